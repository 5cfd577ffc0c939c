"""Noise added where the embedding rows are looked up: the same losses, gradients and clock as noise on the output.

``model/noised_lookup.py`` hands ``GPTModel._preprocess`` a decoder input made by the lookup with the noise in one
pass (on the GPU one Triton kernel, ``tests/gpu/test_noise_in_lookup_gpu.py``; here the lookup and the torch
reference). These tests run the real Megatron-Core model both ways and require bit-identical results, and check that
every embedding the fused path cannot reproduce falls back to noising the output.
"""

from __future__ import annotations

import pytest
import torch

from nemo_noise_plugin.model import NoisyGPTModel
from nemo_noise_plugin.model.noised_lookup import lookup_fusion_blocker
from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.noise.mechanisms import lookup_with_configured_noise, noise_independent_of_input
from nemo_noise_plugin.noise.sampling import add_noise_reference, lookup_with_noise_reference
from tests.support.models import build_tiny_gpt, masked_mean_loss, tiny_gpt_config

FUSABLE = {
    "neftune_true_length": NoiseConfig(alpha=5.0),
    "gaussian_prompt_only": NoiseConfig(mechanism="gaussian", sigma=3.0, tokens="prompt"),
    "laplace_response_special_ids": NoiseConfig(
        mechanism="laplace", laplace_scale=0.05, tokens="response", special_token_ids=[3, 7]
    ),
    "metric_dp": NoiseConfig(mechanism="metric_dp", eta=20.0),
    "uniform_warmup_schedule": NoiseConfig(alpha=5.0, schedule="linear", warmup_steps=1, decay_steps=4),
}


def _twins(noise: NoiseConfig, **config_overrides):
    """Two noisy models with identical weights: noise in the lookup, and noise on the embedding output."""
    twins = []
    for _ in range(2):
        torch.manual_seed(11)
        twins.append(build_tiny_gpt(tiny_gpt_config(**config_overrides), model_class=NoisyGPTModel, noise_config=noise))
    fused, unfused = twins
    unfused.fuse_noise_into_lookup = False
    return fused, unfused


def _step(model, batch, microbatches: int = 2) -> torch.Tensor:
    """Forward and backward of ``microbatches`` microbatches of one iteration; the summed loss."""
    model.noise_clock.start_iteration(model.noise_clock.iteration)
    total = torch.zeros(())
    for _ in range(microbatches):
        loss = masked_mean_loss(model, batch)
        loss.backward()
        total = total + loss.detach()
    return total


@pytest.mark.parametrize("name", list(FUSABLE))
def test_noise_in_the_lookup_gives_bit_identical_losses_gradients_and_clock(megatron_cpu, batch, name):
    fused, unfused = _twins(FUSABLE[name])
    assert lookup_fusion_blocker(fused) is None
    assert lookup_fusion_blocker(unfused) == "the model's fuse_noise_into_lookup is off"
    for iteration in range(3):
        fused.noise_clock.start_iteration(iteration)
        unfused.noise_clock.start_iteration(iteration)
        assert torch.equal(_step(fused, batch), _step(unfused, batch))
        for (param_name, a), b in zip(fused.named_parameters(), unfused.parameters(), strict=True):
            assert torch.equal(a.grad, b.grad), param_name
        assert fused.noise_clock == unfused.noise_clock


def test_noise_in_the_lookup_equals_noise_on_the_output_under_full_recompute(megatron_cpu, batch):
    fused, unfused = _twins(
        FUSABLE["neftune_true_length"], recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
    )
    assert torch.equal(_step(fused, batch, 1), _step(unfused, batch, 1))
    for a, b in zip(fused.parameters(), unfused.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)


def test_the_decoder_input_made_in_the_lookup_is_contiguous_in_megatron_layout(megatron_cpu, batch):
    fused, unfused = _twins(FUSABLE["gaussian_prompt_only"])
    outputs = []
    for model in (fused, unfused):
        with torch.no_grad(), model.noise_batch_inputs(batch["loss_mask"]):
            outputs.append(model._preprocess(input_ids=batch["input_ids"], position_ids=batch["position_ids"])[0])
    assert outputs[0].is_contiguous() and outputs[0].shape == (64, 4, 64)
    assert torch.equal(outputs[0], outputs[1])


@pytest.mark.parametrize(
    ("noise", "config_overrides", "reason"),
    [
        (NoiseConfig(mechanism="metric_dp", eta=20.0, clip_norm=1.0), {}, "depends on the embedding values"),
        (NoiseConfig(mechanism="relative", relative_scale=0.1), {}, "depends on the embedding values"),
        (NoiseConfig(alpha=5.0, projection="nearest_row"), {}, "projection='nearest_row'"),
        (NoiseConfig(alpha=5.0), {"hidden_dropout": 0.1}, "embedding dropout is on"),
        (NoiseConfig(alpha=5.0), {"fp32_residual_connection": True}, "fp32_residual_connection"),
    ],
    ids=["clipped", "relative", "projection", "dropout", "fp32_residual"],
)
def test_embeddings_the_lookup_cannot_reproduce_fall_back_to_noising_the_output(
    megatron_cpu, batch, noise, config_overrides, reason
):
    fused, unfused = _twins(noise, **config_overrides)
    assert reason in lookup_fusion_blocker(fused)
    torch.manual_seed(5)  # dropout, where on, draws the same masks in both
    first = _step(fused, batch, 1)
    torch.manual_seed(5)
    assert torch.equal(first, _step(unfused, batch, 1))


def test_learned_position_embeddings_and_eval_dropout(megatron_cpu):
    torch.manual_seed(3)
    learned = build_tiny_gpt(
        model_class=NoisyGPTModel, noise_config=NoiseConfig(alpha=5.0), position_embedding_type="learned_absolute"
    )
    assert lookup_fusion_blocker(learned) == "learned position embeddings are added"
    dropout = build_tiny_gpt(
        tiny_gpt_config(hidden_dropout=0.1), model_class=NoisyGPTModel, noise_config=NoiseConfig(alpha=5.0)
    )
    dropout.eval()  # eval dropout is the identity: the lookup may take the noise (training_only=False noises eval)
    assert lookup_fusion_blocker(dropout) is None
    assert "inference" in lookup_fusion_blocker(dropout, inference_context=object())


def test_lookup_reference_is_the_output_noise_of_megatrons_lookup():
    torch.manual_seed(0)
    weight = torch.randn(50, 16, requires_grad=True)
    ids = torch.randint(0, 50, (3, 7))
    arguments = {
        "seed": 9,
        "iteration": 4,
        "sample_index": torch.tensor([5, 6, 7]),
        "token_position": torch.arange(7),
        "noise_scale": torch.rand(7, 3),
        "distribution": "gaussian",
    }
    fused = lookup_with_noise_reference(weight, ids, **arguments)
    unfused = add_noise_reference(torch.nn.functional.embedding(ids, weight).transpose(0, 1).contiguous(), **arguments)
    assert torch.equal(fused, unfused) and fused.is_contiguous()
    (grad,) = torch.autograd.grad(fused.square().sum(), weight)
    (grad_unfused,) = torch.autograd.grad(unfused.square().sum(), weight)
    assert torch.equal(grad, grad_unfused)


def test_lookup_noise_refuses_mechanisms_that_depend_on_the_embedding_values():
    config = NoiseConfig(mechanism="gaussian_mechanism", epsilon=20.0, clip_norm=1.0)
    assert not noise_independent_of_input(config)
    with pytest.raises(ValueError, match="gaussian_mechanism.*clip_norm=1.0.*apply_noise"):
        lookup_with_configured_noise(
            torch.zeros(4, 8),
            torch.zeros(1, 2, dtype=torch.long),
            config,
            factor=1.0,
            selected=None,
            geometry=None,
            sample_index=None,
            iteration=0,
        )
