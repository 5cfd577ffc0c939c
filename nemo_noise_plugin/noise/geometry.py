"""Where each local decoder-input token sits in the global batch, and which tokens get noise.

The decoder input a rank holds is a slice of the global ``[S, B, h]`` batch: context parallelism keeps Megatron's
zig-zag chunks (``r`` and ``2*cp - 1 - r`` of ``2*cp``, per packed sequence under THD), sequence parallelism then
keeps the tensor-parallel rank's contiguous slice of those, and data parallelism and microbatching pick the columns.
This module maps local rows and columns back to global token positions and global sample indices, so the noise
(a function of those indices only) is the same at every layout.

From the masks the model's forward receives (context-parallel shards, never scattered by sequence parallelism) it
then finds, for every local token: whether it is a real token (not padding), its sequence's true length ``L`` (for
NEFTune scaling) and whether it belongs to the response. NEFTune scales noise by ``1/sqrt(L * d)``; most
implementations take ``L`` from the padded tensor, the paper's code uses each sequence's true length, which this
module reduces over the context-parallel group. A token at global position ``p`` is a response token when the loss
mask at ``p - 1`` is set: Megatron's labels are the inputs shifted by one, so the loss at ``p - 1`` is the prediction
of token ``p``. Under packing (THD with ``cu_seqlens``) positions, lengths and that shift are per packed sequence.
A token is a private-span token (``tokens='spans'``) when the batch's ``private_mask`` is set at its own position:
the mask is aligned with the input tokens, not with the labels, so it needs no shift and no gather.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from nemo_noise_plugin.utils import group_rank, group_size


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


@dataclass
class NoiseBatchInputs:
    """What the noise layer needs from the batch besides the decoder input (as the model's forward received it)."""

    loss_mask: torch.Tensor | None = None
    """``[b, s]`` loss mask (context-parallel shard when CP > 1)."""
    padding_mask: torch.Tensor | None = None
    """``[b, s]`` padding mask, True = padding (context-parallel shard when CP > 1)."""
    input_ids: torch.Tensor | None = None
    """``[b, s]`` token ids (context-parallel shard when CP > 1), for ``special_token_ids``."""
    packed_seq_params: Any | None = None
    """Megatron ``PackedSeqParams`` when sequences are packed (THD, ``cu_seqlens``)."""
    private_mask: torch.Tensor | None = None
    """``[b, s]`` True inside a marked private span, aligned with ``input_ids`` (context-parallel shard when CP > 1),
    for ``tokens='spans'``."""

    @property
    def packed(self) -> bool:
        """True for a packed (THD) batch."""
        params = self.packed_seq_params
        return params is not None and getattr(params, "qkv_format", "thd") == "thd" and params.cu_seqlens_q is not None


@dataclass
class TokenGeometry:
    """Per local token (``[s, b]``): global position, real-token mask, sequence length, response mask."""

    rows: torch.Tensor
    """``[s]`` int64 index of each local row in the context-parallel-local masks (undoing the SP scatter)."""
    positions: torch.Tensor
    """``[s]`` int64 global token positions of the local rows (packed position under THD)."""
    valid: torch.Tensor
    """``[s, b]`` True for real tokens (padding is never noised)."""
    lengths: torch.Tensor
    """``[s, b]`` float32 true length of each token's sequence."""
    response: torch.Tensor | None
    """``[s, b]`` True for response tokens, or None when not requested."""
    global_length: int
    """Padded global length of a row (the packed row under THD)."""
    private: torch.Tensor | None = None
    """``[s, b]`` True for tokens inside a private span, or None when not requested."""


def token_geometry(
    local_rows: int,
    batch_size: int,
    batch: NoiseBatchInputs,
    layout: LocalLayout,
    cp_group: dist.ProcessGroup | None,
    *,
    need_lengths: bool,
    need_response: bool,
    need_private: bool = False,
    device: torch.device,
) -> TokenGeometry:
    """Locate the local decoder-input tokens in the global batch and classify them."""
    local_index = cp_local_rows(local_rows, layout, device)
    cp_local_length = local_rows * layout.sp_size
    private = _local_private_mask(batch, local_index, cp_local_length) if need_private else None
    global_length = cp_local_length * layout.cp_size
    if need_response and batch.loss_mask is None:
        raise ValueError(
            "NoiseConfig.tokens='prompt'/'response' needs the batch's loss_mask to tell prompt from response, "
            "and the forward call passed none. Pass loss_mask= to the model's forward or set noise.tokens='all'."
        )
    if batch.packed:
        geometry = _packed_geometry(local_index, batch, layout, cp_group, need_response, global_length)
        geometry.private = private
        return geometry
    positions = zigzag_to_global(local_index, cp_local_length, layout)
    lengths = torch.full((batch_size,), float(global_length), device=device)
    if batch.padding_mask is not None:
        valid = ~batch.padding_mask.bool()[:, local_index].t()
        if need_lengths:
            lengths = lengths_from_padding_mask(batch.padding_mask, cp_group).to(device)
    elif batch.loss_mask is not None:
        lengths = lengths_from_loss_mask(batch.loss_mask, global_length, cp_group).to(device)
        valid = positions.view(-1, 1) < lengths.view(1, -1)
    elif need_lengths:
        raise ValueError(
            "NoiseConfig.scaling='true_length' needs the batch's loss_mask or padding_mask to find each "
            "sequence's length, and the forward call passed neither. Pass loss_mask= to the model's forward, "
            "or set noise.scaling='padded_length' (HF-compatible) or 'absolute'."
        )
    else:
        valid = torch.ones(local_rows, batch_size, dtype=torch.bool, device=device)
    response = None
    if need_response:
        global_loss = _gather_global_loss_mask(batch.loss_mask, layout, cp_group, cp_local_length)
        previous = torch.cat([torch.zeros_like(global_loss[:, :1]), global_loss[:, :-1]], dim=1)
        response = previous[:, positions].t()
    return TokenGeometry(
        rows=local_index,
        positions=positions,
        valid=valid,
        lengths=lengths.view(1, -1).expand(local_rows, batch_size),
        response=response,
        global_length=global_length,
        private=private,
    )


def _local_private_mask(batch: NoiseBatchInputs, local_index: torch.Tensor, cp_local_length: int) -> torch.Tensor:
    """``[s, b]`` private-span mask of the local rows: the CP-local ``[b, s]`` mask read at ``rows`` (as the padding
    mask is), so sequence parallelism's scatter is undone and no communication is needed."""
    mask = batch.private_mask
    if mask is None:
        raise ValueError(
            "NoiseConfig.tokens='spans' needs the batch's private_mask (True inside a marked private span), and the "
            "forward call passed none. Give the batch a 'private_mask' key (data.span_dataset builds it from an "
            "SFT JSONL's 'private_spans'), pass private_mask= to noise_batch_inputs, or set noise.tokens='all'."
        )
    if mask.dim() != 2 or mask.size(1) != cp_local_length:
        raise ValueError(
            f"private_mask has shape {list(mask.shape)}: expected [b, {cp_local_length}], the batch's (context-"
            "parallel-local) token shape."
        )
    return mask.to(device=local_index.device).bool()[:, local_index].t()


def _gather_global_loss_mask(
    loss_mask: torch.Tensor, layout: LocalLayout, cp_group: dist.ProcessGroup | None, cp_local_length: int
) -> torch.Tensor:
    """The ``[b, S]`` boolean loss mask of the whole sequence, assembled from the context-parallel shards."""
    local = loss_mask.bool()
    if layout.cp_size == 1:
        return local
    shards = [torch.empty_like(local, dtype=torch.uint8) for _ in range(layout.cp_size)]
    dist.all_gather(shards, local.to(torch.uint8).contiguous(), group=cp_group)
    whole = torch.zeros(local.size(0), cp_local_length * layout.cp_size, dtype=torch.bool, device=local.device)
    index = torch.arange(cp_local_length, device=local.device)
    for rank, shard in enumerate(shards):
        rank_layout = LocalLayout(cp_size=layout.cp_size, cp_rank=rank)
        whole[:, zigzag_to_global(index, cp_local_length, rank_layout)] = shard.bool()
    return whole


def _packed_geometry(
    local_index: torch.Tensor,
    batch: NoiseBatchInputs,
    layout: LocalLayout,
    cp_group: dist.ProcessGroup | None,
    need_response: bool,
    global_length: int,
) -> TokenGeometry:
    params = batch.packed_seq_params
    device = local_index.device
    cu_seqlens = params.cu_seqlens_q.to(device=device, dtype=torch.int64)
    padded = params.cu_seqlens_q_padded
    cu_padded = cu_seqlens if padded is None else padded.to(device=device, dtype=torch.int64)
    positions = packed_zigzag_to_global(local_index, cu_padded, layout)
    sequence = torch.searchsorted(cu_padded[1:], positions, right=True).clamp_max(cu_padded.numel() - 2)
    offset = positions - cu_padded[sequence]
    true_lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.float32)
    valid = (offset < true_lengths[sequence]) & (positions < cu_padded[-1])
    response = None
    if need_response:
        cp_local_length = batch.loss_mask.size(1)
        global_loss = _gather_packed_loss_mask(batch.loss_mask, layout, cp_group, cu_padded, cp_local_length)
        previous = torch.cat([torch.zeros_like(global_loss[:1]), global_loss[:-1]])
        response = (previous[positions] & (offset > 0)).view(-1, 1)
    return TokenGeometry(
        rows=local_index,
        positions=positions,
        valid=valid.view(-1, 1),
        lengths=true_lengths[sequence].clamp_min(1.0).view(-1, 1),
        response=response,
        global_length=global_length,
    )


def _gather_packed_loss_mask(
    loss_mask: torch.Tensor,
    layout: LocalLayout,
    cp_group: dist.ProcessGroup | None,
    cu_padded: torch.Tensor,
    cp_local_length: int,
) -> torch.Tensor:
    """The ``[T]`` boolean loss mask of the whole packed row, assembled from the context-parallel shards."""
    local = loss_mask.bool().view(-1)
    if layout.cp_size == 1:
        return local
    shards = [torch.empty_like(local, dtype=torch.uint8) for _ in range(layout.cp_size)]
    dist.all_gather(shards, local.to(torch.uint8).contiguous(), group=cp_group)
    whole = torch.zeros(cp_local_length * layout.cp_size, dtype=torch.bool, device=local.device)
    index = torch.arange(cp_local_length, device=local.device)
    for rank, shard in enumerate(shards):
        rank_layout = LocalLayout(cp_size=layout.cp_size, cp_rank=rank)
        whole[packed_zigzag_to_global(index, cu_padded, rank_layout)] = shard.bool()
    return whole
