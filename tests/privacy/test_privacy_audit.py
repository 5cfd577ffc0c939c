"""The privacy audit: exact noised inputs, token-recovery attacks and their statistics (small random tables, CPU)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from nemo_noise_plugin.noise.config import NoiseConfig, load_noise_config
from nemo_noise_plugin.noise.families import NOISE_FAMILIES
from nemo_noise_plugin.noise.layer import EmbeddingNoise, NoiseBatchInputs
from nemo_noise_plugin.noise.schedule import NoiseClock
from nemo_noise_plugin.privacy.audit import (
    audit,
    direction_attack,
    lm_beam_attack,
    median_nearest_neighbour_distance,
    nearest_neighbour_attack,
    noised_embeddings,
    noised_tokens,
    rare_token_ids,
    recovery_report,
    wilson_interval,
)
from tests.support.gloo_ranks import run_on_gloo_ranks

VOCAB, HIDDEN = 1000, 32


def random_table(vocab: int = VOCAB, hidden: int = HIDDEN, seed: int = 0) -> torch.Tensor:
    return torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(seed))


def random_tokens(batch: int, seq: int, vocab: int = VOCAB, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def recovered(table: torch.Tensor, tokens: torch.Tensor, config: NoiseConfig, metric: str = "l2") -> torch.Tensor:
    """Per token: did L2/cosine nearest neighbour recover it from the noised input?"""
    noised = noised_embeddings(table, tokens, config)
    guess = nearest_neighbour_attack(noised.reshape(-1, table.size(1)), table, metric).ids
    return guess == tokens.reshape(-1)


# Noised inputs


def padded_batch() -> dict[str, torch.Tensor]:
    tokens = random_tokens(4, 16)
    tokens[:, ::5] = 7
    loss_mask = torch.zeros(4, 16)
    for row, (prompt, length) in enumerate(((6, 16), (3, 12), (4, 9), (2, 5))):
        loss_mask[row, prompt - 1 : length] = 1.0
    return {"tokens": tokens, "loss_mask": loss_mask}


LAYER_CONFIGS = {
    "neftune_true_length": NoiseConfig(alpha=5.0, seed=11),
    "gaussian_response_special": NoiseConfig(mechanism="gaussian", sigma=2.0, tokens="response", special_token_ids=[7]),
    "gaussian_mechanism": NoiseConfig(mechanism="gaussian_mechanism", clip_norm=1.0, epsilon=4.0),
    "metric_dp": NoiseConfig(mechanism="metric_dp", eta=20.0, clip_norm=2.0),
    "relative_warmup": NoiseConfig(mechanism="relative", relative_scale=0.3, warmup_steps=10),
    "quantization": NoiseConfig(mechanism="quantization", quantization_step=0.5),
    **{f"family_{name}": load_noise_config(family.preset, seed=3) for name, family in NOISE_FAMILIES.items()},
}


@pytest.mark.parametrize("name", list(LAYER_CONFIGS))
def test_noised_embeddings_equal_the_noise_layer_bitwise(name):
    config, batch, table = LAYER_CONFIGS[name], padded_batch(), random_table()
    layer = EmbeddingNoise(config, sequence_parallel=False, pg_collection=None)
    clean = table[batch["tokens"]].transpose(0, 1).contiguous()
    inputs = NoiseBatchInputs(loss_mask=batch["loss_mask"], input_ids=batch["tokens"])
    expected = layer(clean, inputs, NoiseClock(iteration=3)).transpose(0, 1)
    noised = noised_embeddings(table, batch["tokens"], config, iteration=3, loss_mask=batch["loss_mask"])
    assert noised.shape == (4, 16, HIDDEN) and noised.dtype == torch.float32
    assert torch.equal(noised, expected)
    assert not torch.equal(noised, clean.transpose(0, 1)), "the configuration must actually add noise"


def test_noised_embeddings_depend_on_the_iteration():
    table, tokens = random_table(), random_tokens(2, 8)
    config = NoiseConfig(mechanism="gaussian", scaling="absolute")
    assert not torch.equal(
        noised_embeddings(table, tokens, config), noised_embeddings(table, tokens, config, iteration=1)
    )


# Nearest neighbour


@pytest.mark.parametrize("metric", ["l2", "cosine"])
@pytest.mark.parametrize(
    "config", [NoiseConfig(alpha=0.0), NoiseConfig(enabled=False, mechanism="gaussian", scaling="absolute")]
)
def test_zero_noise_gives_full_recovery(metric, config):
    table, tokens = random_table(), random_tokens(8, 64)
    assert torch.equal(noised_embeddings(table, tokens, config), table[tokens])
    assert bool(recovered(table, tokens, config, metric).all())


def test_huge_noise_gives_chance_level_recovery():
    table, tokens = random_table(), random_tokens(16, 256)
    correct = recovered(table, tokens, NoiseConfig(mechanism="gaussian", sigma=1e4, scaling="absolute"))
    expected = correct.numel() / VOCAB
    assert abs(int(correct.sum()) - expected) <= 4.0 * math.sqrt(expected), int(correct.sum())


def test_recovery_is_monotone_in_gaussian_sigma():
    table, tokens = random_table(), random_tokens(8, 128)
    sigmas = (0.05, 0.8, 1.0, 1.2, 1.6, 2.4, 4.0)
    correct = [recovered(table, tokens, NoiseConfig(mechanism="gaussian", sigma=s, scaling="absolute")) for s in sigmas]
    rates = [float(c.float().mean()) for c in correct]
    assert rates[0] == 1.0 and rates[-1] < 0.1, rates
    for louder, quieter in zip(correct[1:], correct[:-1], strict=True):
        # Same Philox draw, larger scale: a token found at sigma is found at every smaller sigma.
        assert not bool((louder & ~quieter).any()), rates
    assert all(a > b for a, b in zip(rates[1:-1], rates[2:], strict=True)), rates


def brute_force_top_k(queries: torch.Tensor, table: torch.Tensor, metric: str, k: int) -> torch.Tensor:
    if metric == "l2":
        scores = -(queries.unsqueeze(1) - table.unsqueeze(0)).pow(2).sum(-1)
    else:
        scores = torch.nn.functional.cosine_similarity(queries.unsqueeze(1), table.unsqueeze(0), dim=-1)
    return scores.topk(k, dim=1).indices


@pytest.mark.parametrize("metric", ["l2", "cosine"])
@pytest.mark.parametrize("vocab_chunk,query_chunk", [(37, 29), (64, 400), (333, 1000), (VOCAB, 1)])
def test_chunked_nearest_neighbour_equals_brute_force(metric, vocab_chunk, query_chunk):
    table, tokens = random_table(), random_tokens(4, 100)
    config = NoiseConfig(mechanism="gaussian", sigma=0.8, scaling="absolute")
    queries = noised_embeddings(table, tokens, config).reshape(-1, HIDDEN)
    result = nearest_neighbour_attack(queries, table, metric, top_k=3, vocab_chunk=vocab_chunk, query_chunk=query_chunk)
    expected = brute_force_top_k(queries, table, metric, 3)
    assert torch.equal(result.candidates, expected)
    assert torch.equal(result.ids, expected[:, 0])
    assert bool((result.ids != tokens.reshape(-1)).any()), "the noise must make some guesses wrong"


def test_median_nearest_neighbour_distance_excludes_self():
    table = random_table(vocab=300)
    distances = torch.cdist(table.double(), table.double()).fill_diagonal_(math.inf).min(dim=1).values
    measured = median_nearest_neighbour_distance(table, vocab_chunk=64, query_chunk=50)
    assert measured == pytest.approx(float(distances.median()), rel=1e-5)


# Clipped mechanisms


def test_direction_attack_beats_l2_when_rows_are_far_beyond_the_clip_norm():
    generator = torch.Generator().manual_seed(2)
    directions = torch.nn.functional.normalize(torch.randn(VOCAB, HIDDEN, generator=generator), dim=-1)
    norms = torch.exp(torch.empty(VOCAB, 1).uniform_(0.0, math.log(100.0), generator=generator))
    table, tokens = directions * norms, random_tokens(8, 64)
    config = NoiseConfig(mechanism="gaussian_mechanism", clip_norm=1.0, epsilon=200.0)
    noised = noised_embeddings(table, tokens, config).reshape(-1, HIDDEN)
    truth = tokens.reshape(-1)
    plain = float((nearest_neighbour_attack(noised, table, "l2").ids == truth).float().mean())
    clipped = float((direction_attack(noised, table, 1.0).ids == truth).float().mean())
    cosine = float((direction_attack(noised, table, 1.0, metric="cosine").ids == truth).float().mean())
    assert plain < 0.25 and clipped > 0.95 and cosine > 0.95, (plain, clipped, cosine)


# Vocabulary-parallel tables


def _shard_tables() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(table, queries): a random table, and a small-integer one whose second half repeats the first (exact ties)."""
    table, tokens = random_table(vocab=600), random_tokens(4, 50, vocab=600)
    noised = noised_embeddings(table, tokens, NoiseConfig(mechanism="gaussian", sigma=0.8, scaling="absolute"))
    generator = torch.Generator().manual_seed(3)
    half = torch.randint(-2, 3, (300, 8), generator=generator).float()
    integer_queries = torch.randint(-2, 3, (200, 8), generator=generator).float()
    return {"random": (table, noised.reshape(-1, HIDDEN)), "ties": (torch.cat([half, half]), integer_queries)}


def _search_all(table: torch.Tensor, queries: torch.Tensor, **kwargs) -> dict[str, tuple]:
    return {
        metric: tuple(nearest_neighbour_attack(queries, table, metric, top_k=3, vocab_chunk=64, **kwargs))
        for metric in ("l2", "cosine")
    }


def _vocab_parallel_worker(rank: int, world_size: int, port: int) -> dict:
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        results = {}
        for name, (table, queries) in _shard_tables().items():
            rows = table.size(0) // world_size
            shard = table[rank * rows : (rank + 1) * rows]
            results[name] = _search_all(shard, queries, vocab_start=rank * rows, group=dist.group.WORLD)
        return results
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
def test_vocab_parallel_nearest_neighbour_equals_single_rank():
    ranks = run_on_gloo_ranks(_vocab_parallel_worker, 2)
    for name, (table, queries) in _shard_tables().items():
        for metric, (ids, candidates, scores) in _search_all(table, queries).items():
            for rank in ranks:
                rank_ids, rank_candidates, rank_scores = rank[name][metric]
                assert torch.equal(rank_ids, ids) and torch.equal(rank_candidates, candidates), (name, metric)
                torch.testing.assert_close(rank_scores, scores, rtol=1e-6, atol=1e-5)
    table, queries = _shard_tables()["ties"]
    _, candidates, _ = _search_all(table, queries)["l2"]
    exact = -torch.cdist(queries.double(), table.double()).square().round()  # small integers: exact scores
    for row, best in zip(exact.tolist(), candidates.tolist(), strict=True):
        # Every row has an exactly tied twin 300 ids later; equal scores must go to the lowest id.
        assert best == sorted(range(table.size(0)), key=lambda token: (-row[token], token))[:3]


# Language-model prior


def test_lm_prior_beam_beats_nearest_neighbour_on_near_duplicate_pairs():
    pairs, seq = 200, 12
    generator = torch.Generator().manual_seed(4)
    base = torch.randn(pairs, HIDDEN, generator=generator)
    # Tokens 2i and 2i+1 are almost the same vector: the noise alone cannot tell them apart.
    table = torch.stack([base, base + 1e-3 * torch.randn(pairs, HIDDEN, generator=generator)], 1).reshape(-1, HIDDEN)
    vocab = table.size(0)
    successor = torch.randperm(vocab, generator=generator)
    tokens = [torch.randint(0, vocab, (16,), generator=generator)]
    for _ in range(seq - 1):
        tokens.append(successor[tokens[-1]])
    tokens = torch.stack(tokens, dim=1)

    def bigram(prefix: torch.Tensor) -> torch.Tensor:
        log_probs = torch.full((prefix.size(0), vocab), math.log(1e-6 / vocab))
        log_probs[torch.arange(prefix.size(0)), successor[prefix[:, -1]]] = math.log(1.0 - 1e-6)
        return log_probs

    config = NoiseConfig(mechanism="gaussian", sigma=0.05, scaling="absolute")
    noised = noised_embeddings(table, tokens, config)
    nn_rate = float(
        (nearest_neighbour_attack(noised.reshape(-1, HIDDEN), table).ids == tokens.reshape(-1)).float().mean()
    )
    beam = lm_beam_attack(noised, table, config, bigram, candidates=4, beam_width=4, sequence_chunk=5, vocab_chunk=97)
    beam_rate = float((beam == tokens).float().mean())
    assert nn_rate < 0.7 and beam_rate > 0.95, (nn_rate, beam_rate)


# Statistics


@pytest.mark.parametrize(
    "successes,trials,expected",
    [(8, 10, (0.4902, 0.9433)), (0, 10, (0.0, 0.2775)), (10, 10, (0.7225, 1.0)), (0, 0, (0.0, 1.0))],
)
def test_wilson_interval_known_values(successes, trials, expected):
    assert wilson_interval(successes, trials, 0.95) == pytest.approx(expected, abs=1e-4)


def test_wilson_interval_widens_with_confidence():
    narrow, wide = wilson_interval(30, 100, 0.8), wilson_interval(30, 100, 0.99)
    assert wide[0] < narrow[0] < 0.3 < narrow[1] < wide[1]


def test_recovery_report_splits_rare_and_special_tokens():
    true = torch.tensor([1, 1, 2, 3, 3, 3, 9, 9, 5, 0])
    predicted = torch.tensor([1, 0, 2, 3, 4, 3, 9, 0, 5, 0])
    report = recovery_report(true, predicted, rare_ids=[2, 5, 9], special_ids=[0, 9])
    assert (report["overall"]["recovered"], report["overall"]["total"]) == (7, 10)
    assert (report["rare"]["recovered"], report["rare"]["total"]) == (3, 4)
    assert (report["special"]["recovered"], report["special"]["total"]) == (2, 3)
    assert (report["non_special"]["recovered"], report["non_special"]["total"]) == (5, 7)
    assert report["rare"]["rate"] == 0.75
    assert (report["rare"]["ci_low"], report["rare"]["ci_high"]) == pytest.approx(wilson_interval(3, 4))
    assert recovery_report(true, predicted)["rare"] is None


def test_rare_token_ids_are_the_least_frequent_distinct_tokens():
    tokens = torch.tensor([[4, 4, 4, 4, 8, 8, 8, 1, 1, 6], [4, 8, 4, 1, 2, 4, 8, 8, 3, 4]])
    # Counts: 4 -> 8, 8 -> 6, 1 -> 3, 6 / 2 / 3 -> 1 each; the 0.5 quantile of (1, 1, 1, 3, 6, 8) is 2.
    assert rare_token_ids(tokens, quantile=0.5) == [2, 3, 6]
    assert rare_token_ids(tokens, quantile=1.0) == [1, 2, 3, 4, 6, 8]


# The audit


def test_audit_counts_only_the_noised_tokens_when_asked_and_reports_distinct_ids():
    table, tokens = random_table(), random_tokens(8, 32)
    padding = torch.zeros(8, 32, dtype=torch.bool)
    padding[:, 24:] = True
    special = int(tokens[0, 0])
    config = NoiseConfig(mechanism="gaussian", sigma=1e-3, scaling="absolute", special_token_ids=[special])
    everything = audit(table, tokens, config, attacks=("nn_l2",), padding_mask=padding)
    noised = audit(table, tokens, config, attacks=("nn_l2",), padding_mask=padding, noised_only=True)
    real = tokens[:, :24]
    assert everything["tokens"]["real"] == 8 * 24
    assert noised["tokens"]["real"] == 8 * 24 - int((real == special).sum())  # the special id never gets noise
    assert everything["tokens"]["distinct_ids"] == len(real.unique())
    assert noised["tokens"]["distinct_ids"] == len(real.unique()) - 1
    assert noised["attacks"]["nn_l2"]["special"]["total"] == 0
    assert not noised_tokens(NoiseConfig(enabled=False), tokens, padding_mask=padding).any()


def test_audit_reports_observed_noise_and_attacks_as_json():
    table, tokens = random_table(), random_tokens(8, 32)
    padding = torch.zeros(8, 32, dtype=torch.bool)
    padding[:, 24:] = True
    config = NoiseConfig(mechanism="gaussian", sigma=0.5, scaling="absolute", special_token_ids=[int(tokens[0, 0])])
    report = audit(table, tokens, config, attacks=("nn_l2", "nn_cosine"), padding_mask=padding)
    json.dumps(report)
    assert report["tokens"]["real"] == 8 * 24
    specials = int((tokens[:, :24] == tokens[0, 0]).sum())
    assert report["noise_norm"]["noised_tokens"] == 8 * 24 - specials
    # |z| of N(0, 0.25 I_32) has median ~ 0.5 * sqrt(32 - 2/3).
    assert report["noise_norm"]["median"] == pytest.approx(0.5 * math.sqrt(32 - 2 / 3), rel=0.05)
    assert report["median_nearest_neighbour_distance"] == pytest.approx(median_nearest_neighbour_distance(table))
    for name in ("nn_l2", "nn_cosine"):
        attack = report["attacks"][name]
        assert attack["overall"]["total"] == 8 * 24
        assert attack["special"]["rate"] == 1.0, "special tokens are not noised"
    expected = recovered(table, tokens, config)[~padding.reshape(-1)]
    assert report["attacks"]["nn_l2"]["overall"]["recovered"] == int(expected.sum())


def test_audit_beam_with_a_flat_prior_is_the_clipped_maximum_likelihood_guess():
    table, tokens = 3.0 * random_table(), random_tokens(8, 16)
    config = NoiseConfig(mechanism="gaussian_mechanism", clip_norm=2.0, epsilon=60.0)

    def flat(prefix: torch.Tensor) -> torch.Tensor:
        return torch.full((prefix.size(0), VOCAB), -math.log(VOCAB))

    report = audit(table, tokens, config, attacks=("nn_l2", "direction", "lm_beam"), lm_log_probs=flat)
    attacks = report["attacks"]
    assert attacks["lm_beam"] == attacks["direction"]
    assert 0.3 < attacks["direction"]["overall"]["rate"] < 0.95, attacks["direction"]["overall"]
    assert attacks["nn_l2"]["overall"]["rate"] < attacks["direction"]["overall"]["rate"] - 0.2


def test_laplace_beam_with_a_flat_prior_is_the_l1_maximum_likelihood_guess_on_the_clipped_table():
    table, tokens = 3.0 * random_table(), random_tokens(8, 16)
    config = NoiseConfig(mechanism="laplace", laplace_scale=0.5, clip_norm=2.0)

    def flat(prefix: torch.Tensor) -> torch.Tensor:
        return torch.full((prefix.size(0), VOCAB), -math.log(VOCAB))

    noised = noised_embeddings(table, tokens, config).reshape(-1, HIDDEN)
    clipped = table * (2.0 / table.norm(dim=-1, keepdim=True)).clamp_max(1.0)
    brute_force = torch.cdist(noised, clipped, p=1.0).argmin(dim=1)  # argmax of exp(-|y - clip(e)|_1 / b)
    beam = lm_beam_attack(noised.view(8, 16, HIDDEN), table, config, flat, candidates=4).reshape(-1)
    assert torch.equal(beam, brute_force)
    rate = (beam == tokens.reshape(-1)).float().mean().item()
    direction = audit(table, tokens, config, attacks=("direction",))["attacks"]["direction"]["overall"]["rate"]
    assert 0.3 < rate < 0.95, rate
    assert rate > direction + 0.1  # on Laplace noise the L1 likelihood beats L2 against the same clipped table


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda t: nearest_neighbour_attack(t, t, vocab_chunk=0), "vocab_chunk=0"),
        (lambda t: nearest_neighbour_attack(t, t, "manhattan"), "metric='manhattan'"),
        (lambda t: nearest_neighbour_attack(t[:, :4], t), r"noised has shape \[1000, 4\]"),
        (lambda t: nearest_neighbour_attack(t, t, top_k=1001), "top_k=1001"),
        (lambda t: wilson_interval(3, 2), "successes=3"),
        (lambda t: audit(t, random_tokens(2, 4), NoiseConfig(), attacks=("direction",)), "clip_norm=None"),
        (lambda t: audit(t, random_tokens(2, 4), NoiseConfig(), attacks=("lm_beam",)), "lm_log_probs=None"),
    ],
)
def test_invalid_arguments_are_named_in_the_error(call, message):
    with pytest.raises(ValueError, match=message):
        call(random_table())
