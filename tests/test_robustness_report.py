"""The robustness report sweeps the trained mechanism's own noise level, around the level it was trained with."""

from __future__ import annotations

import pytest

from nemo_noise_plugin.noise.config import NoiseConfig, load_noise_config
from nemo_noise_plugin.noise.families import NOISE_FAMILIES
from nemo_noise_plugin.robustness import REPORT_MULTIPLES, noise_at_scale, scale_field, sweep_scales


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
