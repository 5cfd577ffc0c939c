"""The schedule-plan drivers for the tests: shared with the benchmarks (``benchmarks/schedule_plan_drivers.py``).

A small MoE GPT through Megatron-Core's normal path and its fine-grained schedule plan, side by side. On a CPU the
plan also needs ``tests.support.schedule_plan_substitutes.install_schedule_plan_substitutes()``.
"""

from benchmarks.schedule_plan_drivers import (  # noqa: F401
    SEQ,
    VOCAB,
    PathResult,
    bound_forward_step,
    bridge_state,
    build_model,
    build_provider,
    global_gradients,
    global_layer_name,
    load_from_unsplit,
    local_moe_block_spec,
    microbatches,
    moe_settings,
    run_interleaved,
    run_normal_path,
    run_plan_path,
    same_weights,
)
