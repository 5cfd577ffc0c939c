"""Nearest-row projection: each noised token's embedding replaced by the embedding-table row nearest to it.

``NoiseConfig.projection='nearest_row'``. The noise layer releases ``y = clip(e) + z``; projection maps ``y`` to the
table row ``e_k`` with ``k = argmin_j d(y, row_j)``, so the rest of the network sees a real token embedding again
(decode-then-answer). It reads nothing but the release and the public table: post-processing, so the mechanism's DP
guarantee is unchanged. The Megatron noise hook (``model/mixin.py``) and the Hugging Face serving helper
(``noise/hf_inference.py``) both call ``project_noised``; ``nearest_rows`` is the search itself.

Distances: ``l2`` compares ``y`` with the rows *as the mechanism noises them* (clipped to ``clip_norm`` where the
mechanism clips, the maximum-likelihood guess under Gaussian noise; a token with zero noise finds itself), ``cosine``
compares directions (which clipping does not change). Either way the output is the *unclipped* table row, the
embedding the model was trained on. Equal distances go to the smallest row id.

Vocabulary-parallel tables (Megatron's ``VocabParallelEmbedding``): each tensor-parallel rank searches its shard, the
minimum (distance, id) is all-reduced over the group, and the chosen row is looked up as ``VocabParallelEmbedding``
does (masked local lookup, then an all-reduce, or a reduce-scatter to the sequence-parallel layout), so gradients
reach the chosen row's shard as a normal lookup of the projected id; nothing flows back to the noise or to the
original token's row. Under sequence parallelism the local noised tokens are first gathered over the group (each
rank holds different positions). Memory: the search goes over token chunks and vocabulary chunks so that no score
block has more than ``max_elements`` elements, whatever the vocabulary and batch sizes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F

from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.noise.families import noise_family
from nemo_noise_plugin.validation import check_choice, check_int

__all__ = [
    "DEFAULT_MAX_ELEMENTS",
    "NO_ROW",
    "Projection",
    "TableQueries",
    "lookup_rows",
    "nearest_rows",
    "project_noised",
    "projection_recovery",
]

DEFAULT_MAX_ELEMENTS = 64 * 2**20
"""The most elements of one float32 score block (``[token chunk, vocabulary chunk]``): 256 MiB."""
NO_ROW = -1
"""The id of a token that was not projected (not noised)."""
_TINY = torch.finfo(torch.float32).tiny
_NO_ID = torch.iinfo(torch.int64).max  # sorts after every real row id in the all-reduced minimum


def _group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _prepared_rows(rows: torch.Tensor, metric: str, clip_norm: float | None) -> torch.Tensor:
    rows = rows.detach().float()
    if clip_norm is not None:  # the noise layer's own factor min(1, C / |e|)
        rows = rows * (clip_norm / rows.norm(dim=-1, keepdim=True).clamp_min(_TINY)).clamp_max(1.0)
    if metric == "cosine":
        rows = F.normalize(rows, dim=-1, eps=_TINY)
    return rows


@torch.no_grad()
def nearest_rows(
    queries: torch.Tensor,
    table: torch.Tensor,
    *,
    metric: Literal["l2", "cosine"] = "l2",
    clip_norm: float | None = None,
    vocab_start: int = 0,
    group: dist.ProcessGroup | None = None,
    max_elements: int = DEFAULT_MAX_ELEMENTS,
) -> torch.Tensor:
    """``[N]`` int64 global id of the table row nearest to each of the ``[N, h]`` ``queries``.

    ``table`` is ``[V, h]``, or this rank's vocabulary shard (global ids ``vocab_start ..``) with ``group`` the
    tensor-parallel group it is sharded over; every rank of ``group`` must pass the same queries and gets the same
    ids. ``metric``: ``l2`` (smallest distance to the rows clipped to ``clip_norm`` when given) or ``cosine``
    (largest cosine similarity). Equal distances go to the smallest id. Scores are float32 matrix products computed
    in blocks of at most ``max_elements`` elements (extra memory ``O(max_elements)``); another blocking may change a
    distance's last bit, and so the choice between two rows equally near to within rounding.

    Example::

        ids = nearest_rows(noised.view(-1, h), model.get_input_embeddings().weight, metric="l2")
    """
    check_choice("nearest_rows: metric", metric, ("l2", "cosine"))
    check_int("nearest_rows: max_elements", max_elements, minimum=1)
    if queries.dim() != 2 or table.dim() != 2 or queries.size(1) != table.size(1):
        raise ValueError(
            f"nearest_rows: queries {list(queries.shape)} and table {list(table.shape)} are invalid: expected "
            "[N, h] queries and a [V, h] table of the same h."
        )
    count, hidden = queries.shape
    device = queries.device
    queries = queries.detach().float()
    if metric == "cosine":
        queries = F.normalize(queries, dim=-1, eps=_TINY)
    best = torch.full((count,), float("inf"), device=device)
    best_ids = torch.full((count,), _NO_ID, dtype=torch.int64, device=device)
    vocab_chunk = max(1, min(table.size(0), max_elements // hidden))
    query_chunk = max(1, max_elements // vocab_chunk)
    for start in range(0, table.size(0), vocab_chunk):
        rows = _prepared_rows(table[start : start + vocab_chunk], metric, clip_norm)
        # l2: |y - r|^2 - |y|^2 = |r|^2 - 2 y.r (the query's own norm ranks nothing); cosine: -cos(y, r).
        offsets = rows.pow(2).sum(-1) if metric == "l2" else None
        for first in range(0, count, query_chunk):
            index = slice(first, first + query_chunk)
            products = queries[index] @ rows.t()
            scores = offsets - 2.0 * products if offsets is not None else -products
            values, columns = scores.min(dim=1)  # the first of equal minima: the smallest id of this chunk
            better = values < best[index]  # strict: an earlier (smaller) id keeps a tie
            best[index] = torch.where(better, values, best[index])
            best_ids[index] = torch.where(better, columns + (vocab_start + start), best_ids[index])
    if count and _group_size(group) > 1:  # every rank has the same queries, so all skip or none
        nearest = best.clone()
        dist.all_reduce(nearest, op=dist.ReduceOp.MIN, group=group)
        best_ids = torch.where(best == nearest, best_ids, torch.full_like(best_ids, _NO_ID))
        dist.all_reduce(best_ids, op=dist.ReduceOp.MIN, group=group)
    return best_ids


def lookup_rows(
    ids: torch.Tensor,
    table: torch.Tensor,
    *,
    vocab_start: int = 0,
    group: dist.ProcessGroup | None = None,
    sequence_parallel: bool = False,
) -> torch.Tensor:
    """``[*ids.shape, h]`` rows ``ids`` of the (vocabulary-parallel) ``table``; zeros where ``ids`` is ``NO_ROW``.

    As ``VocabParallelEmbedding.forward``: each rank looks up the ids of its shard (zeros for the others), then the
    shards are summed over ``group`` (an all-reduce; under ``sequence_parallel``, a reduce-scatter of the leading
    dimension, so ``[s, b]`` ids give this rank's ``[s / tp, b, h]`` block). Differentiable in ``table`` like a
    lookup: each row gets the gradients of the positions that took it.
    """
    local = ids - vocab_start
    own = (ids != NO_ROW) & (local >= 0) & (local < table.size(0))
    rows = F.embedding(torch.where(own, local, torch.zeros_like(local)), table)
    rows = torch.where(own.unsqueeze(-1), rows, torch.zeros((), dtype=rows.dtype, device=rows.device))
    if _group_size(group) == 1:
        return rows
    from megatron.core import tensor_parallel

    if sequence_parallel:
        return tensor_parallel.reduce_scatter_to_sequence_parallel_region(rows, group=group)
    return tensor_parallel.reduce_from_tensor_model_parallel_region(rows, group=group)


@dataclass
class Projection:
    """A projected decoder input and the row each token was projected to."""

    decoder_input: torch.Tensor
    """The noised input with each selected token replaced by its nearest table row (same shape, dtype, layout)."""
    ids: torch.Tensor
    """``[s, b]`` int64 nearest row of each selected token, ``NO_ROW`` elsewhere; under sequence parallelism the
    whole (gathered) sequence, identical on every rank of the group, so it lines up with ``input_ids.t()``."""


def projection_recovery(ids: torch.Tensor, input_ids: torch.Tensor) -> float:
    """The fraction of projected tokens (``Projection.ids`` ``[s, b]``) projected back to their own id
    (``input_ids`` ``[b, s]``): the nearest-neighbour recovery of the noised tokens; NaN when none was projected."""
    projected = ids != NO_ROW
    return float((ids == input_ids.t().to(ids.device))[projected].float().mean())


def _gather_sequence(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The group's blocks of the leading (sequence) dimension, concatenated in rank order (bool as uint8)."""
    source = tensor.to(torch.uint8) if tensor.dtype == torch.bool else tensor.contiguous()
    gathered = source.new_empty((source.size(0) * dist.get_world_size(group), *source.shape[1:]))
    dist.all_gather_into_tensor(gathered, source, group=group)
    return gathered.bool() if tensor.dtype == torch.bool else gathered


@dataclass(frozen=True)
class TableQueries:
    """What a replacement of noised tokens by table rows reads: the table (shard) and its tensor-parallel place, and
    the noised tokens of the whole group's sequence (gathered under sequence parallelism) with their selection."""

    weight: torch.Tensor
    """The ``[V or V / tp, h]`` table (shard)."""
    group: dist.ProcessGroup | None
    vocab_start: int
    """The global id of the shard's first row."""
    gather: bool
    """Whether ``queries`` and ``chosen`` were gathered over the sequence-parallel group."""
    queries: torch.Tensor
    """``[s, b, h]`` detached noised embeddings."""
    chosen: torch.Tensor
    """``[s, b]`` the selected (noised) tokens."""

    @classmethod
    def of(
        cls,
        noised: torch.Tensor,
        selected: torch.Tensor,
        embedding: Any,
        sequence_parallel: bool,
        group: dist.ProcessGroup | None,
    ) -> TableQueries:
        """``project_noised``'s arguments read: ``group`` defaults to the embedding's ``tp_group``."""
        group = group if group is not None else getattr(embedding, "tp_group", None)
        gather = sequence_parallel and _group_size(group) > 1
        return cls(
            weight=embedding.weight,
            group=group,
            vocab_start=int(getattr(embedding, "vocab_start_index", 0)),
            gather=gather,
            queries=_gather_sequence(noised.detach(), group) if gather else noised.detach(),
            chosen=_gather_sequence(selected, group) if gather else selected,
        )


def project_noised(
    noised: torch.Tensor,
    selected: torch.Tensor,
    embedding: Any,
    config: NoiseConfig,
    sequence_parallel: bool = False,
    *,
    group: dist.ProcessGroup | None = None,
    max_elements: int = DEFAULT_MAX_ELEMENTS,
) -> Projection:
    """``noised`` (``[s, b, h]``) with each ``selected`` (``[s, b]``) token replaced by its nearest table row.

    ``embedding`` is the module holding the table: a Megatron ``VocabParallelEmbedding`` (its ``weight`` shard,
    ``vocab_start_index`` and ``tp_group`` are used) or any module with a ``[V, h]`` ``weight`` (``nn.Embedding``).
    ``group`` overrides the embedding's group. Metric and clipping come from ``config`` (``projection_metric``; the
    rows are clipped like the input when ``config``'s mechanism clips). Unselected tokens are returned as they are,
    with their gradients; a selected token's output carries the gradient to its chosen row only. Under
    ``sequence_parallel`` ``noised`` and ``selected`` are this rank's positions of the group's sequence.
    """
    table = TableQueries.of(noised, selected, embedding, sequence_parallel, group)
    clip_norm = float(config.clip_norm) if noise_family(config.mechanism).clips(config) else None
    ids = torch.full(table.chosen.shape, NO_ROW, dtype=torch.int64, device=noised.device)
    ids[table.chosen] = nearest_rows(
        table.queries[table.chosen],
        table.weight,
        metric=config.projection_metric,
        clip_norm=clip_norm,
        vocab_start=table.vocab_start,
        group=table.group,
        max_elements=max_elements,
    )
    rows = lookup_rows(
        ids, table.weight, vocab_start=table.vocab_start, group=table.group, sequence_parallel=table.gather
    )
    return Projection(torch.where(selected.unsqueeze(-1), rows.to(noised.dtype), noised), ids)
