"""Per-token L2 clipping of the privacy mechanisms is exact: ``x * min(1, C / |x|)``, never above ``C``.

The privacy guarantee of ``gaussian_mechanism`` (and of ``metric_dp`` with ``clip_norm``) rests on every token's
clipped embedding having norm at most ``C`` and on tokens below ``C`` being left as they are. These tests use
negligible noise so the clipping itself shows, for tokens on both sides of ``C``.
"""

from __future__ import annotations

import pytest
import torch

from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.noise.geometry import NoiseBatchInputs
from nemo_noise_plugin.noise.layer import EmbeddingNoise
from nemo_noise_plugin.noise.mechanisms import clip_scale
from nemo_noise_plugin.noise.schedule import NoiseClock

SEQ, BATCH, HIDDEN, CLIP = 64, 4, 32, 2.0


def _tokens_around_the_clip_norm() -> torch.Tensor:
    """Tokens whose norms span 0.05 C .. 20 C (log-spaced), half of them below C."""
    generator = torch.Generator().manual_seed(0)
    directions = torch.randn(SEQ, BATCH, HIDDEN, generator=generator)
    directions = directions / directions.norm(dim=-1, keepdim=True)
    norms = CLIP * torch.logspace(-1.3, 1.3, SEQ * BATCH).view(SEQ, BATCH, 1)
    return directions * norms


def _exactly_clipped(x: torch.Tensor) -> torch.Tensor:
    norms = x.double().norm(dim=-1, keepdim=True)
    return (x.double() * torch.clamp(CLIP / norms, max=1.0)).float()


def _noised(config: NoiseConfig, x: torch.Tensor) -> torch.Tensor:
    layer = EmbeddingNoise(config, sequence_parallel=False, pg_collection=None)
    return layer(x, NoiseBatchInputs(loss_mask=torch.ones(x.size(1), x.size(0))), NoiseClock())


def test_the_clip_factor_is_min_one_c_over_the_norm_and_one_below_c():
    x = _tokens_around_the_clip_norm()
    factor = clip_scale(x, CLIP, torch.ones(SEQ, BATCH, dtype=torch.bool))
    norms = x.double().norm(dim=-1)
    below = norms <= CLIP
    assert below.any() and (~below).any()
    assert torch.equal(factor[below], torch.ones_like(factor[below]))  # untouched, not merely close
    torch.testing.assert_close(factor[~below].double(), CLIP / norms[~below], rtol=1e-6, atol=0)


def test_unselected_tokens_are_never_scaled():
    x = _tokens_around_the_clip_norm()
    selected = torch.zeros(SEQ, BATCH, dtype=torch.bool)
    assert torch.equal(clip_scale(x, CLIP, selected), torch.ones(SEQ, BATCH))


@pytest.mark.parametrize(
    "config",
    [
        NoiseConfig(mechanism="gaussian_mechanism", clip_norm=CLIP, epsilon=1e12, delta=1e-5),
        NoiseConfig(mechanism="metric_dp", clip_norm=CLIP, eta=1e12),
        NoiseConfig(mechanism="laplace", clip_norm=CLIP, laplace_scale=1e-12),
    ],
    ids=["gaussian_mechanism", "metric_dp", "laplace"],
)
def test_with_negligible_noise_the_output_is_the_exactly_clipped_input(config):
    x = _tokens_around_the_clip_norm()
    out = _noised(config, x)
    noise = 6 * config.dp_sigma if config.mechanism == "gaussian_mechanism" else 1e-9  # per element, 6 sigma
    torch.testing.assert_close(out, _exactly_clipped(x), rtol=2e-6, atol=noise + 1e-7)
    assert out.double().norm(dim=-1).max().item() <= CLIP * (1 + 1e-6) + noise * HIDDEN**0.5
    below = x.double().norm(dim=-1) < CLIP
    torch.testing.assert_close(out[below], x[below], rtol=2e-6, atol=noise + 1e-7)  # not scaled up, not shrunk
