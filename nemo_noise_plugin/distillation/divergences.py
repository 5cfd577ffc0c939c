"""The divergences of knowledge distillation on vocab-parallel logits: KL both ways, JSD, CE + forward KL fused.

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

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from nemo_noise_plugin.distillation.config import KD_LOSSES
from nemo_noise_plugin.distillation.kd_kernel import shard_gradient, shard_statistics
from nemo_noise_plugin.distillation.vocab_parallel import (
    all_reduce,
    compute_dtype,
    global_max,
    sum_over_shards,
    sum_to_replicated,
    vocab_parallel_log_softmax,
)
from nemo_noise_plugin.utils import group_rank, group_size
from nemo_noise_plugin.validation import check_choice, check_number

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
    check_choice("kind", kind, KD_LOSSES)
    check_number("beta", beta, minimum=0.0, maximum=1.0, inclusive=False)
    check_number("temperature", temperature, minimum=0.0, inclusive=False)
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


def _kl(kind: str, doc: str) -> Callable[..., Tensor]:
    """``logit_divergence`` of ``kind`` as a function of ``(student, teacher, temperature, tp_group, *, top_k)``."""

    def divergence(
        student_logits: Tensor,
        teacher_logits: Tensor,
        temperature: float = 1.0,
        tp_group: ProcessGroup | None = None,
        *,
        top_k: int | None = None,
    ) -> Tensor:
        return logit_divergence(
            student_logits, teacher_logits, kind, temperature=temperature, top_k=top_k, tp_group=tp_group
        )

    divergence.__name__ = divergence.__qualname__ = kind
    divergence.__doc__ = doc
    return divergence


forward_kl = _kl(
    "forward_kl", "Per-token KL(p_T || p_S) = sum_v p_T (log p_T - log p_S) (mean-seeking; the usual KD loss)."
)
reverse_kl = _kl("reverse_kl", "Per-token KL(p_S || p_T) = sum_v p_S (log p_S - log p_T) (mode-seeking).")


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
