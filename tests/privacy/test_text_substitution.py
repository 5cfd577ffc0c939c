"""The SANTEXT-style substitution baseline: the exponential mechanism's probabilities, its limits, which positions
change, chunking, and bad input."""

from __future__ import annotations

import math

import pytest
import torch

from nemo_noise_plugin.privacy.text_substitution import (
    substitute_tokens,
    substitution_probabilities,
    substitution_sensitivity,
)
from nemo_noise_plugin.validation import SettingError

TABLE = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 2.0], [3.0, 4.0]])
"""Four rows; row 3 has norm 5, so the unclipped Delta is 10."""


def _expected(x: int, eps: float, delta: float, table=TABLE) -> list[float]:
    """P(y | x) written out: exp(-eps d / (2 Delta)) normalised, with d the Euclidean distance."""
    weights = [math.exp(-eps * math.dist(table[x].tolist(), row.tolist()) / (2 * delta)) for row in table]
    return [w / sum(weights) for w in weights]


def test_the_probabilities_are_the_exponential_mechanism_on_euclidean_distance():
    assert substitution_sensitivity(TABLE) == 10.0
    probabilities = substitution_probabilities(TABLE, torch.tensor([0, 3]), eps=8.0)
    for row, x in enumerate((0, 3)):
        assert probabilities[row].tolist() == pytest.approx(_expected(x, 8.0, 10.0), abs=1e-12)


def test_clipping_scales_rows_to_the_clip_norm_and_sets_delta_to_twice_it():
    clipped = torch.tensor(
        [[0.0, 0.0], [1.0, 0.0], [0.0, 1.5], [0.9, 1.2]], dtype=torch.float64
    )  # rows 2 and 3 clipped to norm 1.5
    assert substitution_sensitivity(TABLE, clip_norm=1.5) == 3.0
    probabilities = substitution_probabilities(TABLE, torch.tensor([1]), eps=5.0, clip_norm=1.5)
    assert probabilities[0].tolist() == pytest.approx(_expected(1, 5.0, 3.0, clipped), abs=1e-12)


def test_the_sampled_frequencies_match_the_formula_by_a_chi_square_test():
    draws = 40_000
    ids = torch.full((draws,), 1)
    out = substitute_tokens(TABLE, ids, torch.ones(draws, dtype=torch.bool), eps=12.0, seed=7)
    counts = torch.bincount(out, minlength=4).tolist()
    expected = [p * draws for p in _expected(1, 12.0, 10.0)]
    chi_square = sum((c - e) ** 2 / e for c, e in zip(counts, expected, strict=True))
    assert chi_square < 16.27, (counts, expected)  # 3 degrees of freedom, p = 0.001
    assert counts[1] / draws == pytest.approx(expected[1] / draws, abs=0.01)  # the largest cell, ~0.33


def test_the_privacy_ratio_is_bounded_by_e_to_the_eps():
    eps = 3.0
    probabilities = substitution_probabilities(TABLE, torch.arange(4), eps=eps)
    ratio = (probabilities[:, None, :] / probabilities[None, :, :]).max()
    assert 1.5 < float(ratio) <= math.exp(eps) + 1e-9


def test_infinite_eps_returns_the_input_and_a_huge_one_the_nearest_row_itself():
    ids = torch.tensor([[3, 2, 1, 0]])
    mask = torch.ones_like(ids, dtype=torch.bool)
    assert torch.equal(substitute_tokens(TABLE, ids, mask, eps=math.inf, seed=0), ids)
    assert torch.equal(substitute_tokens(TABLE, ids, mask, eps=1e6, seed=0), ids)


def test_zero_eps_samples_uniformly_over_the_vocabulary():
    draws = 20_000
    out = substitute_tokens(
        TABLE, torch.zeros(draws, dtype=torch.long), torch.ones(draws, dtype=torch.bool), 0.0, seed=3
    )
    frequencies = (torch.bincount(out, minlength=4).double() / draws).tolist()
    assert frequencies == pytest.approx([0.25] * 4, abs=0.015)


def test_only_protected_positions_change_and_dtype_shape_device_are_kept():
    ids = torch.tensor([[0, 1, 2, 3], [3, 2, 1, 0]], dtype=torch.int32)
    mask = torch.tensor([[True, False, True, False], [False, False, True, True]])
    changed = torch.zeros_like(mask)
    for seed in range(50):
        out = substitute_tokens(TABLE, ids, mask, eps=0.0, seed=seed)
        assert out.dtype == torch.int32 and out.shape == ids.shape
        assert torch.equal(out[~mask], ids[~mask])
        changed |= out != ids
    assert torch.equal(changed, mask)  # at eps 0 every protected position changes in some of 50 draws
    assert torch.equal(ids, torch.tensor([[0, 1, 2, 3], [3, 2, 1, 0]], dtype=torch.int32))  # input untouched


def test_the_result_does_not_depend_on_the_chunk_size_and_follows_the_seed():
    generator = torch.Generator().manual_seed(0)
    table = torch.randn(300, 16, generator=generator)
    ids = torch.randint(0, 300, (5, 40), generator=generator)
    mask = torch.rand(5, 40, generator=generator) < 0.6
    runs = [substitute_tokens(table, ids, mask, eps=20.0, clip_norm=3.0, seed=11, chunk_tokens=n) for n in (1, 7, 4096)]
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], runs[2])
    with_generator = substitute_tokens(
        table, ids, mask, eps=20.0, clip_norm=3.0, generator=torch.Generator().manual_seed(11)
    )
    assert torch.equal(with_generator, runs[0])
    assert not torch.equal(substitute_tokens(table, ids, mask, eps=20.0, clip_norm=3.0, seed=12), runs[0])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"eps": -1.0}, "eps=-1.0 is invalid: expected a finite number >= 0: eps per protected token"),
        ({"eps": float("nan")}, "eps=nan is invalid"),
        ({"clip_norm": 0.0}, "clip_norm=0.0 is invalid"),
        ({"chunk_tokens": 0}, "chunk_tokens=0 is invalid: expected an integer >= 1"),
        ({"seed": None}, "seed=None is invalid: expected exactly one of seed"),
        ({"generator": torch.Generator()}, "seed=0 is invalid: expected exactly one of seed"),
        ({"ids": torch.tensor([0, 4])}, r"token_ids=4 is invalid: expected ids in \[0, 4\)"),
        ({"ids": torch.tensor([0.0, 1.0])}, "token_ids=torch.float32 is invalid: expected an integer tensor"),
        ({"mask": torch.tensor([1, 0])}, r"protected=\(2,\) is invalid: expected a bool tensor"),
        ({"table": torch.zeros(4)}, r"table=\(4,\) is invalid: expected a non-empty floating-point \[V, d\]"),
    ],
)
def test_bad_input_names_the_setting(kwargs, message):
    arguments = {"table": TABLE, "ids": torch.tensor([0, 1]), "mask": torch.tensor([True, False]), "eps": 1.0}
    arguments.update(kwargs)
    options = {key: arguments[key] for key in ("clip_norm", "chunk_tokens", "generator") if key in arguments}
    seed = arguments.get("seed", 0)
    with pytest.raises(SettingError, match=message):
        substitute_tokens(
            arguments["table"], arguments["ids"], arguments["mask"], arguments["eps"], seed=seed, **options
        )
