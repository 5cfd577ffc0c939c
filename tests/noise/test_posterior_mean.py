"""Posterior-mean denoising (``NoiseConfig.projection='posterior_mean'``): the soft lookup, its limits and its hooks.

The chunked float32 log-sum-exp is checked against a brute-force float64 softmax over the whole table for each
density, its gradient against the brute-force soft lookup's, its limits (no noise: nearest-row projection; endless
noise: the table mean) and its Bayes optimality on tokens drawn from its prior; the hooks on the real Megatron-Core
GPT model (CPU, gloo) and on a Hugging Face model must give the posterior mean of the very release the noise layer
drew, with the mechanism's own scale.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.noise.denoise import posterior_mean_noised, posterior_mean_rows, posterior_scale
from nemo_noise_plugin.noise.hf_inference import noised_inputs_embeds
from nemo_noise_plugin.noise.projection import NO_ROW, nearest_rows, project_noised
from nemo_noise_plugin.privacy.audit.noised import noised_embeddings, noised_tokens
from nemo_noise_plugin.privacy.ledger import privacy_ledger
from nemo_noise_plugin.validation import SettingError
from tests.noise.test_projection import CLIP, HIDDEN, VOCAB, random_table, token_batch

DENOISED = NoiseConfig(
    mechanism="gaussian_mechanism",
    clip_norm=CLIP,
    epsilon=40.0,
    tokens="response",
    special_token_ids=[7],
    projection="posterior_mean",
    seed=5,
)
DENSITIES = {"gaussian": 1.0, "metric_dp": 0.5, "laplace": 3.0}
"""A scale per density at which the weights spread over several rows (neither one-hot nor flat)."""


def _queries(count: int = 300, seed: int = 2) -> torch.Tensor:
    table = random_table()
    ids = torch.randint(0, VOCAB, (count,), generator=torch.Generator().manual_seed(seed))
    return table[ids] + 0.1 * torch.randn(count, HIDDEN, generator=torch.Generator().manual_seed(seed + 1))


def _brute_weights(queries: torch.Tensor, table: torch.Tensor, density: str, scale: float, clip) -> torch.Tensor:
    """``[N, V]`` float64 posterior weights straight from the densities' definitions."""
    rows, queries = table.double(), queries.double()
    if clip is not None:
        rows = rows * (clip / rows.norm(dim=1, keepdim=True)).clamp_max(1.0)
    if density == "gaussian":
        logits = -torch.cdist(queries, rows).pow(2) / (2 * scale**2)
    elif density == "metric_dp":
        logits = -torch.cdist(queries, rows) / scale
    else:
        logits = -torch.cdist(queries, rows, p=1.0) / scale
    return torch.softmax(logits, dim=1)


@pytest.mark.parametrize("clip", [None, CLIP])
@pytest.mark.parametrize("density", list(DENSITIES))
def test_chunked_posterior_mean_equals_the_float64_softmax_over_the_table(density, clip):
    table, queries = random_table(), _queries()
    weights = _brute_weights(queries, table, density, DENSITIES[density], clip)
    means, ids = posterior_mean_rows(queries, table, density=density, scale=DENSITIES[density], clip_norm=clip)
    assert float(weights.max(dim=1).values.median()) < 0.9  # the weights really are spread
    torch.testing.assert_close(means.double(), weights @ table.double(), rtol=0, atol=2e-6)
    assert torch.equal(ids, weights.argmax(dim=1))  # the MAP row


@pytest.mark.parametrize("density", list(DENSITIES))
def test_chunking_changes_nothing_but_rounding(density):
    table, queries = random_table(), _queries()
    kwargs = dict(density=density, scale=DENSITIES[density], clip_norm=CLIP)
    whole, whole_ids = posterior_mean_rows(queries, table, **kwargs)
    chunked, chunked_ids = posterior_mean_rows(queries, table, **kwargs, max_elements=1000)  # 15 rows x 66 queries
    torch.testing.assert_close(chunked, whole, rtol=0, atol=1e-6)
    assert torch.equal(chunked_ids, whole_ids)


@pytest.mark.parametrize("density", list(DENSITIES))
def test_gradient_is_the_brute_force_soft_lookups(density):
    table, queries = random_table(), _queries(120)
    upstream = torch.randn(120, HIDDEN, generator=torch.Generator().manual_seed(9))
    leaf = table.clone().requires_grad_()
    means, _ = posterior_mean_rows(
        queries, leaf, density=density, scale=DENSITIES[density], clip_norm=CLIP, max_elements=900
    )
    (means * upstream).sum().backward()
    weights = _brute_weights(queries, table, density, DENSITIES[density], CLIP)
    torch.testing.assert_close(leaf.grad.double(), weights.t() @ upstream.double(), rtol=0, atol=1e-5)


def test_small_noise_gives_nearest_row_projection_and_zero_noise_the_own_row():
    table, queries = random_table(), _queries()
    nearest = nearest_rows(queries, table, clip_norm=CLIP)
    means, ids = posterior_mean_rows(queries, table, density="gaussian", scale=1e-3, clip_norm=CLIP)
    assert torch.equal(ids, nearest)
    torch.testing.assert_close(means, table[nearest], rtol=0, atol=1e-6)
    clipped = table * (CLIP / table.norm(dim=1, keepdim=True)).clamp_max(1.0)
    for density in DENSITIES:  # y = clip(e_k) exactly: the own row, at a tiny scale and at scale 0
        for scale in (1e-4, 0.0):
            means, ids = posterior_mean_rows(clipped, table, density=density, scale=scale, clip_norm=CLIP)
            assert torch.equal(ids, torch.arange(VOCAB)), (density, scale)
            torch.testing.assert_close(means, table, rtol=0, atol=1e-6)


def test_large_noise_gives_the_table_mean_whatever_the_query():
    table, queries = random_table(), _queries(50)
    for density in DENSITIES:
        means, _ = posterior_mean_rows(queries, table, density=density, scale=1e6, max_elements=500)
        torch.testing.assert_close(means, table.mean(0).expand(50, -1), rtol=0, atol=1e-5)


def test_posterior_mean_beats_nearest_row_projection_in_squared_error_where_recovery_is_low():
    """Tokens drawn from the prior (uniform over the table): the MMSE estimate has the smaller mean squared error."""
    table = random_table()
    config = dataclasses.replace(DENOISED, epsilon=15.0, tokens="all", special_token_ids=[])
    tokens = torch.randint(0, VOCAB, (8, 64), generator=torch.Generator().manual_seed(4))
    noised = noised_embeddings(table, tokens, config).transpose(0, 1)
    selected = torch.ones(tokens.t().shape, dtype=torch.bool)
    embedding = torch.nn.Embedding.from_pretrained(table)
    hard = project_noised(noised, selected, embedding, dataclasses.replace(config, projection="nearest_row"))
    soft = posterior_mean_noised(noised, selected, embedding, config)
    clean = table[tokens.t()]
    recovery = float((hard.ids == tokens.t()).float().mean())
    hard_error = float((hard.decoder_input - clean).pow(2).sum(-1).mean())
    soft_error = float((soft.decoder_input - clean).pow(2).sum(-1).mean())
    assert recovery < 0.3
    assert soft_error < 0.8 * hard_error, (soft_error, hard_error)


def _noisy_model(config: NoiseConfig, table: torch.Tensor):
    from nemo_noise_plugin.model import NoisyGPTModel
    from tests.support.models import build_tiny_gpt

    model = build_tiny_gpt(vocab_size=VOCAB, model_class=NoisyGPTModel, noise_config=config)
    with torch.no_grad():
        model.embedding.word_embeddings.weight.copy_(table)
    model.noise_clock.start_iteration(3)
    return model


def _decoder_input(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    with model.noise_batch_inputs(batch["loss_mask"]):
        return model._preprocess(input_ids=batch["tokens"], position_ids=batch["position_ids"])[0]


def test_noisy_model_gives_the_posterior_mean_of_its_own_release_and_leaves_clean_tokens(megatron_cpu):
    table, batch = random_table(), token_batch()
    denoised = _decoder_input(_noisy_model(DENOISED, table), batch)
    release = _decoder_input(_noisy_model(dataclasses.replace(DENOISED, projection="none"), table), batch)
    selected = noised_tokens(DENOISED, batch["tokens"], loss_mask=batch["loss_mask"]).t()
    assert 0 < int(selected.sum()) < selected.numel()
    sigma = posterior_scale(DENOISED, HIDDEN)
    assert sigma == pytest.approx(DENOISED.dp_sigma)  # the mechanism's own scale is the temperature
    weights = _brute_weights(release[selected], table, "gaussian", sigma, CLIP)
    torch.testing.assert_close(denoised[selected].double(), weights @ table.double(), rtol=0, atol=2e-6)
    assert torch.equal(denoised[~selected], release[~selected])  # clean tokens exactly as they were


def test_denoised_tokens_send_each_row_its_weight_times_the_gradient(megatron_cpu):
    table, batch = random_table(), token_batch()
    model = _noisy_model(DENOISED, table)
    model.train()
    decoder_input = _decoder_input(model, batch)
    upstream = torch.randn(decoder_input.shape, generator=torch.Generator().manual_seed(6))
    (decoder_input * upstream).sum().backward()
    release = _decoder_input(_noisy_model(dataclasses.replace(DENOISED, projection="none"), table), batch)
    selected = model.projected_ids != NO_ROW
    weights = _brute_weights(release[selected], table, "gaussian", DENOISED.dp_sigma, CLIP)
    clean = batch["tokens"].t()[~selected]
    expected = weights.t() @ upstream[selected].double()
    expected.index_add_(0, clean, upstream[~selected].double())  # the clean tokens' plain lookup
    torch.testing.assert_close(model.embedding.word_embeddings.weight.grad.double(), expected, rtol=0, atol=1e-5)


def test_hf_serving_denoises_exactly_as_the_megatron_model_does(megatron_cpu):
    from nemo_noise_plugin.model import NoisyGPTModel
    from tests.noise.test_projection_hf import _llama
    from tests.support.models import build_tiny_gpt

    config = dataclasses.replace(DENOISED, tokens="prompt", special_token_ids=[], training_only=False, seed=8)
    table, batch = random_table(), token_batch()
    megatron = build_tiny_gpt(vocab_size=VOCAB, model_class=NoisyGPTModel, noise_config=config).eval()
    with torch.no_grad():
        megatron.embedding.word_embeddings.weight.copy_(table)
        megatron.noise_clock.start_iteration(4)
        with megatron.noise_batch_inputs(batch["loss_mask"]):
            expected = megatron._preprocess(input_ids=batch["tokens"], position_ids=batch["position_ids"])[0]
        got = noised_inputs_embeds(_llama(table), batch["tokens"], config, loss_mask=batch["loss_mask"], iteration=4)
    denoised = megatron.projected_ids.t() >= 0
    assert 0 < int(denoised.sum()) < denoised.numel()
    torch.testing.assert_close(got, expected.transpose(0, 1), rtol=0, atol=1e-6)
    assert torch.equal(got[~denoised], table[batch["tokens"]][~denoised])
    assert not bool((got[denoised].unsqueeze(1) == table.unsqueeze(0)).all(-1).any())  # means, not rows


@pytest.mark.parametrize(
    "fields, reason",
    [
        (dict(mechanism="uniform"), r"uniform noise \(uniform per coordinate\) has no density"),
        (dict(mechanism="quantization"), r"quantization noise .* has no density"),
        (dict(mechanism="relative"), r"each token's own RMS"),
        (dict(mechanism="gaussian", scaling="true_length"), r"scaling='true_length' sizes the noise per sequence"),
        (dict(mechanism="gaussian", scaling="absolute", warmup_steps=5), r"schedule or warm-up"),
    ],
    ids=lambda value: value.get("mechanism", "") + str(value.get("warmup_steps", ""))
    if isinstance(value, dict)
    else "",
)
def test_posterior_mean_needs_a_mechanism_with_one_fixed_density(fields, reason):
    with pytest.raises(SettingError, match=r"NoiseConfig\.projection='posterior_mean' is invalid with mechanism=.*"):
        NoiseConfig(**fields, projection="posterior_mean")
    with pytest.raises(SettingError, match=reason):
        NoiseConfig(**fields, projection="posterior_mean")
    NoiseConfig(**fields, projection="nearest_row")  # the hard projection takes any mechanism


def test_posterior_mean_takes_the_mechanisms_with_a_density_and_their_own_scale():
    assert posterior_scale(
        NoiseConfig(mechanism="metric_dp", eta=50.0, projection="posterior_mean"), 64
    ) == pytest.approx(0.02)
    laplace = NoiseConfig(mechanism="laplace", laplace_scale=0.3, projection="posterior_mean")
    assert posterior_scale(laplace, 64) == pytest.approx(0.3)
    gaussian = NoiseConfig(mechanism="gaussian", sigma=0.5, scaling="absolute", projection="posterior_mean")
    assert posterior_scale(gaussian, 64) == pytest.approx(0.5)


@pytest.mark.parametrize(
    "preset",
    [
        dict(mechanism="gaussian_mechanism", clip_norm=1.0, epsilon=8.0),
        dict(mechanism="metric_dp", eta=100.0, clip_norm=1.0),
        dict(mechanism="laplace", laplace_scale=0.5, clip_norm=1.0),
    ],
    ids=lambda preset: preset["mechanism"],
)
def test_posterior_mean_leaves_the_ledgers_numbers_unchanged_and_says_it_is_post_processing(preset):
    plain = privacy_ledger(NoiseConfig(**preset), sequence_length=512, epochs=3, hidden_size=576)
    denoised = privacy_ledger(
        NoiseConfig(**preset, projection="posterior_mean"), sequence_length=512, epochs=3, hidden_size=576
    )
    assert denoised.per_token == plain.per_token and denoised.per_token
    assert denoised.per_sequence == plain.per_sequence and denoised.per_sequence[0].epsilon is not None
    added = [line for line in denoised.assumptions if line not in plain.assumptions]
    assert len(added) == 1 and "posterior mean" in added[0] and "post-processing" in added[0]
