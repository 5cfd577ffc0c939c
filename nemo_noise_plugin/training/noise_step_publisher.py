"""The Megatron-Bridge callback that publishes each training step's noise keys before the step runs.

Under a full-iteration CUDA graph (``cuda_graph_impl="full_iteration"``) Bridge replays one captured
forward-backward every step: the plugin's forward step, which points the noise clock at ``train_state.step``, runs
only at the capture. A model built for such a run keeps its noise keys in device memory (``noise/replayable.py``);
``PublishNoiseStep`` points each replayable chunk's clock at the step and writes the keys (and raises for an overflow
recorded at an earlier step) at ``on_train_step_start``, outside the graph. The plugin's launchers add it to every
run; a script that calls Bridge's ``finetune``/``pretrain`` itself passes ``callbacks=[PublishNoiseStep()]``. It does
nothing for models whose keys are host numbers.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from megatron.core.utils import unwrap_model

from nemo_noise_plugin.model.mixin import NoiseInjectionMixin
from nemo_noise_plugin.upstream.bridge_imports import import_bridge

__all__ = ["PublishNoiseStep", "publish_noise_steps"]

Callback = import_bridge("megatron.bridge.training.callbacks").Callback


def publish_noise_steps(model_chunks: Iterable[torch.nn.Module], iteration: int) -> int:
    """Point every replayable noisy chunk in training mode at ``iteration`` and publish its keys; how many."""
    published = 0
    for chunk in model_chunks:
        inner = unwrap_model(chunk)
        if not isinstance(inner, NoiseInjectionMixin) or not inner.training:
            continue
        if inner.noise_layer.replayable_step is None:
            continue
        inner.noise_clock.start_iteration(iteration)
        inner.publish_noise_step()
        published += 1
    return published


class PublishNoiseStep(Callback):
    """At each train-step start, ``publish_noise_steps(model, train_state.step)`` (see the module docstring)."""

    def on_train_step_start(self, context: Any) -> None:
        """Publish the step's noise keys before Bridge runs (or replays) the step."""
        publish_noise_steps(context.model, int(context.state.train_state.step))
