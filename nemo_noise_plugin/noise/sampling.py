"""Unit noise from global indices: one table of unit samplers, and the fused "scale the input, add scaled noise".

``UNIT_SAMPLERS`` holds each unit noise a family draws (``NoiseFamily.unit`` names a row): how it is drawn from the
Philox words (``noise/philox.py``) of a ``[s, b, h]`` block given each row's global token position and each column's
global sample index, its per-coordinate spread, its typical norm, and whether the fused Triton kernel draws it.
``add_noise`` is the one operation every family reduces to: ``out = x * input_scale + noise_scale * unit`` per token,
computed in float32 and cast back. On CUDA it dispatches to the fused Triton kernel (``noise/triton_kernel.py``: same
Philox words, one pass over ``x``) for the units it draws; ``add_noise_reference`` is what every other path is
tested against. ``lookup_with_noise`` is the same with the embedding lookup in front (``weight[input_ids]`` in
Megatron's ``[s, b, h]`` layout, no input scale): one kernel pass from the table on CUDA, else the lookup followed by
``add_noise_reference``.

Gaussian values use Box-Muller on word pairs: words ``(w0, w1)`` of a counter give ``(r cos t, r sin t)`` with
``r = sqrt(-2 ln u(w0))``, ``t = 2 pi u(w1)`` and ``u`` the open-interval uniform map; ``(w2, w3)`` likewise.
Laplace values invert the CDF of each word's symmetric uniform ``v`` in (-1, 1): ``sign(v) * -ln(1 - |v|)``
(``|v| <= 1 - 2**-24``, so at most ``24 ln 2 = 16.6``). The metric-DP unit is ``r * g / |g|``: ``g`` Gaussian from
the noise stream, the radius ``r ~ Gamma(d, 1)`` the sum of ``d`` Exp(1) values of the radius stream (exact for
integer shape ``d``), so it is keyed by the same global indices as the direction.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from nemo_noise_plugin.noise.philox import (
    STREAM_NOISE,
    STREAM_RADIUS,
    element_words,
    words_to_open_uniform,
    words_to_symmetric_uniform,
)

__all__ = [
    "UNIT_SAMPLERS",
    "UnitSampler",
    "add_noise",
    "add_noise_reference",
    "lookup_with_noise",
    "lookup_with_noise_reference",
    "unit_noise",
    "unit_sampler",
]

Keys = tuple[int, int | torch.Tensor, torch.Tensor, torch.Tensor, int]
"""``(seed, iteration, samples, positions, hidden_size)``: the flat ``[n]`` global indices of a block's tokens (the
iteration an int or a 0-dim int64 tensor on their device)."""


@dataclass(frozen=True)
class UnitSampler:
    """One unit noise: drawn from the Philox words of global indices, the same at any layout.

    ``draw(keys, stream)`` returns float32 ``[n, hidden_size]`` for the ``n`` tokens of ``keys``.
    """

    name: str
    draw: Callable[[Keys, int], torch.Tensor]
    std: float | None
    """Per-coordinate standard deviation (i.i.d. coordinates); None for a unit drawn as a whole vector."""
    norm: Callable[[int], float]
    """``hidden_size -> `` the unit's typical norm (``noise/bounds.py`` bounds the noise with it)."""
    kernel: bool = False
    """The fused Triton kernel draws it on CUDA (``noise/triton_kernel.py``); False: the torch path everywhere."""
    paired: bool = False
    """Draws hidden elements in pairs (Box-Muller): the hidden size must be even."""


def _per_coordinate(transform: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[Keys, int], torch.Tensor]:
    """A sampler whose coordinates are ``transform`` of the element words, i.i.d."""
    return lambda keys, stream: transform(element_words(*keys, stream))


def _inverse_laplace_cdf(words: torch.Tensor) -> torch.Tensor:
    """Laplace(0, 1) from U(-1, 1): ``sign(v) * -ln(1 - |v|)``, in float64 (``1 - |v|`` is exact), returned float32."""
    v = words_to_symmetric_uniform(words).to(torch.float64)
    return torch.copysign(-torch.log1p(-v.abs()), v).to(torch.float32)


def _box_muller(words: torch.Tensor) -> torch.Tensor:
    """Pairs ``(u0, u1)`` along the last dimension to ``(r cos t, r sin t)``; computed in float64, returned float32."""
    uniform = words_to_open_uniform(words)
    pairs = uniform.to(torch.float64).view(*uniform.shape[:-1], -1, 2)
    radius = torch.sqrt(-2.0 * torch.log(pairs[..., 0]))
    angle = (2.0 * math.pi) * pairs[..., 1]
    return torch.stack((radius * torch.cos(angle), radius * torch.sin(angle)), dim=-1).flatten(-2).to(torch.float32)


def _exponential(words: torch.Tensor) -> torch.Tensor:
    return -torch.log(words_to_open_uniform(words))


def _metric_dp(keys: Keys, stream: int) -> torch.Tensor:
    """``r * g / |g|``, ``g ~ N(0, I_d)`` (noise stream), ``r ~ Gamma(d, 1)`` (radius stream); float64, float32 out."""
    direction = _box_muller(element_words(*keys, STREAM_NOISE)).to(torch.float64)
    radius = _exponential(element_words(*keys, STREAM_RADIUS)).to(torch.float64).sum(dim=-1)
    return (direction * (radius / direction.norm(dim=-1)).unsqueeze(-1)).to(torch.float32)


def _coordinate_norm(std: float) -> Callable[[int], float]:
    return lambda hidden_size: std * math.sqrt(hidden_size)


UNIT_SAMPLERS: dict[str, UnitSampler] = {
    sampler.name: sampler
    for sampler in (
        UnitSampler(
            "uniform",
            _per_coordinate(words_to_symmetric_uniform),
            1 / math.sqrt(3),
            _coordinate_norm(1 / math.sqrt(3)),
            kernel=True,
        ),
        UnitSampler("gaussian", _per_coordinate(_box_muller), 1.0, _coordinate_norm(1.0), kernel=True, paired=True),
        UnitSampler(
            "laplace", _per_coordinate(_inverse_laplace_cdf), math.sqrt(2), _coordinate_norm(math.sqrt(2)), kernel=True
        ),
        UnitSampler("exponential", _per_coordinate(_exponential), 1.0, _coordinate_norm(math.sqrt(2))),
        UnitSampler("metric_dp", _metric_dp, None, float, paired=True),  # |unit| ~ Gamma(d, 1): about d
    )
}
"""Every unit noise by name: U(-1, 1), N(0, 1), Laplace(0, 1) per coordinate, Exp(1) (the metric-DP radius's
stream), and the metric-DP unit ``r * g / |g|`` with ``r ~ Gamma(d, 1)`` (density ``~ exp(-|z|)``)."""


def unit_sampler(name: str) -> UnitSampler:
    """The row of ``name``; a ``ValueError`` listing the samplers otherwise."""
    try:
        return UNIT_SAMPLERS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown unit distribution {name!r}: expected one of {', '.join(UNIT_SAMPLERS)}.") from None


def unit_noise(
    seed: int,
    iteration: int | torch.Tensor,
    sample_index: torch.Tensor,
    token_position: torch.Tensor,
    hidden_size: int,
    distribution: str,
    stream: int = STREAM_NOISE,
) -> torch.Tensor:
    """Float32 ``[s, b, hidden_size]`` unit noise of the sampler ``distribution`` (a row of ``UNIT_SAMPLERS``).

    ``token_position`` is ``[s]`` (or ``[s, b]``) and ``sample_index`` is ``[b]``, both int64 global indices.
    """
    sampler = unit_sampler(distribution)
    seq, batch = token_position.size(0), sample_index.numel()
    positions = token_position.view(seq, -1).expand(seq, batch).reshape(-1)
    samples = sample_index.view(1, batch).expand(seq, batch).reshape(-1)
    if sampler.paired and hidden_size % 2:
        raise ValueError(f"{distribution} noise pairs hidden elements: hidden size {hidden_size} must be even.")
    return sampler.draw((seed, iteration, samples, positions, hidden_size), stream).view(seq, batch, hidden_size)


def add_noise_reference(
    x: torch.Tensor,
    *,
    seed: int,
    iteration: int | torch.Tensor,
    sample_index: torch.Tensor,
    token_position: torch.Tensor,
    noise_scale: torch.Tensor,
    input_scale: torch.Tensor | None = None,
    distribution: str = "uniform",
) -> torch.Tensor:
    """``(x * input_scale + noise_scale * unit).to(x.dtype)`` in float32, per token ``[s, b]`` scales.

    ``x`` is ``[s, b, h]``; ``noise_scale`` and ``input_scale`` are float32 ``[s, b]`` (a zero ``noise_scale``
    leaves the token unnoised); ``distribution`` names a row of ``UNIT_SAMPLERS``. Gradients flow to ``x`` through
    ``input_scale`` only.
    """
    unit = unit_noise(seed, iteration, sample_index, token_position, x.size(2), distribution)
    base = x.float() if input_scale is None else x.float() * input_scale.unsqueeze(-1)
    return (base + unit * noise_scale.unsqueeze(-1)).to(x.dtype)


def add_noise(x: torch.Tensor, *, fast_math: bool = False, **arguments: Any) -> torch.Tensor:
    """``add_noise_reference(x, **arguments)``; on CUDA with Triton, from the fused one-pass kernel (same Philox
    words) when it draws the unit (``UnitSampler.kernel``), with its hardware-log variant when ``fast_math``
    (``NoiseConfig.fast_math``; the torch path is float64 either way)."""
    if x.is_cuda and unit_sampler(arguments.get("distribution", "uniform")).kernel:
        from nemo_noise_plugin.noise.fused_noise import fused_add_noise
        from nemo_noise_plugin.noise.triton_kernel import triton_available

        if triton_available():
            return fused_add_noise(x, fast_math=fast_math, **arguments)
    return add_noise_reference(x, **arguments)


def lookup_with_noise_reference(weight: torch.Tensor, input_ids: torch.Tensor, **arguments: Any) -> torch.Tensor:
    """``add_noise_reference`` of the lookup ``F.embedding(input_ids, weight)`` (``[b, s]`` ids) moved to
    ``[s, b, h]`` as Megatron-Core's embedding moves it (a contiguous transposed copy); gradients flow to ``weight`` as
    the lookup's. ``arguments`` as ``add_noise_reference``'s, less ``input_scale``."""
    looked_up = torch.nn.functional.embedding(input_ids, weight).transpose(0, 1).contiguous()
    return add_noise_reference(looked_up, **arguments)


def lookup_with_noise(
    weight: torch.Tensor, input_ids: torch.Tensor, *, fast_math: bool = False, **arguments: Any
) -> torch.Tensor:
    """``lookup_with_noise_reference(weight, input_ids, **arguments)``; on CUDA with Triton, from the kernel reading
    the table's rows (``fused_gather_add_noise``: the same noise bits as ``add_noise``'s kernel) when it draws the
    unit, ``fast_math`` as ``add_noise``'s."""
    if weight.is_cuda and unit_sampler(arguments.get("distribution", "uniform")).kernel:
        from nemo_noise_plugin.noise.fused_noise import fused_gather_add_noise
        from nemo_noise_plugin.noise.triton_kernel import triton_available

        if triton_available():
            return fused_gather_add_noise(weight, input_ids, fast_math=fast_math, **arguments)
    return lookup_with_noise_reference(weight, input_ids, **arguments)
