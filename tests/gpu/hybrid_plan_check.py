"""The hybrid fine-grained schedule plan vs the normal path on GPUs (EP = GPUs), with noise and with noise + KD.

    torchrun --nproc-per-node 1 tests/gpu/hybrid_plan_check.py --json out.json          # EP=1, local stack
    torchrun --nproc-per-node 2 tests/gpu/hybrid_plan_check.py --json out.json          # EP=2, local stack
    torchrun --nproc-per-node 1 tests/gpu/hybrid_plan_check.py --te --json out.json     # Bridge's TE hybrid spec

A ``HybridModel`` from the plugin's hybrid providers, pattern ``*-*E*E`` (attention, MLP, MoE; 4 experts, top-2,
alltoall; bf16 behind ``Float16Module``), 3 microbatches through Megatron's combined 1F1B schedule (the plan, on
its CUDA streams) and through ``forward_step`` / ``backward_step`` (the normal path), with the plugin's
``noise_forward_step`` and ``distillation_forward_step``. The local stack (default) has Megatron-Core's local
layers and a local final norm (``tests.support.hybrid_schedule_plan``); ``--te`` uses Bridge's default Transformer
Engine hybrid spec (``TENorm`` final norm). With one GPU EP is 1, which Megatron's validation rejects for the plan:
the flag is then set after validation (the output says so). Exit status 0 when every rank's check holds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

REPOSITORY = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPOSITORY))  # tests.support: the test builders, importable from a checkout

LOSS_TOLERANCE, GRADIENT_TOLERANCE = 2e-2, 2e-2
"""bf16 on CUDA streams: the plan accumulates in another order (as for GPT, tests/gpu/test_schedule_plan_gpu.py)."""


def _compare(normal, plan) -> dict:
    loss = max(
        (plan_report[key].float() - normal_report[key].float()).abs().max().item()
        for normal_report, plan_report in zip(normal.reports, plan.reports, strict=True)
        for key in normal_report
    )
    relative = max(
        ((plan.grads[name] - normal.grads[name]).norm() / normal.grads[name].norm().clamp_min(1e-30)).item()
        for name in normal.grads.keys() & plan.grads.keys()
    )
    return {
        "microbatches": len(plan.reports),
        "same parameters with gradients": sorted(plan.grads) == sorted(normal.grads),
        "final norm has a gradient": any("final_norm" in name for name in plan.grads),
        "max |loss difference|": loss,
        "max relative gradient difference": relative,
        "lm loss": [report["lm loss"][0].item() / report["lm loss"][1].item() for report in plan.reports],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--microbatches", type=int, default=3)
    parser.add_argument("--te", action="store_true", help="Bridge's default Transformer Engine hybrid spec")
    parser.add_argument("--json", help="write rank 0's summary here")
    args = parser.parse_args()

    from megatron.core import parallel_state
    from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.module import Float16Module

    from nemo_noise_plugin.distillation.config import KDConfig
    from nemo_noise_plugin.noise.config import NoiseConfig
    from nemo_noise_plugin.training.forward_step import distillation_forward_step, noise_forward_step
    from tests.support.hybrid_schedule_plan import build_hybrid_provider
    from tests.support.schedule_plan import (
        bound_forward_step,
        bridge_state,
        build_model,
        microbatches,
        run_normal_path,
        run_plan_path,
        same_weights,
    )

    world_size = int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    torch.distributed.init_process_group("nccl")
    parallel_state.initialize_model_parallel(expert_model_parallel_size=world_size)
    model_parallel_cuda_manual_seed(1234)
    micro_batch_size = 2
    global_batch = args.microbatches * micro_batch_size * world_size
    init_num_microbatches_calculator(torch.distributed.get_rank(), None, global_batch, micro_batch_size, world_size)
    validated = world_size > 1
    settings = dict(
        pattern="*-*E*E",
        final_norm=not args.te,
        hidden_size=256,
        num_attention_heads=8,
        moe_ffn_hidden_size=512,
        ffn_hidden_size=512,
        seq_length=args.seq_length,
        use_cpu_initialization=False,
        expert_model_parallel_size=world_size,
        overlap_moe_expert_parallel_comm=validated,
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
    )
    if args.te:  # Bridge's default hybrid_stack_spec (Transformer Engine layers, TENorm final norm)
        settings.update(hybrid_stack_spec=None, attention_backend=AttnBackend.auto)
    cases = {
        "noise": (NoiseConfig(alpha=10.0, tokens="response"), None, noise_forward_step),
        "noise + KD": (NoiseConfig(alpha=10.0), KDConfig(kd_weight=0.5, temperature=2.0), distillation_forward_step),
    }
    rank = torch.distributed.get_rank()
    summary = {"world size": world_size, "spec": "te" if args.te else "local", "validated": validated, "cases": {}}
    for name, (noise, kd, forward_step) in cases.items():
        provider = build_hybrid_provider(noise, kd, **settings)
        provider.overlap_moe_expert_parallel_comm = True  # EP=1: set after validation (see the docstring)
        torch.manual_seed(7)
        normal_model = build_model(provider, mixed_precision_wrapper=Float16Module)
        plan_model = build_model(provider, mixed_precision_wrapper=Float16Module)
        same_weights(normal_model, plan_model)
        state = bridge_state(provider, global_batch, micro_batch_size, seq_length=args.seq_length)
        step = bound_forward_step(forward_step, state)
        batches = microbatches(
            args.microbatches,
            micro_batch_size,
            seed=100 + rank,
            device="cuda",
            seq_length=args.seq_length,
            vocab_size=provider.vocab_size,
        )
        normal = run_normal_path(step, normal_model, batches)
        plan = run_plan_path(step, plan_model, batches)
        torch.cuda.synchronize()
        summary["cases"][name] = _compare(normal, plan)
    checks = [
        result["microbatches"] == args.microbatches
        and result["same parameters with gradients"]
        and result["final norm has a gradient"]
        and result["max |loss difference|"] <= LOSS_TOLERANCE
        and result["max relative gradient difference"] <= GRADIENT_TOLERANCE
        for result in summary["cases"].values()
    ]
    summary["ok"] = all(checks)
    print(f"rank {rank}: {json.dumps(summary)}", flush=True)
    verdict = torch.tensor([int(summary["ok"])], device="cuda")
    torch.distributed.all_reduce(verdict, op=torch.distributed.ReduceOp.MIN)
    if rank == 0 and args.json:
        Path(args.json).write_text(json.dumps({**summary, "all ranks ok": bool(verdict.item())}, indent=2))
    torch.distributed.destroy_process_group()
    return 0 if verdict.item() else 1


if __name__ == "__main__":
    sys.exit(main())
