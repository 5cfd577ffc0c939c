"""Privacy accounting: what many noised releases guarantee together, for the privacy ledger.

Two currencies, each with additive composition:

- zero-concentrated DP (zCDP, Bun & Steinke 2016) for the Gaussian mechanism: ``rho = D^2 / (2 sigma^2)`` per
  release, rhos add up, and ``zcdp_to_dp_epsilon`` converts the total to (epsilon, delta)-DP;
- pure epsilon-DP for metric DP (d_chi privacy): noise with density ``~ exp(-eta |z|)`` on inputs at distance at
  most ``2C`` (embeddings clipped to norm ``C``) is ``eta * 2C``-DP, and for the Laplace mechanism: per-coordinate
  ``Laplace(0, b)`` noise on inputs at L1 distance at most ``2C sqrt(d)`` (the L1 diameter of the L2 ball of radius
  ``C`` in ``d`` dimensions) is ``2C sqrt(d) / b``-DP; epsilons add up.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Literal

from nemo_noise_plugin.noise.calibration import check_non_negative, check_open, check_positive
from nemo_noise_plugin.validation import check_choice, check_int

ConversionMethod = Literal["optimal", "bun_steinke"]
CONVERSION_METHODS: tuple[str, ...] = ("optimal", "bun_steinke")

_GRID_POINTS = 2001
_LOG_ORDER_RANGE = (-40.0, 60.0)
"""Search range of ``log(alpha - 1)`` for the optimal conversion: alpha - 1 from about 4e-18 to 1e26."""


def gaussian_zcdp_rho(sigma: float, sensitivity: float) -> float:
    """zCDP of one Gaussian release with noise ``sigma`` and L2 sensitivity ``D``: ``rho = D^2 / (2 sigma^2)``.

    Computed as ``(D / sigma)^2 / 2``: the ratio is what a calibrated level fixes, so a subnormal clip norm (and with
    it a subnormal sigma, whose square is 0.0) gives the level's rho, not a division by zero.
    """
    check_positive("gaussian_zcdp_rho", "sigma", sigma)
    check_non_negative("gaussian_zcdp_rho", "sensitivity", sensitivity)
    return (sensitivity / sigma) ** 2 / 2.0


def compose_zcdp(rhos: Iterable[float]) -> float:
    """zCDP of releases with independent noise, adaptively composed: the sum of their rhos."""
    return _sum_non_negative("compose_zcdp", "rho", rhos)


def compose_pure_dp(epsilons: Iterable[float]) -> float:
    """Pure epsilon-DP of releases with independent noise, adaptively composed: the sum of their epsilons."""
    return _sum_non_negative("compose_pure_dp", "epsilon", epsilons)


def metric_dp_epsilon(eta: float, clip_norm: float) -> float:
    """Pure epsilon of one metric-DP (d_chi) release on embeddings clipped to norm ``C``: ``eta * 2C``."""
    check_positive("metric_dp_epsilon", "eta", eta)
    check_positive("metric_dp_epsilon", "clip_norm", clip_norm)
    return eta * 2.0 * clip_norm


def laplace_epsilon(scale: float, clip_norm: float, hidden_size: int) -> float:
    """Pure epsilon of one per-coordinate Laplace release (scale ``b``) on embeddings clipped to L2 norm ``C``.

    The Laplace mechanism is ``Delta_1 / b``-DP for L1 sensitivity ``Delta_1`` (Dwork & Roth, Theorem 3.6). Two
    embeddings in the L2 ball of radius ``C`` in ``d`` dimensions are at most ``2C sqrt(d)`` apart in L1 (attained by
    ``x = C (1, ..., 1) / sqrt(d)`` and ``-x``), so ``epsilon = 2 C sqrt(d) / b``.
    """
    check_positive("laplace_epsilon", "scale", scale)
    check_positive("laplace_epsilon", "clip_norm", clip_norm)
    check_int("laplace_epsilon: hidden_size", hidden_size, minimum=1)
    return 2.0 * clip_norm * math.sqrt(hidden_size) / scale


def zcdp_to_dp_epsilon(rho: float, delta: float, method: ConversionMethod = "optimal") -> float:
    """The epsilon at which a rho-zCDP mechanism is (epsilon, delta)-DP.

    - ``bun_steinke`` (Bun & Steinke 2016, Proposition 1.3): ``rho + 2 sqrt(rho ln(1/delta))``;
    - ``optimal`` (Canonne, Kamath & Steinke 2020, Proposition 12 / Corollary 13), never larger:
      ``min over alpha > 1 of alpha rho + (ln(1/delta) + (alpha - 1) ln(1 - 1/alpha) - ln(alpha)) / (alpha - 1)``,
      minimised numerically over ``log(alpha - 1)`` (a grid, then golden-section search), clamped at 0.
    """
    check_choice("zcdp_to_dp_epsilon: method", method, CONVERSION_METHODS)
    check_non_negative("zcdp_to_dp_epsilon", "rho", rho)
    check_open("zcdp_to_dp_epsilon", "delta", delta, 0.0, 1.0)
    if rho == 0.0:
        return 0.0
    log_inverse_delta = -math.log(delta)
    if method == "bun_steinke":
        return rho + 2.0 * math.sqrt(rho * log_inverse_delta)
    return max(0.0, _minimise(lambda t: _cks_epsilon(rho, log_inverse_delta, math.exp(t))))


def _cks_epsilon(rho: float, log_inverse_delta: float, u: float) -> float:
    """The Canonne-Kamath-Steinke bound at Renyi order ``alpha = 1 + u``.

    Taking ``u = alpha - 1`` (not alpha) keeps ``ln(1 - 1/alpha) = ln(alpha - 1) - ln(alpha)`` accurate near 1.
    """
    log_alpha = math.log1p(u)
    log_one_minus_inverse_alpha = math.log(u) - log_alpha
    return (1.0 + u) * rho + (log_inverse_delta - log_alpha) / u + log_one_minus_inverse_alpha


def _minimise(function) -> float:
    """Minimum of a unimodal function of one variable on ``_LOG_ORDER_RANGE``: grid, then golden section."""
    low, high = _LOG_ORDER_RANGE
    step = (high - low) / (_GRID_POINTS - 1)
    values = [function(low + i * step) for i in range(_GRID_POINTS)]
    best = min(range(_GRID_POINTS), key=values.__getitem__)
    a, b = low + max(best - 1, 0) * step, low + min(best + 1, _GRID_POINTS - 1) * step
    inverse_golden = (math.sqrt(5.0) - 1.0) / 2.0
    c, d = b - inverse_golden * (b - a), a + inverse_golden * (b - a)
    fc, fd = function(c), function(d)
    for _ in range(200):
        if b - a < 1e-13:
            break
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - inverse_golden * (b - a)
            fc = function(c)
        else:
            a, c, fc = c, d, fd
            d = a + inverse_golden * (b - a)
            fd = function(d)
    return min(values[best], fc, fd)


def _sum_non_negative(function: str, name: str, values: Iterable[float]) -> float:
    total = 0.0
    for value in values:
        check_non_negative(function, name, value)
        total += value
    return total
