"""Unit noise from global indices, and the fused "scale the input, add scaled noise" operation (torch reference).

``unit_noise`` turns Philox words (``noise/philox.py``) into standard uniform, Gaussian or Laplace noise for a
``[s, b, h]`` block given each row's global token position and each column's global sample index. ``add_noise`` is
the one operation every per-coordinate mechanism reduces to: ``out = x * input_scale + noise_scale * unit`` per
token, computed in float32 and cast back. On CUDA it dispatches to the fused Triton kernel
(``noise/triton_kernel.py``: same Philox words, one pass over ``x``); ``add_noise_reference`` is what every other
path is tested against.

Gaussian values use Box-Muller on word pairs: words ``(w0, w1)`` of a counter give ``(r cos t, r sin t)`` with
``r = sqrt(-2 ln u(w0))``, ``t = 2 pi u(w1)`` and ``u`` the open-interval uniform map; ``(w2, w3)`` likewise.
Laplace values invert the CDF of each word's symmetric uniform ``v`` in (-1, 1): ``sign(v) * -ln(1 - |v|)``
(``|v| <= 1 - 2**-24``, so at most ``24 ln 2 = 16.6``).
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from nemo_noise_plugin.noise.philox import (
    STREAM_NOISE,
    element_words,
    words_to_open_uniform,
    words_to_symmetric_uniform,
)

UnitDistribution = Literal["uniform", "gaussian", "laplace", "exponential"]
AddedDistribution = Literal["uniform", "gaussian", "laplace"]
"""The unit distributions ``add_noise`` adds (the per-coordinate units of ``noise/families.py``)."""


def unit_noise(
    seed: int,
    iteration: int,
    sample_index: torch.Tensor,
    token_position: torch.Tensor,
    hidden_size: int,
    distribution: UnitDistribution,
    stream: int = STREAM_NOISE,
) -> torch.Tensor:
    """Float32 ``[s, b, hidden_size]`` standard noise: U(-1, 1), N(0, 1), Laplace(0, 1) or Exp(1).

    ``token_position`` is ``[s]`` (or ``[s, b]``) and ``sample_index`` is ``[b]``, both int64 global indices.
    """
    seq, batch = token_position.size(0), sample_index.numel()
    positions = token_position.view(seq, -1).expand(seq, batch).reshape(-1)
    samples = sample_index.view(1, batch).expand(seq, batch).reshape(-1)
    if distribution == "gaussian" and hidden_size % 2:
        raise ValueError(f"Gaussian noise pairs hidden elements: hidden size {hidden_size} must be even.")
    words = element_words(seed, iteration, samples, positions, hidden_size, stream)
    if distribution == "uniform":
        values = words_to_symmetric_uniform(words)
    elif distribution == "laplace":
        values = _inverse_laplace_cdf(words_to_symmetric_uniform(words))
    elif distribution == "exponential":
        values = -torch.log(words_to_open_uniform(words))
    elif distribution == "gaussian":
        values = _box_muller(words_to_open_uniform(words))
    else:
        raise ValueError(
            f"unknown unit distribution {distribution!r}: expected uniform, gaussian, laplace or exponential."
        )
    return values.view(seq, batch, hidden_size)


def _inverse_laplace_cdf(symmetric: torch.Tensor) -> torch.Tensor:
    """Laplace(0, 1) from U(-1, 1): ``sign(v) * -ln(1 - |v|)``, in float64 (``1 - |v|`` is exact), returned float32."""
    v = symmetric.to(torch.float64)
    return torch.copysign(-torch.log1p(-v.abs()), v).to(torch.float32)


def _box_muller(uniform: torch.Tensor) -> torch.Tensor:
    """Pairs ``(u0, u1)`` along the last dimension to ``(r cos t, r sin t)``; computed in float64, returned float32."""
    pairs = uniform.to(torch.float64).view(*uniform.shape[:-1], -1, 2)
    radius = torch.sqrt(-2.0 * torch.log(pairs[..., 0]))
    angle = (2.0 * math.pi) * pairs[..., 1]
    return torch.stack((radius * torch.cos(angle), radius * torch.sin(angle)), dim=-1).flatten(-2).to(torch.float32)


def add_noise_reference(
    x: torch.Tensor,
    *,
    seed: int,
    iteration: int,
    sample_index: torch.Tensor,
    token_position: torch.Tensor,
    noise_scale: torch.Tensor,
    input_scale: torch.Tensor | None = None,
    distribution: AddedDistribution = "uniform",
) -> torch.Tensor:
    """``(x * input_scale + noise_scale * unit).to(x.dtype)`` in float32, per token ``[s, b]`` scales.

    ``x`` is ``[s, b, h]``; ``noise_scale`` and ``input_scale`` are float32 ``[s, b]`` (a zero ``noise_scale``
    leaves the token unnoised). Gradients flow to ``x`` through ``input_scale`` only.
    """
    unit = unit_noise(seed, iteration, sample_index, token_position, x.size(2), distribution)
    base = x.float() if input_scale is None else x.float() * input_scale.unsqueeze(-1)
    return (base + unit * noise_scale.unsqueeze(-1)).to(x.dtype)


def add_noise(
    x: torch.Tensor,
    *,
    seed: int,
    iteration: int,
    sample_index: torch.Tensor,
    token_position: torch.Tensor,
    noise_scale: torch.Tensor,
    input_scale: torch.Tensor | None = None,
    distribution: AddedDistribution = "uniform",
    fused: bool = True,
) -> torch.Tensor:
    """``add_noise_reference``'s result; on CUDA with Triton, from the fused one-pass kernel (same Philox words)
    unless ``fused`` is False (a family the kernel does not draw: ``NoiseFamily.kernel``)."""
    arguments = dict(
        seed=seed,
        iteration=iteration,
        sample_index=sample_index,
        token_position=token_position,
        noise_scale=noise_scale,
        input_scale=input_scale,
        distribution=distribution,
    )
    if fused and x.is_cuda:
        from nemo_noise_plugin.noise.triton_kernel import fused_add_noise, triton_available

        if triton_available():
            return fused_add_noise(x, **arguments)
    return add_noise_reference(x, **arguments)
