"""Megatron-Bridge recipes for noise training: functions returning a ``ConfigContainer``, and their registry.

Named as Bridge's are (``{model}_{size}_{mode}_config``); train with the forward step each recipe's docstring names
(``noise_forward_step`` or ``distillation_forward_step`` from ``nemo_noise_plugin.training.forward_step``).
Each recipe is registered where it is defined, by ``@register_recipe(name, ...)`` (``registry``), in ``RECIPES``:
``--factory`` name of ``nemo llm finetune`` (and ``--recipe`` of the main job) -> ``Recipe``; one decorated function
adds a recipe to every command. What the families share is ``common``; ``tiny``, ``smollm2``, ``hf_models`` and
``hybrid`` (the tiny recipes on Megatron-Core's ``HybridModel``) state what differs. Importing this package imports
those modules to register their recipes, and is cheap: their tops load no torch and no Megatron, a recipe imports
Bridge and torch when it is called.
"""

from __future__ import annotations

from typing import Any

from nemo_noise_plugin.recipes.registry import RECIPES, REPORTS, Recipe, recipe_function, register_recipe

# The family modules register their recipes when imported; this order is RECIPES' order (the main job's --recipe
# choices): the tiny recipes, SmolLM2, the HF models, the tiny hybrid recipes, the SmolLM2
# private-task recipes.
# isort: off
from nemo_noise_plugin.recipes import tiny
from nemo_noise_plugin.recipes import smollm2
from nemo_noise_plugin.recipes import hf_models
from nemo_noise_plugin.recipes import hybrid
from nemo_noise_plugin.recipes import smollm2_private
# isort: on

__all__ = [
    "RECIPES",
    "REPORTS",
    "Recipe",
    "hf_models",
    "hybrid",
    "recipe_function",
    "register_recipe",
    "smollm2",
    "smollm2_private",
    "tiny",
]


def __getattr__(name: str) -> Any:
    """The recipe functions by name (``recipes.tiny_noise_sft_config``)."""
    for recipe in RECIPES.values():
        if recipe.path.endswith(f":{name}"):
            return recipe_function(recipe.path)
    raise AttributeError(f"module 'nemo_noise_plugin.recipes' has no attribute {name!r}")
