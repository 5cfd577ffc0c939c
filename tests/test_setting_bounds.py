"""Upper bounds of settings that were accepted although unusable (issue 26).

A noise magnitude past float32's range is inf in the model; a Gaussian-mechanism budget whose calibrated sigma is
past it likewise; ``nemo noise audit`` counts such as ``tokens=10**12`` would exhaust memory or run for days. Each is
refused by the one validation path with a message naming the setting, the value, what is allowed and why.
"""

from __future__ import annotations

import pytest

from nemo_noise_plugin.jobs.audit.settings import AUDIT_COUNT_LIMITS, parse_audit_arguments
from nemo_noise_plugin.noise.config import MAGNITUDE_FIELDS, NoiseConfig
from nemo_noise_plugin.validation import FLOAT32_MAX, SettingError

FLOAT32_FIELDS = sorted({*MAGNITUDE_FIELDS.values(), "distance_multiple", "embedding_distance", "clip_norm"})
"""Every NoiseConfig field that sizes the noise in the model (the mechanisms' magnitudes and the clip/distances)."""


def test_float32_max_is_torchs():
    import torch

    assert torch.finfo(torch.float32).max == FLOAT32_MAX
    assert torch.tensor(FLOAT32_MAX, dtype=torch.float32).isfinite()
    assert torch.tensor(FLOAT32_MAX * (1 + 1e-7), dtype=torch.float32).isinf()


@pytest.mark.parametrize("value", [1e300, 1e39, 3.5e38, 10**39])
@pytest.mark.parametrize("field", FLOAT32_FIELDS)
def test_a_noise_magnitude_past_float32_is_refused_saying_why(field, value):
    with pytest.raises(SettingError) as raised:
        NoiseConfig(**{field: value})
    message = str(raised.value)
    assert message.startswith(
        f"NoiseConfig.{field}={value!r} is invalid: expected a magnitude <= 3.4028234663852886e+38"
    )
    assert "inf in float32" in message and "in the model would be inf" in message
    assert "\n" not in message


@pytest.mark.parametrize("field", FLOAT32_FIELDS)
def test_the_largest_float32_is_still_accepted_as_a_magnitude(field):
    owner = {name: mechanism for mechanism, name in MAGNITUDE_FIELDS.items()}.get(field, "uniform")
    extra = {"clip_norm": 1.0} if owner == "gaussian_mechanism" else {}  # its own field, with what it needs
    config = NoiseConfig(mechanism=owner, **extra, **{field: FLOAT32_MAX})
    assert getattr(config, field) == FLOAT32_MAX


def test_an_assigned_huge_alpha_is_refused_where_work_starts():
    config = NoiseConfig()
    config.alpha = 1e300
    with pytest.raises(SettingError, match=r"NoiseConfig\.alpha=1e\+300 is invalid: expected a magnitude <="):
        config.validate()


@pytest.mark.parametrize(
    "budget",
    [dict(clip_norm=1e38, epsilon=1.0), dict(clip_norm=1e36, epsilon=1e-3), dict(clip_norm=1.0, epsilon=5e-324)],
)
def test_a_gaussian_mechanism_budget_whose_sigma_is_inf_in_float32_is_refused(budget):
    with pytest.raises(SettingError, match=r"NoiseConfig\.epsilon=.* is invalid with mechanism='gaussian_mechanism'"):
        NoiseConfig(mechanism="gaussian_mechanism", **budget)


def test_a_gaussian_mechanism_budget_near_the_bound_calibrates_to_a_float32_sigma():
    config = NoiseConfig(mechanism="gaussian_mechanism", clip_norm=1e10, epsilon=1e-10)
    assert 0 < config.dp_sigma <= FLOAT32_MAX


def _audit(tmp_path, **counts) -> dict:
    arguments = ["model=tiny", "sweep=alpha:1", f"output_dir={tmp_path / 'out'}"]
    return parse_audit_arguments([*arguments, *(f"{key}={value}" for key, value in counts.items())])


@pytest.mark.parametrize("key", list(AUDIT_COUNT_LIMITS))
def test_each_audit_count_is_accepted_up_to_its_bound_and_refused_past_it(key, tmp_path):
    limit = AUDIT_COUNT_LIMITS[key]
    assert _audit(tmp_path, **{key: limit})[key] == limit
    for value in (limit + 1, 10**12):
        with pytest.raises(SettingError) as raised:
            _audit(tmp_path, **{key: value})
        assert str(raised.value) == (
            f"{key}={value} is invalid: expected an integer >= 1 and <= {limit} (a real audit needs far fewer; more "
            "would only exhaust memory or time)."
        )


def test_the_audit_count_bounds_are_past_the_defaults_and_the_vocabularies():
    from nemo_noise_plugin.jobs.audit.settings import AUDIT_DEFAULTS
    from nemo_noise_plugin.privacy.audit.search import DEFAULT_QUERY_CHUNK, DEFAULT_VOCAB_CHUNK

    assert AUDIT_COUNT_LIMITS["tokens"] >= 100 * AUDIT_DEFAULTS["tokens"]
    assert AUDIT_COUNT_LIMITS["max_length"] >= 100 * AUDIT_DEFAULTS["max_length"]
    assert AUDIT_COUNT_LIMITS["vocab_chunk"] >= max(DEFAULT_VOCAB_CHUNK, 256_000)  # Gemma's 256k vocabulary
    assert AUDIT_COUNT_LIMITS["query_chunk"] >= 16 * DEFAULT_QUERY_CHUNK
