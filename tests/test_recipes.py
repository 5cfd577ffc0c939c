"""The tiny recipes: Bridge ConfigContainers around the plugin's providers that pass Bridge's own validation."""

from __future__ import annotations

import pytest

from nemo_noise_plugin.distillation.kd_config import KDConfig
from nemo_noise_plugin.noise.config import NoiseConfig


@pytest.fixture(scope="module")
def recipes(megatron_cpu):
    from nemo_noise_plugin import recipes

    return recipes


def test_tiny_noise_sft_recipe_is_a_valid_bridge_config_with_a_noisy_provider(recipes, tmp_path):
    from nemo_noise_plugin.providers import NoisyGPTModelProvider

    config = recipes.tiny_noise_sft_config(dir=str(tmp_path), train_iters=10, noise=NoiseConfig(alpha=15.0))
    config.validate()
    assert type(config.model) is NoisyGPTModelProvider
    assert config.model.noise.alpha == 15.0
    assert config.checkpoint.save == str(tmp_path / "tiny_noise_sft" / "checkpoints")
    assert config.train.train_iters == 10


def test_tiny_distillation_recipe_carries_the_kd_settings(recipes, tmp_path):
    from nemo_noise_plugin.distillation.provider import NoisyDistillationProvider

    config = recipes.tiny_noise_distillation_config(dir=str(tmp_path), kd=KDConfig(loss="jsd", temperature=2.0))
    config.validate()
    assert type(config.model) is NoisyDistillationProvider
    assert (config.model.kd.loss, config.model.kd.temperature) == ("jsd", 2.0)
    assert config.model.pipeline_model_parallel_size == 1
