"""The CPU substitutes: every replacement of a CUDA-only piece that tests and the CPU main job need.

Megatron-Core assumes a GPU in a few places that have no CPU counterpart. Each substitute below stands in for one
such piece and nothing else; ``CPU_SUBSTITUTES`` names them all, and the README lists them. They are installed
only by an explicit ``install_cpu_substitutes()`` call (tests, the CPU main job, which announces it), never on
import and never by the shipped package's own code paths.
"""

from __future__ import annotations

import contextlib
import types
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

SCHEDULE_PLAN_SUBSTITUTES: dict[str, str] = {
    "torch.cuda.Stream / torch.cuda.Event / torch.cuda.current_stream / torch.cuda.stream": "CpuStream and "
    "CpuEvent, which do nothing: on the CPU every operation has finished when it returns, so the schedule plan's "
    "stream waits and event records have nothing to order",
    "torch.Tensor.record_stream": "a no-op (there is no caching allocator to tell about other streams)",
    "megatron.core.pipeline_parallel.schedules: torch.zeros(device='cuda')": "allocates on the CPU: the "
    "schedules create their token counter with a literal 'cuda' device (the module's own torch.zeros only)",
    "megatron.core.transformer.moe.token_dispatcher.maybe_move_tensor_to_cpu": "also converts CPU tensors to "
    "numpy when asked to (as_numpy=True), as it does for CUDA tensors, so the all-to-all split sizes have the type "
    "the dispatcher expects",
}
"""Installed on top of ``CPU_SUBSTITUTES`` by ``install_schedule_plan_substitutes()``, for the fine-grained plan."""

_installed = False
_plan_installed = False


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


class CpuEvent:
    """``torch.cuda.Event`` on the CPU: recording and waiting are no-ops (work is done when a CPU op returns)."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class CpuStream:
    """``torch.cuda.Stream`` on the CPU: one ordered stream of work, so every wait is already satisfied."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    @staticmethod
    def priority_range() -> tuple[int, int]:
        return 0, -1

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def record_event(self, event=None) -> CpuEvent:
        return event if event is not None else CpuEvent()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


_CPU_STREAM = CpuStream()


def install_schedule_plan_substitutes() -> None:
    """Install ``SCHEDULE_PLAN_SUBSTITUTES`` (and ``CPU_SUBSTITUTES``), for running the fine-grained schedule plan."""
    global _plan_installed
    install_cpu_substitutes()
    if _plan_installed:
        return
    import numpy
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    torch.cuda.Stream = CpuStream  # type: ignore[misc,assignment]
    torch.cuda.Event = CpuEvent  # type: ignore[misc,assignment]
    torch.cuda.current_stream = lambda *args, **kwargs: _CPU_STREAM  # type: ignore[assignment]
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()  # type: ignore[assignment]
    torch.Tensor.record_stream = lambda self, stream: None  # type: ignore[method-assign]
    upstream = moe_utils.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy() if not isinstance(tensor, numpy.ndarray) else tensor
        return upstream(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    from megatron.core.pipeline_parallel import schedules

    schedules.torch = _TorchAllocatingOnCpu("torch")
    _plan_installed = True


class _TorchAllocatingOnCpu(types.ModuleType):
    """``torch`` as Megatron's ``pipeline_parallel.schedules`` sees it: ``zeros(device="cuda")`` is a CPU tensor."""

    def __getattr__(self, name: str):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        return torch.zeros(*args, device="cpu" if str(device).startswith("cuda") else device, **kwargs)
