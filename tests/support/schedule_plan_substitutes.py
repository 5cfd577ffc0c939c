"""The schedule-plan CPU substitutes: what the fine-grained schedule plan needs on a CPU, for the tests only.

Installed on top of the package's ``CPU_SUBSTITUTES`` (``nemo_noise_plugin.jobs.cpu``) by
``install_schedule_plan_substitutes()``; no shipped code path runs the schedule plan on a CPU, so they live here.
"""

from __future__ import annotations

import contextlib
import types

import torch

from nemo_noise_plugin.jobs.cpu.substitutes import install_cpu_substitutes

__all__ = ["SCHEDULE_PLAN_SUBSTITUTES", "CpuEvent", "CpuStream", "install_schedule_plan_substitutes"]

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

_plan_installed = False


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
