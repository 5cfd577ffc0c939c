"""NeMo 2 beside the plugin: whether its ``llm.finetune`` is usable here, and the plugin's recipes as its factories.

With ``nemo.collections.llm`` installed and importable, ``cli.nemo_llm`` moves its command to ``nemo noise finetune``
instead of shadowing NeMo's ``llm finetune`` and registers each plugin recipe as a factory of NeMo 2's
``llm.finetune`` (``nemo2_factory``). Cheap to import: nothing is imported from NeMo unless it is installed.
"""

# No ``from __future__ import annotations`` and no ``X | None``, as in ``cli.nemo_llm`` (NeMo-Run's parser).
import importlib.util
import os
from collections.abc import Callable
from typing import Any, Optional

__all__ = ["nemo2_factory", "nemo2_llm_finetune"]


def _nemo2_llm_installed() -> bool:
    """Whether NeMo 2's ``nemo.collections.llm`` package is on the path (found without importing anything)."""
    spec = importlib.util.find_spec("nemo")
    locations = (spec.submodule_search_locations or []) if spec is not None else []
    return any(os.path.isfile(os.path.join(path, "collections", "llm", "__init__.py")) for path in locations)


def nemo2_llm_finetune() -> Optional[Callable]:  # noqa: UP045
    """NeMo 2's ``llm.finetune`` entrypoint when ``nemo.collections.llm`` is installed and imports, else None.

    NeMo 2.x's ``llm`` needs megatron-core 0.16, so next to this plugin (megatron-core 0.19) it usually fails to
    import; then ``nemo`` cannot load NeMo's ``llm`` group either, and the plugin's ``llm finetune`` shadows nothing.
    """
    if not _nemo2_llm_installed():
        return None
    try:
        from nemo.collections.llm import finetune as nemo2_finetune
    except Exception:  # installed but unusable in this environment
        return None
    return nemo2_finetune


def nemo2_factory(finetune: Callable[..., Any], name: str) -> Callable[[], Any]:
    """A factory named ``name`` for NeMo 2's ``llm.finetune``: a ``run.Partial`` of the plugin's ``finetune`` running
    that recipe (``nemo llm finetune --factory NAME`` then runs the plugin's command)."""
    import nemo_run as run

    from nemo_noise_plugin.recipes import RECIPES

    def factory() -> Any:
        return run.Partial(finetune, factory=name)

    factory.__name__ = factory.__qualname__ = name
    factory.__doc__ = f"The plugin's recipe {RECIPES[name].path}, run by nemo_noise_plugin.cli.nemo_llm.finetune."
    return factory
