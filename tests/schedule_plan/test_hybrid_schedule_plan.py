"""The plugin's fine-grained schedule plan for ``HybridModel`` against Megatron-Core's normal path, on CPU.

Real Megatron-Core ``HybridModel`` (attention, MLP and MoE layers on the local hybrid stack, alltoall dispatcher)
from the plugin's hybrid providers, the plugin's Bridge forward steps and Bridge's GlobalState, through the same
drivers as the GPT plan tests. One process: EP is 1, so ``overlap_moe_expert_parallel_comm`` is set after
Megatron's config validation; ``test_hybrid_schedule_plan_ep2.py`` runs EP=2 across two processes.
"""

from __future__ import annotations

import pytest
import torch

from nemo_noise_plugin.distillation.config import KDConfig
from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.training.forward_step import distillation_forward_step, noise_forward_step
from nemo_noise_plugin.validation import SettingError
from tests.support.attention_variables import clean_attention_variables
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

MICROBATCHES, MICRO_BATCH_SIZE = 3, 2


@pytest.fixture(autouse=True)
def _clean_attention_variables():
    """The hybrid providers pin the local attention backend process-wide (``NVTE_*``); give later tests theirs."""
    with clean_attention_variables():
        yield


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


def _models(provider, freeze: tuple[str, ...] = ()):
    provider.overlap_moe_expert_parallel_comm = True  # EP=1: after validation (see the module docstring)
    torch.manual_seed(3)
    normal = build_model(provider)
    plan = build_model(provider)
    same_weights(normal, plan)
    for model in (normal, plan):
        for name, parameter in model.named_parameters():
            if name.startswith(freeze):
                parameter.requires_grad_(False)
    return normal, plan


def _both_paths(noise=None, kd=None, freeze: tuple[str, ...] = (), **provider_settings):
    provider = build_hybrid_provider(noise, kd, **provider_settings)
    normal_model, plan_model = _models(provider, freeze)
    state = bridge_state(provider, MICROBATCHES * MICRO_BATCH_SIZE, MICRO_BATCH_SIZE)
    step = bound_forward_step(distillation_forward_step if kd is not None else noise_forward_step, state)
    batches = microbatches(MICROBATCHES, MICRO_BATCH_SIZE, seed=11)
    return run_normal_path(step, normal_model, batches), run_plan_path(step, plan_model, batches), plan_model


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
    "noise on, response tokens": dict(noise=NoiseConfig(alpha=10.0, tokens="response")),
    "noise on, MLP and MoE layers": dict(noise=NoiseConfig(alpha=10.0), pattern="*-*E"),
    "final norm, MoE last layer": dict(noise=NoiseConfig(alpha=10.0), pattern="*-*E", final_norm=True),
    "final norm, dense last layer": dict(noise=NoiseConfig(alpha=10.0), pattern="*E*-", final_norm=True),
    "final norm, attention last layer": dict(noise=NoiseConfig(alpha=10.0), pattern="-E*", final_norm=True),
    "noise + KD": dict(noise=NoiseConfig(alpha=10.0), kd=KDConfig(kd_weight=0.5, temperature=2.0)),
    "noise + KD, final norm, dense last layer": dict(
        noise=NoiseConfig(alpha=10.0), kd=KDConfig(), pattern="*E*-", final_norm=True
    ),
    "frozen embedding": dict(noise=NoiseConfig(alpha=10.0), freeze=("embedding",)),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_hybrid_plan_gives_the_normal_paths_losses_and_gradients(plan_cpu, case):
    normal, plan, _ = _both_paths(**CASES[case])
    _assert_same(normal, plan)
    assert plan.grads, "no parameter received a gradient"
    if CASES[case].get("final_norm"):
        assert "decoder.final_norm.weight" in plan.grads
    if "freeze" in CASES[case]:
        assert not any(name.startswith(CASES[case]["freeze"]) for name in plan.grads)


def test_the_hybrid_plan_noises_the_embedding_once_per_microbatch(plan_cpu):
    _, clean_plan, _ = _both_paths(noise=NoiseConfig(enabled=False))
    _, noisy_plan, plan_model = _both_paths(noise=NoiseConfig(alpha=50.0))
    for clean, noisy in zip(clean_plan.reports, noisy_plan.reports, strict=True):
        assert not torch.equal(clean["lm loss"], noisy["lm loss"])
    # Three microbatches of iteration 0 were noised, once each: the clock is at the start of iteration 1.
    assert (plan_model.noise_clock.iteration, plan_model.noise_clock.microbatch) == (1, 0)


def test_the_hybrid_plan_is_built_from_the_plugins_nodes_one_layer_plan_per_hybrid_layer(plan_cpu):
    from megatron.core.pipeline_parallel.utils import NoopScheduleNode

    from nemo_noise_plugin.schedule_plan import FrozenTolerantLayerNode, LossPostProcessNode, NoisePreProcessNode
    from nemo_noise_plugin.schedule_plan.hybrid import HybridLayerSchedulePlan, NoisyHybridModelChunkSchedulePlan

    _, model = _models(build_hybrid_provider(NoiseConfig(alpha=5.0), pattern="*-*E"))
    batch = microbatches(1, MICRO_BATCH_SIZE, seed=1)[0]
    plan = model.build_schedule_plan(
        batch["tokens"], batch["position_ids"], batch["attention_mask"], loss_mask=batch["loss_mask"]
    )
    assert isinstance(plan, NoisyHybridModelChunkSchedulePlan)
    assert type(plan.pre_process) is NoisePreProcessNode and type(plan.post_process) is LossPostProcessNode
    assert plan.num_layers() == 4
    layers = [plan.get_layer(index) for index in range(4)]
    assert all(type(layer) is HybridLayerSchedulePlan for layer in layers)
    assert all(type(layer.pre_dispatch_computation) is FrozenTolerantLayerNode for layer in layers)
    moe = [not isinstance(layer.moe_dispatch, NoopScheduleNode) for layer in layers]
    assert moe == [False, False, False, True]
    assert plan.state.noise_inputs.loss_mask is batch["loss_mask"]


def test_a_plain_hybrid_chunk_given_the_plugins_plan_matches_its_normal_path(plan_cpu):
    """What a later pipeline stage (no noise) gets: ``use_plugin_schedule_plan`` on a plain ``HybridModel``."""
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    from nemo_noise_plugin.schedule_plan.builder import use_plugin_schedule_plan

    provider = build_hybrid_provider(None, pattern="*-*E", final_norm=True)
    normal_model, plan_model = _models(provider)
    assert type(plan_model) is HybridModel and not hasattr(HybridModel, "build_schedule_plan")
    keys = list(plan_model.state_dict())
    use_plugin_schedule_plan(plan_model)
    assert list(plan_model.state_dict()) == keys
    bridge_step = __import__("megatron.bridge.training.gpt_step", fromlist=["forward_step"]).forward_step
    step = bound_forward_step(bridge_step, bridge_state(provider, MICROBATCHES * MICRO_BATCH_SIZE, MICRO_BATCH_SIZE))
    batches = microbatches(MICROBATCHES, MICRO_BATCH_SIZE, seed=5)
    _assert_same(run_normal_path(step, normal_model, batches), run_plan_path(step, plan_model, batches))


@pytest.mark.parametrize("pattern", ["M*-E", "*E/*E", "G*E"])
def test_a_pattern_the_plan_cannot_split_is_a_setting_error_at_finalize(plan_cpu, pattern):
    from nemo_noise_plugin.providers.hybrid import NoisyHybridModelProvider
    from tests.support.hybrid_schedule_plan import hybrid_moe_settings

    provider = NoisyHybridModelProvider(**hybrid_moe_settings(pattern), noise=NoiseConfig(alpha=5.0))
    provider.overlap_moe_expert_parallel_comm = True
    with pytest.raises(SettingError) as caught:
        provider.finalize()
    assert caught.value.setting == "NoisyHybridModelProvider.hybrid_layer_pattern" and caught.value.value == pattern
    assert "overlap_moe_expert_parallel_comm=True" in str(caught.value)
    if "M" in pattern:
        assert "its M layers have no all-to-all split" in str(caught.value) and "CUDA kernels" in str(caught.value)


def test_the_plans_pattern_check_names_mamba_layers_and_accepts_pipeline_stages(plan_cpu):
    """The check ``build_schedule_plan`` runs on a built chunk's pattern (``check_hybrid_schedule_plan``); a Mamba
    layer cannot be built on a CPU, so the pattern check is called directly."""
    from nemo_noise_plugin.schedule_plan.hybrid import check_schedule_plan_pattern

    with pytest.raises(SettingError, match=r"NoisyHybridModel\.hybrid_layer_pattern='M\*M\*E' is invalid .*its M"):
        check_schedule_plan_pattern("NoisyHybridModel.hybrid_layer_pattern", "M*M*E")
    check_schedule_plan_pattern("NoisyHybridModel.hybrid_layer_pattern", "*-*E|*E")  # pipeline stages are fine


def test_without_the_plugins_post_process_node_the_hybrid_plan_misses_the_final_norm(plan_cpu, monkeypatch):
    """Megatron's ``PostProcessNode`` applies ``final_norm`` only to an empty decoder, so the plugin's node must."""
    from megatron.core.models.common.utils import PostProcessNode

    from nemo_noise_plugin.schedule_plan import builder

    variant = type("WithMegatronPostProcess", (builder.NoisyHybridModelChunkSchedulePlan,), {})
    variant.POST_PROCESS_NODE_CLASS = PostProcessNode
    monkeypatch.setattr(builder, "NoisyHybridModelChunkSchedulePlan", variant)
    normal, plan, _ = _both_paths(noise=NoiseConfig(enabled=False), pattern="*E*E", final_norm=True)
    assert not torch.allclose(plan.reports[0]["lm loss"], normal.reports[0]["lm loss"], rtol=1e-3)
    assert "decoder.final_norm.weight" not in plan.grads
