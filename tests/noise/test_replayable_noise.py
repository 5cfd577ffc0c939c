"""Replayable noise (``noise/replayable.py``): the step's keys in device memory give the eager path's noise bits.

A CUDA graph replays its kernels with their captured arguments; the replayable layer reads the iteration key and the
schedule factor from 0-dim tensors that ``publish`` fills before each step, and records the finiteness check in a
device flag. Here (CPU) the values: the same output and gradient as the eager keys for every mechanism, the
publication and the overflow flag. The replays themselves run in ``tests/gpu/test_replayable_noise_gpu.py``.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.noise.layer import EmbeddingNoise, NoiseBatchInputs
from nemo_noise_plugin.noise.replayable import ReplayableStep
from nemo_noise_plugin.noise.schedule import NoiseClock, schedule_factor
from nemo_noise_plugin.validation import SettingError

SEQ, BATCH, HIDDEN = 12, 3, 16

CONFIGS = {
    "neftune": NoiseConfig(alpha=5.0),
    "neftune_cosine_warmup": NoiseConfig(alpha=5.0, schedule="cosine", warmup_steps=2, decay_steps=5, min_factor=0.1),
    "gaussian_prompt_linear": NoiseConfig(
        mechanism="gaussian", sigma=0.5, scaling="absolute", tokens="prompt", schedule="linear", decay_steps=4
    ),
    "laplace_special_ids": NoiseConfig(mechanism="laplace", laplace_scale=0.05, special_token_ids=[0, 2]),
    "metric_dp": NoiseConfig(mechanism="metric_dp", eta=50.0),
    "gaussian_clipped": NoiseConfig(mechanism="gaussian", sigma=0.5, clip_norm=1.0, scaling="absolute"),
    "relative": NoiseConfig(mechanism="relative", relative_scale=0.1, warmup_steps=3),
}


def _layer(config: NoiseConfig, replayable: bool) -> EmbeddingNoise:
    return EmbeddingNoise(
        config, sequence_parallel=False, pg_collection=None, megatron_groups=False, replayable=replayable
    )


def _batch() -> NoiseBatchInputs:
    generator = torch.Generator().manual_seed(4)
    padding = torch.arange(SEQ)[None, :] >= torch.tensor([SEQ, 9, 5])[:, None]
    loss_mask = (~padding).float()
    loss_mask[:, :3] = 0.0  # a prompt
    return NoiseBatchInputs(
        loss_mask=loss_mask, padding_mask=padding, input_ids=torch.randint(0, 6, (BATCH, SEQ), generator=generator)
    )


@pytest.mark.parametrize("name", list(CONFIGS))
def test_replayable_keys_give_the_eager_noise_and_gradient_bit_for_bit(name):
    config = CONFIGS[name]
    eager, replayable = _layer(config, False), _layer(config, True)
    batch = _batch()
    torch.manual_seed(0)
    embedded = torch.randn(SEQ, BATCH, HIDDEN)
    weights = torch.randn(SEQ, BATCH, HIDDEN)
    for iteration in range(6):
        outputs, gradients = [], []
        for layer in (eager, replayable):
            clock = NoiseClock()
            clock.start_iteration(iteration)
            x = embedded.clone().requires_grad_()
            microbatches = []
            for _ in range(2):
                microbatches.append(layer(x, batch, clock))
                clock.advance(2)
            (sum(noised * weights for noised in microbatches)).sum().backward()
            outputs.append(torch.stack(microbatches))
            gradients.append(x.grad)
        assert torch.equal(outputs[0], outputs[1]), iteration
        assert torch.equal(gradients[0], gradients[1]), iteration
        assert replayable.replayable_step.published == iteration  # the forward published its own step
        if iteration == 0:
            assert not torch.equal(outputs[1][0], embedded)  # noise was added


def test_publish_fills_the_same_storage_with_each_steps_iteration_and_schedule_factor():
    config = CONFIGS["neftune_cosine_warmup"]
    step = ReplayableStep()
    step.publish(config, 1, torch.device("cpu"))
    storage = (step.iteration.data_ptr(), step.factor.data_ptr(), step.overflow_at.data_ptr())
    for iteration in (1, 4, 2**40):
        step.publish(config, iteration, torch.device("cpu"))
        assert step.holds(iteration, torch.device("cpu")) and not step.holds(iteration + 1, torch.device("cpu"))
        assert int(step.iteration) == iteration and step.iteration.dtype == torch.int64 and step.iteration.dim() == 0
        assert float(step.factor) == pytest.approx(schedule_factor(config, iteration), rel=1e-7)
        assert step.factor.dtype == torch.float32
        assert (step.iteration.data_ptr(), step.factor.data_ptr(), step.overflow_at.data_ptr()) == storage


@pytest.mark.parametrize("iteration", [-1, True, 1.0, 2**63])
def test_publish_refuses_an_iteration_that_is_not_a_64_bit_count(iteration):
    with pytest.raises(ValueError, match=r"ReplayableStep.publish: iteration=.* must be an integer in \[0, 2\*\*63\)"):
        ReplayableStep().publish(NoiseConfig(), iteration, torch.device("cpu"))


def test_the_device_flag_keeps_the_first_overflowing_iteration_and_the_layer_stops_naming_it():
    config = NoiseConfig(mechanism="relative", relative_scale=3e38)  # relative noise: no bound refuses it
    step = ReplayableStep()
    with pytest.raises(RuntimeError, match="never published"):
        step.record_overflow(torch.ones(2), torch.ones(2))
    step.raise_overflow(config)  # nothing published, nothing to raise
    finite, overflowed = torch.ones(4), torch.tensor([1.0, float("inf"), 1.0, 1.0])
    step.publish(config, 6, torch.device("cpu"))
    step.record_overflow(finite, finite)
    step.raise_overflow(config)  # finite: nothing raised
    step.record_overflow(overflowed, overflowed)  # the clean side overflowed too: not the noise's doing
    assert int(step.overflow_at) == 0
    step.publish(config, 7, torch.device("cpu"))
    step.record_overflow(overflowed, finite)
    step.publish(config, 9, torch.device("cpu"))
    step.record_overflow(overflowed, finite)
    assert int(step.overflow_at) == 8  # iteration 7, plus one
    with pytest.raises(SettingError, match=r"at iteration 7 they hold inf or NaN; training stopped"):
        step.raise_overflow(config)

    layer = _layer(config, True)
    clock = NoiseClock()
    clock.start_iteration(3)
    with pytest.raises(SettingError, match=r"^NoiseConfig.relative_scale=3e\+38 is invalid.*at iteration 3"):
        layer(torch.full((SEQ, BATCH, HIDDEN), 10.0), _batch(), clock)


def test_only_a_replayable_layer_publishes_and_copies_start_without_keys():
    with pytest.raises(RuntimeError, match="publish_step needs a replayable noise layer"):
        _layer(NoiseConfig(), False).publish_step(NoiseClock(), torch.device("cpu"))
    layer = _layer(NoiseConfig(), True)
    layer.publish_step(NoiseClock(), torch.device("cpu"))
    assert layer.replayable_step.published == 0
    for other in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        assert other.replayable_step is not layer.replayable_step
        assert other.replayable_step.iteration is None and other.replayable_step.published is None
