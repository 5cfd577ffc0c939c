"""The training model's noise layer never makes the host wait for the GPU (issue 34: no per-step host syncs in the
plugin's path), and its deferred finiteness check still stops an overflowing run, one iteration late, naming the
iteration it happened at (issue 36, finding 5). One CUDA device; skipped without one. Needs no Megatron wheels."""

from __future__ import annotations

import copy

import pytest
import torch

from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.noise.layer import EmbeddingNoise, NoiseBatchInputs
from nemo_noise_plugin.noise.schedule import NoiseClock
from nemo_noise_plugin.validation import SettingError

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SEQ, BATCH, HIDDEN = 128, 4, 576  # SmolLM2-135M's hidden size


def _batch(lengths: list[int]) -> NoiseBatchInputs:
    padding = torch.arange(SEQ)[None, :] >= torch.tensor(lengths)[:, None]
    loss_mask = (~padding).float()
    loss_mask[:, :16] = 0.0  # a prompt
    return NoiseBatchInputs(
        loss_mask=loss_mask.cuda(),
        padding_mask=padding.cuda(),
        input_ids=torch.randint(0, 49152, (BATCH, SEQ)).cuda(),
    )


def _layer(config: NoiseConfig) -> EmbeddingNoise:
    return EmbeddingNoise(
        config, sequence_parallel=False, pg_collection=None, megatron_groups=False, defer_finite_check=True
    )


@pytest.mark.parametrize(
    "config",
    [
        NoiseConfig(alpha=5.0),  # NEFTune, true length (the lengths come from the padding mask)
        NoiseConfig(mechanism="gaussian", sigma=0.5, scaling="absolute", tokens="prompt"),
        NoiseConfig(mechanism="metric_dp", eta=50.0),
        NoiseConfig(mechanism="laplace", laplace_scale=0.05, special_token_ids=[0, 2]),
    ],
    ids=["neftune", "gaussian-prompt", "metric-dp", "laplace-special-ids"],
)
def test_three_iterations_of_two_microbatches_never_sync(config):
    layer = _layer(config)
    batch = _batch([128, 100, 64, 17])
    embedded = torch.randn(SEQ, BATCH, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    clock = NoiseClock()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronising CUDA call in the layer raises
    try:
        for iteration in range(3):
            clock.start_iteration(iteration)
            for _ in range(2):
                noised = layer(embedded, batch, clock)
                noised.float().square().sum().backward()
                clock.advance(2)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.isfinite(noised).all() and not torch.equal(noised, embedded.detach())
    queued = layer.finite_check.queued_iterations
    assert set(queued) <= {0, 1, 2} and 2 in queued  # the last iteration's answer is read at the next check
    layer.finite_check.raise_arrived(config)  # all arrived and finite: nothing raised, the queue empties
    assert layer.finite_check.queued_iterations == []


def test_an_overflow_stops_the_run_at_the_next_check_naming_its_iteration():
    config = NoiseConfig(mechanism="relative", relative_scale=3e38)  # relative noise: no bound refuses it
    layer = _layer(config)
    embedded = torch.full((SEQ, BATCH, HIDDEN), 10.0, device="cuda")
    batch = _batch([SEQ] * BATCH)
    clock = NoiseClock()
    clock.start_iteration(7)
    layer(embedded, batch, clock)  # queued, not read: no wait
    clock.advance(2)
    layer(embedded, batch, clock)  # microbatch 1: no check
    torch.cuda.synchronize()
    teacher_copy = copy.deepcopy(layer)  # a copy owes nothing
    assert teacher_copy.finite_check.queued_iterations == []
    clock.start_iteration(8)
    with pytest.raises(SettingError) as stopped:
        layer(embedded, batch, clock)
    assert str(stopped.value) == (
        "NoiseConfig.relative_scale=3e+38 is invalid with mechanism='relative': expected a noise level whose noised "
        "embeddings stay finite: at iteration 7 they hold inf or NaN; training stopped."
    )
