"""Plain SFT vs NEFTune (alpha 5, 10) vs noise + clean-teacher distillation on the real SmolLM2-135M-Instruct.

Same data (the shipped instruction set), steps, learning rate and seed for every variant; each (variant, seed) runs
in its own process through the plugin's CPU loop (or Bridge's loop on a GPU) with the SmolLM2 recipes, then is
measured on the held-out split: greedy exact match, held-out loss, and KL(clean || noisy) under NEFTune noise at
alpha 5 and 10 (the robustness report's measurement). Results go to ``--output-dir`` as one JSON per run and a
summary (mean and spread over seeds) in ``summary.json`` / ``summary.md``.

    .venv/bin/python benchmarks/real_model_comparison.py --steps 12 --seeds 1 2 3 --output-dir outputs/real_model
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

VARIANTS = ("plain", "neftune5", "neftune10", "noise10_kd")
EVAL_SCALES = (0.0, 5.0, 10.0)


def _noise_and_kd(variant: str):
    from nemo_noise_plugin.distillation.config import KDConfig
    from nemo_noise_plugin.noise.config import NoiseConfig

    return {
        "plain": (NoiseConfig(enabled=False), None),
        "neftune5": (NoiseConfig(alpha=5.0), None),
        "neftune10": (NoiseConfig(alpha=10.0), None),
        "noise10_kd": (NoiseConfig(alpha=10.0), KDConfig()),
    }[variant]


def run_one(variant: str, seed: int, steps: int, lr: float, output_dir: str) -> dict:
    """Train one variant with one seed and measure it; returns (and writes) its results."""
    import dataclasses

    from megatron.core.utils import unwrap_model

    from nemo_noise_plugin.jobs.launch.launcher import launch
    from nemo_noise_plugin.jobs.models.smollm2_folder import ensure_smollm2_hf
    from nemo_noise_plugin.jobs.progress import ProgressLine
    from nemo_noise_plugin.jobs.reports.robustness import held_out_batches, logits_of, robustness_curve
    from nemo_noise_plugin.jobs.reports.task_metric import exact_match
    from nemo_noise_plugin.recipes.smollm2 import (
        smollm2_135m_noise_distillation_config,
        smollm2_135m_noise_sft_config,
    )
    from nemo_noise_plugin.upstream.bridge_imports import import_bridge

    noise, kd = _noise_and_kd(variant)
    noise = dataclasses.replace(noise, seed=seed)
    common = dict(dir=os.path.join(output_dir, "runs"), name=f"{variant}_s{seed}", train_iters=steps, lr=lr)
    common["hf_path"] = str(ensure_smollm2_hf())  # the offline folder, not the hub id the recipes default to
    if kd is None:
        config = smollm2_135m_noise_sft_config(noise=noise, **common)
    else:
        config = smollm2_135m_noise_distillation_config(noise=noise, kd=kd, **common)
    config.rng.seed = seed
    config.checkpoint.save = None  # each run is measured in-process; no resumable state (1.6 GB per run on the CPU)
    results: dict = {"variant": variant, "seed": seed, "steps": steps, "lr": lr, "losses": []}
    callbacks = import_bridge("megatron.bridge.training.callbacks")

    class Measure(callbacks.Callback):
        def _measure(self, context, name):
            model = unwrap_model(context.model[0])
            model.eval()
            cfg = context.state.cfg
            from nemo_noise_plugin.jobs.batches import collate, recipe_datasets, recipe_tokenizer
            from nemo_noise_plugin.jobs.cpu.parallel import causal_attention_mask

            _, valid, _ = recipe_datasets(context.state)
            size = cfg.train.micro_batch_size
            batches = collate(valid, len(valid) // size, size, causal_attention_mask(cfg.model.seq_length), "cpu")
            accuracy, per_task, _ = exact_match(model, batches, recipe_tokenizer(context.state).eod)
            curve = robustness_curve(
                model, held_out_batches(context.state, 4, torch_device()), noise_for_eval(), EVAL_SCALES, logits_of
            )
            results[name] = {
                "exact_match": accuracy,
                "per_task": per_task,
                "curve": [dataclasses.asdict(point) for point in curve],
            }
            print(
                f"{name}: exact match {accuracy:.3f}; "
                + ", ".join(f"alpha {p.scale:g}: loss {p.loss:.4f} KL {p.kl:.5f}" for p in curve)
            )
            model.train()

        def on_train_start(self, context):
            if seed == 1 and variant == VARIANTS[0]:
                self._measure(context, "before")

        def on_train_step_end(self, context):
            loss = context.loss_dict.get("lm loss")
            results["losses"].append(float(loss) if loss is not None else None)

        def on_train_end(self, context):
            self._measure(context, "after")

    start = time.perf_counter()
    launch(config, callbacks=[Measure(), ProgressLine()], allow_cpu_loop=True)
    results["seconds"] = time.perf_counter() - start
    with open(os.path.join(output_dir, f"{variant}_s{seed}.json"), "w") as handle:
        json.dump(results, handle, indent=2)
    return results


def torch_device():
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def noise_for_eval():
    from nemo_noise_plugin.noise.config import NoiseConfig

    return NoiseConfig(alpha=5.0)


def summarize(output_dir: str, seeds: list[int]) -> str:
    """Mean ± standard deviation over seeds per variant, as a Markdown table (also written as JSON)."""
    rows, summary = [], {}
    header = (
        "| variant | exact match | held-out loss | KL(clean‖noisy) α=5 | KL α=10 | loss α=10 | runs |\n"
        "|---|---|---|---|---|---|---|"
    )
    for variant in VARIANTS:
        runs = []
        for seed in seeds:
            path = os.path.join(output_dir, f"{variant}_s{seed}.json")
            if os.path.exists(path):
                with open(path) as handle:
                    runs.append(json.load(handle))
        if not runs:
            continue

        def stat(values):
            mean = statistics.fmean(values)
            spread = statistics.stdev(values) if len(values) > 1 else 0.0
            return mean, spread

        metrics = {
            "exact_match": [r["after"]["exact_match"] for r in runs],
            "loss": [r["after"]["curve"][0]["loss"] for r in runs],
            "kl5": [r["after"]["curve"][1]["kl"] for r in runs],
            "kl10": [r["after"]["curve"][2]["kl"] for r in runs],
            "loss10": [r["after"]["curve"][2]["loss"] for r in runs],
        }
        summary[variant] = {name: {"values": v, "mean_std": stat(v)} for name, v in metrics.items()}
        cells = [f"{stat(v)[0]:.4f} ± {stat(v)[1]:.4f}" for v in metrics.values()]
        rows.append(f"| {variant} | " + " | ".join(cells) + f" | {len(runs)} |")
    before_path = os.path.join(output_dir, f"{VARIANTS[0]}_s{seeds[0]}.json")
    before = None
    if os.path.exists(before_path):
        with open(before_path) as handle:
            before = json.load(handle).get("before")
    if before:
        curve = before["curve"]
        rows.insert(
            0,
            f"| before training | {before['exact_match']:.4f} | {curve[0]['loss']:.4f} | {curve[1]['kl']:.5f} | "
            f"{curve[2]['kl']:.5f} | {curve[2]['loss']:.4f} | 1 |",
        )
    with open(os.path.join(output_dir, "summary.json"), "w") as handle:
        json.dump({"before": before, "after": summary}, handle, indent=2)
    table = header + "\n" + "\n".join(rows)
    with open(os.path.join(output_dir, "summary.md"), "w") as handle:
        handle.write(table + "\n")
    return table


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--output-dir", default="outputs/real_model")
    parser.add_argument("--one", nargs=2, metavar=("VARIANT", "SEED"), help="internal: run one variant and seed")
    parser.add_argument("--summarize", action="store_true", help="only print the summary of finished runs")
    args = parser.parse_args(argv)
    os.makedirs(args.output_dir, exist_ok=True)
    if args.one:
        run_one(args.one[0], int(args.one[1]), args.steps, args.lr, args.output_dir)
        return 0
    if not args.summarize:
        for seed in args.seeds:  # seed-major: every variant has a run before any has three
            for variant in args.variants:
                if os.path.exists(os.path.join(args.output_dir, f"{variant}_s{seed}.json")):
                    continue
                command = [
                    sys.executable,
                    __file__,
                    "--one",
                    variant,
                    str(seed),
                    "--steps",
                    str(args.steps),
                    "--lr",
                    str(args.lr),
                    "--output-dir",
                    args.output_dir,
                ]
                print("+", " ".join(command), flush=True)
                subprocess.run(command, check=True)
    print(summarize(args.output_dir, args.seeds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
