"""The noise families: per-token scales for each mechanism, and the metric-DP sampler.

Every mechanism except metric-DP reduces to ``x * input_scale + noise_scale * unit`` per token with standard
uniform or Gaussian ``unit`` noise (``noise/sampling.py``); metric-DP needs a per-token direction normalisation and a
Gamma radius, drawn here from the same Philox streams. The formulas are in ``NoiseConfig``'s docstring. Per-token
statistics of ``x`` (norm, RMS) are taken without gradient: like the noise, clipping and relative scales are
constants to the backward pass.
"""

from __future__ import annotations

import math

import torch

from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.noise.geometry import TokenGeometry
from nemo_noise_plugin.noise.philox import STREAM_NOISE, STREAM_RADIUS
from nemo_noise_plugin.noise.sampling import add_noise, unit_noise


def selected_tokens(config: NoiseConfig, geometry: TokenGeometry, input_ids: torch.Tensor | None) -> torch.Tensor:
    """``[s, b]`` True for tokens that get noise: real, in the selected part, and not a special token."""
    selected = geometry.valid
    if config.tokens == "response":
        selected = selected & geometry.response
    elif config.tokens == "prompt":
        selected = selected & ~geometry.response
    if config.special_token_ids:
        if input_ids is None:
            raise ValueError(
                "NoiseConfig.special_token_ids is set, but the forward call passed no input_ids to check them against."
            )
        local_ids = input_ids.reshape(input_ids.size(0), -1)[:, geometry.rows].t()
        special = torch.isin(local_ids, torch.tensor(config.special_token_ids, device=local_ids.device))
        selected = selected & ~special
    return selected


UNIT_NOISE_RMS = {"uniform": 1.0 / math.sqrt(3.0), "gaussian": 1.0}
"""Per-element standard deviation of the unit noise of each length-scaled mechanism: U(-1, 1) and N(0, 1)."""


def embedding_distance_scale(config: NoiseConfig, hidden_size: int) -> float:
    """``embedding_distance`` scaling: ``c = D / (sqrt(d) * rms(unit))`` with ``D`` the median nearest-neighbour
    distance, so that ``distance_multiple * c * unit`` has RMS norm ``distance_multiple * D`` (uniform or gaussian)."""
    if config.embedding_distance is None:
        raise ValueError(
            "NoiseConfig.embedding_distance=None is invalid with scaling='embedding_distance': expected the "
            "vocabulary's median nearest-neighbour distance > 0; measure it once from the model's embedding table "
            "with nemo_noise_plugin.privacy.embedding_distance.calibrate_noise_to_embeddings(config, table)."
        )
    return float(config.embedding_distance) / (math.sqrt(hidden_size) * UNIT_NOISE_RMS[config.mechanism])


def length_scale(config: NoiseConfig, geometry: TokenGeometry, hidden_size: int) -> torch.Tensor:
    """``[s, b]`` NEFTune factor ``1/sqrt(L*d)`` (true or padded ``L``), 1 for absolute scaling, or the
    ``embedding_distance`` factor."""
    if config.scaling == "embedding_distance":
        return torch.full_like(geometry.lengths, embedding_distance_scale(config, hidden_size))
    if config.scaling == "absolute":
        return torch.ones_like(geometry.lengths)
    if config.scaling == "padded_length":
        return torch.full_like(geometry.lengths, 1.0 / math.sqrt(geometry.global_length * hidden_size))
    return torch.rsqrt(geometry.lengths.clamp_min(1.0) * hidden_size)


def clip_scale(x: torch.Tensor, clip_norm: float, selected: torch.Tensor) -> torch.Tensor:
    """``[s, b]`` factor ``min(1, C / |x|)`` that clips selected tokens to norm ``C`` (1 elsewhere)."""
    norms = x.detach().float().norm(dim=-1)
    factor = (clip_norm / norms.clamp_min(torch.finfo(torch.float32).tiny)).clamp_max(1.0)
    return torch.where(selected, factor, torch.ones_like(factor))


def apply_noise(
    x: torch.Tensor,
    config: NoiseConfig,
    *,
    factor: float,
    selected: torch.Tensor,
    geometry: TokenGeometry,
    sample_index: torch.Tensor,
    iteration: int,
) -> torch.Tensor:
    """``x`` with the configured mechanism's noise on the selected tokens (schedule ``factor`` applied)."""
    mask = selected.to(torch.float32)
    keys = dict(seed=config.seed, iteration=iteration, sample_index=sample_index, token_position=geometry.positions)
    hidden = x.size(-1)
    mechanism = config.mechanism
    if mechanism in ("uniform", "gaussian"):
        scale = factor * config.magnitude * length_scale(config, geometry, hidden) * mask
        return add_noise(x, noise_scale=scale, distribution=mechanism, **keys)
    if mechanism == "quantization":
        return add_noise(x, noise_scale=mask * (factor * config.quantization_step / 2), distribution="uniform", **keys)
    if mechanism == "relative":
        rms = x.detach().float().pow(2).mean(dim=-1).sqrt()
        return add_noise(x, noise_scale=mask * rms * (factor * config.relative_scale), distribution="gaussian", **keys)
    if mechanism == "gaussian_mechanism":
        clip = clip_scale(x, float(config.clip_norm), selected)
        return add_noise(x, noise_scale=mask * config.dp_sigma, input_scale=clip, distribution="gaussian", **keys)
    return _metric_dp(x, config, mask, selected, **keys)


def metric_dp_noise(
    seed: int, iteration: int, sample_index: torch.Tensor, token_position: torch.Tensor, hidden_size: int, eta: float
) -> torch.Tensor:
    """``[s, b, d]`` float32 d_chi noise ``r * g / |g|`` with ``r ~ Gamma(d, 1/eta)``.

    The Gamma radius is the sum of ``d`` Exp(1) variates (exact for integer shape ``d``) divided by ``eta``, drawn
    from the radius stream, so it is keyed by the same global indices as the direction.
    """
    keys = (seed, iteration, sample_index, token_position, hidden_size)
    direction = unit_noise(*keys, "gaussian", stream=STREAM_NOISE).to(torch.float64)
    radius = unit_noise(*keys, "exponential", stream=STREAM_RADIUS).to(torch.float64).sum(dim=-1) / eta
    return (direction * (radius / direction.norm(dim=-1)).unsqueeze(-1)).to(torch.float32)


def _metric_dp(
    x: torch.Tensor,
    config: NoiseConfig,
    mask: torch.Tensor,
    selected: torch.Tensor,
    *,
    seed: int,
    iteration: int,
    sample_index: torch.Tensor,
    token_position: torch.Tensor,
) -> torch.Tensor:
    noise = metric_dp_noise(seed, iteration, sample_index, token_position, x.size(-1), float(config.eta))
    base = x.float()
    if config.clip_norm is not None:
        base = base * clip_scale(x, float(config.clip_norm), selected).unsqueeze(-1)
    return (base + noise * mask.unsqueeze(-1)).to(x.dtype)
