"""A run configured for a full-iteration CUDA graph, on the CPU loop (no graph there): the launcher adds
``PublishNoiseStep``, the replayable keys give the eager run's losses bit for bit, and ``run_cpu_loop`` called directly
publishes the steps itself. On a GPU the same run replays one captured step
(``tests/gpu/test_full_iteration_graph_gpu.py``)."""

from __future__ import annotations

import pytest
import torch
from megatron.core.utils import unwrap_model

from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.recipes.tiny import tiny_noise_sft_config
from nemo_noise_plugin.upstream.bridge_imports import import_bridge

GRAPH = [
    "model.cuda_graph_impl=full_iteration",
    "model.use_te_rng_tracker=true",
    "rerun_state_machine.check_for_nan_in_loss=false",
    "model.cuda_graph_use_single_mempool=false",  # the recipe evaluates: its graph needs its own pool
]


class _Losses(import_bridge("megatron.bridge.training.callbacks").Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.replayable: list[bool] = []

    def on_train_step_end(self, context) -> None:
        self.losses.append(float(context.loss_dict["lm loss"]))
        self.replayable.append(unwrap_model(context.model[0]).noise_layer.replayable_step is not None)


def _run(tmp_path, name: str, overrides: list[str]) -> _Losses:
    from nemo_noise_plugin.jobs.launch.launcher import launch

    recorder = _Losses()
    config = tiny_noise_sft_config(str(tmp_path / name), train_iters=3, noise=NoiseConfig(alpha=50.0))
    launch(config, overrides, callbacks=[recorder], allow_cpu_loop=True)
    return recorder


@pytest.mark.slow
def test_a_run_for_a_full_iteration_graph_publishes_each_step_and_equals_the_eager_run(tmp_path, monkeypatch):
    monkeypatch.setenv("MASTER_PORT", str(29600 + torch.randint(0, 900, ()).item()))
    eager = _run(tmp_path, "eager", GRAPH[1:])
    graphed = _run(tmp_path, "graph", GRAPH)
    assert graphed.replayable == [True] * 3 and eager.replayable == [False] * 3
    assert graphed.losses == eager.losses and eager.losses[-1] < eager.losses[0]


@pytest.mark.slow
def test_the_cpu_loop_publishes_the_steps_itself_when_called_without_the_launcher(tmp_path, monkeypatch):
    """``run_cpu_loop`` called directly (as a script or a test does) adds ``PublishNoiseStep`` itself: the replayable
    model trains as through the launcher (the forward step's refusal of an unpublished step:
    tests/training/test_noise_step_publisher.py)."""
    from nemo_noise_plugin.jobs.cpu.loop import run_cpu_loop
    from nemo_noise_plugin.training.forward_step import noise_forward_step
    from nemo_noise_plugin.training.overrides import apply_overrides

    monkeypatch.setenv("MASTER_PORT", str(29600 + torch.randint(0, 900, ()).item()))
    recorder = _Losses()
    config = tiny_noise_sft_config(str(tmp_path / "bare"), train_iters=3, noise=NoiseConfig(alpha=50.0))
    run_cpu_loop(apply_overrides(config, GRAPH), noise_forward_step, [recorder])
    assert recorder.replayable == [True] * 3
    assert recorder.losses == _run(tmp_path, "eager", GRAPH[1:]).losses  # the launcher's eager run, bit for bit
