"""``tokens='spans'`` under the fine-grained schedule plan: the plan's pre-process node sees the batch's private mask
(built into the plan, run later), so the plan path gives the normal path's losses and gradients."""

from __future__ import annotations

import pytest
import torch

from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.training.forward_step import noise_forward_step
from tests.support.schedule_plan import (
    bound_forward_step,
    bridge_state,
    build_model,
    build_provider,
    microbatches,
    run_normal_path,
    run_plan_path,
    same_weights,
)

MICROBATCHES, MICRO_BATCH_SIZE = 3, 2


@pytest.fixture(scope="module")
def plan_cpu(megatron_cpu):
    from megatron.core.num_microbatches_calculator import (
        destroy_num_microbatches_calculator,
        init_num_microbatches_calculator,
    )

    from tests.support.schedule_plan_substitutes import install_schedule_plan_substitutes

    install_schedule_plan_substitutes()
    init_num_microbatches_calculator(0, None, MICROBATCHES * MICRO_BATCH_SIZE, MICRO_BATCH_SIZE, 1)
    yield
    destroy_num_microbatches_calculator()


def _span_batches() -> list[dict]:
    batches = microbatches(MICROBATCHES, MICRO_BATCH_SIZE, seed=11)
    for index, batch in enumerate(batches):
        private = torch.zeros_like(batch["tokens"], dtype=torch.bool)
        private[:, 1 + index : 6 + index] = True
        batch["private_mask"] = private
    return batches


def _paths(noise: NoiseConfig):
    provider = build_provider(noise, None)
    provider.overlap_moe_expert_parallel_comm = True  # EP=1: set after validation, as test_schedule_plan.py does
    torch.manual_seed(3)
    normal_model, plan_model = build_model(provider), build_model(provider)
    same_weights(normal_model, plan_model)
    step = bound_forward_step(
        noise_forward_step, bridge_state(provider, MICROBATCHES * MICRO_BATCH_SIZE, MICRO_BATCH_SIZE)
    )
    return run_normal_path(step, normal_model, _span_batches()), run_plan_path(step, plan_model, _span_batches())


def test_span_noise_under_the_plan_gives_the_normal_paths_losses_and_gradients(plan_cpu):
    normal, plan = _paths(NoiseConfig(mechanism="gaussian", sigma=2.0, scaling="absolute", tokens="spans"))
    _, clean = _paths(NoiseConfig(enabled=False))
    for normal_report, plan_report, clean_report in zip(normal.reports, plan.reports, clean.reports, strict=True):
        torch.testing.assert_close(plan_report["lm loss"], normal_report["lm loss"], rtol=1e-6, atol=1e-7)
        assert not torch.equal(plan_report["lm loss"], clean_report["lm loss"])  # the spans were noised
    for name in normal.grads:
        torch.testing.assert_close(plan.grads[name], normal.grads[name], rtol=1e-6, atol=1e-7, msg=name)
