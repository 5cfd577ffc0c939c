"""The noise-family registry is the one place a mechanism is described; the config's names are views of it."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from nemo_noise_plugin.noise.config import (
    LENGTH_SCALED_MECHANISMS,
    MAGNITUDE_FIELDS,
    MECHANISMS,
    PRIVACY_MECHANISMS,
    NoiseConfig,
    NoiseMechanism,
    load_noise_config,
)
from nemo_noise_plugin.noise.densities import NOISE_DENSITIES
from nemo_noise_plugin.noise.families import NOISE_FAMILIES, noise_family
from nemo_noise_plugin.noise.sampling import UNIT_SAMPLERS
from nemo_noise_plugin.privacy.audit.sweep import SWEEP_FIELDS
from nemo_noise_plugin.privacy.ledger import LEDGERS, privacy_ledger

FAMILIES = list(NOISE_FAMILIES)
CONFIG_FIELDS = {field.name for field in dataclasses.fields(NoiseConfig)}


def test_the_mechanism_literal_lists_the_registry_in_its_order():
    assert typing.get_args(NoiseMechanism) == tuple(NOISE_FAMILIES)


def test_the_config_names_are_views_of_the_registry():
    assert MECHANISMS == (
        "uniform",
        "gaussian",
        "metric_dp",
        "gaussian_mechanism",
        "quantization",
        "relative",
        "laplace",
    )
    assert PRIVACY_MECHANISMS == ("metric_dp", "gaussian_mechanism", "laplace")
    assert LENGTH_SCALED_MECHANISMS == ("uniform", "gaussian")
    assert MAGNITUDE_FIELDS == {
        "uniform": "alpha",
        "gaussian": "sigma",
        "metric_dp": "eta",
        "gaussian_mechanism": "epsilon",
        "quantization": "quantization_step",
        "relative": "relative_scale",
        "laplace": "laplace_scale",
    }
    assert SWEEP_FIELDS == {name: family.sweep_fields for name, family in NOISE_FAMILIES.items()}


@pytest.mark.parametrize("name", FAMILIES)
def test_every_family_names_a_preset_of_its_own_mechanism(name):
    config = load_noise_config(NOISE_FAMILIES[name].preset)
    assert config.mechanism == name and config.is_active_configuration


@pytest.mark.parametrize("name", FAMILIES)
def test_every_field_a_family_names_is_a_noise_config_field(name):
    family = NOISE_FAMILIES[name]
    assert family.name == name
    assert {family.magnitude_field, *family.sweep_fields} <= CONFIG_FIELDS
    assert family.cli_flag is None or (family.cli_flag == family.magnitude_field and family.cli_help)
    assert family.magnitude_field in family.sweep_fields


@pytest.mark.parametrize("name", FAMILIES)
def test_every_family_points_to_rows_of_the_building_block_tables(name):
    family = NOISE_FAMILIES[name]
    sampler = UNIT_SAMPLERS[family.unit]
    density = NOISE_DENSITIES[family.attacker_density]
    assert family.accounting is None or family.accounting in LEDGERS
    assert not (sampler.kernel and sampler.std is None)  # the fused kernel draws per-coordinate units only
    assert (density.unit_std is None) == (sampler.std is None)  # a whole-vector unit is scored by its own density
    assert family.density_factor() > 0


def test_metric_dp_has_one_name_in_every_table():
    family = NOISE_FAMILIES["metric_dp"]
    assert (family.unit, family.attacker_density, family.accounting) == ("metric_dp",) * 3
    assert "d_chi" not in {*UNIT_SAMPLERS, *NOISE_DENSITIES, *LEDGERS}


@pytest.mark.parametrize("name", FAMILIES)
def test_a_family_with_accounting_has_a_ledger_and_the_others_say_there_is_none(name):
    family = NOISE_FAMILIES[name]
    config = load_noise_config(family.preset)
    if family.clip != "never":
        config = dataclasses.replace(config, clip_norm=1.0)
    ledger = privacy_ledger(config, sequence_length=8, hidden_size=64)
    assert ledger.has_formal_guarantee == (family.accounting is not None)
    assert family.accounting is None or family.privacy_mechanism  # an accounted level is calibrated once


def test_an_unknown_mechanism_lists_the_families():
    with pytest.raises(ValueError, match="mechanism='cauchy' is invalid: expected one of uniform, gaussian, metric_dp"):
        noise_family("cauchy")
