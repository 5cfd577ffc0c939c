"""Privacy audit: how many training tokens an attacker recovers from the noised embeddings.

The attacker sees the noised decoder input (e.g. what a first pipeline stage sends on) and knows the embedding table
and the noise configuration. ``noised_embeddings`` reproduces exactly what training feeds the network (the plugin's
own noise layer and Philox streams); the attacks guess each token by nearest neighbour (L2 or cosine), by nearest
neighbour against the clipped table (clipped mechanisms), or by a beam search that adds a language-model prior to the
noise likelihood (the BeamClean idea). ``recovery_report`` turns guesses into recovery rates with Wilson intervals
and ``audit`` runs it all.

Every search goes over the vocabulary in chunks of ``vocab_chunk`` rows and over the queries in chunks of
``query_chunk``, so its extra memory is ``O(query_chunk * vocab_chunk)`` (plus the ``[N, top_k]`` result) whatever
the vocabulary and batch sizes, on CPU or CUDA. Scores come from a matrix product, so a different chunking may
change a score's last bit; equal scores go to the lowest token id.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.noise.layer import EmbeddingNoise, NoiseBatchInputs
from nemo_noise_plugin.noise.schedule import NoiseClock, schedule_factor

__all__ = [
    "ATTACKS",
    "Neighbours",
    "audit",
    "direction_attack",
    "lm_beam_attack",
    "median_nearest_neighbour_distance",
    "nearest_neighbour_attack",
    "noised_embeddings",
    "rare_token_ids",
    "recovery_report",
    "wilson_interval",
]

Metric = Literal["l2", "cosine"]
LmLogProbs = Callable[[torch.Tensor], torch.Tensor]
"""``lm_log_probs(prefix_ids [rows, t]) -> [rows, V]``: log-probabilities of the next token after each prefix."""

METRICS: tuple[str, ...] = ("l2", "cosine")
ATTACKS: tuple[str, ...] = ("nn_l2", "nn_cosine", "direction", "lm_beam")
DEFAULT_VOCAB_CHUNK = 4096
DEFAULT_QUERY_CHUNK = 1024

_INTEGER_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
_NO_ID = torch.iinfo(torch.int64).max  # an empty top-k slot; sorts after every real token id
_MIN_SCALE = 1e-12  # noise scale used for tokens the configuration leaves (almost) noise-free
_TINY = torch.finfo(torch.float32).tiny


# Noised embeddings


def _noise_layer(config: NoiseConfig) -> EmbeddingNoise:
    """The plugin's noise layer with no process groups: the audited batch is one whole global batch."""
    return EmbeddingNoise(config, sequence_parallel=False, pg_collection=None, megatron_groups=False)


@torch.no_grad()
def noised_embeddings(
    embedding_table: torch.Tensor,
    token_ids: torch.Tensor,
    noise_config: NoiseConfig,
    *,
    iteration: int = 0,
    loss_mask: torch.Tensor | None = None,
    padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The ``[b, s, h]`` float32 decoder input that training computes for ``token_ids`` at ``iteration``.

    Looks the tokens up in ``embedding_table`` (``[V, h]``), transposes to Megatron's ``[s, b, h]`` and runs the
    plugin's noise layer as a training forward does: microbatch 0 of ``iteration``, one process, so row ``j`` of
    ``token_ids`` is sample ``j`` of the global batch and gets the noise training gives it. A configuration that
    adds no noise (``enabled=False`` or a zero magnitude) returns the clean lookup, as the model does. Learned
    absolute position embeddings, which some models add before the noise, are not included.
    ``loss_mask``/``padding_mask`` (``[b, s]``, padding True) are what the model's forward would get.
    """
    _check_table("embedding_table", embedding_table)
    _check_token_ids(token_ids, embedding_table.size(0))
    _check_masks(token_ids, loss_mask=loss_mask, padding_mask=padding_mask)
    _check_int("iteration", iteration, minimum=0)
    device = embedding_table.device
    token_ids, loss_mask, padding_mask = (_to(device, value) for value in (token_ids, loss_mask, padding_mask))
    clean = embedding_table.detach()[token_ids].transpose(0, 1).contiguous()
    if not noise_config.is_active_configuration:
        return clean.transpose(0, 1).float()
    batch = NoiseBatchInputs(loss_mask=loss_mask, padding_mask=padding_mask, input_ids=token_ids)
    noised = _noise_layer(noise_config)(clean, batch, NoiseClock(iteration=iteration))
    return noised.transpose(0, 1).float()


def _real_tokens(
    config: NoiseConfig,
    embeddings: torch.Tensor,
    loss_mask: torch.Tensor | None,
    padding_mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[b, s]`` real-token mask (not padding) and true sequence lengths, as the noise layer sees them."""
    layer = _noise_layer(config)
    batch = NoiseBatchInputs(
        loss_mask=_to(embeddings.device, loss_mask), padding_mask=_to(embeddings.device, padding_mask)
    )
    geometry = layer.geometry(embeddings.transpose(0, 1), batch, layer.layout())
    return geometry.valid.t(), geometry.lengths.t()


# Chunked top-k search


@dataclass(frozen=True)
class _Scoring:
    """How a search ranks table rows for a query (higher is better).

    ``l2``: minus the squared distance; ``cosine``: cosine similarity; ``gaussian``: ``-|y - e|^2 / (2 s^2)``;
    ``relative``: the Gaussian log-likelihood with std ``s * rms(e)``; ``metric_dp``: ``-eta |y - e|`` (the d_chi
    density). ``scale`` holds the per-query ``s`` or ``eta``; rows are clipped to ``clip_norm`` first when set.
    """

    kind: Literal["l2", "cosine", "gaussian", "relative", "metric_dp"]
    clip_norm: float | None = None
    scale: torch.Tensor | None = None


def _prepare_rows(rows: torch.Tensor, scoring: _Scoring) -> torch.Tensor:
    rows = rows.detach().float()
    if scoring.clip_norm is not None:
        # The same factor as the noise layer's clipping: min(1, C / |e|).
        norms = rows.norm(dim=-1, keepdim=True)
        rows = rows * (scoring.clip_norm / norms.clamp_min(_TINY)).clamp_max(1.0)
    if scoring.kind == "cosine":
        rows = F.normalize(rows, dim=-1, eps=_TINY)
    return rows


def _squared_distances(queries: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    squared = queries.pow(2).sum(-1, keepdim=True) - 2.0 * queries @ rows.t() + rows.pow(2).sum(-1)
    return squared.clamp_min(0.0)


def _scores(scoring: _Scoring, queries: torch.Tensor, rows: torch.Tensor, index: slice) -> torch.Tensor:
    """``[n, v]`` scores of the query chunk ``queries`` (rows ``index`` of all queries) against prepared rows."""
    if scoring.kind == "cosine":
        return F.normalize(queries, dim=-1, eps=_TINY) @ rows.t()
    squared = _squared_distances(queries, rows)
    if scoring.kind == "l2":
        return -squared
    scale = scoring.scale[index].unsqueeze(1)
    if scoring.kind == "gaussian":
        return -squared / (2.0 * scale.square())
    if scoring.kind == "metric_dp":
        return -scale * squared.sqrt()
    rms = rows.pow(2).mean(-1).sqrt().clamp_min(_TINY)
    return -squared / (2.0 * (scale * rms).square()) - rows.size(1) * rms.log()


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


def _search(
    queries: torch.Tensor,
    table: torch.Tensor,
    scoring: _Scoring,
    *,
    top_k: int,
    vocab_chunk: int,
    query_chunk: int,
    vocab_start: int = 0,
    group: dist.ProcessGroup | None = None,
    exclude_self: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, top_k]`` best scores and global token ids per query, over this shard and ``group``'s other shards.

    ``exclude_self``: the queries are the table's own rows (query ``i`` is token ``i``), which are skipped.
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
            if exclude_self:
                own = torch.arange(index.start, index.stop, device=device).unsqueeze(1) == ids
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


# Attacks


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
    _check_choice("metric", metric, METRICS)
    _check_search_args(noised, table, top_k=top_k, vocab_chunk=vocab_chunk, query_chunk=query_chunk, group=group)
    _check_int("vocab_start", vocab_start, minimum=0)
    scores, ids = _search(
        noised,
        table,
        _Scoring(metric),
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
    _check_choice("metric", metric, METRICS)
    _check_number("clip_norm", clip_norm)
    _check_search_args(noised, table, top_k=top_k, vocab_chunk=vocab_chunk, query_chunk=query_chunk)
    scoring = _Scoring(metric, clip_norm=float(clip_norm))
    scores, ids = _search(noised, table, scoring, top_k=top_k, vocab_chunk=vocab_chunk, query_chunk=query_chunk)
    return Neighbours(ids[:, 0], ids, scores)


def _noise_likelihood(
    config: NoiseConfig,
    noised: torch.Tensor,
    iteration: int,
    loss_mask: torch.Tensor | None,
    padding_mask: torch.Tensor | None,
) -> _Scoring:
    """The beam attack's noise log-likelihood for ``[b, s, h]`` observations (see ``lm_beam_attack``)."""
    batch, seq = noised.shape[:2]
    device = noised.device
    factor = schedule_factor(config, iteration)
    mechanism = config.mechanism

    def per_token(value: float) -> torch.Tensor:
        return torch.full((batch * seq,), max(value, _MIN_SCALE), device=device)

    if not config.is_active_configuration:
        return _Scoring("gaussian", scale=per_token(0.0))
    if mechanism == "metric_dp":
        return _Scoring("metric_dp", clip_norm=config.clip_norm, scale=per_token(config.eta))
    if mechanism == "gaussian_mechanism":
        return _Scoring("gaussian", clip_norm=config.clip_norm, scale=per_token(config.dp_sigma))
    if mechanism == "relative":
        return _Scoring("relative", scale=per_token(factor * config.relative_scale))
    if mechanism == "quantization":
        return _Scoring("gaussian", scale=per_token(factor * config.quantization_step / (2.0 * math.sqrt(3.0))))
    spread = config.sigma if mechanism == "gaussian" else config.alpha / math.sqrt(3.0)
    std = factor * spread * _length_scale(config, noised, loss_mask, padding_mask)
    return _Scoring("gaussian", scale=std.reshape(-1).clamp_min(_MIN_SCALE))


def _length_scale(
    config: NoiseConfig, noised: torch.Tensor, loss_mask: torch.Tensor | None, padding_mask: torch.Tensor | None
) -> torch.Tensor:
    """``[b, s]`` NEFTune factor ``c``: ``1/sqrt(L d)`` with the true or padded length ``L``, or 1 (absolute)."""
    batch, seq, hidden = noised.shape
    if config.scaling == "absolute":
        return torch.ones(batch, seq, device=noised.device)
    if config.scaling == "padded_length":
        return torch.full((batch, seq), 1.0 / math.sqrt(seq * hidden), device=noised.device)
    _, lengths = _real_tokens(config, noised, loss_mask, padding_mask)
    return torch.rsqrt(lengths.clamp_min(1.0) * hidden)


@torch.no_grad()
def lm_beam_attack(
    noised: torch.Tensor,
    table: torch.Tensor,
    noise_config: NoiseConfig,
    lm_log_probs: LmLogProbs,
    *,
    iteration: int = 0,
    loss_mask: torch.Tensor | None = None,
    padding_mask: torch.Tensor | None = None,
    candidates: int = 8,
    beam_width: int = 4,
    lm_weight: float = 1.0,
    sequence_chunk: int = 64,
    vocab_chunk: int = DEFAULT_VOCAB_CHUNK,
    query_chunk: int = DEFAULT_QUERY_CHUNK,
) -> torch.Tensor:
    """The ``[b, s]`` token sequences that best explain ``noised`` (``[b, s, h]``) under noise and a language model.

    Per position the ``candidates`` tokens of highest noise log-likelihood are kept; a beam of ``beam_width``
    sequences then runs left to right, scoring ``sum_t loglik_t + lm_weight * log p_LM(token_t | tokens_<t)``
    (the first token by its likelihood alone) with ``lm_log_probs(prefix_ids [rows, t]) -> [rows, >= V]``.
    Sequences go to the LM ``sequence_chunk`` at a time (``sequence_chunk * beam_width`` rows per call).

    Noise log-likelihood of candidate ``e`` for observation ``y`` (per-token constants dropped), from
    ``noise_config``, ``iteration`` (schedule factor ``f``) and the masks (sequence lengths, as in training):

    - gaussian: ``-|y - e|^2 / (2 s^2)``, ``s = f sigma c`` with NEFTune's length factor ``c``;
    - uniform (NEFTune) and quantization: the same Gaussian form with the noise's standard deviation,
      ``s = f alpha c / sqrt(3)`` and ``s = f D / (2 sqrt(3))`` (a smooth stand-in for the box-shaped density);
    - gaussian_mechanism: ``-|y - clip(e)|^2 / (2 sigma_dp^2)``;
    - metric_dp: ``-eta |y - clip(e)|``, the exact d_chi density (clipped when ``clip_norm`` is set);
    - relative: the Gaussian log-likelihood with std ``f rho rms(e)``,
      ``-|y - e|^2 / (2 (f rho rms(e))^2) - d log rms(e)``.

    Every position is scored as noised; an unnoised token (padding, special, unselected) equals its own row and
    is explained best by it. A configuration without noise uses a vanishing scale (nearest neighbour).
    """
    _check_table("table", table)
    if not callable(lm_log_probs):
        raise ValueError(f"lm_log_probs={lm_log_probs!r} is invalid: expected a callable prefix_ids -> log-probs.")
    if not isinstance(noised, torch.Tensor) or noised.dim() != 3 or noised.size(-1) != table.size(1):
        raise ValueError(
            f"noised has shape {_shape(noised)}: expected [b, s, h] with h = the table's hidden size {table.size(1)}."
        )
    batch, seq, hidden = noised.shape
    _check_search_args(
        noised.reshape(-1, hidden), table, top_k=candidates, vocab_chunk=vocab_chunk, query_chunk=query_chunk
    )
    _check_int("iteration", iteration, minimum=0)
    _check_int("beam_width", beam_width, minimum=1)
    _check_int("sequence_chunk", sequence_chunk, minimum=1)
    _check_number("lm_weight", lm_weight, minimum=0.0)
    scoring = _noise_likelihood(noise_config, noised, iteration, loss_mask, padding_mask)
    scores, ids = _search(
        noised.reshape(-1, hidden), table, scoring, top_k=candidates, vocab_chunk=vocab_chunk, query_chunk=query_chunk
    )
    scores, ids = scores.view(batch, seq, -1).double(), ids.view(batch, seq, -1)
    parts = [
        _beam_search(
            scores[first : first + sequence_chunk],
            ids[first : first + sequence_chunk],
            lm_log_probs,
            beam_width=beam_width,
            lm_weight=float(lm_weight),
            vocab_size=table.size(0),
        )
        for first in range(0, batch, sequence_chunk)
    ]
    return torch.cat(parts) if parts else ids[..., 0]


def _beam_search(
    noise_scores: torch.Tensor,
    candidates: torch.Tensor,
    lm_log_probs: LmLogProbs,
    *,
    beam_width: int,
    lm_weight: float,
    vocab_size: int,
) -> torch.Tensor:
    """Best ``[b, s]`` sequences from per-position candidates ``[b, s, K]`` and their noise log-likelihoods."""
    batch, seq, width = candidates.shape
    beams = candidates[:, 0, :beam_width].unsqueeze(-1)  # [b, B, t]
    totals = noise_scores[:, 0, :beam_width]  # [b, B]
    for position in range(1, seq):
        live = beams.size(1)
        prior = _lm_scores(lm_log_probs, beams, vocab_size)
        step = candidates[:, position]
        step_prior = prior.gather(2, step.unsqueeze(1).expand(-1, live, -1))  # [b, B, K]
        expanded = totals.unsqueeze(2) + noise_scores[:, position].unsqueeze(1) + lm_weight * step_prior
        totals, flat = expanded.flatten(1).sort(dim=1, descending=True, stable=True)
        totals, flat = totals[:, :beam_width], flat[:, :beam_width]
        parent, choice = flat // width, flat % width
        history = beams.gather(1, parent.unsqueeze(-1).expand(-1, -1, position))
        beams = torch.cat([history, step.gather(1, choice).unsqueeze(-1)], dim=2)
    return beams[:, 0]


def _lm_scores(lm_log_probs: LmLogProbs, beams: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[b, B, V]`` float64 next-token log-probabilities after each beam's prefix."""
    batch, live, length = beams.shape
    rows = batch * live
    log_probs = lm_log_probs(beams.reshape(rows, length))
    if not isinstance(log_probs, torch.Tensor) or log_probs.dim() != 2 or log_probs.size(0) != rows:
        raise ValueError(
            f"lm_log_probs returned shape {_shape(log_probs)} for {rows} prefixes: "
            f"expected [{rows}, V >= {vocab_size}]."
        )
    if log_probs.size(1) < vocab_size:
        raise ValueError(
            f"lm_log_probs returned {log_probs.size(1)} columns: expected at least the table's {vocab_size} tokens."
        )
    return log_probs.to(device=beams.device, dtype=torch.float64).view(batch, live, -1)


@torch.no_grad()
def median_nearest_neighbour_distance(
    table: torch.Tensor, *, vocab_chunk: int = DEFAULT_VOCAB_CHUNK, query_chunk: int = DEFAULT_QUERY_CHUNK
) -> float:
    """The median over rows of the L2 distance to the nearest *other* row: the noise norm that starts to confuse."""
    _check_table("table", table)
    if table.size(0) < 2:
        raise ValueError(f"table has shape {_shape(table)}: expected at least 2 rows to have neighbours.")
    _check_search_args(table, table, top_k=1, vocab_chunk=vocab_chunk, query_chunk=query_chunk)
    _, ids = _search(
        table, table, _Scoring("l2"), top_k=1, vocab_chunk=vocab_chunk, query_chunk=query_chunk, exclude_self=True
    )
    # The distances are recomputed from the differences: the expansion behind the search loses precision near 0.
    distances = [
        (table[first : first + query_chunk].float() - table[ids[first : first + query_chunk, 0]].float()).norm(dim=-1)
        for first in range(0, table.size(0), query_chunk)
    ]
    return float(torch.cat(distances).median())


# Recovery statistics


def wilson_interval(successes: int, trials: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion; ``(0, 1)`` without trials."""
    _check_int("trials", trials, minimum=0)
    _check_int("successes", successes, minimum=0, maximum=trials)
    _check_confidence(confidence)
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
            f"predicted_ids has shape {_shape(predicted_ids)}: expected true_ids's shape {_shape(true_ids)}."
        )
    _check_confidence(confidence)
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
    _check_number("quantile", quantile, minimum=0.0, maximum=1.0)
    if not isinstance(token_ids, torch.Tensor) or token_ids.dtype not in _INTEGER_DTYPES:
        raise ValueError(f"token_ids has shape {_shape(token_ids)}: expected an integer tensor of token ids.")
    if token_ids.numel() == 0:
        return []
    ids, counts = token_ids.reshape(-1).unique(return_counts=True)
    threshold = torch.quantile(counts.double(), quantile)
    return ids[counts <= threshold].tolist()


# The audit


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
) -> dict[str, Any]:
    """Run ``attacks`` on the exact noised embeddings of ``token_ids`` (``[b, s]``) and report (JSON-serialisable).

    ``attacks`` are from ``ATTACKS``: ``nn_l2``, ``nn_cosine`` (``nearest_neighbour_attack``), ``direction``
    (``direction_attack`` at the config's ``clip_norm``) and ``lm_beam`` (``lm_beam_attack``, needs
    ``lm_log_probs``). Recovery is counted over the real (non-padding) tokens; ``rare_ids`` default to
    ``rare_token_ids`` of those tokens at ``rare_quantile``, ``special_ids`` to the config's ``special_token_ids``.
    The report also has the observed noise norm per noised token (median, mean) and the vocabulary's
    ``median_nearest_neighbour_distance``.
    """
    attacks = _check_attacks(attacks, noise_config, lm_log_probs)
    noised = noised_embeddings(
        table, token_ids, noise_config, iteration=iteration, loss_mask=loss_mask, padding_mask=padding_mask
    )
    token_ids = token_ids.to(table.device)
    real, _ = _real_tokens(noise_config, noised, loss_mask, padding_mask)
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
    neighbour_distance = median_nearest_neighbour_distance(table, **search)
    return {
        "noise_config": dataclasses.asdict(noise_config),
        "iteration": iteration,
        "tokens": {"real": int(real.sum()), "rare_ids": len(rare), "special_ids": len(special)},
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


# Argument checks


def _to(device: torch.device, tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.to(device)


def _shape(value: object) -> str:
    return str(list(value.shape)) if isinstance(value, torch.Tensor) else repr(value)


def _check_int(name: str, value: object, *, minimum: int, maximum: int | None = None) -> None:
    valid = not isinstance(value, bool) and isinstance(value, int) and value >= minimum
    if not valid or (maximum is not None and value > maximum):
        bound = f"in [{minimum}, {maximum}]" if maximum is not None else f">= {minimum}"
        raise ValueError(f"{name}={value!r} is invalid: expected an integer {bound}.")


def _check_number(name: str, value: object, *, minimum: float | None = None, maximum: float | None = None) -> None:
    """A finite number, ``> 0`` unless ``minimum`` is given (then ``>= minimum``), and ``<= maximum``."""
    valid = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    valid = valid and (value > 0 if minimum is None else value >= minimum)
    if not valid or (maximum is not None and value > maximum):
        bound = "> 0" if minimum is None else f">= {minimum:g}"
        bound += f" and <= {maximum:g}" if maximum is not None else ""
        raise ValueError(f"{name}={value!r} is invalid: expected a finite number {bound}.")


def _check_confidence(confidence: object) -> None:
    valid = not isinstance(confidence, bool) and isinstance(confidence, (int, float)) and 0.0 < confidence < 1.0
    if not valid:
        raise ValueError(f"confidence={confidence!r} is invalid: expected a number in (0, 1), e.g. 0.95.")


def _check_choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is invalid: expected one of {', '.join(allowed)}.")


def _check_table(name: str, table: object) -> None:
    if not isinstance(table, torch.Tensor) or table.dim() != 2 or not table.is_floating_point() or table.size(0) == 0:
        raise ValueError(f"{name} has shape {_shape(table)}: expected a floating-point [V, h] tensor with V >= 1.")


def _check_token_ids(token_ids: object, vocab_size: int) -> None:
    if not isinstance(token_ids, torch.Tensor) or token_ids.dim() != 2 or token_ids.dtype not in _INTEGER_DTYPES:
        raise ValueError(f"token_ids has shape {_shape(token_ids)}: expected an integer [b, s] tensor.")
    if token_ids.numel() and (int(token_ids.min()) < 0 or int(token_ids.max()) >= vocab_size):
        raise ValueError(
            f"token_ids has values in [{int(token_ids.min())}, {int(token_ids.max())}]: expected ids in "
            f"[0, {vocab_size - 1}] (the embedding table's rows)."
        )


def _check_masks(token_ids: torch.Tensor, **masks: torch.Tensor | None) -> None:
    for name, mask in masks.items():
        if mask is not None and (not isinstance(mask, torch.Tensor) or mask.shape != token_ids.shape):
            raise ValueError(f"{name} has shape {_shape(mask)}: expected token_ids's shape {_shape(token_ids)}.")


def _check_search_args(
    queries: object,
    table: object,
    *,
    top_k: int,
    vocab_chunk: int,
    query_chunk: int,
    group: dist.ProcessGroup | None = None,
) -> None:
    _check_table("table", table)
    if not isinstance(queries, torch.Tensor) or queries.dim() != 2 or queries.size(1) != table.size(1):
        raise ValueError(
            f"noised has shape {_shape(queries)}: expected [N, h] with h = the table's hidden size {table.size(1)}."
        )
    if queries.device != table.device:
        raise ValueError(f"noised is on {queries.device} and table on {table.device}: expected one device.")
    sharded = group is not None and dist.get_world_size(group) > 1
    _check_int("top_k", top_k, minimum=1, maximum=None if sharded else table.size(0))
    _check_int("vocab_chunk", vocab_chunk, minimum=1)
    _check_int("query_chunk", query_chunk, minimum=1)


def _check_attacks(attacks: Sequence[str], config: NoiseConfig, lm_log_probs: LmLogProbs | None) -> tuple[str, ...]:
    if isinstance(attacks, str) or not attacks:
        raise ValueError(f"attacks={attacks!r} is invalid: expected a non-empty list from {', '.join(ATTACKS)}.")
    for attack in attacks:
        _check_choice("attacks", attack, ATTACKS)
    if "lm_beam" in attacks and lm_log_probs is None:
        raise ValueError("attacks includes 'lm_beam' but lm_log_probs=None: expected a callable prefix -> log-probs.")
    if "direction" in attacks and config.clip_norm is None:
        raise ValueError(
            f"attacks includes 'direction' but the noise config (mechanism={config.mechanism!r}) has clip_norm=None: "
            "expected a clipped mechanism (gaussian_mechanism, or metric_dp with clip_norm)."
        )
    return tuple(attacks)
