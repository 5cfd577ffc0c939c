"""Checked at the boundary, trusted inside (issue 36): two gates per config, one error type.

A ``NoiseConfig``/``KDConfig`` is checked when it is constructed (``__post_init__``) and once more, for assignments
made after that, at the one gate where it starts work: the provider's ``finalize`` (Bridge's
``ConfigContainer.validate``, the CPU loop's build), or ``make_noisy`` for a model built without Bridge. A
distillation provider's constraints (``validate_distillation``) are checked on the values an override would leave
(``apply_overrides``) and at ``finalize``. Nothing between or after re-checks. Every scalar check of the configs,
the privacy math and the audit raises the one ``SettingError`` (a ``ValueError``) naming the setting, the value and
what is allowed.
"""

from __future__ import annotations

import pickle
from collections import Counter

import pytest

from nemo_noise_plugin.distillation.config import KDConfig
from nemo_noise_plugin.noise import calibration
from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.privacy import accounting
from nemo_noise_plugin.privacy.audit import checks as checks_module
from nemo_noise_plugin.privacy.audit import statistics
from nemo_noise_plugin.validation import SettingError, check_int, check_number


@pytest.fixture
def calls(monkeypatch):
    """Counts of the real checks, per method and per checked object (the real methods run; only counted).

    Keys: ``NoiseConfig``, ``KDConfig``, ``validate_distillation``, and ``(name, id(obj))`` for each object."""
    from nemo_noise_plugin.providers import DistillationProviderMixin

    counts: Counter = Counter()
    for owner, method, name in (
        (NoiseConfig, "validate", "NoiseConfig"),
        (KDConfig, "validate", "KDConfig"),
        (DistillationProviderMixin, "validate_distillation", "validate_distillation"),
    ):
        real = getattr(owner, method)

        def counted(self, _real=real, _name=name):
            counts[_name] += 1
            counts[_name, id(self)] += 1
            return _real(self)

        monkeypatch.setattr(owner, method, counted)
    return counts


def _per_object(counts: Counter, name: str) -> list[int]:
    return sorted(count for key, count in counts.items() if isinstance(key, tuple) and key[0] == name)


def test_one_cpu_run_through_launch_checks_each_config_twice(calls, tmp_path):
    from nemo_noise_plugin.jobs.launch.launcher import launch
    from nemo_noise_plugin.recipes.tiny import tiny_noise_distillation_config

    config = tiny_noise_distillation_config(dir=str(tmp_path))
    assert (calls["NoiseConfig"], calls["KDConfig"], calls["validate_distillation"]) == (1, 1, 0)  # constructed
    launch(config, ["train.train_iters=1"], allow_cpu_loop=True)
    # construction + finalize for each config; the override boundary + finalize for the provider's constraints
    # (before issue 36: NoiseConfig 7, KDConfig 6, validate_distillation 4)
    assert (calls["NoiseConfig"], calls["KDConfig"], calls["validate_distillation"]) == (2, 2, 2)
    assert _per_object(calls, "NoiseConfig") == [2] and _per_object(calls, "KDConfig") == [2]


def test_an_override_rebuilds_the_config_and_the_rebuilt_one_is_checked_twice(calls, tmp_path):
    from nemo_noise_plugin.jobs.launch.launcher import launch
    from nemo_noise_plugin.recipes.tiny import tiny_noise_sft_config

    config = tiny_noise_sft_config(dir=str(tmp_path))
    recipes_noise = config.model.noise
    launch(config, ["train.train_iters=1", "model.noise.alpha=10"], allow_cpu_loop=True)
    assert config.model.noise is not recipes_noise and config.model.noise.alpha == 10.0
    assert calls["NoiseConfig", id(recipes_noise)] == 1  # constructed, then replaced by the override's rebuild
    assert calls["NoiseConfig", id(config.model.noise)] == 2  # the rebuild's construction, then finalize
    assert calls["NoiseConfig"] == 3


def test_make_noisy_is_the_gate_for_a_model_built_without_bridge(megatron_cpu, calls):
    from nemo_noise_plugin.model import make_noisy
    from tests.support.models import build_tiny_gpt

    noise = NoiseConfig(alpha=5.0)
    model = make_noisy(build_tiny_gpt(), noise)
    assert model.noise_config is noise and calls["NoiseConfig"] == 2  # construction, then make_noisy
    noise.alpha = -1.0
    with pytest.raises(SettingError, match=r"^NoiseConfig\.alpha=-1\.0 is invalid: expected a finite number >= 0"):
        make_noisy(model, noise)


def test_an_assignment_after_construction_is_caught_at_finalize_naming_the_field(megatron_cpu, tmp_path):
    from nemo_noise_plugin.recipes.tiny import tiny_noise_distillation_config

    config = tiny_noise_distillation_config(dir=str(tmp_path))
    config.model.kd.temperature = 0.0
    with pytest.raises(SettingError, match=r"^KDConfig\.temperature=0\.0 is invalid: expected a finite number"):
        config.model.finalize()
    config.model.kd.temperature = 2.0
    config.model.noise.special_token_ids.append(-1)  # an in-place change of a list field
    with pytest.raises(SettingError, match=r"^NoiseConfig\.special_token_ids=\[.*-1\] is invalid"):
        config.model.finalize()


def test_assignments_after_construction_are_checked_however_small():
    kd = KDConfig()
    kd.enabled = 1  # 1 == True, but not a bool
    with pytest.raises(SettingError, match=r"KDConfig\.enabled=1 is invalid: expected true or false"):
        kd.validate()
    noise = NoiseConfig(alpha=1)
    noise.alpha = True  # True == 1, but not a number here
    with pytest.raises(SettingError, match=r"NoiseConfig\.alpha=True is invalid: expected a finite number >= 0"):
        noise.validate()
    noise.alpha = 1e300
    with pytest.raises(SettingError, match=r"NoiseConfig\.alpha=1e\+300 is invalid"):
        noise.validate()


def test_a_config_holds_its_fields_only():
    import copy
    import dataclasses

    checked = NoiseConfig(alpha=3.0)
    assert set(vars(checked)) == {field.name for field in dataclasses.fields(NoiseConfig)}
    assert NoiseConfig(**{**vars(checked), "alpha": 2.0}).alpha == 2.0  # the fields, and only they, rebuild it
    assert dataclasses.replace(checked, alpha=4.0).alpha == 4.0
    assert copy.deepcopy(checked) == checked


def test_setting_error_names_setting_value_and_allowed_and_pickles():
    with pytest.raises(SettingError) as raised:
        check_int("top_k", 0, minimum=1, maximum=8)
    error = raised.value
    assert isinstance(error, ValueError)
    assert (error.setting, error.value, error.expected) == ("top_k", 0, "an integer >= 1 and <= 8")
    assert str(error) == "top_k=0 is invalid: expected an integer >= 1 and <= 8."
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is SettingError and str(again) == str(error) and again.setting == "top_k"
    with pytest.raises(SettingError, match=r"^q=2 is invalid: expected a finite number in \(0, 1\), e\.g\. 0\.5\.$"):
        check_number("q", 2, minimum=0.0, maximum=1.0, inclusive=False, why=", e.g. 0.5")


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda: calibration.analytic_gaussian_sigma(1, 2, 1),
            r"^analytic_gaussian_sigma: delta=2 is invalid: expected a finite number in \(0, 1\)\.$",
        ),
        (
            lambda: accounting.zcdp_to_dp_epsilon(1, 1e-5, "x"),
            r"^zcdp_to_dp_epsilon: method='x' is invalid: expected one of optimal, bun_steinke\.$",
        ),
        (
            lambda: statistics.wilson_interval(5, 3),
            r"^successes=5 is invalid: expected an integer >= 0 and <= 3\.$",
        ),
        (
            lambda: checks_module.check_confidence(1.5),
            r"^confidence=1\.5 is invalid: expected a finite number in \(0, 1\), e\.g\. 0\.95\.$",
        ),
    ],
    ids=["calibration", "accounting", "audit-count", "audit-confidence"],
)
def test_the_privacy_math_and_the_audit_speak_the_one_dialect(call, message):
    with pytest.raises(SettingError, match=message):
        call()
