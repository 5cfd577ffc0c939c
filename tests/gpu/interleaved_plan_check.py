"""Interleaved schedule plan vs the normal interleaved path on GPUs (PP=2, VPP=2; EP = GPUs / 2), with noise.

    torchrun --nproc-per-node 4 tests/gpu/interleaved_plan_check.py --json out.json     # PP=2, VPP=2, EP=2
    torchrun --nproc-per-node 2 tests/gpu/interleaved_plan_check.py --json out.json     # PP=2, VPP=2, EP=1
    torchrun --nproc-per-node 2 tests/gpu/interleaved_plan_check.py --kd --json out.json  # + clean-teacher KD

MoE GPT on the local spec (4 layers, one per model chunk; 4 experts, top-2, alltoall; bf16 behind
``Float16Module``), at least 4 microbatches, both paths through Megatron's own
``forward_backward_pipelining_with_interleaving`` with the plugin's ``noise_forward_step``. Each rank compares its
chunks' gradients and the last stage its per-microbatch losses, and reports which chunk carries the noise. With 4
GPUs Megatron's config validation is satisfied (EP=2). With 2 GPUs EP is 1, which Megatron's validation rejects for
the plan; the flag is then set after validation, and the output says so: that run exercises the interleaved plan's
CUDA streams and NCCL point-to-point traffic, not the expert all-to-all. With ``--kd`` both paths distil the noisy
student from its clean teacher (``NoisyDistillationProvider``, ``distillation_forward_step``, forward KL at T=2):
the teacher's hidden state then travels the pipeline on its own NCCL group (``distillation.pipeline_teacher``); the
check adds the KD losses per microbatch, the teacher's forward count (one per microbatch and chunk) and that the
teacher's weights are bitwise unchanged. Exit status 0 when every rank's check holds.
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-length", type=int, default=512)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--kd", action="store_true", help="distillation: noisy student, clean teacher, forward KL")
    parser.add_argument("--json", help="write rank 0's summary here")
    args = parser.parse_args()

    from megatron.core import parallel_state
    from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module
    from megatron.core.utils import unwrap_model

    from nemo_noise_plugin.distillation.config import KDConfig
    from nemo_noise_plugin.distillation.teacher_weights import attached_teacher
    from nemo_noise_plugin.model import NoiseInjectionMixin
    from nemo_noise_plugin.noise.config import NoiseConfig
    from nemo_noise_plugin.recipes.common import local_spec_settings
    from nemo_noise_plugin.training.forward_step import distillation_forward_step, noise_forward_step
    from tests.support.schedule_plan import (
        bridge_state,
        build_provider,
        microbatches,
        run_interleaved,
        same_weights,
    )

    world_size = int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    torch.distributed.init_process_group("nccl")
    expert_parallel = world_size // 2
    parallel_state.initialize_model_parallel(
        pipeline_model_parallel_size=2,
        virtual_pipeline_model_parallel_size=2,
        expert_model_parallel_size=expert_parallel,
    )
    model_parallel_cuda_manual_seed(1234)
    data_parallel = parallel_state.get_data_parallel_world_size()
    micro_batch_size = 2
    global_batch = args.microbatches * micro_batch_size * data_parallel
    init_num_microbatches_calculator(torch.distributed.get_rank(), None, global_batch, micro_batch_size, data_parallel)
    spec = {key: value for key, value in local_spec_settings().items() if key != "transformer_layer_spec"}
    settings = dict(
        **spec,
        num_layers=4,
        hidden_size=512,
        num_attention_heads=8,
        moe_ffn_hidden_size=1024,
        seq_length=args.seq_length,
        use_cpu_initialization=False,
        pipeline_model_parallel_size=2,
        virtual_pipeline_model_parallel_size=2,
        expert_model_parallel_size=expert_parallel,
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        batch_p2p_comm=False,
    )
    noise = NoiseConfig(alpha=10.0, tokens="response")
    validated = expert_parallel > 1
    models = {}
    for overlap in (False, True):
        provider = build_provider(
            noise,
            kd=KDConfig(temperature=2.0) if args.kd else None,
            overlap_moe_expert_parallel_comm=overlap and validated,
            share_embeddings_and_output_weights=not args.kd,  # KD: untied, so no embedding-group gradient sync
            **settings,
        )
        provider.overlap_moe_expert_parallel_comm = overlap  # EP=1: set after validation (see the docstring)
        torch.manual_seed(7)
        chunks = provider.provide_distributed_model(
            use_cpu_initialization=False, wrap_with_ddp=False, mixed_precision_wrapper=Float16Module
        )
        models[overlap] = (provider, chunks)
    for normal_chunk, plan_chunk in zip(models[False][1], models[True][1], strict=True):
        same_weights(normal_chunk, plan_chunk)
    batches = microbatches(
        args.microbatches,
        micro_batch_size,
        seed=100 + parallel_state.get_data_parallel_rank(),
        device="cuda",
        seq_length=args.seq_length,
        vocab_size=provider.vocab_size,
    )
    results, teacher_calls = {}, {}
    forward_step = distillation_forward_step if args.kd else noise_forward_step
    for overlap, (provider, chunks) in models.items():
        calls = teacher_calls[overlap] = [0] * len(chunks)
        for index, chunk in enumerate(chunks):
            teacher = attached_teacher(chunk) if args.kd else None
            if teacher is not None:
                teacher.register_forward_hook(lambda *_, _i=index, _c=calls: _c.__setitem__(_i, _c[_i] + 1))
        state = bridge_state(provider, global_batch, micro_batch_size, seq_length=args.seq_length)
        results[overlap] = run_interleaved(chunks, batches, state, forward_step=forward_step)
    teacher_unchanged = not args.kd or all(  # no optimizer step here: the students still hold the initial weights
        torch.equal(tensor, unwrap_model(chunk).state_dict()[name])
        for _, chunks in models.values()
        for chunk in chunks
        for name, tensor in attached_teacher(chunk).state_dict().items()
        if isinstance(tensor, torch.Tensor)
    )
    normal, plan = results[False], results[True]
    relative = max(
        ((plan.grads[name] - normal.grads[name]).norm() / normal.grads[name].norm().clamp_min(1e-30)).item()
        for name in normal.grads
    )
    loss_difference = max(
        [
            (plan_report[key].float() - normal_report[key].float()).abs().max().item()
            for normal_report, plan_report in zip(normal.reports, plan.reports, strict=True)
            for key in normal_report
        ],
        default=0.0,
    )
    noisy_chunks = [
        vp_stage
        for vp_stage, chunk in enumerate(models[True][1])
        if isinstance(unwrap_model(chunk), NoiseInjectionMixin) and unwrap_model(chunk).noise_active
    ]
    summary = {
        "rank": torch.distributed.get_rank(),
        "pp rank": parallel_state.get_pipeline_model_parallel_rank(),
        "expert parallel": expert_parallel,
        "plan config validated by Megatron": validated,
        "noisy virtual stages": noisy_chunks,
        "microbatch losses (plan)": [float(r["lm loss"][0] / r["lm loss"][1]) for r in plan.reports],
        "max |loss difference|": loss_difference,
        "max relative gradient difference": relative,
        "same parameters with gradients": sorted(plan.grads) == sorted(normal.grads),
        "kd": args.kd,
        "kd loss per microbatch (plan)": [
            float(r["kd loss"][0] / r["kd loss"][1]) for r in plan.reports if "kd loss" in r
        ],
        "teacher forwards per chunk": {"normal": teacher_calls[False], "plan": teacher_calls[True]},
        "teacher unchanged": teacher_unchanged,
    }
    expected_noisy = [0] if summary["pp rank"] == 0 else []
    expected_reports = args.microbatches if summary["pp rank"] == 1 else 0
    ok = (
        summary["same parameters with gradients"]
        and noisy_chunks == expected_noisy
        and len(plan.reports) == len(normal.reports) == expected_reports
        and loss_difference <= 2e-2
        and relative <= 2e-2
        and teacher_unchanged
        and (not args.kd or all(calls == [args.microbatches] * 2 for calls in teacher_calls.values()))
        and (not args.kd or summary["pp rank"] == 0 or all(v > 0 for v in summary["kd loss per microbatch (plan)"]))
    )
    everything = [None] * world_size
    torch.distributed.all_gather_object(everything, {**summary, "ok": ok})
    if torch.distributed.get_rank() == 0:
        for entry in everything:
            print(entry)
        if args.json:
            with open(args.json, "w") as handle:
                json.dump(everything, handle, indent=2)
    torch.distributed.destroy_process_group()
    return 0 if all(entry["ok"] for entry in everything) else 1


if __name__ == "__main__":
    raise SystemExit(main())
