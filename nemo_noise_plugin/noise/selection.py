"""Which local tokens get noise, and how long their sequences are.

From the masks the model's forward receives (context-parallel shards, never scattered by sequence parallelism) this
module finds, for every local decoder-input row and column: its global position, whether it is a real token (not
padding), its sequence's true length ``L`` (for NEFTune scaling), and whether it belongs to the response.

A token at global position ``p`` is a response token when the loss mask at ``p - 1`` is set: Megatron's labels are
the inputs shifted by one, so the loss at ``p - 1`` is the prediction of token ``p``. Under packing (THD with
``cu_seqlens``) positions, lengths and that shift are per packed sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from nemo_noise_plugin.noise.lengths import lengths_from_loss_mask, lengths_from_padding_mask
from nemo_noise_plugin.noise.positions import (
    LocalLayout,
    cp_local_rows,
    packed_zigzag_to_global,
    zigzag_to_global,
)


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


def token_geometry(
    local_rows: int,
    batch_size: int,
    batch: NoiseBatchInputs,
    layout: LocalLayout,
    cp_group: dist.ProcessGroup | None,
    *,
    need_lengths: bool,
    need_response: bool,
    device: torch.device,
) -> TokenGeometry:
    """Locate the local decoder-input tokens in the global batch and classify them."""
    local_index = cp_local_rows(local_rows, layout, device)
    cp_local_length = local_rows * layout.sp_size
    global_length = cp_local_length * layout.cp_size
    if need_response and batch.loss_mask is None:
        raise ValueError(
            "NoiseConfig.tokens='prompt'/'response' needs the batch's loss_mask to tell prompt from response, "
            "and the forward call passed none. Pass loss_mask= to the model's forward or set noise.tokens='all'."
        )
    if batch.packed:
        return _packed_geometry(local_index, batch, layout, cp_group, need_response, global_length)
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
    )


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
