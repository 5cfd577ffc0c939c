"""What the recipe families share (Bridge's ``recipes/common.py`` habit): the ConfigContainer, defaults, settings.

The ``ConfigContainer`` a fine-tuning run of the plugin gets (``finetuning_config``), the noise and KD defaults and
their attachment to a provider, the layer-spec and precision settings, and the run folder. Each family module
(``tiny``, ``smollm2``, ``hf_models``) states only what differs: its model, data, tokenizer and sizes.

The module's top imports no torch and no Megatron (``import nemo_noise_plugin.recipes`` stays cheap); every function
imports what it builds with.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.upstream.bridge_imports import import_bridge
from nemo_noise_plugin.validation import check_choice

if TYPE_CHECKING:
    from nemo_noise_plugin.distillation.config import KDConfig

__all__ = [
    "CUDA_FREE_SETTINGS",
    "DEFAULT_NOISE_ALPHA",
    "bf16_settings",
    "default_kd",
    "default_noise",
    "finetuning_config",
    "local_spec_settings",
    "noisy_provider",
    "recipe_run_dir",
]

DEFAULT_NOISE_ALPHA = 5.0
"""The recipes' noise when none is given: NEFTune with alpha 5 (``NoiseConfig(alpha=5.0)``)."""

CUDA_FREE_SETTINGS: dict = dict(
    gradient_accumulation_fusion=False,
    bias_activation_fusion=False,
    bias_dropout_fusion=False,
    masked_softmax_fusion=False,
    persist_layer_norm=False,
    apply_rope_fusion=False,
    cross_entropy_loss_fusion=False,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)
"""Transformer settings without CUDA-only fusions and without dropout (deterministic; runs on a CPU too)."""


def local_spec_settings(attention: str = "unfused") -> dict:
    """Provider settings for Megatron-Core's local layer spec: no Transformer Engine, ``CUDA_FREE_SETTINGS``.

    What the tiny and SmolLM2 recipes, the benchmarks and the CPU tests use, so they run wherever megatron-core does.
    ``attention`` is the plugin provider's ``core_attention`` (``model.sdpa_attention.CORE_ATTENTION``): ``sdpa``
    runs the local spec's attention on PyTorch's fused kernels (flash attention on a GPU), with the same weights;
    the default leaves the field out, so the settings also fit Bridge's own providers.
    """
    from megatron.core.transformer.enums import AttnBackend

    from nemo_noise_plugin.model.sdpa_attention import CORE_ATTENTION

    check_choice("attention", attention, CORE_ATTENTION)
    gpt_provider = import_bridge("megatron.bridge.models.gpt_provider")
    return dict(
        transformer_layer_spec=gpt_provider.local_layer_spec,
        attention_backend=AttnBackend.local,
        **({"core_attention": attention} if attention != "unfused" else {}),
        **CUDA_FREE_SETTINGS,
    )


def bf16_settings() -> dict:
    """Provider settings for bf16 weights and pipeline transfers (``bf16``, ``params_dtype``, ``pipeline_dtype``)."""
    import torch

    return dict(bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16)


def default_noise(noise: NoiseConfig | None) -> NoiseConfig:
    """``noise``, or the recipes' default (NEFTune, ``DEFAULT_NOISE_ALPHA``) when None."""
    return noise or NoiseConfig(alpha=DEFAULT_NOISE_ALPHA)


def default_kd(kd: KDConfig | None) -> KDConfig:
    """``kd``, or ``KDConfig()`` (CE + forward KL from the clean copy) when None: the distillation recipes' default."""
    from nemo_noise_plugin.distillation.config import KDConfig

    return kd or KDConfig()


def noisy_provider(source: Any, noise: NoiseConfig | None = None, kd: KDConfig | None = None) -> Any:
    """``source`` (an AutoBridge or Bridge-recipe provider) as the plugin's provider, hooks kept
    (``providers.noisy_provider_from``): noisy with ``default_noise(noise)``; a noisy student of its clean copy when
    ``kd`` is given."""
    from nemo_noise_plugin.providers.conversion import noisy_provider_from

    return noisy_provider_from(source, default_noise(noise), kd)


def recipe_run_dir(dir: str | None, name: str) -> str:
    """A recipe's run folder: ``dir/name``, by default under ``./nemo_experiments``."""
    return os.path.join(dir if dir is not None else os.path.join(os.getcwd(), "nemo_experiments"), name)


def finetuning_config(
    model: Any,
    *,
    run_dir: str,
    dataset: Any,
    tokenizer: Mapping[str, Any],
    train_iters: int,
    lr: float,
    global_batch_size: int,
    micro_batch_size: int,
    lr_warmup_iters: int,
) -> Any:  # Bridge's ConfigContainer (megatron.bridge is imported only through upstream.bridge_imports)
    """The single-node Bridge ``ConfigContainer`` of the plugin's recipes around ``model``.

    Adam (``lr``, decaying to ``lr / 10`` on a cosine schedule, no weight decay, gradients clipped at 1), bf16, DDP
    with fp32 gradient reduction, validation and checkpoints twice per run (checkpoints under ``run_dir/checkpoints``,
    resumed from there), logging every step, seed 1234.

    Args:
        model: The provider (``config.model``).
        run_dir: The run folder (``recipe_run_dir``); checkpoints go to ``run_dir/checkpoints``.
        dataset: The dataset config (``config.dataset``), built by the family.
        tokenizer: ``TokenizerConfig`` fields, e.g. ``dict(tokenizer_type="NullTokenizer", vocab_size=384)``.
        train_iters: Training steps.
        lr: The peak learning rate.
        global_batch_size: Sequences per step.
        micro_batch_size: Sequences per forward pass.
        lr_warmup_iters: Linear warm-up steps before the cosine decay.

    Returns:
        The ``ConfigContainer``.
    """
    from megatron.core.distributed import DistributedDataParallelConfig

    c = import_bridge("megatron.bridge.training.config")
    tokenizer_config = import_bridge("megatron.bridge.training.tokenizers.config")
    every_half_run = max(train_iters // 2, 1)
    return c.ConfigContainer(
        model=model,
        train=c.TrainingConfig(
            train_iters=train_iters, global_batch_size=global_batch_size, micro_batch_size=micro_batch_size
        ),
        validation=c.ValidationConfig(eval_interval=every_half_run, eval_iters=2),
        optimizer=c.OptimizerConfig(
            optimizer="adam",
            lr=lr,
            min_lr=lr / 10,
            weight_decay=0.0,
            bf16=True,
            use_distributed_optimizer=False,
            clip_grad=1.0,
        ),
        scheduler=c.SchedulerConfig(
            lr_decay_style="cosine",
            lr_warmup_iters=lr_warmup_iters,
            start_weight_decay=0.0,
            end_weight_decay=0.0,
            weight_decay_incr_style="constant",
        ),
        ddp=DistributedDataParallelConfig(use_distributed_optimizer=False, grad_reduce_in_fp32=True),
        dataset=dataset,
        logger=c.LoggerConfig(log_interval=1),
        tokenizer=tokenizer_config.TokenizerConfig(**tokenizer),
        checkpoint=c.CheckpointConfig(
            save=os.path.join(run_dir, "checkpoints"),
            load=os.path.join(run_dir, "checkpoints"),
            save_interval=every_half_run,
            ckpt_format="torch_dist",
        ),
        rng=c.RNGConfig(seed=1234),
    )
