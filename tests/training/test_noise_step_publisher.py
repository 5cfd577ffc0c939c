"""``PublishNoiseStep`` and the forward step's guard: the noise keys of a model built for a full-iteration CUDA graph
are published before every step, and a step that was not published is refused (the replays would freeze the noise).
The graph itself runs in ``tests/gpu/test_full_iteration_graph_gpu.py``; the CPU loop run in
``tests/jobs/test_cpu_loop_full_iteration.py``."""

from __future__ import annotations

import pytest
import torch

from nemo_noise_plugin.model import NoisyGPTModel
from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.noise.schedule import schedule_factor
from nemo_noise_plugin.training.forward_step import sync_noise_clock
from nemo_noise_plugin.training.noise_step_publisher import publish_noise_steps
from tests.support.models import build_tiny_gpt

NOISE = NoiseConfig(alpha=5.0, warmup_steps=4)


def _model(replayable: bool) -> NoisyGPTModel:
    torch.manual_seed(3)
    model = build_tiny_gpt(model_class=NoisyGPTModel, noise_config=NOISE)
    model.init_noise(NOISE, replayable=replayable)
    return model


def test_publishing_moves_only_replayable_chunks_in_training(megatron_cpu):
    replayable, eager, evaluating = _model(True), _model(False), _model(True)
    evaluating.eval()
    plain = torch.nn.Linear(2, 2)
    assert publish_noise_steps([replayable, eager, evaluating, plain], 2) == 1
    step = replayable.noise_layer.replayable_step
    assert replayable.noise_clock.iteration == 2 and replayable.noise_clock.microbatch == 0
    assert int(step.iteration) == 2 and float(step.factor) == pytest.approx(schedule_factor(NOISE, 2))
    assert eager.noise_clock.iteration == 0 and evaluating.noise_layer.replayable_step.published is None


def test_the_forward_step_refuses_a_replayable_step_that_was_not_published(megatron_cpu):
    model = _model(True)
    with pytest.raises(RuntimeError, match=r"noise keys of step 0 were not published.*PublishNoiseStep\(\)"):
        sync_noise_clock(model, 0)
    publish_noise_steps([model], 0)
    sync_noise_clock(model, 0)  # published: accepted
    model.noise_clock.advance(1)  # the step ran: the clock is at 1, the keys still at 0
    with pytest.raises(RuntimeError, match=r"step 1 were not published before it \(they hold step 0\)"):
        sync_noise_clock(model, 1)
    sync_noise_clock(_model(False), 5)  # host keys: nothing to publish
