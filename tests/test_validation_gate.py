"""One validation gate on every path (issues 26, 36): the noise and KD settings are checked as they are *now*.

``NoiseConfig``/``KDConfig`` validate in ``__post_init__``, but an assignment after construction skips it. It is
caught at the config's one gate (issue 36): Bridge's ``ConfigContainer.validate()`` (through the plugin providers'
``finalize``), or ``make_noisy`` for a model built without Bridge. Values that silently disable a
feature are refused (a KD temperature at which the softened softmax saturates in float32) or warned about in one
line (an enabled noise of magnitude 0, a KD that weighs nothing).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from nemo_noise_plugin.distillation.config import MAX_TEMPERATURE, MIN_TEMPERATURE, KDConfig
from nemo_noise_plugin.noise.config import NoiseConfig


@pytest.fixture(scope="module")
def recipes(megatron_cpu):
    from nemo_noise_plugin import recipes

    return recipes


def test_bridges_validate_refuses_a_kd_temperature_of_0_assigned_after_construction(recipes, tmp_path):
    config = recipes.tiny_noise_distillation_config(dir=str(tmp_path))
    config.model.kd.temperature = 0
    with pytest.raises(ValueError, match=r"KDConfig\.temperature=0 is invalid: expected a finite number > 0"):
        config.validate()


def test_bridges_validate_refuses_a_negative_alpha_assigned_after_construction(recipes, tmp_path):
    config = recipes.tiny_noise_sft_config(dir=str(tmp_path))
    config.model.noise.alpha = -1
    with pytest.raises(ValueError, match=r"NoiseConfig\.alpha=-1 is invalid: expected a finite number >= 0"):
        config.validate()


def test_bridges_validate_refuses_a_noise_that_is_no_longer_a_noise_config(recipes, tmp_path):
    config = recipes.tiny_noise_distillation_config(dir=str(tmp_path))
    config.model.noise.enabled = "no"
    with pytest.raises(ValueError, match=r"NoiseConfig\.enabled='no' is invalid: expected true or false"):
        config.validate()


def test_bridges_validate_still_passes_a_valid_config_without_warnings(recipes, tmp_path):
    config = recipes.tiny_noise_distillation_config(dir=str(tmp_path))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*(adds no noise|distils nothing).*")
        config.validate()


def test_a_kd_temperature_of_1e_30_is_refused_with_the_allowed_range():
    allowed = r"expected a finite number in \[0\.0125, 1e\+06\]: below 0\.0125 the softened softmax is one-hot"
    with pytest.raises(ValueError, match=rf"KDConfig\.temperature=1e-30 is invalid: {allowed}"):
        KDConfig(temperature=1e-30)
    with pytest.raises(ValueError, match=r"KDConfig\.temperature=1e\+30 is invalid"):
        KDConfig(temperature=1e30)
    assert KDConfig(temperature=MIN_TEMPERATURE).temperature == MIN_TEMPERATURE
    assert KDConfig(temperature=MAX_TEMPERATURE).kd_scale == MAX_TEMPERATURE**2


def test_the_temperature_bound_is_where_the_softened_softmax_leaves_float32s_normal_range():
    """Logits one unit apart: at the lowest allowed T the smaller probability is still a normal float32 number
    (the KD gradient carries it); just below float32's normal range (T = 1/88) it is not, and at 1e-30 it is 0."""
    logits = torch.tensor([1.0, 0.0])
    tiny = torch.finfo(torch.float32).tiny

    def smaller_probability(temperature: float) -> float:
        return float(torch.softmax(logits / temperature, dim=-1)[1])

    assert smaller_probability(MIN_TEMPERATURE) >= tiny
    assert smaller_probability(1 / 88) < tiny
    assert smaller_probability(1e-30) == 0.0
    assert 1 / MIN_TEMPERATURE < -math.log(tiny) < 88


def test_make_noisy_refuses_settings_assigned_after_construction_and_leaves_the_model_plain(megatron_cpu):
    from megatron.core.models.gpt.gpt_model import GPTModel

    from nemo_noise_plugin.model import make_noisy
    from tests.support.models import build_tiny_gpt

    model = build_tiny_gpt()
    for field, value, message in (
        ("alpha", -5, r"NoiseConfig\.alpha=-5 is invalid: expected a finite number >= 0"),
        ("mechanism", "gausian", r"NoiseConfig\.mechanism='gausian' is invalid: expected one of uniform, gaussian"),
        ("enabled", "no", r"NoiseConfig\.enabled='no' is invalid: expected true or false"),
    ):
        config = NoiseConfig()
        setattr(config, field, value)
        with pytest.raises(ValueError, match=message):
            make_noisy(model, config)
        assert type(model) is GPTModel and not hasattr(model, "noise_layer")


def test_the_audit_is_its_own_gate_and_refuses_settings_assigned_after_construction():
    from nemo_noise_plugin.privacy.audit import audit

    config = NoiseConfig(alpha=5.0)
    config.tokens = "answers"
    table, token_ids = torch.randn(16, 8), torch.randint(0, 16, (2, 4))
    with pytest.raises(ValueError, match=r"NoiseConfig\.tokens='answers' is invalid: expected one of all, prompt"):
        audit(table, token_ids, config)


def test_an_enabled_noise_of_magnitude_0_warns_in_one_line_when_the_run_is_validated(recipes, tmp_path):
    config = recipes.tiny_noise_sft_config(dir=str(tmp_path), noise=NoiseConfig(alpha=0.0))
    with pytest.warns(UserWarning, match=r"^NoiseConfig\.alpha=0\.0 with enabled=True adds no noise") as caught:
        config.validate()
    assert ["\n" in str(warning.message) for warning in caught] == [False] * len(caught)


def test_a_disabled_noise_of_magnitude_0_does_not_warn(recipes, tmp_path):
    config = recipes.tiny_noise_sft_config(dir=str(tmp_path), noise=NoiseConfig(enabled=False, alpha=0.0))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*adds no noise.*")
        config.validate()


def test_a_kd_that_weighs_nothing_warns_in_one_line_when_the_run_is_validated(recipes, tmp_path):
    config = recipes.tiny_noise_distillation_config(dir=str(tmp_path), kd=KDConfig(kd_weight=0.0))
    with pytest.warns(UserWarning, match=r"^KDConfig\.kd_weight=0 with enabled=True and hidden_weight=0 distils"):
        config.validate()
