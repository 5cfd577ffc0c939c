"""Hand a model's weights from one training run to the next in the same process (Bridge callbacks).

The main job uses it for a short clean pre-training phase: ``CaptureWeights`` keeps the first chunk's weights at the
end of that phase, and ``StartFromWeights`` loads them at the start of the runs that follow (the noisy run and its
control), before anything else sees the model. A distillation run copies its clean teacher from the student at
iteration 0, so the teacher is then the pre-trained model rather than the random initialisation.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.utils import unwrap_model

from nemo_noise_plugin.distillation.teacher_weights import load_weights, settle_teacher_from
from nemo_noise_plugin.upstream.bridge_imports import import_bridge

__all__ = ["CaptureWeights", "StartFromWeights"]

_Callback = import_bridge("megatron.bridge.training.callbacks").Callback


class CaptureWeights(_Callback):
    """Keeps a copy of the first model chunk's ``state_dict`` (tensors only) when training ends."""

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] | None = None

    def on_train_end(self, context: Any) -> None:
        state = unwrap_model(context.model[0]).state_dict()
        self.weights = {name: value.detach().clone() for name, value in state.items() if torch.is_tensor(value)}


class StartFromWeights(_Callback):
    """Loads ``weights`` (from ``CaptureWeights``) into the first model chunk when training starts at iteration 0.

    A run resumed from its checkpoint keeps the checkpoint's weights; a distillation run's clean teacher, which
    checkpoints do not hold (``distillation.teacher_weights``), is given ``weights`` again, as at iteration 0.

    Megatron's mixed-precision optimizers keep float32 main copies of the parameters: they are refreshed from the
    loaded weights (``reload_model_params``), so the first optimizer step starts from them too.
    """

    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        self.weights = weights

    def on_train_start(self, context: Any) -> None:
        if context.state.train_state.step:  # resumed: the student keeps its checkpoint's weights; a clean teacher
            settle_teacher_from(context.model[0], self.weights)  # gets the start weights it was copied from
            return
        model = unwrap_model(context.model[0])
        load_weights(model, self.weights, "the captured weights")
        reload = getattr(context.optimizer, "reload_model_params", None)
        if callable(reload):
            reload()
