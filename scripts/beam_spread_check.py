#!/usr/bin/env python3
"""The beam attack's assumed noise spread against the drawn noise's, under ``embedding_distance`` scaling.

The check of ``tests/privacy/test_privacy_audit_noise_model.py`` written against the API that both the current tree
and ``62da161`` (where issue 24 found the drift) have: ``noised_embeddings`` draws the noise with the plugin's layer,
and the beam's ``Scoring`` (``beam.noise_likelihood``, ``_noise_likelihood`` at 62da161) gives the per-token spread
the attacker assumes. For uniform and Gaussian noise at ``embedding_distance`` scaling it prints the per-coordinate
standard deviation of each, their ratio, and exits 1 when a ratio is outside ``1 +- 0.08``.

    PYTHONPATH=<tree> .venv/bin/python scripts/beam_spread_check.py
"""

from __future__ import annotations

import dataclasses
import math
import sys

import torch

from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.privacy.audit import beam
from nemo_noise_plugin.privacy.audit.noised import noised_embeddings

VOCAB, SEQ, HIDDEN, EMBEDDING_DISTANCE, DISTANCE_MULTIPLE, TOLERANCE = 300, 96, 128, 0.8, 1.7, 0.08


def assumed_spread(config: NoiseConfig, noised: torch.Tensor, padding_mask: torch.Tensor) -> float:
    """The mean per-coordinate noise std the beam attack's likelihood assumes for ``noised``'s real tokens."""
    likelihood = getattr(beam, "noise_likelihood", None) or beam._noise_likelihood
    scoring = likelihood(config, noised, 0, None, padding_mask)
    scale = scoring.scale.reshape(noised.shape[:2])
    return float(scale[~padding_mask].mean())


def main() -> int:
    generator = torch.Generator().manual_seed(0)
    table = torch.randn(VOCAB, HIDDEN, generator=generator) * (2.0 / math.sqrt(HIDDEN))
    token_ids = torch.randint(0, VOCAB, (4, SEQ), generator=generator)
    padding_mask = torch.zeros(4, SEQ, dtype=torch.bool)
    failed = False
    for mechanism in ("uniform", "gaussian"):
        config = dataclasses.replace(
            NoiseConfig(mechanism=mechanism, seed=5),
            scaling="embedding_distance",
            embedding_distance=EMBEDDING_DISTANCE,
            distance_multiple=DISTANCE_MULTIPLE,
        )
        noised = noised_embeddings(table, token_ids, config, padding_mask=padding_mask)
        drawn = float((noised - table[token_ids]).std())
        assumed = assumed_spread(config, noised, padding_mask)
        ratio = assumed / drawn
        ok = abs(ratio - 1.0) <= TOLERANCE
        failed |= not ok
        print(
            f"{mechanism:9s} embedding_distance: drawn std {drawn:.4f}, beam assumes {assumed:.4f}, "
            f"ratio {ratio:.3f} {'ok' if ok else 'WRONG'}"
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
