"""nemo-noise-plugin: embedding-noise training (NEFTune, Gaussian, privacy noise) for Megatron-Core and Bridge.

Importing the package is cheap: the noisy model, which needs megatron-core, is loaded on first access.
"""

from __future__ import annotations

from typing import Any

from nemo_noise_plugin.noise.config import NoiseConfig, load_noise_config
from nemo_noise_plugin.utils import deepcopy_module_with_process_groups, freeze_module, should_attach_noise

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
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'nemo_noise_plugin' has no attribute {name!r}")
