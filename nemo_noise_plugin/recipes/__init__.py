"""Megatron-Bridge recipes for noise training: functions returning a ``ConfigContainer``.

Named as Bridge's are (``{model}_{size}_{mode}_config``); train with the forward step each recipe's docstring names
(``noise_forward_step`` or ``distillation_forward_step`` from ``nemo_noise_plugin.forward_step``).
"""

from nemo_noise_plugin.recipes.hf_models import (
    llama31_8b_noise_distillation_config,
    llama31_8b_noise_sft_config,
    llama32_1b_noise_distillation_config,
    llama32_1b_noise_sft_config,
    qwen3_8b_noise_distillation_config,
    qwen3_8b_noise_sft_config,
)
from nemo_noise_plugin.recipes.tiny import tiny_noise_distillation_config, tiny_noise_sft_config

__all__ = [
    "llama31_8b_noise_distillation_config",
    "llama31_8b_noise_sft_config",
    "llama32_1b_noise_distillation_config",
    "llama32_1b_noise_sft_config",
    "qwen3_8b_noise_distillation_config",
    "qwen3_8b_noise_sft_config",
    "tiny_noise_distillation_config",
    "tiny_noise_sft_config",
]
