"""NoiseConfig validation: bad values are rejected with the field, the value and what is allowed."""

from __future__ import annotations

import math
import re

import pytest

from nemo_noise_plugin.distillation.config import KDConfig, load_kd_config
from nemo_noise_plugin.noise.config import NoiseConfig, load_noise_config
from nemo_noise_plugin.presets import available_presets, preset_path
from nemo_noise_plugin.validation import SettingError


def test_defaults_are_neftune_with_true_length_scaling():
    config = NoiseConfig()
    assert (config.mechanism, config.alpha, config.scaling, config.training_only) == (
        "uniform",
        5.0,
        "true_length",
        True,
    )
    assert config.magnitude == 5.0 and config.is_active_configuration


def test_magnitude_follows_the_mechanism():
    assert NoiseConfig(mechanism="gaussian", sigma=0.7).magnitude == 0.7
    assert not NoiseConfig(enabled=False).is_active_configuration
    assert not NoiseConfig(alpha=0.0).is_active_configuration


@pytest.mark.parametrize(
    ("fields", "name", "own"),
    [
        (dict(mechanism="gaussian", alpha=10.0), "alpha", "sigma"),
        (dict(mechanism="uniform", sigma=2.0), "sigma", "alpha"),
        (dict(mechanism="metric_dp", laplace_scale=0.5), "laplace_scale", "eta"),
        (dict(mechanism="laplace", epsilon=4.0, clip_norm=1.0), "epsilon", "laplace_scale"),
    ],
    ids=["gaussian alpha", "uniform sigma", "metric_dp laplace_scale", "laplace epsilon"],
)
def test_a_magnitude_field_of_another_mechanism_is_refused_not_dropped(fields, name, own):
    with pytest.raises(SettingError) as refused:
        NoiseConfig(**fields)
    assert str(refused.value).startswith(f"NoiseConfig.{name}={fields[name]!r} is invalid with mechanism=")
    assert f"(its level is {own}), so it would be ignored." in str(refused.value)


def test_a_noise_yaml_with_a_magnitude_field_of_another_mechanism_is_refused(tmp_path):
    path = tmp_path / "noise.yaml"
    path.write_text("mechanism: gaussian\nalpha: 10\n")
    with pytest.raises(SettingError, match=r"NoiseConfig.alpha=10 is invalid with mechanism='gaussian'"):
        load_noise_config(str(path))


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("mechanism", "cauchy", "expected one of uniform, gaussian, metric_dp, gaussian_mechanism, quantization"),
        ("tokens", "answers", "expected one of all, prompt, response"),
        ("schedule", "step", "expected one of constant, linear, cosine"),
        ("calibration", "rdp", "expected one of analytic, classical"),
        ("eta", 0.0, "expected a finite number > 0"),
        ("delta", 1.0, "expected a finite number in (0, 1)"),
        ("min_factor", 1.5, "expected a finite number in [0, 1]"),
        ("clip_norm", -1.0, "expected a finite number > 0 (or null)"),
        ("epsilon", 0, "expected a finite number > 0 (or null)"),
        ("quantization_step", -0.1, "expected a finite number >= 0"),
        ("laplace_scale", -0.1, "expected a finite number >= 0"),
        ("warmup_steps", 2.5, "expected an integer >= 0"),
        ("seed", 2**32, "expected an integer >= 0 and <= 4294967295"),
        ("special_token_ids", [1, -2], "expected a list of integer token ids >= 0"),
        ("scaling", "per_shard", "expected one of true_length, padded_length, absolute"),
        ("alpha", -1.0, "expected a finite number >= 0"),
        ("alpha", math.nan, "expected a finite number >= 0"),
        ("alpha", "5", "expected a finite number >= 0"),
        ("sigma", math.inf, "expected a finite number >= 0"),
        ("enabled", "yes", "expected true or false"),
        ("training_only", 1, "expected true or false"),
        ("fast_math", "fast", "expected true or false"),
        ("seed", -3, "expected an integer >= 0"),
        ("seed", 1.5, "expected an integer >= 0"),
    ],
)
def test_bad_values_name_the_field_the_value_and_what_is_allowed(field, value, allowed):
    with pytest.raises(ValueError) as error:
        NoiseConfig(**{field: value})
    message = str(error.value)
    assert f"NoiseConfig.{field}={value!r}" in message
    assert allowed in message


NOISE_PRESETS = available_presets("noise")
KD_PRESETS = available_presets("kd")


def test_presets_ship_with_the_package():
    assert {"neftune_alpha5", "neftune_alpha10", "gaussian", "dp_gaussian_mechanism", "metric_dp", "off"} <= set(
        NOISE_PRESETS
    )
    assert {"forward_kl", "forward_kl_t2", "reverse_kl", "jsd", "kd_only"} <= set(KD_PRESETS)


@pytest.mark.parametrize("name", NOISE_PRESETS)
def test_every_shipped_noise_preset_loads_and_validates(name):
    assert isinstance(load_noise_config(name), NoiseConfig)


@pytest.mark.parametrize("name", KD_PRESETS)
def test_every_shipped_kd_preset_loads_and_validates(name):
    assert isinstance(load_kd_config(name), KDConfig)


def test_kd_presets_hold_the_documented_values():
    assert load_kd_config("forward_kl_t2").temperature == 2.0
    assert load_kd_config("kd_only").ce_weight == 0.0
    assert load_kd_config("jsd", jsd_beta=0.25).jsd_beta == 0.25


def test_a_preset_loads_by_path_as_by_name():
    path = preset_path("noise", "gaussian")
    assert path.is_file() and load_noise_config(path) == load_noise_config("gaussian")
    assert load_noise_config(str(path)) == load_noise_config("gaussian")


def test_an_unknown_preset_name_lists_the_available_ones():
    with pytest.raises(FileNotFoundError, match="no noise preset named 'neftune_alpha7'; available: .*neftune_alpha5"):
        load_noise_config("neftune_alpha7")


def test_a_yaml_syntax_error_names_the_file(tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text("alpha: [1, 2\n")
    with pytest.raises(ValueError, match="broken.yaml: not valid YAML"):
        load_noise_config(broken)


def test_presets_hold_the_documented_values():
    assert load_noise_config("neftune_alpha15").alpha == 15.0
    assert load_noise_config("neftune_alpha5_hf_compatible").scaling == "padded_length"
    assert load_noise_config("gaussian", sigma=2.0).sigma == 2.0
    assert not load_noise_config("off").enabled


def test_unknown_keys_in_a_yaml_preset_are_named(tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text("mechanism: uniform\nalpah: 5\n")
    with pytest.raises(ValueError, match=r"unknown NoiseConfig field\(s\) alpah; allowed: enabled, mechanism"):
        load_noise_config(path)


def test_bad_values_in_a_yaml_preset_name_the_field(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("mechanism: cauchy\n")
    with pytest.raises(ValueError, match="NoiseConfig.mechanism='cauchy' is invalid"):
        load_noise_config(path)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (dict(schedule="cosine"), "NoiseConfig.decay_steps=0 is invalid with schedule='cosine'"),
        (
            dict(mechanism="gaussian_mechanism", epsilon=1.0),
            "NoiseConfig.clip_norm=None is invalid with mechanism='gaussian_mechanism'",
        ),
        (
            dict(mechanism="gaussian_mechanism", clip_norm=1.0),
            "NoiseConfig.epsilon=None is invalid with mechanism='gaussian_mechanism'",
        ),
        (
            dict(mechanism="gaussian_mechanism", clip_norm=1.0, epsilon=2.0, calibration="classical"),
            "the classical Gaussian mechanism holds only for epsilon < 1",
        ),
        (
            dict(mechanism="metric_dp", schedule="linear", decay_steps=10),
            "NoiseConfig.schedule='linear' is invalid with warmup_steps=0 and mechanism='metric_dp': expected "
            "schedule='constant' and warmup_steps=0 (a privacy mechanism is calibrated once)",
        ),
        (dict(mechanism="metric_dp", warmup_steps=5), "expected schedule='constant' and warmup_steps=0"),
        (
            dict(mechanism="laplace", warmup_steps=5),
            "NoiseConfig.warmup_steps=5 is invalid with mechanism='laplace': expected schedule='constant' and "
            "warmup_steps=0 (a privacy mechanism is calibrated once)",
        ),
        (
            dict(mechanism="laplace", scaling="embedding_distance"),
            "NoiseConfig.scaling='embedding_distance' is invalid with mechanism='laplace'",
        ),
    ],
)
def test_inconsistent_settings_are_rejected_naming_the_fields(settings, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        NoiseConfig(**settings)


def test_magnitude_of_each_mechanism():
    assert NoiseConfig(mechanism="metric_dp", eta=20.0).magnitude == pytest.approx(0.05)
    assert NoiseConfig(mechanism="quantization", quantization_step=0.25).magnitude == 0.25
    assert NoiseConfig(mechanism="relative", relative_scale=0.3).magnitude == 0.3
    assert NoiseConfig(mechanism="laplace", laplace_scale=0.4).magnitude == 0.4
    dp = NoiseConfig(mechanism="gaussian_mechanism", clip_norm=1.0, epsilon=0.5, calibration="classical")
    assert dp.sensitivity == 2.0
    assert dp.magnitude == pytest.approx(2.0 * math.sqrt(2 * math.log(1.25 / 1e-5)) / 0.5)
