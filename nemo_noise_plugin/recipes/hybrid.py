"""The tiny hybrid recipes: the tiny recipes on Megatron-Core's ``HybridModel`` (``GPTModel``'s successor).

``tiny_hybrid_noise_sft`` and ``tiny_hybrid_noise_distillation`` are ``tiny_noise_sft`` and
``tiny_noise_distillation`` with the plugin's hybrid providers (``providers.hybrid``) in place of the GPT ones: the
same corpus, data pipeline, sizes, optimizer and checkpoints (``tiny.small_gpt_config``), and a hybrid stack of
attention (``*``) and MLP (``-``) layers, ``TINY_HYBRID_PATTERN``, on Megatron-Core's local modules
(``providers.hybrid.local_hybrid_stack_spec``), so they run wherever megatron-core does, the CPU loop included.
The stack has no final norm (``HybridStack`` builds it with Transformer Engine only).

``tiny_mamba_hybrid_noise_sft`` adds Mamba layers (``TINY_MAMBA_PATTERN``) on Bridge's default hybrid stack spec
(Transformer Engine, mamba_ssm, causal_conv1d): GPU only; ``providers.hybrid.mamba_kernels_missing`` says why it
cannot build here when it cannot.

    from megatron.bridge.training.finetune import finetune
    from nemo_noise_plugin.training.forward_step import noise_forward_step
    from nemo_noise_plugin.recipes.hybrid import tiny_hybrid_noise_sft_config

    finetune(tiny_hybrid_noise_sft_config(train_iters=50), noise_forward_step)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from nemo_noise_plugin.recipes.common import (
    CUDA_FREE_SETTINGS,
    bf16_settings,
    default_kd,
)
from nemo_noise_plugin.recipes.registry import register_recipe
from nemo_noise_plugin.recipes.tiny import TINY_MODEL, student_config

if TYPE_CHECKING:
    from nemo_noise_plugin.distillation.config import KDConfig
    from nemo_noise_plugin.noise.config import NoiseConfig

__all__ = [
    "TINY_HYBRID_PATTERN",
    "TINY_MAMBA_PATTERN",
    "tiny_hybrid_noise_distillation_config",
    "tiny_hybrid_noise_sft_config",
    "tiny_mamba_hybrid_noise_sft_config",
]

TINY_HYBRID_PATTERN = "*-*-*-*-"
"""The tiny GPT's four transformer layers as hybrid layers: attention, MLP, four times."""

TINY_MAMBA_PATTERN = "M*-M*-"
"""Mamba, attention, MLP, twice."""


def _hybrid_settings(seq_length: int, pattern: str, *, local: bool) -> dict:
    """The tiny GPT's sizes (``TINY_MODEL`` without ``num_layers``: the pattern sets it) as hybrid-provider fields."""
    from megatron.core.transformer.enums import AttnBackend

    from nemo_noise_plugin.data.corpus import CORPUS_VOCAB_SIZE

    sizes = {name: value for name, value in TINY_MODEL.items() if name != "num_layers"}
    settings: dict[str, Any] = dict(
        **sizes,
        **CUDA_FREE_SETTINGS,
        hybrid_layer_pattern=pattern,
        position_embedding_type="rope",
        vocab_size=CORPUS_VOCAB_SIZE,
        seq_length=seq_length,
        make_vocab_size_divisible_by=128,
        **bf16_settings(),
    )
    if local:
        from nemo_noise_plugin.providers.hybrid import local_hybrid_stack_spec

        settings.update(hybrid_stack_spec=local_hybrid_stack_spec, attention_backend=AttnBackend.local)
    return settings


def _tiny_hybrid_config(
    dir: str | None, name: str, *, pattern: str, local: bool, noise: NoiseConfig | None, kd: KDConfig | None = None,
    **run: Any,
):  # fmt: skip
    """The tiny hybrid model as the plugin's hybrid provider (a noisy student of its clean copy with ``kd``)."""
    from nemo_noise_plugin.providers.hybrid import NoisyHybridDistillationProvider, NoisyHybridModelProvider

    providers = (NoisyHybridModelProvider, NoisyHybridDistillationProvider)
    settings = _hybrid_settings(run["seq_length"], pattern, local=local)
    return student_config(providers, settings, dir, name, noise=noise, kd=kd, **run)


@register_recipe("tiny_hybrid_noise_sft", embedded_corpus=True, reports=("robustness",))
def tiny_hybrid_noise_sft_config(
    dir: str | None = None,
    name: str = "tiny_hybrid_noise_sft",
    train_iters: int = 40,
    seq_length: int = 128,
    lr: float = 3e-4,
    noise: NoiseConfig | None = None,
    data: str = "corpus",
    pattern: str = TINY_HYBRID_PATTERN,
):
    """Noisy fine-tuning of the tiny hybrid model (attention + MLP, local modules). Train with
    ``noise_forward_step``."""
    return _tiny_hybrid_config(
        dir, name, pattern=pattern, local=True, train_iters=train_iters, seq_length=seq_length, lr=lr, data=data,
        noise=noise,
    )  # fmt: skip


@register_recipe(
    "tiny_hybrid_noise_distillation", embedded_corpus=True, reports=("robustness",), clean_pretrain_steps=100
)
def tiny_hybrid_noise_distillation_config(
    dir: str | None = None,
    name: str = "tiny_hybrid_noise_distillation",
    train_iters: int = 40,
    seq_length: int = 128,
    lr: float = 3e-4,
    noise: NoiseConfig | None = None,
    kd: KDConfig | None = None,
    data: str = "corpus",
    pattern: str = TINY_HYBRID_PATTERN,
):
    """Noisy hybrid student + frozen clean copy of itself, CE + forward KL. Train with ``distillation_forward_step``."""
    return _tiny_hybrid_config(
        dir, name, pattern=pattern, local=True, train_iters=train_iters, seq_length=seq_length, lr=lr, data=data,
        noise=noise, kd=default_kd(kd),
    )  # fmt: skip


@register_recipe("tiny_mamba_hybrid_noise_sft", reports=("robustness",))
def tiny_mamba_hybrid_noise_sft_config(
    dir: str | None = None,
    name: str = "tiny_mamba_hybrid_noise_sft",
    train_iters: int = 40,
    seq_length: int = 128,
    lr: float = 3e-4,
    noise: NoiseConfig | None = None,
    data: str = "corpus",
    pattern: str = TINY_MAMBA_PATTERN,
):
    """Noisy fine-tuning of a tiny hybrid model with Mamba layers on Bridge's default (Transformer Engine) hybrid
    spec: needs a GPU with mamba_ssm and causal_conv1d. Train with ``noise_forward_step``."""
    return _tiny_hybrid_config(
        dir, name, pattern=pattern, local=False, train_iters=train_iters, seq_length=seq_length, lr=lr, data=data,
        noise=noise,
    )  # fmt: skip
