"""Step time and tokens/s of SmolLM2-135M instruction fine-tuning through Megatron-Bridge's loop (one GPU).

The SmolLM2 SFT recipe's own config (real weights, the shipped instruction set through Bridge's finetuning data
pipeline, bf16, micro-batch 4, global batch 8, seq length 128), each mode set up in one process with Bridge's
``setup`` and trained by Bridge's ``train`` re-entered a few steps at a time (``distillation_step.BridgeRun``); the
modes run interleaved in rotating order and become ratios with a spread (``benchmarks/step_timing.py``):

- ``plain``: AutoBridge's plain ``GPTModelProvider`` + Bridge's ``gpt_step.forward_step``, the baseline;
- ``plain_control``: the same again on its own copy (the A/A control: the method's resolution on the day);
- ``neftune``: the plugin's provider, NEFTune alpha 5 (true lengths) + ``noise_forward_step``;
- ``noise_kd``: the distillation provider (noisy student, frozen clean copy, CE + forward KL) +
  ``distillation_forward_step``;
- ``teacher_forward``: one step's no-grad forwards of the plain model over the same batches (every microbatch):
  the floor a separate teacher adds, against which ``noise_kd`` is read (target: noise_kd <= plain + it + 3 %).

Every trained mode's loss is checked to fall over its steps before any ratio is printed.

    python benchmarks/real_model_step.py [--hf-path DIR] [--repeats 7] [--steps 8] [--discard 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks.*, from a checkout

from benchmarks.distillation_step import BridgeRun  # noqa: E402
from benchmarks.step_timing import (  # noqa: E402
    format_ratio,
    measure_interleaved,
    median_ms,
    ratio_summary,
    repeat_medians,
)

MODES = ("plain", "plain_control", "neftune", "noise_kd", "teacher_forward")
TRAINED = ("plain", "plain_control", "neftune", "noise_kd")
SEQ, MICRO_BATCH, GLOBAL_BATCH, LR = 128, 4, 8, 1e-4


def _builders(hf_path: str):
    """``model_and_step(mode)`` and ``config_for(provider)`` for ``BridgeRun``: the SmolLM2 SFT recipe's pieces."""
    from nemo_noise_plugin.distillation.config import KDConfig
    from nemo_noise_plugin.noise.config import NoiseConfig
    from nemo_noise_plugin.recipes.common import local_spec_settings
    from nemo_noise_plugin.recipes.smollm2 import instruction_finetuning_config, smollm2_provider
    from nemo_noise_plugin.training.forward_step import distillation_forward_step, noise_forward_step
    from nemo_noise_plugin.upstream.bridge_imports import import_bridge

    gpt_step = import_bridge("megatron.bridge.training.gpt_step")
    auto_bridge = import_bridge("megatron.bridge").AutoBridge

    def model_and_step(mode: str):
        if mode in ("plain", "plain_control"):
            provider = auto_bridge.from_hf_pretrained(hf_path).to_megatron_provider(load_weights=True)
            for name, value in local_spec_settings().items():
                setattr(provider, name, value)
            return provider, gpt_step.forward_step
        if mode == "neftune":
            return smollm2_provider(hf_path, NoiseConfig(alpha=5.0))[0], noise_forward_step
        return smollm2_provider(hf_path, NoiseConfig(alpha=5.0), KDConfig())[0], distillation_forward_step

    def config_for(provider):
        config = instruction_finetuning_config(
            provider,
            hf_path,
            run_dir=tempfile.mkdtemp(prefix="real_model_step-"),
            train_iters=0,
            seq_length=SEQ,
            lr=LR,
            packed_sequence_size=None,
            global_batch_size=GLOBAL_BATCH,
            micro_batch_size=MICRO_BATCH,
        )
        config.validation.eval_interval, config.validation.eval_iters = 10_000, 0
        config.scheduler.lr_decay_style, config.scheduler.lr_warmup_iters = "constant", 0
        config.logger.log_interval = 10_000
        config.checkpoint.save = config.checkpoint.load = None
        return config

    return model_and_step, config_for


class TeacherForward:
    """One step's no-grad forwards (every microbatch) of the plain model over real instruction batches."""

    def __init__(self, run: BridgeRun) -> None:
        from nemo_noise_plugin.jobs.batches import collate, recipe_datasets

        self.model = run.model[0]
        train, _, _ = recipe_datasets(run.state)
        self.batches = collate(train, GLOBAL_BATCH // MICRO_BATCH, MICRO_BATCH, None, "cuda")

    def steps(self, count: int) -> list[float]:
        import torch

        times = []
        self.model.eval()
        for _ in range(count):
            torch.cuda.synchronize()
            started = time.perf_counter()
            with torch.no_grad():
                for batch in self.batches:
                    self.model(batch["tokens"], batch["position_ids"], None)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
        self.model.train()
        return times


def tokens_per_step(run: BridgeRun, steps: int = 32) -> float:
    """Mean padded tokens of one global batch over the first ``steps`` batches of the train split (as collated)."""
    from nemo_noise_plugin.jobs.batches import collate, recipe_datasets

    train, _, _ = recipe_datasets(run.state)
    batches = collate(train, steps * GLOBAL_BATCH // MICRO_BATCH, MICRO_BATCH, None, "cpu")
    return statistics.mean(batch["tokens"].numel() for batch in batches) * GLOBAL_BATCH / MICRO_BATCH


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hf-path", help="SmolLM2 HF folder (default: nemo_noise_plugin.jobs.models' cache)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=8, help="steps per mode per repeat")
    parser.add_argument("--discard", type=int, default=2, help="steps dropped at the start of each slot")
    parser.add_argument("--warm-steps", type=int, default=3)
    parser.add_argument("--json", help="write every repeat's step times, the losses and the summaries here")
    args = parser.parse_args()
    import torch

    from nemo_noise_plugin.upstream.bridge_imports import use_prebuilt_dataset_helpers

    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(name, value)
    os.environ.setdefault("MASTER_PORT", "29519")
    use_prebuilt_dataset_helpers()
    if args.hf_path is None:
        from nemo_noise_plugin.jobs.models.smollm2_folder import ensure_smollm2_hf

        args.hf_path = str(ensure_smollm2_hf())
    model_and_step, config_for = _builders(args.hf_path)
    total = args.warm_steps + args.repeats * args.steps + 10
    runs = {mode: BridgeRun(mode, total, model_and_step, config_for) for mode in TRAINED}
    runners = {mode: runs[mode].steps for mode in TRAINED}
    runners["teacher_forward"] = TeacherForward(runs["plain"]).steps
    for mode in TRAINED:
        runs[mode].steps(args.warm_steps)
    measured = measure_interleaved({mode: runners[mode] for mode in MODES}, args.repeats, args.steps, args.discard)
    losses = {mode: list(runs[mode].losses) for mode in TRAINED}
    trains = {}
    for mode in TRAINED:
        head, tail = statistics.mean(losses[mode][:5]), statistics.mean(losses[mode][-5:])
        trains[mode] = {"first_5_mean": head, "last_5_mean": tail, "falls": tail < head}
    tokens = tokens_per_step(runs["plain"])
    print(
        f"\n{torch.cuda.get_device_name()}; SmolLM2-135M-Instruct SFT recipe (real weights, instruction set), seq "
        f"{SEQ}, micro-batch {MICRO_BATCH}, global batch {GLOBAL_BATCH} (~{tokens:.0f} padded tokens/step), bf16, "
        f"Bridge setup + train loop in one process; {args.repeats} interleaved repeats x {args.steps} steps (first "
        f"{args.discard} dropped); ratio = median of per-repeat ratios [bootstrap 95 %] (min, max)"
    )
    for mode in TRAINED:
        print(f"  {mode:<14} lm loss {trains[mode]['first_5_mean']:.4f} -> {trains[mode]['last_5_mean']:.4f}")
    if not all(entry["falls"] for entry in trains.values()):
        print("NOT COMPARED: a mode's loss did not fall", {m: e for m, e in trains.items() if not e["falls"]})
        sys.exit(1)
    print(f"{'mode':<16}{'step ms':>9}{'tokens/s':>10}  vs plain")
    results: dict = {"settings": vars(args) | {"seq": SEQ, "global_batch": GLOBAL_BATCH}, "modes": {}}
    results["losses"], results["trains"], results["padded_tokens_per_step"] = losses, trains, tokens
    for mode in MODES:
        summary = ratio_summary(measured[mode], measured["plain"])
        step_ms = median_ms(measured[mode])
        results["modes"][mode] = {
            "median_step_ms": step_ms,
            "tokens_per_s": tokens / (step_ms / 1000) if mode != "teacher_forward" else None,
            "vs_plain": summary,
            "step_seconds_per_repeat": measured[mode],
        }
        rate = f"{tokens / (step_ms / 1000):>10.0f}" if mode != "teacher_forward" else f"{'-':>10}"
        print(f"{mode:<16}{step_ms:>9.1f}{rate}  {format_ratio(summary)}")
    plain, teacher = repeat_medians(measured["plain"]), repeat_medians(measured["teacher_forward"])
    floor = [[p + t] for p, t in zip(plain, teacher, strict=True)]
    summary = ratio_summary(measured["noise_kd"], floor)
    results["noise_kd_vs_plain_plus_teacher_forward"] = summary
    print(f"noise_kd / (plain + teacher_forward): {format_ratio(summary)}  (target <= 1.03x)")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=2)


if __name__ == "__main__":
    main()
