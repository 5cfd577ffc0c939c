"""Nearest-neighbour attacks: guess each noised embedding's token as the closest table row (L2 or cosine), or the
closest row of the clipped table (the direction-only attack for clipped mechanisms)."""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
import torch.distributed as dist

from nemo_noise_plugin.privacy.audit.checks import check_search_args
from nemo_noise_plugin.privacy.audit.search import DEFAULT_QUERY_CHUNK, DEFAULT_VOCAB_CHUNK, Scoring, search
from nemo_noise_plugin.validation import check_choice, check_int, check_number

__all__ = ["METRICS", "Metric", "Neighbours", "direction_attack", "nearest_neighbour_attack"]

Metric = Literal["l2", "cosine"]
METRICS: tuple[str, ...] = ("l2", "cosine")


class Neighbours(NamedTuple):
    """A search's guesses: ``ids`` ``[N]`` (the best), ``candidates`` ``[N, k]`` best first, and their ``scores``."""

    ids: torch.Tensor
    candidates: torch.Tensor
    scores: torch.Tensor
    """``l2``: minus the squared distance; ``cosine``: the cosine similarity."""


@torch.no_grad()
def nearest_neighbour_attack(
    noised: torch.Tensor,
    table: torch.Tensor,
    metric: Metric = "l2",
    *,
    top_k: int = 1,
    vocab_chunk: int = DEFAULT_VOCAB_CHUNK,
    query_chunk: int = DEFAULT_QUERY_CHUNK,
    vocab_start: int = 0,
    group: dist.ProcessGroup | None = None,
) -> Neighbours:
    """Guess each noised embedding's token as the nearest table row (``l2``) or the most similar one (``cosine``).

    ``noised`` is ``[N, h]``, ``table`` ``[V, h]``. For a vocabulary-parallel table, ``table`` is this rank's shard
    (global ids ``vocab_start ..``) and ``group`` the tensor-parallel group: each rank searches its shard and the
    shards' top-k are all-gathered and merged (ties to the lowest global id), so every rank returns the
    single-table result. The group's backend must accept the tensors' device (gloo: CPU, NCCL: CUDA).
    """
    check_choice("metric", metric, METRICS)
    check_search_args(noised, table, top_k=top_k, vocab_chunk=vocab_chunk, query_chunk=query_chunk, group=group)
    check_int("vocab_start", vocab_start, minimum=0)
    scores, ids = search(
        noised,
        table,
        Scoring(metric),
        top_k=top_k,
        vocab_chunk=vocab_chunk,
        query_chunk=query_chunk,
        vocab_start=vocab_start,
        group=group,
    )
    return Neighbours(ids[:, 0], ids, scores)


@torch.no_grad()
def direction_attack(
    noised: torch.Tensor,
    table: torch.Tensor,
    clip_norm: float,
    *,
    metric: Metric = "l2",
    top_k: int = 1,
    vocab_chunk: int = DEFAULT_VOCAB_CHUNK,
    query_chunk: int = DEFAULT_QUERY_CHUNK,
) -> Neighbours:
    """Nearest neighbour against the clipped table, for the clipped mechanisms (gaussian_mechanism, metric_dp).

    Those mechanisms add noise around ``e * min(1, C / |e|)``, not around ``e``: clipping keeps each row's direction
    and caps its norm at ``C``. A row much longer than ``C`` is therefore far from its own noised copies and plain L2
    nearest neighbour misses it; compared with the clipped rows it is found again. Every row longer than ``C`` lies
    on the sphere of radius ``C``, where the nearest clipped row is the most similar direction, so among those rows
    this is a direction-only (cosine) attack. ``metric="l2"`` (the default) also uses the norms of rows shorter than
    ``C``, which is the maximum-likelihood guess under Gaussian noise; ``metric="cosine"`` compares directions only
    (which clipping does not change, so it equals ``nearest_neighbour_attack(..., "cosine")``).
    """
    check_choice("metric", metric, METRICS)
    check_number("clip_norm", clip_norm, minimum=0.0, inclusive=False)
    check_search_args(noised, table, top_k=top_k, vocab_chunk=vocab_chunk, query_chunk=query_chunk)
    scoring = Scoring(metric, clip_norm=float(clip_norm))
    scores, ids = search(noised, table, scoring, top_k=top_k, vocab_chunk=vocab_chunk, query_chunk=query_chunk)
    return Neighbours(ids[:, 0], ids, scores)
