"""The robustness report sweeps the trained mechanism's own noise level, around the level it was trained with, and
says at each level whether the noise-trained model beats its control (a paired t-interval over held-out batches)."""

from __future__ import annotations

import json
import math

import pytest

from nemo_noise_plugin.jobs.reports.artifacts import RunReport
from nemo_noise_plugin.jobs.reports.robustness import (
    REPORT_MULTIPLES,
    noise_at_scale,
    scale_field,
    sweep_scales,
    write_report,
)
from nemo_noise_plugin.jobs.reports.robustness_statistics import (
    RobustnessPoint,
    compare_to_control,
    paired_difference,
    summarize_comparison,
    t_quantile,
)
from nemo_noise_plugin.noise.config import NoiseConfig, load_noise_config
from nemo_noise_plugin.noise.families import NOISE_FAMILIES


def test_the_default_neftune_sweep_is_alpha_around_the_trained_alpha():
    noise = NoiseConfig(alpha=10.0)
    assert scale_field(noise) == "alpha"
    assert sweep_scales(noise) == [0.0, 2.5, 5.0, 10.0, 20.0, 40.0]


@pytest.mark.parametrize(
    ("noise", "field", "trained"),
    [
        (NoiseConfig(mechanism="quantization", quantization_step=0.02), "quantization_step", 0.02),
        (NoiseConfig(mechanism="gaussian", sigma=3.0), "sigma", 3.0),
        (NoiseConfig(mechanism="relative", relative_scale=0.2), "relative_scale", 0.2),
    ],
)
def test_other_mechanisms_sweep_their_own_setting(noise, field, trained):
    assert scale_field(noise) == field
    scales = sweep_scales(noise)
    assert scales == pytest.approx([trained * multiple for multiple in REPORT_MULTIPLES])
    swept = noise_at_scale(noise, scales[-1])
    assert swept.mechanism == noise.mechanism and getattr(swept, field) == pytest.approx(4 * trained)


@pytest.mark.parametrize("mechanism", ["uniform", "gaussian"])
def test_under_embedding_distance_scaling_the_sweep_varies_distance_multiple(mechanism):
    """Issue 36, finding 10: the report swept alpha or sigma, which this scaling does not use (six equal rows)."""
    noise = NoiseConfig(mechanism=mechanism, scaling="embedding_distance", embedding_distance=0.8, distance_multiple=2)
    assert scale_field(noise) == "distance_multiple"
    scales = sweep_scales(noise)
    assert scales == pytest.approx([2.0 * multiple for multiple in REPORT_MULTIPLES])
    assert [noise_at_scale(noise, scale).magnitude for scale in scales[1:]] == pytest.approx(scales[1:])


def test_privacy_mechanisms_sweep_the_reciprocal_of_their_budget_so_the_axis_grows_with_the_noise():
    dp = NoiseConfig(mechanism="gaussian_mechanism", clip_norm=1.0, epsilon=8.0)
    assert scale_field(dp) == "1/epsilon"
    scales = sweep_scales(dp)
    assert scales[3] == pytest.approx(1 / 8.0)
    assert noise_at_scale(dp, scales[4]).epsilon == pytest.approx(4.0)  # twice the noise level: half the epsilon
    assert noise_at_scale(dp, scales[4]).dp_sigma > dp.dp_sigma
    metric = NoiseConfig(mechanism="metric_dp", eta=100.0)
    assert scale_field(metric) == "1/eta" and noise_at_scale(metric, sweep_scales(metric)[2]).eta == pytest.approx(200)


def test_level_zero_is_no_noise_and_every_point_noises_in_eval_with_a_fixed_seed():
    dp = NoiseConfig(mechanism="metric_dp", eta=100.0)
    off = noise_at_scale(dp, 0.0)
    assert not off.is_active_configuration
    on = noise_at_scale(NoiseConfig(alpha=5.0, warmup_steps=10, schedule="linear", decay_steps=5), 5.0)
    assert (on.training_only, on.schedule, on.warmup_steps, on.seed) == (False, "constant", 0, 777)


def test_a_model_trained_without_noise_is_swept_around_the_default_level():
    assert sweep_scales(NoiseConfig(enabled=False)) == [0.0, 1.25, 2.5, 5.0, 10.0, 20.0]


@pytest.mark.parametrize("name", list(NOISE_FAMILIES))
def test_every_family_sweeps_its_magnitude_field_with_the_axis_growing_with_the_noise(name):
    family = NOISE_FAMILIES[name]
    noise = load_noise_config(family.preset)
    field = family.magnitude_field
    assert scale_field(noise) == (f"1/{field}" if family.larger_is_quieter else field)
    louder = noise_at_scale(noise, sweep_scales(noise)[4])  # twice the trained level
    expected = getattr(noise, field) / 2 if family.larger_is_quieter else 2 * getattr(noise, field)
    assert getattr(louder, field) == pytest.approx(expected)
    assert louder.magnitude > noise.magnitude


# The comparison with the control: per-batch paired differences, a t-interval over the batches, a verdict per level.

BATCHES = 16


def _point(scale: float, loss: float, kl: float, spread: float = 0.001, shift: int = 0) -> RobustnessPoint:
    """A point whose 16 per-batch values scatter by up to +-1.5 ``spread`` around ``loss`` and ``kl`` (their mean
    exactly; KL 0 stays 0); ``shift`` rotates the scatter, so that two points differ batch by batch."""
    wiggle = [spread * (1 if index % 2 else -1) * (1 + index % 3) / 2 for index in range(BATCHES)]
    wiggle = [w - sum(wiggle) / BATCHES for w in wiggle]
    wiggle = wiggle[shift:] + wiggle[:shift]
    return RobustnessPoint(
        scale, loss, kl, tuple(loss + w for w in wiggle), tuple(kl + w if kl else 0.0 for w in wiggle)
    )


def _curves() -> dict[str, list[RobustnessPoint]]:
    """A control and a noise-trained curve at 0, 2.5, ..., 40: KL clearly lower at 20, clearly higher at 40,
    overlapping at 2.5, 5 and 10 (a mean shift well inside the batch-to-batch scatter); loss clearly lower at 0."""
    control = [_point(0.0, 2.70, 0.0), _point(2.5, 2.71, 0.002), _point(5.0, 2.72, 0.009), _point(10.0, 2.75, 0.04),
               _point(20.0, 2.85, 0.12), _point(40.0, 3.00, 0.22)]  # fmt: skip
    trained = [_point(0.0, 2.65, 0.0), _point(2.5, 2.7101, 0.0021, shift=1), _point(5.0, 2.72, 0.009, shift=3),
               _point(10.0, 2.75, 0.0403, shift=1), _point(20.0, 2.85, 0.10), _point(40.0, 3.00, 0.26)]  # fmt: skip
    return {"before": control, "no noise": control, "after": trained}


def test_the_t_quantile_is_students():
    assert t_quantile(0.975, 1) == pytest.approx(12.7062047, abs=1e-6)
    assert t_quantile(0.975, 3) == pytest.approx(3.1824463, abs=1e-6)
    assert t_quantile(0.975, 15) == pytest.approx(2.1314495, abs=1e-6)  # 16 held-out batches
    assert t_quantile(0.975, 30) == pytest.approx(2.0422725, abs=1e-6)


def test_a_paired_difference_is_the_mean_of_per_batch_differences_with_a_t_interval():
    trained, control = [1.0, 2.0, 3.0, 4.0], [1.5, 2.0, 3.5, 5.0]  # differences -0.5, 0, -0.5, -1: mean -0.5
    difference = paired_difference(trained, control)
    half = t_quantile(0.975, 3) * math.sqrt(1 / 6) / 2  # t * sd / sqrt(n): sd of the differences sqrt(1/6)
    assert difference.mean == pytest.approx(-0.5)
    assert (difference.low, difference.high) == pytest.approx((-0.5 - half, -0.5 + half))
    assert difference.verdict == "no difference (interval includes 0)"  # -0.5 +- 0.65: a paired test cannot tell


@pytest.mark.parametrize(
    ("trained", "control", "verdict"),
    [
        ([0.10, 0.12, 0.11, 0.13], [0.20, 0.21, 0.19, 0.22], "better"),  # lower on every batch
        ([0.30, 0.32, 0.31, 0.33], [0.20, 0.21, 0.19, 0.22], "worse"),
        ([0.20, 0.23, 0.18, 0.22], [0.21, 0.20, 0.20, 0.21], "no difference (interval includes 0)"),  # overlapping
        ([0.0] * 4, [0.0] * 4, "no difference (interval includes 0)"),  # level 0: no noise, no shift
    ],
)
def test_the_verdict_is_better_only_below_zero_and_worse_only_above(trained, control, verdict):
    assert paired_difference(trained, control).verdict == verdict


def test_a_shift_that_is_large_on_average_but_not_in_every_batch_is_no_difference():
    # the same mean gap as "better" above (-0.09), but two batches go the other way: the interval includes 0
    assert paired_difference([0.02, 0.40, 0.02, 0.05], [0.20, 0.21, 0.19, 0.25]).verdict.startswith("no difference")


def test_paired_difference_needs_two_matching_batches():
    with pytest.raises(ValueError, match="1 and 1 per-batch values"):
        paired_difference([0.1], [0.2])
    with pytest.raises(ValueError, match="2 and 3 per-batch values"):
        paired_difference([0.1, 0.2], [0.2, 0.3, 0.4])


def test_the_comparison_gives_each_level_its_verdict_on_constructed_curves():
    curves = _curves()
    comparisons = compare_to_control(curves["after"], curves["no noise"])
    assert [c.scale for c in comparisons] == [0.0, 2.5, 5.0, 10.0, 20.0, 40.0]
    assert [c.kl.verdict.split()[0] for c in comparisons] == ["no", "no", "no", "no", "better", "worse"]
    assert [c.loss.verdict.split()[0] for c in comparisons] == ["better", "no", "no", "no", "no", "no"]
    assert comparisons[4].kl.mean == pytest.approx(-0.02) and comparisons[5].kl.mean == pytest.approx(0.04)
    assert comparisons[4].kl.high < 0 < comparisons[5].kl.low
    assert all(c.batches == BATCHES for c in comparisons)


def test_the_summary_counts_the_verdicts_kl_over_the_noisy_levels_only():
    comparisons = compare_to_control(_curves()["after"], _curves()["no noise"])
    line, verdict = summarize_comparison(comparisons).splitlines()
    assert line == (
        "noise training vs control: lower KL at 1 of 5 noise levels, higher at 1, no difference at 3; held-out loss "
        "lower at 1 of 6 levels, higher at 0, no difference at 5 (95 % paired t-interval over 16 held-out batches, "
        "same noise draws)"
    )
    assert verdict == (
        "no overall robustness gain measured: noise training lowered KL at 1 noise level and raised it at 1; its "
        "clean held-out loss is lower than the control's by 0.0500"
    )


@pytest.mark.parametrize(
    ("kl_at_20", "kl_at_40", "words"),
    [
        (
            0.10,
            0.20,
            "noise training made this model more robust than its control: lower KL at 2 noise levels, "
            "held-out loss higher at none",
        ),
        (0.14, 0.26, "no robustness gain measured: noise training raised KL at 2 noise levels, lowered it at none"),
        (0.12, 0.22, "no difference measured: noise training changed KL against its control at no noise level"),
    ],
)
def test_the_summary_says_in_words_what_the_verdicts_say(kl_at_20, kl_at_40, words):
    control = _curves()["no noise"]
    trained = [*control[:4], _point(20.0, 2.85, kl_at_20), _point(40.0, 3.00, kl_at_40)]
    assert summarize_comparison(compare_to_control(trained, control)).splitlines()[1] == words


def test_lower_kl_with_a_higher_loss_is_steadier_not_more_robust_and_the_clean_cost_is_named():
    control = _curves()["no noise"]
    trained = [_point(0.0, 2.80, 0.0), *control[1:4], _point(20.0, 2.90, 0.10), _point(40.0, 3.00, 0.20)]
    assert summarize_comparison(compare_to_control(trained, control)).splitlines()[1] == (
        "steadier, not more accurate: noise training lowered KL at 2 noise levels but its held-out loss is higher at "
        "2 of 6 levels and lower at none; at a cost: its clean held-out loss is higher than the control's by 0.1000"
    )


def test_lower_kl_with_a_loss_lower_under_heavy_noise_but_higher_clean_is_a_trade_off():
    control = _curves()["no noise"]
    trained = [_point(0.0, 2.80, 0.0), *control[1:4], _point(20.0, 2.85, 0.10), _point(40.0, 2.95, 0.20)]
    assert summarize_comparison(compare_to_control(trained, control)).splitlines()[1] == (
        "a trade-off: noise training lowered KL at 2 noise levels, and its held-out loss is lower at 1 of 6 levels but "
        "higher at 1; at a cost: its clean held-out loss is higher than the control's by 0.1000"
    )


def test_the_comparison_needs_curves_at_the_same_levels():
    control = _curves()["no noise"]
    with pytest.raises(ValueError, match="same scales"):
        compare_to_control(control[1:], control[:-1])


def test_the_report_json_keeps_per_batch_values_and_each_levels_comparison(tmp_path, capsys):
    curves = _curves()
    folder = write_report(curves, "alpha", RunReport(tmp_path / "reports"), "constructed")
    report = json.loads((folder / "robustness.json").read_text())
    assert list(report) == ["before", "no noise", "after"]  # the curves, as before; the comparison is in "after"
    assert all(len(point["batch_kl"]) == BATCHES for name in report for point in report[name])
    at_20 = report["after"][4]["vs_control"]
    assert at_20["control"] == "no noise" and at_20["batches"] == BATCHES
    assert at_20["interval"] == "95 % paired t-interval over 16 held-out batches"
    assert at_20["kl"]["verdict"] == "better" and at_20["kl"]["high"] < 0
    assert report["after"][5]["vs_control"]["kl"]["verdict"] == "worse"
    # reproducible from the file: the per-batch values give the interval back
    again = paired_difference(report["after"][4]["batch_kl"], report["no noise"][4]["batch_kl"])
    assert (again.mean, again.low, again.high) == pytest.approx(
        (at_20["kl"]["mean"], at_20["kl"]["low"], at_20["kl"]["high"])
    )
    assert all("vs_control" not in point for point in report["no noise"] + report["before"])
    out = capsys.readouterr().out
    assert "noise training vs control: lower KL at 1 of 5 noise levels, higher at 1, no difference at 3;" in out
    assert "no overall robustness gain measured" in out


def test_a_report_without_a_control_has_no_comparison(tmp_path, capsys):
    curves = _curves()
    folder = write_report({"before": curves["before"], "after": curves["after"]}, "alpha", RunReport(tmp_path))
    report = json.loads((folder / "robustness.json").read_text())
    assert all("vs_control" not in point for point in report["after"])
    assert "noise training vs control" not in capsys.readouterr().out
