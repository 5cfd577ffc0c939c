"""The one measurement method of the step-time benchmarks: interleaved repeats in one process, ratios with a spread.

Every mode runs in the same process on the same device. A *repeat* runs each mode for a few steps (a *slot*), in
an order that rotates from repeat to repeat (ABC, BCA, CAB, ...) so that no mode always follows the same one; the
first steps of each slot are dropped (caches, allocator and clocks settle after a switch) and the slot's median is
that repeat's value for the mode. A mode's ratio to the baseline is computed per repeat (the two slots of one
repeat ran seconds apart, so slow drifts of the machine cancel) and summarised by the median of those per-repeat
ratios with their min-max and a bootstrap 95 % interval of the median. A control mode (the baseline again, on its
own copy) gives the method's resolution on the machine of the day: a ratio is only read as a difference when it
lies outside the control's interval.

    repeats = measure_interleaved({"plain": plain.steps, "noise": noise.steps}, repeats=7, steps=8, discard=2)
    summary = ratio_summary(repeats["noise"], repeats["plain"])
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Mapping

StepRunner = Callable[[int], list[float]]  # runs that many steps, returns each step's wall time in seconds


def rotated_order(names: list[str], repeat: int) -> list[str]:
    """The order of the modes in repeat ``repeat`` (0-based): rotated by one place per repeat."""
    shift = repeat % len(names)
    return names[shift:] + names[:shift]


def measure_interleaved(
    runners: Mapping[str, StepRunner], repeats: int, steps: int, discard: int
) -> dict[str, list[list[float]]]:
    """Run every mode ``repeats`` times for ``steps`` steps in rotating order; keep every step after ``discard``.

    Returns, per mode, one list of step times (seconds) per repeat.
    """
    if repeats < 1 or steps <= discard or discard < 0:
        raise ValueError(
            f"need repeats >= 1 and steps > discard >= 0, got repeats={repeats}, steps={steps}, discard={discard}"
        )
    names = list(runners)
    measured: dict[str, list[list[float]]] = {name: [] for name in names}
    for repeat in range(repeats):
        for name in rotated_order(names, repeat):
            times = runners[name](steps)
            if len(times) != steps:
                raise RuntimeError(f"mode {name!r} ran {len(times)} steps, asked for {steps}")
            measured[name].append(list(times[discard:]))
    return measured


def repeat_medians(repeats: list[list[float]]) -> list[float]:
    """Each repeat's median step time."""
    return [statistics.median(times) for times in repeats]


def bootstrap_interval(values: list[float], resamples: int = 10_000, seed: int = 0) -> tuple[float, float]:
    """A percentile bootstrap 95 % interval of the median of ``values``."""
    generator = random.Random(seed)
    medians = sorted(statistics.median(generator.choices(values, k=len(values))) for _ in range(resamples))
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def ratio_summary(mode: list[list[float]], baseline: list[list[float]]) -> dict[str, float | list[float]]:
    """The mode's step time over the baseline's: median of the per-repeat ratios, min, max, bootstrap 95 % interval."""
    if len(mode) != len(baseline):
        raise ValueError(f"the two modes ran {len(mode)} and {len(baseline)} repeats; ratios need pairs")
    ratios = [a / b for a, b in zip(repeat_medians(mode), repeat_medians(baseline), strict=True)]
    low, high = bootstrap_interval(ratios)
    return {
        "ratio": statistics.median(ratios),
        "min": min(ratios),
        "max": max(ratios),
        "ci95_low": low,
        "ci95_high": high,
        "per_repeat": ratios,
    }


def format_ratio(summary: Mapping[str, float | list[float]]) -> str:
    """``1.004x [0.998, 1.011] (min 0.995, max 1.02)``: the median ratio, its 95 % interval, min and max."""
    return (
        f"{summary['ratio']:.3f}x [{summary['ci95_low']:.3f}, {summary['ci95_high']:.3f}] "
        f"(min {summary['min']:.3f}, max {summary['max']:.3f})"
    )


def median_ms(repeats: list[list[float]]) -> float:
    """The median over repeats of each repeat's median step time, in milliseconds."""
    return 1000.0 * statistics.median(repeat_medians(repeats))
