"""The same global batch gets bit-identical noise at every parallel layout (gloo processes, real Megatron groups).

Each layout's ranks noise a zero decoder input (so the output *is* the noise) for their share of one global batch;
the shares are put back at the global positions and sample indices that Megatron's own splitting functions give
(``get_batch_on_this_cp_rank``, ``scatter_to_sequence_parallel_region``, the sampler's DP order) and compared with
the noise of the whole batch computed in one process.
"""

from __future__ import annotations

import pytest
import torch

from nemo_noise_plugin.noise.config import NoiseConfig, load_noise_config
from nemo_noise_plugin.noise.families import NOISE_FAMILIES
from nemo_noise_plugin.noise.geometry import NoiseBatchInputs
from nemo_noise_plugin.noise.layer import EmbeddingNoise
from nemo_noise_plugin.noise.schedule import NoiseClock
from tests.support.gloo_ranks import run_on_gloo_ranks

SEQ, BATCH, HIDDEN, ITERATION = 16, 4, 64, 3
TRUE_LENGTHS = (16, 12, 9, 5)
PROMPT_LENGTHS = (6, 3, 4, 2)
SPECIAL_TOKEN = 7

CONFIGS = {
    "neftune": NoiseConfig(alpha=5.0, seed=99),
    "gaussian_response": NoiseConfig(
        mechanism="gaussian", sigma=2.0, tokens="response", special_token_ids=[SPECIAL_TOKEN], seed=5
    ),
    "prompt_absolute": NoiseConfig(alpha=0.5, scaling="absolute", tokens="prompt", seed=17),
    "metric_dp": NoiseConfig(mechanism="metric_dp", eta=50.0, clip_norm=1.0, seed=3),
    **{f"family_{name}": load_noise_config(family.preset, seed=11) for name, family in NOISE_FAMILIES.items()},
}
"""Hand-picked settings, and every noise family's preset (a new family is covered by its row)."""


def global_batch() -> dict[str, torch.Tensor]:
    """Token ids (with special tokens sprinkled in), loss mask over each response, global positions."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(8, 256, (BATCH, SEQ), generator=generator)
    tokens[:, ::5] = SPECIAL_TOKEN
    loss_mask = torch.zeros(BATCH, SEQ)
    for row, (length, prompt) in enumerate(zip(TRUE_LENGTHS, PROMPT_LENGTHS, strict=True)):
        loss_mask[row, prompt - 1 : length] = 1.0  # the label at p - 1 is token p
    positions = torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1).contiguous()
    return {"tokens": tokens, "loss_mask": loss_mask, "position_ids": positions}


def reference_noise(config: NoiseConfig) -> torch.Tensor:
    """The whole batch's noise in one process: TP = CP = DP = 1, one microbatch."""
    batch = global_batch()
    layer = EmbeddingNoise(config, sequence_parallel=False, pg_collection=None)
    clock = NoiseClock(iteration=ITERATION)
    inputs = NoiseBatchInputs(loss_mask=batch["loss_mask"], input_ids=batch["tokens"])
    return layer(torch.zeros(SEQ, BATCH, HIDDEN), inputs, clock)


def _noise_at_layout(rank: int, world_size: int, port: int, tp: int, cp: int, sp: bool, microbatches: int) -> dict:
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.num_microbatches_calculator import (
        destroy_num_microbatches_calculator,
        init_num_microbatches_calculator,
    )
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.utils import get_batch_on_this_cp_rank

    from tests.support.models import destroy_cpu_parallel, init_cpu_parallel

    init_cpu_parallel(
        rank=rank, world_size=world_size, port=port, tensor_model_parallel_size=tp, context_parallel_size=cp
    )
    dp_size = parallel_state.get_data_parallel_world_size()
    dp_rank = parallel_state.get_data_parallel_rank()
    micro_batch_size = BATCH // (dp_size * microbatches)
    init_num_microbatches_calculator(rank, None, BATCH, micro_batch_size, dp_size)
    try:
        groups = ProcessGroupCollection.use_mpu_process_groups()
        whole = global_batch()
        shares = {name: [] for name in CONFIGS}
        layers = {
            name: EmbeddingNoise(config, sequence_parallel=sp, pg_collection=groups) for name, config in CONFIGS.items()
        }
        clocks = {name: NoiseClock() for name in CONFIGS}
        for clock in clocks.values():
            clock.start_iteration(ITERATION)
        for microbatch in range(microbatches):
            # Megatron's sampler order: microbatch m of DP rank r holds samples m*mbs*dp + r*mbs + j.
            first = microbatch * micro_batch_size * dp_size + dp_rank * micro_batch_size
            samples = list(range(first, first + micro_batch_size))
            local = get_batch_on_this_cp_rank(
                {key: value[samples].clone() for key, value in whole.items()},
                is_hybrid_cp=False,
                cp_group=parallel_state.get_context_parallel_group(),
            )
            rows = local["position_ids"][0]  # global positions of this CP rank's tokens
            if sp:
                rows = tensor_parallel.scatter_to_sequence_parallel_region(rows.view(-1, 1).float()).view(-1).long()
            inputs = NoiseBatchInputs(loss_mask=local["loss_mask"], input_ids=local["tokens"])
            for name, layer in layers.items():
                noise = layer(torch.zeros(rows.numel(), micro_batch_size, HIDDEN), inputs, clocks[name])
                clocks[name].advance()
                shares[name].append({"rows": rows, "samples": samples, "noise": noise})
        return {"shares": shares, "clocks": {name: clock.state_dict() for name, clock in clocks.items()}}
    finally:
        destroy_num_microbatches_calculator()
        destroy_cpu_parallel()


def _assemble(results: list[dict], name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Put every rank's shares back into a global ``[S, B, h]`` tensor; also count how often each element came."""
    assembled = torch.full((SEQ, BATCH, HIDDEN), float("nan"))
    coverage = torch.zeros(SEQ, BATCH, dtype=torch.int64)
    for result in results:
        for share in result["shares"][name]:
            rows, samples = share["rows"], torch.tensor(share["samples"])
            block = assembled[rows][:, samples]
            previous = block.clone()
            written = torch.where(torch.isnan(previous), share["noise"], previous)
            assert torch.equal(written, share["noise"]), "replicas of one element disagree"
            assembled[rows.view(-1, 1), samples.view(1, -1)] = share["noise"]
            coverage[rows.view(-1, 1), samples.view(1, -1)] += 1
    return assembled, coverage


LAYOUTS = {
    "tp2": dict(world_size=2, tp=2, cp=1, sp=False, microbatches=1),
    "tp2_sp": dict(world_size=2, tp=2, cp=1, sp=True, microbatches=1),
    "cp2": dict(world_size=2, tp=1, cp=2, sp=False, microbatches=1),
    "dp2_two_microbatches": dict(world_size=2, tp=1, cp=1, sp=False, microbatches=2),
    "tp2_sp_cp2": dict(world_size=4, tp=2, cp=2, sp=True, microbatches=1),
}


@pytest.fixture(scope="module")
def references(megatron_cpu):
    return {name: reference_noise(config) for name, config in CONFIGS.items()}


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "layout",
    [pytest.param(name, marks=pytest.mark.slow) if LAYOUTS[name]["world_size"] > 2 else name for name in LAYOUTS],
)  # the 4-process layout is slow (about 20 s): the main suite stays under 10 minutes
def test_global_batch_gets_bit_identical_noise_at_every_layout(references, layout):
    spec = dict(LAYOUTS[layout])
    world_size = spec.pop("world_size")
    results = run_on_gloo_ranks(_noise_at_layout, world_size, spec["tp"], spec["cp"], spec["sp"], spec["microbatches"])
    replicas = 1 if spec["sp"] else spec["tp"]  # without SP every TP rank holds the whole decoder input
    for name, expected in references.items():
        assembled, coverage = _assemble(results, name)
        assert torch.equal(coverage, torch.full_like(coverage, replicas)), f"{name}: every element exactly once"
        assert torch.equal(assembled, expected), f"{name}: noise differs from the single-process batch"
    for result in results:
        assert result["clocks"]["neftune"] == {"iteration": ITERATION + 1, "microbatch": 0}


def test_microbatch_split_does_not_change_the_noise(references):
    """Four microbatches of one sample each (one process) reproduce the one-microbatch noise exactly."""
    batch = global_batch()
    for name, config in CONFIGS.items():
        layer = EmbeddingNoise(config, sequence_parallel=False, pg_collection=None)
        clock = NoiseClock()
        clock.start_iteration(ITERATION)
        pieces = []
        for sample in range(BATCH):
            inputs = NoiseBatchInputs(
                loss_mask=batch["loss_mask"][sample : sample + 1], input_ids=batch["tokens"][sample : sample + 1]
            )
            pieces.append(layer(torch.zeros(SEQ, 1, HIDDEN), inputs, clock))
            clock.advance(num_microbatches=BATCH)
        assert torch.equal(torch.cat(pieces, dim=1), references[name]), name
        assert clock.state_dict() == {"iteration": ITERATION + 1, "microbatch": 0}


def test_reference_noise_respects_the_token_selection(references):
    batch = global_batch()
    real = torch.arange(SEQ).view(-1, 1) < torch.tensor(TRUE_LENGTHS).view(1, -1)
    response = real & (torch.arange(SEQ).view(-1, 1) >= torch.tensor(PROMPT_LENGTHS).view(1, -1))
    special = batch["tokens"].t() == SPECIAL_TOKEN
    touched = {name: noise.abs().amax(dim=-1) > 0 for name, noise in references.items()}
    assert torch.equal(touched["neftune"], real)
    assert torch.equal(touched["metric_dp"], real)
    assert torch.equal(touched["gaussian_response"], response & ~special)
    assert torch.equal(touched["prompt_absolute"], real & ~response)


def test_different_iterations_samples_and_positions_get_independent_noise(references):
    noise = references["neftune"]
    assert not torch.equal(noise[:, 0], noise[:, 1])
    assert not torch.equal(noise[0, 0], noise[1, 0])
    layer = EmbeddingNoise(CONFIGS["neftune"], sequence_parallel=False, pg_collection=None)
    batch = global_batch()
    inputs = NoiseBatchInputs(loss_mask=batch["loss_mask"])
    later = layer(torch.zeros(SEQ, BATCH, HIDDEN), inputs, NoiseClock(iteration=ITERATION + 1))
    assert not torch.equal(later, noise)
    correlation = torch.corrcoef(torch.stack([later[:5, 0].flatten(), noise[:5, 0].flatten()]))[0, 1]
    assert abs(correlation.item()) < 0.1


def _model_noise_under_tp(rank: int, world_size: int, port: int) -> torch.Tensor:
    from nemo_noise_plugin.model import NoisyGPTModel
    from tests.support.models import (
        build_tiny_gpt,
        destroy_cpu_parallel,
        init_cpu_parallel,
        tiny_gpt_config,
    )

    init_cpu_parallel(rank=rank, world_size=world_size, port=port, tensor_model_parallel_size=2)
    try:
        config = tiny_gpt_config(tensor_model_parallel_size=2)
        model = build_tiny_gpt(config, model_class=NoisyGPTModel, noise_config=CONFIGS["neftune"])
        with torch.no_grad():
            model.embedding.word_embeddings.weight.zero_()  # the decoder input is then exactly the noise
        model.noise_clock.start_iteration(ITERATION)
        batch = global_batch()
        with torch.no_grad(), model.noise_batch_inputs(batch["loss_mask"]):
            return model._preprocess(input_ids=batch["tokens"], position_ids=batch["position_ids"])[0]
    finally:
        destroy_cpu_parallel()


@pytest.mark.multiprocess
def test_noisy_model_under_tp2_adds_the_single_process_noise_on_both_ranks(references):
    first, second = run_on_gloo_ranks(_model_noise_under_tp, 2)
    assert torch.equal(first, second)
    assert torch.equal(first, references["neftune"])
