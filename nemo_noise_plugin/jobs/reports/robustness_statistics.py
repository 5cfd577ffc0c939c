"""The robustness report's statistics: the noise-trained model against its control, batch by batch, in words.

``compare_to_control`` takes, at every noise level, the per-batch differences of held-out loss and of
KL(clean || noisy) between the noise-trained model (``after``) and its control (``no noise``; same batches, same
noise draws), their mean and a 95 % paired t-interval over the batches (``paired_difference``, with Student's t
from its closed form, ``t_quantile``: no SciPy), and a verdict per level and metric: ``better`` (the interval is
below 0), ``worse`` (above 0) or ``no difference (interval includes 0)``; ``summarize_comparison`` says it in words
and ``format_comparison`` as a table. ``RobustnessPoint`` is one measured level, with its per-batch values.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "BETTER",
    "CONFIDENCE",
    "CONTROL",
    "NO_DIFFERENCE",
    "TRAINED",
    "WORSE",
    "Difference",
    "LevelComparison",
    "RobustnessPoint",
    "compare_to_control",
    "format_comparison",
    "interval_name",
    "paired_difference",
    "summarize_comparison",
    "t_quantile",
]

CONFIDENCE = 0.95
"""Two-sided confidence of the comparison's interval."""
CONTROL, TRAINED = "no noise", "after"
"""The curves ``compare_to_control`` compares: the control at its end, and the noise-trained model at its end."""
BETTER, WORSE, NO_DIFFERENCE = "better", "worse", "no difference (interval includes 0)"


@dataclass(frozen=True)
class RobustnessPoint:
    """Held-out loss and KL(clean || noisy), in nats per loss token, at one noise scale.

    ``batch_loss`` and ``batch_kl`` are the same per held-out batch (per loss token of that batch), in batch order:
    the samples of ``compare_to_control``'s interval. ``loss`` and ``kl`` weigh the batches by their loss tokens.
    """

    scale: float
    loss: float
    kl: float
    batch_loss: tuple[float, ...] = ()
    batch_kl: tuple[float, ...] = ()


@dataclass(frozen=True)
class Difference:
    """The noise-trained model minus its control, per batch, for one metric at one level: mean, interval, verdict.

    Lower is better for both metrics, so an interval wholly below 0 is ``better``, wholly above 0 ``worse``.
    """

    mean: float
    low: float
    high: float
    verdict: str


@dataclass(frozen=True)
class LevelComparison:
    """``Difference`` of held-out loss and of KL(clean || noisy) at one noise scale, over ``batches`` batches."""

    scale: float
    loss: Difference
    kl: Difference
    batches: int


def t_quantile(probability: float, degrees: int) -> float:
    """The ``probability`` quantile (> 0.5) of Student's t with ``degrees`` (>= 1) degrees of freedom.

    Bisection on the closed form of the t distribution's CDF for integer degrees of freedom (Abramowitz & Stegun
    26.7.3-4), so no SciPy is needed: ``t_quantile(0.975, 15)`` is 2.1314.
    """
    if not 0.5 < probability < 1 or degrees < 1:
        raise ValueError(f"t_quantile({probability}, {degrees}): expected 0.5 < probability < 1 and degrees >= 1.")

    def central(t: float) -> float:  # P(|T| < t)
        theta = math.atan(t / math.sqrt(degrees))
        cos2, term, total = math.cos(theta) ** 2, 1.0, 0.0
        if degrees % 2:
            for k in range(1, (degrees - 1) // 2 + 1):  # cos, 2/3 cos^3, 2*4/(3*5) cos^5, ...
                total += term
                term *= cos2 * (2 * k) / (2 * k + 1)
            return (
                2 / math.pi * (theta + math.sin(theta) * math.cos(theta) * total)
                if degrees > 1
                else 2 * theta / math.pi
            )
        for k in range(1, degrees // 2 + 1):  # 1, 1/2 cos^2, 1*3/(2*4) cos^4, ...
            total += term
            term *= cos2 * (2 * k - 1) / (2 * k)
        return math.sin(theta) * total

    target, low, high = 2 * probability - 1, 0.0, 1.0
    while central(high) < target:
        high *= 2
    for _ in range(200):
        middle = (low + high) / 2
        low, high = (middle, high) if central(middle) < target else (low, middle)
    return (low + high) / 2


def paired_difference(trained: Sequence[float], control: Sequence[float], confidence: float = CONFIDENCE) -> Difference:
    """Mean of the per-batch differences ``trained - control`` with a paired t-interval over the batches, and its
    verdict (lower is better): ``better`` when the interval is below 0, ``worse`` above, else ``no difference``.

    Example::

        paired_difference([0.10, 0.12, 0.11], [0.20, 0.21, 0.19]).verdict  # 'better'
    """
    if len(trained) != len(control) or len(trained) < 2:
        raise ValueError(
            f"paired_difference: {len(trained)} and {len(control)} per-batch values; expected the same number, >= 2."
        )
    differences = [a - b for a, b in zip(trained, control, strict=True)]
    count = len(differences)
    mean = sum(differences) / count
    spread = math.sqrt(sum((d - mean) ** 2 for d in differences) / (count - 1) / count)
    half = t_quantile((1 + confidence) / 2, count - 1) * spread
    low, high = mean - half, mean + half
    verdict = BETTER if high < 0 else WORSE if low > 0 else NO_DIFFERENCE
    return Difference(mean, low, high, verdict)


def compare_to_control(
    trained: Sequence[RobustnessPoint], control: Sequence[RobustnessPoint], confidence: float = CONFIDENCE
) -> list[LevelComparison]:
    """At each noise level, the noise-trained model's loss and KL against its control's, batch by batch.

    Both curves must come from the same held-out batches, scales and noise draws (``robustness_curve`` with the same
    arguments but the model), with per-batch values. Level 0 has no noise: its KL is 0 for both models. Example::

        comparisons = compare_to_control(curves["after"], curves["no noise"])
        print(summarize_comparison(comparisons))  # noise training vs control: lower KL at 1 of 5 noise levels, ...
    """
    if [p.scale for p in trained] != [p.scale for p in control]:
        raise ValueError("compare_to_control: the two curves must be measured at the same scales.")
    return [
        LevelComparison(
            mine.scale,
            paired_difference(mine.batch_loss, theirs.batch_loss, confidence),
            paired_difference(mine.batch_kl, theirs.batch_kl, confidence),
            len(mine.batch_kl),
        )
        for mine, theirs in zip(trained, control, strict=True)
    ]


def interval_name(confidence: float = CONFIDENCE, batches: int | None = None) -> str:
    """``95 % paired t-interval over 16 held-out batches``: the interval's name in the reports."""
    over = f"{batches} held-out batches" if batches is not None else "the held-out batches"
    return f"{confidence * 100:g} % paired t-interval over {over}"


def _levels(count: int) -> str:
    return f"{count} noise level{'' if count == 1 else 's'}"


def _tally(verdicts: Sequence[str]) -> tuple[int, int, int]:
    return verdicts.count(BETTER), verdicts.count(WORSE), verdicts.count(NO_DIFFERENCE)


def summarize_comparison(comparisons: Sequence[LevelComparison], confidence: float = CONFIDENCE) -> str:
    """The comparison in words, counted from the verdicts: KL over the noisy levels (level 0 has no noise, so no
    KL), loss over all of them, the interval used; then whether noise training made the model more robust: lower KL
    somewhere, higher KL and higher loss nowhere; lower KL with a loss lower at some levels and higher at others is a
    trade-off, and with a loss only higher it is steadier, not more accurate (a less trained model, or one that
    ignores its input, shifts less too); and what it did to the clean loss.

    Example: ``noise training vs control: lower KL at 2 of 5 noise levels, higher at 0, no difference at 3 ...``.
    """
    noisy = [c for c in comparisons if c.scale > 0]
    kl_better, kl_worse, kl_same = _tally([c.kl.verdict for c in noisy])
    loss_better, loss_worse, loss_same = _tally([c.loss.verdict for c in comparisons])
    batches = comparisons[0].batches if comparisons else 0
    interval = interval_name(confidence, batches)
    line = (
        f"noise training vs control: lower KL at {kl_better} of {len(noisy)} noise levels, higher at {kl_worse}, "
        f"no difference at {kl_same}; held-out loss lower at {loss_better} of {len(comparisons)} levels, "
        f"higher at {loss_worse}, no difference at {loss_same} ({interval}, same noise draws)"
    )
    if kl_better and not kl_worse and not loss_worse:
        verdict = (
            f"noise training made this model more robust than its control: lower KL at {_levels(kl_better)}, "
            "held-out loss higher at none"
        )
    elif kl_better and not kl_worse and loss_better:
        verdict = (
            f"a trade-off: noise training lowered KL at {_levels(kl_better)}, and its held-out loss is lower at "
            f"{loss_better} of {len(comparisons)} levels but higher at {loss_worse}"
        )
    elif kl_better and not kl_worse:
        verdict = (
            f"steadier, not more accurate: noise training lowered KL at {_levels(kl_better)} but its held-out loss is "
            f"higher at {loss_worse} of {len(comparisons)} levels and lower at none"
        )
    elif kl_better:
        verdict = (
            f"no overall robustness gain measured: noise training lowered KL at {_levels(kl_better)} and raised it "
            f"at {kl_worse}"
        )
    elif kl_worse:
        verdict = f"no robustness gain measured: noise training raised KL at {_levels(kl_worse)}, lowered it at none"
    else:
        verdict = "no difference measured: noise training changed KL against its control at no noise level"
    clean = [c.loss for c in comparisons if c.scale == 0]
    if clean and clean[0].verdict == WORSE:
        verdict += f"; at a cost: its clean held-out loss is higher than the control's by {clean[0].mean:.4f}"
    elif clean and clean[0].verdict == BETTER:
        verdict += f"; its clean held-out loss is lower than the control's by {-clean[0].mean:.4f}"
    return f"{line}\n{verdict}"


def format_comparison(comparisons: Sequence[LevelComparison], scale_name: str) -> str:
    """A plain-text table: per level and metric, the mean per-batch difference (noise-trained - control), its
    interval and its verdict (``no difference`` where the interval includes 0)."""
    rows = [
        f"{scale_name:>10}  {'loss difference [interval]':<30}{'verdict':<16}{'KL difference [interval]':<33}verdict"
    ]
    for c in comparisons:
        loss = f"{c.loss.mean:+.4f} [{c.loss.low:+.4f}, {c.loss.high:+.4f}]"
        kl = f"{c.kl.mean:+.5f} [{c.kl.low:+.5f}, {c.kl.high:+.5f}]"
        rows.append(f"{c.scale:>10g}  {loss:<30}{_short(c.loss.verdict):<16}{kl:<33}{_short(c.kl.verdict)}")
    return "\n".join(rows)


def _short(verdict: str) -> str:
    return "no difference" if verdict == NO_DIFFERENCE else verdict
