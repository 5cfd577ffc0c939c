"""The main job's noise flags come from the family registry: one flag per family that names one, checked per use."""

from __future__ import annotations

import pytest

from nemo_noise_plugin.cli.main_job import build_noise_config, parse_args
from nemo_noise_plugin.noise.families import NOISE_FAMILIES

FLAGGED = [name for name, family in NOISE_FAMILIES.items() if family.cli_flag]


def test_the_flagged_families_are_neftune_gaussian_and_laplace():
    assert FLAGGED == ["uniform", "gaussian", "laplace"]


@pytest.mark.parametrize("name", FLAGGED)
def test_each_family_flag_sets_its_magnitude_field(name):
    family = NOISE_FAMILIES[name]
    option = "--" + family.cli_flag.replace("_", "-")
    noise = build_noise_config(parse_args(["--mechanism", name, option, "0.25"]))
    assert noise.mechanism == name and getattr(noise, family.magnitude_field) == 0.25


def test_a_flag_of_another_family_is_an_error_naming_the_flag_and_the_field_to_use():
    with pytest.raises(ValueError, match=r"--laplace-scale=0.2 is not used by mechanism 'uniform' \(only by laplace\)"):
        build_noise_config(parse_args(["--laplace-scale", "0.2"]))
    with pytest.raises(ValueError, match=r"--scaling=absolute is not used by mechanism 'laplace' \(only by uniform"):
        build_noise_config(parse_args(["--mechanism", "laplace", "--scaling", "absolute"]))
