"""The beam attack's noise model is the drawn noise's, for every mechanism and every scaling it takes.

The LM-prior beam attack scores candidates with a noise likelihood (``beam.noise_likelihood``). Here the noise is
drawn by the plugin's own layer (``noised_embeddings``) for every family of the registry at every scaling it
accepts, with sequences of different true lengths and a schedule factor below 1 where the family allows one, and
the spread that likelihood assumes for each sequence is compared with the spread of the drawn noise: a wrong
NEFTune length factor, Gaussian-mechanism sigma, metric-DP eta or ``embedding_distance`` size fails here.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from scipy import stats

from nemo_noise_plugin.noise.config import SCALINGS, load_noise_config
from nemo_noise_plugin.noise.families import NOISE_FAMILIES
from nemo_noise_plugin.noise.schedule import schedule_factor
from nemo_noise_plugin.privacy.audit.beam import noise_likelihood
from nemo_noise_plugin.privacy.audit.noised import noised_embeddings

VOCAB, SEQ, HIDDEN = 300, 96, 128
LENGTHS = (96, 80, 64, 48)
"""True lengths of the four audited sequences (the rest is padding): NEFTune's factor differs per sequence."""
EMBEDDING_DISTANCE = 0.8
TOLERANCE = 0.08
"""Relative; the spread of 48 x 128 draws is known to ~2 % (4 standard errors for Laplace), a wrong constant
(sqrt(2), sqrt(3), a length ratio, the 30-fold embedding_distance error) is far outside."""


def _cases() -> list[tuple[str, str]]:
    cases = []
    for name, family in NOISE_FAMILIES.items():
        scalings = SCALINGS if family.length_scaled else (load_noise_config(family.preset).scaling,)
        cases += [(name, scaling) for scaling in scalings]
    return cases


CASES = _cases()


def _config(name: str, scaling: str):
    """The family's preset at ``scaling``, with ``distance_multiple`` unlike the magnitude and, for the families that
    allow one, a warm-up that puts the schedule factor at 0.5 on iteration 1."""
    family = NOISE_FAMILIES[name]
    config = load_noise_config(family.preset, seed=5)
    settings = {"scaling": scaling, "distance_multiple": 1.7}
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


def _drawn_and_assumed(name: str, scaling: str):
    """Per sequence: the drawn noise ``[L, h]`` (normalised by the token's RMS for relative noise), and the
    likelihood's kind, per-token scale ``[L]`` and clip."""
    config = _config(name, scaling)
    iteration = 1
    table, token_ids, padding_mask = _batch()
    noised = noised_embeddings(table, token_ids, config, iteration=iteration, padding_mask=padding_mask)
    scoring = noise_likelihood(config, noised, iteration, padding_mask=padding_mask)
    clean = table[token_ids]
    if scoring.clip_norm is not None:
        clean = clean * (scoring.clip_norm / clean.norm(dim=-1, keepdim=True)).clamp_max(1.0)
    noise = noised - clean
    if scoring.kind == "relative":
        noise = noise / table[token_ids].pow(2).mean(dim=-1, keepdim=True).sqrt()
    scale = scoring.scale.view(len(LENGTHS), SEQ)
    per_sequence = [(noise[row, :length].double(), scale[row, :length].double()) for row, length in enumerate(LENGTHS)]
    return config, scoring, per_sequence


def _assumed_coordinate_std(kind: str, scale: torch.Tensor) -> torch.Tensor:
    """The per-coordinate standard deviation of the density the likelihood scores with, from that density's math."""
    if kind in ("gaussian", "relative"):  # exp(-|z|^2 / (2 s^2))
        return scale
    if kind == "laplace":  # exp(-|z|_1 / b): variance 2 b^2
        return scale * math.sqrt(2.0)
    if kind == "metric_dp":  # exp(-eta |z|): |z| ~ Gamma(d, 1/eta), E|z|^2 = d (d + 1) / eta^2
        return math.sqrt(HIDDEN + 1) / scale
    raise AssertionError(f"unexpected scoring kind {kind!r}")


@pytest.mark.parametrize(("name", "scaling"), CASES, ids=[f"{name}-{scaling}" for name, scaling in CASES])
def test_the_beam_likelihood_assumes_the_spread_of_the_drawn_noise(name, scaling):
    config, scoring, per_sequence = _drawn_and_assumed(name, scaling)
    assert config.is_active_configuration and (config.warmup_steps == 0 or schedule_factor(config, 1) == 0.5)
    for row, (noise, scale) in enumerate(per_sequence):
        assumed = _assumed_coordinate_std(scoring.kind, scale)
        assert assumed.max() / assumed.min() < 1 + 1e-6, "one scale per sequence: every token has the same noise"
        drawn = noise.pow(2).mean().sqrt().item()
        assert drawn == pytest.approx(assumed.mean().item(), rel=TOLERANCE), (
            f"{name}/{scaling}, sequence {row} (length {LENGTHS[row]}): the beam assumes a per-coordinate spread of "
            f"{assumed.mean().item():.4g}, the drawn noise has {drawn:.4g}"
        )


@pytest.mark.parametrize(("name", "scaling"), CASES, ids=[f"{name}-{scaling}" for name, scaling in CASES])
def test_the_beam_likelihood_has_the_shape_of_the_drawn_noise(name, scaling):
    """Gaussian and Laplace likelihoods on Gaussian and Laplace noise, the d_chi density's radius on metric-DP noise;
    uniform noise is scored by a Gaussian of its variance (a documented smooth stand-in): the drawn noise is the
    box of that variance."""
    config, scoring, per_sequence = _drawn_and_assumed(name, scaling)
    unit = NOISE_FAMILIES[name].unit
    noise = torch.cat([noise for noise, _ in per_sequence])
    scale = torch.cat([scale for _, scale in per_sequence])
    normalised = (noise / scale.unsqueeze(-1)).flatten().numpy()
    if unit == "uniform":  # U(-sqrt(3) s, sqrt(3) s) for the Gaussian's s
        assert scoring.kind == "gaussian"
        assert stats.kstest(normalised, stats.uniform(loc=-math.sqrt(3), scale=2 * math.sqrt(3)).cdf).pvalue > 1e-3
    elif unit == "gaussian":
        assert scoring.kind in ("gaussian", "relative")
        assert stats.kstest(normalised, stats.norm().cdf).pvalue > 1e-3
    elif unit == "laplace":
        assert scoring.kind == "laplace"
        assert stats.kstest(normalised, stats.laplace().cdf).pvalue > 1e-3
    else:
        assert unit == "d_chi" and scoring.kind == "metric_dp"
        eta = scale  # the metric_dp scoring's scale is eta; the radius of exp(-eta |z|) is Gamma(d, 1/eta)
        assert (noise.norm(dim=-1) * eta).mean().item() == pytest.approx(HIDDEN, rel=0.01)
