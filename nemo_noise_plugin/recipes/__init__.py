"""Megatron-Bridge recipes for noise training: functions returning a ``ConfigContainer``, and their registry.

Named as Bridge's are (``{model}_{size}_{mode}_config``); train with the forward step each recipe's docstring names
(``noise_forward_step`` or ``distillation_forward_step`` from ``nemo_noise_plugin.training.forward_step``).
``RECIPES`` maps each ``--factory`` name of ``nemo llm finetune`` (and ``--recipe`` of the main job) to its recipe;
one entry adds a recipe to every command. Importing this package is cheap: a recipe's module (Bridge, torch) is
imported when the recipe is used.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

__all__ = ["RECIPES", "Recipe", "recipe_function"]


@dataclass(frozen=True)
class Recipe:
    """A registered recipe: where its function lives and where it can run."""

    path: str
    """``module:function`` returning a ``ConfigContainer``."""
    embedded_corpus: bool = False
    """Trains on data shipped with the package (the tiny recipes' corpus, the SmolLM2 recipes' instruction set): runs
    on the CPU loop without a GPU and writes the robustness report. The SmolLM2 model itself comes from the package
    index (``pretrained.ensure_smollm2_hf``), converted once and cached."""
    clean_pretrain_steps: int = 0
    """Steps of clean training (noise and KD off) the main job runs first, for recipes that start from random weights
    but distil from a teacher copied from the start: the tiny distillation recipe's teacher is then a trained model."""


_HF_MODELS = ("llama32_1b", "llama31_8b", "qwen3_8b")

RECIPES: dict[str, Recipe] = {
    "tiny_noise_sft": Recipe("nemo_noise_plugin.recipes.tiny:tiny_noise_sft_config", embedded_corpus=True),
    "tiny_noise_distillation": Recipe(
        "nemo_noise_plugin.recipes.tiny:tiny_noise_distillation_config", embedded_corpus=True, clean_pretrain_steps=100
    ),
    "smollm2_135m_noise_sft": Recipe(
        "nemo_noise_plugin.recipes.smollm2:smollm2_135m_noise_sft_config", embedded_corpus=True
    ),
    "smollm2_135m_noise_distillation": Recipe(
        "nemo_noise_plugin.recipes.smollm2:smollm2_135m_noise_distillation_config", embedded_corpus=True
    ),
    **{
        f"{model}_noise_{mode}": Recipe(f"nemo_noise_plugin.recipes.hf_models:{model}_noise_{mode}_config")
        for model in _HF_MODELS
        for mode in ("sft", "distillation")
    },
}
"""``--factory`` name -> recipe."""


def recipe_function(path: str) -> Any:
    """The object at ``package.module:attribute`` (or ``package.module.attribute``)."""
    module_name, sep, attribute = path.partition(":")
    if not sep:
        module_name, _, attribute = path.rpartition(".")
    target = importlib.import_module(module_name)
    for part in attribute.split("."):
        target = getattr(target, part)
    return target


def __getattr__(name: str) -> Any:
    """The recipe functions by name (``recipes.tiny_noise_sft_config``), imported on first use."""
    for recipe in RECIPES.values():
        if recipe.path.endswith(f":{name}"):
            return recipe_function(recipe.path)
    raise AttributeError(f"module 'nemo_noise_plugin.recipes' has no attribute {name!r}")
