"""The posterior-mean denoiser with a token prior (``NoiseConfig.projection_prior``): weights, limits, file, hooks.

The chunked log-sum-exp with a prior is checked against a brute-force float64 softmax of ``log prior + log
likelihood`` (means, MAP ids, gradients), also where whole vocabulary chunks have prior 0; a prior uniform over every
row is the uniform posterior; rows of prior 0 get no weight; on tokens drawn from the prior the prior's estimate has
the smaller squared error and the higher MAP recovery (the reason the option exists). The file format refuses bad
input naming the setting, the prior never changes the ledger's numbers, and the Megatron hook and the HF serving
helper use it. The layouts (TP=2 with a shard of prior 0, SP, DP) are in ``test_posterior_mean_layouts``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.noise.denoise import posterior_mean_noised, posterior_mean_rows
from nemo_noise_plugin.noise.token_prior import PRIOR_FORMAT, read_token_prior, write_token_prior
from nemo_noise_plugin.privacy.audit.noised import noised_embeddings
from nemo_noise_plugin.privacy.ledger import privacy_ledger
from nemo_noise_plugin.validation import SettingError
from tests.noise.test_posterior_mean import DENOISED, DENSITIES, _brute_weights, _decoder_input, _noisy_model
from tests.noise.test_projection import CLIP, HIDDEN, VOCAB, random_table, token_batch

PRIOR_FILE = Path(__file__).with_name("data") / "token_prior_256.json"
"""Ids 8..119 with counts ``1 + id % 7``: rows 120.. (and the whole second shard at TP=2) have prior 0."""
WITH_PRIOR = dataclasses.replace(DENOISED, projection_prior=str(PRIOR_FILE))


def _log_prior(weighting: str = "frequency") -> torch.Tensor:
    prior = dataclasses.replace(read_token_prior(PRIOR_FILE), weighting=weighting)
    return prior.log_prior(VOCAB)


def _brute_prior_weights(queries, table, density, scale, clip, log_prior) -> torch.Tensor:
    likelihood = _brute_weights(queries, table, density, scale, clip)  # a softmax: log of it is logits - const
    return torch.softmax(likelihood.log() + log_prior.double().unsqueeze(0), dim=1)


def _queries(count: int = 300, seed: int = 2) -> torch.Tensor:
    table = random_table()
    ids = torch.randint(0, VOCAB, (count,), generator=torch.Generator().manual_seed(seed))
    return table[ids] + 0.1 * torch.randn(count, HIDDEN, generator=torch.Generator().manual_seed(seed + 1))


@pytest.mark.parametrize("shift", [0, 128], ids=["early", "late"])  # late: the first 136 rows have prior 0
@pytest.mark.parametrize("weighting", ["frequency", "support"])
@pytest.mark.parametrize("density", list(DENSITIES))
def test_posterior_mean_with_a_prior_equals_the_float64_softmax_of_prior_and_likelihood(density, weighting, shift):
    table, queries, log_prior = random_table(), _queries(), _log_prior(weighting).roll(shift)
    weights = _brute_prior_weights(queries, table, density, DENSITIES[density], CLIP, log_prior)
    for max_elements in (None, 1000):  # 1000: chunks of 15 rows, several of them entirely of prior 0
        options = {} if max_elements is None else dict(max_elements=max_elements)
        means, ids = posterior_mean_rows(
            queries, table, density=density, scale=DENSITIES[density], clip_norm=CLIP, log_prior=log_prior, **options
        )
        torch.testing.assert_close(means.double(), weights @ table.double(), rtol=0, atol=2e-6)
        assert torch.equal(ids, weights.argmax(dim=1))
        assert bool(torch.isfinite(log_prior[ids]).all())  # the MAP row is one the prior allows


def test_rows_of_prior_zero_get_no_weight_and_no_gradient():
    table, queries, log_prior = random_table(), _queries(120), _log_prior()
    leaf = table.clone().requires_grad_()
    means, _ = posterior_mean_rows(queries, leaf, density="gaussian", scale=1.0, clip_norm=CLIP, log_prior=log_prior)
    upstream = torch.randn(120, HIDDEN, generator=torch.Generator().manual_seed(9))
    (means * upstream).sum().backward()
    weights = _brute_prior_weights(queries, table, "gaussian", 1.0, CLIP, log_prior)
    torch.testing.assert_close(leaf.grad.double(), weights.t() @ upstream.double(), rtol=0, atol=1e-5)
    outside = torch.isinf(log_prior)
    assert int(outside.sum()) == VOCAB - 112 and bool((leaf.grad[outside] == 0).all())


def test_a_prior_uniform_over_every_row_is_the_uniform_posterior():
    table, queries = random_table(), _queries()
    flat = torch.full((VOCAB,), -math.log(VOCAB))
    for density, scale in DENSITIES.items():
        plain = posterior_mean_rows(queries, table, density=density, scale=scale, clip_norm=CLIP)
        uniform = posterior_mean_rows(queries, table, density=density, scale=scale, clip_norm=CLIP, log_prior=flat)
        torch.testing.assert_close(uniform[0], plain[0], rtol=0, atol=1e-6)
        assert torch.equal(uniform[1], plain[1])


def test_on_tokens_drawn_from_the_prior_the_prior_lowers_the_error_and_raises_recovery():
    """The option's reason: a release of a task token is better explained by the task's vocabulary than the table."""
    table, prior = random_table(), read_token_prior(PRIOR_FILE)
    ids = torch.tensor(sorted(prior.counts))
    weights = torch.tensor([float(prior.counts[int(t)]) for t in ids])
    tokens = ids[torch.multinomial(weights, 8 * 64, replacement=True, generator=torch.Generator().manual_seed(4))]
    tokens = tokens.view(8, 64)
    config = dataclasses.replace(WITH_PRIOR, epsilon=40.0, tokens="all", special_token_ids=[])  # recovery ~ 1/2
    noised = noised_embeddings(table, tokens, config).transpose(0, 1)
    selected = torch.ones(tokens.t().shape, dtype=torch.bool)
    embedding = torch.nn.Embedding.from_pretrained(table)
    uniform = posterior_mean_noised(noised, selected, embedding, dataclasses.replace(config, projection_prior=None))
    informed = posterior_mean_noised(noised, selected, embedding, config)
    clean = table[tokens.t()]

    def error(projection) -> float:
        return float((projection.decoder_input - clean).pow(2).sum(-1).mean())

    def recovery(projection) -> float:
        return float((projection.ids == tokens.t()).float().mean())

    assert error(informed) < 0.8 * error(uniform), (error(informed), error(uniform))
    assert recovery(informed) > recovery(uniform) + 0.1, (recovery(informed), recovery(uniform))


def test_the_noisy_model_and_hf_serving_denoise_with_the_configs_prior(megatron_cpu):
    from nemo_noise_plugin.noise.hf_inference import noised_inputs_embeds
    from tests.noise.test_projection_hf import _llama

    table, batch = random_table(), token_batch()
    model = _noisy_model(WITH_PRIOR, table)
    denoised = _decoder_input(model, batch)
    release = _decoder_input(_noisy_model(dataclasses.replace(WITH_PRIOR, projection="none", projection_prior=None),
                                          table), batch)  # fmt: skip
    selected = model.projected_ids >= 0
    weights = _brute_prior_weights(release[selected], table, "gaussian", WITH_PRIOR.dp_sigma, CLIP, _log_prior())
    torch.testing.assert_close(denoised[selected].double(), weights @ table.double(), rtol=0, atol=2e-6)
    assert bool(torch.isfinite(_log_prior()[model.projected_ids[selected]]).all())
    assert torch.equal(denoised[~selected], release[~selected])

    served = dataclasses.replace(WITH_PRIOR, tokens="prompt", special_token_ids=[], training_only=False, seed=8)
    megatron = _noisy_model(served, table).eval()
    megatron.noise_clock.start_iteration(4)
    with torch.no_grad():
        expected = _decoder_input(megatron, batch)
        got = noised_inputs_embeds(_llama(table), batch["tokens"], served, loss_mask=batch["loss_mask"], iteration=4)
    torch.testing.assert_close(got, expected.transpose(0, 1), rtol=0, atol=1e-6)


def test_the_prior_leaves_the_ledgers_numbers_unchanged_and_is_named_as_side_information():
    preset = dict(mechanism="gaussian_mechanism", clip_norm=1.0, epsilon=8.0, projection="posterior_mean")
    plain = privacy_ledger(NoiseConfig(**preset), sequence_length=512, epochs=3, hidden_size=576)
    informed = privacy_ledger(
        NoiseConfig(**preset, projection_prior=str(PRIOR_FILE)), sequence_length=512, epochs=3, hidden_size=576
    )
    assert informed.per_token == plain.per_token and informed.per_sequence == plain.per_sequence
    added = [line for line in informed.assumptions if line not in plain.assumptions]
    assert len(added) == 1 and str(PRIOR_FILE) in added[0] and "post-processing" in added[0]


def test_write_and_read_a_prior_file_atomically(tmp_path):
    path = write_token_prior(tmp_path / "p" / "prior.json", {3: 2, 1: 5}, vocab_size=10, weighting="support")
    assert sorted(p.name for p in path.parent.iterdir()) == ["prior.json"]  # no partial file left
    prior = read_token_prior(path)
    assert (prior.vocab_size, dict(prior.counts), prior.weighting) == (10, {1: 5, 3: 2}, "support")
    log_prior = prior.log_prior(4, start=1)  # the shard of global ids 1..4
    assert torch.equal(torch.isfinite(log_prior), torch.tensor([True, False, True, False]))
    torch.testing.assert_close(log_prior[0], torch.tensor(math.log(0.5)))
    with pytest.raises(SettingError, match=r"vocab_size=10.*count >= 1"):
        write_token_prior(tmp_path / "bad.json", {12: 1}, vocab_size=10)
    assert not (tmp_path / "bad.json").exists()


@pytest.mark.parametrize(
    "document, reason",
    [
        ("not json", r"it is not JSON"),
        ({"format": "other"}, r"its 'format' is not"),
        ({"vocab_size": 0}, r"vocab_size=0 is not an integer >= 1"),
        ({"weighting": "idf"}, r"weighting='idf' is not one of frequency, support"),
        ({"counts": [[1, 2, 3]]}, r"counts must be a list of \[token_id, count\] integer pairs"),
        ({"counts": [[1, 0]]}, r"the pair \[1, 0\] needs"),
        ({"counts": [[1, 2], [1, 3]]}, r"each id once"),
        ({"counts": []}, r"it counts no token"),
    ],
    ids=["json", "format", "vocab", "weighting", "pairs", "zero", "twice", "empty"],
)
def test_a_bad_prior_file_is_refused_naming_the_setting(tmp_path, document, reason):
    good = {"format": PRIOR_FORMAT, "vocab_size": 10, "weighting": "frequency", "counts": [[1, 2]]}
    path = tmp_path / "prior.json"
    path.write_text(document if isinstance(document, str) else json.dumps({**good, **document}))
    with pytest.raises(SettingError, match=r"^NoiseConfig\.projection_prior='.*prior\.json' is invalid: .*" + reason):
        NoiseConfig(mechanism="gaussian_mechanism", clip_norm=1.0, epsilon=8.0, projection="posterior_mean",
                    projection_prior=str(path))  # fmt: skip


def test_a_prior_needs_posterior_mean_an_existing_file_noise_and_a_table_as_large(tmp_path):
    base = dict(mechanism="gaussian_mechanism", clip_norm=1.0, epsilon=8.0)
    for projection in ("none", "nearest_row"):
        with pytest.raises(SettingError, match=rf"with projection='{projection}': expected None: only projection="):
            NoiseConfig(**base, projection=projection, projection_prior=str(PRIOR_FILE))
    with pytest.raises(SettingError, match=r"projection_prior='.*missing\.json' is invalid: .*cannot be read"):
        NoiseConfig(**base, projection="posterior_mean", projection_prior=str(tmp_path / "missing.json"))
    with pytest.raises(SettingError, match=r"projection_prior=5 is invalid: expected a token-prior file or None"):
        NoiseConfig(**base, projection="posterior_mean", projection_prior=5)
    small = torch.nn.Embedding.from_pretrained(random_table()[:100])
    with pytest.raises(SettingError, match=r"at most the table's 100 rows: it is over vocab_size=256"):
        posterior_mean_noised(torch.zeros(2, 1, HIDDEN), torch.ones(2, 1, dtype=torch.bool), small, WITH_PRIOR)
    with pytest.raises(SettingError, match=r"with noise scale 0.0: expected None: without noise"):
        posterior_mean_rows(_queries(4), random_table(), density="gaussian", scale=0.0, log_prior=_log_prior())
