"""Each noise family has the distribution its formula says, checked tightly enough to catch a wrong constant."""

from __future__ import annotations

import math

import pytest
import torch
from scipy import stats

from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.noise.geometry import NoiseBatchInputs
from nemo_noise_plugin.noise.layer import EmbeddingNoise
from nemo_noise_plugin.noise.philox import philox4x32
from nemo_noise_plugin.noise.sampling import add_noise, add_noise_reference, unit_noise
from nemo_noise_plugin.noise.schedule import NoiseClock, schedule_factor

SEQ, BATCH, HIDDEN = 256, 8, 64


def _noised(config: NoiseConfig, x: torch.Tensor, iteration: int = 0) -> torch.Tensor:
    layer = EmbeddingNoise(config, sequence_parallel=False, pg_collection=None)
    return layer(x, NoiseBatchInputs(loss_mask=torch.ones(x.size(1), x.size(0))), NoiseClock(iteration=iteration))


def _noise(config: NoiseConfig, iteration: int = 0) -> torch.Tensor:
    return _noised(config, torch.zeros(SEQ, BATCH, HIDDEN), iteration)


@pytest.mark.parametrize(
    ("counter", "key", "expected"),
    [
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        (
            (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
            (0xA4093822, 0x299F31D0),
            (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
        ),
    ],
)
def test_philox_matches_random123_known_answer_vectors(counter, key, expected):
    words = philox4x32(tuple(torch.tensor([word]) for word in counter), key)
    assert tuple(int(word) for word in words) == expected


def test_neftune_uniform_is_uniform_on_plus_minus_alpha_over_sqrt_l_d():
    alpha = 5.0
    values = _noise(NoiseConfig(alpha=alpha)).flatten().double()
    bound = alpha / math.sqrt(SEQ * HIDDEN)
    assert values.abs().max() < bound
    assert stats.kstest(values.numpy(), stats.uniform(loc=-bound, scale=2 * bound).cdf).pvalue > 1e-3
    assert values.var().item() == pytest.approx(bound**2 / 3, rel=0.01)  # SE ~0.3% with 131k samples


def test_gaussian_has_standard_deviation_sigma_over_sqrt_l_d():
    sigma = 3.0
    values = _noise(NoiseConfig(mechanism="gaussian", sigma=sigma)).flatten().double()
    scale = sigma / math.sqrt(SEQ * HIDDEN)
    assert stats.kstest(values.numpy(), stats.norm(scale=scale).cdf).pvalue > 1e-3
    assert values.std().item() == pytest.approx(scale, rel=0.01)
    assert stats.kurtosis(values.numpy()) == pytest.approx(0.0, abs=0.05)


def test_metric_dp_radius_is_gamma_d_over_eta_and_direction_is_uniform():
    eta = 40.0
    tokens = 4096
    noise = unit_noise(7, 0, torch.arange(tokens), torch.zeros(1, dtype=torch.int64), HIDDEN, "metric_dp") / eta
    noise = noise.view(-1, HIDDEN).double()
    radius = noise.norm(dim=-1)
    # E|z| = d/eta; |z| ~ Gamma(d, 1/eta) has relative SD 1/sqrt(d), so the mean's SE is 0.2%: a shape of d-1 fails.
    assert radius.mean().item() == pytest.approx(HIDDEN / eta, rel=0.006)
    assert stats.kstest(radius.numpy(), stats.gamma(a=HIDDEN, scale=1 / eta).cdf).pvalue > 1e-3
    directions = noise / radius.unsqueeze(-1)
    assert directions.mean(dim=0).abs().max().item() < 4 / math.sqrt(tokens)
    # Each coordinate of a uniform unit vector has variance 1/d.
    assert directions.var(dim=0).mean().item() == pytest.approx(1 / HIDDEN, rel=0.03)


def test_metric_dp_clips_embeddings_before_adding_noise():
    x = torch.randn(16, 2, HIDDEN) * 5
    config = NoiseConfig(mechanism="metric_dp", eta=1e9, clip_norm=1.5)  # negligible noise: the clip shows
    out = _noised(config, x)
    assert out.norm(dim=-1).max().item() == pytest.approx(1.5, rel=1e-4)


def test_gaussian_mechanism_clips_to_c_and_adds_the_calibrated_sigma():
    config = NoiseConfig(mechanism="gaussian_mechanism", clip_norm=0.5, epsilon=4.0, delta=1e-5)
    x = torch.randn(SEQ, BATCH, HIDDEN) * 3  # norms ~24, far above the clip
    out = _noised(config, x)
    clipped = x * (0.5 / x.norm(dim=-1, keepdim=True))
    noise = (out - clipped).flatten().double()
    assert noise.std().item() == pytest.approx(config.dp_sigma, rel=0.01)
    assert stats.kstest(noise.numpy(), stats.norm(scale=config.dp_sigma).cdf).pvalue > 1e-3
    small = torch.full((4, 1, HIDDEN), 0.01)  # norm 0.08 < C: left unclipped
    mean_out = torch.stack([_noised(config, small, iteration=i) for i in range(200)]).mean(dim=0)
    assert torch.allclose(mean_out, small, atol=5 * config.dp_sigma / math.sqrt(200))


def test_quantization_proxy_is_uniform_on_plus_minus_half_the_step():
    step = 0.02
    values = _noise(NoiseConfig(mechanism="quantization", quantization_step=step)).flatten().double()
    assert values.abs().max() < step / 2
    assert values.var().item() == pytest.approx(step**2 / 12, rel=0.01)


def test_relative_noise_rms_is_rho_times_each_tokens_rms():
    rho = 0.2
    x = torch.randn(SEQ, BATCH, HIDDEN) * torch.linspace(0.1, 10, SEQ).view(-1, 1, 1)
    noise = _noised(NoiseConfig(mechanism="relative", relative_scale=rho), x) - x
    token_rms = x.pow(2).mean(dim=-1, keepdim=True).sqrt()
    normalised = (noise / token_rms).flatten().double()  # N(0, rho^2) if each token's noise RMS is rho * its RMS
    assert normalised.std().item() == pytest.approx(rho, rel=0.01)
    assert stats.kstest(normalised.numpy(), stats.norm(scale=rho).cdf).pvalue > 1e-3


def test_laplace_has_mean_zero_and_standard_deviation_b_sqrt_2():
    b = 0.3
    values = _noise(NoiseConfig(mechanism="laplace", laplace_scale=b)).flatten().double()
    assert values.mean().item() == pytest.approx(0.0, abs=4 * b * math.sqrt(2 / values.numel()))
    assert values.std().item() == pytest.approx(b * math.sqrt(2), rel=0.01)  # SE ~0.3% with 131k samples
    assert values.abs().mean().item() == pytest.approx(b, rel=0.01)  # E|z| = b: a Gaussian of that std gives 1.13 b
    assert stats.kstest(values.numpy(), stats.laplace(scale=b).cdf).pvalue > 1e-3
    assert stats.kurtosis(values.numpy()) == pytest.approx(3.0, abs=0.15)
    assert values.abs().max().item() <= b * 24 * math.log(2) * (1 + 1e-6)  # |v| <= 1 - 2**-24


def test_laplace_is_not_length_scaled_and_clips_when_clip_norm_is_set():
    short = NoiseConfig(mechanism="laplace", laplace_scale=0.3)
    x = torch.zeros(SEQ, BATCH, HIDDEN)
    whole = _noised(short, x)
    half = EmbeddingNoise(short, sequence_parallel=False, pg_collection=None)(
        x[: SEQ // 2], NoiseBatchInputs(loss_mask=torch.ones(BATCH, SEQ // 2)), NoiseClock()
    )
    assert torch.equal(half, whole[: SEQ // 2])  # the same noise at a quarter of the length: no 1/sqrt(L)
    big = torch.randn(16, 2, HIDDEN) * 5
    out = _noised(NoiseConfig(mechanism="laplace", laplace_scale=1e-9, clip_norm=1.5), big)
    assert out.norm(dim=-1).max().item() == pytest.approx(1.5, rel=1e-4)


@pytest.mark.parametrize(
    ("schedule", "iteration", "expected"),
    [
        ("constant", 0, 0.25),  # warm-up 4: (0 + 1) / 4
        ("constant", 3, 1.0),
        ("constant", 1000, 1.0),
        ("linear", 4, 1.0),
        ("linear", 9, 0.1 + 0.9 * 0.5),  # half-way through a 10-step decay to 0.1
        ("linear", 100, 0.1),
        ("cosine", 9, 0.1 + 0.9 * 0.5),
        ("cosine", 6, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.2))),
        ("cosine", 14, 0.1),
    ],
)
def test_schedule_factor(schedule, iteration, expected):
    config = NoiseConfig(schedule=schedule, warmup_steps=4, decay_steps=10, min_factor=0.1)
    assert schedule_factor(config, iteration) == pytest.approx(expected, abs=1e-12)


def test_schedule_scales_the_noise_by_its_factor():
    config = NoiseConfig(alpha=5.0, schedule="linear", decay_steps=10, min_factor=0.0)
    full, half = _noise(config, iteration=0), _noise(config, iteration=5)
    unit_full = _noise(NoiseConfig(alpha=5.0), iteration=0)
    unit_half = _noise(NoiseConfig(alpha=5.0), iteration=5)
    assert torch.allclose(full, unit_full)
    assert torch.allclose(half, 0.5 * unit_half)


@pytest.mark.parametrize("distribution", ["gaussian", "laplace"])
def test_fast_math_is_a_kernel_setting_the_cpu_path_draws_the_float64_reference_either_way(distribution):
    """``NoiseConfig.fast_math`` chooses the GPU kernel's math (issue 34, item 3); off the GPU ``add_noise`` is the
    float64 reference with or without it."""
    arguments = {
        "seed": 3,
        "iteration": 5,
        "sample_index": torch.arange(2),
        "token_position": torch.arange(6),
        "noise_scale": torch.full((6, 2), 0.5),
        "distribution": distribution,
    }
    x = torch.randn(6, 2, 8)
    reference = add_noise_reference(x, **arguments)
    assert torch.equal(add_noise(x, fast_math=True, **arguments), reference)
    assert torch.equal(add_noise(x, fast_math=False, **arguments), reference)
    assert not torch.equal(reference, x)
