"""Recovery statistics: token recovery rates overall, for rare and for special tokens, with Wilson intervals."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

import torch

from nemo_noise_plugin.privacy.audit.checks import INTEGER_DTYPES, check_confidence, shape_of
from nemo_noise_plugin.validation import check_int, check_number

__all__ = ["rare_token_ids", "recovery_report", "wilson_interval"]


def wilson_interval(successes: int, trials: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion; ``(0, 1)`` without trials."""
    check_int("trials", trials, minimum=0)
    check_int("successes", successes, minimum=0, maximum=trials)
    check_confidence(confidence)
    if trials == 0:
        return 0.0, 1.0
    z = statistics.NormalDist().inv_cdf(0.5 + confidence / 2.0)
    rate, z2 = successes / trials, z * z
    denominator = 1.0 + z2 / trials
    centre = (rate + z2 / (2.0 * trials)) / denominator
    half = z * math.sqrt(rate * (1.0 - rate) / trials + z2 / (4.0 * trials * trials)) / denominator
    return max(0.0, centre - half), min(1.0, centre + half)


def _recovery(correct: torch.Tensor, confidence: float) -> dict[str, Any]:
    recovered, total = int(correct.sum()), correct.numel()
    low, high = wilson_interval(recovered, total, confidence)
    return {
        "recovered": recovered,
        "total": total,
        "rate": recovered / total if total else None,
        "ci_low": low,
        "ci_high": high,
    }


def recovery_report(
    true_ids: torch.Tensor,
    predicted_ids: torch.Tensor,
    *,
    rare_ids: Sequence[int] | torch.Tensor | None = None,
    special_ids: Sequence[int] | torch.Tensor | None = None,
    confidence: float = 0.95,
) -> dict[str, Any]:
    """Token recovery rates (JSON-serialisable) with Wilson score intervals at ``confidence``.

    ``overall`` counts every position of ``true_ids``/``predicted_ids`` (same shape); ``rare`` and ``special``
    count the positions whose true token is in ``rare_ids``/``special_ids`` and ``non_special`` the others (None
    when the ids are not given). Each entry has ``recovered``, ``total``, ``rate`` (None if empty), ``ci_low``,
    ``ci_high``.
    """
    if not isinstance(true_ids, torch.Tensor) or not isinstance(predicted_ids, torch.Tensor):
        raise ValueError("true_ids and predicted_ids must be tensors of token ids.")
    if true_ids.shape != predicted_ids.shape:
        raise ValueError(
            f"predicted_ids has shape {shape_of(predicted_ids)}: expected true_ids's shape {shape_of(true_ids)}."
        )
    check_confidence(confidence)
    true_ids = true_ids.reshape(-1)
    correct = true_ids == predicted_ids.reshape(-1).to(true_ids.device)
    report: dict[str, Any] = {"confidence": confidence, "overall": _recovery(correct, confidence)}
    rare = _membership(true_ids, rare_ids)
    special = _membership(true_ids, special_ids)
    report["rare"] = None if rare is None else _recovery(correct[rare], confidence)
    report["special"] = None if special is None else _recovery(correct[special], confidence)
    report["non_special"] = None if special is None else _recovery(correct[~special], confidence)
    return report


def _membership(token_ids: torch.Tensor, ids: Sequence[int] | torch.Tensor | None) -> torch.Tensor | None:
    if ids is None:
        return None
    return torch.isin(token_ids, torch.as_tensor(ids, dtype=token_ids.dtype, device=token_ids.device))


def rare_token_ids(token_ids: torch.Tensor, *, quantile: float = 0.1) -> list[int]:
    """Ids whose count in ``token_ids`` is at most the ``quantile`` of the counts of the ids that occur.

    E.g. ``quantile=0.1``: the least frequent tenth of the distinct tokens of the audited text (more when counts
    tie at the threshold).
    """
    check_number("quantile", quantile, minimum=0.0, maximum=1.0)
    if not isinstance(token_ids, torch.Tensor) or token_ids.dtype not in INTEGER_DTYPES:
        raise ValueError(f"token_ids has shape {shape_of(token_ids)}: expected an integer tensor of token ids.")
    if token_ids.numel() == 0:
        return []
    ids, counts = token_ids.reshape(-1).unique(return_counts=True)
    threshold = torch.quantile(counts.double(), quantile)
    return ids[counts <= threshold].tolist()
