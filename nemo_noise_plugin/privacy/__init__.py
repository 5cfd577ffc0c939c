"""Differential-privacy accounting, the privacy ledger and the token-recovery audit of the noise.

The calibration, (epsilon, delta) into the Gaussian mechanism's sigma, is the noise's own
(``nemo_noise_plugin.noise.calibration``); ``accounting`` composes releases (zCDP, pure DP) and
converts zCDP to (epsilon, delta), with the pure-DP epsilon of metric-DP and Laplace; ``ledger`` states what a
``NoiseConfig`` guarantees per token and per sequence (import it from ``nemo_noise_plugin.privacy.ledger``);
``embedding_distance`` sizes noise from an embedding table's neighbour distances; ``audit`` attacks noised embeddings
(nearest neighbour, the LM-prior beam) and sweeps noise levels. The math is pure Python (``math`` only, no SciPy).
"""

from nemo_noise_plugin.privacy.accounting import (
    compose_pure_dp,
    compose_zcdp,
    gaussian_zcdp_rho,
    laplace_epsilon,
    metric_dp_epsilon,
    zcdp_to_dp_epsilon,
)

__all__ = [
    "compose_pure_dp",
    "compose_zcdp",
    "gaussian_zcdp_rho",
    "laplace_epsilon",
    "metric_dp_epsilon",
    "zcdp_to_dp_epsilon",
]
