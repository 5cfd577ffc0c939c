"""Tiny Megatron-Core GPT models for tests and benchmarks (the real GPTModel on the local layer spec).

The gloo process-group set-up and the CPU substitutes they run on come from the package (``jobs.cpu``),
which the CPU main job uses too; they are re-exported here for the tests.
"""

from __future__ import annotations

from typing import Any

import torch

from nemo_noise_plugin.jobs.cpu import causal_attention_mask, destroy_cpu_parallel, free_port, init_cpu_parallel
from nemo_noise_plugin.recipes.tiny import CUDA_FREE_SETTINGS

__all__ = [
    "TINY_CPU_TRANSFORMER_SETTINGS",
    "build_tiny_gpt",
    "causal_attention_mask",
    "destroy_cpu_parallel",
    "free_port",
    "init_cpu_parallel",
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
        position_embedding_type="rope",
        **model_kwargs,
    )
