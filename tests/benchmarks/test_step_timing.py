"""The step-time method of the benchmarks (``benchmarks/step_timing.py``): interleaving, pairing and the spread."""

from __future__ import annotations

import pytest

from benchmarks.step_timing import (
    bootstrap_interval,
    format_ratio,
    measure_interleaved,
    ratio_summary,
    repeat_medians,
    rotated_order,
)


def test_the_order_rotates_so_no_mode_always_runs_first():
    names = ["a", "b", "c"]
    orders = [rotated_order(names, repeat) for repeat in range(3)]
    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert {order[0] for order in orders} == set(names)


def test_modes_run_interleaved_and_the_first_steps_of_each_slot_are_dropped():
    calls: list[tuple[str, int]] = []

    def runner(name: str, step_time: float):
        def steps(count: int) -> list[float]:
            calls.append((name, count))
            return [10.0] + [step_time] * (count - 1)  # a slow first step after the switch

        return steps

    measured = measure_interleaved({"a": runner("a", 1.0), "b": runner("b", 2.0)}, repeats=3, steps=4, discard=1)
    assert [name for name, _ in calls] == ["a", "b", "b", "a", "a", "b"]
    assert all(count == 4 for _, count in calls)
    assert measured == {"a": [[1.0, 1.0, 1.0]] * 3, "b": [[2.0, 2.0, 2.0]] * 3}


def test_per_repeat_ratios_cancel_a_drift_that_pooled_medians_do_not():
    # The machine slows down 30 % over the run; mode b is always 5 % slower than a in the same repeat.
    drift = [1.0 + 0.05 * repeat for repeat in range(7)]
    a = [[d, d] for d in drift]
    b = [[1.05 * d, 1.05 * d] for d in drift]
    summary = ratio_summary(b, a)
    assert summary["ratio"] == pytest.approx(1.05)
    assert summary["min"] == pytest.approx(1.05) and summary["max"] == pytest.approx(1.05)
    assert summary["ci95_low"] == pytest.approx(1.05) and summary["ci95_high"] == pytest.approx(1.05)


def test_the_interval_holds_the_median_and_widens_with_the_spread():
    tight = [1.00, 1.01, 0.99, 1.00, 1.02, 0.98, 1.00]
    wide = [1.00, 1.10, 0.90, 1.00, 1.20, 0.80, 1.00]
    low, high = bootstrap_interval(tight)
    assert low <= 1.00 <= high
    wide_low, wide_high = bootstrap_interval(wide)
    assert wide_high - wide_low > high - low
    assert bootstrap_interval(tight) == (low, high)  # seeded: the same data give the same interval


def test_the_summary_keeps_every_repeat_and_prints_the_spread():
    summary = ratio_summary([[2.0], [3.0], [2.2]], [[2.0], [2.0], [2.0]])
    assert summary["per_repeat"] == pytest.approx([1.0, 1.5, 1.1])
    assert summary["ratio"] == pytest.approx(1.1)
    assert format_ratio(summary).startswith("1.100x [")
    assert "min 1.000, max 1.500" in format_ratio(summary)
    assert repeat_medians([[1.0, 3.0, 2.0], [5.0]]) == [2.0, 5.0]


def test_bad_settings_and_unpaired_repeats_are_refused():
    with pytest.raises(ValueError, match="steps > discard"):
        measure_interleaved({"a": lambda count: [1.0] * count}, repeats=2, steps=2, discard=2)
    with pytest.raises(ValueError, match="pairs"):
        ratio_summary([[1.0]], [[1.0], [1.0]])
    with pytest.raises(RuntimeError, match="ran 1 steps"):
        measure_interleaved({"a": lambda count: [1.0]}, repeats=1, steps=3, discard=0)
