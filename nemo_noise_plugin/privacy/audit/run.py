"""The audit run: the exact noised embeddings of some tokens, the chosen attacks on them, and their recovery report."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.noise.families import NOISE_FAMILIES, noise_family
from nemo_noise_plugin.privacy.audit.attacks import direction_attack, nearest_neighbour_attack
from nemo_noise_plugin.privacy.audit.beam import LmLogProbs, lm_beam_attack
from nemo_noise_plugin.privacy.audit.noised import noised_embeddings, noised_tokens, real_tokens
from nemo_noise_plugin.privacy.audit.search import (
    DEFAULT_QUERY_CHUNK,
    DEFAULT_VOCAB_CHUNK,
    median_nearest_neighbour_distance,
)
from nemo_noise_plugin.privacy.audit.statistics import rare_token_ids, recovery_report
from nemo_noise_plugin.validation import check_choice, check_number

__all__ = ["ATTACKS", "audit", "check_attacks", "clips_embeddings"]

ATTACKS: tuple[str, ...] = ("nn_l2", "nn_cosine", "direction", "lm_beam")


def clips_embeddings(config: NoiseConfig) -> bool:
    """True when the mechanism clips embeddings to ``clip_norm`` (gaussian_mechanism, metric_dp with a clip, ...:
    the family's ``clips``)."""
    return noise_family(config.mechanism).clips(config)


@torch.no_grad()
def audit(
    table: torch.Tensor,
    token_ids: torch.Tensor,
    noise_config: NoiseConfig,
    attacks: Sequence[str] = ("nn_l2", "nn_cosine"),
    lm_log_probs: LmLogProbs | None = None,
    *,
    iteration: int = 0,
    loss_mask: torch.Tensor | None = None,
    padding_mask: torch.Tensor | None = None,
    rare_ids: Sequence[int] | None = None,
    rare_quantile: float = 0.1,
    special_ids: Sequence[int] | None = None,
    confidence: float = 0.95,
    candidates: int = 8,
    beam_width: int = 4,
    lm_weight: float = 1.0,
    vocab_chunk: int = DEFAULT_VOCAB_CHUNK,
    query_chunk: int = DEFAULT_QUERY_CHUNK,
    neighbour_distance: float | None = None,
    noised_only: bool = False,
    private_mask: torch.Tensor | None = None,
) -> dict[str, Any]:
    """Run ``attacks`` on the exact noised embeddings of ``token_ids`` (``[b, s]``) and report (JSON-serialisable).

    ``attacks`` are from ``ATTACKS``: ``nn_l2``, ``nn_cosine`` (``nearest_neighbour_attack``), ``direction``
    (``direction_attack`` at the config's ``clip_norm``) and ``lm_beam`` (``lm_beam_attack``, needs
    ``lm_log_probs``). Recovery is counted over the real (non-padding) tokens; ``rare_ids`` default to
    ``rare_token_ids`` of those tokens at ``rare_quantile``, ``special_ids`` to the config's ``special_token_ids``.
    The report also has the observed noise norm per noised token (median, mean) and the vocabulary's
    ``median_nearest_neighbour_distance`` (pass ``neighbour_distance`` when it is already known: a sweep over
    noise levels computes it once). ``noised_only`` counts only the tokens that actually received noise
    (``noised_tokens``: not the ``special_token_ids``, only the ``tokens`` part the config selects); the report's
    ``tokens`` says how many were counted (``real``) and how many distinct ids they hold (``distinct_ids``).
    ``tokens='spans'``: the protected tokens are those of ``private_mask`` (``[b, s]``, True inside a private span,
    as the training batch carries it), and recovery is always counted on them only (the clean tokens around them
    are in the clear: counting them would only dilute the rate); the attacks still see the whole sequence.
    ``noise_config`` is checked as it is now first: the audit is its own entry point (a job, not a training run's
    path), so it is the gate for an assignment after construction, as ``make_noisy`` is for a model.

    Args:
        table: the model's input embedding table, ``[V, h]``.
        token_ids: the audited tokens, ``[b, s]``.
        noise_config: the noise training used (its level, scaling, clipping and token selection).
        attacks: names from ``ATTACKS``.
        lm_log_probs: a language model's next-token log-probabilities, for ``lm_beam``.

    Returns:
        The report: recovery per attack (overall, rare, special, Wilson intervals), noise norms and token counts.

    Example::

        report = audit(model.embedding.word_embeddings.weight, token_ids, load_noise_config("metric_dp"))
        print(report["attacks"]["nn_l2"]["overall"]["rate"])  # share of real tokens the nearest row recovers
    """
    noise_config.validate()
    if rare_ids is None:
        check_number("rare_quantile", rare_quantile, minimum=0.0, maximum=1.0)
    attacks = check_attacks(attacks, noise_config, lm_log_probs)
    masks = dict(loss_mask=loss_mask, padding_mask=padding_mask, private_mask=private_mask)
    noised = noised_embeddings(table, token_ids, noise_config, iteration=iteration, **masks)
    token_ids = token_ids.to(table.device)
    real, _ = real_tokens(noise_config, noised, loss_mask, padding_mask)
    if noised_only or noise_config.tokens == "spans":
        real = real & noised_tokens(noise_config, token_ids, **masks)
    true_ids = token_ids[real]
    search = dict(vocab_chunk=vocab_chunk, query_chunk=query_chunk)
    predictions: dict[str, Callable[[], torch.Tensor]] = {
        "nn_l2": lambda: nearest_neighbour_attack(noised[real], table, "l2", **search).ids,
        "nn_cosine": lambda: nearest_neighbour_attack(noised[real], table, "cosine", **search).ids,
        "direction": lambda: direction_attack(noised[real], table, noise_config.clip_norm, **search).ids,
        "lm_beam": lambda: lm_beam_attack(
            noised,
            table,
            noise_config,
            lm_log_probs,
            iteration=iteration,
            loss_mask=loss_mask,
            padding_mask=padding_mask,
            candidates=candidates,
            beam_width=beam_width,
            lm_weight=lm_weight,
            **search,
        )[real],
    }
    rare = list(rare_ids) if rare_ids is not None else rare_token_ids(true_ids, quantile=rare_quantile)
    special = list(special_ids) if special_ids is not None else noise_config.special_token_ids
    noise_norm = (noised[real] - table[true_ids].float()).norm(dim=-1)
    if neighbour_distance is None:
        neighbour_distance = median_nearest_neighbour_distance(table, **search)
    return {
        "noise_config": dataclasses.asdict(noise_config),
        "iteration": iteration,
        "tokens": {
            "real": int(real.sum()),
            "distinct_ids": int(true_ids.unique().numel()),
            "rare_ids": len(rare),
            "special_ids": len(special),
        },
        "noise_norm": _noise_norm_summary(noise_norm),
        "median_nearest_neighbour_distance": neighbour_distance,
        "attacks": {
            name: recovery_report(
                true_ids, predictions[name](), rare_ids=rare, special_ids=special, confidence=confidence
            )
            for name in attacks
        },
    }


def _noise_norm_summary(norms: torch.Tensor) -> dict[str, Any]:
    """Median and mean noise norm over the tokens that got noise (non-zero), and how many did."""
    noised = norms[norms > 0]
    if noised.numel() == 0:
        return {"noised_tokens": 0, "median": 0.0, "mean": 0.0}
    return {"noised_tokens": noised.numel(), "median": float(noised.median()), "mean": float(noised.mean())}


def check_attacks(attacks: Sequence[str], config: NoiseConfig, lm_log_probs: LmLogProbs | None) -> tuple[str, ...]:
    if isinstance(attacks, str) or not attacks:
        raise ValueError(f"attacks={attacks!r} is invalid: expected a non-empty list from {', '.join(ATTACKS)}.")
    for attack in attacks:
        check_choice("attacks", attack, ATTACKS)
    if "lm_beam" in attacks and lm_log_probs is None:
        raise ValueError("attacks includes 'lm_beam' but lm_log_probs=None: expected a callable prefix -> log-probs.")
    if "direction" in attacks and not clips_embeddings(config):
        required = [name for name, family in NOISE_FAMILIES.items() if family.clip == "required"]
        optional = [name for name, family in NOISE_FAMILIES.items() if family.clip == "optional"]
        raise ValueError(
            f"attacks includes 'direction' but the noise config (mechanism={config.mechanism!r}, "
            f"clip_norm={config.clip_norm!r}) does not clip: "
            f"expected a clipped mechanism ({', '.join(required)}, or {' or '.join(optional)} with clip_norm)."
        )
    return tuple(attacks)
