"""The Llama 3.2 1B / Llama 3.1 8B / Qwen3 8B recipes, run offline up to where they need weights: every recipe
builds from Bridge's own SFT recipe with the model's published HF config, converts to the plugin's provider with the
model's architecture, takes Hydra overrides, and survives a YAML round trip (in a subprocess: the hub is read
offline from ``tests/support/hub_configs.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.support.hub_configs import HUB_CONFIGS, write_offline_hub

pytestmark = pytest.mark.slow  # one subprocess that imports Bridge and builds six recipes (about a minute)

MODELS = {
    "llama32_1b": "meta-llama/Llama-3.2-1B",
    "llama31_8b": "meta-llama/Meta-Llama-3.1-8B",
    "qwen3_8b": "Qwen/Qwen3-8B",
}

SCRIPT = textwrap.dedent(
    """
    import json, sys, tempfile, warnings
    warnings.filterwarnings("ignore")
    from nemo_noise_plugin.recipes import RECIPES, recipe_function
    from nemo_noise_plugin.training.overrides import apply_overrides, load_config_yaml

    results = {}
    for name in sys.argv[1:]:
        config = recipe_function(RECIPES[name].path)()
        built = {
            "provider": type(config.model).__name__,
            "hidden": config.model.hidden_size, "layers": config.model.num_layers,
            "heads": config.model.num_attention_heads, "groups": config.model.num_query_groups,
            "ffn": config.model.ffn_hidden_size, "vocab": config.model.vocab_size,
            "tied": config.model.share_embeddings_and_output_weights, "tp": config.model.tensor_model_parallel_size,
            "tokenizer": config.tokenizer.tokenizer_model, "load_weights": hasattr(config.model, "_pre_wrap_hooks"),
        }
        config = apply_overrides(config, ["model.noise.alpha=12.5", "train.train_iters=7", "model.noise.seed=99"])
        with tempfile.TemporaryDirectory() as folder:
            path = folder + "/run_config.yaml"
            config.to_yaml(path)
            loaded = load_config_yaml(path)
        built["round_trip"] = {
            "provider": type(loaded.model).__name__, "alpha": loaded.model.noise.alpha, "seed": loaded.model.noise.seed,
            "train_iters": loaded.train.train_iters, "hidden": loaded.model.hidden_size,
            "kd": None if getattr(loaded.model, "kd", None) is None else loaded.model.kd.kd_weight,
        }
        built["kd"] = None if getattr(config.model, "kd", None) is None else config.model.kd.kd_weight
        results[name] = built
    print("RESULTS " + json.dumps(results))
    """
)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict:
    hf_home = write_offline_hub(tmp_path_factory.mktemp("hf_home"))
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    names = [f"{model}_noise_{mode}" for model in MODELS for mode in ("sft", "distillation")]
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, *names], capture_output=True, text=True, timeout=900, env=env
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("RESULTS ")]
    return json.loads(line.removeprefix("RESULTS "))


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("mode", ["sft", "distillation"])
def test_the_recipe_builds_the_models_architecture_as_the_plugins_provider(built, model, mode):
    recipe = built[f"{model}_noise_{mode}"]
    hf = HUB_CONFIGS[MODELS[model]]
    assert recipe["provider"] == ("NoisyDistillationProvider" if mode == "distillation" else "NoisyGPTModelProvider")
    assert (recipe["hidden"], recipe["layers"], recipe["ffn"]) == (
        hf["hidden_size"], hf["num_hidden_layers"], hf["intermediate_size"]
    )  # fmt: skip
    assert (recipe["heads"], recipe["groups"]) == (hf["num_attention_heads"], hf["num_key_value_heads"])
    assert recipe["vocab"] >= hf["vocab_size"] and recipe["tied"] == hf["tie_word_embeddings"]
    assert recipe["tokenizer"] == MODELS[model]
    assert recipe["tp"] == {"llama32_1b": 1, "llama31_8b": 2, "qwen3_8b": 4}[model]  # Bridge's layouts
    assert (recipe["kd"] is None) == (mode == "sft")


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("mode", ["sft", "distillation"])
def test_overrides_and_the_yaml_round_trip_keep_the_plugin_settings(built, model, mode):
    recipe = built[f"{model}_noise_{mode}"]
    assert recipe["round_trip"] == {
        "provider": recipe["provider"],
        "alpha": 12.5,
        "seed": 99,
        "train_iters": 7,
        "hidden": recipe["hidden"],
        "kd": recipe["kd"],
    }
