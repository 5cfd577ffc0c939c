"""Sequence lengths for NEFTune scaling, from the masks a Megatron forward receives.

NEFTune scales noise by ``1/sqrt(L * d)``. Most implementations take ``L`` from the padded tensor; the paper's code
uses each sequence's true length. Under context parallelism the local masks hold Megatron's zig-zag shard of the
sequence (chunks ``r`` and ``2*cp - 1 - r`` of ``2*cp``), so lengths are reduced over the context-parallel group.
Under sequence parallelism the masks are not scattered (only the embedding output is), so no TP reduction is needed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from nemo_noise_plugin.noise.positions import LocalLayout, zigzag_to_global


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This process's rank in ``group``; 0 without a group or without torch.distributed."""
    return dist.get_rank(group) if group is not None and dist.is_initialized() else 0


def group_size(group: dist.ProcessGroup | None) -> int:
    """The size of ``group``; 1 without a group or without torch.distributed."""
    return dist.get_world_size(group) if group is not None and dist.is_initialized() else 1


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
    local_index = torch.arange(loss_mask.size(1), device=loss_mask.device)
    positions = zigzag_to_global(local_index, loss_mask.size(1), LocalLayout(cp_size=cp_size, cp_rank=cp_rank))
    carries_loss = loss_mask != 0
    last = torch.where(carries_loss, positions.unsqueeze(0) + 1, torch.zeros_like(positions).unsqueeze(0))
    lengths = last.amax(dim=1).to(torch.float32)
    if cp_size > 1:
        dist.all_reduce(lengths, op=dist.ReduceOp.MAX, group=cp_group)
    return torch.where(lengths > 0, lengths, torch.full_like(lengths, float(global_length)))
