"""Watching the training steps: one progress line per step, and a stop on a loss that is not finite.

``ProgressLine`` prints the LM loss, the KD loss and tokens/s; ``FiniteLossGuard`` stops the run with
``NonFiniteLossError`` naming the step and the loss. Both are Megatron-Bridge callbacks, so they act the same in
Bridge's training loop (GPU) and in the CPU loop (which fires the same callback events). Under pipelining the loss
exists on the last stage only; the last rank prints it.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from nemo_noise_plugin.upstream.bridge_imports import import_bridge

__all__ = ["FiniteLossGuard", "NonFiniteLossError", "ProgressLine", "format_progress_header", "format_progress_line"]

Callback = import_bridge("megatron.bridge.training.callbacks").Callback


def format_progress_header() -> str:
    """The column titles above the progress lines."""
    return f"{'step':>9} {'loss':>9} {'kd loss':>9} {'tokens/s':>9}"


def format_progress_line(step: int, steps: int, losses: dict[str, float], tokens_per_second: float) -> str:
    """``step/steps``, ``lm loss``, ``kd loss`` (``-`` without one) and tokens/s, aligned under the header."""
    kd = f"{losses['kd loss']:>9.4f}" if "kd loss" in losses else f"{'-':>9}"
    counter = f"{step}/{steps}"
    return f"{counter:>9} {losses.get('lm loss', float('nan')):>9.4f} {kd} {tokens_per_second:>9.0f}"


def _is_last_rank() -> bool:
    if not torch.distributed.is_initialized():
        return True
    return torch.distributed.get_rank() == torch.distributed.get_world_size() - 1


class ProgressLine(Callback):
    """Prints ``format_progress_line`` after every training step (Bridge callback)."""

    def __init__(self) -> None:
        self.step_started = 0.0

    def on_train_start(self, context: Any) -> None:
        if _is_last_rank():
            print(format_progress_header(), flush=True)

    def on_train_step_start(self, context: Any) -> None:
        self.step_started = time.perf_counter()

    def on_train_step_end(self, context: Any) -> None:
        elapsed = time.perf_counter() - self.step_started
        train = context.state.cfg.train
        losses = {key: float(value) for key, value in (context.loss_dict or {}).items()}
        tokens = train.global_batch_size * context.state.cfg.model.seq_length
        if losses and _is_last_rank():
            # Bridge counts the step after this event: train_state.step is still the 0-based index of this one.
            line = format_progress_line(context.state.train_state.step + 1, train.train_iters, losses, tokens / elapsed)
            print(line, flush=True)


class NonFiniteLossError(RuntimeError):
    """A training step produced a NaN or infinite loss; the message names the step and the loss."""


class FiniteLossGuard(Callback):
    """Stops training at the first step whose reported losses are not all finite (Bridge callback)."""

    def on_train_step_end(self, context: Any) -> None:
        for name, value in (context.loss_dict or {}).items():
            number = float(value)
            if not math.isfinite(number):
                step = context.state.train_state.step + 1
                raise NonFiniteLossError(
                    f"step {step}: {name} = {number}; training stopped (check the learning rate and the noise / KD "
                    "settings, e.g. model.kd.temperature > 0)."
                )
