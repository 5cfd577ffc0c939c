"""NoiseConfig validation: bad values are rejected with the field, the value and what is allowed."""

from __future__ import annotations

import math

import pytest

from nemo_noise_plugin.noise.config import NoiseConfig


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
    assert NoiseConfig(mechanism="gaussian", sigma=0.7, alpha=3.0).magnitude == 0.7
    assert not NoiseConfig(enabled=False).is_active_configuration
    assert not NoiseConfig(alpha=0.0).is_active_configuration


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("mechanism", "laplace", "expected one of uniform, gaussian"),
        ("scaling", "per_shard", "expected one of true_length, padded_length, absolute"),
        ("alpha", -1.0, "expected a finite number >= 0"),
        ("alpha", math.nan, "expected a finite number >= 0"),
        ("alpha", "5", "expected a finite number >= 0"),
        ("sigma", math.inf, "expected a finite number >= 0"),
        ("enabled", "yes", "expected true or false"),
        ("training_only", 1, "expected true or false"),
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
