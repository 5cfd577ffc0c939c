"""Gaussian-mechanism calibration: the noise standard deviation that makes one release (epsilon, delta)-DP.

``NoiseConfig.dp_sigma`` calls these for ``mechanism='gaussian_mechanism'``, and the privacy ledger uses
``gaussian_mechanism_delta`` / ``gaussian_mechanism_epsilon`` to state what a composed Gaussian release guarantees.
Pure Python and ``math`` only: no SciPy at run time.

The Gaussian mechanism ``M(x) = f(x) + N(0, sigma^2 I)`` with L2 sensitivity ``D = sup |f(x) - f(x')|`` is
(epsilon, delta)-DP exactly when (Balle & Wang, ICML 2018, Theorem 8)::

    delta >= Phi(D / (2 sigma) - epsilon sigma / D) - exp(epsilon) * Phi(-D / (2 sigma) - epsilon sigma / D)
"""

from __future__ import annotations

import math

from nemo_noise_plugin.validation import check_number

_SQRT2 = math.sqrt(2.0)
_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)
_ASYMPTOTIC_BELOW = -37.0
"""Below this, ``erfc`` underflows; ``log Phi`` uses its asymptotic series, which is exact to double precision there."""


def classical_gaussian_sigma(epsilon: float, delta: float, sensitivity: float) -> float:
    """The classical calibration ``sigma = D * sqrt(2 ln(1.25 / delta)) / epsilon`` (Dwork & Roth, Theorem A.1).

    The theorem holds only for ``0 < epsilon < 1``; ``analytic_gaussian_sigma`` is exact and valid for any epsilon.
    """
    check_open(
        "classical_gaussian_sigma",
        "epsilon",
        epsilon,
        0.0,
        1.0,
        why=" (Dwork & Roth, Theorem A.1); use analytic_gaussian_sigma for epsilon >= 1",
    )
    check_open("classical_gaussian_sigma", "delta", delta, 0.0, 1.0)
    check_positive("classical_gaussian_sigma", "sensitivity", sensitivity)
    return sensitivity * math.sqrt(2.0 * math.log(1.25 / delta)) / epsilon


def analytic_gaussian_sigma(epsilon: float, delta: float, sensitivity: float) -> float:
    """The smallest sigma whose Gaussian mechanism is (epsilon, delta)-DP: Balle & Wang's analytic calibration.

    Algorithm 1 of Balle & Wang (ICML 2018) solves ``gaussian_mechanism_delta(sigma) = delta``; this bisects the
    same exact, decreasing function of sigma (in log sigma, to a relative width of 1e-15) and returns the upper end
    of the final bracket, so ``gaussian_mechanism_delta(result) <= delta`` always holds.
    """
    check_positive("analytic_gaussian_sigma", "epsilon", epsilon)
    check_open("analytic_gaussian_sigma", "delta", delta, 0.0, 1.0)
    check_positive("analytic_gaussian_sigma", "sensitivity", sensitivity)
    return _smallest_satisfying(
        lambda sigma: _log_gaussian_delta(sigma, epsilon, sensitivity) <= math.log(delta),
        start=sensitivity * math.sqrt(2.0 * math.log(1.25 / delta)) / epsilon,
    )


def gaussian_mechanism_delta(sigma: float, epsilon: float, sensitivity: float) -> float:
    """The exact delta of the Gaussian mechanism with noise ``sigma`` and L2 sensitivity ``D`` at ``epsilon``.

    ``Phi(D/(2s) - e*s/D) - exp(e) * Phi(-D/(2s) - e*s/D)``, evaluated in log space so that neither ``exp(e)`` nor
    the Gaussian tails overflow or underflow; decreasing in sigma and in epsilon.
    """
    check_positive("gaussian_mechanism_delta", "sigma", sigma)
    check_non_negative("gaussian_mechanism_delta", "epsilon", epsilon)
    check_positive("gaussian_mechanism_delta", "sensitivity", sensitivity)
    return math.exp(_log_gaussian_delta(sigma, epsilon, sensitivity))


def gaussian_mechanism_epsilon(sigma: float, delta: float, sensitivity: float) -> float:
    """The smallest epsilon at which the Gaussian mechanism (noise ``sigma``, sensitivity ``D``) is (epsilon, delta)-DP.

    The inverse of ``gaussian_mechanism_delta`` in epsilon (bisection to a relative width of 1e-15, upper end
    returned); 0 when the mechanism is already (0, delta)-DP.
    """
    check_positive("gaussian_mechanism_epsilon", "sigma", sigma)
    check_open("gaussian_mechanism_epsilon", "delta", delta, 0.0, 1.0)
    check_positive("gaussian_mechanism_epsilon", "sensitivity", sensitivity)
    if _log_gaussian_delta(sigma, 0.0, sensitivity) <= math.log(delta):
        return 0.0
    mu = sensitivity / sigma
    return _smallest_satisfying(
        lambda epsilon: _log_gaussian_delta(sigma, epsilon, sensitivity) <= math.log(delta),
        start=mu * mu / 2.0 + mu * math.sqrt(2.0 * math.log(1.0 / delta)),
    )


def log_normal_cdf(x: float) -> float:
    """``log Phi(x)`` of the standard normal CDF, accurate in relative terms for every finite x."""
    if x < _ASYMPTOTIC_BELOW:
        # Phi(x) = phi(x) / |x| * (1 - 1/x^2 + 3/x^4 - 15/x^6 + ...); the terms fall by (2k+1)/x^2 < 1/60 each.
        inverse_square = 1.0 / (x * x)
        term, series = 1.0, 1.0
        for k in range(1, 12):
            term *= -(2 * k - 1) * inverse_square
            series += term
        return -0.5 * x * x - math.log(-x) - _LOG_SQRT_2PI + math.log(series)
    if x < 0.0:
        return math.log(0.5 * math.erfc(-x / _SQRT2))
    return math.log1p(-0.5 * math.erfc(x / _SQRT2))


def _log_gaussian_delta(sigma: float, epsilon: float, sensitivity: float) -> float:
    """``log`` of the exact delta: ``log T1 + log(1 - T2/T1)`` with ``T2/T1`` formed from logs (always < 1)."""
    a = sensitivity / (2.0 * sigma)
    b = epsilon * sigma / sensitivity
    log_first = log_normal_cdf(a - b)
    log_second = epsilon + log_normal_cdf(-a - b)
    ratio = log_second - log_first
    if ratio >= 0.0:  # only reachable by rounding when delta is far below double precision
        return -math.inf
    return log_first + math.log(-math.expm1(ratio))


def _smallest_satisfying(holds, *, start: float) -> float:
    """Smallest positive x with ``holds(x)`` for a predicate that is False below a threshold and True above it."""
    low, high = start, start
    while holds(low):
        low /= 2.0
        if low < 1e-300:
            return low
    while not holds(high):
        high *= 2.0
        if high > 1e300:
            raise ArithmeticError("no finite value satisfies the privacy target")
    while high - low > 1e-15 * high:
        middle = math.sqrt(low * high) if high / low > 4.0 else 0.5 * (low + high)
        if middle <= low or middle >= high:
            break
        if holds(middle):
            high = middle
        else:
            low = middle
    return high


def check_positive(function: str, name: str, value: float) -> None:
    """``SettingError`` unless the argument ``name`` of ``function`` is a finite number > 0."""
    check_number(f"{function}: {name}", value, minimum=0.0, inclusive=False)


def check_non_negative(function: str, name: str, value: float) -> None:
    """``SettingError`` unless the argument ``name`` of ``function`` is a finite number >= 0."""
    check_number(f"{function}: {name}", value, minimum=0.0)


def check_open(function: str, name: str, value: float, low: float, high: float, *, why: str = "") -> None:
    """``SettingError`` unless the argument ``name`` of ``function`` is a finite number in ``(low, high)``."""
    check_number(f"{function}: {name}", value, minimum=low, maximum=high, inclusive=False, why=why)
