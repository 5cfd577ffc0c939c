"""The one place that imports Megatron-Bridge, so it imports on machines without Transformer Engine.

``import megatron.bridge`` hard-imports Transformer Engine through Bridge's LoRA-layer module
(``megatron.bridge.peft.lora_layers``), although Bridge lists TE as optional, and ``megatron.bridge.training.pretrain``
imports ``nvidia_resiliency_ext.inprocess``, whose wheels that megatron-core accepts (>= 0.6) need glibc 2.39.
When (and only when) such a package is missing, the module that needs it is substituted by one whose classes
raise a clear error if used. Transformer Engine itself is never faked: megatron-core would then believe TE
exists. With both packages installed (a NeMo container), nothing is substituted.

Every other module of the plugin gets Bridge through ``import_bridge``. Importing the package installs
``BridgeImportHook`` (``install_bridge_import_hook``), so a user script may also write
``import nemo_noise_plugin`` and then ``from megatron.bridge import AutoBridge``: the substitutes are put in place
when Bridge is first imported, not before (importing the plugin alone changes nothing else).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
import warnings
from typing import Any

LORA_LAYERS_MODULE = "megatron.bridge.peft.lora_layers"
NVRX_PACKAGE = "nvidia_resiliency_ext"
NVRX_INPROCESS_MODULE = "nvidia_resiliency_ext.inprocess"

_LORA_LAYER_CLASSES = ("LoRALinear", "LoRATopKRouter", "TEFusedLoRALinear", "LinearAdapter")
_NVRX_INPROCESS_CLASSES = ("CallWrapper", "Wrapper", "Compose")

SUBSTITUTED_MODULES: list[str] = []
"""Modules replaced in this process (empty until ``ensure_bridge_importable`` runs; empty with TE and NVRx)."""


class MissingDependencyError(ImportError):
    """Raised when a feature that needs a substituted (absent) package is used."""


class MissingDependencyAttributeError(AttributeError):
    """A substituted module's missing attribute (the message says which package it needs): an ``AttributeError``, so
    ``hasattr``, ``getattr`` with a default and the object walks of pickling (torch.compile's cache keys, which
    visit every module a compiled function's globals reach) treat it as absent instead of failing."""


def _package_missing(name: str) -> bool:
    if name in sys.modules and name not in SUBSTITUTED_MODULES:
        return False
    try:
        return importlib.util.find_spec(name) is None
    except (ImportError, ValueError):
        return True


def _unavailable_class(module_name: str, class_name: str, reason: str) -> type:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        raise MissingDependencyError(f"{module_name}.{class_name} is unavailable: {reason}")

    return type(class_name, (), {"__init__": __init__, "__module__": module_name})


def _substitute_module(name: str, class_names: tuple[str, ...], reason: str, *, package: bool = False) -> None:
    module = types.ModuleType(name, f"Substitute installed by nemo_noise_plugin: {reason}")
    module.__file__ = None
    for class_name in class_names:
        setattr(module, class_name, _unavailable_class(name, class_name, reason))

    def __getattr__(attribute: str) -> Any:
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        raise MissingDependencyAttributeError(f"{name}.{attribute} is unavailable: {reason}")

    module.__getattr__ = __getattr__  # type: ignore[method-assign]
    if package:
        module.__path__ = []  # a package with no submodules: imports of its submodules fail normally
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent in sys.modules:
        setattr(sys.modules[parent], child, module)
    SUBSTITUTED_MODULES.append(name)


def ensure_bridge_importable() -> list[str]:
    """Substitute the modules Bridge cannot import on this machine (idempotent); return the substituted names."""
    if SUBSTITUTED_MODULES or LORA_LAYERS_MODULE in sys.modules:
        return list(SUBSTITUTED_MODULES)
    reasons = []
    if _package_missing("transformer_engine"):
        reason = (
            "Transformer Engine is not installed; Megatron-Bridge's LoRA layers need it "
            "(nemo_noise_plugin does not use them). Install transformer_engine for LoRA/PEFT."
        )
        _substitute_module(LORA_LAYERS_MODULE, _LORA_LAYER_CLASSES, reason)
        reasons.append(f"{LORA_LAYERS_MODULE} (transformer_engine missing)")
    if _package_missing(NVRX_INPROCESS_MODULE):
        reason = (
            "nvidia-resiliency-ext is not installed (megatron-core needs >= 0.6, whose wheels need glibc 2.39); "
            "in-process restart and fault tolerance are unavailable."
        )
        if _package_missing(NVRX_PACKAGE):
            _substitute_module(NVRX_PACKAGE, (), reason, package=True)
        _substitute_module(NVRX_INPROCESS_MODULE, _NVRX_INPROCESS_CLASSES, reason)
        reasons.append(f"{NVRX_PACKAGE}.inprocess (nvidia-resiliency-ext missing)")
    if reasons:
        warnings.warn(
            "nemo_noise_plugin substituted modules so Megatron-Bridge imports here: " + "; ".join(reasons) + ".",
            stacklevel=2,
        )
    return list(SUBSTITUTED_MODULES)


class BridgeImportHook:
    """A ``sys.meta_path`` finder that runs ``ensure_bridge_importable`` when Megatron-Bridge is first imported.

    It finds nothing itself (the normal finders import Bridge) and removes itself after its first use.
    """

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> None:
        """On the first import of ``megatron.bridge`` (or a submodule), put the substitutes in place."""
        if fullname == "megatron.bridge" or fullname.startswith("megatron.bridge."):
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            ensure_bridge_importable()
        return None


def install_bridge_import_hook() -> None:
    """Make a later ``import megatron.bridge`` (by anyone) import on this machine; idempotent, imports nothing."""
    if "megatron.bridge" in sys.modules:
        return
    if not any(isinstance(finder, BridgeImportHook) for finder in sys.meta_path):
        sys.meta_path.insert(0, BridgeImportHook())


def import_bridge(module_name: str = "megatron.bridge") -> types.ModuleType:
    """Import a Megatron-Bridge module (``megatron.bridge`` or a submodule) after ``ensure_bridge_importable``."""
    if module_name != "megatron.bridge" and not module_name.startswith("megatron.bridge."):
        raise ValueError(f"import_bridge: {module_name!r} is not a megatron.bridge module.")
    ensure_bridge_importable()
    return importlib.import_module(module_name)


def use_prebuilt_dataset_helpers() -> bool:
    """Let Bridge's ``initialize_megatron`` use megatron-core's prebuilt dataset helper instead of running ``make``.

    megatron-core wheels ship the C++ dataset index helper compiled (``megatron.core.datasets.helpers_cpp``) and no
    Makefile, yet Bridge 0.6.2 calls ``compile_helpers()`` (``make -C .../datasets``) at start-up and exits when it
    fails. When the prebuilt helper imports and there is nothing to build, that call is skipped; a source checkout
    with a Makefile is left alone. Returns True when the build step was skipped.
    """
    import importlib
    import importlib.util
    import os

    if importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is None:
        return False
    datasets = importlib.import_module("megatron.core.datasets")
    if os.path.exists(os.path.join(os.path.dirname(datasets.__file__), "Makefile")):
        return False
    initialize = import_bridge("megatron.bridge.training.initialize")
    initialize.compile_helpers = lambda: None
    return True
