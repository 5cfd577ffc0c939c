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
