"""The SANTEXT-style substitution baseline: its distribution, its limits, its mask, its chunking, its errors."""

import math

import pytest
import torch

from nemo_noise_plugin.privacy.text_substitution import (
    substitute_tokens,
    substitution_probabilities,
    substitution_scale,
)
from nemo_noise_plugin.validation import SettingError


def _table() -> torch.Tensor:
    return torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 2.0], [3.0, 4.0]])  # row 3 has norm 5: clipped to 3


def test_scale_is_eps_over_twice_the_sensitivity_or_half_eta():
    assert substitution_scale(20.0, 3.0) == pytest.approx(20.0 / 12.0)
    assert substitution_scale(30.0, 3.0, "metric") == pytest.approx(15.0)


def test_probabilities_follow_the_exponential_mechanism_on_clipped_rows():
    probabilities = substitution_probabilities(torch.tensor([1]), _table(), epsilon=8.0, clip_norm=3.0)[0]
    rows = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 2.0], [1.8, 2.4]], dtype=torch.float64)
    weights = torch.exp(-(8.0 / 12.0) * (rows - rows[1]).norm(dim=-1))
    torch.testing.assert_close(probabilities, weights / weights.sum())


def test_draws_match_the_probabilities():
    table, draws = _table(), 40_000
    ids = torch.full((draws,), 2)
    released = substitute_tokens(ids, table, torch.ones(draws, dtype=torch.bool), epsilon=6.0, clip_norm=3.0, seed=3)
    expected = substitution_probabilities(torch.tensor([2]), table, epsilon=6.0, clip_norm=3.0)[0]
    observed = torch.bincount(released, minlength=4).double() / draws
    chi_square = float(((observed - expected) ** 2 / expected).sum() * draws)
    assert chi_square < 16.3  # chi-square, 3 degrees of freedom, p = 0.001


def test_pure_guarantee_bounds_every_probability_ratio_by_exp_eps():
    table = torch.randn(50, 8) * 2
    probabilities = substitution_probabilities(torch.arange(50), table, epsilon=2.0, clip_norm=3.0)
    ratios = probabilities.unsqueeze(0) / probabilities.unsqueeze(1)  # [x, x', y]
    assert float(ratios.max()) <= math.exp(2.0) * (1 + 1e-9)


def test_only_masked_positions_change_and_huge_eps_keeps_the_token():
    ids = torch.tensor([[0, 1, 2, 3]])
    mask = torch.tensor([[False, True, True, False]])
    released = substitute_tokens(ids, _table(), mask, epsilon=1e6, clip_norm=3.0)
    assert torch.equal(released, ids)
    noisy = substitute_tokens(ids.repeat(200, 1), _table(), mask.repeat(200, 1), epsilon=1e-6, clip_norm=3.0)
    assert torch.equal(noisy[:, [0, 3]], ids.repeat(200, 1)[:, [0, 3]])
    counts = torch.bincount(noisy[:, 1:3].flatten(), minlength=4).double() / 400
    assert float((counts - 0.25).abs().max()) < 0.08  # eps -> 0: uniform over the vocabulary


def test_chunking_does_not_change_the_draw_distribution_bounds():
    ids, mask = torch.randint(0, 4, (64,)), torch.ones(64, dtype=torch.bool)
    whole = substitute_tokens(ids, _table(), mask, epsilon=1e6, clip_norm=3.0, max_elements=1 << 20)
    chunked = substitute_tokens(ids, _table(), mask, epsilon=1e6, clip_norm=3.0, max_elements=4)
    assert torch.equal(whole, chunked)


def test_bad_settings_are_named():
    with pytest.raises(SettingError, match="epsilon"):
        substitution_scale(0.0, 3.0)
    with pytest.raises(SettingError, match="guarantee"):
        substitution_scale(1.0, 3.0, "approximate")
    with pytest.raises(ValueError, match="shape"):
        substitute_tokens(
            torch.zeros(3, dtype=torch.long), _table(), torch.ones(2, dtype=torch.bool), epsilon=1.0, clip_norm=3.0
        )
