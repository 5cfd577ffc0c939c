"""The distillation loss of one training step: CE and KD on the chosen tokens, plus the hidden-state loss.

``combined_distillation_loss`` is what the distillation forward steps call: the divergence of ``divergences`` (or
the fused cross-entropy + forward KL) on the tokens ``kd_token_mask`` selects, averaged per token
(``masked_token_mean``), weighed with the cross-entropy, plus ``hidden_state_loss`` on the chosen layers; all on
vocab-parallel logits, the same value on every tensor-parallel rank (``divergences``). Used by the distillation
training step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from nemo_noise_plugin.distillation.config import KDConfig
from nemo_noise_plugin.distillation.divergences import cross_entropy_and_forward_kl, logit_divergence
from nemo_noise_plugin.distillation.vocab_parallel import (
    compute_dtype,
    token_cross_entropy,
)
from nemo_noise_plugin.utils import group_size
from nemo_noise_plugin.validation import SettingError

ProcessGroup = dist.ProcessGroup


def masked_token_mean(per_token: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(sum(per_token * mask) / sum(mask), sum(per_token * mask), sum(mask))``.

    The numerator and the (detached) token count are what Megatron's loss reduction needs to average over all
    microbatches and data-parallel ranks; an empty mask gives a mean of 0 (not NaN). Masked-out positions may
    hold any value, NaN included.
    """
    if mask.shape != per_token.shape:
        raise ValueError(f"mask {tuple(mask.shape)} does not match the per-token loss {tuple(per_token.shape)}.")
    weights = mask.to(per_token.dtype)
    total = torch.where(mask != 0, per_token * weights, torch.zeros_like(per_token)).sum()
    count = weights.sum().detach()
    return total / count.clamp(min=1), total, count


def hidden_state_loss(student_hidden: Tensor, teacher_hidden: Tensor, kind: str) -> Tensor:
    """Per-token distance of hidden states ``[..., h]``: ``mse`` = mean_h (s - t)^2, ``cosine`` = 1 - cos(s, t).

    Layer outputs hold the full hidden size on every tensor-parallel rank, so no reduction is needed here.
    """
    if student_hidden.shape != teacher_hidden.shape:
        raise ValueError(f"student hidden {tuple(student_hidden.shape)} != teacher {tuple(teacher_hidden.shape)}.")
    dtype = compute_dtype(student_hidden, teacher_hidden)
    student, teacher = student_hidden.to(dtype), teacher_hidden.detach().to(dtype)
    if kind == "mse":
        return (student - teacher).square().mean(dim=-1)
    if kind == "cosine":
        return 1.0 - F.cosine_similarity(student, teacher, dim=-1, eps=1e-8)
    raise SettingError("kind", kind, "mse or cosine")


def kd_token_mask(loss_mask: Tensor, tokens: str, padding_mask: Tensor | None = None) -> Tensor:
    """The positions distilled: ``response`` = ``loss_mask`` (times ``padding_mask`` if given); ``all`` = every
    non-padding position (``padding_mask``, 1 = real token; None = no padding)."""
    if tokens == "response":
        return loss_mask if padding_mask is None else loss_mask * padding_mask.to(loss_mask.dtype)
    if tokens == "all":
        return torch.ones_like(loss_mask) if padding_mask is None else padding_mask.to(loss_mask.dtype)
    raise SettingError("tokens", tokens, "all or response")


class DistillationLoss(NamedTuple):
    """The combined loss of one microbatch and its parts.

    ``loss`` is the objective (weighted sum of per-part token means); ``loss_sum = loss * num_tokens`` and
    ``num_tokens`` (int, the distilled-token count) are the pair Megatron's schedules reduce across microbatches and
    data-parallel ranks; ``parts`` holds detached means for logging: ``ce``, ``kd`` (the raw divergence, before
    weight and T^2), ``hidden`` (averaged over layers) and ``total`` (= ``loss``); ``counts`` their token counts.
    """

    loss: Tensor
    loss_sum: Tensor
    num_tokens: Tensor
    parts: dict[str, Tensor]
    counts: dict[str, Tensor]

    def bridge_outputs(self) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """``(loss_sum, num_tokens, report)`` as Bridge's ``masked_next_token_loss`` returns them.

        Report entries are ``[sum, count]`` pairs (``lm loss`` is the CE), so the training loop's sums over
        microbatches and ranks give token-weighted averages.
        """
        names = {"ce": "lm loss", "kd": "kd loss", "hidden": "hidden loss", "total": "total loss"}
        report = {
            label: torch.stack([self.parts[part] * self.counts[part], self.counts[part].to(self.parts[part].dtype)])
            for part, label in names.items()
        }
        return self.loss_sum, self.num_tokens, report


def combined_distillation_loss(
    config: KDConfig,
    student_logits: Tensor,
    teacher_logits: Tensor | None,
    loss_mask: Tensor,
    *,
    labels: Tensor | None = None,
    padding_mask: Tensor | None = None,
    hidden_pairs: Sequence[tuple[Tensor, Tensor]] = (),
    tp_group: ProcessGroup | None = None,
    sequence_parallel: bool = False,
) -> DistillationLoss:
    """``ce_weight * CE + kd_scale * KD + hidden_weight * H`` for one microbatch (see ``KDConfig``).

    Layouts: logits ``[b, s, V/tp]`` (``GPTModel`` without labels); ``labels``, ``loss_mask``, ``padding_mask``
    ``[b, s]``; ``hidden_pairs`` = (student, teacher) outputs of ``config.hidden_layers`` in Megatron's
    ``[s, b, h]`` (``[s/tp, b, h]`` with ``sequence_parallel``: gathered here over ``tp_group``). CE is averaged
    over ``loss_mask``, KD and H over ``kd_token_mask``. ``labels`` are required when ``ce_weight > 0``; when
    given with ``ce_weight == 0`` the CE is still reported (without gradient).
    """
    mask = kd_token_mask(loss_mask, config.tokens if config.enabled else "response", padding_mask)
    if tuple(student_logits.shape[:-1]) != tuple(mask.shape):
        raise ValueError(f"logits {tuple(student_logits.shape)} do not match the [b, s] mask {tuple(mask.shape)}.")
    ce_weight = config.ce_weight if config.enabled else 1.0
    if labels is None and ce_weight > 0:
        raise ValueError(f"labels are required with ce_weight={ce_weight!r} (enabled={config.enabled}).")
    zero = student_logits.new_zeros((), dtype=compute_dtype(student_logits))
    count = mask.to(zero.dtype).sum().detach()
    parts = {"ce": zero.detach(), "kd": zero.detach(), "hidden": zero.detach()}
    counts = {"ce": loss_mask.to(zero.dtype).sum().detach(), "kd": count, "hidden": count}
    loss = zero

    distilling = config.enabled and config.kd_weight > 0
    if distilling and teacher_logits is None:
        raise ValueError("teacher_logits are required with kd_weight > 0.")
    per_token_ce = divergence = None
    if distilling and labels is not None and config.loss == "forward_kl" and config.top_k is None:
        per_token_ce, divergence = cross_entropy_and_forward_kl(
            student_logits, teacher_logits, labels, config.temperature, tp_group
        )

    if labels is not None:
        with contextlib.nullcontext() if ce_weight > 0 else torch.no_grad():
            if per_token_ce is None:
                per_token_ce = token_cross_entropy(student_logits, labels, tp_group)
            ce, _, _ = masked_token_mean(per_token_ce, loss_mask)
        parts["ce"] = ce.detach()
        if ce_weight > 0:
            loss = loss + ce_weight * ce

    if distilling:
        if divergence is None:
            divergence = logit_divergence(
                student_logits,
                teacher_logits,
                config.loss,
                temperature=config.temperature,
                beta=config.jsd_beta,
                top_k=config.top_k,
                tp_group=tp_group,
            )
        kd, _, _ = masked_token_mean(divergence, mask)
        parts["kd"] = kd.detach()
        loss = loss + config.kd_scale * kd

    if config.enabled and config.hidden_loss != "none":
        if len(hidden_pairs) != len(config.hidden_layers):
            raise ValueError(
                f"{len(hidden_pairs)} hidden-state pairs given for hidden_layers={config.hidden_layers!r}."
            )
        per_token = sum(
            hidden_state_loss(*_full_sequence(pair, sequence_parallel, tp_group), config.hidden_loss)
            for pair in hidden_pairs
        ) / len(hidden_pairs)
        hidden, _, _ = masked_token_mean(per_token.transpose(0, 1), mask)  # [s, b] -> [b, s]
        parts["hidden"] = hidden.detach()
        if config.hidden_weight > 0:
            loss = loss + config.hidden_weight * hidden

    parts["total"] = loss.detach()
    counts["total"] = count
    return DistillationLoss(loss, loss * count, count.to(torch.int), parts, counts)


def _full_sequence(
    pair: tuple[Tensor, Tensor], sequence_parallel: bool, tp_group: ProcessGroup | None
) -> tuple[Tensor, Tensor]:
    """Gather sequence-parallel ``[s/tp, b, h]`` hidden states to ``[s, b, h]``.

    The student's gather splits its gradient back (``tensor_parallel_output_grad=False``): the loss after it is the
    same on every rank, so a reduce-scatter would count it ``tp`` times.
    """
    if not sequence_parallel or group_size(tp_group) == 1:
        return pair
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    student, teacher = pair
    student = gather_from_sequence_parallel_region(student, tensor_parallel_output_grad=False, group=tp_group)
    with torch.no_grad():
        teacher = gather_from_sequence_parallel_region(teacher.detach(), group=tp_group)
    return student, teacher
