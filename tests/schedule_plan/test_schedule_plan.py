"""The plugin's fine-grained schedule plan against Megatron-Core's normal path, on CPU.

Real Megatron-Core (MoE GPT on the local spec, alltoall dispatcher), the plugin's Bridge forward steps and Bridge's
GlobalState; the only substitutes are ``cpu_substitutes``'s (fake CUDA streams and events for the plan). In one
process EP is 1, so ``overlap_moe_expert_parallel_comm`` is set after Megatron's config validation (which demands
EP > 1); ``test_schedule_plan_ep2.py`` runs EP=2 across two processes with the validation satisfied.
"""

from __future__ import annotations

import pytest
import torch

from nemo_noise_plugin.distillation.config import KDConfig
from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.training.forward_step import distillation_forward_step, noise_forward_step
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


def _models(provider, freeze: tuple[str, ...] = (), delay_wgrad_compute: bool = False):
    provider.overlap_moe_expert_parallel_comm = True  # EP=1: after validation (see the module docstring)
    provider.delay_wgrad_compute = delay_wgrad_compute  # needs the flag above, so also set after validation
    torch.manual_seed(3)
    normal = build_model(provider)
    plan = build_model(provider)
    same_weights(normal, plan)
    for model in (normal, plan):
        for name, parameter in model.named_parameters():
            if name.startswith(freeze):
                parameter.requires_grad_(False)
    return normal, plan


def _both_paths(
    noise=None, kd=None, freeze: tuple[str, ...] = (), forward_step=None, delay_wgrad_compute=False, **overrides
):
    provider = build_provider(noise, kd, **overrides)
    normal_model, plan_model = _models(provider, freeze, delay_wgrad_compute)
    state = bridge_state(provider, MICROBATCHES * MICRO_BATCH_SIZE, MICRO_BATCH_SIZE)
    if forward_step is None:
        forward_step = distillation_forward_step if kd is not None else noise_forward_step
    step = bound_forward_step(forward_step, state)
    batches = microbatches(MICROBATCHES, MICRO_BATCH_SIZE, seed=11)
    normal = run_normal_path(step, normal_model, batches)
    plan = run_plan_path(step, plan_model, batches)
    return normal, plan, plan_model


def _assert_same(normal, plan, rtol: float = 1e-6, atol: float = 1e-7) -> None:
    assert len(normal.reports) == len(plan.reports) == MICROBATCHES
    for normal_report, plan_report in zip(normal.reports, plan.reports, strict=True):
        assert normal_report.keys() == plan_report.keys()
        for key in normal_report:
            torch.testing.assert_close(plan_report[key], normal_report[key], rtol=rtol, atol=atol, msg=key)
    assert normal.grads.keys() == plan.grads.keys()
    for name in normal.grads:
        torch.testing.assert_close(plan.grads[name], normal.grads[name], rtol=rtol, atol=atol, msg=name)


CASES = {
    "noise off": dict(noise=NoiseConfig(enabled=False)),
    "noise on, response tokens, true length": dict(noise=NoiseConfig(alpha=10.0, tokens="response")),
    "gaussian noise": dict(noise=NoiseConfig(mechanism="gaussian", sigma=0.5)),
    "noise + KD": dict(noise=NoiseConfig(alpha=10.0), kd=KDConfig(kd_weight=0.5, temperature=2.0)),
    "noise + KD, dense last layer": dict(noise=NoiseConfig(alpha=10.0), kd=KDConfig(), moe_layer_freq=[1, 0]),
    "dense last layer": dict(noise=NoiseConfig(alpha=10.0), moe_layer_freq=[1, 0]),
    "frozen embedding": dict(noise=NoiseConfig(alpha=10.0), freeze=("embedding",)),
    "frozen embedding, no noise": dict(noise=NoiseConfig(enabled=False), freeze=("embedding",)),
    "frozen first layer, delayed wgrad": dict(
        noise=NoiseConfig(alpha=10.0), freeze=("embedding", "decoder.layers.0."), delay_wgrad_compute=True
    ),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_plan_path_gives_the_normal_paths_losses_and_gradients(plan_cpu, case):
    normal, plan, _ = _both_paths(**CASES[case])
    _assert_same(normal, plan)
    assert plan.grads, "no parameter received a gradient"
    if "freeze" in CASES[case]:
        assert not any(name.startswith(CASES[case]["freeze"]) for name in plan.grads)


def test_the_plan_noises_the_embedding_and_advances_the_noise_clock(plan_cpu):
    _, clean_plan, _ = _both_paths(noise=NoiseConfig(enabled=False))
    _, noisy_plan, plan_model = _both_paths(noise=NoiseConfig(alpha=50.0))
    for clean, noisy in zip(clean_plan.reports, noisy_plan.reports, strict=True):
        assert not torch.equal(clean["lm loss"], noisy["lm loss"])
    # Three microbatches of iteration 0 were noised: the clock is at the start of iteration 1.
    assert (plan_model.noise_clock.iteration, plan_model.noise_clock.microbatch) == (1, 0)


def test_the_plan_is_built_from_the_plugins_nodes(plan_cpu):
    from nemo_noise_plugin.schedule_plan import (
        FrozenTolerantLayerNode,
        LossPostProcessNode,
        NoisePreProcessNode,
        NoisyModelChunkSchedulePlan,
    )

    provider = build_provider(NoiseConfig(alpha=5.0))
    _, model = _models(provider)
    batch = microbatches(1, MICRO_BATCH_SIZE, seed=1)[0]
    plan = model.build_schedule_plan(
        batch["tokens"], batch["position_ids"], batch["attention_mask"], loss_mask=batch["loss_mask"]
    )
    assert isinstance(plan, NoisyModelChunkSchedulePlan)
    assert type(plan.pre_process) is NoisePreProcessNode and type(plan.post_process) is LossPostProcessNode
    layer = plan.get_layer(0)
    assert all(
        type(node) is FrozenTolerantLayerNode for node in (layer.pre_dispatch_computation, layer.mlp, layer.moe_combine)
    )
    assert plan.state.noise_inputs.loss_mask is batch["loss_mask"]


def test_kd_parts_are_reported_from_inside_the_plan(plan_cpu):
    normal, plan, _ = _both_paths(noise=NoiseConfig(alpha=10.0), kd=KDConfig())
    for report in plan.reports:
        assert {"lm loss", "kd loss", "total loss"} <= set(report)
        assert report["kd loss"][0] > 0  # noisy student vs clean teacher
        assert not report["kd loss"].requires_grad


# Upstream behaviour the plugin's nodes correct. At EP=1 Megatron's own layer nodes cannot run (their all-to-all
# returns its input, which their free_input then releases), so each test below swaps exactly one of the plugin's
# node classes back to Megatron-Core's; test_schedule_plan_ep2.py runs Megatron's whole plan at EP=2.


@pytest.fixture
def plan_with(monkeypatch):
    from nemo_noise_plugin.schedule_plan import builder

    def swap(**node_classes):
        variant = type("PlanWithUpstreamNodes", (builder.NoisyModelChunkSchedulePlan,), node_classes)
        monkeypatch.setattr(builder, "NoisyModelChunkSchedulePlan", variant)

    return swap


def test_megatrons_post_process_node_skips_the_final_layernorm_after_a_dense_last_layer(plan_cpu, plan_with):
    """Minimal reproduction (megatron-core 0.19.2): dense last layer -> the plan's logits miss the final norm."""
    from megatron.core.models.common.utils import PostProcessNode

    plan_with(POST_PROCESS_NODE_CLASS=PostProcessNode)
    noise_off = NoiseConfig(enabled=False)
    normal, upstream_plan, plan_model = _both_paths(noise=noise_off, moe_layer_freq=[1, 0])
    assert not torch.allclose(upstream_plan.reports[0]["lm loss"], normal.reports[0]["lm loss"], rtol=1e-3)

    # The upstream node's loss is exactly the normal path's with the final layernorm removed.
    provider = build_provider(noise_off, moe_layer_freq=[1, 0])
    without_norm, _ = _models(provider)
    same_weights(plan_model, without_norm)
    without_norm.decoder.final_layernorm = torch.nn.Identity()
    state = bridge_state(provider, MICROBATCHES * MICRO_BATCH_SIZE, MICRO_BATCH_SIZE)
    batches = microbatches(MICROBATCHES, MICRO_BATCH_SIZE, seed=11)
    reference = run_normal_path(bound_forward_step(noise_forward_step, state), without_norm, batches)
    for expected, got in zip(reference.reports, upstream_plan.reports, strict=True):
        torch.testing.assert_close(got["lm loss"], expected["lm loss"], rtol=1e-6, atol=1e-7)


def test_megatrons_post_process_node_is_right_after_a_moe_last_layer(plan_cpu, plan_with):
    from megatron.core.models.common.utils import PostProcessNode

    plan_with(POST_PROCESS_NODE_CLASS=PostProcessNode)
    normal, upstream_plan, _ = _both_paths(noise=NoiseConfig(enabled=False))
    _assert_same(normal, upstream_plan)


def test_megatrons_pre_process_node_crashes_on_a_frozen_embedding(plan_cpu, plan_with):
    from megatron.core.models.common.utils import PreProcessNode

    plan_with(PRE_PROCESS_NODE_CLASS=PreProcessNode)
    with pytest.raises(RuntimeError, match="does not require grad"):
        _both_paths(noise=NoiseConfig(enabled=False), freeze=("embedding",))


def test_megatrons_layer_nodes_crash_on_a_frozen_first_layer(plan_cpu, plan_with):
    from megatron.core.models.common.utils import TransformerLayerNode

    from nemo_noise_plugin.schedule_plan import FrozenTolerantLayerNode, NoisyLayerSchedulePlan

    # Megatron's node class with the plugin's single-rank free_input guard, so that only backward differs.
    class UpstreamBackwardNode(TransformerLayerNode):
        _resolve_free_input = staticmethod(FrozenTolerantLayerNode._resolve_free_input)

    layer_plan = type("UpstreamLayerPlan", (NoisyLayerSchedulePlan,), {"NODE_CLASS": UpstreamBackwardNode})
    plan_with(LAYER_SCHEDULE_PLAN_CLASS=layer_plan)
    with pytest.raises(RuntimeError, match="does not require grad"):
        _both_paths(noise=NoiseConfig(enabled=False), freeze=("embedding", "decoder.layers.0."))


def test_hidden_state_kd_is_rejected_under_the_plan_before_the_model_is_built(plan_cpu):
    provider = build_provider(NoiseConfig(alpha=5.0), KDConfig(hidden_loss="mse", hidden_layers=[0]))
    provider.overlap_moe_expert_parallel_comm = True
    with pytest.raises(ValueError, match="kd.hidden_loss='mse'.*overlap_moe_expert_parallel_comm"):
        provider.validate_distillation()
