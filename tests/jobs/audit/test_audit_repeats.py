"""An audit sweep level or attack given twice is refused naming it (issue 36, finding 8): before, ``sweep=alpha:1,1``,
``sweep=metric_dp/eta:10;metric_dp/eta:10`` and ``attacks=nn_l2,nn_l2`` each wrote the same rows twice."""

from __future__ import annotations

import pytest

from nemo_noise_plugin.jobs.audit.settings import parse_audit_arguments
from nemo_noise_plugin.privacy.audit.sweep import Sweep, parse_sweeps
from nemo_noise_plugin.validation import SettingError


@pytest.mark.parametrize(
    ("text", "repeated"),
    [
        ("alpha:1,1", "uniform/alpha:1"),
        ("alpha:1,5,1.0", "uniform/alpha:1"),
        ("metric_dp/eta:10;metric_dp/eta:10", "metric_dp/eta:10"),
        ("alpha:1,5;uniform/alpha:5,10", "uniform/alpha:5"),
    ],
)
def test_a_sweep_level_given_twice_is_refused_naming_it(text, repeated):
    with pytest.raises(SettingError) as refused:
        parse_sweeps(text, "uniform")
    assert str(refused.value) == (
        f"sweep={text!r} is invalid: expected each level once: {repeated} is given more than once."
    )


def test_the_same_level_of_two_fields_or_mechanisms_is_two_sweeps():
    assert parse_sweeps("alpha:1;gaussian/sigma:1", "uniform") == [
        Sweep("uniform", "alpha", (1.0,)),
        Sweep("gaussian", "sigma", (1.0,)),
    ]


def test_an_attack_given_twice_is_refused_naming_it(tmp_path):
    arguments = ["model=tiny", "mechanism=uniform", "sweep=alpha:1,5", f"output_dir={tmp_path}"]
    with pytest.raises(SettingError) as refused:
        parse_audit_arguments([*arguments, "attacks=nn_l2,nn_cosine,nn_l2"])
    assert str(refused.value) == (
        "attacks='nn_l2,nn_cosine,nn_l2' is invalid: expected each attack once: nn_l2 is given more than once."
    )
    assert parse_audit_arguments([*arguments, "attacks=nn_l2,nn_cosine"])["attacks"] == ("nn_l2", "nn_cosine")
