"""One validation dialect, and a config validated once per build (issue 24).

Every gate of a run (the recipe's construction, ``apply_overrides``, ``validate_plugin_settings``, a provider's
``finalize``, ``make_noisy``) calls ``NoiseConfig``/``KDConfig.validate``; the checks themselves (``_check``) run once
per distinct field values (``validation.ValidatedSettings``), so an unchanged config is checked once per build while
an assignment after construction is still caught at the next gate. Every scalar check of the configs, the privacy
math and the audit raises the one ``SettingError`` (a ``ValueError``) naming the setting, the value and what is
allowed.
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
def checks(monkeypatch):
    """Counts of the real ``_check`` runs of each config class (the real method runs; only counted)."""
    counts: Counter[str] = Counter()
    for config_type in (NoiseConfig, KDConfig):
        real = config_type._check

        def counted(self, _real=real, _name=config_type.__name__):
            counts[_name] += 1
            _real(self)

        monkeypatch.setattr(config_type, "_check", counted)
    return counts


def _build_and_pass_the_launch_gates(overrides: list[str]):
    """A finetune build (recipe, overrides, validation) and the gates ``launch`` and Bridge's validate pass."""
    from nemo_noise_plugin.jobs.launch.finetune import run_finetune
    from nemo_noise_plugin.training.overrides import apply_overrides, validate_plugin_settings

    config = run_finetune("tiny_noise_distillation", overrides, dryrun=True, print_fn=lambda _: None)
    apply_overrides(config, [])  # launch() applies its own (here no) overrides
    validate_plugin_settings(config)  # then validates the plugin's settings
    config.model.finalize()  # Bridge's ConfigContainer.validate finalizes the provider
    return config


def test_one_build_checks_each_config_once(megatron_cpu, checks, monkeypatch):
    calls: Counter[str] = Counter()
    for config_type in (NoiseConfig, KDConfig):
        real = config_type.validate

        def called(self, _real=real, _name=config_type.__name__):
            calls[_name] += 1
            _real(self)

        monkeypatch.setattr(config_type, "validate", called)
    config = _build_and_pass_the_launch_gates(["train.train_iters=3"])
    assert config.train.train_iters == 3
    assert calls["KDConfig"] >= 5 and calls["NoiseConfig"] >= 3  # every gate still asks
    assert checks == {"NoiseConfig": 1, "KDConfig": 1}  # the checks ran once per config


def test_a_config_an_override_touches_is_checked_once_more_as_rebuilt(megatron_cpu, checks):
    config = _build_and_pass_the_launch_gates(["model.kd.temperature=2", "model.noise.alpha=10"])
    assert (config.model.kd.temperature, config.model.noise.alpha) == (2.0, 10.0)
    assert type(config.model.kd.temperature) is float  # the int became a float before the one check
    assert checks == {"NoiseConfig": 2, "KDConfig": 2}  # the recipe's objects, and the rebuilt ones once each


def test_an_assignment_after_the_build_is_caught_at_the_next_gate(megatron_cpu):
    from nemo_noise_plugin.training.overrides import ConfigOverrideError, validate_plugin_settings

    config = _build_and_pass_the_launch_gates([])
    config.model.kd.temperature = 0.0
    with pytest.raises(ConfigOverrideError, match=r"model\.kd\.temperature=0\.0 is invalid: expected a finite"):
        validate_plugin_settings(config)
    config.model.kd.temperature = 2.0
    config.model.noise.special_token_ids.append(-1)  # an in-place change of a list field
    with pytest.raises(ValueError, match=r"NoiseConfig\.special_token_ids=\[.*-1\] is invalid"):
        config.model.finalize()


def test_assignments_after_construction_are_checked_however_small(checks):
    kd = KDConfig()
    kd.validate()
    assert checks["KDConfig"] == 1
    kd.temperature = 0.0
    with pytest.raises(SettingError, match=r"KDConfig\.temperature=0\.0 is invalid"):
        kd.validate()
    kd.temperature = 1.0  # back to the checked values: nothing to check again ...
    kd.validate()
    kd.enabled = 1  # ... but 1 is not True, although 1 == True
    with pytest.raises(SettingError, match=r"KDConfig\.enabled=1 is invalid: expected true or false"):
        kd.validate()
    noise = NoiseConfig(alpha=1)
    noise.alpha = True  # True == 1, but not a number here
    with pytest.raises(SettingError, match=r"NoiseConfig\.alpha=True is invalid: expected a finite number >= 0"):
        noise.validate()
    noise.alpha = 1e300
    with pytest.raises(SettingError, match=r"NoiseConfig\.alpha=1e\+300 is invalid"):
        noise.validate()


def test_a_failed_check_is_not_remembered(checks):
    noise = NoiseConfig()
    noise.sigma = -1.0
    for _ in range(2):
        with pytest.raises(SettingError):
            noise.validate()
    assert checks["NoiseConfig"] == 3  # construction, then both failed checks ran


def test_the_memo_is_invisible_on_the_config(checks):
    import copy
    import dataclasses

    checked = NoiseConfig(alpha=3.0)
    assert set(vars(checked)) == {field.name for field in dataclasses.fields(NoiseConfig)}
    assert NoiseConfig(**{**vars(checked), "alpha": 2.0}).alpha == 2.0  # the fields, and only they, rebuild it
    assert dataclasses.replace(checked, alpha=4.0).alpha == 4.0
    assert checks["NoiseConfig"] == 3
    duplicate = copy.deepcopy(checked)
    duplicate.validate()  # a copy is another config: checked afresh, once
    duplicate.validate()
    assert checks["NoiseConfig"] == 4 and duplicate == checked


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
