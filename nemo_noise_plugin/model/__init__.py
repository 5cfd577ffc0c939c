"""The noisy model: Megatron-Core GPT and hybrid models that add embedding noise to the first stage's decoder input.

``mixin`` holds the hook (``NoiseInjectionMixin``), ``gpt`` and ``hybrid`` the model classes, ``make_noisy`` the
in-place conversion of models built elsewhere (e.g. by a Megatron-Bridge provider), ``sdpa_attention`` the local
spec's core attention on PyTorch's fused kernels (the providers' ``core_attention="sdpa"``).
"""

from nemo_noise_plugin.model.gpt import NoisyGPTModel
from nemo_noise_plugin.model.hybrid import NoisyHybridModel
from nemo_noise_plugin.model.make_noisy import make_noisy, make_plain, plain_class_of
from nemo_noise_plugin.model.mixin import NoiseInjectionMixin

__all__ = ["NoiseInjectionMixin", "NoisyGPTModel", "NoisyHybridModel", "make_noisy", "make_plain", "plain_class_of"]
