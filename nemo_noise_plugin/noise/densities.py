"""The attacker's noise densities: one table of log-likelihoods ``log p(y | e)`` that the family rows point to.

``NoiseFamily.attacker_density`` names a row of ``NOISE_DENSITIES``. The privacy audit's beam attack
(``privacy/audit/search.py``) scores table rows with it, and posterior-mean denoising (``noise/denoise.py``) weighs
them with it, each with the mechanism's own scale (``NoiseFamily.attacker_noise``). Per-query constants are dropped:

- ``gaussian``: ``-|y - e|^2 / (2 s^2)`` (scale: the standard deviation ``s``);
- ``laplace``: ``-|y - e|_1 / b`` (scale: ``b``; per-coordinate standard deviation ``b sqrt(2)``);
- ``metric_dp``: ``-|y - e| / s``, the d_chi density of the metric-DP unit (scale: ``s = 1/eta``).

Every density's normaliser is ``s^-d``, so a scale that differs per row (relative noise: ``s rms(e)``) adds
``-d log rms(e)`` (``log_likelihood(..., row_scale=)``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["NOISE_DENSITIES", "NoiseDensity", "noise_density", "squared_distances"]


def squared_distances(queries: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``[n, v]`` ``|q - r|^2`` from ``|q|^2 - 2 q.r + |r|^2`` (one matrix product), clamped at 0."""
    squared = queries.pow(2).sum(-1, keepdim=True) - 2.0 * queries @ rows.t() + rows.pow(2).sum(-1)
    return squared.clamp_min(0.0)


@dataclass(frozen=True)
class NoiseDensity:
    """One noise density as an attacker scores with it: ``kernel(queries, rows, scale) -> [n, v]`` log p(y | e).

    ``scale`` is a number or a tensor broadcasting to ``[n, v]`` (``[n, 1]`` per query).
    """

    name: str
    kernel: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | float], torch.Tensor]
    unit_std: float | None
    """Per-coordinate standard deviation at scale 1 (a unit of standard deviation ``u`` is this density at scale
    ``u / unit_std``); None: the density of the unit sampler of the same name, whose scale is the unit's."""

    def log_likelihood(
        self,
        queries: torch.Tensor,
        rows: torch.Tensor,
        scale: torch.Tensor | float,
        row_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``[n, v]`` log p(query | row) up to a per-query constant, float32; ``rows`` already clipped.

        ``row_scale`` (``[v]``): each row's noise is ``scale * row_scale`` (relative noise, ``rms(e)``).
        """
        if row_scale is None:
            return self.kernel(queries, rows, scale)
        return self.kernel(queries, rows, scale * row_scale) - rows.size(1) * row_scale.log()


def _gaussian(queries: torch.Tensor, rows: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    return squared_distances(queries, rows) * (-0.5 / scale**2)


def _laplace(queries: torch.Tensor, rows: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    return torch.cdist(queries, rows, p=1.0) * (-1.0 / scale)


def _metric_dp(queries: torch.Tensor, rows: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    return squared_distances(queries, rows).sqrt() * (-1.0 / scale)


NOISE_DENSITIES: dict[str, NoiseDensity] = {
    density.name: density
    for density in (
        NoiseDensity("gaussian", _gaussian, 1.0),
        NoiseDensity("laplace", _laplace, 2.0**0.5),
        NoiseDensity("metric_dp", _metric_dp, None),
    )
}
"""Every attacker density by name."""


def noise_density(name: str) -> NoiseDensity:
    """The row of ``name``; a ``ValueError`` listing the densities otherwise."""
    try:
        return NOISE_DENSITIES[name]
    except (KeyError, TypeError):
        raise ValueError(f"density={name!r} is invalid: expected one of {', '.join(NOISE_DENSITIES)}.") from None
