"""The privacy ledger of private spans (``tokens='spans'``): epsilon per protected span and per example.

A span of ``n`` noised tokens trained on for ``E`` epochs makes ``n E`` token releases; neighbouring inputs differ
in every token of the span (per span) or of all the example's spans (per example). Each statement composes the
per-token guarantee of ``privacy.ledger`` over those releases:

- basic composition: ``n E`` times the per-token ``(epsilon, delta)`` (exact for the pure mechanisms, metric-DP
  and Laplace, where it is the only statement);
- for the Gaussian mechanism, the tighter statements the ledger makes for a sequence, with the span's tokens as the
  sequence: ``n E`` Gaussian releases of sensitivity ``2C`` are one Gaussian release of sensitivity
  ``2C sqrt(n E)`` (exact), and the zCDP sum ``n E rho_token`` converted to ``(epsilon, delta)``.

Only the span's own tokens count: the clean tokens around a span are released in the clear and protect nothing, so
a span's guarantee says nothing about them. ``span_token_counts`` reads the spans of a batch's ``private_mask``.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.privacy.ledger import Guarantee, privacy_ledger
from nemo_noise_plugin.validation import SettingError, check_int

__all__ = [
    "SpanGuarantee",
    "SpanLedger",
    "format_span_ledger",
    "protected_span_counts",
    "span_ledger",
    "span_ledger_summary",
    "span_token_counts",
]


@dataclass(frozen=True)
class SpanGuarantee:
    """What one protected span (or all spans of one example) gets: its noised tokens and their composition."""

    tokens: int
    """Noised tokens ``n`` of the span (or of all the example's spans)."""
    releases: int
    """Token releases ``n E``."""
    basic: Guarantee
    """Basic composition: ``n E`` times the per-token (epsilon, delta)."""
    tighter: tuple[Guarantee, ...] = ()
    """The Gaussian mechanism's exact and zCDP statements for these ``n E`` releases (empty for pure DP)."""

    @property
    def epsilon(self) -> float | None:
        """The smallest epsilon among the statements (None without a guarantee)."""
        values = [g.epsilon for g in (self.basic, *self.tighter) if g.epsilon is not None]
        return min(values) if values else None


@dataclass(frozen=True)
class SpanLedger:
    """Per-span and per-example guarantees of ``tokens='spans'`` for examples given as their spans' token counts."""

    mechanism: str
    epochs: int
    per_token: tuple[Guarantee, ...]
    spans: tuple[tuple[SpanGuarantee, ...], ...]
    """Per example, one entry per span, in the given order."""
    examples: tuple[SpanGuarantee, ...]
    """Per example, all its spans together (an example without spans has ``tokens == 0`` and epsilon 0)."""
    assumptions: tuple[str, ...]


def span_token_counts(private_mask: torch.Tensor) -> list[list[int]]:
    """Per row of a ``[b, s]`` private mask, the token count of each span (maximal run of True), left to right.

    >>> span_token_counts(torch.tensor([[0, 1, 1, 0, 1], [0, 0, 0, 0, 0]]).bool())
    [[2, 1], []]
    """
    if not isinstance(private_mask, torch.Tensor) or private_mask.dim() != 2:
        raise SettingError("private_mask", private_mask, "a [b, s] boolean tensor (True inside a private span)")
    counts = []
    for row in private_mask.bool().cpu():
        edges = torch.diff(
            torch.cat([torch.zeros(1, dtype=torch.int8), row.to(torch.int8), torch.zeros(1, dtype=torch.int8)])
        )
        starts, ends = (edges == 1).nonzero().view(-1), (edges == -1).nonzero().view(-1)
        counts.append((ends - starts).tolist())
    return counts


def protected_span_counts(private_mask: torch.Tensor, noised: torch.Tensor) -> list[list[int]]:
    """Per row, the noised-token count of each span of ``private_mask`` (maximal run of True): the span's tokens that
    ``noised`` (``[b, s]``, e.g. ``privacy.audit.noised_tokens``) marks, so a special id inside a span is not
    counted; spans with no noised token are left out (``span_ledger``'s ``span_tokens``).

    >>> protected_span_counts(torch.tensor([[0, 1, 1, 1, 0, 1]]).bool(), torch.tensor([[0, 1, 0, 1, 0, 1]]).bool())
    [[2, 1]]
    """
    if not isinstance(noised, torch.Tensor) or noised.shape != private_mask.shape:
        raise SettingError(
            "noised", noised, f"a [b, s] boolean tensor of the private mask's shape {private_mask.shape}"
        )
    counts = []
    for row, marked in zip(private_mask.bool().cpu(), noised.bool().cpu(), strict=True):
        edges = torch.diff(
            torch.cat([torch.zeros(1, dtype=torch.int8), row.to(torch.int8), torch.zeros(1, dtype=torch.int8)])
        )
        starts, ends = (edges == 1).nonzero().view(-1), (edges == -1).nonzero().view(-1)
        spans = [int(marked[start:end].sum()) for start, end in zip(starts.tolist(), ends.tolist(), strict=True)]
        counts.append([count for count in spans if count > 0])
    return counts


def _composed(config: NoiseConfig, tokens: int, epochs: int, delta: float | None, hidden_size: int | None):
    if tokens == 0:
        return SpanGuarantee(0, 0, Guarantee(0.0, 0.0, "no protected token: nothing released under noise"))
    ledger = privacy_ledger(config, sequence_length=tokens, epochs=epochs, delta=delta, hidden_size=hidden_size)
    releases = tokens * epochs
    if not ledger.per_token or ledger.per_token[0].epsilon is None:
        reason = ledger.assumptions[0] if ledger.assumptions else "no per-token guarantee"
        return SpanGuarantee(tokens, releases, Guarantee(None, 0.0, reason))
    token = ledger.per_token[0]
    basic = Guarantee(
        releases * token.epsilon, min(1.0, releases * token.delta), "basic composition: n E x (epsilon, delta)_token"
    )
    tighter = ledger.per_sequence if token.delta > 0 else ()  # the Gaussian mechanism's exact and zCDP statements
    return SpanGuarantee(tokens, releases, basic, tuple(tighter))


def span_ledger(
    config: NoiseConfig,
    span_tokens: Sequence[Sequence[int]],
    *,
    epochs: int = 1,
    delta: float | None = None,
    hidden_size: int | None = None,
) -> SpanLedger:
    """Epsilon per protected span and per example for ``config`` (``tokens='spans'``), trained on ``epochs`` times.

    Args:
        config: the run's noise settings (``tokens='spans'``).
        span_tokens: per example, the noised-token count of each of its spans (``span_token_counts`` of a batch's
            private mask, minus any ``special_token_ids`` inside a span).
        epochs: passes over each example.
        delta: the delta of the Gaussian mechanism's composed statements; None: ``config.delta``.
        hidden_size: the model's hidden size (required by a clipped ``laplace`` config).

    Example::

        ledger = span_ledger(config, span_token_counts(batch["private_mask"]), epochs=3)
        print(format_span_ledger(ledger))
    """
    if config.tokens != "spans":
        raise SettingError(
            "NoiseConfig.tokens", config.tokens, "'spans'", why=" (span accounting composes over noised span tokens)"
        )
    check_int("span_ledger: epochs", epochs, minimum=1)
    examples, spans = [], []
    for index, counts in enumerate(span_tokens):
        for count in counts:
            check_int(f"span_ledger: span_tokens[{index}]", count, minimum=1)
        spans.append(tuple(_composed(config, count, epochs, delta, hidden_size) for count in counts))
        examples.append(_composed(config, sum(counts), epochs, delta, hidden_size))
    token_ledger = privacy_ledger(config, sequence_length=1, epochs=1, delta=delta, hidden_size=hidden_size)
    assumptions = (
        *token_ledger.assumptions,
        "Per span: neighbouring examples differ in every token of one span; per example: in every token of all its "
        "spans. n counts the span's noised tokens; the clean tokens around a span are released in the clear.",
    )
    return SpanLedger(config.mechanism, epochs, token_ledger.per_token, tuple(spans), tuple(examples), assumptions)


def span_ledger_summary(ledger: SpanLedger) -> dict[str, Any]:
    """The ledger in a report's JSON: span and example counts, epsilon per span by its token count and per example
    (median and max; None where the mechanism has no guarantee), the epochs and the assumptions.

    Example::

        summary = span_ledger_summary(span_ledger(config, [[2, 3], [2]], epochs=2))
        summary["per_span_epsilon"]["by_tokens"]["2"], summary["per_example_epsilon"]["max"]
    """
    spans = [span for example in ledger.spans for span in example]
    by_tokens = {str(n): eps for n, eps in sorted({(span.tokens, span.epsilon) for span in spans}, key=_by_count)}
    return {
        "mechanism": ledger.mechanism,
        "epochs": ledger.epochs,
        "spans": len(spans),
        "examples": len(ledger.examples),
        "span_tokens": {"median": _median([span.tokens for span in spans]), "max": max(s.tokens for s in spans)}
        if spans
        else {"median": None, "max": None},
        "per_token_epsilon": ledger.per_token[0].epsilon if ledger.per_token else None,
        "per_span_epsilon": {**_spread([span.epsilon for span in spans]), "by_tokens": by_tokens},
        "per_example_epsilon": _spread([example.epsilon for example in ledger.examples if example.tokens]),
        "assumptions": list(ledger.assumptions),
    }


def _by_count(pair: tuple[int, float | None]) -> int:
    return pair[0]


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return float(ordered[middle]) if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def _spread(values: Sequence[float | None]) -> dict[str, float | None]:
    """Median and max of epsilons; None for both when there is none or one is unbounded (None)."""
    if not values or any(value is None for value in values):
        return {"median": None, "max": None}
    return {"median": _median(values), "max": max(values)}


def format_span_ledger(ledger: SpanLedger) -> str:
    """Plain text: per example, its spans' and its own token counts and epsilons, then the assumptions."""
    lines = [f"Span privacy ledger: {ledger.mechanism}, E = {ledger.epochs} epoch(s)"]
    for token in ledger.per_token:
        lines.append(f"  per token: epsilon {token.epsilon:.6g} at delta {token.delta:g} ({token.how})")
    for index, (spans, example) in enumerate(zip(ledger.spans, ledger.examples, strict=True)):
        lines.append(f"  example {index}: {example.tokens} protected tokens, epsilon {_shown(example.epsilon)}")
        for number, span in enumerate(spans):
            lines.append(f"    span {number}: {span.tokens} tokens, epsilon {_shown(span.epsilon)}")
    lines.append("Assumptions")
    lines += [textwrap.fill(text, 110, initial_indent="  - ", subsequent_indent="    ") for text in ledger.assumptions]
    return "\n".join(lines)


def _shown(value: float | None) -> str:
    return "unbounded" if value is None else f"{value:.6g}"
