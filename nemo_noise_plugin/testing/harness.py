"""Tiny Megatron-Core GPT models on gloo process groups, for tests and the CPU main job.

Everything here is the real Megatron-Core (parallel_state, GPTModel, local layer spec); only the substitutes in
``cpu_substitutes`` stand in for CUDA-only pieces.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import torch
import torch.distributed as dist

from nemo_noise_plugin.testing.cpu_substitutes import install_cpu_substitutes


def free_port() -> int:
    """A free TCP port on the loopback interface, for a gloo rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_cpu_parallel(
    *,
    rank: int = 0,
    world_size: int = 1,
    port: int | None = None,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int | None = None,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    seed: int = 1234,
) -> None:
    """Initialise torch.distributed (gloo) and Megatron's parallel state on the CPU, then seed its RNGs."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    install_cpu_substitutes()
    if not dist.is_initialized():
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port if port is not None else free_port())
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
        context_parallel_size=context_parallel_size,
        expert_model_parallel_size=expert_model_parallel_size,
    )
    model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)


def destroy_cpu_parallel() -> None:
    """Tear down Megatron's parallel state and the default process group."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


TINY_CPU_TRANSFORMER_SETTINGS: dict[str, Any] = dict(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    use_cpu_initialization=True,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    bias_dropout_fusion=False,
    gradient_accumulation_fusion=False,
    apply_rope_fusion=False,
    masked_softmax_fusion=False,
    bias_activation_fusion=False,
    persist_layer_norm=False,
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


def causal_attention_mask(sequence_length: int) -> torch.Tensor:
    """Megatron's ``[1, 1, s, s]`` boolean causal mask (True = masked out)."""
    return torch.triu(torch.ones(sequence_length, sequence_length, dtype=torch.bool), diagonal=1).view(
        1, 1, sequence_length, sequence_length
    )
