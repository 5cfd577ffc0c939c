"""The tiny recipes: Bridge ConfigContainers around the plugin's providers that pass Bridge's own validation."""

from __future__ import annotations

import pytest

from nemo_noise_plugin.distillation.config import KDConfig
from nemo_noise_plugin.noise.config import NoiseConfig


@pytest.fixture(scope="module")
def recipes(megatron_cpu):
    from nemo_noise_plugin import recipes

    return recipes


def test_tiny_noise_sft_recipe_is_a_valid_bridge_config_with_a_noisy_provider(recipes, tmp_path):
    from nemo_noise_plugin.providers import NoisyGPTModelProvider

    config = recipes.tiny_noise_sft_config(dir=str(tmp_path), train_iters=10, noise=NoiseConfig(alpha=15.0))
    config.validate()
    assert type(config.model) is NoisyGPTModelProvider
    assert config.model.noise.alpha == 15.0
    assert config.checkpoint.save == str(tmp_path / "tiny_noise_sft" / "checkpoints")
    assert config.train.train_iters == 10


def test_tiny_distillation_recipe_carries_the_kd_settings(recipes, tmp_path):
    from nemo_noise_plugin.providers import NoisyDistillationProvider

    config = recipes.tiny_noise_distillation_config(dir=str(tmp_path), kd=KDConfig(loss="jsd", temperature=2.0))
    config.validate()
    assert type(config.model) is NoisyDistillationProvider
    assert (config.model.kd.loss, config.model.kd.temperature) == ("jsd", 2.0)
    assert config.model.pipeline_model_parallel_size == 1


def test_model_recipes_start_from_bridges_own_sft_recipes(recipes):
    from nemo_noise_plugin.recipes.hf_models import BRIDGE_SFT_RECIPES
    from nemo_noise_plugin.upstream.bridge_imports import import_bridge

    assert set(BRIDGE_SFT_RECIPES) == {"llama32_1b", "llama31_8b", "qwen3_8b"}
    for module, function in BRIDGE_SFT_RECIPES.values():
        assert callable(getattr(import_bridge(module), function)), f"{module}.{function}"
    for model in BRIDGE_SFT_RECIPES:
        for mode in ("sft", "distillation"):
            assert callable(getattr(recipes, f"{model}_noise_{mode}_config"))


def test_unknown_model_recipe_is_a_clear_error(recipes):
    from nemo_noise_plugin.recipes.hf_models import noise_recipe_from_bridge

    with pytest.raises(ValueError, match="model='llama4' is invalid: expected one of llama32_1b, llama31_8b, qwen3_8b"):
        noise_recipe_from_bridge("llama4")
