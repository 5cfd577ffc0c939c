"""Type messages say what is wrong with the value's type (issue 36, finding 9), not "expected a number" for a number.

numpy, torch, Decimal and Fraction numbers, quoted YAML values and bools are refused (the configs hold plain Python
values, which YAML and Hydra give) with the reason and the conversion; a 400-digit integer is shown shortened.
"""

from __future__ import annotations

import decimal
import fractions

import numpy as np
import pytest
import torch

from nemo_noise_plugin.distillation.config import KDConfig
from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.validation import SettingError


@pytest.mark.parametrize(
    "value, reason",
    [
        (np.float32(5.0), r"it is a numpy\.float32, not a Python number; pass float\(\.\.\.\) of it"),
        (torch.tensor(5.0), r"it is a torch\.Tensor, not a Python number; pass float"),
        (decimal.Decimal("5"), r"it is a decimal\.Decimal, not a Python number"),
        (fractions.Fraction(5), r"it is a fractions\.Fraction, not a Python number"),
        ("5", r"'5' is a string \(quoted\?\); write the number without quotes"),
        (True, r"True is a bool, not a number"),
        (
            10**400,
            r"it is larger than any float",
        ),
    ],
    ids=["numpy", "torch", "decimal", "fraction", "quoted", "bool", "huge"],
)
def test_a_number_of_the_wrong_type_is_named_with_its_type(value, reason):
    """(np.float64 is a Python float and is taken as one.)"""
    with pytest.raises(
        SettingError, match=r"^NoiseConfig\.alpha=.* is invalid: expected a finite number >= 0: " + reason
    ):
        NoiseConfig(alpha=value)


def test_integers_booleans_and_kd_settings_say_the_same():
    with pytest.raises(SettingError, match=r"seed=5\.0 is invalid: .*: 5\.0 is a float; write an integer\.$"):
        NoiseConfig(seed=5.0)
    with pytest.raises(SettingError, match=r"seed=np\.int64\(3\) is invalid: .*numpy\.int64, not a Python integer; "):
        NoiseConfig(seed=np.int64(3))
    with pytest.raises(SettingError, match=r"enabled='false' is invalid: expected true or false: 'false' is a string"):
        NoiseConfig(enabled="false")
    with pytest.raises(SettingError, match=r"KDConfig\.temperature=np\.float32\(2\.0\) is invalid: .*numpy\.float32"):
        KDConfig(temperature=np.float32(2.0))
    shortened = r"^NoiseConfig\.alpha=1" + "0" * 39 + r"\.\.\." + "0" * 12 + r" \(401 characters\) is invalid"
    with pytest.raises(SettingError, match=shortened):
        NoiseConfig(alpha=10**400)


def test_a_plain_value_out_of_range_gets_no_type_note():
    with pytest.raises(SettingError, match=r"^NoiseConfig\.alpha=-1\.0 is invalid: expected a finite number >= 0\.$"):
        NoiseConfig(alpha=-1.0)


def test_text_that_is_no_number_even_unquoted_gets_no_quoting_hint():
    """``alpha=abc`` is not a quoted number: "write the number without quotes" would send the user the wrong way."""
    with pytest.raises(SettingError, match=r"^NoiseConfig\.alpha='abc' is invalid: expected a finite number >= 0\.$"):
        NoiseConfig(alpha="abc")
    with pytest.raises(SettingError, match=r"enabled='maybe' is invalid: expected true or false\.$"):
        NoiseConfig(enabled="maybe")
