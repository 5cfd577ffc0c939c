"""Moved to ``nemo_noise_plugin.noise.calibration``; this alias keeps the old import path working."""

from nemo_noise_plugin.noise.calibration import (  # noqa: F401
    analytic_gaussian_sigma,
    classical_gaussian_sigma,
    gaussian_mechanism_delta,
    gaussian_mechanism_epsilon,
    log_normal_cdf,
)
