"""Step time and peak memory of noise distillation against plain fine-tuning and Bridge's ModelOpt route (one GPU).

Each mode runs Megatron-Bridge's real training loop (``pretrain``: DDP, Float16Module, bf16, Adam, mock data) on
the same model in a fresh process, times the last iterations with CUDA synchronisation around each step and reads
the peak allocated memory; the parent prints them side by side as ratios.

- ``plain``: ``GPTModelProvider`` + Bridge's ``gpt_step.forward_step`` (plain fine-tuning);
- ``noise``: ``NoisyGPTModelProvider`` + ``noise_forward_step`` (NEFTune, no teacher);
- ``noise_kd``: ``NoisyDistillationProvider`` + ``distillation_forward_step`` (CE + forward KL to the clean copy);
- ``modelopt``: Bridge's ``DistillationProvider`` (ModelOpt) with the same noisy student and a teacher holding the
  same weights, ``forward_step_modelopt``, CE kept (``skip_lm_loss=False``) and logits KL.

    python benchmarks/distillation_step.py [--iterations 20] [--json results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

MODES = ("plain", "noise", "noise_kd", "modelopt")
MODEL = dict(num_layers=8, hidden_size=2048, ffn_hidden_size=8192, num_attention_heads=16, vocab_size=32768)
SEQ, MICRO_BATCH, GLOBAL_BATCH = 2048, 2, 8


def _provider_settings():
    import torch

    from nemo_noise_plugin.recipes.tiny import local_spec_settings

    return dict(
        **MODEL,
        **local_spec_settings(),
        seq_length=SEQ,
        make_vocab_size_divisible_by=128,
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
    )


def _model_and_step(mode: str):
    from nemo_noise_plugin.bridge_imports import import_bridge
    from nemo_noise_plugin.distillation.config import KDConfig
    from nemo_noise_plugin.noise.config import NoiseConfig
    from nemo_noise_plugin.providers import GPTModelProvider, NoisyDistillationProvider, NoisyGPTModelProvider
    from nemo_noise_plugin.training.forward_step import distillation_forward_step, noise_forward_step

    gpt_step = import_bridge("megatron.bridge.training.gpt_step")
    settings, noise = _provider_settings(), NoiseConfig(alpha=5.0)
    if mode == "plain":
        return GPTModelProvider(**settings), gpt_step.forward_step
    if mode == "noise":
        return NoisyGPTModelProvider(**settings, noise=noise), noise_forward_step
    if mode == "noise_kd":
        return NoisyDistillationProvider(**settings, noise=noise, kd=KDConfig()), distillation_forward_step
    distillation_provider = import_bridge("megatron.bridge.models.distillation_provider")
    distillation = import_bridge("megatron.bridge.training.post_training.distillation")
    # Bridge's forward_step_modelopt does not hand the loss mask to the model, so the student's noise is scaled by
    # the padded length here (same cost; the true-length scaling needs the plugin's forward step).
    padded = NoiseConfig(alpha=5.0, scaling="padded_length")
    student, teacher = NoisyGPTModelProvider(**settings, noise=padded), GPTModelProvider(**settings)
    students: list = []
    student.register_pre_wrap_hook(lambda chunks: (students.append(chunks), chunks)[1])
    teacher.register_pre_wrap_hook(lambda chunks: _copy_weights(students[-1], chunks))  # same weights as ours
    config = distillation.ModelOptDistillConfig(
        logit_layers=("output_layer", "output_layer"), skip_lm_loss=False, kd_loss_scale=1.0, logit_kl_temperature=1.0
    )
    model = distillation_provider.convert_to_distillation_provider(student, teacher, config)
    return model, gpt_step.forward_step_modelopt


def _copy_weights(source_chunks, target_chunks):
    import torch

    with torch.no_grad():
        for target, source in zip(target_chunks[0].parameters(), source_chunks[0].parameters(), strict=True):
            target.copy_(source)
    return target_chunks


def _config(model):
    import tempfile

    from nemo_noise_plugin.recipes.tiny import small_gpt_config

    config = small_gpt_config(
        model,
        run_dir=tempfile.mkdtemp(),
        train_iters=0,
        seq_length=SEQ,
        lr=1e-5,
        data="mock",
        vocab_size=MODEL["vocab_size"],
    )
    config.train.global_batch_size, config.train.micro_batch_size = GLOBAL_BATCH, MICRO_BATCH
    config.validation.eval_interval, config.validation.eval_iters = 10_000, 0
    config.scheduler.lr_decay_style = "constant"
    config.logger.log_interval = 5
    config.checkpoint.save = config.checkpoint.load = None
    return config


def run_mode(mode: str, iterations: int, warmup: int) -> dict:
    """One mode in this process: Bridge's ``pretrain`` with a step timer; returns times and peak memory."""
    import torch

    from nemo_noise_plugin.bridge_imports import import_bridge, use_prebuilt_dataset_helpers

    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(name, value)
    os.environ.setdefault("MASTER_PORT", str(29500 + MODES.index(mode)))
    use_prebuilt_dataset_helpers()
    callbacks = import_bridge("megatron.bridge.training.callbacks")
    pretrain = import_bridge("megatron.bridge.training.pretrain").pretrain

    times: list[float] = []

    class StepTimer(callbacks.Callback):
        def on_train_step_start(self, context) -> None:
            torch.cuda.synchronize()
            self.started = time.perf_counter()

        def on_train_step_end(self, context) -> None:
            torch.cuda.synchronize()
            times.append(time.perf_counter() - self.started)

    model, forward_step = _model_and_step(mode)
    config = _config(model)
    config.train.train_iters = warmup + iterations
    pretrain(config, forward_step, callbacks=[StepTimer()])
    measured = sorted(times[warmup:])
    return {
        "mode": mode,
        "median_step_ms": 1000 * measured[len(measured) // 2],
        "mean_step_ms": 1000 * sum(measured) / len(measured),
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
        "iterations": len(measured),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=MODES, help="run one mode in this process (the parent runs all)")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated modes for the parent to run")
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    if args.mode:
        result = run_mode(args.mode, args.iterations, args.warmup)
        print("RESULT " + json.dumps(result), flush=True)
        return
    results = {}
    for mode in args.modes.split(","):
        command = [sys.executable, __file__, "--mode", mode, "--iterations", str(args.iterations)]
        command += ["--warmup", str(args.warmup)]
        completed = subprocess.run(command, capture_output=True, text=True)
        lines = [line for line in completed.stdout.splitlines() if line.startswith("RESULT ")]
        if completed.returncode != 0 or not lines:
            print(
                f"mode {mode} failed (exit {completed.returncode}):\n"
                f"{completed.stdout[-3000:]}\n{completed.stderr[-6000:]}"
            )
            continue
        results[mode] = json.loads(lines[-1][len("RESULT ") :])
    import torch

    print(
        f"\n{torch.cuda.get_device_name()}; GPT {MODEL}, seq {SEQ}, micro-batch {MICRO_BATCH}, "
        f"global batch {GLOBAL_BATCH}, bf16, Bridge pretrain loop; median of {args.iterations} steps"
    )
    base = results.get("plain")
    print(f"{'mode':<10}{'step ms':>10}{'vs plain':>10}{'peak GiB':>10}{'vs plain':>10}")
    for mode, result in results.items():
        time_ratio = result["median_step_ms"] / base["median_step_ms"] if base else float("nan")
        memory_ratio = result["peak_memory_gib"] / base["peak_memory_gib"] if base else float("nan")
        print(
            f"{mode:<10}{result['median_step_ms']:>10.1f}{time_ratio:>9.3f}x"
            f"{result['peak_memory_gib']:>10.2f}{memory_ratio:>9.3f}x"
        )
    if "noise_kd" in results and "modelopt" in results:
        ours, theirs = results["noise_kd"], results["modelopt"]
        print(
            f"noise_kd / modelopt: step time {ours['median_step_ms'] / theirs['median_step_ms']:.3f}x, "
            f"peak memory {ours['peak_memory_gib'] / theirs['peak_memory_gib']:.3f}x"
        )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=2)


if __name__ == "__main__":
    main()
