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

__all__ = ["RECIPES", "REPORTS", "Recipe", "recipe_function"]

REPORTS = ("task", "privacy_audit", "robustness")
"""The reports a recipe may name: ``task`` (held-out exact match and the HF export, for instruction data),
``privacy_audit`` (the embedding-inversion audit at each evaluation, ``<run>/privacy_audit/privacy_audit.jsonl``) and
``robustness`` (loss and KL under noise before and after training; it finishes the report folder). The jobs wing
builds them (``jobs.reports.callbacks``); a recipe only names them."""


@dataclass(frozen=True)
class Recipe:
    """A registered recipe: where its function lives and where it can run."""

    path: str
    """``module:function`` returning a ``ConfigContainer``."""
    embedded_corpus: bool = False
    """Trains on data shipped with the package (the tiny recipes' corpus, the SmolLM2 recipes' instruction set): runs
    on the CPU loop without a GPU, and is one of the main job's ``--recipe`` choices. The SmolLM2 model itself comes
    from the package index (``data.smollm2_wheel.ensure_smollm2_hf``), converted once and cached."""
    reports: tuple[str, ...] = ()
    """The reports a run of this recipe writes (names from ``REPORTS``), under ``nemo llm finetune`` and the main job
    alike; empty: none. The jobs wing builds their callbacks."""
    clean_pretrain_steps: int = 0
    """Steps of clean training (noise and KD off) the main job runs first, for recipes that start from random weights
    but distil from a teacher copied from the start: the tiny distillation recipe's teacher is then a trained model.
    Only the main job reads it: ``nemo llm finetune`` trains what it is given."""

    def __post_init__(self) -> None:
        unknown = [name for name in self.reports if name not in REPORTS]
        if unknown or len(set(self.reports)) != len(self.reports):
            raise ValueError(f"reports={self.reports!r} is invalid: expected distinct names from {REPORTS}.")


_HF_MODELS = ("llama32_1b", "llama31_8b", "qwen3_8b")

RECIPES: dict[str, Recipe] = {
    "tiny_noise_sft": Recipe(
        "nemo_noise_plugin.recipes.tiny:tiny_noise_sft_config", embedded_corpus=True, reports=("robustness",)
    ),
    "tiny_noise_distillation": Recipe(
        "nemo_noise_plugin.recipes.tiny:tiny_noise_distillation_config",
        embedded_corpus=True,
        reports=("robustness",),
        clean_pretrain_steps=100,
    ),
    "smollm2_135m_noise_sft": Recipe(
        "nemo_noise_plugin.recipes.smollm2:smollm2_135m_noise_sft_config",
        embedded_corpus=True,
        reports=("task", "robustness"),
    ),
    "smollm2_135m_noise_distillation": Recipe(
        "nemo_noise_plugin.recipes.smollm2:smollm2_135m_noise_distillation_config",
        embedded_corpus=True,
        reports=("task", "robustness"),
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
