"""The beam attack's noise model is the drawn noise's, for every mechanism and every scaling it takes.

The LM-prior beam attack scores candidates with a noise likelihood (``beam.noise_likelihood``). Here the noise is
drawn by the plugin's own layer (``noised_embeddings``) for every family of the registry at every scaling it
accepts, with sequences of different true lengths and a schedule factor below 1 where the family allows one, and
the spread that likelihood assumes for each sequence is compared with the spread of the drawn noise: a wrong
NEFTune length factor, Gaussian-mechanism sigma, metric-DP eta or ``embedding_distance`` size fails here.

Both sides read one row of ``NOISE_FAMILIES`` (``token_scale``), so a mis-scaling in that shared row moves the drawn
noise and the assumed noise together. The last two tests therefore pin each side to the mechanism's documented
math, written out here from the config's own fields (NEFTune's ``alpha / sqrt(L d)``, Balle & Wang's sigma solved
with SciPy, ``E|z| = d / eta``, Laplace's ``E|z_i| = b``), never read from the registry.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from scipy import optimize, stats

from nemo_noise_plugin.noise.config import SCALINGS, load_noise_config
from nemo_noise_plugin.noise.families import NOISE_FAMILIES
from nemo_noise_plugin.noise.schedule import schedule_factor
from nemo_noise_plugin.privacy.audit.beam import noise_likelihood
from nemo_noise_plugin.privacy.audit.noised import noised_embeddings
from nemo_noise_plugin.privacy.audit.search import search

VOCAB, SEQ, HIDDEN = 300, 96, 128
LENGTHS = (96, 80, 64, 48)
"""True lengths of the four audited sequences (the rest is padding): NEFTune's factor differs per sequence."""
EMBEDDING_DISTANCE = 0.8
TOLERANCE = 0.08
"""Relative; the spread of 48 x 128 draws is known to ~2 % (4 standard errors for Laplace), a wrong constant
(sqrt(2), sqrt(3), a length ratio, the 30-fold embedding_distance error) is far outside."""


CLIP_NORM = 1.0
CLIP_CHOICES = {"never": (None,), "optional": (CLIP_NORM, None), "required": (CLIP_NORM,)}
"""The ``clip_norm`` values each family's ``clip`` allows: clipping families run clipped, optional ones both ways."""


def _cases() -> list[tuple[str, str, float | None]]:
    cases = []
    for name, family in NOISE_FAMILIES.items():
        scalings = SCALINGS if family.length_scaled else (load_noise_config(family.preset).scaling,)
        cases += [(name, scaling, clip) for scaling in scalings for clip in CLIP_CHOICES[family.clip]]
    return cases


CASES = _cases()
IDS = [
    f"{name}-{scaling}" + ("" if NOISE_FAMILIES[name].clip == "never" else f"-clip{clip}" if clip else "-unclipped")
    for name, scaling, clip in CASES
]


def _config(name: str, scaling: str, clip_norm: float | None):
    """The family's preset at ``scaling`` and ``clip_norm``, with ``distance_multiple`` unlike the magnitude and, for
    the families that allow one, a warm-up that puts the schedule factor at 0.5 on iteration 1."""
    family = NOISE_FAMILIES[name]
    config = load_noise_config(family.preset, seed=5)
    settings = {"scaling": scaling, "distance_multiple": 1.7}
    if family.clip != "never":
        settings["clip_norm"] = clip_norm
    if scaling == "embedding_distance":
        settings["embedding_distance"] = EMBEDDING_DISTANCE
    if not family.privacy_mechanism:
        settings["warmup_steps"] = 4
    return dataclasses.replace(config, **settings)


def _batch():
    generator = torch.Generator().manual_seed(0)
    table = torch.randn(VOCAB, HIDDEN, generator=generator) * (2.0 / math.sqrt(HIDDEN))  # row norms ~2 > clip 1
    token_ids = torch.randint(0, VOCAB, (len(LENGTHS), SEQ), generator=generator)
    padding_mask = torch.arange(SEQ).view(1, -1) >= torch.tensor(LENGTHS).view(-1, 1)
    return table, token_ids, padding_mask


def _drawn_and_assumed(name: str, scaling: str, clip_norm: float | None):
    """Per sequence: the drawn noise ``[L, h]`` (normalised by the token's RMS for relative noise), and the
    likelihood's kind, per-token scale ``[L]`` and clip."""
    config = _config(name, scaling, clip_norm)
    iteration = 1
    table, token_ids, padding_mask = _batch()
    noised = noised_embeddings(table, token_ids, config, iteration=iteration, padding_mask=padding_mask)
    scoring = noise_likelihood(config, noised, iteration, padding_mask=padding_mask)
    clean = table[token_ids]
    if scoring.clip_norm is not None:
        clean = clean * (scoring.clip_norm / clean.norm(dim=-1, keepdim=True)).clamp_max(1.0)
    noise = noised - clean
    if scoring.relative:
        noise = noise / table[token_ids].pow(2).mean(dim=-1, keepdim=True).sqrt()
    scale = scoring.scale.view(len(LENGTHS), SEQ)
    per_sequence = [(noise[row, :length].double(), scale[row, :length].double()) for row, length in enumerate(LENGTHS)]
    return config, scoring, per_sequence


def _assumed_coordinate_std(kind: str, scale: torch.Tensor) -> torch.Tensor:
    """The per-coordinate standard deviation of the density the likelihood scores with, from that density's math."""
    if kind == "gaussian":  # exp(-|z|^2 / (2 s^2)), relative or not
        return scale
    if kind == "laplace":  # exp(-|z|_1 / b): variance 2 b^2
        return scale * math.sqrt(2.0)
    if kind == "metric_dp":  # exp(-|z| / s), s = 1/eta: |z| ~ Gamma(d, s), E|z|^2 = d (d + 1) s^2
        return math.sqrt(HIDDEN + 1) * scale
    raise AssertionError(f"unexpected scoring kind {kind!r}")


@pytest.mark.parametrize(("name", "scaling", "clip_norm"), CASES, ids=IDS)
def test_the_beam_likelihood_assumes_the_spread_of_the_drawn_noise(name, scaling, clip_norm):
    config, scoring, per_sequence = _drawn_and_assumed(name, scaling, clip_norm)
    assert config.is_active_configuration and (config.warmup_steps == 0 or schedule_factor(config, 1) == 0.5)
    for row, (noise, scale) in enumerate(per_sequence):
        assumed = _assumed_coordinate_std(scoring.kind, scale)
        assert assumed.max() / assumed.min() < 1 + 1e-6, "one scale per sequence: every token has the same noise"
        drawn = noise.pow(2).mean().sqrt().item()
        assert drawn == pytest.approx(assumed.mean().item(), rel=TOLERANCE), (
            f"{name}/{scaling}, sequence {row} (length {LENGTHS[row]}): the beam assumes a per-coordinate spread of "
            f"{assumed.mean().item():.4g}, the drawn noise has {drawn:.4g}"
        )


@pytest.mark.parametrize(("name", "scaling", "clip_norm"), CASES, ids=IDS)
def test_the_beam_likelihood_has_the_shape_of_the_drawn_noise(name, scaling, clip_norm):
    """Gaussian and Laplace likelihoods on Gaussian and Laplace noise, the d_chi density's radius on metric-DP noise;
    uniform noise is scored by a Gaussian of its variance (a documented smooth stand-in): the drawn noise is the
    box of that variance."""
    config, scoring, per_sequence = _drawn_and_assumed(name, scaling, clip_norm)
    unit = NOISE_FAMILIES[name].unit
    noise = torch.cat([noise for noise, _ in per_sequence])
    scale = torch.cat([scale for _, scale in per_sequence])
    normalised = (noise / scale.unsqueeze(-1)).flatten().numpy()
    if unit == "uniform":  # U(-sqrt(3) s, sqrt(3) s) for the Gaussian's s
        assert scoring.kind == "gaussian"
        assert stats.kstest(normalised, stats.uniform(loc=-math.sqrt(3), scale=2 * math.sqrt(3)).cdf).pvalue > 1e-3
    elif unit == "gaussian":
        assert scoring.kind == "gaussian"
        assert stats.kstest(normalised, stats.norm().cdf).pvalue > 1e-3
    elif unit == "laplace":
        assert scoring.kind == "laplace"
        assert stats.kstest(normalised, stats.laplace().cdf).pvalue > 1e-3
    else:
        assert unit == "metric_dp" and scoring.kind == "metric_dp"
        # the metric_dp scoring's scale is s = 1/eta; the radius of exp(-|z| / s) is Gamma(d, s)
        assert (noise.norm(dim=-1) / scale).mean().item() == pytest.approx(HIDDEN, rel=0.01)


# The documented noise of each mechanism, written out from the config's fields (not from NOISE_FAMILIES)

PER_ROW_TOLERANCE = 0.05
"""Relative, per sequence (>= 48 x 128 draws): at least 3.8 standard errors (Laplace's mean |z_i|: 1.3 %), while a
10 % mis-scaling, a dropped length factor (up to sqrt(96 / 48) = 1.41) or the padded length for the true one
(sqrt(96 / 48) on the shortest sequence) is far outside."""
POOLED_TOLERANCE = 0.025
"""Relative, over the 288 x 128 draws of all four sequences: >= 4.8 standard errors (Laplace: 0.52 %)."""
DOCUMENTED_KIND = {
    "uniform": "gaussian",  # the smooth stand-in with the box's variance (lm_beam_attack's docstring)
    "gaussian": "gaussian",
    "metric_dp": "metric_dp",
    "gaussian_mechanism": "gaussian",
    "quantization": "gaussian",
    "relative": "gaussian",  # with the scale times each row's RMS (Scoring.relative)
    "laplace": "laplace",
}
"""The density the beam scores each mechanism with; a family added to the registry fails here until it is added."""


def _balle_wang_sigma(epsilon: float, delta: float, sensitivity: float) -> float:
    """The analytic Gaussian mechanism's sigma (Balle & Wang 2018, Theorem 8), solved by SciPy's root finder:
    ``Phi(D / 2s - e s / D) - exp(e) Phi(-D / 2s - e s / D) = delta``."""

    def excess_delta(sigma: float) -> float:
        a, b = sensitivity / (2.0 * sigma), epsilon * sigma / sensitivity
        return stats.norm.cdf(a - b) - math.exp(epsilon) * stats.norm.cdf(-a - b) - delta

    return optimize.brentq(excess_delta, 1e-3 * sensitivity, 1e3 * sensitivity, xtol=1e-15, rtol=1e-13)


def _documented_scale(config, length: int) -> float:
    """The documented noise parameter of a sequence of true ``length``: the per-coordinate standard deviation
    (uniform, gaussian, quantization, gaussian_mechanism; relative: in units of the token's RMS), Laplace's ``b`` or
    metric-DP's rate ``eta``; times the warm-up factor ``(i + 1) / W`` at iteration 1 where there is a warm-up."""
    factor = 2.0 / config.warmup_steps if config.warmup_steps else 1.0
    mechanism, scaling = config.mechanism, config.scaling
    if mechanism in ("uniform", "gaussian"):
        if scaling == "embedding_distance":  # the noise's RMS norm is distance_multiple * D
            return factor * config.distance_multiple * config.embedding_distance / math.sqrt(HIDDEN)
        unit_std, magnitude = (1.0 / math.sqrt(3.0), config.alpha) if mechanism == "uniform" else (1.0, config.sigma)
        neftune = {"true_length": 1.0 / math.sqrt(length * HIDDEN), "padded_length": 1.0 / math.sqrt(SEQ * HIDDEN)}
        return factor * magnitude * neftune.get(scaling, 1.0) * unit_std  # absolute: 1
    if mechanism == "quantization":  # U(-D/2, D/2): std D / (2 sqrt 3)
        return factor * config.quantization_step / (2.0 * math.sqrt(3.0))
    if mechanism == "relative":
        return factor * config.relative_scale
    if mechanism == "laplace":
        return config.laplace_scale
    if mechanism == "metric_dp":
        return config.eta
    if mechanism == "gaussian_mechanism":
        return _balle_wang_sigma(config.epsilon, config.delta, 2.0 * config.clip_norm)
    raise AssertionError(f"no documented scale for mechanism {mechanism!r}: add it here")


def _documented_noise(name: str, scaling: str, clip_norm: float | None):
    """The config, the batch, the noised embeddings, and the drawn noise ``y - clip(x)`` ``[b, s, h]`` float64 with
    the documented clip (``min(1, C / |x|)``; for relative noise divided by the token's RMS)."""
    config = _config(name, scaling, clip_norm)
    table, token_ids, padding_mask = _batch()
    noised = noised_embeddings(table, token_ids, config, iteration=1, padding_mask=padding_mask)
    clean = table[token_ids].double()
    if config.mechanism in ("metric_dp", "gaussian_mechanism", "laplace") and config.clip_norm is not None:
        clean = clean * (config.clip_norm / clean.norm(dim=-1, keepdim=True)).clamp_max(1.0)
    noise = noised.double() - clean
    if config.mechanism == "relative":
        noise = noise / clean.pow(2).mean(dim=-1, keepdim=True).sqrt()
    return config, (table, token_ids, padding_mask), noised, noise


def _estimate(mechanism: str, noise: torch.Tensor) -> float:
    """The documented parameter as estimated from noise ``[n, h]``: ``d / mean |z|`` (metric-DP's eta, from
    ``|z| ~ Gamma(d, 1/eta)``), ``mean |z_i|`` (Laplace's b) or the per-coordinate RMS (a standard deviation)."""
    if mechanism == "metric_dp":
        return HIDDEN / noise.norm(dim=-1).mean().item()
    if mechanism == "laplace":
        return noise.abs().mean().item()
    return noise.pow(2).mean().sqrt().item()


@pytest.mark.parametrize(("name", "scaling", "clip_norm"), CASES, ids=IDS)
def test_the_drawn_noise_has_the_documented_scale(name, scaling, clip_norm):
    """NEFTune's 1/sqrt(L d) with each sequence's own L, Balle & Wang's sigma at sensitivity 2C, metric-DP's eta,
    Laplace's b: the plugin's noise layer draws them, on embeddings clipped to C where the config clips."""
    config, _, _, noise = _documented_noise(name, scaling, clip_norm)
    documented = [_documented_scale(config, length) for length in LENGTHS]
    for row, length in enumerate(LENGTHS):
        estimate = _estimate(config.mechanism, noise[row, :length])
        assert estimate == pytest.approx(documented[row], rel=PER_ROW_TOLERANCE), (
            f"{name}/{scaling}, sequence {row} (length {length}): the documented noise parameter is "
            f"{documented[row]:.5g}, the drawn noise has {estimate:.5g}"
        )
    rescale = (lambda z, s: z * s) if config.mechanism == "metric_dp" else (lambda z, s: z / s)
    pooled = torch.cat([rescale(noise[row, :length], documented[row]) for row, length in enumerate(LENGTHS)])
    assert _estimate(config.mechanism, pooled) == pytest.approx(1.0, rel=POOLED_TOLERANCE), (
        f"{name}/{scaling}: over all sequences the drawn noise is {_estimate(config.mechanism, pooled):.4f} times "
        "the documented parameter"
    )


@pytest.mark.parametrize(("name", "scaling", "clip_norm"), CASES, ids=IDS)
def test_the_beam_scores_the_true_token_with_the_documented_density(name, scaling, clip_norm):
    """The search's score of each real token's own row under ``noise_likelihood`` is the documented log-density
    of its drawn noise (constants dropped): ``-|z|^2 / 2s^2``, ``-|z|_1 / b``, ``-eta |z|``, and for relative noise
    ``-|z|^2 / 2 (s rms)^2 - d log rms``, with the documented s, b or eta of the token's sequence."""
    config, (table, token_ids, padding_mask), noised, noise = _documented_noise(name, scaling, clip_norm)
    scoring = noise_likelihood(config, noised, 1, padding_mask=padding_mask)
    assert scoring.kind == DOCUMENTED_KIND[name] and scoring.relative == (name == "relative")
    assert scoring.clip_norm == (config.clip_norm if name in ("metric_dp", "gaussian_mechanism", "laplace") else None)
    real = ~padding_mask.reshape(-1)
    queries, ids = noised.reshape(-1, HIDDEN)[real], token_ids.reshape(-1)[real]
    real_scoring = dataclasses.replace(scoring, scale=scoring.scale[real])
    scores, found = search(queries, table, real_scoring, top_k=VOCAB, vocab_chunk=VOCAB, query_chunk=VOCAB)
    scored = scores.double().gather(1, (found == ids.unsqueeze(1)).int().argmax(dim=1, keepdim=True)).squeeze(1)

    z = noise.reshape(-1, HIDDEN)[real]
    scale = torch.tensor([_documented_scale(config, length) for length in LENGTHS], dtype=torch.float64)
    scale = scale.repeat_interleave(torch.tensor(LENGTHS))
    if scoring.kind == "laplace":
        documented = -z.abs().sum(-1) / scale
    elif scoring.kind == "metric_dp":
        documented = -scale * z.norm(dim=-1)
    else:
        documented = -z.pow(2).sum(-1) / (2.0 * scale.square())
        if scoring.relative:  # z is already in units of rms(e)
            documented = documented - HIDDEN * table[ids].double().pow(2).mean(-1).sqrt().log()
    # The search scores in float32 from |y|^2 - 2 y.e + |e|^2, which rounds |y - e|^2 ~ 3e-4 (quantization) by up
    # to 2 % per token; the mean over a sequence's tokens averages that out, a 10 % wrong scale moves it 10-21 %.
    torch.testing.assert_close(scored, documented, rtol=0.05, atol=0.0)
    first = 0
    for row, length in enumerate(LENGTHS):
        mean_scored, mean_documented = (values[first : first + length].mean().item() for values in (scored, documented))
        assert mean_scored == pytest.approx(mean_documented, rel=2e-3), (
            f"{name}/{scaling}, sequence {row} (length {length}): the beam scores the true tokens {mean_scored:.6g} "
            f"on average, the documented density {mean_documented:.6g}"
        )
        first += length


CLIPPED = [case for case in CASES if case[2] is not None]


@pytest.mark.parametrize(("name", "scaling", "clip_norm"), CLIPPED, ids=[IDS[CASES.index(case)] for case in CLIPPED])
def test_the_noise_is_centred_on_the_embedding_clipped_to_clip_norm(name, scaling, clip_norm):
    """Every table row has norm ~2 > C = 1: noise added to the unclipped row would sit |x| - C ~ 1 along the row's
    direction (about 14 standard errors for the Gaussian mechanism's sigma 1.2, whose spread barely notices it)."""
    config, (table, token_ids, padding_mask), _, noise = _documented_noise(name, scaling, clip_norm)
    direction = torch.nn.functional.normalize(table[token_ids].double(), dim=-1)
    along = (noise * direction).sum(-1)[~padding_mask]
    standard_error = along.std().item() / math.sqrt(along.numel())
    assert abs(along.mean().item()) < 4 * standard_error, (
        f"{name}: the noise has mean {along.mean().item():.4g} along the embedding (standard error "
        f"{standard_error:.2g}): it is not centred on the embedding clipped to {config.clip_norm}"
    )
