"""Sequence lengths for NEFTune scaling, including Megatron's zig-zag context-parallel shards."""

from __future__ import annotations

import pytest
import torch

from nemo_noise_plugin.noise.geometry import (
    LocalLayout,
    lengths_from_loss_mask,
    lengths_from_padding_mask,
    zigzag_to_global,
)
from tests.support.gloo_ranks import run_on_gloo_ranks


def _zigzag_shard(full: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Megatron's get_batch_on_this_cp_rank slicing of a [b, s] tensor."""
    chunks = full.view(full.size(0), 2 * cp_size, -1)
    return torch.cat([chunks[:, cp_rank], chunks[:, 2 * cp_size - 1 - cp_rank]], dim=1)


def test_zigzag_positions_match_megatrons_chunk_assignment():
    full = torch.arange(16).unsqueeze(0)
    for cp_rank in range(2):
        expected = _zigzag_shard(full, 2, cp_rank)[0]
        assert torch.equal(zigzag_to_global(torch.arange(8), 8, LocalLayout(cp_size=2, cp_rank=cp_rank)), expected)


def test_odd_local_length_under_context_parallelism_is_rejected():
    with pytest.raises(ValueError, match="local sequence length 7 must be even"):
        zigzag_to_global(torch.arange(7), 7, LocalLayout(cp_size=2, cp_rank=0))


def test_loss_mask_length_is_one_past_the_last_position_with_loss():
    loss_mask = torch.zeros(3, 10)
    loss_mask[0, 3:7] = 1  # prompt 0..2 without loss, padding from 7
    loss_mask[1, :] = 1
    lengths = lengths_from_loss_mask(loss_mask, global_length=10, cp_group=None)
    assert lengths.tolist() == [7.0, 10.0, 10.0]  # no loss at all: the padded length


def test_padding_mask_length_counts_real_tokens():
    padding = torch.tensor([[False] * 6 + [True] * 4, [False] * 10])
    assert lengths_from_padding_mask(padding, cp_group=None).tolist() == [6.0, 10.0]


def _lengths_on_cp_shard(rank: int, world_size: int, port: int) -> dict:
    from megatron.core import parallel_state

    from tests.support.models import destroy_cpu_parallel, init_cpu_parallel

    init_cpu_parallel(rank=rank, world_size=world_size, port=port, context_parallel_size=2)
    try:
        group = parallel_state.get_context_parallel_group()
        loss_mask = torch.zeros(3, 16)
        loss_mask[0, 2:5] = 1  # ends in chunk 1 (rank 1's first chunk)
        loss_mask[1, 4:14] = 1  # ends in chunk 3 (rank 0's second chunk)
        local_loss = _zigzag_shard(loss_mask, 2, rank)
        padding = torch.ones(3, 16, dtype=torch.bool)
        padding[0, :5] = False
        padding[1, :14] = False
        padding[2, :] = False
        return {
            "loss": lengths_from_loss_mask(local_loss, 16, group).tolist(),
            "padding": lengths_from_padding_mask(_zigzag_shard(padding, 2, rank), group).tolist(),
        }
    finally:
        destroy_cpu_parallel()


@pytest.mark.multiprocess
def test_context_parallel_shards_agree_with_the_full_sequence():
    first, second = run_on_gloo_ranks(_lengths_on_cp_shard, 2)
    assert first == second == {"loss": [5.0, 14.0, 16.0], "padding": [5.0, 14.0, 16.0]}
