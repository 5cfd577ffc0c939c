"""Per-stage cost of clean-teacher distillation under PP=2, measured on one GPU: KD vs plain fine-tuning.

A PP=2 split of an 8-layer GPT (hidden 2048, FFN 8192, 16 heads, vocabulary 32768, local spec, bf16): the first
stage's chunk (embedding + layers 0-3) and the last stage's chunk (layers 4-7 + final norm + output layer + loss),
built by the plugin's providers. Each stage runs its own share of one PP=2 1F1B step over 4 microbatches (first
stage: F0 F1 B0 F2 B1 F3 B2 B3; last stage: F0 B0 F1 B1 ... ; the gradient/activation a neighbour would send is a
fixed random tensor), in these modes:

- ``first_plain`` / ``last_plain``: plain fine-tuning (Megatron's CE on the last stage, no noise, no teacher);
- ``first_kd``: NEFTune noise + the teacher chunk's forward under ``no_grad`` per microbatch (what
  ``distillation.pipeline_teacher`` does there, the send left out);
- ``last_kd``: the student chunk + the teacher's last chunk and output layer under ``no_grad`` + the plugin's
  ``combined_distillation_loss`` (CE + forward KL), as ``distillation_forward_step`` does on the last stage;
- ``last_full_teacher``: the other design, a complete teacher on the last stage (both teacher chunks run there);
- ``first_plain_again``: plain again, the plain-vs-plain control.

All modes live in one process and are measured by the method of ``benchmarks/step_timing.py``: interleaved repeats
in rotating order, CUDA-synchronised steps, the first ``--discard`` of each slot dropped, per-repeat ratios against
the same repeat's plain step of the stage, reported as median [bootstrap 95 %] (min, max).
Memory: the activation peak of a stage's step
(``max_memory_allocated`` minus what was allocated before it), plus the stage's resident state counted from
parameter numbers: bf16 weights (2 B/param), fp32 main grads + Adam master/m/v (16 B/param, Bridge's default
optimizer without distributed sharding) and, with KD, the teacher's bf16 weights (2 B/param).

    python benchmarks/distillation_pp.py [--repeats 5] [--steps 6] [--discard 1] [--tiny --cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks.step_timing, from a checkout

from benchmarks.step_timing import format_ratio, measure_interleaved, ratio_summary, repeat_medians  # noqa: E402

MODEL = dict(num_layers=4, hidden_size=2048, ffn_hidden_size=8192, num_attention_heads=16, vocab_size=32768)
TINY = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, vocab_size=256)
SEQ, MICRO_BATCH, MICROBATCHES = 2048, 2, 4
MODES = ("first_plain", "first_kd", "last_plain", "last_kd", "last_full_teacher", "first_plain_again")
FIRST_STAGE_ORDER = ("F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3")
LAST_STAGE_ORDER = ("F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3")


def _setup(device: str) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29533")):
        os.environ.setdefault(name, value)
    if device == "cpu":
        from nemo_noise_plugin.jobs.cpu.substitutes import install_cpu_substitutes

        install_cpu_substitutes()
    else:
        torch.cuda.set_device(0)
    dist.init_process_group("gloo" if device == "cpu" else "nccl", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(1234)


def _chunks(model: dict, seq: int, device: str):
    """Student chunks of both stages (first: noisy) and their clean teachers, from the plugin's provider."""
    import torch
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.module import Float16Module

    from nemo_noise_plugin.distillation.config import KDConfig
    from nemo_noise_plugin.distillation.teacher import build_clean_teacher
    from nemo_noise_plugin.noise.config import NoiseConfig
    from nemo_noise_plugin.providers import NoisyDistillationProvider
    from nemo_noise_plugin.recipes.common import local_spec_settings

    provider = NoisyDistillationProvider(
        **model,
        **local_spec_settings(),
        seq_length=seq,
        make_vocab_size_divisible_by=128,
        share_embeddings_and_output_weights=False,
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        use_cpu_initialization=device == "cpu",
        noise=NoiseConfig(alpha=5.0, scaling="padded_length"),
        kd=KDConfig(),
    )
    provider.finalize()
    provider._pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    torch.manual_seed(1)
    first = provider.provide(pre_process=True, post_process=False)
    last = provider.provide(pre_process=False, post_process=True)
    # Float16Module casts every parameter to bf16, as Bridge does; its output cast to fp32 belongs to the last stage
    # only (on one GPU it would also apply to the first chunk), so the first chunk runs unwrapped.
    if device != "cpu":  # Bridge's provide_distributed_model moves the chunks; provide() alone does not
        first.cuda()
        last.cuda()
    Float16Module(provider, first)
    chunks = {"first": first, "last": Float16Module(provider, last)}
    teachers = {name: build_clean_teacher(chunk) for name, chunk in chunks.items()}
    return provider, chunks, teachers


def _set_noise(chunk, on: bool) -> None:
    from megatron.core.utils import unwrap_model

    from nemo_noise_plugin.noise.config import NoiseConfig

    unwrap_model(chunk).init_noise(NoiseConfig(alpha=5.0, scaling="padded_length", enabled=on))


class Stage:
    """One stage's work for a mode: ``forward(m)`` and ``backward(m)`` per microbatch, in 1F1B order."""

    def __init__(self, mode, provider, chunks, teachers, batch, device) -> None:
        import torch

        self.mode, self.provider, self.chunks, self.teachers, self.batch = mode, provider, chunks, teachers, batch
        hidden = provider.hidden_size
        shape = (batch["tokens"].size(1), batch["tokens"].size(0), hidden)
        generator = torch.Generator(device=device).manual_seed(7)
        self.upstream_grad = torch.randn(shape, generator=generator, device=device, dtype=torch.bfloat16)
        self.received = torch.randn(shape, generator=generator, device=device, dtype=torch.bfloat16)
        self.outputs: dict[int, object] = {}

    def order(self):
        return FIRST_STAGE_ORDER if self.mode.startswith("first") else LAST_STAGE_ORDER

    def forward(self, microbatch: int) -> None:
        import torch

        batch = self.batch
        if self.mode.startswith("first"):
            output = self.chunks["first"](
                input_ids=batch["tokens"], position_ids=batch["position_ids"], attention_mask=batch["attention_mask"]
            )
            if self.mode == "first_kd":
                with torch.no_grad():
                    self.teachers["first"](
                        input_ids=batch["tokens"],
                        position_ids=batch["position_ids"],
                        attention_mask=batch["attention_mask"],
                    )
            self.outputs[microbatch] = output
            return
        student_input = self.received.detach().requires_grad_(True)
        self.chunks["last"].set_input_tensor(student_input)
        if self.mode == "last_plain":
            losses = self.chunks["last"](
                input_ids=None, position_ids=None, attention_mask=batch["attention_mask"], labels=batch["labels"]
            )
            loss = (losses.float() * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
        else:
            from nemo_noise_plugin.distillation.losses import combined_distillation_loss

            logits = self.chunks["last"](input_ids=None, position_ids=None, attention_mask=batch["attention_mask"])
            with torch.no_grad():
                teacher_input = self.received
                if self.mode == "last_full_teacher":  # the whole teacher runs here, from the tokens
                    teacher_input = self.teachers["first"](
                        input_ids=batch["tokens"],
                        position_ids=batch["position_ids"],
                        attention_mask=batch["attention_mask"],
                    )
                self.teachers["last"].set_input_tensor(teacher_input)
                teacher_logits = self.teachers["last"](
                    input_ids=None, position_ids=None, attention_mask=batch["attention_mask"]
                )
            result = combined_distillation_loss(
                self.provider.kd, logits, teacher_logits, batch["loss_mask"], labels=batch["labels"]
            )
            loss_sum, num_tokens, _ = result.bridge_outputs()
            loss = loss_sum / num_tokens
        self.outputs[microbatch] = loss

    def backward(self, microbatch: int) -> None:
        output = self.outputs.pop(microbatch)
        if self.mode.startswith("first"):
            output.backward(self.upstream_grad)
        else:
            output.backward()

    def step(self) -> None:
        _set_noise(self.chunks["first"], self.mode == "first_kd")
        for item in self.order():
            (self.forward if item[0] == "F" else self.backward)(int(item[1:]))


def _batch(provider, seq: int, device: str):
    import torch

    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, provider.vocab_size, (MICRO_BATCH, seq), generator=generator)
    loss_mask = torch.ones(MICRO_BATCH, seq)
    loss_mask[:, : seq // 4] = 0  # a prompt
    batch = {
        "tokens": tokens,
        "labels": torch.roll(tokens, -1, dims=1),
        "loss_mask": loss_mask,
        "position_ids": torch.arange(seq).expand(MICRO_BATCH, -1).contiguous(),
    }
    batch = {key: value.to(device) for key, value in batch.items()}
    # Megatron's local attention builds its default causal mask on "cuda"; on the CPU pass it explicitly.
    batch["attention_mask"] = (
        None if device != "cpu" else torch.triu(torch.ones(seq, seq), 1).bool().view(1, 1, seq, seq)
    )
    return batch


def _parameters(module) -> int:
    return sum(p.numel() for p in module.parameters())


def run(repeats: int, steps: int, discard: int, tiny: bool, device: str) -> dict:
    import torch

    _setup(device)
    model, seq = (TINY, 64) if tiny else (MODEL, SEQ)
    provider, chunks, teachers = _chunks(model, seq, device)
    batch = _batch(provider, seq, device)
    synchronize = torch.cuda.synchronize if device != "cpu" else (lambda: None)
    stages = {mode: Stage(mode, provider, chunks, teachers, batch, device) for mode in MODES}
    for stage in stages.values():  # warm-up: allocator, kernels, gradients allocated
        stage.step()
    activation_peak = dict.fromkeys(MODES, 0)

    def runner(mode: str):
        def run_steps(count: int) -> list[float]:
            samples = []
            for _ in range(count):
                synchronize()
                if device != "cpu":
                    before = torch.cuda.memory_allocated()
                    torch.cuda.reset_peak_memory_stats()
                started = time.perf_counter()
                stages[mode].step()
                synchronize()
                samples.append(time.perf_counter() - started)
                if device != "cpu":
                    activation_peak[mode] = max(activation_peak[mode], torch.cuda.max_memory_allocated() - before)
            return samples

        return run_steps

    measured = measure_interleaved({mode: runner(mode) for mode in MODES}, repeats, steps, discard)
    times = {mode: repeat_medians(repeats_of_mode) for mode, repeats_of_mode in measured.items()}
    counts = {name: _parameters(chunk) for name, chunk in chunks.items()}
    return {
        "times": times,
        "step_seconds_per_repeat": measured,
        "activation_peak": activation_peak,
        "parameters": counts,
        "model": model,
        "seq": seq,
    }


def report(result: dict) -> str:
    times, peaks, counts = result["times"], result["activation_peak"], result["parameters"]
    lines = [
        f"GPT PP=2 split {result['model']} per stage, seq {result['seq']}, micro-batch {MICRO_BATCH}, "
        f"{MICROBATCHES} microbatches per step, {len(times['first_plain'])} interleaved repeats "
        "(benchmarks/step_timing.py)"
    ]
    gib = 2**30
    baseline = {"first": "first_plain", "last": "last_plain"}
    lines.append(
        f"{'mode':<20}{'step ms (median)':>18}  {'vs plain: median [bootstrap 95 %] (min, max)':<46}"
        f"{'act. peak GiB':>15}{'stage GiB':>11}{'vs plain':>10}"
    )
    for mode in MODES:
        stage = "first" if mode.startswith("first") else "last"
        summary = ratio_summary([[value] for value in times[mode]], [[value] for value in times[baseline[stage]]])
        resident = 18 * counts[stage]
        if mode in ("first_kd", "last_kd"):
            resident += 2 * counts[stage]
        if mode == "last_full_teacher":
            resident += 2 * (counts["first"] + counts["last"])
        total = resident + peaks[mode]
        plain_total = 18 * counts[stage] + peaks[baseline[stage]]
        lines.append(
            f"{mode:<20}{1000 * statistics.median(times[mode]):>18.1f}"
            f"  {format_ratio(summary):<46}"
            f"{peaks[mode] / gib:>15.2f}{total / gib:>11.2f}{total / plain_total:>9.3f}x"
        )
    lines.append(f"parameters: first chunk {counts['first'] / 1e6:.1f} M, last chunk {counts['last'] / 1e6:.1f} M")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=6, help="steps per mode per repeat")
    parser.add_argument("--discard", type=int, default=1, help="steps dropped at the start of each slot")
    parser.add_argument("--tiny", action="store_true", help="a tiny model (a quick check of the script)")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU (with --tiny)")
    parser.add_argument("--json", help="write the raw results here")
    args = parser.parse_args()
    result = run(args.repeats, args.steps, args.discard, args.tiny, "cpu" if args.cpu else "cuda")
    print(report(result), flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=2)


if __name__ == "__main__":
    main()
