"""Same noise after a Megatron checkpoint save/load, and with activation recompute (real Megatron-Core, CPU)."""

from __future__ import annotations

import torch

from nemo_noise_plugin.model import NoisyGPTModel
from nemo_noise_plugin.noise.config import NoiseConfig
from tests.support.models import build_tiny_gpt, masked_mean_loss, tiny_gpt_config

NOISE = NoiseConfig(alpha=10.0, schedule="cosine", warmup_steps=2, decay_steps=6, min_factor=0.2, seed=42)


def _train(model, batch, steps: int, optimizer) -> list[float]:
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = masked_mean_loss(model, batch)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _model(seed: int = 3, **config_overrides):
    torch.manual_seed(seed)
    return build_tiny_gpt(tiny_gpt_config(**config_overrides), model_class=NoisyGPTModel, noise_config=NOISE)


def test_training_resumed_from_a_megatron_checkpoint_continues_with_identical_noise(megatron_cpu, batch, tmp_path):
    from megatron.core import dist_checkpointing

    uninterrupted = _model()
    optimizer = torch.optim.SGD(uninterrupted.parameters(), lr=0.05)
    reference = _train(uninterrupted, batch, 6, optimizer)

    first_half = _model()
    optimizer = torch.optim.SGD(first_half.parameters(), lr=0.05)
    _train(first_half, batch, 3, optimizer)
    checkpoint = {"model": first_half.sharded_state_dict(), "noise_state": first_half.noise_state_dict()}
    dist_checkpointing.save(checkpoint, str(tmp_path))

    resumed = _model(seed=99)  # different initial weights: everything must come from the checkpoint
    loaded = dist_checkpointing.load({"model": resumed.sharded_state_dict(), "noise_state": None}, str(tmp_path))
    resumed.load_state_dict(loaded["model"])
    resumed.load_noise_state_dict(loaded["noise_state"])
    assert resumed.noise_clock.state_dict() == {"iteration": 3, "microbatch": 0}
    optimizer = torch.optim.SGD(resumed.parameters(), lr=0.05)
    assert _train(resumed, batch, 3, optimizer) == reference[3:]


def test_a_loop_that_restores_only_its_iteration_gets_the_same_noise(megatron_cpu, batch):
    """Bridge restores ``train_state.step``; ``start_iteration(step)`` alone reproduces the noise."""
    continuous, restarted = _model(), _model()
    with torch.no_grad(), continuous.noise_batch_inputs(batch["loss_mask"]):
        for _ in range(5):
            continuous._preprocess(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
    restarted.noise_clock.start_iteration(5)
    with torch.no_grad(), continuous.noise_batch_inputs(batch["loss_mask"]):
        expected = continuous._preprocess(input_ids=batch["input_ids"], position_ids=batch["position_ids"])[0]
    with torch.no_grad(), restarted.noise_batch_inputs(batch["loss_mask"]):
        actual = restarted._preprocess(input_ids=batch["input_ids"], position_ids=batch["position_ids"])[0]
    assert torch.equal(actual, expected)


def test_full_activation_recompute_gives_the_same_loss_and_gradients(megatron_cpu, batch):
    plain = _model()
    recomputed = _model(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    recomputed.load_state_dict(plain.state_dict())
    losses = []
    for model in (plain, recomputed):
        per_token = model(
            batch["input_ids"],
            batch["position_ids"],
            batch["attention_mask"],
            labels=batch["labels"],
            loss_mask=batch["loss_mask"],
        )
        loss = (per_token * batch["loss_mask"]).sum()
        loss.backward()
        losses.append(loss)
    assert torch.equal(losses[0], losses[1])
    for a, b in zip(plain.parameters(), recomputed.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-7)
    assert plain.noise_clock == recomputed.noise_clock
