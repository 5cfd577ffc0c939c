"""The CPU loop honours the recipe's optimizer settings: gradient clipping, warm-up, decay style and ``min_lr``."""

from __future__ import annotations

import math
import os

import pytest
import torch

from nemo_noise_plugin.jobs.cpu.loop import build_optimizer, run_cpu_loop
from nemo_noise_plugin.recipes.tiny import tiny_noise_sft_config
from nemo_noise_plugin.training.forward_step import noise_forward_step
from nemo_noise_plugin.upstream.bridge_imports import import_bridge


def _config(tmp_path, **scheduler):
    config = tiny_noise_sft_config(dir=str(tmp_path), train_iters=10, lr=1e-3)
    for name, value in scheduler.items():
        setattr(config.scheduler, name, value)
    return config


def _lrs(config, steps: int) -> list[float]:
    parameter = torch.nn.Parameter(torch.zeros(3))
    optimizer, scheduler = build_optimizer(config, [parameter])
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        scheduler.step(increment=config.train.global_batch_size)
    return lrs


def test_the_learning_rate_warms_up_linearly_then_decays_by_cosine_to_min_lr(tmp_path):
    config = _config(tmp_path, lr_warmup_iters=4, lr_decay_style="cosine")
    lrs = _lrs(config, 11)
    peak, floor = 1e-3, 1e-4  # the tiny recipe's min_lr is lr / 10
    expected = [peak * step / 4 for step in range(5)]
    for step in range(5, 11):
        ratio = (step - 4) / (10 - 4)
        expected.append(floor + (peak - floor) * 0.5 * (math.cos(math.pi * ratio) + 1.0))
    assert lrs == pytest.approx(expected, rel=1e-9, abs=1e-15)


def test_a_linear_decay_style_is_followed(tmp_path):
    lrs = _lrs(_config(tmp_path, lr_decay_style="linear"), 11)
    assert lrs == pytest.approx([1e-3 - 9e-4 * step / 10 for step in range(11)], rel=1e-9)


def _first_update(tmp_path, **settings) -> float:
    """The largest parameter change made by the CPU loop's first optimizer step with these settings."""
    config = tiny_noise_sft_config(dir=str(tmp_path), train_iters=2, lr=1e-3)
    config.optimizer.clip_grad = settings.pop("clip_grad", config.optimizer.clip_grad)
    for name, value in settings.items():
        setattr(config.scheduler, name, value)
    callbacks = import_bridge("megatron.bridge.training.callbacks")
    changes: list[float] = []

    class FirstStep(callbacks.Callback):
        def on_train_start(self, context):
            self.start = [p.detach().clone() for p in context.model[0].parameters()]

        def on_train_step_end(self, context):
            if not changes:
                after = list(context.model[0].parameters())
                changes.append(max((a - b).abs().max().item() for a, b in zip(after, self.start, strict=True)))

    run_cpu_loop(config, noise_forward_step, [FirstStep()])
    return changes[0]


def test_warm_up_starts_from_lr_warmup_init_so_the_first_step_leaves_the_weights_unchanged(tmp_path):
    assert _first_update(tmp_path / "warm", lr_warmup_iters=1) == 0.0  # lr_warmup_init is 0
    assert _first_update(tmp_path / "cold", lr_warmup_iters=0) > 1e-4


def test_gradients_are_clipped_to_clip_grad(tmp_path):
    # Adam divides by the gradient's running RMS, so only a clip that takes gradients below adam_eps (1e-8) shows
    # in the first update: unclipped it is ~lr per weight, clipped to a global norm of 1e-9 far smaller.
    unclipped = _first_update(tmp_path / "off", clip_grad=0.0)
    clipped = _first_update(tmp_path / "on", clip_grad=1e-9)
    assert unclipped > 5e-4 and clipped < unclipped / 10


def test_attention_variables_left_by_an_earlier_model_neither_break_the_loop_nor_are_lost(tmp_path, monkeypatch):
    # An earlier model in this process pinned another attention backend; Megatron would refuse ours on that value.
    monkeypatch.setenv("NVTE_FLASH_ATTN", "1")
    monkeypatch.delenv("NVTE_FUSED_ATTN", raising=False)
    config = tiny_noise_sft_config(dir=str(tmp_path), train_iters=1, lr=1e-3)
    run_cpu_loop(config, noise_forward_step)
    assert os.environ.get("NVTE_FLASH_ATTN") == "1"
    assert "NVTE_FUSED_ATTN" not in os.environ
