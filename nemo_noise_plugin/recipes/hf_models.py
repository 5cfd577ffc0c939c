"""Noise-SFT and noise-distillation recipes for Llama 3.2 1B, Llama 3.1 8B and Qwen3 8B.

Each starts from Megatron-Bridge's own SFT recipe for the model (its AutoBridge provider from the HF checkpoint,
parallelism, optimizer, SQuAD data), so the model and its tested defaults are Bridge's, then converts the provider
with ``noisy_provider_from`` (keeping AutoBridge's hooks) and sets the pretrained checkpoint. They read the model's
HF config from the Hugging Face hub (or the local HF cache) when called.

    nemo llm finetune --factory llama32_1b_noise_distillation checkpoint.pretrained_checkpoint=/ckpt/llama32_1b
"""

from __future__ import annotations

from nemo_noise_plugin.distillation.config import KDConfig
from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.upstream.bridge_imports import import_bridge

BRIDGE_SFT_RECIPES = {
    "llama32_1b": ("megatron.bridge.recipes.llama", "llama32_1b_sft_config"),
    "llama31_8b": ("megatron.bridge.recipes.llama", "llama31_8b_sft_config"),
    "qwen3_8b": ("megatron.bridge.recipes.qwen", "qwen3_8b_sft_config"),
}
"""The Bridge recipe each model's recipes start from."""


def noise_recipe_from_bridge(
    model: str,
    *,
    noise: NoiseConfig | None = None,
    kd: KDConfig | None = None,
    pretrained_checkpoint: str | None = None,
):
    """Bridge's SFT recipe for ``model`` with the plugin's provider (distillation when ``kd`` is given)."""
    from nemo_noise_plugin.providers import noisy_provider_from

    if model not in BRIDGE_SFT_RECIPES:
        raise ValueError(f"model={model!r} is invalid: expected one of {', '.join(BRIDGE_SFT_RECIPES)}.")
    module, function = BRIDGE_SFT_RECIPES[model]
    config = getattr(import_bridge(module), function)()
    config.model = noisy_provider_from(config.model, noise or NoiseConfig(alpha=5.0), kd)
    if pretrained_checkpoint is not None:
        config.checkpoint.pretrained_checkpoint = pretrained_checkpoint
    return config


def llama32_1b_noise_sft_config(pretrained_checkpoint: str | None = None, noise: NoiseConfig | None = None):
    """Llama 3.2 1B noise SFT (1 GPU). Train with ``noise_forward_step``."""
    return noise_recipe_from_bridge("llama32_1b", noise=noise, pretrained_checkpoint=pretrained_checkpoint)


def llama32_1b_noise_distillation_config(
    pretrained_checkpoint: str | None = None, noise: NoiseConfig | None = None, kd: KDConfig | None = None
):
    """Llama 3.2 1B noisy student + clean copy (1 GPU). Train with ``distillation_forward_step``."""
    return noise_recipe_from_bridge(
        "llama32_1b", noise=noise, kd=kd or KDConfig(), pretrained_checkpoint=pretrained_checkpoint
    )


def llama31_8b_noise_sft_config(pretrained_checkpoint: str | None = None, noise: NoiseConfig | None = None):
    """Llama 3.1 8B noise SFT (Bridge's layout: TP=2). Train with ``noise_forward_step``."""
    return noise_recipe_from_bridge("llama31_8b", noise=noise, pretrained_checkpoint=pretrained_checkpoint)


def llama31_8b_noise_distillation_config(
    pretrained_checkpoint: str | None = None, noise: NoiseConfig | None = None, kd: KDConfig | None = None
):
    """Llama 3.1 8B noisy student + clean copy (TP=2). Train with ``distillation_forward_step``."""
    return noise_recipe_from_bridge(
        "llama31_8b", noise=noise, kd=kd or KDConfig(), pretrained_checkpoint=pretrained_checkpoint
    )


def qwen3_8b_noise_sft_config(pretrained_checkpoint: str | None = None, noise: NoiseConfig | None = None):
    """Qwen3 8B noise SFT (Bridge's layout: TP=4). Train with ``noise_forward_step``."""
    return noise_recipe_from_bridge("qwen3_8b", noise=noise, pretrained_checkpoint=pretrained_checkpoint)


def qwen3_8b_noise_distillation_config(
    pretrained_checkpoint: str | None = None, noise: NoiseConfig | None = None, kd: KDConfig | None = None
):
    """Qwen3 8B noisy student + clean copy (TP=4). Train with ``distillation_forward_step``."""
    return noise_recipe_from_bridge(
        "qwen3_8b", noise=noise, kd=kd or KDConfig(), pretrained_checkpoint=pretrained_checkpoint
    )
