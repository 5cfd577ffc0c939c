"""The recipe registry (issue 24): recipes registered by ``@register_recipe`` where they are defined, a cheap import
of the registry, the old public names, and every recipe's ``ConfigContainer`` unchanged by the move.

``tests/recipes/recipe_configs.json`` was written by ``tests/support/recipe_snapshot.py`` from the recipes before the
move (commit 42e330f: a central ``RECIPES`` dict of string paths, the ``ConfigContainer`` assembly written out in
``tiny.py`` and ``smollm2.py``); the test builds the same calls now and compares.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from nemo_noise_plugin import recipes
from nemo_noise_plugin.recipes import RECIPES, Recipe, recipe_function, register_recipe, registry

REPO = Path(__file__).resolve().parents[2]
SNAPSHOT = REPO / "tests" / "recipes" / "recipe_configs.json"

FACTORIES = [
    "tiny_noise_sft",
    "tiny_noise_distillation",
    "smollm2_135m_noise_sft",
    "smollm2_135m_noise_distillation",
    "llama32_1b_noise_sft",
    "llama32_1b_noise_distillation",
    "llama31_8b_noise_sft",
    "llama31_8b_noise_distillation",
    "qwen3_8b_noise_sft",
    "qwen3_8b_noise_distillation",
]
"""Every ``--factory`` name before the move, in ``RECIPES``' order then (the main job's ``--recipe`` order)."""

HYBRID_FACTORIES = ["tiny_hybrid_noise_sft", "tiny_hybrid_noise_distillation", "tiny_mamba_hybrid_noise_sft"]
"""The tiny recipes on ``HybridModel`` (issue 35), registered after them (``recipes/hybrid.py``)."""

PRIVATE_FACTORIES = ["smollm2_135m_private_span_sft", "smollm2_135m_gist_sft"]
"""The SmolLM2 private-task recipes (issue 33), registered last (``recipes/smollm2_private.py``)."""


def _environment() -> dict[str, str]:
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": str(REPO) if not path else f"{REPO}{os.pathsep}{path}"}


def test_importing_the_registry_and_listing_the_recipes_loads_neither_torch_nor_megatron():
    script = textwrap.dedent(
        """
        import sys
        from nemo_noise_plugin.recipes import RECIPES
        names = [(name, recipe.path, recipe.embedded_corpus, recipe.reports) for name, recipe in RECIPES.items()]
        heavy = sorted({m.split(".")[0] for m in sys.modules if m.split(".")[0] in
                        ("torch", "megatron", "transformer_engine", "transformers", "numpy", "nemo_run")})
        families = sorted(m for m in sys.modules if m.startswith("nemo_noise_plugin.recipes."))
        print(len(names), heavy, families)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=_environment()
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == (
        "15 [] ['nemo_noise_plugin.recipes.common', 'nemo_noise_plugin.recipes.hf_models', "
        "'nemo_noise_plugin.recipes.hybrid', 'nemo_noise_plugin.recipes.registry', "
        "'nemo_noise_plugin.recipes.smollm2', 'nemo_noise_plugin.recipes.smollm2_private', "
        "'nemo_noise_plugin.recipes.tiny']"
    )


def test_every_factory_name_is_registered_in_the_old_order_by_its_definition():
    assert list(RECIPES) == FACTORIES + HYBRID_FACTORIES + PRIVATE_FACTORIES
    for name, recipe in RECIPES.items():
        function = recipe_function(recipe.path)
        assert function is recipe.function is getattr(recipes, f"{name}_config")  # the attribute access of old
        assert function.__name__ == f"{name}_config"  # Bridge's canonical names stay the function names
        module, _, qualname = recipe.path.partition(":")
        assert (function.__module__, function.__qualname__) == (module, qualname)
    assert recipes.RECIPES is registry.RECIPES and recipes.Recipe is Recipe
    assert RECIPES["tiny_noise_distillation"] == Recipe(
        "nemo_noise_plugin.recipes.tiny:tiny_noise_distillation_config",
        embedded_corpus=True,
        reports=("robustness",),
        clean_pretrain_steps=100,
    )
    assert RECIPES["qwen3_8b_noise_sft"] == Recipe("nemo_noise_plugin.recipes.hf_models:qwen3_8b_noise_sft_config")
    with pytest.raises(AttributeError, match="has no attribute 'nope_config'"):
        recipes.nope_config  # noqa: B018


def test_the_shared_pieces_live_in_common_and_each_family_exports_only_its_own():
    from nemo_noise_plugin.recipes import common, hf_models, smollm2, tiny
    from nemo_noise_plugin.recipes.hf_models import BRIDGE_SFT_RECIPES, llama32_1b_noise_sft_config
    from nemo_noise_plugin.recipes.smollm2 import instruction_finetuning_config, smollm2_provider

    shared = set(common.__all__)
    assert {"CUDA_FREE_SETTINGS", "local_spec_settings", "recipe_run_dir"} <= shared
    for family in (tiny, smollm2, hf_models):
        assert not shared & set(family.__all__), family.__name__  # no re-export of common's pieces
    assert callable(tiny.small_gpt_config) and callable(instruction_finetuning_config) and callable(smollm2_provider)
    assert llama32_1b_noise_sft_config is RECIPES["llama32_1b_noise_sft"].function
    assert set(BRIDGE_SFT_RECIPES) == {"llama32_1b", "llama31_8b", "qwen3_8b"}


@pytest.fixture
def scratch_registry():
    """Registrations made by the test are removed afterwards."""
    before = dict(RECIPES)
    yield RECIPES
    RECIPES.clear()
    RECIPES.update(before)


def my_model_noise_sft_config(dir: str | None = None):
    """A stand-in recipe at module level."""
    return dir


def test_the_decorator_registers_the_function_where_it_is_defined_and_returns_it(scratch_registry):
    decorated = register_recipe("my_model_noise_sft", reports=("robustness",))(my_model_noise_sft_config)
    assert decorated is my_model_noise_sft_config
    assert RECIPES["my_model_noise_sft"] == Recipe(f"{__name__}:my_model_noise_sft_config", reports=("robustness",))
    assert RECIPES["my_model_noise_sft"].function is my_model_noise_sft_config
    register_recipe("my_model_noise_sft", reports=("robustness",))(my_model_noise_sft_config)  # a module reloaded
    assert list(RECIPES).count("my_model_noise_sft") == 1


def test_the_decorator_refuses_what_no_command_could_resolve(scratch_registry):
    def local_config():
        return None

    with pytest.raises(ValueError, match="is not a module-level function"):
        register_recipe("local")(local_config)
    with pytest.raises(ValueError, match="already registered for nemo_noise_plugin.recipes.tiny:tiny_noise_sft_config"):
        register_recipe("tiny_noise_sft")(my_model_noise_sft_config)
    with pytest.raises(ValueError, match="reports=\\('nope',\\) is invalid"):
        register_recipe("my_model_noise_sft", reports=("nope",))(my_model_noise_sft_config)
    with pytest.raises(ValueError, match="name='my model' is invalid"):
        register_recipe("my model")
    assert "local" not in RECIPES and RECIPES["tiny_noise_sft"].path.endswith(":tiny_noise_sft_config")
    assert "my_model_noise_sft" not in RECIPES


@pytest.mark.slow
def test_every_recipe_builds_the_config_it_built_before_the_registry_moved(tmp_path):
    """Each registered recipe (and a few with arguments) as plain data, against the snapshot taken before."""
    out = tmp_path / "now.json"
    result = subprocess.run(
        [sys.executable, str(REPO / "tests" / "support" / "recipe_snapshot.py"), str(out), str(tmp_path / "work")],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=REPO,
        env=_environment(),
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    now, before = json.loads(out.read_text()), json.loads(SNAPSHOT.read_text())
    assert sorted(now) == sorted(before)
    for label in before:
        differences = list(_differences(before[label], now[label], label))
        assert not differences, "\n".join(differences[:20])
    assert out.read_text() == SNAPSHOT.read_text()  # byte for byte, as written


def _differences(before, now, where: str):
    if isinstance(before, dict) and isinstance(now, dict):
        for key in sorted(set(before) | set(now)):
            if key not in now or key not in before:
                yield f"{where}.{key}: {'missing now' if key not in now else 'new'}"
            else:
                yield from _differences(before[key], now[key], f"{where}.{key}")
    elif before != now:
        yield f"{where}: {before!r} -> {now!r}"
