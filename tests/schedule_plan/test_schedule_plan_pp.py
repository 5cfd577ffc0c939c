"""The interleaved schedule plan (PP=2, VPP=2, EP=2) against the normal interleaved path, on four gloo CPU processes.

Megatron-Core runs the fine-grained plan under pipelining only with virtual stages
(``combined_1f1b_schedule_for_interleaved_pipelining``). Four processes: PP=2, and at each stage DP=2 = EP=2; 4
layers in 2 virtual stages per rank (one layer per model chunk; the last one dense, so the last stage needs the
plugin's post-process node although it carries no noise), 4 experts, top-2, alltoall, bf16 behind
``Float16Module``, 4 microbatches, Megatron's config validation satisfied. Both paths are Megatron's own
``forward_backward_pipelining_with_interleaving`` (``overlap_moe_expert_parallel_comm`` off and on) with the plugin's
``noise_forward_step``. The 4-GPU form of this check is ``tests/gpu/test_schedule_plan_pp_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.gloo_ranks import run_on_gloo_ranks

MICROBATCHES, MICRO_BATCH_SIZE = 4, 2


def _interleaved_rank(rank: int, world_size: int, port: int) -> dict:
    from megatron.core import parallel_state
    from megatron.core.num_microbatches_calculator import (
        destroy_num_microbatches_calculator,
        init_num_microbatches_calculator,
    )
    from megatron.core.transformer.module import Float16Module
    from megatron.core.utils import unwrap_model

    from nemo_noise_plugin.model import NoiseInjectionMixin
    from nemo_noise_plugin.noise.config import NoiseConfig
    from tests.support.models import destroy_cpu_parallel, init_cpu_parallel
    from tests.support.schedule_plan import (
        bridge_state,
        build_provider,
        microbatches,
        run_interleaved,
        same_weights,
    )
    from tests.support.schedule_plan_substitutes import install_schedule_plan_substitutes

    init_cpu_parallel(
        rank=rank,
        world_size=world_size,
        port=port,
        pipeline_model_parallel_size=2,
        virtual_pipeline_model_parallel_size=2,
        expert_model_parallel_size=2,
    )
    install_schedule_plan_substitutes()
    data_parallel = parallel_state.get_data_parallel_world_size()
    global_batch = MICROBATCHES * MICRO_BATCH_SIZE * data_parallel
    init_num_microbatches_calculator(rank, None, global_batch, MICRO_BATCH_SIZE, data_parallel)
    settings = dict(
        num_layers=4,
        moe_layer_freq=[1, 1, 1, 0],  # a dense last layer, on the last stage's chunk without noise
        pipeline_model_parallel_size=2,
        virtual_pipeline_model_parallel_size=2,
        expert_model_parallel_size=2,
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        batch_p2p_comm=False,
    )
    noise = NoiseConfig(alpha=10.0, tokens="response")
    try:
        chunks = {}
        for overlap in (False, True):
            provider = build_provider(noise, overlap_moe_expert_parallel_comm=overlap, **settings)
            torch.manual_seed(3)
            chunks[overlap] = (
                provider,
                provider.provide_distributed_model(
                    use_cpu_initialization=True, wrap_with_ddp=False, mixed_precision_wrapper=Float16Module
                ),
            )
        for normal_chunk, plan_chunk in zip(chunks[False][1], chunks[True][1], strict=True):
            same_weights(normal_chunk, plan_chunk)
        plans_built = _count_plans(chunks[True][1])
        batches = microbatches(MICROBATCHES, MICRO_BATCH_SIZE, seed=100 + parallel_state.get_data_parallel_rank())
        results = {}
        for overlap, (provider, model) in chunks.items():
            state = bridge_state(provider, global_batch, MICRO_BATCH_SIZE)
            results["plan" if overlap else "normal"] = run_interleaved(model, batches, state)
        noisy = []
        for vp_stage, chunk in enumerate(chunks[True][1]):
            inner = unwrap_model(chunk)
            if isinstance(inner, NoiseInjectionMixin) and inner.noise_active:
                noisy.append((vp_stage, inner.noise_clock.iteration, inner.noise_clock.microbatch))
        return {
            "plans built per chunk": plans_built,
            "pp rank": parallel_state.get_pipeline_model_parallel_rank(),
            "noisy chunks": noisy,
            "normal": results["normal"],
            "plan": results["plan"],
        }
    finally:
        destroy_num_microbatches_calculator()
        destroy_cpu_parallel()


def _count_plans(chunks) -> list[int]:
    """Count ``build_schedule_plan`` calls per chunk (filled in as the schedule runs): proof the plan path ran."""
    from megatron.core.utils import unwrap_model

    counts = [0] * len(chunks)
    for index, chunk in enumerate(chunks):
        inner = unwrap_model(chunk)
        build = inner.build_schedule_plan

        def counting(*args, _build=build, _index=index, **kwargs):
            counts[_index] += 1
            return _build(*args, **kwargs)

        inner.build_schedule_plan = counting
    return counts


@pytest.mark.slow
def test_interleaved_plan_matches_the_normal_interleaved_path_and_noises_one_chunk():
    ranks = run_on_gloo_ranks(_interleaved_rank, 4, timeout=900)
    for rank, result in enumerate(ranks):
        print(f"rank {rank} (pp {result['pp rank']}): noisy chunks {result['noisy chunks']}")
        normal, plan = result["normal"], result["plan"]
        assert result["plans built per chunk"] == [MICROBATCHES, MICROBATCHES]  # the plan path really ran
        assert sorted(plan.grads) == sorted(normal.grads)
        scale = max(grad.abs().max().item() for grad in normal.grads.values())
        difference = max((plan.grads[name] - normal.grads[name]).abs().max().item() for name in normal.grads)
        print(f"  max |grad difference| {difference:.3e} (largest gradient {scale:.3e})")
        assert difference <= scale / 64
        assert len(plan.reports) == len(normal.reports) == (MICROBATCHES if result["pp rank"] == 1 else 0)
        for normal_report, plan_report in zip(normal.reports, plan.reports, strict=True):
            for key in normal_report:
                assert torch.equal(plan_report[key], normal_report[key]), key
        print("  lm loss per microbatch:", [float(r["lm loss"][0] / r["lm loss"][1]) for r in plan.reports])
    # Noise on exactly one model chunk of the whole pipeline: virtual stage 0 of pipeline rank 0 (on each DP rank),
    # and it noised the four microbatches of iteration 0 (its clock is at the start of iteration 1).
    noisy = [(result["pp rank"], chunk) for result in ranks for chunk in result["noisy chunks"]]
    assert noisy == [(0, (0, 1, 0)), (0, (0, 1, 0))], noisy
