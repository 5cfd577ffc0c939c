"""NoisyGPTModelProvider: Bridge's GPTModelProvider with the noise settings as a field."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.process_groups_config import ProcessGroupCollection

from nemo_noise_plugin.model import NoisyGPTModel
from nemo_noise_plugin.noise.config import NoiseConfig
from tests.support.models import TINY_CPU_TRANSFORMER_SETTINGS


@pytest.fixture(scope="module")
def providers(megatron_cpu):
    from nemo_noise_plugin import providers

    return providers


def _cpu_provider(provider_class, **overrides):
    settings = dict(
        TINY_CPU_TRANSFORMER_SETTINGS,
        vocab_size=256,
        seq_length=32,
        make_vocab_size_divisible_by=128,
        transformer_layer_spec=get_gpt_layer_local_spec(),
    )
    settings.update(overrides)
    provider = provider_class(**settings)
    provider.finalize()
    provider._pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    return provider


def test_noise_is_a_dataclass_field_of_a_bridge_gpt_provider(providers):
    field_names = [f.name for f in dataclasses.fields(providers.NoisyGPTModelProvider)]
    assert "noise" in field_names and "hidden_size" in field_names
    assert issubclass(providers.NoisyGPTModelProvider, providers.GPTModelProvider)


def test_provide_builds_a_noisy_model_carrying_the_providers_settings(providers):
    provider = _cpu_provider(providers.NoisyGPTModelProvider, noise=NoiseConfig(alpha=5.0))
    provider.noise.alpha = 10.0  # what an override of model.noise.alpha does
    model = provider.provide()
    assert type(model) is NoisyGPTModel
    assert model.noise_config.alpha == 10.0


def test_noisy_and_plain_providers_build_models_with_the_same_weights_layout(providers):
    torch.manual_seed(3)
    noisy = _cpu_provider(providers.NoisyGPTModelProvider).provide()
    plain = _cpu_provider(providers.GPTModelProvider).provide()
    assert type(plain) is GPTModel
    assert list(noisy.state_dict()) == list(plain.state_dict())


def test_a_noise_field_that_is_not_a_noise_config_is_rejected_before_building(providers):
    provider = _cpu_provider(providers.NoisyGPTModelProvider)
    provider.noise = {"alpha": 5}
    with pytest.raises(TypeError, match="NoisyGPTModelProvider.noise must be a NoiseConfig, got dict"):
        provider.provide()


def test_core_attention_sdpa_reaches_every_layer_although_bridge_resets_local_specs(providers):
    """Bridge's ``provide`` puts ``DotProductAttention`` back into a local spec (``attention_backend=local``): the
    provider's ``core_attention='sdpa'`` turns it into ``SDPADotProductAttention`` after the build, student and clean
    teacher alike, and leaves the weights as they were."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnBackend

    from nemo_noise_plugin.distillation.config import KDConfig
    from nemo_noise_plugin.distillation.teacher_weights import attached_teacher
    from nemo_noise_plugin.model.sdpa_attention import SDPADotProductAttention

    def core_attentions(model):
        return [type(m) for m in model.modules() if isinstance(m, DotProductAttention)]

    local = dict(attention_backend=AttnBackend.local)
    torch.manual_seed(3)
    unfused = _cpu_provider(providers.NoisyGPTModelProvider, **local).provide()
    torch.manual_seed(3)
    sdpa = _cpu_provider(providers.NoisyGPTModelProvider, core_attention="sdpa", **local).provide()
    assert core_attentions(unfused) == [DotProductAttention] * 2
    assert core_attentions(sdpa) == [SDPADotProductAttention] * 2
    pairs = zip(unfused.state_dict().values(), sdpa.state_dict().values(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs if isinstance(a, torch.Tensor))  # (extra states are None)
    distillation = providers.NoisyDistillationProvider
    (student,) = _cpu_provider(distillation, core_attention="sdpa", kd=KDConfig(), **local).provide_distributed_model(
        use_cpu_initialization=True, wrap_with_ddp=False, mixed_precision_wrapper=None
    )  # the teacher is copied from the built student here

    assert core_attentions(student) == [SDPADotProductAttention] * 2
    assert core_attentions(attached_teacher(student)) == [SDPADotProductAttention] * 2


def test_an_unknown_core_attention_is_refused_at_finalize(providers):
    from nemo_noise_plugin.validation import SettingError

    message = r"NoisyGPTModelProvider\.core_attention='flash' is invalid: expected one of unfused, sdpa"
    with pytest.raises(SettingError, match=message):
        _cpu_provider(providers.NoisyGPTModelProvider, core_attention="flash")


@pytest.mark.parametrize("legacy_scope", [False, True], ids=["cuda_graph_impl", "legacy_cuda_graph_scope"])
def test_a_full_iteration_cuda_graph_builds_a_model_with_replayable_noise_keys(providers, legacy_scope):
    """Bridge replays one captured step: the noisy model then reads its noise keys from device memory (published
    before each step by PublishNoiseStep), so every replay adds its own step's noise (tests/gpu: an H100 run)."""
    graph = {"cuda_graph_scope": "full_iteration"} if legacy_scope else {"cuda_graph_impl": "full_iteration"}
    graphed = _cpu_provider(providers.NoisyGPTModelProvider, use_te_rng_tracker=True, **graph)
    assert graphed.cuda_graph_impl == "full_iteration" and graphed.replays_training_steps
    assert graphed.provide().noise_layer.replayable_step is not None
    eager = _cpu_provider(providers.NoisyGPTModelProvider)
    assert not eager.replays_training_steps
    assert eager.provide().noise_layer.replayable_step is None
