"""The noise sweep of the privacy audit: token recovery per attack against noise level, with epsilon and task cost.

A sweep varies one setting of one mechanism (NEFTune ``alpha``, Gaussian ``sigma``, metric-DP ``eta``, the Gaussian
mechanism's ``epsilon``, or ``distance_multiple`` under ``embedding_distance`` scaling) over levels; at each level
``audit`` runs the attacks on the exact noised embeddings, ``privacy_ledger`` gives the per-token and per-sequence
epsilon, and an optional ``task_loss(config)`` (computed by a model-aware caller, e.g. ``audit_report``) the
held-out loss with that noise. The report is one JSON row per (mechanism, level, attack), a text table and a PNG.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from nemo_noise_plugin.noise.bounds import check_noise_fits
from nemo_noise_plugin.noise.config import NoiseConfig, unused_magnitude_defaults
from nemo_noise_plugin.noise.families import NOISE_FAMILIES, noise_family
from nemo_noise_plugin.privacy.audit.beam import LmLogProbs
from nemo_noise_plugin.privacy.audit.run import ATTACKS, audit, check_attacks, clips_embeddings
from nemo_noise_plugin.privacy.audit.search import (
    DEFAULT_QUERY_CHUNK,
    DEFAULT_VOCAB_CHUNK,
    median_nearest_neighbour_distance,
)
from nemo_noise_plugin.privacy.ledger import Guarantee, privacy_ledger
from nemo_noise_plugin.validation import SettingError, check_choice, check_int

__all__ = [
    "STANDARD_SWEEPS",
    "SWEEP_FIELDS",
    "Sweep",
    "audit_sweep",
    "format_sweep",
    "parse_sweeps",
    "plot_sweep",
    "write_sweep_report",
]

SWEEP_FIELDS: dict[str, tuple[str, ...]] = {name: family.sweep_fields for name, family in NOISE_FAMILIES.items()}
"""The settings a sweep may vary, per mechanism (each family's ``sweep_fields``)."""
TaskLoss = Callable[[NoiseConfig], float]
"""``task_loss(config) -> held-out loss`` (nats/token) of the model with ``config``'s noise on its embeddings."""


@dataclass(frozen=True)
class Sweep:
    """One mechanism's noise levels: ``field`` of ``NoiseConfig`` set to each of ``levels``."""

    mechanism: str
    field: str
    levels: tuple[float, ...]

    def __post_init__(self) -> None:
        check_choice("sweep mechanism", self.mechanism, tuple(NOISE_FAMILIES))
        check_choice(f"sweep field for {self.mechanism}", self.field, noise_family(self.mechanism).sweep_fields)
        if not self.levels or any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in self.levels):
            raise ValueError(f"sweep levels={self.levels!r} are invalid: expected a non-empty list of numbers.")

    @classmethod
    def at_level_of(cls, config: NoiseConfig) -> Sweep:
        """The one-level sweep at ``config``'s own level: its mechanism's magnitude field (``distance_multiple``
        under ``embedding_distance`` scaling) at its value, e.g. a trained run's noise."""
        family = noise_family(config.mechanism)
        length_scaled_distance = config.scaling == "embedding_distance" and family.length_scaled
        field = "distance_multiple" if length_scaled_distance else family.magnitude_field
        value = getattr(config, field)
        if value is None:
            raise ValueError(f"NoiseConfig.{field}=None has no level to audit: expected a number.")
        return cls(config.mechanism, field, (float(value),))

    def configs(self, base: NoiseConfig) -> list[NoiseConfig]:
        """``base`` with this sweep's mechanism and each level (validated like every ``NoiseConfig``)."""
        scaling = base.scaling if noise_family(self.mechanism).length_scaled else "true_length"
        if self.field == "distance_multiple":
            scaling = "embedding_distance"
        elif scaling == "embedding_distance":
            scaling = "true_length"
        return [
            dataclasses.replace(
                base,
                mechanism=self.mechanism,
                scaling=scaling,
                **{**unused_magnitude_defaults(self.mechanism), self.field: float(level)},  # the base's own level goes
            )
            for level in self.levels
        ]


STANDARD_SWEEPS: tuple[Sweep, ...] = (
    Sweep("uniform", "alpha", (1.0, 5.0, 15.0, 50.0, 150.0, 500.0)),
    Sweep("gaussian", "distance_multiple", (0.1, 0.25, 0.5, 1.0, 2.0, 4.0)),
    Sweep("metric_dp", "eta", (1000.0, 300.0, 100.0, 30.0, 10.0)),
    Sweep("gaussian_mechanism", "epsilon", (1000.0, 300.0, 100.0, 30.0, 10.0, 3.0)),
)
"""``sweep=standard``: NEFTune alpha, Gaussian noise sized from the table, metric-DP eta, Gaussian-mechanism epsilon."""


def parse_sweeps(text: str, mechanism: str) -> list[Sweep]:
    """``"alpha:1,5,10"`` (for ``mechanism``), ``"uniform/alpha:1,5;metric_dp/eta:100,10"`` or ``"standard"``."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(
            f"sweep={text!r} is invalid: expected e.g. alpha:1,5,10 or uniform/alpha:1,5;gaussian/sigma:1,2."
        )
    if text.strip() == "standard":
        return list(STANDARD_SWEEPS)
    sweeps = []
    for part in text.split(";"):
        head, colon, values = part.strip().partition(":")
        sweep_mechanism, slash, field = head.partition("/")
        if not slash:
            sweep_mechanism, field = mechanism, head
        try:
            levels = tuple(float(value) for value in values.split(",")) if colon else ()
        except ValueError:
            levels = ()
        if not colon or not levels or not field:
            raise ValueError(
                f"sweep={text!r} is invalid at {part!r}: expected [mechanism/]field:level,level,... "
                "(e.g. alpha:1,5,10 or metric_dp/eta:100,10), parts separated by ';', or 'standard'."
            )
        sweeps.append(Sweep(sweep_mechanism.strip(), field.strip(), levels))
    seen = [(sweep.mechanism, sweep.field, level) for sweep in sweeps for level in sweep.levels]
    repeated = sorted({entry for entry in seen if seen.count(entry) > 1})
    if repeated:  # each level once: a repeat only wrote the same rows twice
        shown = ", ".join(f"{mechanism}/{field}:{level:g}" for mechanism, field, level in repeated)
        raise SettingError("sweep", text, "each level once", why=f": {shown} is given more than once")
    return sweeps


def _ledger_entries(guarantees: Sequence[Guarantee]) -> list[dict[str, Any]]:
    return [{"epsilon": g.epsilon, "delta": g.delta, "how": g.how} for g in guarantees]


def _first_epsilon(guarantees: Sequence[Guarantee]) -> float | None:
    return guarantees[0].epsilon if guarantees else None


@torch.no_grad()
def audit_sweep(
    table: torch.Tensor,
    token_ids: torch.Tensor,
    base_config: NoiseConfig,
    sweeps: Sequence[Sweep],
    attacks: Sequence[str] = ("nn_l2", "nn_cosine"),
    *,
    lm_log_probs: LmLogProbs | None = None,
    task_loss: TaskLoss | None = None,
    task_exact_match: TaskLoss | None = None,
    loss_mask: torch.Tensor | None = None,
    padding_mask: torch.Tensor | None = None,
    private_mask: torch.Tensor | None = None,
    special_ids: Sequence[int] | None = None,
    sequence_length: int | None = None,
    epochs: int = 1,
    confidence: float = 0.95,
    candidates: int = 8,
    beam_width: int = 4,
    vocab_chunk: int = DEFAULT_VOCAB_CHUNK,
    query_chunk: int = DEFAULT_QUERY_CHUNK,
    neighbour_sample: int | None = None,
    metadata: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Audit ``token_ids`` (``[b, s]``) at every level of ``sweeps``; the JSON-serialisable report.

    ``rows`` has one entry per (mechanism, level, attack): recovery (overall, rare, special, with Wilson intervals
    at ``confidence``), the observed median noise norm and its ratio to the vocabulary's median nearest-neighbour
    distance, the ledger's per-token and per-sequence epsilon (``privacy_ledger`` at ``sequence_length``, default
    ``s``, and ``epochs``) and ``task_loss`` (None without ``task_loss``). Attacks that do not apply to a
    mechanism (``direction`` where nothing is clipped) are listed under ``skipped``; ``lm_beam`` needs
    ``lm_log_probs``. ``clean_task_loss`` is the loss without noise. ``task_exact_match`` (optional, like
    ``task_loss``) adds each level's held-out exact match (``task_exact_match`` in the rows, and
    ``clean_task_exact_match``). ``neighbour_sample`` estimates the median
    nearest-neighbour distance from that many rows (``median_nearest_neighbour_distance``; default all).
    ``private_mask`` (``[b, s]``) marks the private spans of ``tokens='spans'``: only they are noised and counted.
    ``tokens`` and ``distinct_ids`` are how many audited tokens were counted and how many distinct ids they hold;
    ``metadata`` (e.g. ``data``: where the tokens came from) is copied to the top of the report.

    Args:
        table: the model's input embedding table, ``[V, h]``.
        token_ids: the audited tokens, ``[b, s]``.
        base_config: the noise settings each level changes one field of.
        sweeps: the levels (``parse_sweeps("alpha:1,5,10", "uniform")``).
        attacks: names from ``ATTACKS``.

    Returns:
        The report (``rows``, ``skipped``, the clean task loss and metric, token counts, ``metadata``).

    Example::

        sweeps = parse_sweeps("metric_dp/eta:100,50,30", "metric_dp")
        report = audit_sweep(table, token_ids, load_noise_config("metric_dp"), sweeps)
        write_sweep_report(report, "audit_out")
    """
    if isinstance(attacks, str) or not attacks:
        raise ValueError(f"attacks={attacks!r} is invalid: expected a non-empty list from {', '.join(ATTACKS)}.")
    for attack in attacks:
        check_choice("attacks", attack, ATTACKS)
    if "lm_beam" in attacks and lm_log_probs is None:
        raise ValueError("attacks includes 'lm_beam' but lm_log_probs=None: expected a callable prefix -> log-probs.")
    sequence_length = token_ids.size(1) if sequence_length is None else sequence_length
    check_int("sequence_length", sequence_length, minimum=1)
    check_int("epochs", epochs, minimum=1)
    search = dict(vocab_chunk=vocab_chunk, query_chunk=query_chunk)
    distance = median_nearest_neighbour_distance(table, sample=neighbour_sample, **search)
    rows, skipped = [], []
    for sweep in sweeps:
        for level, config in zip(sweep.levels, sweep.configs(base_config), strict=True):
            if config.scaling == "embedding_distance" and config.embedding_distance is None:
                config = dataclasses.replace(config, embedding_distance=distance)
            check_noise_fits(config, table.size(1), table.dtype)  # not NaN rows in the report
            usable = [a for a in attacks if a != "direction" or clips_embeddings(config)]
            if not usable:  # only 'direction', on a level that does not clip: the audit's own refusal names it
                check_attacks(attacks, config, lm_log_probs)
            skipped += [{"mechanism": sweep.mechanism, "attack": a} for a in attacks if a not in usable]
            report = audit(
                table,
                token_ids,
                config,
                usable,
                lm_log_probs,
                loss_mask=loss_mask,
                padding_mask=padding_mask,
                private_mask=private_mask,
                special_ids=special_ids,
                confidence=confidence,
                candidates=candidates,
                beam_width=beam_width,
                neighbour_distance=distance,
                **search,
            )
            ledger = privacy_ledger(config, sequence_length=sequence_length, epochs=epochs, hidden_size=table.size(1))
            loss = None if task_loss is None else float(task_loss(config))
            accuracy = None if task_exact_match is None else float(task_exact_match(config))
            noise_norm = report["noise_norm"]["median"]
            for attack in usable:
                rows.append(
                    {
                        "mechanism": sweep.mechanism,
                        "field": sweep.field,
                        "level": float(level),
                        "attack": attack,
                        "recovery": report["attacks"][attack],
                        "noise_norm_median": noise_norm,
                        "noise_to_neighbour_distance": noise_norm / distance if distance > 0 else None,
                        "per_token_epsilon": _first_epsilon(ledger.per_token),
                        "per_sequence_epsilon": _first_epsilon(ledger.per_sequence),
                        "ledger": {
                            "per_token": _ledger_entries(ledger.per_token),
                            "per_sequence": _ledger_entries(ledger.per_sequence),
                            "sequence_length": sequence_length,
                            "epochs": epochs,
                        },
                        "task_loss": loss,
                        "task_exact_match": accuracy,
                        "noise_config": dataclasses.asdict(config),
                    }
                )
    clean = dataclasses.replace(base_config, enabled=False)
    return {
        **(metadata or {}),
        "table_shape": list(table.shape),
        "tokens": int(report["tokens"]["real"]) if rows else 0,
        "distinct_ids": int(report["tokens"]["distinct_ids"]) if rows else 0,
        "median_nearest_neighbour_distance": distance,
        "confidence": confidence,
        "clean_task_loss": None if task_loss is None else float(task_loss(clean)),
        "clean_task_exact_match": None if task_exact_match is None else float(task_exact_match(clean)),
        "rows": rows,
        "skipped": [dict(t) for t in {tuple(s.items()) for s in skipped}],
    }


def _percent(recovery: dict[str, Any] | None) -> str:
    if recovery is None or recovery["rate"] is None:
        return "-"
    return f"{100 * recovery['rate']:.1f} [{100 * recovery['ci_low']:.1f}, {100 * recovery['ci_high']:.1f}]"


def _number(value: float | None, spec: str = ".3g") -> str:
    if value is None:
        return "-"
    return "inf" if math.isinf(value) else format(value, spec)


def format_sweep(report: dict[str, Any]) -> str:
    """A plain-text table: one line per (mechanism, level, attack); recovery in % with its interval."""
    confidence = round(100 * report["confidence"])
    header = (
        f"{'mechanism':<19}{'setting':<24}{'attack':<10}{f'recovery % [{confidence}% CI]':<24}"
        f"{'rare %':<24}{'special %':<12}{'|z|/d_nn':>9}{'eps/token':>11}{'eps/seq':>11}{'task loss':>11}"
        f"{'exact match':>13}"
    )
    distinct = f" ({report['distinct_ids']} distinct ids)" if "distinct_ids" in report else ""
    source = f" from {report['data']}" if report.get("data") else ""
    lines = [
        f"tokens {report['tokens']}{distinct}{source}, table {report['table_shape']}, "
        f"median nearest-neighbour distance {report['median_nearest_neighbour_distance']:.4g}, "
        f"clean task loss {_number(report['clean_task_loss'], '.4f')}, "
        f"clean exact match {_number(report.get('clean_task_exact_match'), '.3f')}",
        header,
    ]
    for row in report["rows"]:
        recovery = row["recovery"]
        special = recovery["special"]
        lines.append(
            f"{row['mechanism']:<19}{row['field'] + '=' + format(row['level'], 'g'):<24}{row['attack']:<10}"
            f"{_percent(recovery['overall']):<24}{_percent(recovery['rare']):<24}"
            f"{_percent(special).split(' ')[0] if special and special['total'] else '-':<12}"
            f"{_number(row['noise_to_neighbour_distance']):>9}{_number(row['per_token_epsilon']):>11}"
            f"{_number(row['per_sequence_epsilon']):>11}{_number(row['task_loss'], '.4f'):>11}"
            f"{_number(row.get('task_exact_match'), '.3f'):>13}"
        )
    return "\n".join(lines)


def plot_sweep(report: dict[str, Any], path: str) -> bool:
    """Recovery (with intervals) and task loss against noise level, one column per swept mechanism; a PNG at
    ``path``, titled from the report's ``provenance`` when it has one. Returns False (and writes nothing) without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    sweeps = list(dict.fromkeys((row["mechanism"], row["field"]) for row in report["rows"]))
    figure, axes = plt.subplots(2, max(1, len(sweeps)), figsize=(4.5 * max(1, len(sweeps)), 7), squeeze=False)
    for column, (mechanism, field) in enumerate(sweeps):
        rows = [row for row in report["rows"] if (row["mechanism"], row["field"]) == (mechanism, field)]
        top, bottom = axes[0][column], axes[1][column]
        for attack in dict.fromkeys(row["attack"] for row in rows):
            points = [row for row in rows if row["attack"] == attack]
            levels = [row["level"] for row in points]
            overall = [row["recovery"]["overall"] for row in points]
            rates = [100 * o["rate"] for o in overall]
            errors = [
                [max(0.0, r - 100 * o["ci_low"]) for r, o in zip(rates, overall, strict=True)],
                [max(0.0, 100 * o["ci_high"] - r) for r, o in zip(rates, overall, strict=True)],
            ]
            top.errorbar(levels, rates, yerr=errors, marker="o", capsize=3, label=attack)
        losses = {row["level"]: row["task_loss"] for row in rows if row["task_loss"] is not None}
        if losses:
            bottom.plot(list(losses), list(losses.values()), marker="s", color="black", label="noised")
            if report.get("clean_task_loss") is not None:
                bottom.axhline(report["clean_task_loss"], color="gray", linestyle="--", label="clean")
            bottom.legend(loc="upper left")
        matches = {row["level"]: row.get("task_exact_match") for row in rows}
        matches = {level: value for level, value in matches.items() if value is not None}
        if matches:
            right = bottom.twinx()
            right.plot(list(matches), list(matches.values()), marker="^", color="tab:green", label="exact match")
            if report.get("clean_task_exact_match") is not None:
                right.axhline(report["clean_task_exact_match"], color="tab:green", linestyle=":", label="clean EM")
            right.set(ylabel="held-out exact match", ylim=(-0.03, 1.03))
            right.legend(loc="center left")
        for axis in (top, bottom):
            axis.set_xscale("log")
            axis.grid(alpha=0.3)
            axis.set_xlabel(field)
        top.set(ylabel="tokens recovered (%)", title=mechanism, ylim=(-3, 103))
        top.legend()
        bottom.set(ylabel="held-out loss (nats/token)")
    settings = (report.get("provenance") or {}).get("settings")
    if settings:  # the title from the report's provenance: what was audited, by which version
        version = report["provenance"].get("plugin_version")
        figure.suptitle(f"privacy audit: model {settings.get('model')}, data {settings.get('data')}, plugin {version}")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def write_sweep_report(report: dict[str, Any], output_dir: str, name: str = "privacy_audit") -> dict[str, str]:
    """Write ``{name}.json``, ``{name}.txt`` (the table) and ``{name}.png`` under ``output_dir``; their paths."""
    os.makedirs(output_dir, exist_ok=True)
    paths = {kind: os.path.join(output_dir, f"{name}.{kind}") for kind in ("json", "txt", "png")}
    with open(paths["json"], "w") as handle:
        json.dump(report, handle, indent=2)
    with open(paths["txt"], "w") as handle:
        handle.write(format_sweep(report) + "\n")
    if not plot_sweep(report, paths["png"]):
        del paths["png"]
    return paths
