"""Drawing the configured noise: token selection, clipping and each family's per-token scale on its unit sampler.

What a mechanism is comes from its row of ``noise/families.py``: every family reduces to
``x * input_scale + noise_scale * unit`` per token (``noise/sampling.py``), with ``unit`` drawn by the row's unit
sampler (``UNIT_SAMPLERS``), ``noise_scale`` the row's ``token_scale`` (times the token's RMS for relative noise) and
``input_scale`` the clip factor of clipping families. The formulas are in ``NoiseConfig``'s docstring. Per-token
statistics of ``x`` (norm, RMS) are taken without gradient: like the noise, clipping and relative scales are
constants to the backward pass.

``lookup_with_configured_noise`` draws the same noise onto an embedding lookup in one pass, for the mechanisms whose
noise does not depend on the embedding values (``noise_independent_of_input``: no clipping, not relative).
"""

from __future__ import annotations

import torch

from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.noise.families import noise_family
from nemo_noise_plugin.noise.geometry import TokenGeometry
from nemo_noise_plugin.noise.sampling import add_noise, lookup_with_noise


def selected_tokens(config: NoiseConfig, geometry: TokenGeometry, input_ids: torch.Tensor | None) -> torch.Tensor:
    """``[s, b]`` True for tokens that get noise: real, in the selected part (prompt, response or private spans),
    and not a special token."""
    selected = geometry.valid
    if config.tokens == "response":
        selected = selected & geometry.response
    elif config.tokens == "prompt":
        selected = selected & ~geometry.response
    elif config.tokens == "spans":
        selected = selected & geometry.private
    if config.special_token_ids:
        if input_ids is None:
            raise ValueError(
                "NoiseConfig.special_token_ids is set, but the forward call passed no input_ids to check them against."
            )
        local_ids = input_ids.reshape(input_ids.size(0), -1)[:, geometry.rows].t()
        for token in config.special_token_ids:  # device comparisons: a host-made id tensor would sync every step
            selected = selected & (local_ids != token)
    return selected


def clip_scale(x: torch.Tensor, clip_norm: float, selected: torch.Tensor) -> torch.Tensor:
    """``[s, b]`` factor ``min(1, C / |x|)`` that clips selected tokens to norm ``C`` (1 elsewhere)."""
    norms = x.detach().float().norm(dim=-1)
    factor = (clip_norm / norms.clamp_min(torch.finfo(torch.float32).tiny)).clamp_max(1.0)
    return torch.where(selected, factor, torch.ones_like(factor))


def apply_noise(
    x: torch.Tensor,
    config: NoiseConfig,
    *,
    factor: float | torch.Tensor,
    selected: torch.Tensor,
    geometry: TokenGeometry,
    sample_index: torch.Tensor,
    iteration: int | torch.Tensor,
) -> torch.Tensor:
    """``x`` with the configured mechanism's noise on the selected tokens (schedule ``factor`` applied).

    ``factor`` and ``iteration`` are host numbers, or 0-dim device tensors (float32, int64) that a CUDA graph's
    replays read anew (``noise/replayable.py``)."""
    family = noise_family(config.mechanism)
    clip = clip_scale(x, float(config.clip_norm), selected) if family.clips(config) else None
    scale = family.token_scale(config, geometry.lengths, geometry.global_length, x.size(-1), factor)
    if family.relative_to_embedding:
        scale = scale * x.detach().float().pow(2).mean(dim=-1).sqrt()
    return add_noise(x, input_scale=clip, **_draw_arguments(config, scale, selected, geometry, sample_index, iteration))


def _draw_arguments(
    config: NoiseConfig,
    scale: torch.Tensor,
    selected: torch.Tensor,
    geometry: TokenGeometry,
    sample_index: torch.Tensor,
    iteration: int | torch.Tensor,
) -> dict:
    """The noise keys, the per-token scale on the selected tokens, the unit of ``config``'s family and the kernel's
    math (``fast_math``)."""
    return {
        "seed": config.seed,
        "iteration": iteration,
        "sample_index": sample_index,
        "token_position": geometry.positions,
        "noise_scale": scale * selected.to(torch.float32),
        "distribution": noise_family(config.mechanism).unit,
        "fast_math": config.fast_math,
    }


def noise_independent_of_input(config: NoiseConfig) -> bool:
    """Whether ``config``'s noise and scales are independent of the embedding values (no clipping, not relative):
    then the noise can be added where the rows are looked up (``lookup_with_configured_noise``)."""
    family = noise_family(config.mechanism)
    return not family.clips(config) and not family.relative_to_embedding


def lookup_with_configured_noise(
    weight: torch.Tensor,
    input_ids: torch.Tensor,
    config: NoiseConfig,
    *,
    factor: float | torch.Tensor,
    selected: torch.Tensor,
    geometry: TokenGeometry,
    sample_index: torch.Tensor,
    iteration: int | torch.Tensor,
) -> torch.Tensor:
    """``apply_noise`` of the lookup ``weight[input_ids]`` (``[b, s]`` ids, ``[s, b, h]`` out) in one pass; only for
    mechanisms whose noise is independent of the input (``noise_independent_of_input``)."""
    if not noise_independent_of_input(config):
        raise ValueError(
            f"mechanism {config.mechanism!r} with clip_norm={config.clip_norm!r} scales the noise or the input by "
            "the embedding values: add it to the looked-up embeddings with apply_noise instead."
        )
    family = noise_family(config.mechanism)
    scale = family.token_scale(config, geometry.lengths, geometry.global_length, weight.size(-1), factor)
    return lookup_with_noise(
        weight, input_ids, **_draw_arguments(config, scale, selected, geometry, sample_index, iteration)
    )
