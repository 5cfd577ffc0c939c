"""Gaussian-mechanism calibration and privacy accounting: the formulas, checked against numbers and references."""

from __future__ import annotations

import math

import numpy as np
import pytest

from nemo_noise_plugin.noise.calibration import (
    analytic_gaussian_sigma,
    classical_gaussian_sigma,
    gaussian_mechanism_delta,
    gaussian_mechanism_epsilon,
    log_normal_cdf,
)
from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.privacy.accounting import (
    compose_pure_dp,
    compose_zcdp,
    gaussian_zcdp_rho,
    laplace_epsilon,
    metric_dp_epsilon,
    zcdp_to_dp_epsilon,
)

TARGETS = [(1.0, 1e-5, 1.0), (0.5, 1e-5, 1.0), (8.0, 1e-5, 2.0), (0.1, 1e-6, 1.0), (2.0, 1e-10, 1.0), (50.0, 1e-5, 2.0)]


def _delta_with_scipy(sigma: float, epsilon: float, sensitivity: float) -> float:
    """The textbook formula with SciPy's normal CDF (fine where exp(epsilon) does not overflow)."""
    norm = pytest.importorskip("scipy.stats").norm
    a, b = sensitivity / (2 * sigma), epsilon * sigma / sensitivity
    return norm.cdf(a - b) - math.exp(epsilon) * norm.cdf(-a - b)


def test_classical_sigma_is_dwork_roth_theorem_a1():
    # 2 * sqrt(2 ln(1.25 / 1e-5)) / 0.5, ln(125000) = 11.736069016284437
    assert classical_gaussian_sigma(0.5, 1e-5, 2.0) == pytest.approx(19.379221050421556, rel=1e-12)


@pytest.mark.parametrize("epsilon", [1.0, 2.0, 0.0, -0.5])
def test_classical_sigma_rejects_epsilon_outside_zero_one_naming_it(epsilon):
    expected = r"expected a finite number in \(0, 1\) \(Dwork & Roth"
    with pytest.raises(ValueError, match=rf"epsilon={epsilon!r} is invalid: {expected}"):
        classical_gaussian_sigma(epsilon, 1e-5, 1.0)


@pytest.mark.parametrize(
    ("function", "arguments", "message"),
    [
        (analytic_gaussian_sigma, (1.0, 0.0, 1.0), r"delta=0.0 is invalid: expected a finite number in \(0, 1\)"),
        (analytic_gaussian_sigma, (1.0, 1.5, 1.0), r"delta=1.5 is invalid"),
        (analytic_gaussian_sigma, (0.0, 1e-5, 1.0), r"epsilon=0.0 is invalid: expected a finite number > 0"),
        (analytic_gaussian_sigma, (1.0, 1e-5, -2.0), r"sensitivity=-2.0 is invalid"),
        (classical_gaussian_sigma, (0.5, 1e-5, math.inf), r"sensitivity=inf is invalid"),
        (gaussian_mechanism_delta, (0.0, 1.0, 1.0), r"sigma=0.0 is invalid"),
    ],
)
def test_calibration_errors_name_the_argument_and_the_allowed_range(function, arguments, message):
    with pytest.raises(ValueError, match=message):
        function(*arguments)


@pytest.mark.parametrize(("epsilon", "delta", "sensitivity"), TARGETS)
def test_analytic_sigma_meets_delta_exactly(epsilon, delta, sensitivity):
    sigma = analytic_gaussian_sigma(epsilon, delta, sensitivity)
    assert gaussian_mechanism_delta(sigma, epsilon, sensitivity) == pytest.approx(delta, rel=1e-9)
    assert gaussian_mechanism_delta(sigma, epsilon, sensitivity) <= delta
    assert gaussian_mechanism_delta(sigma * (1 - 1e-6), epsilon, sensitivity) > delta


@pytest.mark.parametrize(("epsilon", "delta"), [(0.01, 1e-5), (0.1, 1e-6), (0.5, 1e-5), (0.9, 1e-3)])
def test_analytic_sigma_is_smaller_than_classical_below_epsilon_one(epsilon, delta):
    assert analytic_gaussian_sigma(epsilon, delta, 1.0) < classical_gaussian_sigma(epsilon, delta, 1.0)


@pytest.mark.parametrize(
    ("epsilon", "delta", "sensitivity", "reference"),
    [(1.0, 1e-5, 1.0, 3.730631634944469), (0.5, 1e-5, 1.0, 7.031826674729583), (8.0, 1e-5, 2.0, 1.200458145167056)],
)
def test_analytic_sigma_matches_balle_wang_reference_implementation(epsilon, delta, sensitivity, reference):
    # Values of calibrateAnalyticGaussianMechanism (Balle & Wang's published code, tol=1e-12 on delta).
    assert analytic_gaussian_sigma(epsilon, delta, sensitivity) == pytest.approx(reference, rel=1e-8)


def test_analytic_sigma_scales_linearly_with_sensitivity():
    assert analytic_gaussian_sigma(2.0, 1e-6, 6.0) == pytest.approx(6.0 * analytic_gaussian_sigma(2.0, 1e-6, 1.0))


def test_delta_decreases_in_sigma_and_in_epsilon():
    sigmas = np.geomspace(0.2, 20.0, 200)  # delta from 0.98 down to 1e-91
    deltas = [gaussian_mechanism_delta(float(s), 1.0, 1.0) for s in sigmas]
    assert all(later < earlier for earlier, later in zip(deltas, deltas[1:], strict=False))
    by_epsilon = [gaussian_mechanism_delta(2.0, e, 1.0) for e in (0.0, 0.5, 1.0, 4.0)]
    assert all(later < earlier for earlier, later in zip(by_epsilon, by_epsilon[1:], strict=False))
    phi_quarter = 0.5987063256829237  # Phi(1/4): at epsilon = 0, delta = Phi(a) - Phi(-a) with a = D / (2 sigma)
    assert gaussian_mechanism_delta(2.0, 0.0, 1.0) == pytest.approx(2 * phi_quarter - 1, rel=1e-12)


@pytest.mark.parametrize(("sigma", "epsilon", "sensitivity"), [(1.0, 1.0, 1.0), (3.0, 0.5, 2.0), (0.4, 4.0, 1.0)])
def test_delta_matches_the_textbook_formula(sigma, epsilon, sensitivity):
    expected = _delta_with_scipy(sigma, epsilon, sensitivity)
    assert gaussian_mechanism_delta(sigma, epsilon, sensitivity) == pytest.approx(expected, rel=1e-10)


def test_delta_stays_accurate_where_exp_epsilon_overflows():
    mpmath = pytest.importorskip("mpmath")
    mpmath.mp.dps = 60
    sigma, epsilon, sensitivity = 0.0575, 800.0, 2.0
    a, b = mpmath.mpf(sensitivity) / (2 * mpmath.mpf(sigma)), mpmath.mpf(epsilon) * mpmath.mpf(sigma) / sensitivity
    expected = mpmath.ncdf(a - b) - mpmath.exp(mpmath.mpf(epsilon)) * mpmath.ncdf(-a - b)
    assert gaussian_mechanism_delta(sigma, epsilon, sensitivity) == pytest.approx(float(expected), rel=1e-9)


@pytest.mark.parametrize("x", [-200.0, -40.0, -37.5, -20.0, -1.0, 0.0, 3.0, 40.0])
def test_log_normal_cdf_is_accurate_in_both_tails(x):
    mpmath = pytest.importorskip("mpmath")
    mpmath.mp.dps = 60
    assert log_normal_cdf(x) == pytest.approx(float(mpmath.log(mpmath.ncdf(x))), rel=1e-13, abs=1e-300)


@pytest.mark.parametrize(("epsilon", "delta", "sensitivity"), TARGETS)
def test_epsilon_of_the_analytic_sigma_is_the_target_epsilon(epsilon, delta, sensitivity):
    sigma = analytic_gaussian_sigma(epsilon, delta, sensitivity)
    assert gaussian_mechanism_epsilon(sigma, delta, sensitivity) == pytest.approx(epsilon, rel=1e-9)


def test_zcdp_rho_of_a_gaussian_release():
    assert gaussian_zcdp_rho(2.0, 2.0) == 0.5
    assert gaussian_zcdp_rho(1.2004581443979037, 2.0) == pytest.approx(1.3878289764790792, rel=1e-12)


def test_a_subnormal_clip_norm_gives_the_levels_rho_not_a_division_by_zero():
    """``nemo noise ledger ... clip_norm=5e-324`` (issue 36 finding 7): sigma scales with C, and so does D = 2C."""
    from nemo_noise_plugin.privacy.ledger import privacy_ledger

    assert gaussian_zcdp_rho(1e-323, 2e-323) == pytest.approx(2.0, rel=0.5)  # subnormals carry ~1 digit
    tiny = privacy_ledger(NoiseConfig(mechanism="gaussian_mechanism", epsilon=4.0, clip_norm=5e-324), sequence_length=8)
    normal = privacy_ledger(NoiseConfig(mechanism="gaussian_mechanism", epsilon=4.0, clip_norm=1.0), sequence_length=8)
    assert tiny.per_token[0].epsilon == pytest.approx(normal.per_token[0].epsilon, rel=1e-6)


def test_composition_adds_rho_and_pure_epsilon():
    assert compose_zcdp([0.25, 0.5, 1.0]) == 1.75
    assert compose_pure_dp([200.0] * 3) == 600.0
    with pytest.raises(ValueError, match=r"compose_zcdp: rho=-1.0 is invalid"):
        compose_zcdp([0.5, -1.0])


def test_metric_dp_epsilon_is_eta_times_twice_the_clip():
    assert metric_dp_epsilon(100.0, 1.0) == 200.0
    assert metric_dp_epsilon(2.5, 0.2) == pytest.approx(1.0)
    with pytest.raises(ValueError, match=r"clip_norm=0.0 is invalid"):
        metric_dp_epsilon(1.0, 0.0)


def test_laplace_epsilon_is_the_l1_diameter_of_the_clip_ball_over_b():
    assert laplace_epsilon(0.5, 1.0, 4096) == 256.0  # 2 * 1 * sqrt(4096) / 0.5
    assert laplace_epsilon(2.0, 3.0, 9) == pytest.approx(9.0)
    with pytest.raises(ValueError, match=r"laplace_epsilon: scale=0.0 is invalid"):
        laplace_epsilon(0.0, 1.0, 4)
    with pytest.raises(ValueError, match=r"laplace_epsilon: hidden_size=0 is invalid"):
        laplace_epsilon(1.0, 1.0, 0)


def test_laplace_epsilon_bounds_the_privacy_loss_of_clipped_pairs_and_is_attained():
    """The log density ratio of per-coordinate Laplace noise on two clipped embeddings never exceeds epsilon, and
    reaches it for the antipodal pair ``+-C (1, ..., 1) / sqrt(d)`` at outputs beyond both."""
    d, clip, b = 16, 1.5, 0.7
    epsilon = laplace_epsilon(b, clip, d)
    rng = np.random.default_rng(0)

    def clipped(points):
        norms = np.linalg.norm(points, axis=-1, keepdims=True)
        return points * np.minimum(1.0, clip / norms)

    def privacy_loss(y, x, x_other):  # log p(y | x) - log p(y | x') for Laplace(0, b)^d
        return (np.abs(y - x_other).sum(-1) - np.abs(y - x).sum(-1)) / b

    x, x_other = clipped(rng.normal(size=(4000, d)) * 3), clipped(rng.normal(size=(4000, d)) * 3)
    y = x + rng.laplace(scale=b, size=(4000, d))
    assert privacy_loss(y, x, x_other).max() <= epsilon * (1 + 1e-12)
    corner = np.full(d, clip / math.sqrt(d))
    beyond = corner + 1.0  # every coordinate beyond both +corner and -corner
    assert privacy_loss(beyond, corner, -corner) == pytest.approx(epsilon, rel=1e-12)
    assert np.linalg.norm(corner) == pytest.approx(clip)  # the pair is inside the clip ball


def test_bun_steinke_conversion_value():
    # rho + 2 sqrt(rho ln(1/delta)) with rho = 1, ln(1e5) = 11.512925464970229
    assert zcdp_to_dp_epsilon(1.0, 1e-5, "bun_steinke") == pytest.approx(7.786140424415112, rel=1e-12)


@pytest.mark.parametrize("rho", [1e-6, 1e-3, 0.1, 1.0, 10.0, 2131.7, 1e6])
@pytest.mark.parametrize("delta", [1e-10, 1e-5, 1e-2])
def test_optimal_conversion_is_the_grid_minimum_and_beats_bun_steinke(rho, delta):
    alpha = 1.0 + np.logspace(-9, 12, 1_000_001)
    bound = alpha * rho + (np.log(1 / delta) + (alpha - 1) * np.log1p(-1 / alpha) - np.log(alpha)) / (alpha - 1)
    grid_minimum = max(float(bound.min()), 0.0)
    optimal = zcdp_to_dp_epsilon(rho, delta, "optimal")
    assert optimal == pytest.approx(grid_minimum, rel=1e-8, abs=1e-12)
    assert optimal <= grid_minimum + 1e-12 * max(1.0, grid_minimum)
    assert optimal < zcdp_to_dp_epsilon(rho, delta, "bun_steinke")


def test_optimal_conversion_known_value():
    assert zcdp_to_dp_epsilon(1.0, 1e-5) == pytest.approx(7.0771966958, rel=1e-9)


def test_exact_gaussian_epsilon_is_below_the_zcdp_conversion():
    sigma, sensitivity, delta = 1.0, 1.0, 1e-5
    rho = gaussian_zcdp_rho(sigma, sensitivity)
    assert gaussian_mechanism_epsilon(sigma, delta, sensitivity) < zcdp_to_dp_epsilon(rho, delta)


def test_conversion_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"method='rdp' is invalid: expected one of optimal, bun_steinke"):
        zcdp_to_dp_epsilon(1.0, 1e-5, "rdp")
    with pytest.raises(ValueError, match=r"delta=1.0 is invalid: expected a finite number in \(0, 1\)"):
        zcdp_to_dp_epsilon(1.0, 1.0)
    with pytest.raises(ValueError, match=r"rho=-0.1 is invalid"):
        zcdp_to_dp_epsilon(-0.1, 1e-5)
