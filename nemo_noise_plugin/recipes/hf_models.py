"""Noise-SFT and noise-distillation recipes for Llama 3.2 1B, Llama 3.1 8B and Qwen3 8B.

Each starts from Megatron-Bridge's own SFT recipe for the model (its AutoBridge provider from the HF checkpoint,
parallelism, optimizer, SQuAD data), so the model and its tested defaults are Bridge's, then converts the provider
with ``noisy_provider_from`` (keeping AutoBridge's hooks) and sets the pretrained checkpoint. They read the model's
HF config from the Hugging Face hub (or the local HF cache) when called.

The recipes are made and registered in a loop over ``BRIDGE_SFT_RECIPES``: per model, ``{model}_noise_sft_config``
and ``{model}_noise_distillation_config`` (``--factory {model}_noise_sft`` / ``{model}_noise_distillation``). A model
is one entry there and one in ``MODEL_DESCRIPTIONS``.

    nemo llm finetune --factory llama32_1b_noise_distillation checkpoint.pretrained_checkpoint=/ckpt/llama32_1b
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from nemo_noise_plugin.recipes.common import default_kd, noisy_provider
from nemo_noise_plugin.recipes.registry import register_recipe
from nemo_noise_plugin.upstream.bridge_imports import import_bridge
from nemo_noise_plugin.validation import check_choice

if TYPE_CHECKING:
    from nemo_noise_plugin.distillation.config import KDConfig
    from nemo_noise_plugin.noise.config import NoiseConfig

BRIDGE_SFT_RECIPES = {
    "llama32_1b": ("megatron.bridge.recipes.llama", "llama32_1b_sft_config"),
    "llama31_8b": ("megatron.bridge.recipes.llama", "llama31_8b_sft_config"),
    "qwen3_8b": ("megatron.bridge.recipes.qwen", "qwen3_8b_sft_config"),
}
"""The Bridge recipe each model's recipes start from."""

MODEL_DESCRIPTIONS = {
    "llama32_1b": ("Llama 3.2 1B", "1 GPU"),
    "llama31_8b": ("Llama 3.1 8B", "Bridge's layout: TP=2"),
    "qwen3_8b": ("Qwen3 8B", "Bridge's layout: TP=4"),
}
"""Each model's name and layout, for its recipes' docstrings."""


def noise_recipe_from_bridge(
    model: str,
    *,
    noise: NoiseConfig | None = None,
    kd: KDConfig | None = None,
    pretrained_checkpoint: str | None = None,
):
    """Bridge's SFT recipe for ``model`` with the plugin's provider (distillation when ``kd`` is given)."""
    check_choice("model", model, tuple(BRIDGE_SFT_RECIPES))
    module, function = BRIDGE_SFT_RECIPES[model]
    config = getattr(import_bridge(module), function)()
    config.model = noisy_provider(config.model, noise, kd)
    if pretrained_checkpoint is not None:
        config.checkpoint.pretrained_checkpoint = pretrained_checkpoint
    return config


def _sft_recipe(model: str) -> Callable[..., Any]:
    def recipe(pretrained_checkpoint: str | None = None, noise: NoiseConfig | None = None):
        return noise_recipe_from_bridge(model, noise=noise, pretrained_checkpoint=pretrained_checkpoint)

    title, layout = MODEL_DESCRIPTIONS[model]
    recipe.__doc__ = f"{title} noise SFT ({layout}). Train with ``noise_forward_step``."
    return recipe


def _distillation_recipe(model: str) -> Callable[..., Any]:
    def recipe(pretrained_checkpoint: str | None = None, noise: NoiseConfig | None = None, kd: KDConfig | None = None):
        kd = default_kd(kd)
        return noise_recipe_from_bridge(model, noise=noise, kd=kd, pretrained_checkpoint=pretrained_checkpoint)

    title, layout = MODEL_DESCRIPTIONS[model]
    recipe.__doc__ = f"{title} noisy student + clean copy ({layout}). Train with ``distillation_forward_step``."
    return recipe


__all__ = ["BRIDGE_SFT_RECIPES", "MODEL_DESCRIPTIONS", "noise_recipe_from_bridge"]

for _model in BRIDGE_SFT_RECIPES:
    for _mode, _make in (("sft", _sft_recipe), ("distillation", _distillation_recipe)):
        _function = _make(_model)
        _function.__name__ = _function.__qualname__ = f"{_model}_noise_{_mode}_config"  # Bridge's naming
        globals()[_function.__name__] = register_recipe(f"{_model}_noise_{_mode}")(_function)
        __all__.append(_function.__name__)
del _model, _mode, _make, _function
