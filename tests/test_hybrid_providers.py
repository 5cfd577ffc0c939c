"""The hybrid providers (issue 35): Bridge's ``HybridModelProvider`` with the plugin's noise and distillation halves.

Real Bridge providers building real Megatron-Core ``HybridModel`` chunks on a single-process gloo group, with the
plugin's local hybrid stack (attention and MLP layers; Mamba layers need CUDA kernels).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from megatron.core.models.hybrid.hybrid_model import HybridModel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnBackend

from nemo_noise_plugin.distillation.config import KDConfig
from nemo_noise_plugin.model.hybrid import NoisyHybridModel
from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.validation import SettingError
from tests.support.attention_variables import clean_attention_variables
from tests.support.models import TINY_CPU_TRANSFORMER_SETTINGS

PATTERN = "*-*-"


@pytest.fixture(scope="module")
def hybrid(megatron_cpu):
    from nemo_noise_plugin.providers import hybrid

    return hybrid


@pytest.fixture(autouse=True)
def _clean_attention_variables():
    """Megatron pins the attention backend process-wide (``NVTE_*``): earlier tests in this process may have pinned
    another one, and these models use the local backend; start from no variables, give later tests theirs back."""
    with clean_attention_variables():
        yield


def _settings(hybrid, **overrides) -> dict:
    settings = {name: value for name, value in TINY_CPU_TRANSFORMER_SETTINGS.items() if name != "num_layers"}
    settings.update(
        hybrid_layer_pattern=PATTERN,
        hybrid_stack_spec=hybrid.local_hybrid_stack_spec,
        attention_backend=AttnBackend.local,
        position_embedding_type="rope",
        vocab_size=256,
        seq_length=32,
        bf16=False,
        params_dtype=torch.float32,
    )
    settings.update(overrides)
    return settings


def _finalized(provider):
    provider.finalize()
    provider._pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    return provider


def test_the_hybrid_providers_are_bridge_hybrid_providers_with_the_plugin_fields(hybrid):
    from nemo_noise_plugin import providers

    assert providers.NoisyHybridModelProvider is hybrid.NoisyHybridModelProvider  # importable from providers
    assert issubclass(hybrid.NoisyHybridModelProvider, hybrid.HybridModelProvider)
    assert issubclass(hybrid.NoisyHybridDistillationProvider, hybrid.NoisyHybridModelProvider)
    names = [f.name for f in dataclasses.fields(hybrid.NoisyHybridDistillationProvider)]
    assert {"noise", "kd", "teacher_checkpoint", "hybrid_layer_pattern", "mamba_num_groups"} <= set(names)
    assert names[-5:] == ["noise", "core_attention", "kd", "teacher_shares_frozen_modules", "teacher_checkpoint"]


def test_provide_builds_a_noisy_hybrid_model_with_the_noise_set_after_construction(hybrid):
    provider = _finalized(hybrid.NoisyHybridModelProvider(**_settings(hybrid), noise=NoiseConfig(alpha=5.0)))
    provider.noise.alpha = 10.0  # what model.noise.alpha=10 does
    model = provider.provide()
    assert type(model) is NoisyHybridModel
    assert model.noise_config.alpha == 10.0
    assert model.hybrid_layer_pattern == PATTERN and len(model.decoder.layers) == 4


def test_noisy_and_plain_hybrid_providers_build_the_same_weights_layout(hybrid):
    noisy = _finalized(hybrid.NoisyHybridModelProvider(**_settings(hybrid))).provide()
    plain = _finalized(hybrid.HybridModelProvider(**_settings(hybrid))).provide()
    assert type(plain) is HybridModel
    assert list(noisy.state_dict()) == list(plain.state_dict())


def test_a_noise_that_is_not_a_noise_config_is_refused_before_building(hybrid):
    provider = _finalized(hybrid.NoisyHybridModelProvider(**_settings(hybrid)))
    provider.noise = {"alpha": 5}
    with pytest.raises(TypeError, match="NoisyHybridModelProvider.noise must be a NoiseConfig, got dict"):
        provider.provide()


def test_finalize_refuses_a_negative_alpha_assigned_after_construction(hybrid):
    provider = hybrid.NoisyHybridModelProvider(**_settings(hybrid))
    provider.noise.alpha = -1
    with pytest.raises(SettingError, match=r"NoiseConfig\.alpha=-1 is invalid: expected a finite number >= 0"):
        provider.finalize()


@pytest.mark.parametrize("pattern", ["*x-", "", "|"])
def test_a_layer_pattern_megatron_cannot_parse_is_a_setting_error_at_finalize(hybrid, pattern):
    provider = hybrid.NoisyHybridModelProvider(**_settings(hybrid, hybrid_layer_pattern=pattern))
    with pytest.raises(SettingError) as caught:
        provider.finalize()
    assert caught.value.setting == "NoisyHybridModelProvider.hybrid_layer_pattern" and caught.value.value == pattern
    assert "e.g. '*-*-' or 'M*-'" in str(caught.value)


def test_num_layers_other_than_the_patterns_length_is_a_setting_error(hybrid):
    provider = hybrid.NoisyHybridModelProvider(**_settings(hybrid, num_layers=3))
    with pytest.raises(SettingError, match=r"num_layers=3 is invalid with hybrid_layer_pattern='\*-\*-': expected "):
        provider.finalize()


def test_virtual_pipeline_stages_are_refused_before_building(hybrid):
    provider = hybrid.NoisyHybridModelProvider(**_settings(hybrid, virtual_pipeline_model_parallel_size=2))
    with pytest.raises(SettingError, match=r"virtual_pipeline_model_parallel_size=2 is invalid: expected None"):
        provider.validate_noise()


@pytest.mark.skipif(
    __import__("importlib").util.find_spec("mamba_ssm") is not None and torch.cuda.is_available(),
    reason="the Mamba kernels are here: tests/gpu/test_hybrid_sft_gpu.py builds Mamba layers",
)
def test_mamba_layers_without_their_kernels_are_a_clear_error_naming_what_is_missing(hybrid):
    provider = _finalized(hybrid.NoisyHybridModelProvider(**_settings(hybrid, hybrid_layer_pattern="M*-")))
    with pytest.raises(RuntimeError, match=r"hybrid_layer_pattern='M\*-' cannot be built here\. Mamba layers \(M\)"):
        provider.provide()
    assert "mamba_ssm is not installed" in hybrid.mamba_kernels_missing()


def test_each_hybrid_student_chunk_carries_a_clean_frozen_hybrid_teacher(hybrid):
    from nemo_noise_plugin.distillation.teacher_weights import attached_teacher

    provider = _finalized(hybrid.NoisyHybridDistillationProvider(**_settings(hybrid), kd=KDConfig()))
    (student,) = provider.provide_distributed_model(
        use_cpu_initialization=True, wrap_with_ddp=False, mixed_precision_wrapper=None
    )
    teacher = attached_teacher(student)
    assert type(student) is NoisyHybridModel and type(teacher) is HybridModel
    assert all(not p.requires_grad for p in teacher.parameters()) and not teacher.training
    assert not any(module is teacher for module in student.modules())
    assert teacher.pg_collection is student.pg_collection and teacher.config is student.config  # shared, not copied
    assert teacher.state_dict().keys() == student.state_dict().keys()
    for name, value in student.state_dict().items():
        if torch.is_tensor(value):
            assert torch.equal(value, teacher.state_dict()[name]), name
            assert value.data_ptr() != teacher.state_dict()[name].data_ptr() or value.numel() == 0, name


def test_kd_hidden_layers_are_checked_against_the_patterns_layers_before_finalize(hybrid):
    provider = hybrid.NoisyHybridDistillationProvider(
        **_settings(hybrid), kd=KDConfig(hidden_loss="mse", hidden_layers=[4], hidden_weight=1.0)
    )
    assert provider.num_layers is None  # derived from the pattern only at finalize
    outside = r"KDConfig\.hidden_layers=\[4\] is invalid with num_layers=4: expected layer indices in 0\.\.3"
    with pytest.raises(ValueError, match=outside):
        provider.validate_distillation()


def test_overrides_reach_the_hybrid_providers_and_are_checked_by_the_same_gate(hybrid, tmp_path):
    from nemo_noise_plugin.recipes.hybrid import tiny_hybrid_noise_distillation_config
    from nemo_noise_plugin.training.overrides import ConfigOverrideError, apply_overrides

    config = tiny_hybrid_noise_distillation_config(dir=str(tmp_path))
    apply_overrides(config, ["model.noise.alpha=3", "model.kd.temperature=2", "model.hybrid_layer_pattern=*-"])
    model = config.model
    assert (model.noise.alpha, model.kd.temperature, model.hybrid_layer_pattern) == (3.0, 2.0, "*-")
    outside = r"model\.kd\.hidden_layers=\[5\] is invalid with num_layers=2: expected layer indices in 0\.\.1"
    with pytest.raises(ConfigOverrideError, match=outside):
        apply_overrides(config, ["model.kd.hidden_loss=mse", "model.kd.hidden_weight=1", "model.kd.hidden_layers=[5]"])
    with pytest.raises(ConfigOverrideError, match=r"model\.noise\.alpha=-2 is invalid"):
        apply_overrides(config, ["model.noise.alpha=-2"])


def test_the_launcher_picks_the_distillation_step_for_a_hybrid_distillation_provider(hybrid, tmp_path):
    from nemo_noise_plugin.jobs.launch.launcher import forward_step_for
    from nemo_noise_plugin.recipes.hybrid import tiny_hybrid_noise_distillation_config, tiny_hybrid_noise_sft_config
    from nemo_noise_plugin.training.forward_step import distillation_forward_step, noise_forward_step

    assert forward_step_for(tiny_hybrid_noise_distillation_config(dir=str(tmp_path))) is distillation_forward_step
    assert forward_step_for(tiny_hybrid_noise_sft_config(dir=str(tmp_path))) is noise_forward_step
