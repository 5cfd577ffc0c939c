"""Chunked top-k search of a (possibly vocabulary-parallel) embedding table: the engine of every attack.

Every search goes over the vocabulary in chunks of ``vocab_chunk`` rows and over the queries in chunks of
``query_chunk``, so its extra memory is ``O(query_chunk * vocab_chunk)`` (plus the ``[N, top_k]`` result) whatever
the vocabulary and batch sizes, on CPU or CUDA. Scores come from a matrix product, so a different chunking may
change a score's last bit; equal scores go to the lowest token id.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from nemo_noise_plugin.noise.densities import noise_density, squared_distances
from nemo_noise_plugin.privacy.audit.checks import check_search_args, check_table, shape_of
from nemo_noise_plugin.validation import check_int

__all__ = [
    "DEFAULT_QUERY_CHUNK",
    "DEFAULT_VOCAB_CHUNK",
    "TINY",
    "Scoring",
    "median_nearest_neighbour_distance",
    "search",
]

DEFAULT_VOCAB_CHUNK = 4096
DEFAULT_QUERY_CHUNK = 1024
TINY = torch.finfo(torch.float32).tiny
"""The smallest positive float32: the floor of norms that are divided by."""
_NO_ID = torch.iinfo(torch.int64).max  # an empty top-k slot; sorts after every real token id


@dataclass(frozen=True)
class Scoring:
    """How a search ranks table rows for a query (higher is better).

    ``l2``: minus the squared distance; ``cosine``: cosine similarity; any other ``kind`` names an attacker density
    of ``noise.densities.NOISE_DENSITIES`` (``gaussian`` ``-|y - e|^2 / (2 s^2)``, ``laplace`` ``-|y - e|_1 / b``,
    ``metric_dp`` ``-|y - e| / s`` with ``s = 1/eta``), whose per-query scale ``scale`` holds; ``relative``: that
    scale is times each row's RMS (relative noise). Rows are clipped to ``clip_norm`` first when set.
    """

    kind: str
    clip_norm: float | None = None
    scale: torch.Tensor | None = None
    relative: bool = False


def _prepare_rows(rows: torch.Tensor, scoring: Scoring) -> torch.Tensor:
    rows = rows.detach().float()
    if scoring.clip_norm is not None:
        # The same factor as the noise layer's clipping: min(1, C / |e|).
        norms = rows.norm(dim=-1, keepdim=True)
        rows = rows * (scoring.clip_norm / norms.clamp_min(TINY)).clamp_max(1.0)
    if scoring.kind == "cosine":
        rows = F.normalize(rows, dim=-1, eps=TINY)
    return rows


def _scores(scoring: Scoring, queries: torch.Tensor, rows: torch.Tensor, index: slice) -> torch.Tensor:
    """``[n, v]`` scores of the query chunk ``queries`` (rows ``index`` of all queries) against prepared rows."""
    if scoring.kind == "cosine":
        return F.normalize(queries, dim=-1, eps=TINY) @ rows.t()
    if scoring.kind == "l2":
        return -squared_distances(queries, rows)
    row_scale = rows.pow(2).mean(-1).sqrt().clamp_min(TINY) if scoring.relative else None
    return noise_density(scoring.kind).log_likelihood(queries, rows, scoring.scale[index].unsqueeze(1), row_scale)


def _chunk_top_k(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top ``k`` columns per row, equal scores in column order (``torch.topk`` promises no order for ties)."""
    if k == 1:
        return scores.max(dim=1, keepdim=True)  # max returns the first of equal maxima
    values, columns = scores.sort(dim=1, descending=True, stable=True)
    return values[:, :k], columns[:, :k]


def _best_k(scores: torch.Tensor, ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` best (score, id) pairs per row: higher score first, equal scores by lower id."""
    by_id = ids.argsort(dim=1)
    scores, ids = scores.gather(1, by_id), ids.gather(1, by_id)
    order = scores.argsort(dim=1, descending=True, stable=True)[:, :k]
    return scores.gather(1, order), ids.gather(1, order)


def search(
    queries: torch.Tensor,
    table: torch.Tensor,
    scoring: Scoring,
    *,
    top_k: int,
    vocab_chunk: int,
    query_chunk: int,
    vocab_start: int = 0,
    group: dist.ProcessGroup | None = None,
    self_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, top_k]`` best scores and global token ids per query, over this shard and ``group``'s other shards.

    ``self_ids``: the queries are table rows (query ``i`` is token ``self_ids[i]``), which are skipped.
    """
    count, device = queries.size(0), queries.device
    best_scores = torch.full((count, top_k), -math.inf, device=device)
    best_ids = torch.full((count, top_k), _NO_ID, dtype=torch.int64, device=device)
    for start in range(0, table.size(0), vocab_chunk):
        rows = _prepare_rows(table[start : start + vocab_chunk], scoring)
        ids = torch.arange(rows.size(0), device=device) + (vocab_start + start)
        k = min(top_k, rows.size(0))
        for first in range(0, count, query_chunk):
            index = slice(first, min(first + query_chunk, count))
            scores = _scores(scoring, queries[index].detach().float(), rows, index)
            if self_ids is not None:
                own = self_ids[index].unsqueeze(1) == ids
                scores = scores.masked_fill(own, -math.inf)
            chunk_scores, columns = _chunk_top_k(scores, k)
            best_scores[index], best_ids[index] = _best_k(
                torch.cat([best_scores[index], chunk_scores], dim=1),
                torch.cat([best_ids[index], ids[columns]], 1),
                top_k,
            )
    if group is not None and dist.get_world_size(group) > 1:
        best_scores, best_ids = _combine_shards(best_scores, best_ids, top_k, group)
    if count and bool((best_ids == _NO_ID).any()):
        raise ValueError(f"top_k={top_k} is invalid: expected at most the number of candidate tokens.")
    return best_scores, best_ids


def _combine_shards(
    scores: torch.Tensor, ids: torch.Tensor, top_k: int, group: dist.ProcessGroup
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every shard's top-k gathered, and the best ``top_k`` of them (ties to the lowest global id)."""
    world_size = dist.get_world_size(group)
    all_scores = [torch.empty_like(scores) for _ in range(world_size)]
    all_ids = [torch.empty_like(ids) for _ in range(world_size)]
    dist.all_gather(all_scores, scores.contiguous(), group=group)
    dist.all_gather(all_ids, ids.contiguous(), group=group)
    return _best_k(torch.cat(all_scores, dim=1), torch.cat(all_ids, dim=1), top_k)


@torch.no_grad()
def median_nearest_neighbour_distance(
    table: torch.Tensor,
    *,
    vocab_chunk: int = DEFAULT_VOCAB_CHUNK,
    query_chunk: int = DEFAULT_QUERY_CHUNK,
    sample: int | None = None,
) -> float:
    """The median over rows of the L2 distance to the nearest *other* row: the noise norm that starts to confuse.

    ``sample``: use that many rows (a fixed pseudo-random subset, each searched against the whole table) instead
    of all, for large vocabularies; the median of a sample of ``n`` rows is within about ``1/sqrt(n)`` quantile
    of the exact one.
    """
    check_table("table", table)
    if table.size(0) < 2:
        raise ValueError(f"table has shape {shape_of(table)}: expected at least 2 rows to have neighbours.")
    check_search_args(table, table, top_k=1, vocab_chunk=vocab_chunk, query_chunk=query_chunk)
    rows = torch.arange(table.size(0), device=table.device)
    if sample is not None:
        check_int("sample", sample, minimum=1)
        if sample < table.size(0):
            order = torch.randperm(table.size(0), generator=torch.Generator().manual_seed(0))[:sample]
            rows = order.sort().values.to(table.device)
    queries = table[rows]
    _, ids = search(
        queries, table, Scoring("l2"), top_k=1, vocab_chunk=vocab_chunk, query_chunk=query_chunk, self_ids=rows
    )
    # The distances are recomputed from the differences: the expansion behind the search loses precision near 0.
    distances = [
        (queries[first : first + query_chunk].float() - table[ids[first : first + query_chunk, 0]].float()).norm(dim=-1)
        for first in range(0, rows.numel(), query_chunk)
    ]
    return float(torch.cat(distances).median())
