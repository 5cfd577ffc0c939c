"""Sequence lengths for NEFTune scaling, from the masks a Megatron forward receives.

NEFTune scales noise by ``1/sqrt(L * d)``. Most implementations take ``L`` from the padded tensor; the paper's code
uses each sequence's true length. Under context parallelism the local masks hold Megatron's zig-zag shard of the
sequence (chunks ``r`` and ``2*cp - 1 - r`` of ``2*cp``), so lengths are reduced over the context-parallel group.
Under sequence parallelism the masks are not scattered (only the embedding output is), so no TP reduction is needed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This process's rank in ``group``; 0 without a group or without torch.distributed."""
    return dist.get_rank(group) if group is not None and dist.is_initialized() else 0


def group_size(group: dist.ProcessGroup | None) -> int:
    """The size of ``group``; 1 without a group or without torch.distributed."""
    return dist.get_world_size(group) if group is not None and dist.is_initialized() else 1


def zigzag_global_positions(local_length: int, cp_size: int, cp_rank: int, device: torch.device) -> torch.Tensor:
    """Global sequence positions of the ``local_length`` tokens held by context-parallel rank ``cp_rank``."""
    local = torch.arange(local_length, device=device)
    if cp_size == 1:
        return local
    if local_length % 2:
        raise ValueError(
            f"context parallelism: local sequence length {local_length} must be even (two zig-zag chunks)."
        )
    chunk = local_length // 2
    first, second = cp_rank, 2 * cp_size - 1 - cp_rank
    chunk_index = torch.where(local < chunk, first, second)
    return chunk_index * chunk + local % chunk


def lengths_from_padding_mask(padding_mask: torch.Tensor, cp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """Per-sequence token count from a ``[b, s]`` padding mask (True = padding), summed over the CP group."""
    lengths = (~padding_mask.bool()).sum(dim=1).to(torch.float32)
    if group_size(cp_group) > 1:
        dist.all_reduce(lengths, op=dist.ReduceOp.SUM, group=cp_group)
    return lengths


def lengths_from_loss_mask(
    loss_mask: torch.Tensor, global_length: int, cp_group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Per-sequence length from a ``[b, s]`` loss mask: one past the last position that carries loss.

    Megatron's labels are the inputs shifted by one, so the last real input token is the last position with a
    target; positions after it are padding. A sequence with no loss-carrying position gets ``global_length``.
    """
    cp_size, cp_rank = group_size(cp_group), group_rank(cp_group)
    positions = zigzag_global_positions(loss_mask.size(1), cp_size, cp_rank, loss_mask.device)
    carries_loss = loss_mask != 0
    last = torch.where(carries_loss, positions.unsqueeze(0) + 1, torch.zeros_like(positions).unsqueeze(0))
    lengths = last.amax(dim=1).to(torch.float32)
    if cp_size > 1:
        dist.all_reduce(lengths, op=dist.ReduceOp.MAX, group=cp_group)
    return torch.where(lengths > 0, lengths, torch.full_like(lengths, float(global_length)))
