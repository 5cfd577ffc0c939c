"""The CPU substitutes: every replacement of a CUDA-only piece that tests and the CPU main job need.

Megatron-Core assumes a GPU in a few places that have no CPU counterpart. Each substitute below stands in for one
such piece and nothing else; ``CPU_SUBSTITUTES`` names them all, and the README lists them. They are installed
only by an explicit ``install_cpu_substitutes()`` call (tests, the CPU main job, which announces it), never on
import and never by the shipped package's own code paths. The fine-grained schedule plan's stand-ins (streams,
events) are the tests' own: ``tests/support/schedule_plan_substitutes.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

CPU_SUBSTITUTES: dict[str, str] = {
    "torch.cuda.current_device": "returns 'cpu', so Megatron's GlobalMemoryBuffer and similar allocations land on "
    "the CPU through Megatron's own code",
    "torch.Tensor.cuda": "returns the tensor itself (on the CPU), for Megatron-Bridge's batch fetch, which moves "
    "every batch to the GPU",
    "torch.cuda.synchronize": "a no-op (nothing runs asynchronously on the CPU), for Megatron's checkpoint writers",
    "megatron.core.tensor_parallel.random CUDA RNG tracker": "CpuRNGStatesTracker keeps named CPU generator states "
    "and forks the CPU RNG instead of the CUDA one",
    "megatron.core.tensor_parallel.random._get_cuda_rng_state / _set_cuda_rng_state": "read and restore the CPU "
    "generator state, so activation recompute (CheckpointFunction) replays its RNG on the CPU",
}

_installed = False


class _CpuTrackerMixin:
    """CUDA RNG tracker semantics (named states, ``fork`` swaps the active state) on the CPU generator."""

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"cuda rng state {name} already exists")
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        if name not in self.states_:
            raise Exception(f"cuda rng state {name} is not added")
        original = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(original)


def install_cpu_substitutes() -> None:
    """Install the CPU substitutes (idempotent). Only for machines without CUDA."""
    global _installed
    if _installed:
        return
    if torch.cuda.is_available():
        raise RuntimeError("install_cpu_substitutes() is for machines without CUDA; this one has a GPU.")
    from megatron.core.tensor_parallel import random as megatron_random

    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *args, **kwargs: None  # type: ignore[assignment]
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]

    base = megatron_random.CudaRNGStatesTracker
    tracker_class = type("CpuRNGStatesTracker", (_CpuTrackerMixin, base), {})
    megatron_random._CUDA_RNG_STATE_TRACKER = tracker_class()
    megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    megatron_random._get_cuda_rng_state = lambda *args, clone=False, **kwargs: torch.get_rng_state()
    megatron_random._set_cuda_rng_state = lambda new_state, *args, **kwargs: torch.set_rng_state(new_state)
    _installed = True
