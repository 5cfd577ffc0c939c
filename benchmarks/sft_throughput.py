"""SFT throughput side by side on one GPU: the plugin through Bridge's loop, TRL's SFTTrainer, a plain loop (issue 34).

The same model, micro-batches (made once, in one order, shared by every runner), global batch, sequence length,
bf16, AdamW (betas 0.9/0.999, eps 1e-8, no weight decay, constant lr, clip 1.0) for every runner:

- ``plugin_off`` / ``plugin_on``: the plugin's provider (noise disabled / NEFTune ``--alpha``, true lengths) with
  ``noise_forward_step`` in Bridge's ``setup`` + ``train`` (re-entered a few steps at a time), Megatron's local spec;
  ``plugin_off_sdpa`` / ``plugin_on_sdpa``: the same with the local spec's core attention on PyTorch's SDPA
  (``local_spec_settings("sdpa")``, ``model/sdpa_attention.py``);
- ``plugin_on_graph``: ``plugin_on_sdpa`` with one CUDA graph per step (``recipes.common.use_step_graph``:
  Bridge's ``full_iteration`` graph, captured after 2 eager steps, replayable noise keys published by
  ``PublishNoiseStep``), its micro-batches the same samples padded to ``seq`` (the graph replays fixed shapes; the
  padding is masked, so the loss is the same and tokens/s counts the unpadded batch as for every runner);
  ``plugin_off_graph``: the same, noise off (Megatron keeps one training graph per process in class attributes;
  each graph runner puts its own graph back before its slot, ``PluginGpuRunner``), ``--baseline plugin_off_graph``
  for the noise's cost under the graph with its own A/A control;
- ``plugin_off_again``: the A/A control, ``plugin_off`` itself measured in a second slot of every repeat;
- ``trl_off`` / ``trl_on``: TRL's ``SFTTrainer.train()`` (``neftune_noise_alpha`` None / ``--alpha``), bf16 AMP;
- ``plain``: a transformers model, fused torch AdamW, bf16 autocast: the floor of what the host can launch.

Runners alternate in rotating order (``benchmarks/step_timing.py``: repeats x steps, the first ``--discard`` of each
slot dropped; median step time, ratio to ``plugin_off`` with a bootstrap 95 % interval). Tokens/s counts all tokens
of the padded batch and the answer tokens (loss-mask ones). Peak memory per runner: its own resident memory (the
allocation growth while it was built and warmed up) plus the most its slots allocated above what was resident when
they started (``torch.cuda.max_memory_allocated``), i.e. what the runner would peak at alone. Every step's loss is
kept: runners on the same weights and batches should agree within the noise's spread.

    python benchmarks/sft_throughput.py --model smollm2 --hf-path DIR --out results/sft_smollm2   # ~6 min on an H200
    python benchmarks/sft_throughput.py --model llama-1b --hf-path DIR --out results/sft_llama1b  # ~3 min
    python benchmarks/sft_throughput.py --model tiny --hf-path DIR --device cpu ...                # the CPU smoke test

``--hf-path``: the SmolLM2 HF folder (``scripts/fetch_smollm2.py``). ``llama-1b``: the Llama-3.2-1B architecture at
random initialisation, saved once as an HF folder (with SmolLM2's tokenizer, for TRL's pad id) that every runner
loads (the plugin through AutoBridge, as SmolLM2), trained on random tokens over the whole 2048 positions (the
instruction examples are ~80 tokens: at 2048 they would measure padding).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks.*, from a checkout

from benchmarks.sft_runners import (  # noqa: E402
    Batches,
    PlainRunner,
    PluginCpuRunner,
    PluginGpuRunner,
    core_attention_of,
    noise_path_of,
    synthetic_batches,
)
from benchmarks.sft_trl_runner import TrlRunner  # noqa: E402
from benchmarks.step_timing import format_ratio, measure_interleaved, median_ms, ratio_summary  # noqa: E402

LLAMA_1B = dict(
    hidden_size=2048,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    intermediate_size=8192,
    vocab_size=128256,
    max_position_embeddings=2048,
    rope_theta=500000.0,
    tie_word_embeddings=True,
    rms_norm_eps=1e-5,
)
PRESETS = {  # seq, global batch, micro-batch, lr, repeats, steps, discard, warm-up steps
    "smollm2": dict(seq=128, global_batch=8, micro_batch=4, lr=1e-4, repeats=7, steps=8, discard=2, warm=3),
    "llama-1b": dict(seq=2048, global_batch=8, micro_batch=2, lr=3e-4, repeats=4, steps=4, discard=1, warm=2),
    "tiny": dict(seq=128, global_batch=4, micro_batch=2, lr=1e-3, repeats=1, steps=2, discard=0, warm=0),
}
PLUGIN_RUNNERS = (  # name, noise on, the local spec's core attention (model.sdpa_attention), one graph per step
    ("plugin_off", False, "unfused", False),
    ("plugin_on", True, "unfused", False),
    ("plugin_off_sdpa", False, "sdpa", False),
    ("plugin_on_sdpa", True, "sdpa", False),
    ("plugin_on_graph", True, "sdpa", True),
    ("plugin_off_graph", False, "sdpa", True),
)
GRAPH_RUNNERS = tuple(name for name, _, _, graph in PLUGIN_RUNNERS if graph)
TRL_REFERENCE = "trl_on"
"""The runner each plugin runner's speed-up is paired against (``vs trl_on``: TRL's step time over the runner's)."""
BASELINE = "plugin_off"
"""The runner every ratio is taken against (``--baseline`` picks another plugin runner); measured twice per repeat,
the second time as ``<baseline>_again``, the A/A control."""
PROFILED = ("plugin_off", "plugin_on", "plugin_on_sdpa", "plugin_on_graph", "plain")  # main thread (TRL: its own)


def plugin_config(
    model: str, model_path: str, settings: dict, alpha: float | None, attention: str = "unfused", graph: bool = False
):
    """The plugin's provider of the HF folder ``model_path`` (its weights; noise ``alpha`` or disabled) and its Bridge
    config: the SFT recipe's (instruction data) for SmolLM2, the small-GPT recipe's (mock data) for ``llama-1b``,
    with this benchmark's schedule (constant lr, no warm-up, no evaluation, no checkpoints); ``attention``: the local
    spec's core attention (``recipes.common.CORE_ATTENTION``); ``graph``: one CUDA graph per training step
    (``recipes.common.use_step_graph``)."""
    from nemo_noise_plugin.noise.config import NoiseConfig
    from nemo_noise_plugin.recipes.common import bf16_settings, local_spec_settings, noisy_provider, use_step_graph
    from nemo_noise_plugin.recipes.smollm2 import instruction_finetuning_config
    from nemo_noise_plugin.recipes.tiny import small_gpt_config
    from nemo_noise_plugin.upstream.bridge_imports import import_bridge

    noise = NoiseConfig(alpha=alpha) if alpha else NoiseConfig(enabled=False)
    auto_bridge = import_bridge("megatron.bridge").AutoBridge
    source = auto_bridge.from_hf_pretrained(model_path).to_megatron_provider(load_weights=True)
    provider = noisy_provider(source, noise)
    for name, value in local_spec_settings(attention).items():
        setattr(provider, name, value)
    run_dir = tempfile.mkdtemp(prefix="sft_throughput-")
    sizes = dict(global_batch_size=settings["global_batch"], micro_batch_size=settings["micro_batch"])
    if model == "llama-1b":
        for name, value in {**bf16_settings(), "seq_length": settings["seq"]}.items():
            setattr(provider, name, value)
        config = small_gpt_config(
            provider, run_dir=run_dir, train_iters=0, seq_length=settings["seq"], lr=settings["lr"], data="mock",
            vocab_size=provider.vocab_size,
        )  # fmt: skip
        config.train.global_batch_size, config.train.micro_batch_size = sizes.values()
    else:
        config = instruction_finetuning_config(
            provider, model_path, run_dir=run_dir, train_iters=0, seq_length=settings["seq"], lr=settings["lr"],
            packed_sequence_size=None, **sizes,
        )  # fmt: skip
    config.validation.eval_interval, config.validation.eval_iters = 10_000, 0
    config.scheduler.lr_decay_style, config.scheduler.lr_warmup_iters = "constant", 0
    config.optimizer.min_lr = config.optimizer.lr
    config.logger.log_interval = 10_000
    config.checkpoint.save = config.checkpoint.load = None
    return use_step_graph(config) if graph else config


def random_llama_folder(tokenizer_path: str, dims: dict | None = None) -> str:
    """An HF folder (in a temporary directory) of the Llama-3.2-1B architecture at random initialisation (seed 1234,
    bf16 on disk) with ``tokenizer_path``'s tokenizer: every runner of ``llama-1b`` starts from these weights."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    folder = tempfile.mkdtemp(prefix="sft_throughput-llama-")
    torch.manual_seed(1234)
    LlamaForCausalLM(LlamaConfig(**(dims or LLAMA_1B))).to(torch.bfloat16).save_pretrained(folder)
    AutoTokenizer.from_pretrained(tokenizer_path).save_pretrained(folder)
    return folder


def instruction_batches(hf_path: str, settings: dict, count: int, fixed_width: bool = False) -> list[dict]:
    """``count`` micro-batches of the shipped instruction set through the recipe's Bridge finetuning pipeline
    (chat template, answer-only loss mask), consecutive samples from the first, on the host; ``fixed_width``: every
    row padded to ``seq`` (the step graph's dataset setting, ``pad_to_max_length``), else to its batch's longest."""
    from nemo_noise_plugin.jobs.batches import collate, recipe_datasets, setup_tokenizer
    from nemo_noise_plugin.upstream.bridge_imports import import_bridge

    config = plugin_config("smollm2", hf_path, settings, None, graph=fixed_width)
    state = import_bridge("megatron.bridge.training.state").GlobalState()
    state.cfg = config
    setup_tokenizer(state)
    config.dataset.finalize()
    train, _, _ = recipe_datasets(state)
    return collate(train, count, settings["micro_batch"], None, "cpu")


def hf_model(model_path: str):
    """The transformers model of the TRL and plain runners: the HF folder's weights, in float32 (bf16 autocast)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)


def runner_builders(args, settings: dict, batches: Batches, fixed: Batches | None, total: int) -> dict:
    """``{name: build()}`` for every runner on ``args.device`` (TRL's only when trl is installed; the graph runner
    only on a GPU, on ``fixed``: the same micro-batches padded to ``seq``)."""
    from nemo_noise_plugin.training.forward_step import noise_forward_step

    builders: dict = {}
    for name, alpha, attention, graph in PLUGIN_RUNNERS:
        alpha = args.alpha if alpha else None
        if graph and (args.device != "cuda" or fixed is None):
            continue
        if args.device == "cuda":

            def build(name=name, alpha=alpha, attention=attention, graph=graph):
                config = plugin_config(args.model, args.model_path, settings, alpha, attention, graph)
                return PluginGpuRunner(name, 2 * total, lambda mode: (config.model, noise_forward_step),
                                       lambda provider: config, fixed if graph else batches)  # fmt: skip
        else:

            def build(alpha=alpha, attention=attention):
                config = plugin_config(args.model, args.model_path, settings, alpha, attention)
                return PluginCpuRunner(config, noise_forward_step, batches, settings["lr"])

        builders[name] = build
    try:
        import trl  # noqa: F401
    except ImportError:
        print("trl is not installed: the TRL runners are left out", flush=True)
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.hf_path)
        for name, alpha in (("trl_off", None), ("trl_on", args.alpha)):

            def build(alpha=alpha):
                model = hf_model(args.model_path)
                return TrlRunner(model, tokenizer, batches, total + 1, settings["lr"], alpha, args.device)

            builders[name] = build
    builders["plain"] = lambda: PlainRunner(hf_model(args.model_path), batches, settings["lr"], args.device)
    return builders


class Metered:
    """A runner's ``steps`` with its slot peaks: the most allocated above what was resident when each slot began."""

    def __init__(self, runner, device: str) -> None:
        self.runner, self.device, self.slot_peaks = runner, device, []

    def steps(self, count: int) -> list[float]:
        import torch

        if self.device != "cuda":
            return self.runner.steps(count)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        resident = torch.cuda.memory_allocated()
        times = self.runner.steps(count)
        self.slot_peaks.append(torch.cuda.max_memory_allocated() - resident)
        return times


def allocated(device: str) -> int:
    import torch

    return torch.cuda.memory_allocated() if device == "cuda" else 0


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(PRESETS), default="smollm2")
    parser.add_argument("--hf-path", help="SmolLM2 HF folder (default: nemo_noise_plugin.jobs.models' cache)")
    parser.add_argument("--out", required=True, help="folder for one JSON per runner and summary.md")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--alpha", type=float, default=5.0, help="NEFTune alpha of the noise-on runners")
    parser.add_argument(
        "--baseline", default=BASELINE, choices=[name for name, *_ in PLUGIN_RUNNERS],
        help="the plugin runner the ratios are taken against, measured twice per repeat (A/A control)",
    )  # fmt: skip
    for key in ("seq", "global_batch", "micro_batch", "repeats", "steps", "discard", "warm"):
        parser.add_argument(f"--{key.replace('_', '-')}", type=int, help="default: the --model preset's")
    parser.add_argument("--lr", type=float, help="default: the --model preset's")
    parser.add_argument(
        "--runners",
        help="comma-separated subset of plugin_on, plugin_off_sdpa, plugin_on_sdpa, plugin_on_graph, plugin_off_graph, "
        "trl_off, trl_on, plain (the --baseline runner always runs)",
    )
    parser.add_argument(
        "--profile", type=int, default=0, metavar="STEPS",
        help="after the measurement, STEPS more steps of PROFILED's runners under torch.profiler "
        "(<out>/profile_<runner>.txt and profile.json: host vs device time per step, kernel launches)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.baseline in GRAPH_RUNNERS and args.device != "cuda":
        parser.error(f"--baseline {args.baseline}: a CUDA-graph runner needs --device cuda (got {args.device})")
    named = args.runners.split(",") if args.runners else []
    known = [name for name, *_ in PLUGIN_RUNNERS] + ["trl_off", "trl_on", "plain"]
    if unknown := [name for name in named if name not in known]:
        parser.error(f"--runners {args.runners}: unknown {', '.join(unknown)}; expected some of {', '.join(known)}")
    if (graphs := [name for name in named if name in GRAPH_RUNNERS]) and args.device != "cuda":
        parser.error(f"--runners {args.runners}: {', '.join(graphs)} need --device cuda (got {args.device})")
    settings = {key: getattr(args, key) if getattr(args, key) is not None else value
                for key, value in PRESETS[args.model].items()}  # fmt: skip
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(name, value)
    os.environ.setdefault("MASTER_PORT", "29531")
    from nemo_noise_plugin.upstream.bridge_imports import use_prebuilt_dataset_helpers

    use_prebuilt_dataset_helpers()
    if args.hf_path is None:
        from nemo_noise_plugin.jobs.models.smollm2_folder import ensure_smollm2_hf

        args.hf_path = str(ensure_smollm2_hf())
    micro = settings["global_batch"] // settings["micro_batch"]
    total = settings["warm"] + settings["repeats"] * settings["steps"]
    count = 2 * total * micro  # the A/A control's runner takes twice the steps
    args.model_path = args.hf_path
    baseline, control = args.baseline, f"{args.baseline}_again"
    wanted = {baseline, *(args.runners.split(",") if args.runners else [name for name, *_ in PLUGIN_RUNNERS])}
    if not args.runners:
        wanted |= {"trl_off", "trl_on", "plain"}
    fixed = None
    if args.model == "llama-1b":
        args.model_path = random_llama_folder(args.hf_path, LLAMA_1B)
        batches = Batches(
            synthetic_batches(count, settings["micro_batch"], settings["seq"], LLAMA_1B["vocab_size"]), micro
        )
        fixed = batches  # every row already fills seq
    else:
        batches = Batches(instruction_batches(args.hf_path, settings, count), micro)
        if wanted & set(GRAPH_RUNNERS) and args.device == "cuda":
            fixed = Batches(instruction_batches(args.hf_path, settings, count, fixed_width=True), micro)
    runners, resident = {}, {}
    builders = runner_builders(args, settings, batches, fixed, total)
    # the graph runner first: Bridge's setup replaces process-wide state (the rerun state machine) that its capture
    # reads, and the runners built after it keep their own settings for their eager steps
    order = sorted((name for name in builders if name in wanted), key=lambda name: name not in GRAPH_RUNNERS)
    for name, build in [(name, builders[name]) for name in order]:
        before = allocated(args.device)
        runners[name] = Metered(build(), args.device)
        runners[name].steps(settings["warm"]) if settings["warm"] else None
        resident[name] = allocated(args.device) - before
        print(f"{name}: built and warmed up ({resident[name] / 2**30:.2f} GiB resident)", flush=True)
    runners[control] = runners[baseline]
    order = [baseline, control, *[name for name in runners if name not in (baseline, control)]]
    measured = measure_interleaved(
        {name: runners[name].steps for name in order}, settings["repeats"], settings["steps"], settings["discard"]
    )
    results = report(args, settings, batches, runners, resident, measured)
    if args.profile:
        from benchmarks.step_profile import profile_runners

        profiled = {name: runners[name].runner.steps for name in PROFILED if name in runners}
        profile_runners(profiled, args.profile, Path(args.out), args.device)
    for runner in runners.values():
        getattr(runner.runner, "close", lambda: None)()
    return results


def report(args, settings, batches: Batches, runners: dict, resident: dict, measured: dict) -> dict:
    """Write ``<out>/<runner>.json`` and ``<out>/summary.md``; print the table; returns the per-runner results."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    baseline, control = args.baseline, f"{args.baseline}_again"
    steps = len(runners[baseline].runner.losses) // 2  # its own slots and the A/A control's
    counts = [batches.tokens(index) for index in range(steps)]
    all_tokens = statistics.mean(c[0] for c in counts)
    answer_tokens = statistics.mean(c[1] for c in counts)
    results = {}
    for name, runner in runners.items():
        step_ms = median_ms(measured[name])
        owner = baseline if name == control else name
        peak = resident[owner] + max(runners[owner].slot_peaks, default=0) if args.device == "cuda" else None
        results[name] = {
            "runner": name,
            "model": args.model,
            "settings": settings | {"alpha": args.alpha, "device": args.device},
            "median_step_ms": step_ms,
            "tokens_per_s": all_tokens / (step_ms / 1000),
            "answer_tokens_per_s": answer_tokens / (step_ms / 1000),
            "baseline": baseline,
            "vs_plugin_off": ratio_summary(measured[name], measured[baseline]),
            "trl_step_over_this": ratio_summary(measured[TRL_REFERENCE], measured[name])
            if TRL_REFERENCE in measured
            else None,
            "peak_memory_gib": peak / 2**30 if peak is not None else None,
            "core_attention": core_attention_of(runner.runner),
            "noise_in_lookup": noise_path_of(runner.runner),
            "step_graph": getattr(runner.runner, "step_graph", None) is not None,
            "losses": list(runner.runner.losses),
            "tokens_per_step": [c[0] for c in counts],
            "answer_tokens_per_step": [c[1] for c in counts],
            "step_seconds_per_repeat": measured[name],
        }
        (out / f"{name}.json").write_text(json.dumps(results[name], indent=1))
    table = summary_table(args, settings, all_tokens, answer_tokens, results)
    (out / "summary.md").write_text(table + "\n")
    print(table, flush=True)
    return results


def summary_table(args, settings, all_tokens: float, answer_tokens: float, results: dict) -> str:
    """The markdown table: step time, tokens/s, ratio to plugin_off, peak memory, first and last losses."""
    lines = [
        f"{args.model}: seq {settings['seq']}, global batch {settings['global_batch']} "
        f"(micro {settings['micro_batch']}), ~{all_tokens:.0f} tokens ({answer_tokens:.0f} answer) per step; "
        f"{settings['repeats']} interleaved repeats x "
        f"{settings['steps']} steps (first {settings['discard']} dropped), NEFTune alpha {args.alpha}",
        "",
        f"| runner | step (ms) | tokens/s | answer tokens/s | vs {args.baseline} | {TRL_REFERENCE} step / this step "
        "| peak GiB | loss first -> last 3 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, entry in results.items():
        losses = entry["losses"]
        head = statistics.mean(losses[:3]) if losses else float("nan")
        tail = statistics.mean(losses[-3:]) if losses else float("nan")
        peak = f"{entry['peak_memory_gib']:.2f}" if entry["peak_memory_gib"] is not None else "-"
        lines.append(
            f"| `{name}` | {entry['median_step_ms']:.1f} | {entry['tokens_per_s']:.0f} | "
            f"{entry['answer_tokens_per_s']:.0f} | {format_ratio(entry['vs_plugin_off'])} | "
            f"{format_ratio(entry['trl_step_over_this']) if entry['trl_step_over_this'] else '-'} | {peak} | "
            f"{head:.4f} -> {tail:.4f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
