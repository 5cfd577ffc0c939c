"""Where each local decoder-input row sits in the global batch: the indices that key the noise.

The decoder input a rank holds is a slice of the global ``[S, B, h]`` batch: context parallelism keeps Megatron's
zig-zag chunks (``r`` and ``2*cp - 1 - r`` of ``2*cp``, per packed sequence under THD), sequence parallelism then
keeps the tensor-parallel rank's contiguous slice of those, and data parallelism and microbatching pick the columns.
This module maps local rows and columns back to global token positions and global sample indices, so the noise
(a function of those indices only) is the same at every layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LocalLayout:
    """This rank's place in the parallel layout, as far as the decoder input is concerned."""

    sp_size: int = 1
    """Tensor-parallel size when sequence parallelism scatters the decoder input, else 1."""
    sp_rank: int = 0
    cp_size: int = 1
    cp_rank: int = 0
    dp_size: int = 1
    dp_rank: int = 0


def cp_local_rows(local_rows: int, layout: LocalLayout, device: torch.device) -> torch.Tensor:
    """Index of each local decoder-input row in the context-parallel-local sequence (undoing the SP scatter)."""
    return layout.sp_rank * local_rows + torch.arange(local_rows, device=device, dtype=torch.int64)


def zigzag_to_global(cp_local_index: torch.Tensor, cp_local_length: int, layout: LocalLayout) -> torch.Tensor:
    """Global positions of context-parallel-local indices under Megatron's zig-zag split of one sequence."""
    if layout.cp_size == 1:
        return cp_local_index
    if cp_local_length % 2:
        raise ValueError(
            f"context parallelism: local sequence length {cp_local_length} must be even (two zig-zag chunks)."
        )
    chunk = cp_local_length // 2
    first, second = layout.cp_rank, 2 * layout.cp_size - 1 - layout.cp_rank
    chunk_index = torch.where(cp_local_index < chunk, first, second)
    return chunk_index * chunk + cp_local_index % chunk


def packed_zigzag_to_global(
    cp_local_index: torch.Tensor, cu_seqlens_padded: torch.Tensor, layout: LocalLayout
) -> torch.Tensor:
    """Global packed positions of CP-local THD indices: each packed sequence is zig-zag split on its own."""
    if layout.cp_size == 1:
        return cp_local_index
    padded_lengths = (cu_seqlens_padded[1:] - cu_seqlens_padded[:-1]).to(torch.int64)
    if bool((padded_lengths % (2 * layout.cp_size)).any()):
        raise ValueError(
            f"packed sequences under context parallelism: every padded length (cu_seqlens_padded differences "
            f"{padded_lengths.tolist()}) must be a multiple of 2 * cp = {2 * layout.cp_size}."
        )
    local_lengths = padded_lengths // layout.cp_size
    local_starts = torch.cumsum(local_lengths, 0) - local_lengths
    sequence = torch.searchsorted(local_starts + local_lengths, cp_local_index, right=True)
    offset_in_local = cp_local_index - local_starts[sequence]
    chunk = local_lengths[sequence] // 2
    first, second = layout.cp_rank, 2 * layout.cp_size - 1 - layout.cp_rank
    chunk_index = torch.where(offset_in_local < chunk, first, second)
    return cu_seqlens_padded.to(torch.int64)[sequence] + chunk_index * chunk + offset_in_local % chunk


def global_sample_indices(micro_batch_size: int, microbatch: int, layout: LocalLayout, device: torch.device):
    """Index of each local column in the iteration's global batch, in Megatron's sampler order.

    Megatron's pretraining sampler hands microbatch ``m`` of data-parallel rank ``r`` the samples
    ``m * mbs * dp + r * mbs + j``, so this index names the same sample at any DP size and microbatch split.
    """
    base = microbatch * micro_batch_size * layout.dp_size + layout.dp_rank * micro_batch_size
    return base + torch.arange(micro_batch_size, device=device, dtype=torch.int64)
