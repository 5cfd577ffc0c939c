"""Megatron's parallel state on gloo CPU process groups, for the CPU main job and the tests.

Everything here is the real Megatron-Core (``parallel_state``, its RNG seeding); only the substitutes in
``jobs.cpu.substitutes`` stand in for CUDA-only pieces, installed by ``init_cpu_parallel``.
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist

from nemo_noise_plugin.jobs.cpu.substitutes import install_cpu_substitutes

__all__ = ["causal_attention_mask", "destroy_cpu_parallel", "free_port", "init_cpu_parallel"]


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


def causal_attention_mask(sequence_length: int) -> torch.Tensor:
    """Megatron's ``[1, 1, s, s]`` boolean causal mask (True = masked out)."""
    return torch.triu(torch.ones(sequence_length, sequence_length, dtype=torch.bool), diagonal=1).view(
        1, 1, sequence_length, sequence_length
    )
