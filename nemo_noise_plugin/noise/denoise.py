"""Posterior-mean denoising: each noised token's embedding replaced by the mean of the table rows given its release.

``NoiseConfig.projection='posterior_mean'``. The noise layer releases ``y = clip(e) + z`` with ``z`` of the
mechanism's density ``p``; with a uniform prior over the table rows the Bayes (MMSE) estimate of the clean embedding
is ``E[e | y] = sum_v w_v e_v`` with ``w_v = p(y | e_v) / sum_u p(y | e_u)`` and log-weights (up to a constant)

``log p(y | clip(e_v))`` of the mechanism's attacker density (``noise.densities.NOISE_DENSITIES``: ``gaussian``,
``laplace``, ``metric_dp``, ...) at the mechanism's own scale (``NoiseFamily.attacker_noise``: the density and scale
the privacy audit's attacker scores with). Nearest-row projection is the hard (MAP) version of it. It reads
nothing but the release and the public table: post-processing, so the mechanism's DP guarantee is unchanged.

Vocabulary-parallel tables: each tensor-parallel rank runs a chunked, online log-sum-exp over its shard (blocks of
at most ``max_elements`` scores) keeping the running maximum, the sum of exponentials and the weighted sum of its
rows; the maxima are all-reduced (MAX), the sums rescaled and all-reduced (SUM), as in a vocabulary-parallel
softmax, and the local weighted sums are all-reduced (reduce-scattered under sequence parallelism, after the local
noised tokens were gathered, as ``project_noised`` does). The weights carry no gradient: the table rows get
``w_v`` times the upstream gradient (a soft embedding lookup, recomputed chunk by chunk in the backward pass, so
memory stays ``O(max_elements)``); nothing flows to the noise.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.noise.densities import NOISE_DENSITIES, noise_density
from nemo_noise_plugin.noise.families import noise_family
from nemo_noise_plugin.noise.projection import (
    DEFAULT_MAX_ELEMENTS,
    NO_ROW,
    Projection,
    TableQueries,
    _group_size,
    _prepared_rows,
    nearest_rows,
    project_noised,
)
from nemo_noise_plugin.noise.token_prior import read_token_prior
from nemo_noise_plugin.validation import SettingError, check_choice, check_int

__all__ = ["denoise_noised", "posterior_mean_noised", "posterior_mean_rows", "posterior_scale"]

_NO_ID = torch.iinfo(torch.int64).max


def _blocks(vocab: int, hidden: int, max_elements: int) -> tuple[int, int]:
    vocab_chunk = max(1, min(vocab, max_elements // hidden))
    return vocab_chunk, max(1, max_elements // vocab_chunk)


class _SoftLookup(torch.autograd.Function):
    """This rank's part ``sum_{v in shard} w_v e_v`` of the posterior mean; backward: ``w^T grad`` to the rows."""

    @staticmethod
    def forward(ctx, queries, table, density, scale, clip_norm, vocab_start, group, max_elements, log_prior):
        count, hidden = queries.shape
        log_likelihood = noise_density(density).log_likelihood
        peak = torch.full((count,), -math.inf, device=queries.device)
        total = torch.zeros(count, device=queries.device)
        weighted = torch.zeros(count, hidden, device=queries.device)
        best_ids = torch.full((count,), _NO_ID, dtype=torch.int64, device=queries.device)
        vocab_chunk, query_chunk = _blocks(table.size(0), hidden, max_elements)
        for start in range(0, table.size(0), vocab_chunk):
            raw = table[start : start + vocab_chunk].detach().float()
            rows = _prepared_rows(raw, "l2", clip_norm)
            for first in range(0, count, query_chunk):
                index = slice(first, first + query_chunk)
                logits = _prior_logits(log_likelihood(queries[index], rows, scale), log_prior, start, vocab_chunk)
                values, columns = logits.max(dim=1)  # the first of equal maxima: the smallest id of this chunk
                better = values > peak[index]
                best_ids[index] = torch.where(better, columns + (vocab_start + start), best_ids[index])
                # Rows of prior 0 score -inf; a block with no row of the prior's support leaves the peak at -inf.
                new_peak = torch.maximum(peak[index], values)
                shift = torch.where(torch.isfinite(new_peak), new_peak, torch.zeros_like(new_peak))
                decay = torch.exp(peak[index] - shift)  # exp(-inf) = 0 on the first block
                weights = torch.exp(logits - shift.unsqueeze(1))
                total[index] = total[index] * decay + weights.sum(1)
                weighted[index] = weighted[index] * decay.unsqueeze(1) + weights @ raw
                peak[index] = new_peak
        if count and _group_size(group) > 1:  # every rank has the same queries, so all skip or none
            local_peak = peak.clone()
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
            best_ids = torch.where(local_peak == peak, best_ids, torch.full_like(best_ids, _NO_ID))
            dist.all_reduce(best_ids, op=dist.ReduceOp.MIN, group=group)
            decay = torch.exp(local_peak - peak)  # a shard far from every query contributes 0
            total, weighted = total * decay, weighted * decay.unsqueeze(1)
            dist.all_reduce(total, group=group)
        log_normaliser = peak + total.log()
        ctx.save_for_backward(queries, table, log_normaliser)
        ctx.settings = (density, scale, clip_norm, max_elements, log_prior)
        ctx.mark_non_differentiable(best_ids)
        return (weighted / total.unsqueeze(1)).to(table.dtype), best_ids

    @staticmethod
    def backward(ctx, grad_output, _grad_ids):
        queries, table, log_normaliser = ctx.saved_tensors
        density, scale, clip_norm, max_elements, log_prior = ctx.settings
        log_likelihood = noise_density(density).log_likelihood
        grad_output = grad_output.float()
        grad_table = torch.zeros(table.shape, device=table.device)
        vocab_chunk, query_chunk = _blocks(table.size(0), queries.size(1), max_elements)
        for start in range(0, table.size(0), vocab_chunk):
            rows = _prepared_rows(table[start : start + vocab_chunk], "l2", clip_norm)
            for first in range(0, queries.size(0), query_chunk):
                index = slice(first, first + query_chunk)
                logits = _prior_logits(log_likelihood(queries[index], rows, scale), log_prior, start, vocab_chunk)
                weights = torch.exp(logits - log_normaliser[index].unsqueeze(1))
                grad_table[start : start + vocab_chunk] += weights.t() @ grad_output[index]
        return None, grad_table.to(table.dtype), None, None, None, None, None, None, None


def _prior_logits(logits: torch.Tensor, log_prior: torch.Tensor | None, start: int, count: int) -> torch.Tensor:
    """``logits`` (``[queries, rows]`` log-likelihoods of the rows ``start ..``) plus the rows' log-prior."""
    return logits if log_prior is None else logits + log_prior[start : start + count].unsqueeze(0)


def _partial_posterior_mean(
    queries: torch.Tensor,
    table: torch.Tensor,
    *,
    density: str,
    scale: float,
    clip_norm: float | None,
    vocab_start: int,
    group: dist.ProcessGroup | None,
    max_elements: int,
    log_prior: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    check_choice("posterior_mean_rows: density", density, tuple(NOISE_DENSITIES))
    check_int("posterior_mean_rows: max_elements", max_elements, minimum=1)
    if queries.dim() != 2 or table.dim() != 2 or queries.size(1) != table.size(1):
        raise ValueError(
            f"posterior_mean_rows: queries {list(queries.shape)} and table {list(table.shape)} are invalid: expected "
            "[N, h] queries and a [V, h] table of the same h."
        )
    if log_prior is not None and (log_prior.dim() != 1 or log_prior.size(0) != table.size(0)):
        raise ValueError(
            f"posterior_mean_rows: log_prior {list(log_prior.shape)} is invalid: expected [{table.size(0)}], one "
            "log-prior per row of the table (shard)."
        )
    queries = queries.detach().float()
    if not scale > 0 and log_prior is not None:
        raise SettingError(
            "NoiseConfig.projection_prior",
            "a prior",
            "None",
            context=f" with noise scale {scale}",
            why=": without noise the posterior is the own row whatever the prior",
        )
    if not scale > 0:  # no noise: the posterior is the own (nearest) row, the limit scale -> 0
        ids = nearest_rows(
            queries, table, clip_norm=clip_norm, vocab_start=vocab_start, group=group, max_elements=max_elements
        )
        local = ids - vocab_start
        own = (local >= 0) & (local < table.size(0))
        rows = table[torch.where(own, local, torch.zeros_like(local))] * own.unsqueeze(-1).to(table.dtype)
        return rows, ids
    if log_prior is not None:
        log_prior = log_prior.to(device=queries.device, dtype=torch.float32)
    return _SoftLookup.apply(
        queries, table, density, float(scale), clip_norm, vocab_start, group, max_elements, log_prior
    )


def posterior_mean_rows(
    queries: torch.Tensor,
    table: torch.Tensor,
    *,
    density: str,
    scale: float,
    clip_norm: float | None = None,
    vocab_start: int = 0,
    group: dist.ProcessGroup | None = None,
    max_elements: int = DEFAULT_MAX_ELEMENTS,
    log_prior: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The posterior mean ``[N, h]`` of the rows of ``table`` given each of the ``[N, h]`` releases ``queries``,
    and ``[N]`` the most likely (MAP) row id of each.

    ``density`` (a row of ``NOISE_DENSITIES``: ``gaussian``, ``metric_dp``, ``laplace``) and ``scale`` (sigma,
    ``1/eta``, ``b``) are the mechanism's noise; the rows are clipped to ``clip_norm`` in the likelihood when given,
    the mean is of the unclipped rows. The prior is uniform over the rows, or ``log_prior`` (``[V]``, one per row of
    ``table``, ``-inf`` for a row of prior 0: ``noise.token_prior.TokenPrior.log_prior``), and the MAP row is then the
    most probable one under it. ``table`` may be this rank's vocabulary shard (global ids ``vocab_start``..) of the
    tensor-parallel ``group``; every rank passes the same queries and gets the same result. Differentiable in
    ``table`` as a soft lookup with the weights held fixed. ``scale == 0`` gives the nearest (own) row (no prior).

    Example::

        means, ids = posterior_mean_rows(noised, model.get_input_embeddings().weight, density="gaussian", scale=0.3)
    """
    means, ids = _partial_posterior_mean(
        queries,
        table,
        density=density,
        scale=scale,
        clip_norm=clip_norm,
        vocab_start=vocab_start,
        group=group,
        max_elements=max_elements,
        log_prior=log_prior,
    )
    if _group_size(group) > 1:
        from megatron.core import tensor_parallel

        means = tensor_parallel.reduce_from_tensor_model_parallel_region(means, group=group)
    return means, ids


def posterior_scale(config: NoiseConfig, hidden_size: int) -> float:
    """The scale of ``config``'s noise density (``NoiseFamily.attacker_noise``): sigma, ``1/eta`` or ``b``.

    ``config.validate()`` has refused the families whose scale is not one number (``NoiseConfig`` ``projection``)."""
    ones = torch.ones(1)
    return float(noise_family(config.mechanism).attacker_noise(config, ones, 1, hidden_size).scale[0])


def posterior_mean_noised(
    noised: torch.Tensor,
    selected: torch.Tensor,
    embedding: Any,
    config: NoiseConfig,
    sequence_parallel: bool = False,
    *,
    group: dist.ProcessGroup | None = None,
    max_elements: int = DEFAULT_MAX_ELEMENTS,
) -> Projection:
    """``noised`` (``[s, b, h]``) with each ``selected`` (``[s, b]``) token replaced by its posterior mean.

    Arguments as ``projection.project_noised``; the ``Projection.ids`` are the MAP rows (under ``gaussian`` without a
    prior the clipped-l2 nearest rows). The prior over the rows is ``config.projection_prior``'s (uniform without
    one). Unselected tokens are returned as they are, with their gradients.
    """
    table = TableQueries.of(noised, selected, embedding, sequence_parallel, group)
    weight, group = table.weight, table.group
    family = noise_family(config.mechanism)
    log_prior = None
    if config.projection_prior is not None:
        prior = read_token_prior(config.projection_prior)
        rows_in_all = int(getattr(embedding, "num_embeddings", weight.size(0)))
        if prior.vocab_size > rows_in_all:
            raise SettingError(
                "NoiseConfig.projection_prior",
                config.projection_prior,
                f"a prior over at most the table's {rows_in_all} rows",
                why=f": it is over vocab_size={prior.vocab_size} tokens",
            )
        log_prior = prior.log_prior(weight.size(0), start=table.vocab_start, device=weight.device)
    means, ids = _partial_posterior_mean(
        table.queries[table.chosen],
        weight,
        density=family.attacker_density,
        scale=posterior_scale(config, weight.size(1)),
        clip_norm=float(config.clip_norm) if family.clips(config) else None,
        vocab_start=table.vocab_start,
        group=group,
        max_elements=max_elements,
        log_prior=log_prior,
    )
    chosen = table.chosen
    all_ids = torch.full(chosen.shape, NO_ROW, dtype=torch.int64, device=noised.device)
    all_ids[chosen] = ids
    rows = means.new_zeros((*chosen.shape, weight.size(1))).index_put((chosen,), means)
    if _group_size(group) > 1:
        from megatron.core import tensor_parallel

        if table.gather:
            rows = tensor_parallel.reduce_scatter_to_sequence_parallel_region(rows, group=group)
        else:
            rows = tensor_parallel.reduce_from_tensor_model_parallel_region(rows, group=group)
    return Projection(torch.where(selected.unsqueeze(-1), rows.to(noised.dtype), noised), all_ids)


def denoise_noised(
    noised: torch.Tensor, selected: torch.Tensor, embedding: Any, config: NoiseConfig, *args: Any, **options: Any
) -> Projection:
    """``config.projection`` applied to the noised tokens: ``posterior_mean_noised`` for ``posterior_mean``,
    ``projection.project_noised`` for ``nearest_row`` (further arguments as there: ``sequence_parallel``,
    ``group``, ``max_elements``); what the noise hooks call."""
    replace = posterior_mean_noised if config.projection == "posterior_mean" else project_noised
    return replace(noised, selected, embedding, config, *args, **options)
