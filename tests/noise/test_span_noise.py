"""``tokens='spans'``: only private-span tokens are noised, with the same noise and gradients at every layout.

The layout comparison follows ``test_layout_invariance.py``: each layout's ranks take their share of one global
batch the way Megatron splits it (the sampler's DP order, ``get_batch_on_this_cp_rank``'s zig-zag shard, which also
shards the private mask, and ``scatter_to_sequence_parallel_region``), noise a random decoder input and backpropagate
a fixed weighting of the output; the shares of the noised input and of its gradient are put back at their global
positions and compared with one process holding the whole batch.
"""

from __future__ import annotations

import pytest
import torch

from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.noise.geometry import NoiseBatchInputs
from nemo_noise_plugin.noise.layer import EmbeddingNoise
from nemo_noise_plugin.noise.schedule import NoiseClock
from tests.support.gloo_ranks import run_on_gloo_ranks

SEQ, BATCH, HIDDEN, ITERATION = 16, 4, 32, 5
TRUE_LENGTHS = (16, 12, 9, 5)
SPANS = (((2, 5), (9, 14)), ((0, 1), (6, 8)), ((3, 9),), ())
"""Per row: private spans as [start, end) token positions (row 3 has none)."""
SPECIAL_TOKEN = 7

CONFIGS = {
    "gaussian_mechanism": NoiseConfig(
        mechanism="gaussian_mechanism", epsilon=5.0, clip_norm=1.0, tokens="spans", seed=21
    ),  # clipping: the gradient is not the identity
    "neftune_true_length": NoiseConfig(alpha=5.0, tokens="spans", seed=4),
    "metric_dp_special": NoiseConfig(
        mechanism="metric_dp", eta=20.0, clip_norm=1.0, tokens="spans", special_token_ids=[SPECIAL_TOKEN], seed=8
    ),
}


def global_batch() -> dict[str, torch.Tensor]:
    """Token ids, loss mask over each real token, private mask over each row's spans, global positions, input."""
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(8, 256, (BATCH, SEQ), generator=generator)
    tokens[:, ::4] = SPECIAL_TOKEN
    loss_mask = torch.zeros(BATCH, SEQ)
    private_mask = torch.zeros(BATCH, SEQ, dtype=torch.bool)
    for row, (length, spans) in enumerate(zip(TRUE_LENGTHS, SPANS, strict=True)):
        loss_mask[row, :length] = 1.0
        for start, end in spans:
            private_mask[row, start:end] = True
    positions = torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1).contiguous()
    embeds = torch.randn(SEQ, BATCH, HIDDEN, generator=generator)
    weights = torch.randn(SEQ, BATCH, HIDDEN, generator=generator)
    return {
        "tokens": tokens,
        "loss_mask": loss_mask,
        "private_mask": private_mask,
        "position_ids": positions,
        "embeds": embeds,
        "weights": weights,
    }


def _noise_and_gradient(layer, clock, x, weights, inputs) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.clone().requires_grad_(True)
    noised = layer(x, inputs, clock)
    (noised * weights).sum().backward()
    return noised.detach(), x.grad


def reference(config: NoiseConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch in one process: TP = CP = DP = 1, one microbatch."""
    batch = global_batch()
    layer = EmbeddingNoise(config, sequence_parallel=False, pg_collection=None)
    inputs = NoiseBatchInputs(
        loss_mask=batch["loss_mask"], input_ids=batch["tokens"], private_mask=batch["private_mask"]
    )
    return _noise_and_gradient(layer, NoiseClock(iteration=ITERATION), batch["embeds"], batch["weights"], inputs)


@pytest.fixture(scope="module")
def references(megatron_cpu):
    return {name: reference(config) for name, config in CONFIGS.items()}


def test_only_private_span_tokens_are_noised(references):
    batch = global_batch()
    real = torch.arange(SEQ).view(-1, 1) < torch.tensor(TRUE_LENGTHS).view(1, -1)
    private = batch["private_mask"].t()
    special = batch["tokens"].t() == SPECIAL_TOKEN
    for name, (noised, _) in references.items():
        touched = (noised - batch["embeds"]).abs().amax(dim=-1) > 0
        expected = private & real & (~special if name == "metric_dp_special" else True)
        assert torch.equal(touched, expected), name
    assert int(private.sum()) == 3 + 5 + 1 + 2 + 6  # 17 span tokens, none in row 3


def test_clean_tokens_get_the_plain_gradient_and_span_tokens_the_clipped_one(references):
    batch = global_batch()
    _, gradient = references["gaussian_mechanism"]
    private = batch["private_mask"].t()
    assert torch.equal(gradient[~private], batch["weights"][~private])  # untouched: d(out)/d(x) = I
    norms = batch["embeds"].norm(dim=-1)
    clipped = private & (norms > 1.0)
    assert int(clipped.sum()) == 17  # every span token of N(0, I_32) has norm > 1: each is clipped
    assert not torch.allclose(gradient[clipped], batch["weights"][clipped])


def test_true_length_scaling_takes_the_sequence_length_not_the_span_length(references):
    """NEFTune's 1/sqrt(L d) under tokens='spans' uses the sequence's length L (here L = 12 for row 1)."""
    batch = global_batch()
    noised, _ = references["neftune_true_length"]
    noise = (noised - batch["embeds"])[6:8, 1]  # row 1's second span
    bound = 5.0 / (12 * HIDDEN) ** 0.5
    assert float(noise.abs().max()) <= bound
    assert float(noise.abs().max()) > 0.8 * bound  # U(-1, 1) over 64 draws reaches near the bound


def test_spans_without_a_private_mask_is_a_clear_error(megatron_cpu):
    batch = global_batch()
    layer = EmbeddingNoise(CONFIGS["neftune_true_length"], sequence_parallel=False, pg_collection=None)
    inputs = NoiseBatchInputs(loss_mask=batch["loss_mask"])
    with pytest.raises(ValueError, match="tokens='spans' needs the batch's private_mask"):
        layer(batch["embeds"], inputs, NoiseClock())


def test_private_mask_of_the_wrong_length_is_a_clear_error(megatron_cpu):
    batch = global_batch()
    layer = EmbeddingNoise(CONFIGS["neftune_true_length"], sequence_parallel=False, pg_collection=None)
    inputs = NoiseBatchInputs(loss_mask=batch["loss_mask"], private_mask=batch["private_mask"][:, :-2])
    with pytest.raises(ValueError, match=r"private_mask has shape \[4, 14\]: expected \[b, 16\]"):
        layer(batch["embeds"], inputs, NoiseClock())


def _spans_at_layout(rank: int, world_size: int, port: int, tp: int, cp: int, sp: bool, microbatches: int) -> dict:
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
        layers = {
            name: EmbeddingNoise(config, sequence_parallel=sp, pg_collection=groups) for name, config in CONFIGS.items()
        }
        clocks = {name: NoiseClock(iteration=ITERATION) for name in CONFIGS}
        shares = {name: [] for name in CONFIGS}
        for microbatch in range(microbatches):
            first = microbatch * micro_batch_size * dp_size + dp_rank * micro_batch_size
            samples = list(range(first, first + micro_batch_size))
            keys = ("tokens", "loss_mask", "private_mask", "position_ids")
            local = get_batch_on_this_cp_rank(
                {key: whole[key][samples].clone() for key in keys},
                is_hybrid_cp=False,
                cp_group=parallel_state.get_context_parallel_group(),
            )
            rows = local["position_ids"][0]  # global positions of this CP rank's tokens
            if sp:
                rows = tensor_parallel.scatter_to_sequence_parallel_region(rows.view(-1, 1).float()).view(-1).long()
            x = whole["embeds"][rows][:, samples]
            weights = whole["weights"][rows][:, samples]
            inputs = NoiseBatchInputs(
                loss_mask=local["loss_mask"], input_ids=local["tokens"], private_mask=local["private_mask"]
            )
            for name, layer in layers.items():
                noised, gradient = _noise_and_gradient(layer, clocks[name], x, weights, inputs)
                clocks[name].advance()
                shares[name].append({"rows": rows, "samples": samples, "noised": noised, "gradient": gradient})
        return shares
    finally:
        destroy_num_microbatches_calculator()
        destroy_cpu_parallel()


def _assemble(results: list[dict], name: str, key: str) -> tuple[torch.Tensor, torch.Tensor]:
    assembled = torch.full((SEQ, BATCH, HIDDEN), float("nan"))
    coverage = torch.zeros(SEQ, BATCH, dtype=torch.int64)
    for result in results:
        for share in result[name]:
            rows, samples = share["rows"].view(-1, 1), torch.tensor(share["samples"]).view(1, -1)
            previous = assembled[rows, samples]
            assert torch.equal(torch.where(torch.isnan(previous), share[key], previous), share[key]), "replicas differ"
            assembled[rows, samples] = share[key]
            coverage[rows, samples] += 1
    return assembled, coverage


LAYOUTS = {
    "tp2_sp": dict(world_size=2, tp=2, cp=1, sp=True, microbatches=1),
    "cp2": dict(world_size=2, tp=1, cp=2, sp=False, microbatches=1),
    "dp2_two_microbatches": dict(world_size=2, tp=1, cp=1, sp=False, microbatches=2),
    "tp2_sp_cp2": dict(world_size=4, tp=2, cp=2, sp=True, microbatches=1),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "layout",
    [pytest.param(name, marks=pytest.mark.slow) if LAYOUTS[name]["world_size"] > 2 else name for name in LAYOUTS],
)
def test_span_noise_and_gradients_are_the_same_at_every_layout(references, layout):
    spec = dict(LAYOUTS[layout])
    world_size = spec.pop("world_size")
    results = run_on_gloo_ranks(_spans_at_layout, world_size, spec["tp"], spec["cp"], spec["sp"], spec["microbatches"])
    for name, (noised, gradient) in references.items():
        for key, expected in (("noised", noised), ("gradient", gradient)):
            assembled, coverage = _assemble(results, name, key)
            assert torch.equal(coverage, torch.ones_like(coverage)), f"{name}: every element exactly once"
            assert torch.equal(assembled, expected), f"{name} {key}: differs from the single-process batch"


def test_noisy_model_noises_the_private_mask_handed_to_noise_batch_inputs(megatron_cpu):
    """The model's hand-over (``noise_batch_inputs(private_mask=...)``) reaches the layer: the embedding output of
    a model with zeroed embeddings is exactly the noise, on span tokens only, and equals the layer's own."""
    from nemo_noise_plugin.model import NoisyGPTModel
    from tests.support.models import build_tiny_gpt

    config = NoiseConfig(alpha=5.0, scaling="absolute", tokens="spans", seed=4)
    model = build_tiny_gpt(model_class=NoisyGPTModel, noise_config=config, max_sequence_length=SEQ)
    with torch.no_grad():
        model.embedding.word_embeddings.weight.zero_()
    model.noise_clock.start_iteration(ITERATION)
    batch = global_batch()
    with torch.no_grad(), model.noise_batch_inputs(batch["loss_mask"], private_mask=batch["private_mask"]):
        decoder_input = model._preprocess(input_ids=batch["tokens"], position_ids=batch["position_ids"])[0]
    touched = decoder_input.abs().amax(dim=-1) > 0
    assert torch.equal(touched, batch["private_mask"].t())
    layer = EmbeddingNoise(config, sequence_parallel=False, pg_collection=None)
    inputs = NoiseBatchInputs(loss_mask=batch["loss_mask"], private_mask=batch["private_mask"])
    expected = layer(torch.zeros_like(decoder_input), inputs, NoiseClock(iteration=ITERATION))
    assert torch.equal(decoder_input, expected)
