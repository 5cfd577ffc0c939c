"""nemo-noise-plugin: embedding-noise training (NEFTune, Gaussian, privacy noise) for Megatron-Core and Bridge.

Importing the package is cheap (no torch): the helpers and the noisy model are loaded on first access.
"""

from __future__ import annotations

from typing import Any

from nemo_noise_plugin.noise.config import NoiseConfig, load_noise_config
from nemo_noise_plugin.upstream.bridge_imports import install_bridge_import_hook

install_bridge_import_hook()  # `import megatron.bridge` after this works without Transformer Engine

__version__ = "0.1.0"

__all__ = [
    "NoiseConfig",
    "NoisyGPTModel",
    "deepcopy_module_with_process_groups",
    "freeze_module",
    "load_noise_config",
    "make_noisy",
    "should_attach_noise",
]

_LAZY = {
    "NoisyGPTModel": "nemo_noise_plugin.model.gpt",
    "make_noisy": "nemo_noise_plugin.model.make_noisy",
    "deepcopy_module_with_process_groups": "nemo_noise_plugin.utils",
    "freeze_module": "nemo_noise_plugin.utils",
    "should_attach_noise": "nemo_noise_plugin.utils",
}
"""Names loaded on first access: they need torch (and the model, megatron-core)."""


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'nemo_noise_plugin' has no attribute {name!r}")
