"""CE + KD loss inside the fine-grained schedule plan's post-process node.

In the plan, everything that needs a gradient must leave through ``PostProcessNode``'s single output: each node
backpropagates only from its own outputs, so a loss built from logits captured elsewhere (a forward hook, a second
output) is either lost or backpropagated twice. ``DistillationOutputProcessor`` is the ``output_processor`` that
Megatron's ``GPTModel._postprocess`` calls in place of the output layer + CE: it computes the student's logits, then
the combined loss against the clean teacher's logits (computed under ``no_grad`` before the plan runs), and returns
the loss sum as the node's output. The parts reported to the training loop (``lm loss``, ``kd loss``, ...) carry no
gradient and go to the loss function through ``DistillationLossParts``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from nemo_noise_plugin.distillation.config import KDConfig
from nemo_noise_plugin.distillation.losses import combined_distillation_loss
from nemo_noise_plugin.distillation.pipeline_teacher import lazy_teacher_logits

__all__ = ["DistillationLossParts", "DistillationOutputProcessor", "plan_distillation_loss"]


@dataclass
class DistillationLossParts:
    """What the plan's post-process node computed besides the loss: the token count and the report (no graph)."""

    num_tokens: torch.Tensor | None = None
    report: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class DistillationOutputProcessor:
    """``output_processor`` for ``build_schedule_plan``: student logits, then ``combined_distillation_loss``.

    The logits are the ones ``GPTModel.forward`` returns without labels (output layer, logit scaling, ``[b, s, V/tp]``),
    so the loss equals the normal path's ``distillation_forward_step`` loss.
    """

    kd_config: KDConfig
    teacher_logits: torch.Tensor | Callable[[], torch.Tensor] | None
    """The teacher's logits, or (pipeline parallel) a function that computes them when the node runs."""
    loss_mask: torch.Tensor
    labels: torch.Tensor | None
    tp_group: Any
    sequence_parallel: bool

    def __call__(
        self,
        *,
        hidden_states: torch.Tensor,
        output_layer: torch.nn.Module,
        output_weight: torch.Tensor | None,
        runtime_gather_output: bool | None,
        context: DistillationLossParts,
        scale_logits: Any,
        **_: Any,
    ) -> torch.Tensor:
        logits, _ = output_layer(hidden_states, weight=output_weight, runtime_gather_output=runtime_gather_output)
        student_logits = scale_logits(logits).transpose(0, 1).contiguous()
        result = combined_distillation_loss(
            self.kd_config,
            student_logits,
            lazy_teacher_logits(self.teacher_logits),
            self.loss_mask,
            labels=self.labels,
            tp_group=self.tp_group,
            sequence_parallel=self.sequence_parallel,
        )
        loss_sum, num_tokens, report = result.bridge_outputs()
        context.num_tokens = num_tokens.detach()
        context.report = {name: value.detach() for name, value in report.items()}
        return loss_sum


def plan_distillation_loss(
    parts: DistillationLossParts, loss_sum: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """The plan's loss function: Bridge's ``(loss_sum, num_tokens, report)`` from the post-process node's output."""
    if parts.num_tokens is None:
        raise RuntimeError("the schedule plan's post-process node did not run the distillation output processor.")
    # A new tensor: the schedule's loss node hands in a detached leaf, and Megatron scales the loss in place.
    return loss_sum.clone(), parts.num_tokens, parts.report
