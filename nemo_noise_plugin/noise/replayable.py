"""Noise that a CUDA graph can replay: the step's noise keys and the overflow check live in device memory.

A CUDA graph (Megatron-Core's ``FullCudaGraphWrapper``, ``cuda_graph_impl="full_iteration"``) records the kernels of
one step with their arguments and replays them unchanged. The noise kernel's iteration key and the schedule factor
are host numbers in the eager path, so a replay would add the captured step's noise again at every step. In the
replayable path (``EmbeddingNoise(replayable=True)``) the kernel and the per-token scale read them from two
0-dim tensors that ``ReplayableStep.publish`` fills outside the graph before each step; the noise of every
(iteration, sample, position) is the eager path's (the same counter contract: only where the key is read from
changes).

The once-per-iteration finiteness check is split the same way: inside the graph, ``record_overflow`` keeps the first
overflowing iteration in a device flag (device ops only); outside it, ``raise_overflow`` copies the flag to pinned
host memory without waiting and raises for the answer of an earlier call once its event has passed (two steps late
on the GPU, at once on a CPU).
"""

from __future__ import annotations

from typing import Any

import torch

from nemo_noise_plugin.noise.bounds import noise_overflowed, overflow_error
from nemo_noise_plugin.noise.schedule import schedule_factor

__all__ = ["ReplayableStep"]

_INT64_MAX = 2**63 - 1


def _indexed(device: torch.device | str) -> torch.device:
    """``device`` with its index (``cuda`` -> ``cuda:<current>``), as a tensor's ``.device`` names it."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class ReplayableStep:
    """The current step's noise keys in device memory (``iteration`` int64, ``factor`` float32, both 0-dim) and the
    first overflowing iteration plus one (``overflow_at``, 0: none yet).

    The tensors are made on the first ``publish`` and keep their storage from then on, so a graph captured after it
    reads whatever a later ``publish`` wrote. A copy (``copy.deepcopy``: the distillation teacher, the schedule plan)
    starts empty: it makes its own tensors on its first ``publish``.
    """

    def __init__(self) -> None:
        self.iteration: torch.Tensor | None = None
        self.factor: torch.Tensor | None = None
        self.overflow_at: torch.Tensor | None = None
        self.published: int | None = None
        self._queued: list[tuple[torch.Tensor, Any]] = []

    def __deepcopy__(self, memo: dict) -> ReplayableStep:
        return ReplayableStep()

    def __getstate__(self) -> dict:
        return ReplayableStep().__dict__

    def holds(self, iteration: int, device: torch.device) -> bool:
        """Whether the device keys on ``device`` hold ``iteration``."""
        on_device = self.iteration is not None and self.iteration.device == _indexed(device)
        return on_device and self.published == iteration

    def publish(self, config: Any, iteration: int, device: torch.device) -> None:
        """Write ``iteration`` and its schedule factor (``config``'s schedule) into the device keys, unless they hold
        it already; outside any graph capture (a fill inside one would be frozen into the graph)."""
        if isinstance(iteration, bool) or not isinstance(iteration, int) or not 0 <= iteration <= _INT64_MAX:
            raise ValueError(f"ReplayableStep.publish: iteration={iteration!r} must be an integer in [0, 2**63).")
        device = _indexed(device)
        if self.holds(iteration, device):
            return
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"the replayable noise keys hold iteration {self.published}, not {iteration}, inside a CUDA graph "
                "capture: call publish_noise_step() (ReplayableStep.publish) before capturing and before each replay."
            )
        if self.iteration is None or self.iteration.device != device:
            self.iteration = torch.zeros((), dtype=torch.int64, device=device)
            self.factor = torch.zeros((), dtype=torch.float32, device=device)
            self.overflow_at = torch.zeros((), dtype=torch.int64, device=device)
            self._queued = []
        self.iteration.fill_(iteration)  # a fill kernel with the value as its argument: no copy, no sync
        self.factor.fill_(schedule_factor(config, iteration))
        self.published = iteration

    def record_overflow(self, noised: torch.Tensor, clean: torch.Tensor) -> None:
        """Keep the published iteration (plus one) in ``overflow_at`` if ``noised`` overflowed while ``clean`` did
        not and no earlier iteration did: device operations only, so a graph can replay it."""
        if self.overflow_at is None:
            raise RuntimeError("record_overflow before publish: the replayable noise keys were never published.")
        first = (self.overflow_at == 0) & noise_overflowed(noised, clean)
        self.overflow_at.copy_(torch.where(first, self.iteration + 1, self.overflow_at))

    def raise_overflow(self, config: Any) -> None:
        """``SettingError`` naming the first overflowing iteration once it is known on the host; outside a graph.

        CPU flags are read at once. On the GPU each call copies the flag to pinned memory without waiting and reads
        the copies of earlier calls whose events have passed (``Event.query`` never waits): called once per step, a
        run stops two steps after the overflow (its next step copies the flag, the one after reads it).
        """
        if self.overflow_at is None:
            return
        if not self.overflow_at.is_cuda:
            overflow_at = int(self.overflow_at)
            if overflow_at:
                raise overflow_error(config, overflow_at - 1)
            return
        waiting, overflow_at = [], 0
        for answer, arrived in self._queued:
            if not arrived.query():
                waiting.append((answer, arrived))
            elif int(answer) and not overflow_at:
                overflow_at = int(answer)
        self._queued = waiting
        if overflow_at:
            raise overflow_error(config, overflow_at - 1)
        answer = torch.empty((), dtype=torch.int64, pin_memory=True)
        answer.copy_(self.overflow_at, non_blocking=True)
        arrived = torch.cuda.Event()
        arrived.record()
        self._queued.append((answer, arrived))
