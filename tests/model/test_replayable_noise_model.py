"""A noisy GPT model with replayable noise keys (``init_noise(..., replayable=True)``): the same losses, gradients
and clock as the eager keys through the real Megatron-Core model, with the noise in the lookup and on the output."""

from __future__ import annotations

import pytest
import torch

from nemo_noise_plugin.model import NoisyGPTModel
from nemo_noise_plugin.noise.config import NoiseConfig
from tests.support.models import build_tiny_gpt, masked_mean_loss

NOISE = {
    "neftune_linear_schedule": NoiseConfig(alpha=5.0, schedule="linear", warmup_steps=1, decay_steps=4),
    "gaussian_prompt_only": NoiseConfig(mechanism="gaussian", sigma=3.0, tokens="prompt"),
    "metric_dp": NoiseConfig(mechanism="metric_dp", eta=20.0),
}


def _twins(noise: NoiseConfig, fuse: bool):
    """Two noisy models with identical weights: eager noise keys, and replayable ones."""
    twins = []
    for replayable in (False, True):
        torch.manual_seed(11)
        model = build_tiny_gpt(model_class=NoisyGPTModel, noise_config=noise)
        model.init_noise(noise, replayable=replayable)
        model.fuse_noise_into_lookup = fuse
        twins.append(model)
    return twins


@pytest.mark.parametrize("fuse", [True, False], ids=["lookup", "output"])
@pytest.mark.parametrize("name", list(NOISE))
def test_replayable_keys_give_bit_identical_losses_gradients_and_clock(megatron_cpu, batch, name, fuse):
    eager, replayable = _twins(NOISE[name], fuse)
    for iteration in range(3):
        losses = []
        for model in (eager, replayable):
            model.noise_clock.start_iteration(iteration)
            if model is replayable:
                model.publish_noise_step()
                assert int(model.noise_layer.replayable_step.iteration) == iteration
            total = torch.zeros(())
            for _ in range(2):
                loss = masked_mean_loss(model, batch)
                loss.backward()
                total = total + loss.detach()
            losses.append(total)
        assert torch.equal(losses[0], losses[1]), iteration
        for (param_name, a), b in zip(eager.named_parameters(), replayable.parameters(), strict=True):
            assert torch.equal(a.grad, b.grad), param_name
        assert eager.noise_clock == replayable.noise_clock
