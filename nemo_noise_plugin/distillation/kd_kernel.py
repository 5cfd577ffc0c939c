"""Cross-entropy and forward KL of one vocabulary shard in two passes over the logits: Triton on CUDA, torch elsewhere.

The distillation loss needs, per token, the student's log-normaliser at T = 1 (for the CE) and at temperature T,
the teacher's at T, and ``sum_v p_T(v) (t_v - s_v) / T`` (for the KL). All of them are streaming reductions over
the vocabulary: ``shard_statistics`` computes them for this rank's shard in one read of the student and teacher
logits (online softmax: running maxima and rescaled sums), and ``shard_gradient`` writes the gradient w.r.t. the
student logits in one more read. ``distillation.losses`` combines the shards' statistics over the tensor-parallel
group (a few ``[tokens]`` vectors), so nothing ``[tokens, V/tp]``-sized is ever materialised in float32.

On CUDA with Triton the two passes are fused kernels (one program per token row, float32 accumulation); otherwise
the torch reference below computes the same statistics in row chunks, bounding its float32 temporaries.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch
from torch import Tensor

from nemo_noise_plugin.distillation.vocab_parallel import compute_dtype
from nemo_noise_plugin.noise.triton_kernel import triton_available

__all__ = ["ShardStatistics", "shard_gradient", "shard_statistics", "use_kd_kernel"]

_CHUNK_ELEMENTS = 1 << 24  # the torch reference's float32 temporaries stay below this many elements per tensor


class ShardStatistics(NamedTuple):
    """Per-token ``[tokens]`` statistics of one vocabulary shard (float32, or float64 for float64 logits).

    For ``z`` in (student, student / T, teacher / T): ``*_max`` is the shard's maximum and ``*_sum`` is
    ``sum_v exp(z_v - max)``; ``teacher_cross`` is ``sum_v exp(t_v / T - teacher_max) (t_v - s_v) / T``;
    ``label_logit`` is the student's logit of the label where this shard holds the label, else 0.
    """

    student_max: Tensor
    student_sum: Tensor
    scaled_max: Tensor
    scaled_sum: Tensor
    teacher_max: Tensor
    teacher_sum: Tensor
    teacher_cross: Tensor
    label_logit: Tensor


def use_kd_kernel(logits: Tensor) -> bool:
    """True when the fused Triton kernels serve these logits (CUDA, half or single precision)."""
    return logits.is_cuda and logits.dtype in (torch.bfloat16, torch.float16, torch.float32) and triton_available()


def shard_statistics(student: Tensor, teacher: Tensor, local_labels: Tensor, temperature: float) -> ShardStatistics:
    """The statistics of ``[tokens, V/tp]`` shards; ``local_labels`` are labels minus this shard's first id."""
    if use_kd_kernel(student) and teacher.is_cuda:
        return _statistics_triton(student, teacher, local_labels, temperature)
    return _statistics_torch(student, teacher, local_labels, temperature)


def shard_gradient(
    student: Tensor,
    teacher: Tensor,
    local_labels: Tensor,
    temperature: float,
    lse: tuple[Tensor, Tensor, Tensor],
    ce_weight: Tensor,
    kd_weight: Tensor,
) -> Tensor:
    """``ce_weight (p_S - onehot(label)) + kd_weight / T (p_S,T - p_T,T)`` on the shard, in ``student.dtype``.

    ``lse`` are the full-vocabulary log-normalisers of student, student / T and teacher / T, and the weights the
    per-token gradients of the CE and the KL (``[tokens]``).
    """
    if use_kd_kernel(student) and teacher.is_cuda:
        return _gradient_triton(student, teacher, local_labels, temperature, lse, ce_weight, kd_weight)
    return _gradient_torch(student, teacher, local_labels, temperature, lse, ce_weight, kd_weight)


def _row_chunks(tokens: int, vocab: int) -> list[slice]:
    rows = max(1, _CHUNK_ELEMENTS // max(vocab, 1))
    return [slice(start, min(start + rows, tokens)) for start in range(0, tokens, rows)]


def _statistics_torch(student: Tensor, teacher: Tensor, local_labels: Tensor, temperature: float) -> ShardStatistics:
    dtype = compute_dtype(student)
    tokens, vocab = student.shape
    parts: list[list[Tensor]] = [[] for _ in ShardStatistics._fields]
    owned = (local_labels >= 0) & (local_labels < vocab)
    for rows in _row_chunks(tokens, vocab):
        s = student[rows].to(dtype)
        s_max = s.amax(dim=-1, keepdim=True)
        s_sum = (s - s_max).exp_().sum(dim=-1)
        scaled = s / temperature
        scaled_max = s_max / temperature  # T > 0: the maximum scales with the logits
        scaled_sum = (scaled - scaled_max).exp_().sum(dim=-1)
        t = teacher[rows].to(dtype) / temperature  # a new tensor: the caller's teacher logits stay as they are
        t_max = t.amax(dim=-1, keepdim=True)
        weights = (t - t_max).exp_()
        t_sum = weights.sum(dim=-1)
        cross = (weights * t.sub_(scaled)).sum(dim=-1)
        label = s.gather(-1, local_labels[rows].clamp(0, vocab - 1).unsqueeze(-1)).squeeze(-1)
        label = torch.where(owned[rows], label, torch.zeros_like(label))
        values = (s_max.squeeze(-1), s_sum, scaled_max.squeeze(-1), scaled_sum, t_max.squeeze(-1), t_sum, cross, label)
        for part, value in zip(parts, values, strict=True):
            part.append(value)
    return ShardStatistics(*(torch.cat(part) for part in parts))


def _gradient_torch(student, teacher, local_labels, temperature, lse, ce_weight, kd_weight) -> Tensor:
    dtype = compute_dtype(student)
    tokens, vocab = student.shape
    student_lse, scaled_lse, teacher_lse = (value.unsqueeze(-1) for value in lse)
    ce_weight, kd_weight = ce_weight.to(dtype).unsqueeze(-1), (kd_weight.to(dtype) / temperature).unsqueeze(-1)
    owned = (local_labels >= 0) & (local_labels < vocab)
    grad = torch.empty_like(student)
    for rows in _row_chunks(tokens, vocab):
        s = student[rows].to(dtype)
        chunk = (s - student_lse[rows]).exp_().mul_(ce_weight[rows])
        chunk += (s / temperature - scaled_lse[rows]).exp_().mul_(kd_weight[rows])
        chunk -= (teacher[rows].to(dtype) / temperature - teacher_lse[rows]).exp_().mul_(kd_weight[rows])
        label_grad = torch.where(owned[rows], -ce_weight[rows].squeeze(-1), torch.zeros_like(ce_weight[rows, 0]))
        chunk.scatter_add_(-1, local_labels[rows].clamp(0, vocab - 1).unsqueeze(-1), label_grad.unsqueeze(-1))
        grad[rows] = chunk
    return grad


_BLOCK = 4096


def _statistics_triton(student: Tensor, teacher: Tensor, local_labels: Tensor, temperature: float) -> ShardStatistics:
    student, teacher = student.contiguous(), teacher.contiguous()
    tokens, vocab = student.shape
    out = torch.empty((8, tokens), dtype=torch.float32, device=student.device)
    _kernels()["statistics"][(tokens,)](
        student, teacher, local_labels.contiguous().to(torch.int64), out, vocab, 1.0 / temperature, BLOCK=_BLOCK
    )
    return ShardStatistics(*out.unbind(0))


def _gradient_triton(student, teacher, local_labels, temperature, lse, ce_weight, kd_weight) -> Tensor:
    student, teacher = student.contiguous(), teacher.contiguous()
    tokens, vocab = student.shape
    grad = torch.empty_like(student)
    rows = (
        torch.stack([lse[0], lse[1], lse[2], ce_weight.float(), kd_weight.float() / temperature]).float().contiguous()
    )
    grid = (tokens, -(-vocab // _BLOCK))
    _kernels()["gradient"][grid](
        student,
        teacher,
        local_labels.contiguous().to(torch.int64),
        rows,
        grad,
        tokens,
        vocab,
        1.0 / temperature,
        BLOCK=_BLOCK,
    )
    return grad


@functools.cache
def _kernels() -> dict[str, Any]:
    """Build (once) the two Triton kernels; deferred so that importing this module never needs Triton."""
    import triton
    import triton.language as tl

    @triton.jit
    def statistics(student, teacher, labels, out, vocab, inv_t, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = row * vocab
        label = tl.load(labels + row)
        negative_infinity = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), axis=0)  # 0-d float32 scalars
        zero = tl.sum(tl.zeros([BLOCK], tl.float32), axis=0)
        s_max, s_sum, c_max, c_sum = negative_infinity, zero, negative_infinity, zero
        t_max, t_sum, cross, label_logit = negative_infinity, zero, zero, zero
        for start in range(0, vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            valid = cols < vocab
            s = tl.load(student + base + cols, mask=valid, other=-float("inf")).to(tl.float32)
            t = tl.load(teacher + base + cols, mask=valid, other=-float("inf")).to(tl.float32) * inv_t
            new_max = tl.maximum(s_max, tl.max(s, axis=0))
            s_sum = s_sum * tl.exp(s_max - new_max) + tl.sum(tl.exp(s - new_max), axis=0)
            s_max = new_max
            c = s * inv_t
            new_max = tl.maximum(c_max, tl.max(c, axis=0))
            c_sum = c_sum * tl.exp(c_max - new_max) + tl.sum(tl.exp(c - new_max), axis=0)
            c_max = new_max
            new_max = tl.maximum(t_max, tl.max(t, axis=0))
            rescale = tl.exp(t_max - new_max)
            weights = tl.exp(t - new_max)
            t_sum = t_sum * rescale + tl.sum(weights, axis=0)
            cross = cross * rescale + tl.sum(tl.where(valid, weights * (t - c), 0.0), axis=0)
            t_max = new_max
            owned = (cols == label) & valid  # a label past this shard must not match its padding columns
            label_logit += tl.sum(tl.where(owned, s, 0.0), axis=0)
        tokens = tl.num_programs(0).to(tl.int64)
        tl.store(out + row, s_max)
        tl.store(out + tokens + row, s_sum)
        tl.store(out + 2 * tokens + row, c_max)
        tl.store(out + 3 * tokens + row, c_sum)
        tl.store(out + 4 * tokens + row, t_max)
        tl.store(out + 5 * tokens + row, t_sum)
        tl.store(out + 6 * tokens + row, cross)
        tl.store(out + 7 * tokens + row, label_logit)

    @triton.jit
    def gradient(student, teacher, labels, rows, grad, tokens, vocab, inv_t, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        valid = cols < vocab
        base = row * vocab
        student_lse = tl.load(rows + row)
        scaled_lse = tl.load(rows + tokens + row)
        teacher_lse = tl.load(rows + 2 * tokens + row)
        ce_weight = tl.load(rows + 3 * tokens + row)
        kd_weight = tl.load(rows + 4 * tokens + row)
        label = tl.load(labels + row)
        s = tl.load(student + base + cols, mask=valid, other=0.0).to(tl.float32)
        t = tl.load(teacher + base + cols, mask=valid, other=0.0).to(tl.float32)
        value = ce_weight * tl.exp(s - student_lse)
        value += kd_weight * (tl.exp(s * inv_t - scaled_lse) - tl.exp(t * inv_t - teacher_lse))
        value -= tl.where(cols == label, ce_weight, 0.0)
        tl.store(grad + base + cols, value.to(grad.dtype.element_ty), mask=valid)

    return {"statistics": statistics, "gradient": gradient}
