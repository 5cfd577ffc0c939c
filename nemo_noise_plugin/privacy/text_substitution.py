"""Text-level substitution, the baseline of embedding noise: each private token replaced by a sampled token.

SANTEXT (Yue et al., "Differential Privacy for Text Analytics via Natural Text Sanitization", ACL Findings 2021)
releases *text*: each protected token ``x`` becomes ``y`` drawn by the exponential mechanism over the vocabulary with
the embedding distance as the utility, ``P(y | x) ∝ exp(-scale * |e_x - e_y|)``. Here the rows are clipped to norm
``C`` as the embedding mechanisms clip them, so two rows are at most ``2C`` apart, and

- ``guarantee="pure"``: ``scale = eps / (2 * 2C)``: every token's release is ``eps``-DP (pure, delta 0) against any
  replacement of the token (the utility's sensitivity is ``2C``; the 2 is the exponential mechanism's);
- ``guarantee="metric"``: ``scale = eta / 2``: ``eta * |e_x - e_x'|``-metric DP (d_chi privacy on the token), the
  guarantee of the metric-DP embedding mechanism at the same ``eta``.

So "the same per-token eps" as the Gaussian mechanism (eps, delta 1e-5) means the same eps with delta 0 here (a
stronger guarantee at equal eps), and as metric-DP the same eta. The output is token ids: a model reads ordinary
text, which is what makes this the decode-then-answer baseline at the text level. Sampling is Gumbel-max over
vocabulary chunks (exact for the softmax above), seeded, bounded in memory.
"""

from __future__ import annotations

from typing import Literal

import torch

from nemo_noise_plugin.validation import check_choice, check_int, check_number

__all__ = ["substitute_tokens", "substitution_probabilities", "substitution_scale"]

Guarantee = Literal["pure", "metric"]
GUARANTEES = ("pure", "metric")
_TINY = torch.finfo(torch.float32).tiny


def substitution_scale(epsilon: float, clip_norm: float, guarantee: Guarantee = "pure") -> float:
    """The exponent's factor on the distance: ``eps / (4C)`` for a pure guarantee, ``eta / 2`` for a metric one."""
    check_number("epsilon", epsilon, minimum=0.0, inclusive=False)
    check_number("clip_norm", clip_norm, minimum=0.0, inclusive=False)
    check_choice("guarantee", guarantee, GUARANTEES)
    return epsilon / (4.0 * clip_norm) if guarantee == "pure" else epsilon / 2.0


def _clipped(table: torch.Tensor, clip_norm: float) -> torch.Tensor:
    rows = table.detach().float()
    return rows * (clip_norm / rows.norm(dim=-1, keepdim=True).clamp_min(_TINY)).clamp_max(1.0)


def substitution_probabilities(
    token_ids: torch.Tensor, table: torch.Tensor, *, epsilon: float, clip_norm: float, guarantee: Guarantee = "pure"
) -> torch.Tensor:
    """``[N, V]`` float64 ``P(y | x)`` of each of the ``[N]`` tokens (small tables: tests and audits)."""
    scale = substitution_scale(epsilon, clip_norm, guarantee)
    rows = _clipped(table, clip_norm).double()
    distances = torch.cdist(rows[token_ids.flatten()], rows)
    return torch.softmax(-scale * distances, dim=-1)


@torch.no_grad()
def substitute_tokens(
    token_ids: torch.Tensor,
    table: torch.Tensor,
    mask: torch.Tensor,
    *,
    epsilon: float,
    clip_norm: float,
    guarantee: Guarantee = "pure",
    seed: int = 0,
    max_elements: int = 32 * 2**20,
) -> torch.Tensor:
    """``token_ids`` with every position where ``mask`` is True replaced by a token drawn from
    ``P(y | x) ∝ exp(-scale * |clip(e_x) - clip(e_y)|)`` (``substitution_scale``); other positions unchanged.

    ``table`` is the ``[V, h]`` embedding table the distances are taken in (the model's own); ``seed`` fixes the
    draw. Example::

        released = substitute_tokens(ids, model.embedding.word_embeddings.weight, private_mask, epsilon=20.0,
                                     clip_norm=3.0)
    """
    if token_ids.shape != mask.shape:
        raise ValueError(f"mask has shape {tuple(mask.shape)}, expected token_ids' shape {tuple(token_ids.shape)}")
    check_int("max_elements", max_elements, minimum=1)
    scale = substitution_scale(epsilon, clip_norm, guarantee)
    rows = _clipped(table, clip_norm)
    out = token_ids.clone()
    picked = mask.bool().to(token_ids.device)
    sources = token_ids[picked].to(rows.device)
    if sources.numel() == 0:
        return out
    generator = torch.Generator(device=rows.device).manual_seed(seed)
    chunk = max(1, max_elements // rows.size(0))
    drawn = []
    for start in range(0, sources.numel(), chunk):
        queries = rows[sources[start : start + chunk]]
        logits = -scale * torch.cdist(queries, rows)
        uniform = torch.rand(logits.shape, generator=generator, device=rows.device).clamp_min(_TINY)
        drawn.append((logits - torch.log(-torch.log(uniform))).argmax(-1))  # Gumbel-max: a softmax draw
    out[picked] = torch.cat(drawn).to(out.device, out.dtype)
    return out
