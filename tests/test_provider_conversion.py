"""noisy_provider_from: a provider Bridge built (AutoBridge from a local HF checkpoint) becomes a plugin provider.

GPT: tiny Llama and Qwen3 checkpoints (``GPTModelProvider``). Hybrid: a tiny Nemotron-H checkpoint of attention and
MLP layers only (``HybridModelProvider``; Mamba layers cannot be built on a CPU), built on the local hybrid stack.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from nemo_noise_plugin.distillation.config import KDConfig
from nemo_noise_plugin.noise.config import NoiseConfig

HF_ARCHITECTURES = {
    "llama": dict(config="LlamaConfig", tie_word_embeddings=False),
    "qwen3": dict(config="Qwen3Config", tie_word_embeddings=True, head_dim=16),
}


@pytest.fixture(scope="module")
def bridge(megatron_cpu):
    from nemo_noise_plugin import providers
    from nemo_noise_plugin.upstream.bridge_imports import import_bridge

    return dict(
        providers=providers,
        AutoBridge=import_bridge("megatron.bridge.models.conversion.auto_bridge").AutoBridge,
        gpt_provider=import_bridge("megatron.bridge.models.gpt_provider"),
    )


@pytest.fixture(scope="module", params=sorted(HF_ARCHITECTURES))
def hf_checkpoint(request, tmp_path_factory):
    """A tiny random HF causal LM saved to disk (config + safetensors): what AutoBridge.from_hf_pretrained reads."""
    import transformers

    settings = dict(HF_ARCHITECTURES[request.param])
    config_class = getattr(transformers, settings.pop("config"))
    config = config_class(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        **settings,
    )
    torch.manual_seed(7)
    model = transformers.AutoModelForCausalLM.from_config(config)
    directory = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(directory)
    return directory, {name: tensor.clone() for name, tensor in model.state_dict().items()}


def _autobridge_provider(bridge, directory, load_weights=True):
    return bridge["AutoBridge"].from_hf_pretrained(str(directory)).to_megatron_provider(load_weights=load_weights)


def _on_cpu(bridge, provider):
    """The CPU settings of tests/test_providers.py: local layer spec, CUDA-only fusions off, finalized."""
    from nemo_noise_plugin.recipes.common import local_spec_settings

    settings = dict(local_spec_settings(), use_cpu_initialization=True)
    # Megatron records the attention backend in process-wide NVTE_* variables and refuses a second, different one;
    # the other in-process tests build models with the default backend, so these keep it too.
    settings.pop("attention_backend")
    for name, value in settings.items():
        setattr(provider, name, value)
    provider.finalize()
    return provider


def _build(provider):
    """Bridge's own model building on the CPU: provide, then the registered pre-wrap hooks (HF weight loading)."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    return provider.provide_distributed_model(
        wrap_with_ddp=False,
        use_cpu_initialization=True,
        mixed_precision_wrapper=None,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
    )


def test_every_field_of_an_autobridge_provider_is_carried_over(bridge, hf_checkpoint):
    directory, _ = hf_checkpoint
    source = _autobridge_provider(bridge, directory)
    noise = NoiseConfig(alpha=10.0)
    converted = bridge["providers"].noisy_provider_from(source, noise)
    assert type(converted) is bridge["providers"].NoisyGPTModelProvider
    assert converted.noise is noise
    for f in dataclasses.fields(source):
        assert getattr(converted, f.name) is getattr(source, f.name), f.name
    assert (converted.normalization, converted.gated_linear_unit, converted.hf_model_id) == (
        "RMSNorm",
        True,
        str(directory),
    )
    assert converted.perform_initialization is False  # AutoBridge's "weights come from the hook" setting


def test_the_pre_wrap_hooks_are_carried_in_a_list_of_their_own(bridge, hf_checkpoint):
    source = _autobridge_provider(bridge, hf_checkpoint[0])
    source.register_post_wrap_hook(lambda model: model)
    converted = bridge["providers"].noisy_provider_from(source)
    assert len(source._pre_wrap_hooks) == 1  # AutoBridge's load_weights_hf_to_megatron
    assert converted._pre_wrap_hooks == source._pre_wrap_hooks
    assert converted._post_wrap_hooks == source._post_wrap_hooks
    converted.register_pre_wrap_hook(lambda model: model)
    assert (len(converted._pre_wrap_hooks), len(source._pre_wrap_hooks)) == (2, 1)


def test_the_converted_provider_builds_a_noisy_model_holding_the_hf_weights(bridge, hf_checkpoint):
    from nemo_noise_plugin.model import NoisyGPTModel

    directory, hf_weights = hf_checkpoint
    plain = _build(_on_cpu(bridge, _autobridge_provider(bridge, directory)))[0]
    converted = bridge["providers"].noisy_provider_from(
        _autobridge_provider(bridge, directory), NoiseConfig(alpha=15.0)
    )
    noisy = _build(_on_cpu(bridge, converted))[0]
    assert type(noisy) is NoisyGPTModel and noisy.noise_config.alpha == 15.0
    plain_state, noisy_state = plain.state_dict(), noisy.state_dict()
    assert list(noisy_state) == list(plain_state)
    for name, tensor in plain_state.items():
        if isinstance(tensor, torch.Tensor):
            assert torch.equal(noisy_state[name], tensor), name
    assert torch.equal(noisy_state["embedding.word_embeddings.weight"], hf_weights["model.embed_tokens.weight"])
    assert torch.equal(
        noisy_state["decoder.layers.1.mlp.linear_fc2.weight"], hf_weights["model.layers.1.mlp.down_proj.weight"]
    )


def test_provide_on_the_converted_provider_gives_a_noisy_model(bridge, hf_checkpoint):
    from megatron.core.process_groups_config import ProcessGroupCollection

    from nemo_noise_plugin.model import NoisyGPTModel

    converted = bridge["providers"].noisy_provider_from(_autobridge_provider(bridge, hf_checkpoint[0], False))
    converted = _on_cpu(bridge, converted)
    converted._pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    assert type(converted.provide()) is NoisyGPTModel


def test_kd_gives_a_distillation_provider_whose_teacher_holds_the_hf_weights(bridge, hf_checkpoint):
    from nemo_noise_plugin.distillation.teacher_weights import attached_teacher
    from nemo_noise_plugin.providers import NoisyDistillationProvider

    directory, hf_weights = hf_checkpoint
    kd = KDConfig(loss="jsd", temperature=2.0)
    converted = bridge["providers"].noisy_provider_from(_autobridge_provider(bridge, directory), kd=kd)
    assert type(converted) is NoisyDistillationProvider and converted.kd is kd
    student = _build(_on_cpu(bridge, converted))[0]
    teacher = attached_teacher(student)
    embedding = hf_weights["model.embed_tokens.weight"]
    assert torch.equal(student.embedding.word_embeddings.weight, embedding)
    assert torch.equal(teacher.embedding.word_embeddings.weight, embedding)


def test_a_plugin_provider_keeps_a_copy_of_its_own_noise_and_kd_settings(bridge):
    from nemo_noise_plugin.providers import NoisyDistillationProvider

    source = NoisyDistillationProvider(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        noise=NoiseConfig(alpha=15.0),
        kd=KDConfig(temperature=3.0),
        teacher_shares_frozen_modules=True,
    )
    converted = bridge["providers"].noisy_provider_from(source)
    assert type(converted) is NoisyDistillationProvider
    assert (converted.noise.alpha, converted.kd.temperature, converted.teacher_shares_frozen_modules) == (
        15.0,
        3.0,
        True,
    )
    assert converted.noise is not source.noise and converted.kd is not source.kd


def test_a_subclass_that_only_changes_defaults_converts_with_its_defaults(bridge):
    from nemo_noise_plugin.upstream.bridge_imports import import_bridge

    mistral = import_bridge("megatron.bridge.models.mistral.mistral_provider").MistralModelProvider
    source = mistral()
    converted = bridge["providers"].noisy_provider_from(source)
    assert type(converted) is bridge["providers"].NoisyGPTModelProvider
    assert converted == bridge["providers"].NoisyGPTModelProvider(
        **{f.name: getattr(source, f.name) for f in dataclasses.fields(source)}, noise=NoiseConfig()
    )
    assert (converted.hidden_size, converted.num_layers) == (source.hidden_size, source.num_layers) != (None, None)


@pytest.mark.parametrize(
    "module, class_name, lost",
    [
        ("megatron.bridge.models.gemma.gemma_provider", "GemmaModelProvider", "its own provide"),
        ("megatron.bridge.models.mla_provider", "MLAModelProvider", "its own __post_init__, finalize and fields"),
        ("megatron.bridge.models.stepfun.step35_provider", "Step35ModelProvider", "fields attention_other_setting"),
        ("megatron.bridge.models.nemotron_vl.nemotron_vl_provider", "NemotronVLModelProvider", "its own provide"),
    ],
)
def test_a_subclass_with_its_own_model_building_is_rejected_by_name(bridge, module, class_name, lost):
    from nemo_noise_plugin.upstream.bridge_imports import import_bridge

    provider_class = getattr(import_bridge(module), class_name)
    source = object.__new__(provider_class)  # the check is on the class: no need to satisfy its constructor
    with pytest.raises(bridge["providers"].UnsupportedProviderError) as error:
        bridge["providers"].noisy_provider_from(source)
    assert f"cannot convert {module}.{class_name}" in str(error.value)
    assert lost in str(error.value)
    base = "HybridModelProvider" if "Nemotron" in class_name else "GPTModelProvider"
    assert f"builds the model with {base}.provide/finalize" in str(error.value)


def test_a_provider_that_is_neither_a_gpt_nor_a_hybrid_provider_is_rejected(bridge):
    from nemo_noise_plugin.upstream.bridge_imports import import_bridge

    t5 = import_bridge("megatron.bridge.models.t5_provider").T5ModelProvider
    with pytest.raises(
        bridge["providers"].UnsupportedProviderError,
        match="expects a megatron.bridge GPTModelProvider or HybridModelProvider, got .*T5ModelProvider",
    ):
        bridge["providers"].noisy_provider_from(object.__new__(t5))


# Hybrid: Bridge's HybridModelProvider (AutoBridge's provider for Nemotron-H) becomes NoisyHybridModelProvider

HYBRID_PATTERN = "*-*-"


@pytest.fixture(scope="module")
def nemotron_h_checkpoint(tmp_path_factory):
    """A tiny random Nemotron-H (attention and MLP layers, no Mamba) saved as AutoBridge reads it, and its weights.

    transformers 5 saves the embedding as ``backbone.embedding.weight``; Bridge 0.6.2's Nemotron-H mapping (and the
    published checkpoints) name it ``backbone.embeddings.weight``, so the file is written under that name.
    """
    import safetensors.torch
    import transformers

    config = transformers.NemotronHConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=len(HYBRID_PATTERN),
        hybrid_override_pattern=HYBRID_PATTERN,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
    )
    torch.manual_seed(7)
    model = transformers.AutoModelForCausalLM.from_config(config)
    directory = tmp_path_factory.mktemp("nemotron_h")
    model.save_pretrained(directory)
    weights = safetensors.torch.load_file(directory / "model.safetensors")
    weights["backbone.embeddings.weight"] = weights.pop("backbone.embedding.weight")
    safetensors.torch.save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    return directory, weights


def _hybrid_on_cpu(bridge, provider):
    """``_on_cpu`` for a hybrid provider: the local hybrid stack, and the MoE fusions AutoBridge's Nemotron-H
    settings switch on (Transformer Engine only) off."""
    from nemo_noise_plugin.providers.hybrid import local_hybrid_stack_spec
    from nemo_noise_plugin.recipes.common import local_spec_settings

    provider.hybrid_stack_spec = local_hybrid_stack_spec
    provider.moe_permute_fusion = provider.moe_grouped_gemm = provider.moe_shared_expert_overlap = False
    for name, value in local_spec_settings().items():
        if name not in ("transformer_layer_spec", "attention_backend"):  # a GPT field; the backend as in _on_cpu
            setattr(provider, name, value)
    provider.use_cpu_initialization = True
    provider.finalize()
    return provider


def test_an_autobridge_hybrid_provider_converts_with_every_field_and_its_hooks(bridge, nemotron_h_checkpoint):
    from nemo_noise_plugin.providers.hybrid import (
        HybridModelProvider,
        NoisyHybridDistillationProvider,
        NoisyHybridModelProvider,
    )

    source = _autobridge_provider(bridge, nemotron_h_checkpoint[0])
    assert type(source) is HybridModelProvider and source.hybrid_layer_pattern == HYBRID_PATTERN
    noise, kd = NoiseConfig(alpha=10.0), KDConfig(temperature=2.0)
    converted = bridge["providers"].noisy_provider_from(source, noise)
    distilling = bridge["providers"].noisy_provider_from(source, noise, kd=kd)
    assert type(converted) is NoisyHybridModelProvider and converted.noise is noise
    assert type(distilling) is NoisyHybridDistillationProvider and distilling.kd is kd
    for result in (converted, distilling):
        for f in dataclasses.fields(source):
            assert getattr(result, f.name) is getattr(source, f.name), f.name
        assert len(source._pre_wrap_hooks) == 1  # AutoBridge's load_weights_hf_to_megatron
        assert result._pre_wrap_hooks == source._pre_wrap_hooks
        assert result._pre_wrap_hooks is not source._pre_wrap_hooks
    assert type(bridge["providers"].noisy_provider_from(distilling)) is NoisyHybridDistillationProvider


def test_the_converted_hybrid_provider_builds_a_noisy_hybrid_model_holding_the_hf_weights(
    bridge, nemotron_h_checkpoint
):
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    from nemo_noise_plugin.distillation.teacher_weights import attached_teacher
    from nemo_noise_plugin.model.hybrid import NoisyHybridModel

    directory, hf_weights = nemotron_h_checkpoint
    plain = _build(_hybrid_on_cpu(bridge, _autobridge_provider(bridge, directory)))[0]
    converted = bridge["providers"].noisy_provider_from(
        _autobridge_provider(bridge, directory), NoiseConfig(alpha=15.0), kd=KDConfig()
    )
    student = _build(_hybrid_on_cpu(bridge, converted))[0]
    teacher = attached_teacher(student)
    assert type(plain) is HybridModel and type(student) is NoisyHybridModel and type(teacher) is HybridModel
    assert student.noise_config.alpha == 15.0
    plain_state, student_state = plain.state_dict(), student.state_dict()
    assert list(student_state) == list(plain_state)
    for name, tensor in plain_state.items():
        if isinstance(tensor, torch.Tensor):
            assert torch.equal(student_state[name], tensor), name
    loaded = {
        "embedding.word_embeddings.weight": "backbone.embeddings.weight",
        "decoder.layers.0.input_layernorm.weight": "backbone.layers.0.norm.weight",
        "decoder.layers.2.self_attention.linear_proj.weight": "backbone.layers.2.mixer.o_proj.weight",
        "decoder.layers.3.mlp.linear_fc2.weight": "backbone.layers.3.mixer.down_proj.weight",
        "output_layer.weight": "lm_head.weight",
    }
    for megatron_name, hf_name in loaded.items():
        assert torch.equal(student_state[megatron_name], hf_weights[hf_name]), megatron_name
        assert torch.equal(teacher.state_dict()[megatron_name], hf_weights[hf_name]), megatron_name


def test_bridges_mamba_provider_converts_with_its_deprecated_stack_spec_carried(bridge):
    from nemo_noise_plugin.providers.hybrid import NoisyHybridModelProvider, local_hybrid_stack_spec
    from nemo_noise_plugin.upstream.bridge_imports import import_bridge
    from nemo_noise_plugin.validation import SettingError

    mamba = import_bridge("megatron.bridge.models.mamba.mamba_provider").MambaModelProvider
    settings = dict(hybrid_layer_pattern=HYBRID_PATTERN, hidden_size=64, num_attention_heads=4)
    source = mamba(**settings, mamba_stack_spec=local_hybrid_stack_spec)  # its __post_init__ moves it over
    converted = bridge["providers"].noisy_provider_from(source)
    assert type(converted) is NoisyHybridModelProvider
    assert converted.hybrid_stack_spec is local_hybrid_stack_spec
    late = mamba(**settings)
    late.mamba_stack_spec = local_hybrid_stack_spec  # set after construction: carried as __post_init__ would
    assert bridge["providers"].noisy_provider_from(late).hybrid_stack_spec is local_hybrid_stack_spec
    late.hybrid_stack_spec = local_hybrid_stack_spec
    with pytest.raises(SettingError, match=r"MambaModelProvider\.mamba_stack_spec=.* is invalid with hybrid_stack"):
        bridge["providers"].noisy_provider_from(late)
