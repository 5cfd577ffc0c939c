"""Noise math and random streams for embedding-noise training."""

from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.noise.layer import EmbeddingNoise, NoiseBatchInputs

__all__ = ["EmbeddingNoise", "NoiseBatchInputs", "NoiseConfig"]
