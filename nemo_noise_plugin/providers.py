"""Megatron-Bridge model providers for noisy models.

``NoisyGPTModelProvider`` is Bridge's ``GPTModelProvider`` with the noise settings as one more dataclass field, so
everything that configures a Bridge provider (recipes, Hydra-style ``model.noise.alpha=10`` overrides, YAML) reaches
them. ``provide`` builds the plain Megatron-Core model exactly as Bridge does, then makes it noisy on the chunk that
``should_attach_noise`` selects (the first pipeline stage, virtual stage 0).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron.core.models.gpt.gpt_model import GPTModel

from nemo_noise_plugin.bridge_imports import import_bridge
from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.noisy_gpt import make_noisy
from nemo_noise_plugin.utils import should_attach_noise

GPTModelProvider = import_bridge("megatron.bridge.models.gpt_provider").GPTModelProvider

__all__ = ["NoisyGPTModelProvider"]


@dataclass
class NoisyGPTModelProvider(GPTModelProvider):
    """A ``GPTModelProvider`` whose first-stage model chunk adds embedding noise (see ``NoiseConfig``)."""

    noise: NoiseConfig = field(default_factory=NoiseConfig)
    """Embedding-noise settings; validated when set."""

    def provide(self, pre_process=None, post_process=None, vp_stage=None) -> GPTModel:
        """Build one model chunk as ``GPTModelProvider.provide`` does; noisy where ``should_attach_noise`` says."""
        if not isinstance(self.noise, NoiseConfig):
            raise TypeError(
                f"NoisyGPTModelProvider.noise must be a NoiseConfig, got {type(self.noise).__name__}: {self.noise!r}."
            )
        model = super().provide(pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)
        if should_attach_noise(vp_stage):
            make_noisy(model, self.noise)
        return model
