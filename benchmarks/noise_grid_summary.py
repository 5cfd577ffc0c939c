"""Tables and the frontier figure from a ``benchmarks/noise_grid.py`` grid's ``<cell>/result.json`` files.

Every number is a mean over seeds with its sample standard deviation; a variant is compared with ``plain`` paired
by seed (the same data order): the mean of the per-seed differences and a t-interval (95 %) over seeds. With fewer
than two paired seeds no interval is given.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def load_results(out: Path) -> dict[str, dict[int, dict[str, Any]]]:
    """``{variant: {seed: result}}`` of every finished cell under ``out``."""
    results: dict[str, dict[int, dict[str, Any]]] = defaultdict(dict)
    for path in sorted(out.glob("*/result.json")):
        result = json.loads(path.read_text())
        results[result["cell"]["variant"]][int(result["cell"]["seed"])] = result
    return dict(results)


def mean_sd(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def paired(a: dict[int, float], b: dict[int, float]) -> dict[str, Any] | None:
    """Mean of ``a[seed] - b[seed]`` over shared seeds with a 95 % t-interval (None without a shared seed)."""
    seeds = sorted(set(a) & set(b))
    if not seeds:
        return None
    differences = [a[s] - b[s] for s in seeds]
    mean = statistics.fmean(differences)
    if len(differences) < 2:
        return {"mean": mean, "interval": None, "seeds": len(seeds)}
    half = T_975[len(differences) - 1] * statistics.stdev(differences) / math.sqrt(len(differences))
    return {"mean": mean, "interval": [mean - half, mean + half], "seeds": len(seeds)}


def _cell(values: dict[int, float], reference: dict[int, float] | None, spec: str) -> str:
    if not values:
        return "-"
    mean, sd = mean_sd(list(values.values()))
    text = f"{mean:{spec}} ± {sd:{spec}}"
    if reference is not None:
        comparison = paired(values, reference)
        if comparison and comparison["interval"]:
            low, high = comparison["interval"]
            mark = "*" if low > 0 or high < 0 else ""
            text += f" ({comparison['mean']:+{spec}} [{low:+{spec}}, {high:+{spec}}]{mark})"
        elif comparison:
            text += f" ({comparison['mean']:+{spec}})"
    return text


def _values(runs: dict[int, dict[str, Any]], get: Callable[[dict[str, Any]], float | None]) -> dict[int, float]:
    values = {}
    for seed, result in runs.items():
        try:
            value = get(result)
        except (KeyError, TypeError):
            value = None
        if value is not None:
            values[seed] = float(value)
    return values


NEFTUNE_ROWS: tuple[tuple[str, str, Callable[[dict[str, Any]], float]], ...] = (
    ("noise-off training loss", ".3f", lambda r: r["train_clean"]["loss"]),
    ("held-out loss (test)", ".3f", lambda r: r["clean"]["test"]["loss"]),
    ("held-out loss (validation)", ".3f", lambda r: r["clean"]["validation"]["loss"]),
    ("exact match (test)", ".3f", lambda r: r["clean"]["test"]["exact_match"]),
    ("exact match (validation)", ".3f", lambda r: r["clean"]["validation"]["exact_match"]),
    ("answer length, tokens (test)", ".2f", lambda r: r["answers_test"]["mean_length"]),
    ("copies a training answer (ROUGE-L >= 0.9)", ".3f", lambda r: r["answers_test"]["copy_rate"]),
    ("... that is not the reference", ".3f", lambda r: r["answers_test"]["copy_not_reference_rate"]),
    ("repeated 2-grams", ".4f", lambda r: r["answers_test"]["repeated_bigrams"]),
)
NEFTUNE_ORDER = ("plain", "neftune_a5", "neftune_a10", "neftune_a15", "neftune_a5_padded")


def neftune_table(results: dict[str, dict[int, dict[str, Any]]]) -> str:
    """The NEFTune table: one row per measurement, one column per variant (mean ± sd over seeds; for a variant,
    the paired difference to plain and its 95 % interval; * where the interval excludes 0)."""
    variants = [v for v in NEFTUNE_ORDER if v in results]
    seeds = {v: len(results[v]) for v in variants}
    header = "| measurement | " + " | ".join(f"{v} (n={seeds[v]})" for v in variants) + " |"
    lines = [header, "|" + "---|" * (len(variants) + 1)]
    for label, spec, get in NEFTUNE_ROWS:
        plain = _values(results.get("plain", {}), get)
        cells = [_cell(_values(results[v], get), None if v == "plain" else plain, spec) for v in variants]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    tasks = sorted({t for v in variants for r in results[v].values() for t in r["clean"]["test"]["per_task"]})
    for task in tasks:
        get = lambda r, task=task: r["clean"]["test"]["per_task"].get(task)  # noqa: E731
        plain = _values(results.get("plain", {}), get)
        cells = [_cell(_values(results[v], get), None if v == "plain" else plain, ".2f") for v in variants]
        lines.append(f"| exact match, {task} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


FRONTIER_ORDER = ("gm_eps100", "gm_eps50", "gm_eps20", "mdp_eta100", "mdp_eta50", "mdp_eta30")


def frontier_rows(results: dict[str, dict[int, dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per (level, model): a plain (scored under the level), b noise-aware, c noise-aware + KD from the clean
    fine-tuned model; exact match and loss under the level's noise on the test split, recovery per attack, with
    mean, sd and seeds; the ceiling d (plain, clean) is the same for every level."""
    rows = []
    for level in FRONTIER_ORDER:
        for model, variant in (("a plain", "plain"), ("b noise-aware", level), ("c noise-aware + KD", f"{level}_kd")):
            runs = {s: r for s, r in results.get(variant, {}).items() if level in r.get("frontier", {})}
            if not runs:
                continue
            row: dict[str, Any] = {"level": level, "model": model, "variant": variant, "seeds": sorted(runs)}
            em = _values(runs, lambda r, level=level: r["frontier"][level]["noised"]["test"]["exact_match"])
            loss = _values(runs, lambda r, level=level: r["frontier"][level]["noised"]["test"]["loss"])
            row["exact_match"], row["loss"] = mean_sd(list(em.values())), mean_sd(list(loss.values()))
            row["exact_match_by_seed"] = em
            for attack in ("nn_l2", "nn_cosine", "lm_beam"):
                rec = _values(runs, lambda r, lv=level, at=attack: r["frontier"][lv]["attacks"][at]["recovery"])
                row[attack] = mean_sd(list(rec.values()))
            first = next(iter(runs.values()))["frontier"][level]
            row["privacy"] = first["privacy"]
            row["noised_tokens"] = first["attacks"]["noised_tokens"]
            row["distinct_ids"] = first["attacks"]["distinct_ids"]
            rows.append(row)
    return rows


def frontier_table(results: dict[str, dict[int, dict[str, Any]]]) -> str:
    plain = results.get("plain", {})
    ceiling = mean_sd(list(_values(plain, lambda r: r["clean"]["test"]["exact_match"]).values())) if plain else None
    lines = []
    if ceiling:
        lines.append(
            f"Ceiling (d): the plain model without noise, exact match (test) {ceiling[0]:.3f} ± {ceiling[1]:.3f} "
            f"(n={len(plain)}).\n"
        )
    lines.append(
        "| level | eps/token | eps/prompt | model | n | exact match (test) | loss (test) "
        "| NN L2 % | NN cos % | beam % |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|---|")
    for row in frontier_rows(results):
        p = row["privacy"]
        seq = p.get("eps_per_sequence")
        lines.append(
            f"| {row['level']} | {p.get('eps_per_token'):.3g} | {seq:.3g} | {row['model']} | {len(row['seeds'])} | "
            f"{row['exact_match'][0]:.3f} ± {row['exact_match'][1]:.3f} | "
            f"{row['loss'][0]:.2f} ± {row['loss'][1]:.2f} | "
            + " | ".join(f"{100 * row[a][0]:.1f} ± {100 * row[a][1]:.1f}" for a in ("nn_l2", "nn_cosine", "lm_beam"))
            + " |"
        )
    return "\n".join(lines)


def plot_frontier(results: dict[str, dict[int, dict[str, Any]]], path: str) -> bool:
    """Recovery by the beam attack (x) against exact match under the noise (y), one curve per training variant,
    the clean ceiling as a line; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = frontier_rows(results)
    figure, axis = plt.subplots(figsize=(7, 5))
    for model, marker in (("a plain", "o"), ("b noise-aware", "s"), ("c noise-aware + KD", "^")):
        for family, style in (("gm", "-"), ("mdp", "--")):
            points = [r for r in rows if r["model"] == model and r["level"].startswith(family)]
            points.sort(key=lambda r: r["lm_beam"][0])
            if not points:
                continue
            axis.errorbar(
                [100 * r["lm_beam"][0] for r in points],
                [r["exact_match"][0] for r in points],
                xerr=[100 * r["lm_beam"][1] for r in points],
                yerr=[r["exact_match"][1] for r in points],
                marker=marker,
                linestyle=style,
                label=f"{model} ({'Gaussian mech.' if family == 'gm' else 'metric-DP'})",
                capsize=2,
            )
            for r in points:
                axis.annotate(r["level"], (100 * r["lm_beam"][0], r["exact_match"][0]), fontsize=6)
    plain = results.get("plain", {})
    if plain:
        ceiling = statistics.fmean(r["clean"]["test"]["exact_match"] for r in plain.values())
        axis.axhline(ceiling, color="grey", linestyle=":", label=f"d clean ceiling ({ceiling:.2f})")
    axis.set(
        xlabel="token recovery by the LM-prior beam attack (%)",
        ylabel="held-out exact match under the noise (test)",
        title="SmolLM2-135M privacy-utility frontier",
    )
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


BOUND_FILE = "prompt_recovery_bound_nn.json"
"""``benchmarks/prompt_recovery_bound.py``'s nearest-neighbour results, when the grid's folder holds them."""


def projection_estimates(results: dict[str, dict[int, dict[str, Any]]], bound: dict[str, Any]) -> list[dict]:
    """Per level: the exact match a decode-then-answer pipeline would reach (project every noised prompt embedding
    to its nearest table row, then answer with the clean fine-tuned model): per task, the fraction of chats whose
    whole user question the projection recovers times the plain models' clean exact match on that task (mean
    over seeds), averaged over the tasks (the bound's 440 test chats hold 40 per task). An estimate: it assumes
    the clean model answers a recovered question as often as any question of its task."""
    plain = results.get("plain", {})
    if not plain:
        return []
    tasks = sorted(next(iter(plain.values()))["clean"]["test"]["per_task"])
    clean = {t: statistics.fmean(r["clean"]["test"]["per_task"][t] for r in plain.values()) for t in tasks}
    rows = []
    for level, attacks in bound.get("levels", {}).items():
        by_task = attacks["nn_l2"]["whole_question_by_task"]
        estimate = statistics.fmean(by_task[t] * clean[t] for t in tasks if t in by_task)
        rows.append(
            {
                "level": level,
                "token_recovery": attacks["nn_l2"]["token_recovery"],
                "whole_question": attacks["nn_l2"]["whole_question_recovered"],
                "estimated_exact_match": estimate,
            }
        )
    return rows


def projection_table(rows: list[dict]) -> str:
    """The ``projection_estimates`` rows as markdown."""
    lines = [
        "| level | NN per-token recovery % | whole question recovered % | decode-then-answer exact match (estimate) |",
        "|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['level']} | {100 * row['token_recovery']:.1f} | {100 * row['whole_question']:.1f} | "
            f"{row['estimated_exact_match']:.3f} |"
        )
    return "\n".join(lines)


def summarize_grid(out: Path, markdown: str | None, figure: str | None) -> None:
    results = load_results(out)
    text = "## NEFTune\n\n" + neftune_table(results) + "\n\n## Privacy-utility frontier\n\n" + frontier_table(results)
    if (out / BOUND_FILE).is_file():
        rows = projection_estimates(results, json.loads((out / BOUND_FILE).read_text()))
        text += "\n\n## Nearest-row projection front end (estimate, 440 test chats)\n\n" + projection_table(rows)
    print(text)
    if markdown:
        Path(markdown).write_text(text + "\n")
    if figure:
        plot_frontier(results, figure)
