"""``NoisyGPTModel``: a Megatron-Core ``GPTModel`` with embedding noise on its first pipeline stage."""

from __future__ import annotations

from typing import Any

from megatron.core.models.gpt.gpt_model import GPTModel

from nemo_noise_plugin.model.mixin import NoiseInjectionMixin
from nemo_noise_plugin.noise.config import NoiseConfig

__all__ = ["NoisyGPTModel"]


class NoisyGPTModel(NoiseInjectionMixin, GPTModel):
    """A Megatron-Core ``GPTModel`` whose first pipeline stage adds embedding noise to its decoder input.

    Takes ``GPTModel``'s arguments plus ``noise_config``; its state dict and checkpoints are a ``GPTModel``'s.
    """

    def __init__(self, *args: Any, noise_config: NoiseConfig | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.init_noise(noise_config if noise_config is not None else NoiseConfig())
