"""Vocabulary-parallel primitives: reductions over the tensor-parallel shards of Megatron's logits.

Megatron's output layer is a ``ColumnParallelLinear`` that leaves the logits split along the vocabulary: with
tensor parallelism each rank holds ``V/tp`` consecutive vocabulary entries (rank ``r`` owns ``[r*V/tp, (r+1)*V/tp)``).
Two reductions make full-vocabulary math work on such shards, as in Megatron's ``_VocabParallelCrossEntropy``:
softmax normalisers are summed over the shards with a backward that also sums (every shard's terms depend on them),
and the per-token sum over the vocabulary is summed with an identity backward (every rank then holds, and
backpropagates, the same loss). ``tp_group=None`` (or a group of one) means the logits are the whole vocabulary.
The KD losses (``distillation.losses``) are built from these.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from nemo_noise_plugin.utils import group_rank, group_size

ProcessGroup = dist.ProcessGroup

__all__ = [
    "all_reduce",
    "compute_dtype",
    "global_max",
    "sum_over_shards",
    "sum_to_replicated",
    "token_cross_entropy",
    "vocab_parallel_log_softmax",
]


def compute_dtype(*tensors: Tensor) -> torch.dtype:
    """float32 for half-precision logits (as Megatron's cross-entropy), float64 stays float64."""
    dtype = torch.float32
    for tensor in tensors:
        dtype = torch.promote_types(dtype, tensor.dtype)
    return dtype


class _SumOverShards(torch.autograd.Function):
    """All-reduce (sum) of per-shard partial sums that every rank then uses in its own shard's terms.

    Backward sums the output gradients over the ranks too: rank ``r``'s partial sum influences every rank's terms.
    """

    @staticmethod
    def forward(ctx, tensor: Tensor, group: ProcessGroup) -> Tensor:
        ctx.group = group
        total = tensor.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _SumToReplicated(torch.autograd.Function):
    """All-reduce (sum) of per-shard partial results into a value every rank uses identically; backward: identity.

    The same contract as Megatron's ``reduce_from_tensor_model_parallel_region``: each rank backpropagates the
    same downstream loss, so the gradient of its partial result is the gradient of the total.
    """

    @staticmethod
    def forward(ctx, tensor: Tensor, group: ProcessGroup) -> Tensor:
        total = tensor.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


def sum_over_shards(tensor: Tensor, group: ProcessGroup | None) -> Tensor:
    """Sum of per-shard partial sums, with a backward that sums too (``_SumOverShards``)."""
    return tensor if group_size(group) == 1 else _SumOverShards.apply(tensor, group)


def sum_to_replicated(tensor: Tensor, group: ProcessGroup | None) -> Tensor:
    """Sum of per-shard partial results with an identity backward (``_SumToReplicated``)."""
    return tensor if group_size(group) == 1 else _SumToReplicated.apply(tensor, group)


def global_max(tensor: Tensor, group: ProcessGroup | None) -> Tensor:
    """Max over the last dimension and all shards, detached (a shift that cancels out of every softmax)."""
    maximum = tensor.detach().amax(dim=-1, keepdim=True)
    if group_size(group) > 1:
        dist.all_reduce(maximum, op=dist.ReduceOp.MAX, group=group)
    return maximum


def vocab_parallel_log_softmax(logits: Tensor, tp_group: ProcessGroup | None = None) -> Tensor:
    """Log-softmax over the full vocabulary of vocab-parallel ``logits`` ``[..., V/tp]``; returns this rank's shard.

    Numerically stable (shifted by the global max) and computed in float32 at least. The backward is exact for a
    loss made of every rank's shard: the normaliser's gradient is summed over the ranks.
    """
    logits = logits.to(compute_dtype(logits))
    shifted = logits - global_max(logits, tp_group)
    normaliser = sum_over_shards(shifted.exp().sum(dim=-1, keepdim=True), tp_group)
    return shifted - normaliser.log()


def token_cross_entropy(logits: Tensor, labels: Tensor, tp_group: ProcessGroup | None = None) -> Tensor:
    """Per-token cross-entropy ``-log p(label)`` of vocab-parallel ``logits`` (same as Megatron's CE, no smoothing)."""
    log_probs = vocab_parallel_log_softmax(logits, tp_group)
    shard = log_probs.size(-1)
    local = labels.long() - group_rank(tp_group) * shard
    owned = (local >= 0) & (local < shard)
    picked = log_probs.gather(-1, local.clamp(0, shard - 1).unsqueeze(-1)).squeeze(-1)
    return -sum_to_replicated(torch.where(owned, picked, torch.zeros_like(picked)), tp_group)


def all_reduce(tensor: Tensor, group: ProcessGroup | None, op=dist.ReduceOp.SUM) -> Tensor:
    """In-place all-reduce over ``group`` (nothing for a group of one or none); returns ``tensor``."""
    if group_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor
