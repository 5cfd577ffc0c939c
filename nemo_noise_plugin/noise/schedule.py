"""The noise clock and the scale schedule: which iteration and microbatch a forward belongs to, and how loud.

The noise is keyed by the training iteration and by each sample's index in the iteration's global batch, so the
model must know both. ``NoiseClock`` counts noised forwards: after ``num_microbatches`` of them the iteration
advances. A training loop that knows its iteration (Megatron-Bridge's ``train_state.step``, restored from the
checkpoint on resume) calls ``start_iteration`` each step, which also makes the clock exact after a resume; a loop
that does not can save ``state_dict()`` in its checkpoint. The schedule is a pure function of the iteration, so the
iteration is all the state it has.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from nemo_noise_plugin.noise.config import NoiseConfig


def schedule_factor(config: NoiseConfig, iteration: int) -> float:
    """The scale factor in [0, 1] at ``iteration``: linear warm-up, then constant, linear or cosine decay."""
    if iteration < config.warmup_steps:
        return (iteration + 1) / config.warmup_steps
    if config.schedule == "constant":
        return 1.0
    progress = min(1.0, (iteration - config.warmup_steps) / config.decay_steps)
    if config.schedule == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return config.min_factor + (1.0 - config.min_factor) * shape


def current_num_microbatches() -> int:
    """Megatron's number of microbatches per iteration, or 1 when its calculator is not initialised."""
    try:
        from megatron.core import num_microbatches_calculator as calculator
    except ImportError:
        return 1
    if calculator._GLOBAL_NUM_MICROBATCHES_CALCULATOR is None:
        return 1
    return int(calculator.get_num_microbatches())


@dataclass
class NoiseClock:
    """The (iteration, microbatch) that the next noised forward belongs to."""

    iteration: int = 0
    microbatch: int = 0

    def start_iteration(self, iteration: int) -> None:
        """Synchronise with the training loop at the start of ``iteration`` (before its first microbatch)."""
        if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 0:
            raise ValueError(f"NoiseClock.start_iteration: iteration={iteration!r} must be an integer >= 0.")
        self.iteration, self.microbatch = iteration, 0

    def advance(self, num_microbatches: int | None = None) -> None:
        """Move past one microbatch; after the last microbatch of the iteration, to the next iteration."""
        per_iteration = current_num_microbatches() if num_microbatches is None else num_microbatches
        self.microbatch += 1
        if self.microbatch >= per_iteration:
            self.iteration, self.microbatch = self.iteration + 1, 0

    def state_dict(self) -> dict[str, Any]:
        """The clock as plain integers, for a checkpoint's common (non-sharded) state."""
        return {"iteration": self.iteration, "microbatch": self.microbatch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a clock saved by ``state_dict``."""
        missing = {"iteration", "microbatch"} - set(state)
        if missing:
            raise ValueError(f"noise clock state is missing {', '.join(sorted(missing))}: got keys {sorted(state)}.")
        self.iteration, self.microbatch = int(state["iteration"]), int(state["microbatch"])
