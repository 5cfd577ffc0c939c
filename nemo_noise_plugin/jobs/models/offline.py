"""A recipe's pretrained model as an offline folder: the jobs wing passes it as ``hf_path`` where it can make one.

A recipe whose ``hf_path`` defaults to a hub id says so (``Recipe.hf_model``); the library builds from whatever it
is given. ``with_offline_model`` wraps such a recipe so that a call without ``hf_path`` gets the folder
``OFFLINE_FOLDERS`` makes for that hub id (SmolLM2-135M-Instruct: ``smollm2_folder.ensure_smollm2_hf``, from its PyPI
wheel, converted once and cached), so the plugin's commands reach no model hub. A call that names ``hf_path`` (a
folder, or the hub id itself) is passed through unchanged, and nothing is made.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nemo_noise_plugin.jobs.models.smollm2_folder import ensure_smollm2_hf
from nemo_noise_plugin.recipes.registry import RECIPES
from nemo_noise_plugin.recipes.smollm2 import SMOLLM2_HF_MODEL

__all__ = ["OFFLINE_FOLDERS", "offline_folder", "with_offline_model"]

OFFLINE_FOLDERS: dict[str, Callable[[], Path]] = {SMOLLM2_HF_MODEL: ensure_smollm2_hf}
"""Hub id -> the function that makes (or finds) its offline Hugging Face folder."""


def offline_folder(name: str) -> str | None:
    """The offline folder of recipe ``name``'s model (made on first use), as a string; None when the recipe takes no
    ``hf_path`` or the jobs wing has no offline copy of its model. Example::

        hf_path = offline_folder("smollm2_135m_noise_sft")   # .../SmolLM2-135M-Instruct-Q4_1-f32
    """
    recipe = RECIPES.get(name)
    make = OFFLINE_FOLDERS.get(recipe.hf_model) if recipe is not None and recipe.hf_model else None
    return None if make is None else str(make())


def with_offline_model(name: str, recipe: Callable[..., Any]) -> Callable[..., Any]:
    """``recipe`` (registered as ``name``) with ``hf_path`` set to ``offline_folder(name)`` when a call gives none;
    ``recipe`` itself when there is no offline folder to give. The wrapper keeps the recipe's signature
    (``inspect.signature`` follows it), so the commands' argument checks see the recipe's own parameters."""
    registered = RECIPES.get(name)
    if registered is None or OFFLINE_FOLDERS.get(registered.hf_model) is None:
        return recipe

    @functools.wraps(recipe)
    def with_folder(*args: Any, **kwargs: Any) -> Any:
        given = inspect.signature(recipe).bind_partial(*args, **kwargs).arguments
        if given.get("hf_path") is None:
            kwargs["hf_path"] = offline_folder(name)
        return recipe(*args, **kwargs)

    return with_folder
