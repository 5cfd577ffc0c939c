"""``scaling="embedding_distance"``: noise sized as a multiple of the vocabulary's median nearest-neighbour distance."""

from __future__ import annotations

import math

import pytest
import torch

from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.privacy.audit import median_nearest_neighbour_distance, noised_embeddings
from nemo_noise_plugin.privacy.embedding_distance import calibrate_noise_to_embeddings


def table_of(vocab: int, hidden: int, scale: float, seed: int) -> torch.Tensor:
    return scale * torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(seed))


def noise_norms(table: torch.Tensor, config: NoiseConfig) -> torch.Tensor:
    tokens = torch.randint(0, table.size(0), (16, 64), generator=torch.Generator().manual_seed(5))
    return (noised_embeddings(table, tokens, config) - table[tokens]).norm(dim=-1).reshape(-1)


@pytest.mark.parametrize("mechanism", ["uniform", "gaussian"])
@pytest.mark.parametrize("multiple", [0.5, 2.0])
def test_realised_noise_norm_is_the_multiple_of_the_median_neighbour_distance(mechanism, multiple):
    # Two tables whose neighbour distances differ by ~1000x (hidden 48 at scale 0.02, hidden 256 at scale 3).
    for table in (table_of(800, 48, 0.02, 0), table_of(600, 256, 3.0, 1)):
        config = calibrate_noise_to_embeddings(NoiseConfig(mechanism=mechanism, distance_multiple=multiple), table)
        assert config.scaling == "embedding_distance"
        assert config.embedding_distance == pytest.approx(median_nearest_neighbour_distance(table), rel=1e-6)
        target = multiple * config.embedding_distance
        norms = noise_norms(table, config)
        assert float(norms.median()) == pytest.approx(target, rel=0.03)
        assert float(norms.pow(2).mean().sqrt()) == pytest.approx(target, rel=0.02)


def test_alpha_and_sigma_do_not_change_embedding_distance_noise():
    table = table_of(500, 64, 1.0, 2)
    base = calibrate_noise_to_embeddings(NoiseConfig(mechanism="gaussian", distance_multiple=1.0), table)
    louder = NoiseConfig(**{**base.__dict__, "sigma": 50.0})
    assert torch.equal(noise_norms(table, base), noise_norms(table, louder))


def test_zero_multiple_adds_no_noise():
    table = table_of(300, 32, 1.0, 3)
    config = calibrate_noise_to_embeddings(NoiseConfig(distance_multiple=0.0), table)
    assert not config.is_active_configuration
    assert float(noise_norms(table, config).max()) == 0.0


def test_missing_distance_is_a_clear_error_when_noise_is_added():
    config = NoiseConfig(scaling="embedding_distance")  # valid until used: calibrated later from the model
    with pytest.raises(ValueError, match=r"embedding_distance=None .*calibrate_noise_to_embeddings"):
        noise_norms(table_of(100, 16, 1.0, 4), config)


@pytest.mark.parametrize(
    "fields,message",
    [
        (dict(distance_multiple=-1.0), r"NoiseConfig.distance_multiple=-1.0 is invalid: expected a finite number >= 0"),
        (dict(distance_multiple=math.inf), r"NoiseConfig.distance_multiple=inf"),
        (dict(embedding_distance=0.0), r"NoiseConfig.embedding_distance=0.0 is invalid: expected a finite number > 0"),
        (dict(embedding_distance="far"), r"NoiseConfig.embedding_distance='far'"),
        (
            dict(scaling="embedding_distance", mechanism="metric_dp"),
            r"scaling='embedding_distance' is invalid with mechanism='metric_dp': expected mechanism in uniform",
        ),
    ],
)
def test_invalid_embedding_distance_settings_are_named(fields, message):
    with pytest.raises(ValueError, match=message):
        NoiseConfig(**fields)


def test_calibration_rejects_other_mechanisms_and_duplicate_tables():
    with pytest.raises(ValueError, match="mechanism='relative' is invalid for calibrate_noise_to_embeddings"):
        calibrate_noise_to_embeddings(NoiseConfig(mechanism="relative"), table_of(10, 4, 1.0, 0))
    with pytest.raises(ValueError, match="median nearest-neighbour distance is 0.0"):
        calibrate_noise_to_embeddings(NoiseConfig(), torch.ones(10, 4))
