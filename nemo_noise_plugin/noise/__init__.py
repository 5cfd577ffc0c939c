"""Noise math and random streams for embedding-noise training.

Importing the package is cheap (no torch): the noise layer is loaded on first access.
"""

from __future__ import annotations

from typing import Any

from nemo_noise_plugin.noise.config import NoiseConfig

__all__ = ["EmbeddingNoise", "NoiseBatchInputs", "NoiseConfig"]


def __getattr__(name: str) -> Any:
    if name in ("EmbeddingNoise", "NoiseBatchInputs"):
        from nemo_noise_plugin.noise import layer

        return getattr(layer, name)
    raise AttributeError(f"module 'nemo_noise_plugin.noise' has no attribute {name!r}")
