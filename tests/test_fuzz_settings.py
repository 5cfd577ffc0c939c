"""Property-based tests that close the category "a bad setting gives a traceback or a silent wrong run" (issue 26).

Over the fields of ``NoiseConfig`` and ``KDConfig`` (at construction and assigned afterwards), the privacy ledger's
and the audit's settings, and the command-line overrides of the finetune path, with wrong types, special floats,
huge and tiny values, strings with spaces and unicode and numpy scalars: every input either works (and then what
the plugin derives from it works too) or raises the plugin's own error, a ``ValueError`` whose one-line message
names the setting and says what is expected. Any other exception fails the test.

Derandomised (``derandomize=True``) so CI sees the same examples on every run; about 20 s on 2 cores. Explicit
``@example``s hold the values just past each documented bound (a KD temperature outside [1/80, 1e6], a noise
magnitude or calibrated Gaussian-mechanism sigma that is not finite in float32), and what a valid config derives is
checked against those bounds, so removing one of the checks fails a test.
"""

from __future__ import annotations

import dataclasses
import math
import tempfile

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from nemo_noise_plugin.distillation.config import (
    HIDDEN_LOSSES,
    KD_LOSSES,
    KD_TOKEN_SELECTIONS,
    MAX_TEMPERATURE,
    MIN_TEMPERATURE,
    KDConfig,
)
from nemo_noise_plugin.noise.config import (
    CALIBRATIONS,
    MECHANISMS,
    SCALINGS,
    SCHEDULES,
    TOKEN_SELECTIONS,
    NoiseConfig,
)
from nemo_noise_plugin.validation import FLOAT32_MAX


def _fuzz(examples: int) -> settings:
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )


FUZZ = _fuzz(40)
"""Per setting (the tests are parametrised by setting, so each one gets its share of the examples)."""
FUZZ_MIXED = _fuzz(150)
"""Combinations of several settings."""

NOISE_FIELDS = tuple(field.name for field in dataclasses.fields(NoiseConfig))
KD_FIELDS = tuple(field.name for field in dataclasses.fields(KDConfig))
CHOICES = (*MECHANISMS, *SCALINGS, *TOKEN_SELECTIONS, *SCHEDULES, *CALIBRATIONS, *KD_LOSSES, *KD_TOKEN_SELECTIONS)
CHOICES = (*CHOICES, *HIDDEN_LOSSES)

SPECIAL_FLOATS = st.sampled_from(
    [0.0, -0.0, math.nan, -math.nan, math.inf, -math.inf, 5e-324, 1e-300, 1e-30, 1e300, 1.7976931348623157e308, -1e-30]
)
HUGE_INTS = st.sampled_from([10**400, -(10**400), 2**63, 2**64 + 1])
"""Integers past a float's range (``math.isfinite`` overflows on them) and past int64."""
NUMBERS = st.one_of(
    st.integers(min_value=-(2**80), max_value=2**80),
    st.integers(min_value=-3, max_value=20),
    HUGE_INTS,
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(min_value=-10.0, max_value=10.0),
    SPECIAL_FLOATS,
)
NUMPY_SCALARS = st.one_of(
    st.floats(width=32).map(np.float32),
    st.floats().map(np.float64),
    st.integers(min_value=-(2**63), max_value=2**63 - 1).map(np.int64),
    st.integers(min_value=0, max_value=10).map(np.int32),
    st.booleans().map(np.bool_),
    st.sampled_from(CHOICES).map(np.str_),
)
TEXTS = st.one_of(
    st.text(max_size=12),
    st.sampled_from(
        ["", " ", "uniform ", " gaussian", "Uniform", "ünïcödé", "1e3", "nan", "true", "no", "None", "null", "a b"]
    ),
    st.sampled_from(["[1, 2]", "{}", "\u00a0", "\x00", "gausian", "5", "-1", "１２", "🙂", "forward kl"]),
)
LISTS = st.one_of(
    st.lists(
        st.one_of(st.integers(min_value=-5, max_value=300), st.integers(min_value=2**62, max_value=2**70)), max_size=3
    ),
    st.lists(TEXTS, max_size=2),
    st.tuples(st.integers(min_value=0, max_value=8)),
    st.lists(st.floats(allow_nan=True), max_size=2),
)
WILD = st.one_of(st.none(), st.booleans(), NUMBERS, NUMPY_SCALARS, TEXTS, st.sampled_from(CHOICES), LISTS)
"""Any value a user, a YAML file or a script could put into a setting."""


def _rejects_clearly(error: ValueError, names: tuple[str, ...]) -> None:
    """The plugin's own error: one line naming one of ``names`` (the setting) and saying what is expected."""
    message = str(error)
    assert "\n" not in message, message
    assert any(name in message for name in names), f"{message!r} names none of {names}"
    assert "expected" in message or "invalid" in message, message


def _use_noise_config(config: NoiseConfig) -> None:
    """What the plugin derives from a valid noise config: it must all work (or refuse with the plugin's error)."""
    from nemo_noise_plugin.noise.schedule import schedule_factor
    from nemo_noise_plugin.privacy.audit.noised import noised_embeddings
    from nemo_noise_plugin.privacy.ledger import privacy_ledger
    from nemo_noise_plugin.privacy.ledger_format import format_ledger

    config.validate()  # idempotent on a valid config
    assert isinstance(config.magnitude, float) and not math.isnan(config.magnitude)
    assert config.magnitude <= FLOAT32_MAX, f"magnitude {config.magnitude!r} is inf in the float32 model"
    if config.mechanism == "gaussian_mechanism":  # the calibrated level is a real noise the model can hold
        assert 0.0 < config.dp_sigma <= FLOAT32_MAX, config.dp_sigma
    assert config.is_active_configuration in (True, False)
    assert config.silent_field is None or config.silent_field in NOISE_FIELDS
    for iteration in (0, 1, 10**6):
        assert 0.0 <= schedule_factor(config, iteration) <= 1.0
    format_ledger(privacy_ledger(config, sequence_length=4, hidden_size=8))
    generator = torch.Generator().manual_seed(0)
    table, token_ids = torch.randn(16, 8, generator=generator), torch.randint(0, 16, (2, 4), generator=generator)
    try:
        noised_embeddings(table, token_ids, config, loss_mask=torch.ones(2, 4))
    except ValueError as error:  # embedding_distance scaling before the distance was measured: named, not a crash
        _rejects_clearly(error, ("embedding_distance",))


def _use_kd_config(config: KDConfig) -> None:
    config.validate()
    assert isinstance(config.kd_scale, float) and not math.isnan(config.kd_scale)
    # The documented range (distillation.config): outside it the softened softmax is one-hot or uniform in float32.
    assert MIN_TEMPERATURE <= config.temperature <= MAX_TEMPERATURE, config.temperature


USE = {NoiseConfig: _use_noise_config, KDConfig: _use_kd_config}
"""Each config class and what the plugin derives from a valid one."""
SINGLE_FIELDS = [
    pytest.param(config_type, field, id=f"{config_type.__name__}.{field}")
    for config_type in USE
    for field in (f.name for f in dataclasses.fields(config_type))
]
BOUNDARY_VALUES = (2e6, 1e30, 1e-3, 1e39, 1e300)
"""Values just past a documented bound of some field (KD temperature in [1/80, 1e6]; a noise magnitude that must
be finite in float32, <= 3.4e38): each single-field test tries them on every field."""


def _works_or_is_refused_by_name(config_type: type, values: dict, *, assigned: bool) -> None:
    """Build ``config_type`` from ``values`` (or assign them to a default one and validate it where work starts):
    it works, and then everything derived from it works too, or it is refused by the plugin's error naming one of
    the fields."""
    owner = config_type.__name__
    if len(values) == 1:  # the field itself
        names = (*(f"{owner}.{name}" for name in values), *values)
    else:  # any of the fields (a combination may be refused for another field's sake)
        names = tuple(f"{owner}.{field.name}" for field in dataclasses.fields(config_type))
    try:
        if assigned:
            config = config_type()
            for name, value in values.items():
                setattr(config, name, value)
            config.validate()
        else:
            config = config_type(**values)
    except ValueError as error:
        _rejects_clearly(error, names)
        return
    USE[config_type](config)


@pytest.mark.parametrize("assigned", [False, True], ids=["at_construction", "assigned_after"])
@pytest.mark.parametrize(("config_type", "field"), SINGLE_FIELDS)
@FUZZ
@given(value=WILD)
@example(value=BOUNDARY_VALUES[0])
@example(value=BOUNDARY_VALUES[1])
@example(value=BOUNDARY_VALUES[2])
@example(value=BOUNDARY_VALUES[3])
@example(value=BOUNDARY_VALUES[4])
def test_any_single_field_works_or_is_refused_by_name(config_type, field, assigned, value):
    """At construction, and assigned afterwards (refused where work starts: ``validate``)."""
    _works_or_is_refused_by_name(config_type, {field: value}, assigned=assigned)


def _field_combinations(config_type: type):
    return st.dictionaries(
        st.sampled_from([f.name for f in dataclasses.fields(config_type)]), WILD, min_size=2, max_size=5
    )


@FUZZ_MIXED
@given(values=_field_combinations(NoiseConfig))
# Gaussian-mechanism budgets no finite float32 sigma calibrates to (sigma ~ clip_norm / epsilon): refused.
@example(values={"mechanism": "gaussian_mechanism", "clip_norm": 1e38, "epsilon": 1.0})
@example(values={"mechanism": "gaussian_mechanism", "clip_norm": 1e36, "epsilon": 1e-3})
@example(values={"mechanism": "gaussian_mechanism", "clip_norm": 1.0, "epsilon": 5e-324})  # no finite sigma at all
def test_any_combination_of_noise_fields_works_or_is_refused_by_name(values):
    _works_or_is_refused_by_name(NoiseConfig, values, assigned=False)


@FUZZ_MIXED
@given(values=_field_combinations(KDConfig))
@example(values={"temperature": 1e7, "ce_weight": 0.0})
@example(values={"temperature": 1 / 100, "kd_weight": 2.0})
def test_any_combination_of_kd_fields_works_or_is_refused_by_name(values):
    _works_or_is_refused_by_name(KDConfig, values, assigned=False)


LEDGER_SETTINGS = ("sequence_length", "epochs", "delta", "hidden_size")


@FUZZ_MIXED
@given(values=st.dictionaries(st.sampled_from(LEDGER_SETTINGS), WILD, min_size=1, max_size=4))
def test_the_ledgers_settings_work_or_are_refused_by_name(values):
    from nemo_noise_plugin.privacy.ledger import privacy_ledger
    from nemo_noise_plugin.privacy.ledger_format import format_ledger

    values.setdefault("sequence_length", 8)
    config = NoiseConfig(mechanism="gaussian_mechanism", clip_norm=1.0, epsilon=4.0)
    try:
        ledger = privacy_ledger(config, **values)
    except ValueError as error:
        _rejects_clearly(error, LEDGER_SETTINGS)
        return
    format_ledger(ledger)


def _as_argument(value: object) -> str:
    """How a value reaches a ``key=value`` command line: its text."""
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(map(str, value)) + "]"
    return str(value)


@pytest.mark.parametrize("key", (*LEDGER_SETTINGS, *NOISE_FIELDS))
@_fuzz(10)
@given(value=WILD)
def test_nemo_noise_ledger_arguments_work_or_are_refused_by_name(key, value):
    from nemo_noise_plugin.cli.nemo_noise import run_ledger

    arguments = {"config": "dp_gaussian_mechanism", "sequence_length": "8", key: _as_argument(value)}
    try:
        run_ledger([f"{name}={text}" for name, text in arguments.items()])
    except ValueError as error:
        _rejects_clearly(error, (key,))


AUDIT_KEYS = ("tokens", "max_length", "task_sequences", "epochs", "vocab_chunk", "query_chunk", "neighbour_sample")
AUDIT_KEYS = (*AUDIT_KEYS, "attacks", "device", "task_loss", "sweep", "model")


@pytest.mark.parametrize("key", tuple(dict.fromkeys((*AUDIT_KEYS, *NOISE_FIELDS))))
@_fuzz(10)
@given(value=WILD)
def test_nemo_noise_audit_arguments_work_or_are_refused_by_name(key, value, tmp_path_factory):
    from nemo_noise_plugin.jobs.audit.settings import parse_audit_arguments

    output = tmp_path_factory.getbasetemp() / "audit_out"  # checked writable, never created
    arguments = {"model": "tiny", "sweep": "alpha:1,5", "output_dir": str(output), key: _as_argument(value)}
    try:
        parse_audit_arguments([f"{name}={text}" for name, text in arguments.items()])
    except ValueError as error:
        _rejects_clearly(error, (key, "field:level", "sweep"))


AUDIT_ARGUMENTS = ("confidence", "candidates", "beam_width", "vocab_chunk", "query_chunk", "rare_quantile")


@pytest.mark.parametrize("name", AUDIT_ARGUMENTS)
@FUZZ
@given(value=WILD)
def test_the_audits_python_arguments_work_or_are_refused_by_name(name, value):
    from nemo_noise_plugin.privacy.audit import audit

    generator = torch.Generator().manual_seed(0)
    table, token_ids = torch.randn(16, 8, generator=generator), torch.randint(0, 16, (2, 4), generator=generator)
    try:
        audit(table, token_ids, NoiseConfig(alpha=5.0, scaling="absolute"), **{name: value})
    except ValueError as error:
        _rejects_clearly(error, (name,))


@pytest.fixture(scope="module")
def distillation_config(megatron_cpu):
    """The tiny distillation recipe (a noisy student, KD) in a module-wide temporary folder."""
    from nemo_noise_plugin.recipes import tiny_noise_distillation_config

    with tempfile.TemporaryDirectory() as folder:
        yield lambda: tiny_noise_distillation_config(dir=folder)


@_fuzz(100)
@given(field=st.sampled_from((*(f"noise.{n}" for n in NOISE_FIELDS), *(f"kd.{n}" for n in KD_FIELDS))), value=WILD)
@example(field="kd.temperature", value=1e7)
@example(field="noise.alpha", value=1e300)
@example(field="noise.enabled", value=["", ""])  # Hydra cannot parse "[, ]": the refusal names the override
def test_command_line_overrides_work_or_are_refused_by_name(distillation_config, field, value):
    """``nemo llm finetune ... model.noise.alpha=<text>``: Bridge's Hydra path plus the plugin's checks."""
    from nemo_noise_plugin.training.overrides import apply_overrides, validate_plugin_settings

    config = distillation_config()
    override = f"model.{field}={_as_argument(value)}"
    try:
        apply_overrides(config, [override])
        validate_plugin_settings(config)
    except ValueError as error:
        _rejects_clearly(error, (f"model.{field}", field.partition(".")[2]))
        return
    config.model.noise.validate()
    config.model.kd.validate()
