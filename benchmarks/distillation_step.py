"""Step time and peak memory of noise distillation against plain fine-tuning and Bridge's ModelOpt route (one GPU).

Every mode is set up in one process with Megatron-Bridge's own ``setup`` (DDP, Float16Module, bf16, Adam, mock
data) and trained by Bridge's own ``train`` loop, re-entered for a few steps at a time: the modes run interleaved
in rotating order (``benchmarks/step_timing.py`` says how the repeats become ratios with a spread), with CUDA
synchronisation around each step.

- ``plain``: ``GPTModelProvider`` + Bridge's ``gpt_step.forward_step`` (plain fine-tuning), the baseline;
- ``plain_control``: the same again on its own copy, the control pair that shows the method's resolution;
- ``noise``: ``NoisyGPTModelProvider`` + ``noise_forward_step`` (NEFTune, no teacher);
- ``noise_kd``: ``NoisyDistillationProvider`` + ``distillation_forward_step`` (CE + forward KL to the clean copy);
- ``modelopt``: Bridge's ``DistillationProvider`` (ModelOpt) with the same noisy student and a teacher holding the
  same weights, ``forward_step_modelopt``, CE kept (``skip_lm_loss=False``) + logits KL at a fixed weight 1 (noise_kd's
  objective; ModelOpt's default balancer does not train here: ``modelopt_provider`` says why);
- ``teacher_forward``: one step's worth of no-grad forwards (every microbatch) of the plain model: the floor that
  any separate teacher adds to a step, against which ``noise_kd`` is read.

Peak memory in the interleaved run is each mode's resident memory (allocated after its first steps minus before its
setup) plus the largest transient peak of its slots: an upper bound (on the H200 it counted about 3.2 GiB more than
a fresh process of the mode reaches). ``--fresh-process-memory`` measures the exact peak of each mode alone in a
fresh process (``torch.cuda.max_memory_allocated``); the published memory ratios come from it.

A baseline must train before its speed is compared: after the interleaved run every trained mode's ``lm loss`` must
fall (mean of its last ``--loss-window`` steps at most ``1 - --min-loss-drop`` times the mean of its first); if one
does not, a ``FAILED`` line names it, no ratio is printed and the exit status is 1.

    python benchmarks/distillation_step.py [--repeats 7] [--steps 8] [--discard 2] [--json results.json]
        [--profile profile.txt]
    python benchmarks/distillation_step.py --fresh-process-memory plain,noise,noise_kd,modelopt --warm-steps 5
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks.step_timing, from a checkout

from benchmarks.step_timing import (  # noqa: E402
    format_ratio,
    measure_interleaved,
    median_ms,
    ratio_summary,
    repeat_medians,
)

MODES = ("plain", "plain_control", "noise", "noise_kd", "modelopt", "teacher_forward")
MODEL = dict(num_layers=8, hidden_size=2048, ffn_hidden_size=8192, num_attention_heads=16, vocab_size=32768)
SEQ, MICRO_BATCH, GLOBAL_BATCH = 2048, 2, 8


def _provider_settings():
    import torch

    from nemo_noise_plugin.recipes.common import local_spec_settings

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
    from nemo_noise_plugin.distillation.config import KDConfig
    from nemo_noise_plugin.noise.config import NoiseConfig
    from nemo_noise_plugin.providers import GPTModelProvider, NoisyDistillationProvider, NoisyGPTModelProvider
    from nemo_noise_plugin.training.forward_step import distillation_forward_step, noise_forward_step
    from nemo_noise_plugin.upstream.bridge_imports import import_bridge

    gpt_step = import_bridge("megatron.bridge.training.gpt_step")
    settings, noise = _provider_settings(), NoiseConfig(alpha=5.0)
    if mode in ("plain", "plain_control"):
        return GPTModelProvider(**settings), gpt_step.forward_step
    if mode == "noise":
        return NoisyGPTModelProvider(**settings, noise=noise), noise_forward_step
    if mode == "noise_kd":
        return NoisyDistillationProvider(**settings, noise=noise, kd=KDConfig()), distillation_forward_step
    return modelopt_provider(settings), gpt_step.forward_step_modelopt


def modelopt_provider(settings: dict, kd_weight: float | None = 1.0):
    """Bridge's ``DistillationProvider`` (ModelOpt): the noisy student, a teacher holding its start weights, logits KL.

    The loss is ``CE + kd_weight * KL(teacher || student)`` at T = 1, summed over the loss mask like Bridge's CE:
    noise_kd's objective (``KDConfig()``), so both modes train the same loss and their step times compare like for
    like. ModelOpt's default balancer is *not* used (issue 26): with ``skip_lm_loss=False`` its
    ``LogitsAndIntermediatesLossBalancer`` rescales the KD term of every microbatch to the CE's size
    (``kd *= CE.detach() / kd.detach()``), so the KL's gradient is multiplied by CE / KL. A balance made for a
    trained teacher; here the teacher starts as the student's own weights and the KL is only the noise's effect
    (about 1/400 of the CE on the tiny CPU model of
    ``tests/benchmarks/test_distillation_step_modelopt.py``), so the KL's gradient outweighed the CE's by that
    factor: the grad norm grew (612 -> 1830 on the H200) and the lm loss did not fall (10.79 -> 10.74) while every
    other mode fell to about 4.0. The fixed weight below trains like the
    other modes (and drops the two host syncs per microbatch of that balancer's ``if kd_loss > 0 and
    original_loss > 0``). ``kd_weight=None`` builds the old configuration (ModelOpt's default balancer), for the
    test that shows it does not train.
    """
    from nemo_noise_plugin.noise.config import NoiseConfig
    from nemo_noise_plugin.providers import GPTModelProvider, NoisyGPTModelProvider
    from nemo_noise_plugin.upstream.bridge_imports import import_bridge

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
        logit_layers=("output_layer", "output_layer"),
        skip_lm_loss=False,
        logit_kl_temperature=1.0,
        loss_balancer=None if kd_weight is None else fixed_weight_balancer(kd_weight),
    )
    return distillation_provider.convert_to_distillation_provider(student, teacher, config)


def fixed_weight_balancer(kd_weight: float):
    """A ModelOpt loss balancer returning ``CE + kd_weight * logits KL`` (no per-microbatch rescaling)."""
    import modelopt.torch.distill as mtd
    import torch

    class FixedWeightBalancer(mtd.DistillationLossBalancer):
        def forward(self, loss_dict: dict) -> dict:
            ce = loss_dict.pop(mtd.loss_balancers.STUDENT_LOSS_KEY)
            if len(loss_dict) != 1:
                raise ValueError(f"expected the logits loss alone, got {sorted(loss_dict)}")
            (logits_loss,) = loss_dict.values()
            total = ce + kd_weight * logits_loss
            return {"kd_loss": total, "logits_loss": logits_loss, "intermediate_loss": torch.zeros_like(logits_loss)}

    return FixedWeightBalancer()


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


class BridgeRun:
    """One mode set up in this process by Bridge's ``setup``; ``steps(n)`` re-enters Bridge's ``train`` for n steps.

    ``model_and_step(mode)`` -> (provider, forward step) and ``config_for(provider)`` -> ``ConfigContainer`` build the
    mode (default: this benchmark's GPT on mock data); ``losses`` holds every step's ``lm loss``, so a caller can
    check that a mode trains before its speed is compared.
    """

    def __init__(self, mode: str, total_steps: int, model_and_step=None, config_for=None) -> None:
        import torch
        from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator
        from megatron.core.rerun_state_machine import destroy_rerun_state_machine

        from nemo_noise_plugin.upstream.bridge_imports import import_bridge

        callbacks = import_bridge("megatron.bridge.training.callbacks")
        config_module = import_bridge("megatron.bridge.training.config")
        data_utils = import_bridge("megatron.bridge.data.utils")
        setup = import_bridge("megatron.bridge.training.setup").setup
        state_module = import_bridge("megatron.bridge.training.state")
        self._train = import_bridge("megatron.bridge.training.train").train
        times: list[float] = []
        losses: list[float] = []
        self.times, self.losses = times, losses

        class StepTimer(callbacks.Callback):
            def on_train_step_start(self, context) -> None:
                torch.cuda.synchronize()
                self.started = time.perf_counter()

            def on_train_step_end(self, context) -> None:
                torch.cuda.synchronize()
                times.append(time.perf_counter() - self.started)
                if context.loss_dict and "lm loss" in context.loss_dict:
                    losses.append(float(context.loss_dict["lm loss"]))

        # Bridge's setup initialises these process-wide singletons and refuses to do it twice; every mode has the
        # same batch sizes and rerun settings, so each setup may replace the previous mode's.
        destroy_num_microbatches_calculator()
        destroy_rerun_state_machine()
        model, self.forward_step = (model_and_step or _model_and_step)(mode)
        config = (config_for or _config)(model)
        config.train.train_iters = total_steps  # sizes the mock dataset; each steps() call moves the stop
        config_module.runtime_config_update(config)
        self.state = state_module.GlobalState()
        self.state.cfg = config
        self.callbacks = callbacks.normalize_callbacks([StepTimer()])
        self.setup = setup(self.state, data_utils.get_dataset_provider(config.dataset), callback_manager=self.callbacks)
        self.state.cfg.train.train_iters = 0

    @property
    def model(self):
        return self.setup.model

    def steps(self, count: int) -> list[float]:
        """Run ``count`` more steps of Bridge's training loop; each step's wall time in seconds."""
        out = self.setup
        self.times.clear()
        # train() starts its interval timer on entry and leaves it running on return: reset it for the re-entry.
        self.state.timers("interval-time", log_level=0).reset()
        self.state.cfg.train.train_iters = self.state.train_state.step + count
        self._train(
            self.forward_step,
            out.model,
            out.optimizer,
            out.scheduler,
            out.train_data_iterator,
            out.valid_data_iterator,
            self.state,
            out.checkpoint_manager,
            out.pg_collection,
            callback_manager=self.callbacks,
        )
        return list(self.times)


class TeacherForward:
    """One step's no-grad forwards of a plain model (every microbatch of a step): a separate teacher's floor."""

    def __init__(self, model) -> None:
        import torch

        self.model = model
        generator = torch.Generator(device="cuda").manual_seed(5)
        self.tokens = [
            torch.randint(0, MODEL["vocab_size"], (MICRO_BATCH, SEQ), device="cuda", generator=generator)
            for _ in range(GLOBAL_BATCH // MICRO_BATCH)
        ]
        self.position_ids = torch.arange(SEQ, device="cuda").unsqueeze(0).expand(MICRO_BATCH, -1)

    def steps(self, count: int) -> list[float]:
        import torch

        times = []
        self.model.eval()  # a teacher runs without dropout
        for _ in range(count):
            torch.cuda.synchronize()
            started = time.perf_counter()
            with torch.no_grad():
                for tokens in self.tokens:
                    self.model(tokens, self.position_ids, None)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
        self.model.train()
        return times


class MemoryTracked:
    """A mode's step runner that also records the largest transient peak of its slots above their start."""

    def __init__(self, runner) -> None:
        self.runner, self.transient_bytes = runner, 0

    def steps(self, count: int) -> list[float]:
        import torch

        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        times = self.runner.steps(count)
        torch.cuda.synchronize()
        self.transient_bytes = max(self.transient_bytes, torch.cuda.max_memory_allocated() - start)
        return times


def build_modes(modes: list[str], total_steps: int, warm_steps: int) -> tuple[dict, dict[str, int]]:
    """Set up each mode and warm it with ``warm_steps`` steps; returns the runners and each one's resident bytes."""
    import torch

    runners: dict[str, MemoryTracked] = {}
    resident: dict[str, int] = {}
    built: dict[str, BridgeRun] = {}
    # The first mode set up also holds the process's one-time buffers; the control, not the baseline, carries them.
    for mode in sorted(modes, key=lambda name: name != "plain_control"):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        if mode == "teacher_forward":
            plain = built.get("plain") or BridgeRun("plain", total_steps)
            built.setdefault("plain", plain)
            runner = TeacherForward(plain.model[0])
        else:
            runner = built.setdefault(mode, BridgeRun(mode, total_steps))
        runners[mode] = MemoryTracked(runner)
        runners[mode].steps(warm_steps)
        torch.cuda.synchronize()
        resident[mode] = torch.cuda.memory_allocated() - before
    return runners, resident


def profile_modes(runners: dict, modes: list[str], steps: int, path: str) -> None:
    """Profile ``steps`` steps of each mode (CPU and CUDA): the operators and kernel counts, side by side, to a file."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    lines = []
    for mode in modes:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=False) as prof:
            runners[mode].steps(steps)
        events = prof.key_averages()
        kernels = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
        cpu_ops = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CPU)
        lines.append(f"===== {mode}: {steps} steps, {kernels} CUDA kernel launches, {cpu_ops} CPU op events =====")
        lines.append(events.table(sort_by="self_cpu_time_total", row_limit=40))
        lines.append(events.table(sort_by="self_cuda_time_total", row_limit=25))
        counts = {e.key: e.count for e in events}
        lines.append("op counts: " + json.dumps(counts, sort_keys=True))
    with open(path, "w") as handle:
        handle.write("\n".join(lines))


def fresh_process_peak(mode: str, steps: int) -> dict:
    """This mode alone in this process: set up, ``steps`` steps, and the process's peak allocated memory."""
    import torch

    run = BridgeRun(mode, steps + 10)
    run.steps(steps)
    return {"mode": mode, "peak_gib": torch.cuda.max_memory_allocated() / 2**30, "lm_loss": list(run.losses)}


def fresh_process_peaks(modes: list[str], steps: int) -> tuple[dict[str, float], dict[str, list[float]]]:
    """Each mode's peak in a process of its own (a check of the in-process resident + transient accounting), and the
    lm loss of its steps there."""
    import subprocess

    peaks, losses = {}, {}
    for mode in modes:
        command = [sys.executable, __file__, "--peak-of", mode, "--warm-steps", str(steps)]
        completed = subprocess.run(command, capture_output=True, text=True)
        lines = [line for line in completed.stdout.splitlines() if line.startswith("PEAK ")]
        if completed.returncode != 0 or not lines:
            raise RuntimeError(f"mode {mode} failed (exit {completed.returncode}):\n{completed.stderr[-4000:]}")
        record = json.loads(lines[-1][len("PEAK ") :])
        peaks[mode], losses[mode] = record["peak_gib"], record["lm_loss"]
    return peaks, losses


def loss_checks(losses: dict[str, list[float]], window: int = 5, min_drop: float = 0.1) -> dict[str, dict]:
    """Whether each mode trained: the mean lm loss of its last ``window`` steps is at most ``1 - min_drop`` times that
    of its first ``window`` steps (finite, and with at least ``2 * window`` steps recorded)."""
    import math

    checks = {}
    for mode, values in losses.items():
        first = sum(values[:window]) / window if len(values) >= 2 * window else math.nan
        last = sum(values[-window:]) / window if len(values) >= 2 * window else math.nan
        trains = math.isfinite(first) and math.isfinite(last) and last <= (1 - min_drop) * first
        checks[mode] = {"steps": len(values), "first_mean": first, "last_mean": last, "trains": trains}
    return checks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated modes; the first is the baseline")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=8, help="steps per mode per repeat")
    parser.add_argument("--discard", type=int, default=2, help="steps dropped at the start of each slot")
    parser.add_argument("--warm-steps", type=int, default=3, help="steps run right after each mode's setup")
    parser.add_argument("--loss-window", type=int, default=5, help="steps averaged at each end for the loss check")
    parser.add_argument(
        "--min-loss-drop", type=float, default=0.1, help="least relative fall of each trained mode's lm loss"
    )
    parser.add_argument("--json", help="write every repeat's step times and the summaries here")
    parser.add_argument(
        "--fresh-process-memory", help="comma-separated modes: only measure each one's peak memory in its own process"
    )
    parser.add_argument("--peak-of", choices=MODES, help=argparse.SUPPRESS)  # the child of --fresh-process-memory
    parser.add_argument("--profile", help="also profile 3 steps of plain, noise and noise_kd into this file")
    args = parser.parse_args()
    modes = args.modes.split(",")
    if unknown := sorted(set(modes) - set(MODES)):
        parser.error(f"--modes: unknown {unknown}; choose from {', '.join(MODES)}")
    trained = ("plain", "noise", "noise_kd", "modelopt")
    if args.fresh_process_memory and (bad := sorted(set(args.fresh_process_memory.split(",")) - set(trained))):
        parser.error(f"--fresh-process-memory: unknown {bad}; choose from {', '.join(trained)}")
    import torch

    from nemo_noise_plugin.upstream.bridge_imports import use_prebuilt_dataset_helpers

    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(name, value)
    os.environ.setdefault("MASTER_PORT", "29517")
    use_prebuilt_dataset_helpers()
    if args.peak_of:
        print("PEAK " + json.dumps(fresh_process_peak(args.peak_of, args.warm_steps)), flush=True)
        return
    if args.fresh_process_memory:
        peaks, losses = fresh_process_peaks(args.fresh_process_memory.split(","), args.warm_steps)
        base_peak = next(iter(peaks.values()))
        print(f"peak memory, each mode in a fresh process after {args.warm_steps} steps (lm loss of those steps):")
        for mode, peak in peaks.items():
            trace = " ".join(f"{loss:.2f}" for loss in losses[mode])
            print(f"{mode:<16}{peak:>9.2f} GiB{peak / base_peak:>9.3f}x  lm loss {trace}")
        if {"noise_kd", "modelopt"} <= set(peaks):
            print(f"noise_kd / modelopt peak memory: {peaks['noise_kd'] / peaks['modelopt']:.3f}x (target <= 0.85x)")
        if args.json:
            with open(args.json, "w") as handle:
                json.dump(
                    {"fresh_process_peak_gib": peaks, "lm_loss": losses, "settings": vars(args)}, handle, indent=2
                )
        return
    total = args.warm_steps + args.repeats * args.steps + 10
    runners, resident = build_modes(modes, total, args.warm_steps)
    measured = measure_interleaved(
        {mode: runners[mode].steps for mode in modes}, args.repeats, args.steps, args.discard
    )
    base = modes[0]
    results: dict = {"modes": {}, "settings": vars(args) | {"model": MODEL, "seq": SEQ, "global_batch": GLOBAL_BATCH}}
    losses = {mode: list(runners[mode].runner.losses) for mode in modes if mode != "teacher_forward"}
    checks = loss_checks(losses, args.loss_window, args.min_loss_drop)
    results["lm_loss"], results["loss_check"] = losses, checks
    print(f"\nlm loss, mean of the first -> last {args.loss_window} of each trained mode's steps:")
    for mode, check in checks.items():
        verdict = "trains" if check["trains"] else "FAILED"
        print(f"  {mode:<16}{check['first_mean']:.4f} -> {check['last_mean']:.4f}  {verdict}")
    if failed := [mode for mode, check in checks.items() if not check["trains"]]:
        print(
            f"FAILED: {', '.join(failed)} did not train (lm loss fell less than {args.min_loss_drop:.0%} from its "
            f"first {args.loss_window} steps to its last): no ratio is compared against a mode that does not train"
        )
        if args.json:
            with open(args.json, "w") as handle:
                json.dump(results, handle, indent=2)
        sys.exit(1)
    print(
        f"\n{torch.cuda.get_device_name()}; GPT {MODEL}, seq {SEQ}, micro-batch {MICRO_BATCH}, global batch "
        f"{GLOBAL_BATCH}, bf16, Bridge setup + train loop in one process; {args.repeats} interleaved repeats x "
        f"{args.steps} steps (first {args.discard} dropped); ratio = median of per-repeat ratios [bootstrap 95 %] "
        "(min, max)"
    )
    print(f"{'mode':<16}{'step ms':>9}  {'vs ' + base:<46}{'peak GiB (in-process upper bound)':>9}")
    peak = {mode: resident[mode] + runners[mode].transient_bytes for mode in modes}
    for mode in modes:
        summary = ratio_summary(measured[mode], measured[base])
        results["modes"][mode] = {
            "median_step_ms": median_ms(measured[mode]),
            "vs_baseline": summary,
            "resident_gib": resident[mode] / 2**30,
            "peak_gib": peak[mode] / 2**30,
            "step_seconds_per_repeat": measured[mode],
        }
        memory_ratio = peak[mode] / peak[base]
        print(
            f"{mode:<16}{median_ms(measured[mode]):>9.1f}  {format_ratio(summary):<46}"
            f"{peak[mode] / 2**30:>9.2f}{memory_ratio:>9.3f}x"
        )
    if {"noise_kd", "teacher_forward", "plain"} <= set(modes):
        plain, teacher = repeat_medians(measured["plain"]), repeat_medians(measured["teacher_forward"])
        floor = [[p + t] for p, t in zip(plain, teacher, strict=True)]
        summary = ratio_summary(measured["noise_kd"], floor)
        results["noise_kd_vs_plain_plus_teacher_forward"] = summary
        print(f"noise_kd / (plain + teacher_forward): {format_ratio(summary)}  (target <= 1.03x)")
    if {"noise_kd", "modelopt"} <= set(modes):
        summary = ratio_summary(measured["noise_kd"], measured["modelopt"])
        results["noise_kd_vs_modelopt"] = summary | {"peak_memory": peak["noise_kd"] / peak["modelopt"]}
        print(
            f"noise_kd / modelopt: step time {format_ratio(summary)}, peak memory "
            f"{peak['noise_kd'] / peak['modelopt']:.3f}x (in-process upper bound; exact: --fresh-process-memory)"
        )
    if args.profile:
        profile_modes(runners, [m for m in ("plain", "noise", "noise_kd") if m in runners], 3, args.profile)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=2)


if __name__ == "__main__":
    main()
