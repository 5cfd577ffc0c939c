"""Nearest-row projection at every tensor-parallel layout: the same decoder input and embedding gradients as one rank.

Real Megatron-Core GPT models on gloo CPU processes: TP=2 (the vocabulary split in two shards, with and without
sequence parallelism) and DP=2 project one global batch's noised tokens; their decoder inputs, put back at the
positions and samples each rank holds, and their embedding-weight gradients under a fixed linear loss (shards
concatenated, DP ranks summed) must equal the single-process model's.
"""

from __future__ import annotations

import pytest
import torch

from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.noise.projection import nearest_rows
from tests.noise.test_projection import BATCH, HIDDEN, PRIVATE, SEQ, VOCAB, random_table, token_batch
from tests.support.gloo_ranks import run_on_gloo_ranks

CONFIGS = {
    "l2_clipped_response": PRIVATE,
    "cosine_all": NoiseConfig(
        mechanism="gaussian", sigma=0.5, scaling="absolute", projection="nearest_row", projection_metric="cosine"
    ),
}
ITERATION = 3


def loss_weights() -> torch.Tensor:
    """The fixed ``[S, B, h]`` weights of the linear loss ``sum(decoder_input * weights)``."""
    return torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(6))


def _project(model, tokens, loss_mask, positions, weights) -> dict:
    model.zero_grad(set_to_none=True)
    model.noise_clock.start_iteration(ITERATION)
    with model.noise_batch_inputs(loss_mask):
        decoder_input = model._preprocess(input_ids=tokens, position_ids=positions)[0]
    (decoder_input * weights).sum().backward()
    word_embeddings = model.embedding.word_embeddings
    return {
        "decoder_input": decoder_input.detach(),
        "ids": model.projected_ids,
        "grad": word_embeddings.weight.grad.clone(),
        "vocab_start": int(word_embeddings.vocab_start_index),
    }


def _model(config: NoiseConfig, table: torch.Tensor, *, sequence_parallel: bool = False, **parallel):
    """The tiny noisy GPT with ``table`` as its (sharded) embedding.

    The local layer spec's torch LayerNorm refuses sequence parallelism when the layers are built; only
    ``_preprocess`` runs here, so sequence parallelism is switched on after the build (the embedding reads it at
    each forward, the noise layer at ``init_noise``).
    """
    from nemo_noise_plugin.model import NoisyGPTModel
    from tests.support.models import build_tiny_gpt, tiny_gpt_config

    transformer_config = tiny_gpt_config(**parallel)
    model = build_tiny_gpt(transformer_config, vocab_size=VOCAB, model_class=NoisyGPTModel, noise_config=config)
    if sequence_parallel:
        transformer_config.sequence_parallel = True
        model.init_noise(config)
    word_embeddings = model.embedding.word_embeddings
    with torch.no_grad():
        word_embeddings.weight.copy_(table[word_embeddings.vocab_start_index : word_embeddings.vocab_end_index])
    return model


def _at_layout(rank: int, world_size: int, port: int, tp: int, sp: bool) -> dict:
    from megatron.core import parallel_state

    from tests.support.models import destroy_cpu_parallel, init_cpu_parallel

    init_cpu_parallel(rank=rank, world_size=world_size, port=port, tensor_model_parallel_size=tp)
    try:
        dp_size, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
        samples = list(range(dp_rank * BATCH // dp_size, (dp_rank + 1) * BATCH // dp_size))
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        rows = list(range(tp_rank * SEQ // tp, (tp_rank + 1) * SEQ // tp)) if sp else list(range(SEQ))
        batch, table = token_batch(), random_table()
        weights = loss_weights()[rows][:, samples]
        results = {
            name: _project(
                _model(config, table, tensor_model_parallel_size=tp, sequence_parallel=sp),
                batch["tokens"][samples],
                batch["loss_mask"][samples],
                batch["position_ids"][samples],
                weights,
            )
            for name, config in CONFIGS.items()
        }
        tie = None
        if tp > 1:  # rows 10 (shard 0) and 200 (shard 1) equal: both shards find the query equally near
            tied = table.clone()
            tied[200] = tied[10]
            start = tp_rank * VOCAB // tp
            shard = tied[start : start + VOCAB // tp]
            tie = nearest_rows(
                tied[10:11] + 1e-3, shard, vocab_start=start, group=parallel_state.get_tensor_model_parallel_group()
            )
        return {"rows": rows, "samples": samples, "results": results, "tie": tie}
    finally:
        destroy_cpu_parallel()


@pytest.fixture(scope="module")
def references(megatron_cpu):
    batch, table = token_batch(), random_table()
    return {
        name: _project(
            _model(config, table), batch["tokens"], batch["loss_mask"], batch["position_ids"], loss_weights()
        )
        for name, config in CONFIGS.items()
    }


LAYOUTS = {
    "tp2": dict(world_size=2, tp=2, sp=False),
    "tp2_sp": dict(world_size=2, tp=2, sp=True),
    "dp2": dict(world_size=2, tp=1, sp=False),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "layout", [name if name == "tp2_sp" else pytest.param(name, marks=pytest.mark.slow) for name in LAYOUTS]
)  # about 35 s each: TP=2 with SP (the gather, the shards, the reduce-scatter) stays in the main suite
def test_projection_gives_the_single_rank_decoder_input_and_gradients_at_every_layout(references, layout):
    spec = dict(LAYOUTS[layout])
    ranks = run_on_gloo_ranks(_at_layout, spec.pop("world_size"), spec["tp"], spec["sp"])
    for name, expected in references.items():
        assembled = torch.full_like(expected["decoder_input"], float("nan"))
        ids = torch.full_like(expected["ids"], -2)
        grad = torch.zeros_like(expected["grad"])
        for rank in ranks:
            got = rank["results"][name]
            rows, samples = torch.tensor(rank["rows"]), torch.tensor(rank["samples"])
            assembled[rows.view(-1, 1), samples.view(1, -1)] = got["decoder_input"]
            assert torch.equal(got["ids"], ranks[0]["results"][name]["ids"]) or spec["tp"] == 1
            ids[:, samples] = got["ids"]  # the whole sequence, identical on every TP rank
            if spec["tp"] > 1:
                shard = slice(got["vocab_start"], got["vocab_start"] + got["grad"].size(0))
                torch.testing.assert_close(got["grad"], expected["grad"][shard], rtol=1e-6, atol=1e-6)
            else:
                grad += got["grad"]
        assert torch.equal(assembled, expected["decoder_input"]), f"{name}: decoder input differs from one rank's"
        assert torch.equal(ids, expected["ids"]), f"{name}: projected ids differ from one rank's"
        if spec["tp"] == 1:
            torch.testing.assert_close(grad, expected["grad"], rtol=1e-6, atol=1e-6)
        assert 0.1 < float((ids == token_batch()["tokens"].t())[ids >= 0].float().mean()) < 0.95, name
    if spec["tp"] > 1:
        assert [rank["tie"].tolist() for rank in ranks] == [[10], [10]]
