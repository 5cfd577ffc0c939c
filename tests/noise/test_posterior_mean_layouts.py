"""Posterior-mean denoising at every tensor-parallel layout: the single-rank decoder input and embedding gradients.

Real Megatron-Core GPT models on gloo CPU processes, without a prior and with a token prior whose support lies in the
first shard only: TP=2 (the vocabulary split in two shards, whose log-sum-exps
are combined by the all-reduced maximum and sum, with and without sequence parallelism) and DP=2 denoise one global
batch's noised tokens; their decoder inputs, put back at the positions and samples each rank holds, and their
embedding-weight gradients under a fixed linear loss (shards concatenated, DP ranks summed) must equal the
single-process model's to float32 rounding (the shards' sums are added in another order).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.noise import test_projection_layouts as layouts
from tests.noise.test_posterior_mean import DENOISED
from tests.noise.test_posterior_mean_prior import PRIOR_FILE
from tests.noise.test_projection import token_batch
from tests.support.gloo_ranks import run_on_gloo_ranks

CONFIGS = {
    "gaussian_mechanism": DENOISED,
    "laplace": dataclasses.replace(DENOISED, mechanism="laplace", laplace_scale=1.0, epsilon=None),
    # A token prior over ids 8..119: at TP=2 the second shard (ids 128..255) has prior 0 everywhere.
    "gaussian_mechanism_prior": dataclasses.replace(DENOISED, projection_prior=str(PRIOR_FILE)),
}


def _at_layout(rank: int, world_size: int, port: int, tp: int, sp: bool) -> dict:
    layouts.CONFIGS = CONFIGS  # this spawned process's copy of the projection layout test, run with these configs
    return layouts._at_layout(rank, world_size, port, tp, sp)


@pytest.fixture(scope="module")
def references(megatron_cpu):
    batch, table = token_batch(), layouts.random_table()
    return {
        name: layouts._project(
            layouts._model(config, table),
            batch["tokens"],
            batch["loss_mask"],
            batch["position_ids"],
            layouts.loss_weights(),
        )
        for name, config in CONFIGS.items()
    }


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "layout", [name if name == "tp2_sp" else pytest.param(name, marks=pytest.mark.slow) for name in layouts.LAYOUTS]
)
def test_posterior_mean_gives_the_single_rank_decoder_input_and_gradients_at_every_layout(references, layout):
    spec = dict(layouts.LAYOUTS[layout])
    ranks = run_on_gloo_ranks(_at_layout, spec.pop("world_size"), spec["tp"], spec["sp"])
    for name, expected in references.items():
        assembled = torch.full_like(expected["decoder_input"], float("nan"))
        ids = torch.full_like(expected["ids"], -2)
        grad = torch.zeros_like(expected["grad"])
        for rank in ranks:
            got = rank["results"][name]
            rows, samples = torch.tensor(rank["rows"]), torch.tensor(rank["samples"])
            assembled[rows.view(-1, 1), samples.view(1, -1)] = got["decoder_input"]
            ids[:, samples] = got["ids"]  # the MAP rows of the whole sequence, identical on every TP rank
            if spec["tp"] > 1:
                assert torch.equal(got["ids"], ranks[0]["results"][name]["ids"])
                shard = slice(got["vocab_start"], got["vocab_start"] + got["grad"].size(0))
                torch.testing.assert_close(got["grad"], expected["grad"][shard], rtol=0, atol=1e-5)
            else:
                grad += got["grad"]
        torch.testing.assert_close(assembled, expected["decoder_input"], rtol=0, atol=1e-6)
        assert torch.equal(ids, expected["ids"]), f"{name}: MAP ids differ from one rank's"
        if spec["tp"] == 1:
            torch.testing.assert_close(grad, expected["grad"], rtol=0, atol=1e-5)
        selected = expected["ids"] >= 0
        assert 0 < int(selected.sum()) < selected.numel()
        table = layouts.random_table()
        denoised = expected["decoder_input"][selected]
        assert not bool((denoised.unsqueeze(1) == table.unsqueeze(0)).all(-1).any()), f"{name}: means, not rows"
