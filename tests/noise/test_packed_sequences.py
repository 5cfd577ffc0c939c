"""Packed sequences (THD with ``cu_seqlens``): per-sequence L, positions and prompt/response, also under CP=2."""

from __future__ import annotations

import math

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams

from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.noise.geometry import NoiseBatchInputs
from nemo_noise_plugin.noise.layer import EmbeddingNoise
from nemo_noise_plugin.noise.schedule import NoiseClock
from tests.support.gloo_ranks import run_on_gloo_ranks

HIDDEN = 64
TRUE_LENGTHS = (5, 7, 3)
PADDED_LENGTHS = (8, 8, 4)  # multiples of 2 * cp for CP = 2
PROMPT_LENGTHS = (2, 4, 1)
TOTAL = sum(PADDED_LENGTHS)


def _cu(lengths) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def packed_params() -> PackedSeqParams:
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=_cu(TRUE_LENGTHS),
        cu_seqlens_kv=_cu(TRUE_LENGTHS),
        cu_seqlens_q_padded=_cu(PADDED_LENGTHS),
        cu_seqlens_kv_padded=_cu(PADDED_LENGTHS),
    )


def packed_loss_mask() -> torch.Tensor:
    mask = torch.zeros(1, TOTAL)
    for start, length, prompt in zip(_cu(PADDED_LENGTHS)[:-1].tolist(), TRUE_LENGTHS, PROMPT_LENGTHS, strict=True):
        mask[0, start + prompt - 1 : start + length] = 1.0
    return mask


CONFIGS = {
    "neftune": NoiseConfig(alpha=5.0),
    "response": NoiseConfig(alpha=5.0, scaling="absolute", tokens="response"),
}


def _packed_noise(config: NoiseConfig, rows: int, loss_mask: torch.Tensor, groups=None) -> torch.Tensor:
    layer = EmbeddingNoise(config, sequence_parallel=False, pg_collection=groups)
    inputs = NoiseBatchInputs(loss_mask=loss_mask, packed_seq_params=packed_params())
    return layer(torch.zeros(rows, 1, HIDDEN), inputs, NoiseClock(iteration=2))


@pytest.fixture(scope="module")
def references(megatron_cpu):
    return {name: _packed_noise(config, TOTAL, packed_loss_mask()) for name, config in CONFIGS.items()}


def test_each_packed_sequence_is_scaled_by_its_own_true_length_and_padding_is_clean(references):
    noise = references["neftune"][:, 0]
    for start, length, padded in zip(_cu(PADDED_LENGTHS)[:-1].tolist(), TRUE_LENGTHS, PADDED_LENGTHS, strict=True):
        bound = 5.0 / math.sqrt(length * HIDDEN)
        real = noise[start : start + length]
        assert real.abs().max() <= bound * (1 + 1e-6)
        assert real.abs().max() >= 0.9 * bound
        assert torch.count_nonzero(noise[start + length : start + padded]) == 0


def test_response_selection_does_not_leak_across_packed_sequence_boundaries(references):
    touched = references["response"][:, 0].abs().amax(dim=-1) > 0
    expected = torch.zeros(TOTAL, dtype=torch.bool)
    for start, length, prompt in zip(_cu(PADDED_LENGTHS)[:-1].tolist(), TRUE_LENGTHS, PROMPT_LENGTHS, strict=True):
        expected[start + prompt : start + length] = True
    assert torch.equal(touched, expected)


def _te_partition(cp_size: int, cp_rank: int) -> torch.Tensor:
    """Transformer Engine's THD split: each sequence in 2*cp chunks, rank r keeps chunks r and 2*cp-1-r."""
    index = []
    for start, padded in zip(_cu(PADDED_LENGTHS)[:-1].tolist(), PADDED_LENGTHS, strict=True):
        chunk = padded // (2 * cp_size)
        for part in (cp_rank, 2 * cp_size - 1 - cp_rank):
            index.extend(range(start + part * chunk, start + (part + 1) * chunk))
    return torch.tensor(index)


def _packed_noise_under_cp(rank: int, world_size: int, port: int) -> dict:
    from megatron.core.process_groups_config import ProcessGroupCollection

    from tests.support.models import destroy_cpu_parallel, init_cpu_parallel

    init_cpu_parallel(rank=rank, world_size=world_size, port=port, context_parallel_size=2)
    try:
        groups = ProcessGroupCollection.use_mpu_process_groups()
        index = _te_partition(2, rank)
        local_loss = packed_loss_mask()[:, index]
        return {
            "index": index,
            **{name: _packed_noise(config, index.numel(), local_loss, groups) for name, config in CONFIGS.items()},
        }
    finally:
        destroy_cpu_parallel()


@pytest.mark.multiprocess
def test_packed_noise_under_cp2_is_bit_identical_to_one_process(references):
    results = run_on_gloo_ranks(_packed_noise_under_cp, 2)
    for name, expected in references.items():
        assembled = torch.full_like(expected, float("nan"))
        for result in results:
            assembled[result["index"]] = result[name]
        assert torch.equal(assembled, expected), name
