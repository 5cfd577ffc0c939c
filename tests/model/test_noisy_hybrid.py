"""The noisy hybrid model on real Megatron-Core ``HybridModel``: where noise goes and what stays a plain model.

The hybrid stack is attention + dense MLP + attention + MoE (pattern ``*-*E``) on Megatron-Core's local modules:
Mamba layers need mamba_ssm's CUDA/Triton kernels (``ssm/mamba_mixer.py:202``) and the stack's final norm is
Transformer Engine only (``hybrid_block.py:215``), so the CPU stack has no Mamba layer and ``post_layer_norm=False``.
"""

from __future__ import annotations

import pytest
import torch
from megatron.core.models.common.model_chunk_schedule_plan import ModelChunkState
from megatron.core.models.common.utils import PreProcessNode
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules
from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
from megatron.core.models.hybrid.hybrid_model import HybridModel
from megatron.core.ssm.mlp_layer import MLPLayer
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import (
    MoETransformerLayer,
    TransformerLayer,
    TransformerLayerSubmodules,
)

from nemo_noise_plugin.distillation.teacher import build_clean_teacher
from nemo_noise_plugin.model import NoiseInjectionMixin, NoisyGPTModel, make_noisy, plain_class_of
from nemo_noise_plugin.model.hybrid import NoisyHybridModel
from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.noise.layer import EmbeddingNoise, NoiseBatchInputs
from nemo_noise_plugin.noise.schedule import NoiseClock
from tests.support.models import build_tiny_gpt, tiny_gpt_config

PATTERN = "*-*E"
HIDDEN = 64


def _local_hybrid_stack_spec() -> ModuleSpec:
    """Megatron-Core's local (non-TE) attention, MLP and MoE layers in a HybridStack without its TE final norm."""
    dense = get_gpt_layer_local_submodules()
    moe = get_gpt_layer_local_submodules(num_experts=4)
    return ModuleSpec(
        module=HybridStack,
        params={"post_layer_norm": False},
        submodules=HybridStackSubmodules(
            attention_layer=ModuleSpec(
                module=TransformerLayer,
                submodules=TransformerLayerSubmodules(
                    input_layernorm=dense.input_layernorm,
                    self_attention=dense.self_attention,
                    self_attn_bda=dense.self_attn_bda,
                ),
            ),
            mlp_layer=ModuleSpec(
                module=MLPLayer,
                submodules=TransformerLayerSubmodules(
                    pre_mlp_layernorm=dense.pre_mlp_layernorm, mlp=dense.mlp, mlp_bda=dense.mlp_bda
                ),
            ),
            moe_layer=ModuleSpec(
                module=MoETransformerLayer,
                submodules=TransformerLayerSubmodules(
                    pre_mlp_layernorm=moe.pre_mlp_layernorm, mlp=moe.mlp, mlp_bda=moe.mlp_bda
                ),
            ),
        ),
    )


def _build(model_class: type = HybridModel, **kwargs):
    # add_bias_linear=False: the local SequentialMLP experts add their bias in place on a view (mlp.py:354).
    config = tiny_gpt_config(
        num_layers=len(PATTERN),
        ffn_hidden_size=128,
        add_bias_linear=False,
        num_moe_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=64,
    )
    return model_class(
        config=config,
        hybrid_stack_spec=_local_hybrid_stack_spec(),
        vocab_size=256,
        max_sequence_length=64,
        hybrid_layer_pattern=PATTERN,
        position_embedding_type="rope",
        **kwargs,
    )


def _pair(noise: NoiseConfig, **kwargs):
    """A plain HybridModel and a NoisyHybridModel with identical weights."""
    torch.manual_seed(7)
    plain = _build(**kwargs)
    noisy = _build(NoisyHybridModel, noise_config=noise, **kwargs)
    noisy.load_state_dict(plain.state_dict())
    return plain, noisy


def _forward(model, batch, **overrides):
    """Masked mean loss and the decoder input the hybrid stack received."""
    seen = []
    handle = model.decoder.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["hidden_states"]), with_kwargs=True
    )
    try:
        kwargs = dict(labels=batch["labels"], loss_mask=batch["loss_mask"])
        kwargs.update(overrides)
        per_token = model(batch["input_ids"], batch["position_ids"], batch["attention_mask"], **kwargs)
    finally:
        handle.remove()
    (decoder_input,) = seen
    return (per_token * batch["loss_mask"]).sum() / batch["loss_mask"].sum(), decoder_input


def _layer_noised(noise: NoiseConfig, embedded: torch.Tensor, batch, iteration: int) -> torch.Tensor:
    """What the EmbeddingNoise layer itself returns for ``embedded`` at (seed, iteration, microbatch 0)."""
    clock = NoiseClock()
    clock.start_iteration(iteration)
    layer = EmbeddingNoise(noise, sequence_parallel=False, pg_collection=None)
    inputs = NoiseBatchInputs(loss_mask=batch["loss_mask"], input_ids=batch["input_ids"])
    with torch.no_grad():
        return layer(embedded, inputs, clock)


def _clean_embedding(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return model.embedding(input_ids=batch["input_ids"], position_ids=batch["position_ids"])


@pytest.mark.parametrize("config", [NoiseConfig(enabled=False), NoiseConfig(alpha=0.0)])
def test_disabled_or_zero_noise_trains_exactly_like_the_plain_hybrid_model(megatron_cpu, batch, config):
    plain, noisy = _pair(config)
    plain_loss, plain_input = _forward(plain, batch)
    noisy_loss, noisy_input = _forward(noisy, batch)
    plain_loss.backward()
    noisy_loss.backward()
    assert torch.equal(noisy_input, plain_input)
    assert torch.equal(noisy_loss, plain_loss)
    for (name, a), b in zip(plain.named_parameters(), noisy.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), name
    assert noisy.noise_step == 0


def test_decoder_input_is_the_embedding_plus_the_noise_layers_noise_for_seed_and_iteration(megatron_cpu, batch):
    noise = NoiseConfig(alpha=10.0, seed=21)
    _, noisy = _pair(noise)
    noisy.noise_clock.start_iteration(3)
    _, decoder_input = _forward(noisy, batch)

    expected = _layer_noised(noise, _clean_embedding(noisy, batch), batch, iteration=3)
    assert torch.equal(decoder_input.detach(), expected)
    assert not torch.equal(expected, _clean_embedding(noisy, batch))
    wrong_iteration = _layer_noised(noise, _clean_embedding(noisy, batch), batch, iteration=4)
    assert not torch.equal(decoder_input.detach(), wrong_iteration)
    assert (noisy.noise_clock.iteration, noisy.noise_clock.microbatch) == (4, 0), "one microbatch per iteration"


def test_noise_equals_the_noisy_gpt_models_noise_for_the_same_seed_and_iteration(megatron_cpu, batch):
    noise = NoiseConfig(alpha=10.0, seed=5)
    _, hybrid = _pair(noise)
    gpt = build_tiny_gpt(model_class=NoisyGPTModel, noise_config=noise)
    with torch.no_grad(), gpt.noise_batch_inputs(batch["loss_mask"]):
        gpt_noise = gpt._preprocess(input_ids=batch["input_ids"], position_ids=batch["position_ids"])[0]
        gpt_noise -= gpt.embedding(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
    with torch.no_grad():
        _, decoder_input = _forward(hybrid, batch)
    hybrid_noise = decoder_input - _clean_embedding(hybrid, batch)
    assert gpt_noise.abs().max() > 0
    assert torch.allclose(hybrid_noise, gpt_noise, rtol=0, atol=1e-6)


def test_noise_changes_the_loss_and_gradients_flow_through_it(megatron_cpu, batch):
    """The noisy model's gradients equal those of a plain model fed embedding + the same noise."""
    noise = NoiseConfig(alpha=10.0)
    plain, noisy = _pair(noise)
    noisy_loss, noisy_input = _forward(noisy, batch)
    noisy_loss.backward()

    embedded = plain.embedding(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
    added = (noisy_input - embedded).detach()
    assert added.abs().max() > 0
    with torch.no_grad():
        clean_loss, _ = _forward(plain, batch)
    assert not torch.equal(noisy_loss.detach(), clean_loss)
    replayed_loss, _ = _forward(plain, batch, decoder_input=embedded + added)
    replayed_loss.backward()

    expected = plain.embedding.word_embeddings.weight.grad
    actual = noisy.embedding.word_embeddings.weight.grad
    assert expected.abs().sum() > 0
    assert torch.allclose(actual, expected, rtol=1e-4, atol=1e-7)
    assert noisy.decoder.layers[3].mlp.router.weight.grad.abs().sum() > 0


def test_eval_mode_adds_no_noise_and_equals_the_plain_model(megatron_cpu, batch):
    plain, noisy = _pair(NoiseConfig(alpha=15.0))
    plain.eval()
    noisy.eval()
    with torch.no_grad():
        plain_loss, plain_input = _forward(plain, batch)
        noisy_loss, noisy_input = _forward(noisy, batch)
    assert torch.equal(noisy_input, plain_input)
    assert torch.equal(noisy_loss, plain_loss)
    assert noisy.noise_step == 0


def test_training_only_false_adds_noise_in_eval_without_advancing_the_clock(megatron_cpu, batch):
    noise = NoiseConfig(alpha=15.0, training_only=False)
    plain, noisy = _pair(noise)
    plain.eval()
    noisy.eval()
    with torch.no_grad():
        plain_loss, _ = _forward(plain, batch)
        noisy_loss, noisy_input = _forward(noisy, batch)
    assert torch.equal(noisy_input, _layer_noised(noise, _clean_embedding(noisy, batch), batch, iteration=0))
    assert not torch.equal(noisy_loss, plain_loss)
    assert noisy.noise_step == 0, "evaluation forwards do not advance the training noise clock"


def test_caller_supplied_decoder_input_is_never_noised(megatron_cpu, batch):
    plain, noisy = _pair(NoiseConfig(alpha=15.0))
    decoder_input = torch.randn(64, 4, HIDDEN)
    with torch.no_grad():
        expected, _ = _forward(plain, batch, decoder_input=decoder_input)
        actual, seen = _forward(noisy, batch, decoder_input=decoder_input)
    assert seen is decoder_input
    assert torch.equal(actual, expected)
    assert noisy.noise_step == 0


def test_non_first_pipeline_stage_is_never_noised(megatron_cpu, batch):
    plain, noisy = _pair(NoiseConfig(alpha=15.0), pre_process=False)
    hidden = torch.randn(64, 4, HIDDEN)
    plain.set_input_tensor(hidden)
    noisy.set_input_tensor(hidden)
    with torch.no_grad():
        assert torch.equal(_forward(noisy, batch)[0], _forward(plain, batch)[0])
    assert noisy.noise_step == 0


def test_state_dict_keys_match_and_weights_load_both_ways(megatron_cpu, batch):
    plain, noisy = _pair(NoiseConfig(alpha=5.0))
    assert list(plain.state_dict()) == list(noisy.state_dict())
    assert plain.sharded_state_dict().keys() == noisy.sharded_state_dict().keys()

    fresh_plain = _build()
    fresh_plain.load_state_dict(noisy.state_dict(), strict=True)
    fresh_noisy = _build(NoisyHybridModel, noise_config=NoiseConfig())
    fresh_noisy.load_state_dict(plain.state_dict(), strict=True)
    for model in (plain, fresh_plain, fresh_noisy):
        model.eval()
    with torch.no_grad():
        reference, _ = _forward(plain, batch)
        assert torch.equal(_forward(fresh_plain, batch)[0], reference)
        assert torch.equal(_forward(fresh_noisy, batch)[0], reference)


def test_make_noisy_converts_a_built_hybrid_model_and_its_subclasses_in_place(megatron_cpu, batch):
    model = _build()
    parameters = dict(model.named_parameters())
    keys = list(model.state_dict())
    assert make_noisy(model, NoiseConfig(alpha=10.0)) is model
    assert type(model) is NoisyHybridModel and plain_class_of(NoisyHybridModel) is HybridModel
    assert all(p is parameters[name] for name, p in model.named_parameters())
    assert list(model.state_dict()) == keys
    _, decoder_input = _forward(model, batch)
    assert not torch.equal(decoder_input, _clean_embedding(model, batch))

    class CustomHybrid(HybridModel):
        pass

    custom = _build(CustomHybrid)
    make_noisy(custom, NoiseConfig(alpha=10.0))
    assert isinstance(custom, CustomHybrid) and isinstance(custom, NoiseInjectionMixin)
    assert type(custom).__name__ == "NoisyCustomHybrid" and plain_class_of(type(custom)) is CustomHybrid
    _, decoder_input = _forward(custom, batch)
    assert not torch.equal(decoder_input, _clean_embedding(custom, batch))
    assert type(_build()) is HybridModel, "nothing global changed"


def test_schedule_plan_preprocess_node_gets_the_noised_decoder_input_and_rotary_embedding(megatron_cpu, batch):
    """Megatron's own PreProcessNode (what a HybridModel schedule plan would run) unpacks ``_preprocess``."""
    noise = NoiseConfig(alpha=10.0)
    _, noisy = _pair(noise)
    state = ModelChunkState()
    state.input_ids, state.position_ids = batch["input_ids"], batch["position_ids"]
    state.decoder_input = state.packed_seq_params = state.padding_mask = None
    node = PreProcessNode(noisy, state, event=None, stream=None)
    with torch.no_grad(), noisy.noise_batch_inputs(batch["loss_mask"]):
        decoder_input = node.forward_impl()
    assert torch.equal(decoder_input, _layer_noised(noise, _clean_embedding(noisy, batch), batch, iteration=0))
    assert torch.equal(state.rotary_pos_emb, noisy.rotary_pos_emb(64))
    assert noisy.noise_step == 1


def test_clean_teacher_of_a_noisy_hybrid_model_is_a_plain_hybrid_model(megatron_cpu, batch):
    plain, noisy = _pair(NoiseConfig(alpha=10.0))
    teacher = build_clean_teacher(noisy)
    assert type(teacher) is HybridModel and not isinstance(teacher, NoiseInjectionMixin)
    teacher.train()  # a training-mode forward is where the student adds noise
    plain.train()
    with torch.no_grad():
        assert torch.equal(_forward(teacher, batch)[0], _forward(plain, batch)[0])


@pytest.mark.parametrize("case", ["eval_mode", "caller_supplied_input"])
def test_schedule_plan_preprocess_node_adds_no_noise_when_none_is_due(megatron_cpu, batch, case):
    _, noisy = _pair(NoiseConfig(alpha=10.0))
    supplied = torch.randn(64, 4, HIDDEN) if case == "caller_supplied_input" else None
    if case == "eval_mode":
        noisy.eval()
    state = ModelChunkState()
    state.input_ids, state.position_ids, state.decoder_input = batch["input_ids"], batch["position_ids"], supplied
    state.packed_seq_params = state.padding_mask = None
    with torch.no_grad(), noisy.noise_batch_inputs(batch["loss_mask"]):
        decoder_input = PreProcessNode(noisy, state, event=None, stream=None).forward_impl()
    assert torch.equal(decoder_input, supplied if supplied is not None else _clean_embedding(noisy, batch))
    assert noisy.noise_step == 0


def test_megatron_hybrid_model_still_lacks_preprocess_and_build_schedule_plan():
    """When this fails, Megatron-Core gained them: follow docs/hybrid_model.md ("once HybridModel gains ...")."""
    assert not hasattr(HybridModel, "_preprocess")
    assert not hasattr(HybridModel, "_postprocess")
    assert not hasattr(HybridModel, "build_schedule_plan")


def test_a_noisy_hybrid_model_builds_the_plugins_hybrid_schedule_plan(megatron_cpu, batch):
    """Upstream has none (above); the plan itself: tests/schedule_plan/test_hybrid_schedule_plan.py."""
    from nemo_noise_plugin.schedule_plan.hybrid import NoisyHybridModelChunkSchedulePlan

    _, noisy = _pair(NoiseConfig(alpha=5.0))
    plan = noisy.build_schedule_plan(batch["input_ids"], batch["position_ids"], batch["attention_mask"])
    assert isinstance(plan, NoisyHybridModelChunkSchedulePlan) and plan.num_layers() == len(PATTERN)
