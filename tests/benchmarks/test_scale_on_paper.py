"""The arithmetic of ``benchmarks/scale_on_paper.py`` against numbers worked out by hand."""

from __future__ import annotations

import pytest

from benchmarks import scale_on_paper


def test_one_layout_matches_the_hand_arithmetic():
    row = scale_on_paper.layout_row(8.03e9, 4096, 8, 8192, 1, 128, (2, 2, True), mfu=0.4)
    assert (row["dp"], row["m"]) == (2, 64)  # 8 GPUs / (2 x 2); 128 sequences / (2 x 1)
    t_mb = 6 * 8.03e9 * 8192 / (2 * 2 * 0.4 * 989e12)
    assert row["t_mb"] == pytest.approx(t_mb)
    assert row["t_step"] == pytest.approx((64 + 2 - 1) * t_mb)  # the pipeline bubble adds PP - 1 micro-batches
    assert row["nbytes"] == 4 * 8192 * 4096 / 2  # sequence parallel: each TP rank holds s / TP rows
    assert row["noise"]["uniform"] == pytest.approx(64 * row["nbytes"] * 40.4e-6 / 134.2e6)


def test_the_gaussian_kernel_is_slower_than_the_uniform_at_every_measured_width():
    for hidden in scale_on_paper.MEASURED:
        assert scale_on_paper.bandwidth(hidden, gaussian=True) < scale_on_paper.bandwidth(hidden)
