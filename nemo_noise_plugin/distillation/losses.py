"""Knowledge-distillation losses on vocab-parallel logits: the noisy student learns the clean teacher's predictions.

Megatron's output layer is a ``ColumnParallelLinear`` that leaves the logits split along the vocabulary: with
tensor parallelism each rank holds ``V/tp`` consecutive vocabulary entries (rank ``r`` owns ``[r*V/tp, (r+1)*V/tp)``),
and ``GPTModel.forward`` without labels returns them as ``[b, s, V/tp]``. Every function here takes such shards
and the tensor-parallel group, and gives the same values on every rank as the full-vocabulary computation would,
with gradients w.r.t. each rank's shard equal to the full-vocabulary gradient's slice; ``tp_group=None`` (or a
group of one) means the logits are the whole vocabulary. Per-token results keep the logits' leading dimensions.

Two reductions make this work, as in Megatron's ``_VocabParallelCrossEntropy``: softmax normalisers are summed
over the shards with a backward that also sums (every shard's terms depend on them), and the per-token sum over
the vocabulary is summed with an identity backward (every rank then holds, and backpropagates, the same loss).
Teacher inputs are always detached; only the student gets gradients. Used by the distillation training step.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from nemo_noise_plugin.distillation.config import KD_LOSSES, KDConfig
from nemo_noise_plugin.distillation.kd_kernel import shard_gradient, shard_statistics
from nemo_noise_plugin.distillation.vocab_parallel import (
    all_reduce,
    compute_dtype,
    global_max,
    sum_over_shards,
    sum_to_replicated,
    token_cross_entropy,
    vocab_parallel_log_softmax,
)
from nemo_noise_plugin.utils import group_rank, group_size

ProcessGroup = dist.ProcessGroup
MAX = dist.ReduceOp.MAX


def _divergence_terms(student_log_probs: Tensor, teacher_log_probs: Tensor, kind: str, beta: float) -> Tensor:
    """Element-wise terms whose sum over the vocabulary is the divergence."""
    if kind == "forward_kl":
        return teacher_log_probs.exp() * (teacher_log_probs - student_log_probs)
    if kind == "reverse_kl":
        return student_log_probs.exp() * (student_log_probs - teacher_log_probs)
    mixture_log_probs = torch.logaddexp(teacher_log_probs + math.log(beta), student_log_probs + math.log1p(-beta))
    teacher_part = teacher_log_probs.exp() * (teacher_log_probs - mixture_log_probs)
    student_part = student_log_probs.exp() * (student_log_probs - mixture_log_probs)
    return beta * teacher_part + (1.0 - beta) * student_part


def _top_k_log_probs(
    student_logits: Tensor, teacher_logits: Tensor, top_k: int, tp_group: ProcessGroup | None
) -> tuple[Tensor, Tensor, Tensor]:
    """Both distributions renormalised over the teacher's global top-k tokens, as ``[..., k]`` tensors.

    Returns (student log-probs, teacher log-probs, owned): entry ``j`` is the ``j``-th of the teacher's top-k
    tokens (descending teacher logit); the teacher log-probs are complete on every rank, the student's are valid
    where ``owned`` (the token lies in this rank's vocabulary shard) and finite placeholders elsewhere.
    """
    shard, tp_size, tp_rank = teacher_logits.size(-1), group_size(tp_group), group_rank(tp_group)
    if top_k > shard * tp_size:
        raise ValueError(f"top_k={top_k} exceeds the vocabulary size {shard * tp_size}.")
    values, indices = teacher_logits.topk(min(top_k, shard), dim=-1)
    indices = indices + tp_rank * shard
    if tp_size > 1:  # candidates: every shard's local top-k; the global top-k is among them
        gathered_values = [torch.empty_like(values) for _ in range(tp_size)]
        gathered_indices = [torch.empty_like(indices) for _ in range(tp_size)]
        dist.all_gather(gathered_values, values.contiguous(), group=tp_group)
        dist.all_gather(gathered_indices, indices.contiguous(), group=tp_group)
        values, position = torch.cat(gathered_values, dim=-1).topk(top_k, dim=-1)
        indices = torch.cat(gathered_indices, dim=-1).gather(-1, position)
    teacher_log_probs = torch.log_softmax(values, dim=-1)

    local = indices - tp_rank * shard
    owned = (local >= 0) & (local < shard)
    selected = student_logits.gather(-1, local.clamp(0, shard - 1))
    maximum = global_max(torch.where(owned, selected.detach(), torch.full_like(selected, -math.inf)), tp_group)
    shifted = torch.where(owned, selected, maximum) - maximum  # placeholders stay finite: no NaN gradients
    normaliser = sum_over_shards((shifted.exp() * owned).sum(dim=-1, keepdim=True), tp_group)
    return shifted - normaliser.log(), teacher_log_probs, owned


def logit_divergence(
    student_logits: Tensor,
    teacher_logits: Tensor,
    kind: str = "forward_kl",
    *,
    temperature: float = 1.0,
    beta: float = 0.5,
    top_k: int | None = None,
    tp_group: ProcessGroup | None = None,
) -> Tensor:
    """Per-token divergence between the temperature-softened student and teacher distributions.

    ``kind``: ``forward_kl`` = sum_v p_T (log p_T - log p_S); ``reverse_kl`` = sum_v p_S (log p_S - log p_T);
    ``jsd`` = beta KL(p_T || m) + (1 - beta) KL(p_S || m), m = beta p_T + (1 - beta) p_S (HF TRL's
    ``generalized_jsd_loss`` for 0 < beta < 1). ``p = softmax(logits / temperature)``. With ``top_k`` both
    distributions are renormalised over the teacher's top-k tokens (ties at the k-th value broken arbitrarily).
    Logits are ``[..., V/tp]`` shards on ``tp_group``; the result ``[...]`` is identical on every rank.
    """
    if kind not in KD_LOSSES:
        raise ValueError(f"kind={kind!r} is invalid: expected one of {', '.join(KD_LOSSES)}.")
    if not 0.0 < beta < 1.0:
        raise ValueError(f"beta={beta!r} is invalid: expected 0 < beta < 1.")
    if not temperature > 0:
        raise ValueError(f"temperature={temperature!r} is invalid: expected > 0.")
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student logits {tuple(student_logits.shape)} != teacher {tuple(teacher_logits.shape)}.")
    dtype = compute_dtype(student_logits, teacher_logits)
    student = student_logits.to(dtype) / temperature
    teacher = teacher_logits.detach().to(dtype) / temperature
    if top_k is None:
        student_log_probs = vocab_parallel_log_softmax(student, tp_group)
        with torch.no_grad():
            teacher_log_probs = vocab_parallel_log_softmax(teacher, tp_group)
        terms = _divergence_terms(student_log_probs, teacher_log_probs, kind, beta)
    else:
        student_log_probs, teacher_log_probs, owned = _top_k_log_probs(student, teacher, top_k, tp_group)
        terms = _divergence_terms(student_log_probs, teacher_log_probs, kind, beta) * owned
    return sum_to_replicated(terms.sum(dim=-1), tp_group)


def forward_kl(
    student_logits: Tensor,
    teacher_logits: Tensor,
    temperature: float = 1.0,
    tp_group: ProcessGroup | None = None,
    *,
    top_k: int | None = None,
) -> Tensor:
    """Per-token KL(p_T || p_S) = sum_v p_T (log p_T - log p_S) (mean-seeking; the usual KD loss)."""
    return logit_divergence(
        student_logits, teacher_logits, "forward_kl", temperature=temperature, top_k=top_k, tp_group=tp_group
    )


def reverse_kl(
    student_logits: Tensor,
    teacher_logits: Tensor,
    temperature: float = 1.0,
    tp_group: ProcessGroup | None = None,
    *,
    top_k: int | None = None,
) -> Tensor:
    """Per-token KL(p_S || p_T) = sum_v p_S (log p_S - log p_T) (mode-seeking)."""
    return logit_divergence(
        student_logits, teacher_logits, "reverse_kl", temperature=temperature, top_k=top_k, tp_group=tp_group
    )


def jsd(
    student_logits: Tensor,
    teacher_logits: Tensor,
    beta: float = 0.5,
    temperature: float = 1.0,
    tp_group: ProcessGroup | None = None,
    *,
    top_k: int | None = None,
) -> Tensor:
    """Per-token generalised JSD: beta KL(p_T || m) + (1 - beta) KL(p_S || m), m = beta p_T + (1 - beta) p_S."""
    return logit_divergence(
        student_logits, teacher_logits, "jsd", temperature=temperature, beta=beta, top_k=top_k, tp_group=tp_group
    )


class _CrossEntropyAndForwardKL(torch.autograd.Function):
    """Per-token CE (T = 1) and KL(p_T || p_S) (temperature T) of vocab-parallel logits in two passes over them.

    Forward: each rank reduces its shard to per-token statistics (``kd_kernel.shard_statistics``: maxima,
    rescaled exponential sums, the teacher-weighted logit gap, the label's logit), combined over the
    tensor-parallel group into the full-vocabulary log-normalisers, CE and KL. Backward writes
    ``g_ce * (p_S - onehot(label)) + g_kd / T * (p_S,T - p_T,T)`` on each rank's shard in one more pass. Saves only
    the logits (alive anyway) and ``[tokens]`` vectors; on CUDA both passes are fused Triton kernels.
    """

    @staticmethod
    def forward(ctx, student_logits, teacher_logits, labels, temperature, group):
        shape, shard = student_logits.shape[:-1], student_logits.size(-1)
        student, teacher = student_logits.reshape(-1, shard), teacher_logits.reshape(-1, shard)
        local_labels = labels.reshape(-1).long() - group_rank(group) * shard
        with torch.no_grad():
            stats = shard_statistics(student, teacher, local_labels, temperature)
            own_maxima = torch.stack([stats.student_max, stats.scaled_max, stats.teacher_max])
            maxima = all_reduce(own_maxima.clone(), group, MAX)
            rescale = (own_maxima - maxima).exp_()
            sums = torch.stack([stats.student_sum, stats.scaled_sum, stats.teacher_sum, stats.teacher_cross])
            sums[:3] *= rescale
            sums[3] *= rescale[2]
            sums = all_reduce(torch.cat([sums, stats.label_logit.unsqueeze(0)]), group)
            student_lse, scaled_lse, teacher_lse = (maxima + sums[:3].log()).unbind(0)
            cross_entropy = student_lse - sums[4]
            divergence = sums[3] / sums[2] - teacher_lse + scaled_lse
        ctx.save_for_backward(student, teacher, local_labels, student_lse, scaled_lse, teacher_lse)
        ctx.temperature, ctx.shape = temperature, student_logits.shape
        return cross_entropy.reshape(shape), divergence.reshape(shape)

    @staticmethod
    def backward(ctx, grad_ce, grad_kd):
        student, teacher, local_labels, student_lse, scaled_lse, teacher_lse = ctx.saved_tensors
        zeros = torch.zeros_like(student_lse)
        ce_weight = zeros if grad_ce is None else grad_ce.reshape(-1).to(zeros.dtype)
        kd_weight = zeros if grad_kd is None else grad_kd.reshape(-1).to(zeros.dtype)
        grad = shard_gradient(
            student,
            teacher,
            local_labels,
            ctx.temperature,
            (student_lse, scaled_lse, teacher_lse),
            ce_weight,
            kd_weight,
        )
        return grad.reshape(ctx.shape), None, None, None, None


def cross_entropy_and_forward_kl(
    student_logits: Tensor,
    teacher_logits: Tensor,
    labels: Tensor,
    temperature: float = 1.0,
    tp_group: ProcessGroup | None = None,
) -> tuple[Tensor, Tensor]:
    """Per-token ``(CE, KL(p_T || p_S))`` of vocab-parallel logits, the memory-lean way (see the class above).

    Equal in value and gradient to ``token_cross_entropy`` and ``forward_kl`` (the tests check both).
    """
    return _CrossEntropyAndForwardKL.apply(student_logits, teacher_logits.detach(), labels, temperature, tp_group)


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
    raise ValueError(f"kind={kind!r} is invalid: expected mse or cosine.")


def kd_token_mask(loss_mask: Tensor, tokens: str, padding_mask: Tensor | None = None) -> Tensor:
    """The positions distilled: ``response`` = ``loss_mask`` (times ``padding_mask`` if given); ``all`` = every
    non-padding position (``padding_mask``, 1 = real token; None = no padding)."""
    if tokens == "response":
        return loss_mask if padding_mask is None else loss_mask * padding_mask.to(loss_mask.dtype)
    if tokens == "all":
        return torch.ones_like(loss_mask) if padding_mask is None else padding_mask.to(loss_mask.dtype)
    raise ValueError(f"tokens={tokens!r} is invalid: expected all or response.")


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
