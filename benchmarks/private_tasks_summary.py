"""Tables and figures of the private-task grid (``benchmarks/private_tasks_grid.py``): every variant and baseline of
a (task, level, region) in one row, mean ± standard deviation over seeds, the attacks' recovery, and paired
differences by seed (95 % t-intervals).

    python benchmarks/private_tasks_summary.py --out benchmarks/results/private_tasks \\
        --markdown benchmarks/results/private_tasks/SUMMARY.md --figures benchmarks/results/private_tasks
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571}
"""Student-t 97.5 % quantiles by degrees of freedom (seeds - 1)."""
COLUMNS = (
    ("plain: raw noise", "plain", "raw"),
    ("plain + projection", "plain", "projected"),
    ("plain + denoiser", "plain", "denoised"),
    ("plain + task-prior denoiser", "plain", "denoised_prior"),
    ("plain on SANTEXT text", "plain", "substituted"),
    ("(a) noise-aware", "aware", "raw"),
    ("(b) projected training", "projected", "projected"),
    ("(d) denoiser training", "denoised", "denoised"),
    ("(d') task-prior denoiser training", "denoised_prior", "denoised_prior"),
    ("(c) KD", "kd", "raw"),
)
"""(header, trained variant, serving mode) of the utility columns."""


def load(out: Path) -> list[dict[str, Any]]:
    """Every finished cell's ``result.json`` under ``out``."""
    return [json.loads(path.read_text()) for path in sorted(out.glob("*/result.json"))]


def mean_sd(values: list[float]) -> str:
    if not values:
        return "—"
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.fmean(values):.3f} ± {statistics.stdev(values):.3f}"


def paired(a: dict[int, float], b: dict[int, float]) -> str:
    """Mean of ``a - b`` over the seeds both have, with its 95 % t-interval."""
    seeds = sorted(set(a) & set(b))
    if len(seeds) < 2:
        return "—"
    diffs = [a[s] - b[s] for s in seeds]
    mean, sd = statistics.fmean(diffs), statistics.stdev(diffs)
    half = T_975[len(seeds) - 1] * sd / math.sqrt(len(seeds))
    return f"{mean:+.3f} [{mean - half:+.3f}, {mean + half:+.3f}]"


def collect(results: list[dict[str, Any]]) -> dict[str, Any]:
    """``table[task][(level, region)][(variant, serving)][seed] = exact match`` plus attacks and ceilings."""
    table: dict[str, Any] = defaultdict(lambda: defaultdict(lambda: defaultdict(dict)))
    attacks: dict[str, Any] = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    ceilings: dict[str, dict[int, float]] = defaultdict(dict)
    privacy: dict[tuple[str, str, str], dict[str, Any]] = {}
    diagnostics: dict[tuple, dict[int, dict[str, float]]] = defaultdict(dict)
    for result in results:
        cell = result["cell"]
        task, variant, seed = cell["task"], cell["variant"], cell["seed"]
        scales = (cell.get("lr_scale", 1.0), cell.get("epochs_scale", 1.0))
        if variant == "aware" and cell.get("level"):
            key = f"{cell['level']}/{cell['region']}"
            losses = result.get("losses") or [float("nan")]
            entry = result["levels"][key]["raw"]
            diagnostics[(task, key, *scales)][seed] = {
                "exact_match": entry["exact_match"],
                "steps": result.get("train_iters"),
                "lr": result.get("lr"),
                "first_loss": losses[0],
                "last_loss": statistics.fmean(losses[-5:]),
            }
        if scales != (1.0, 1.0):  # a diagnostic run: its own table, not a column of the grid's
            continue
        if variant == "plain":
            ceilings[task][seed] = result["clean"]["test"]["exact_match"]
        for key, entry in result.get("levels", {}).items():
            level, region = key.split("/")
            for serving in ("raw", "projected", "denoised", "denoised_prior", "substituted"):
                if serving in entry:
                    table[task][(level, region)][(variant, serving)][seed] = entry[serving]["exact_match"]
            if variant == "plain":
                for name in ("nn_l2", "nn_cosine", "lm_beam"):
                    if name in entry["attacks"]:
                        attacks[task][(level, region)][name].append(entry["attacks"][name]["recovery"])
                    if name in entry.get("canary_attacks", {}):
                        attacks[task][(level, region)]["canary_" + name].append(
                            entry["canary_attacks"][name]["recovery"]
                        )
                privacy[(task, level, region)] = entry["privacy"]
                if "substitution" in entry:  # SANTEXT's own recovery: the substituted tokens that kept their id
                    attacks[task][(level, region)]["santext_kept"].append(entry["substitution"]["kept_fraction"])
    return {"table": table, "attacks": attacks, "ceilings": ceilings, "privacy": privacy, "diagnostics": diagnostics}


def diagnostics_markdown(summary: dict[str, Any]) -> list[str]:
    """The noise-aware runs by learning rate and passes: accuracy under the run's noise, first and last training
    loss (mean of the last 5 steps), per (task, level, lr scale, passes scale)."""
    rows = summary.get("diagnostics", {})
    if not any(key[2:] != (1.0, 1.0) for key in rows):
        return []
    lines = ["### noise-aware training by learning rate and passes (diagnostics)", ""]
    lines += ["| task | level / region | lr | steps | seeds | accuracy | first loss | last loss |", "|" + "---|" * 8]
    for (task, key, lr_scale, epochs_scale), seeds in sorted(rows.items()):
        if not any(k[:2] == (task, key) and k[2:] != (1.0, 1.0) for k in rows):
            continue
        runs = list(seeds.values())
        row = [task, key, f"{runs[0]['lr']:.0e} ({lr_scale:g}x)", f"{runs[0]['steps']} ({epochs_scale:g}x)"]
        row += [str(len(runs))] + [
            mean_sd([r[name] for r in runs]) for name in ("exact_match", "first_loss", "last_loss")
        ]
        lines.append("| " + " | ".join(row) + " |")
    return [*lines, ""]


def markdown(summary: dict[str, Any]) -> str:
    """One table per task: utility of every column, recovery, the privacy ledger, and the paired differences."""
    lines: list[str] = []
    for task, rows in sorted(summary["table"].items()):
        ceiling = list(summary["ceilings"][task].values())
        lines += [f"### {task} (clean ceiling, test: {mean_sd(ceiling)}, {len(ceiling)} seeds)", ""]
        header = ["level / region", "eps/token", "eps/example", "nn L2", "beam", "canary beam", "SANTEXT kept"]
        header += [name for name, _, _ in COLUMNS] + ["best − plain+projection"]
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for (level, region), columns in sorted(rows.items()):
            attacks = summary["attacks"][task][(level, region)]
            privacy = summary["privacy"].get((task, level, region), {})
            row = [f"{level} / {region}"]
            for key in ("eps_per_token", "eps_per_example"):
                value = privacy.get(key)
                row.append("—" if value is None else f"{value:.3g}")
            for name in ("nn_l2", "lm_beam", "canary_lm_beam", "santext_kept"):
                row.append(mean_sd(attacks.get(name, [])))
            trained = {}
            for _, variant, serving in COLUMNS:
                values = columns.get((variant, serving), {})
                row.append(mean_sd(list(values.values())))
                if variant != "plain" and values:
                    trained[(variant, serving)] = values
            baseline = columns.get(("plain", "projected"), {})
            if trained and baseline:
                best = max(trained.values(), key=lambda v: statistics.fmean(v.values()))
                row.append(paired(best, baseline))
            else:
                row.append("—")
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    lines += diagnostics_markdown(summary)
    return "\n".join(lines)


def figures(summary: dict[str, Any], folder: Path) -> list[Path]:
    """One figure per task: recovery (LM-prior beam, else nearest neighbour) on x, exact match on y, a curve per
    column, span region; the clean ceiling as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for task, rows in sorted(summary["table"].items()):
        figure, axis = plt.subplots(figsize=(7, 4.5))
        for name, variant, serving in COLUMNS:
            points = []
            for (level, region), columns in rows.items():
                values = columns.get((variant, serving))
                attacks = summary["attacks"][task][(level, region)]
                recovery = attacks.get("lm_beam") or attacks.get("nn_l2")
                if serving == "substituted":  # text baseline: its own recovery (tokens left unchanged)
                    recovery = attacks.get("santext_kept")
                if values and recovery and region == "span":
                    points.append((statistics.fmean(recovery), statistics.fmean(values.values())))
            if points:
                points.sort()
                axis.plot(*zip(*points, strict=True), marker="o", label=name)
        ceiling = list(summary["ceilings"][task].values())
        if ceiling:
            axis.axhline(statistics.fmean(ceiling), color="black", linestyle="--", label="clean ceiling")
        axis.set_xlabel("token recovery of the private span (LM-prior beam; SANTEXT: tokens kept)")
        axis.set_ylabel("exact match / accuracy (test)")
        axis.set_title(f"{task}: private spans noised")
        axis.legend(fontsize=7)
        path = folder / f"frontier_{task}.png"
        figure.tight_layout()
        figure.savefig(path, dpi=120)
        plt.close(figure)
        written.append(path)
    return written


def summarize_grid(out: Path, markdown_path: str | None, figures_folder: str | None) -> None:
    """Print (or write) the tables; draw the figures."""
    summary = collect(load(out))
    text = markdown(summary)
    if markdown_path:
        Path(markdown_path).write_text(text + "\n")
    print(text)
    if figures_folder:
        for path in figures(summary, Path(figures_folder)):
            print(f"figure: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--markdown")
    parser.add_argument("--figures")
    args = parser.parse_args()
    summarize_grid(Path(args.out), args.markdown, args.figures)


if __name__ == "__main__":
    main()
