"""Tiny Megatron-Core GPT models and corpus batches for CPU benchmarks and tests (the real GPTModel, local spec).

The benchmarks import them from here and the tests through ``tests/support/models.py`` (benchmarks never import
``tests/``). The gloo process-group set-up and the CPU substitutes they run on come from the package
(``jobs.cpu``), which the CPU main job uses too; they are re-exported here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from nemo_noise_plugin.jobs.cpu import causal_attention_mask, destroy_cpu_parallel, free_port, init_cpu_parallel
from nemo_noise_plugin.recipes.common import CUDA_FREE_SETTINGS

__all__ = [
    "PAD_TOKEN",
    "TINY_CPU_TRANSFORMER_SETTINGS",
    "LanguageModelingBatch",
    "build_tiny_gpt",
    "causal_attention_mask",
    "destroy_cpu_parallel",
    "free_port",
    "init_cpu_parallel",
    "sample_padded_batch",
    "tiny_gpt_config",
]


TINY_CPU_TRANSFORMER_SETTINGS: dict[str, Any] = dict(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    use_cpu_initialization=True,
    **CUDA_FREE_SETTINGS,
)
"""A small transformer with dropout and the CUDA-only fusions off; shared by configs and Bridge providers."""


def tiny_gpt_config(**overrides: Any):
    """A small fp32 ``TransformerConfig`` for CPU runs (dropout off, CPU initialisation)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(**{**TINY_CPU_TRANSFORMER_SETTINGS, "params_dtype": torch.float32, **overrides})


def build_tiny_gpt(
    config=None,
    *,
    vocab_size: int = 256,
    max_sequence_length: int = 64,
    model_class: type | None = None,
    pre_process: bool = True,
    post_process: bool = True,
    **model_kwargs: Any,
):
    """A GPT model on Megatron-Core's local (non-Transformer-Engine) layer spec."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    config = config if config is not None else tiny_gpt_config()
    model_class = model_class if model_class is not None else GPTModel
    return model_class(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        pre_process=pre_process,
        post_process=post_process,
        **{"position_embedding_type": "rope", **model_kwargs},
    )


PAD_TOKEN = 0
"""The padding token of ``sample_padded_batch``."""


@dataclass
class LanguageModelingBatch:
    """One Megatron-style batch: ``[b, s]`` tokens, shifted labels, loss mask (0 on padding) and positions."""

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor


def sample_padded_batch(
    corpus: torch.Tensor, batch_size: int, sequence_length: int, generator: torch.Generator, min_length: int
) -> LanguageModelingBatch:
    """Random windows of random true length in ``[min_length, sequence_length]``, right-padded, as in SFT."""
    if not 2 <= min_length <= sequence_length < corpus.numel():
        raise ValueError(
            f"sequence_length={sequence_length} and min_length={min_length} must satisfy "
            f"2 <= min_length <= sequence_length < corpus size ({corpus.numel()})."
        )
    tokens = torch.full((batch_size, sequence_length), PAD_TOKEN, dtype=torch.long)
    labels = torch.full((batch_size, sequence_length), PAD_TOKEN, dtype=torch.long)
    loss_mask = torch.zeros(batch_size, sequence_length)
    for row in range(batch_size):
        length = int(torch.randint(min_length, sequence_length + 1, (1,), generator=generator))
        start = int(torch.randint(0, corpus.numel() - length - 1, (1,), generator=generator))
        window = corpus[start : start + length + 1]
        tokens[row, :length] = window[:-1]
        labels[row, :length] = window[1:]
        loss_mask[row, :length] = 1.0
    position_ids = torch.arange(sequence_length).unsqueeze(0).expand(batch_size, -1)
    return LanguageModelingBatch(tokens, labels, loss_mask, position_ids)
