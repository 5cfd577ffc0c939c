"""The fine-grained schedule plan on 2 GPUs (EP=2): equivalence with the normal path, and the step time of noise.

Run with ``torchrun --nproc-per-node 2 benchmarks/schedule_plan_step.py [--json results.json]``. A MoE GPT (local
spec, 4 experts, top-2, alltoall dispatcher, bf16 behind ``Float16Module``), EP=2 (the two GPUs are also the data-
parallel ranks), driven by Megatron-Core's own ``forward_backward_no_pipelining`` with the plugin's Bridge forward
steps and a Bridge ``GlobalState``. EP is the number of processes; ``--nproc-per-node 1`` runs it on one GPU at EP=1,
where two things differ (and ``setup`` in the JSON says so): Megatron-Core 0.19.2's config validation refuses
``overlap_moe_expert_parallel_comm`` at EP=1, so the flag is set after validation, as the CPU tests and
``tests/gpu/interleaved_plan_check.py`` do; and Megatron's own layer nodes cannot run the plain plan there (a
single-rank all-to-all returns its input, which their ``free_input`` then releases), so they get the plugin nodes'
single-rank guard (dispatch and combine keep their inputs) and nothing else. EP=1 has no all-to-all to overlap: it
measures the plan's schedule and the noise in it, not the communication overlap.

1. Equivalence: for noise and for noise + KD, one step through the normal path (``overlap_moe_expert_parallel_comm``
   off) and one through the plan (on), same weights and microbatches: the largest loss and gradient differences.
2. Step time of the plan (combined 1F1B): Megatron's own plan on a plain ``GPTModel`` with Bridge's GPT step (twice,
   two model copies: the spread between them is the measurement's noise floor), the plugin's plan with noise off,
   with noise of alpha 1e-6 (all the noise work, but too small to change which experts the router picks), with
   NEFTune alpha 5, and with noise + KD (clean teacher forward included). Noise that changes the embeddings also
   changes the routing, hence the experts' load and the all-to-all sizes: the alpha 1e-6 row is the cost of the
   noise itself, the alpha 5 row includes the effect of the different routing. All run on the same weights with
   CUDA synchronisation around each step, by the method of ``benchmarks/step_timing.py``: interleaved repeats in
   rotating order, per-repeat ratios to the plain plan summarised with a bootstrap interval and min-max.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

REPOSITORY = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPOSITORY))  # benchmarks.*: the shared builders, importable from a checkout

from benchmarks.step_timing import format_ratio, measure_interleaved, ratio_summary, repeat_medians  # noqa: E402

MODEL = dict(num_layers=4, hidden_size=1024, num_attention_heads=16, moe_ffn_hidden_size=2048, vocab_size=32768)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=3, help="steps of each mode before the repeats")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=6, help="steps per mode per repeat")
    parser.add_argument("--discard", type=int, default=2, help="steps dropped at the start of each slot")
    parser.add_argument("--sync-debug", action="store_true", help="list where each mode makes the host wait")
    parser.add_argument("--json", help="write the results here (rank 0)")
    return parser.parse_args()


def _initialise() -> tuple[int, int]:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    torch.distributed.init_process_group("nccl")
    parallel_state.initialize_model_parallel(expert_model_parallel_size=world_size)
    model_parallel_cuda_manual_seed(1234)
    if world_size == 1:
        _guard_single_rank_all_to_all()
    return rank, world_size


def _guard_single_rank_all_to_all() -> None:
    """EP=1: Megatron's own layer nodes keep the dispatch and combine inputs, as the plugin's nodes do there.

    A single-rank all-to-all returns its input; upstream's ``free_input`` would release the output it just made. The
    plugin's ``FrozenTolerantLayerNode`` already keeps them (and defers to this method for the other nodes).
    """
    from megatron.core.models.common.utils import TransformerLayerNode, should_free_input

    def resolve_free_input(name, is_moe, config, num_local_experts):
        if name in ("moe_dispatch", "moe_combine"):
            return False
        return should_free_input(name, is_moe, config, num_local_experts)

    TransformerLayerNode._resolve_free_input = staticmethod(resolve_free_input)


def _settings(args: argparse.Namespace, overlap: bool) -> dict:
    from nemo_noise_plugin.recipes.common import local_spec_settings

    settings = {key: value for key, value in local_spec_settings().items() if key != "transformer_layer_spec"}
    return dict(
        **settings,
        **MODEL,
        seq_length=args.seq_length,
        use_cpu_initialization=False,
        expert_model_parallel_size=torch.distributed.get_world_size(),
        overlap_moe_expert_parallel_comm=overlap,
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
    )


def _plan_validated() -> bool:
    """Whether Megatron's config validation accepts the plan: it demands expert parallelism (EP > 1)."""
    return torch.distributed.get_world_size() > 1


def _build(args, noise, kd, overlap: bool):
    from megatron.core.transformer.module import Float16Module

    from benchmarks.schedule_plan_drivers import build_model, build_provider

    provider = build_provider(noise, kd, **_settings(args, overlap and _plan_validated()))
    provider.overlap_moe_expert_parallel_comm = overlap  # EP=1: set after validation (see the module docstring)
    torch.manual_seed(7)
    return provider, build_model(provider, mixed_precision_wrapper=Float16Module)


def _step(forward_step, provider, model, batches, args, world_size: int):
    from megatron.core.pipeline_parallel.schedules import get_forward_backward_func

    from benchmarks.schedule_plan_drivers import bound_forward_step, bridge_state

    global_batch = args.microbatches * args.micro_batch_size * world_size
    state = bridge_state(provider, global_batch, args.micro_batch_size, seq_length=args.seq_length)
    model.zero_grad(set_to_none=True)
    return get_forward_backward_func()(
        forward_step_func=bound_forward_step(forward_step, state),
        data_iterator=iter(batches),
        model=[model],
        num_microbatches=len(batches),
        seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size,
    )


def _batches(args, seed: int) -> list[dict]:
    from benchmarks.schedule_plan_drivers import microbatches

    return microbatches(
        args.microbatches,
        args.micro_batch_size,
        seed=seed,
        device="cuda",
        seq_length=args.seq_length,
        vocab_size=MODEL["vocab_size"],
    )


def _gradients(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.float().clone() for name, p in model.named_parameters() if p.grad is not None}


def equivalence(args, world_size: int, rank: int) -> dict[str, dict]:
    from benchmarks.schedule_plan_drivers import same_weights
    from nemo_noise_plugin.distillation.config import KDConfig
    from nemo_noise_plugin.noise.config import NoiseConfig
    from nemo_noise_plugin.training.forward_step import distillation_forward_step, noise_forward_step

    cases = {
        "noise": (NoiseConfig(alpha=5.0, tokens="response"), None, noise_forward_step),
        "noise + KD": (NoiseConfig(alpha=5.0), KDConfig(kd_weight=0.5), distillation_forward_step),
    }
    results = {}
    for name, (noise, kd, forward_step) in cases.items():
        normal_provider, normal_model = _build(args, noise, kd, overlap=False)
        plan_provider, plan_model = _build(args, noise, kd, overlap=True)
        same_weights(normal_model, plan_model)
        batches = _batches(args, seed=100 + rank)
        normal_reports = _step(forward_step, normal_provider, normal_model, batches, args, world_size)
        plan_reports = _step(forward_step, plan_provider, plan_model, batches, args, world_size)
        normal_grads, plan_grads = _gradients(normal_model), _gradients(plan_model)
        loss_difference = max(
            (plan[key].float() - normal[key].float()).abs().max().item()
            for normal, plan in zip(normal_reports, plan_reports, strict=True)
            for key in normal
        )
        relative_grads = [
            ((plan_grads[key] - normal_grads[key]).norm() / normal_grads[key].norm().clamp_min(1e-30)).item()
            for key in normal_grads
        ]
        results[name] = {
            "microbatches": len(plan_reports),
            "lm loss (plan)": [float(r["lm loss"][0] / r["lm loss"][1]) for r in plan_reports],
            "lm loss (normal)": [float(r["lm loss"][0] / r["lm loss"][1]) for r in normal_reports],
            "max |loss difference|": loss_difference,
            "max relative gradient difference": max(relative_grads),
            "same parameters with gradients": sorted(plan_grads) == sorted(normal_grads),
        }
        del normal_model, plan_model
        torch.cuda.empty_cache()
    return results


def step_times(args, world_size: int, rank: int) -> dict[str, float]:
    from nemo_noise_plugin.distillation.config import KDConfig
    from nemo_noise_plugin.noise.config import NoiseConfig
    from nemo_noise_plugin.training.forward_step import distillation_forward_step, noise_forward_step
    from nemo_noise_plugin.upstream.bridge_imports import import_bridge

    modes = {
        "plain plan (Megatron)": (None, None, import_bridge("megatron.bridge.training.gpt_step").forward_step),
        "plain plan, 2nd copy": (None, None, import_bridge("megatron.bridge.training.gpt_step").forward_step),
        "plugin plan, noise off": (NoiseConfig(enabled=False), None, noise_forward_step),
        "noise plan, alpha 1e-6": (NoiseConfig(alpha=1e-6), None, noise_forward_step),
        "noise plan": (NoiseConfig(alpha=5.0), None, noise_forward_step),
        "noise + KD plan": (NoiseConfig(alpha=5.0), KDConfig(kd_weight=0.5), distillation_forward_step),
    }
    from benchmarks.schedule_plan_drivers import same_weights

    built = {name: (_build(args, noise, kd, overlap=True), step) for name, (noise, kd, step) in modes.items()}
    # One set of weights for all three: with a random router, other weights route tokens to experts (and across
    # the two GPUs) differently, which changes the step time by a few percent on its own.
    reference = built["plain plan (Megatron)"][0][1]
    for (_, model), _ in built.values():
        same_weights(reference, model)
    batches = _batches(args, seed=200 + rank)
    if args.sync_debug:
        _report_host_syncs(built, batches, args, world_size, rank)

    def runner(name: str):
        (provider, model), forward_step = built[name]

        def steps(count: int) -> list[float]:
            times = []
            for _ in range(count):
                torch.cuda.synchronize()
                torch.distributed.barrier()
                start = time.perf_counter()
                _step(forward_step, provider, model, batches, args, world_size)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            return times

        return steps

    runners = {name: runner(name) for name in built}
    for steps in runners.values():
        steps(args.warmup)
    measured = measure_interleaved(runners, args.repeats, args.steps, args.discard)
    medians = {name: repeat_medians(repeats) for name, repeats in measured.items()}
    gathered = [None] * world_size
    torch.distributed.all_gather_object(gathered, medians)
    # Per repeat, the slower rank's median: a step ends when both ranks have finished it.
    return {name: [max(values) for values in zip(*(g[name] for g in gathered), strict=True)] for name in modes}


def _report_host_syncs(built, batches, args, world_size: int, rank: int) -> None:
    """One step of each mode under ``torch.cuda.set_sync_debug_mode``: where the host waits for the GPU."""
    import warnings

    for name, ((provider, model), forward_step) in built.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                _step(forward_step, provider, model, batches, args, world_size)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        places = sorted({f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)})
        if rank == 0:
            print(f"host syncs, {name}: {len(places)} places: {places}")


def main() -> None:
    from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator

    args = parse_args()
    rank, world_size = _initialise()
    init_num_microbatches_calculator(
        rank, None, args.microbatches * args.micro_batch_size * world_size, args.micro_batch_size, world_size
    )
    results = {
        "setup": {
            "world size": world_size,
            "expert parallel": world_size,
            "plan config validated by Megatron": _plan_validated(),
            "Megatron's layer nodes given the single-rank free_input guard": world_size == 1,
        },
        "equivalence": equivalence(args, world_size, rank),
    }
    medians = step_times(args, world_size, rank)
    plain = [[value] for value in medians["plain plan (Megatron)"]]
    results["step time per repeat (s, median of the slot, slower rank)"] = medians
    summaries = {name: ratio_summary([[value] for value in values], plain) for name, values in medians.items()}
    results["ratio to the plain plan"] = summaries
    if rank == 0:
        device = torch.cuda.get_device_name()
        print(
            f"{world_size} x {device}, EP={world_size}, {MODEL}, seq {args.seq_length}, "
            f"micro-batch {args.micro_batch_size}, {args.microbatches} microbatches"
        )
        print(f"setup: {results['setup']}")
        for name, result in results["equivalence"].items():
            print(f"equivalence, {name}: {result}")
        print(
            f"{args.repeats} interleaved repeats x {args.steps} steps (first {args.discard} dropped); ratio = median "
            "of per-repeat ratios [bootstrap 95 %] (min, max); '2nd copy' is the control"
        )
        for name, values in medians.items():
            step_ms = 1000 * statistics.median(values)
            print(f"{name:>24}: {step_ms:8.2f} ms  {format_ratio(summaries[name])} the plain plan")
        if args.json:
            with open(args.json, "w") as handle:
                json.dump(results, handle, indent=2)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
