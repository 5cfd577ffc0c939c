"""The fine-grained schedule plan for Megatron-Core's ``HybridModel``, which megatron-core 0.19.2 does not have.

A hybrid stack's attention (``*``), MLP (``-``) and MoE (``E``) layers are Megatron-Core ``TransformerLayer``s
(``MLPLayer``, ``MoETransformerLayer``), so each becomes one layer plan of the plugin's GPT nodes
(``NoisyLayerSchedulePlan``: ``FrozenTolerantLayerNode``s from Megatron-Core's ``build_layer_callables``), with
two adaptations that ``HybridLayerSchedulePlan.layer_callables`` makes:

- Megatron-Core's delayed-wgrad wrapper asks every layer for ``self_attention.backward_dw``; an MLP or MoE layer of
  a hybrid stack has an ``IdentityOp`` there, so the wrapper is built with a no-op in its place (and identity
  modules are dropped from the delayed-wgrad map).
- GPT's MoE combine callable reads ``decoder.final_layernorm`` (``gpt/fine_grained_callables.py:251``), an
  attribute ``HybridStack`` lacks (its norm is ``final_norm``); the combine runs with that attribute set to None,
  and the plugin's ``LossPostProcessNode`` applies ``final_norm`` after the last layer, whatever its type.

The pre-process node is the plugin's ``NoisePreProcessNode``: it calls ``NoisyHybridModel._preprocess``, the one
place the noise is added, exactly as the normal forward does. The post-process node is ``LossPostProcessNode``; it
calls ``_postprocess``, which ``HybridModel`` lacks: ``hybrid_postprocess`` is the output layer and loss part of
``HybridModel.forward`` with GPT's ``output_processor`` hook (what KD under the plan uses). Mamba (``M``) and the
other non-transformer layers, and multi-token prediction, are refused (``check_schedule_plan_pattern``): they have
no all-to-all split in megatron-core 0.19.2. See ``docs/hybrid_model.md``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from megatron.core import tensor_parallel
from megatron.core.inference.utils import InferenceMode
from megatron.core.models.hybrid.hybrid_layer_allocation import Symbols
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.utils import is_using_quantization_scales

from nemo_noise_plugin.schedule_plan.nodes import NoisyLayerSchedulePlan, NoisyModelChunkSchedulePlan
from nemo_noise_plugin.validation import SettingError

__all__ = [
    "HYBRID_PLAN_METHODS",
    "PLAN_LAYER_SYMBOLS",
    "PreprocessOutput",
    "HybridLayerSchedulePlan",
    "NoisyHybridModelChunkSchedulePlan",
    "check_hybrid_schedule_plan",
    "check_schedule_plan_pattern",
    "hybrid_postprocess",
    "hybrid_preprocess",
]

PreprocessOutput = tuple[torch.Tensor | None, torch.Tensor | None, None, None, None, torch.Tensor | None]
"""``(decoder_input, rotary_pos_emb, rotary_pos_cos, rotary_pos_sin, sequence_len_offset, padding_mask)``."""

PLAN_LAYER_SYMBOLS: tuple[str, ...] = (Symbols.ATTENTION, Symbols.MLP, Symbols.MOE)
"""The hybrid layer symbols the schedule plan splits: attention, MLP and MoE (all ``TransformerLayer``s)."""


def check_schedule_plan_pattern(setting: str, pattern: str | None) -> None:
    """``SettingError`` unless every layer of the hybrid ``pattern`` has a schedule-plan split, and it has no MTP.

    ``setting`` names the pattern in the message (``NoisyHybridModelProvider.hybrid_layer_pattern``).
    """
    main, _, mtp = (pattern or "").partition(Symbols.MTP_SEPARATOR)
    unsupported = sorted({symbol for symbol in main.replace(Symbols.PIPE, "") if symbol not in PLAN_LAYER_SYMBOLS})
    allowed = "attention (*), MLP (-) and MoE (E) layers only, without MTP depths (/)"
    context = " with overlap_moe_expert_parallel_comm=True (the fine-grained schedule plan)"
    if unsupported:
        why = (
            f": its {', '.join(unsupported)} layers have no all-to-all split in megatron-core 0.19.2's schedule plan"
            + (" (Mamba layers also need CUDA kernels)" if Symbols.MAMBA in unsupported else "")
            + "; turn overlap_moe_expert_parallel_comm off for this pattern"
        )
        raise SettingError(setting, pattern, allowed, context=context, why=why)
    if mtp:
        why = ": the hybrid schedule plan has no multi-token-prediction nodes; drop the MTP part of the pattern"
        raise SettingError(setting, pattern, allowed, context=context, why=why)


def check_hybrid_schedule_plan(model: torch.nn.Module) -> None:
    """``check_schedule_plan_pattern`` for a built hybrid model chunk (its pattern and its own layers)."""
    pattern = model.hybrid_layer_pattern
    check_schedule_plan_pattern(f"{type(model).__name__}.hybrid_layer_pattern", pattern)
    if model.mtp_process or model.config.mtp_num_layers:
        setting = f"{type(model).__name__}.config.mtp_num_layers"
        raise SettingError(setting, model.config.mtp_num_layers, "None", why=": the hybrid plan has no MTP nodes")


def _no_weight_gradients() -> None:
    """The delayed weight gradients of a layer part that has no weights (an ``IdentityOp``)."""


@contextlib.contextmanager
def _identity_attention_wgrad(layer: torch.nn.Module) -> Iterator[None]:
    """While Megatron-Core builds the layer's callables: a no-op ``backward_dw`` on an identity attention."""
    attention = layer.self_attention
    patched = not hasattr(attention, "backward_dw")
    if patched:
        attention.backward_dw = _no_weight_gradients
    try:
        yield
    finally:
        if patched:
            del attention.backward_dw


def _combine_without_gpt_final_layernorm(combine: Callable) -> Callable:
    """GPT's MoE combine callable on a ``HybridStack``: ``decoder.final_layernorm`` reads None while it runs."""

    def combine_forward(node, output):
        decoder = node.chunk_state.model.decoder
        if hasattr(decoder, "final_layernorm"):
            return combine(node, output)
        decoder.final_layernorm = None  # not a module: no parameter or state-dict key appears
        try:
            return combine(node, output)
        finally:
            del decoder.final_layernorm

    return combine_forward


class HybridLayerSchedulePlan(NoisyLayerSchedulePlan):
    """``NoisyLayerSchedulePlan`` for one attention, MLP or MoE layer of a hybrid stack (module docstring)."""

    def layer_callables(self) -> tuple[list, dict]:
        """Megatron-Core's callables for the layer, adapted to a hybrid stack's attention-free / MLP-free layers."""
        from megatron.core.models.common.fine_grained_callables import build_layer_callables, get_layer_moe_metadata

        with _identity_attention_wgrad(self.layer):
            forward, backward_dw = build_layer_callables(self.layer)
        forward = list(forward)
        if get_layer_moe_metadata(self.layer)[0]:
            forward[3] = _combine_without_gpt_final_layernorm(forward[3])
        backward_dw = {name: module for name, module in backward_dw.items() if not isinstance(module, IdentityOp)}
        return forward, backward_dw


class NoisyHybridModelChunkSchedulePlan(NoisyModelChunkSchedulePlan):
    """A hybrid model chunk's schedule plan: the plugin's GPT pre/post-process nodes, hybrid layer plans."""

    LAYER_SCHEDULE_PLAN_CLASS = HybridLayerSchedulePlan


def hybrid_postprocess(
    model: torch.nn.Module,
    hidden_states: torch.Tensor,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    labels: torch.Tensor | None,
    *,
    loss_mask: torch.Tensor | None = None,
    decoder_input: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    packed_seq_params: Any = None,
    runtime_gather_output: bool | None = None,
    output_processor: Callable[..., torch.Tensor] | None = None,
    output_processor_context: Any = None,
    **_: Any,
) -> torch.Tensor:
    """``GPTModel._postprocess`` for a ``HybridModel`` in training: logits and loss, or ``output_processor``.

    The output-layer and loss part of ``HybridModel.forward`` (megatron-core 0.19.2, ``hybrid_model.py:524-633``)
    without its MTP and inference branches (the plan refuses MTP and runs in training only), and with the
    ``output_processor`` call of ``GPTModel._postprocess`` (``gpt_model.py:719-737``). The final norm was applied
    before, by ``LossPostProcessNode``; arguments only GPT uses (rotary embeddings, ...) are accepted and ignored.
    """
    if not model.post_process:
        return hidden_states
    output_weight = None
    if model.share_embeddings_and_output_weights:
        output_weight = model.shared_embedding_or_output_weight()
    if output_processor is not None:
        return output_processor(
            hidden_states=hidden_states,
            output_layer=model.output_layer,
            output_weight=output_weight,
            labels=labels,
            loss_mask=loss_mask,
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            decoder_input=decoder_input,
            inference_context=None,
            packed_seq_params=packed_seq_params,
            runtime_gather_output=runtime_gather_output,
            context=output_processor_context,
            compute_language_model_loss=model.compute_language_model_loss,
            scale_logits=model._scale_logits,
            config=model.config,
        )
    logits, _ = model.output_layer(hidden_states, weight=output_weight, runtime_gather_output=runtime_gather_output)
    logits = model._scale_logits(logits)
    if labels is None:
        return logits.transpose(0, 1).contiguous()  # [s, b, v] -> [b, s, v]
    return model.compute_language_model_loss(labels, logits)


def hybrid_preprocess(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    decoder_input: torch.Tensor | None = None,
    inference_context: Any = None,
    packed_seq_params: Any = None,
    padding_mask: torch.Tensor | None = None,
    *,
    add_noise: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> PreprocessOutput:
    """``GPTModel._preprocess`` for a ``HybridModel``: the embedding and rotary part of ``HybridModel.forward``.

    Returns the six-tuple ``PreProcessNode`` unpacks. ``add_noise`` (``NoisyHybridModel``) is applied to the
    embedding output in its final (sequence-parallel scattered) layout; a caller-supplied ``decoder_input`` and a
    stage without ``pre_process`` are never passed to it.
    """
    if decoder_input is None and model.pre_process:
        # HybridModel.forward, megatron-core 0.19.2 hybrid_model.py:455-473.
        decoder_input = model.embedding(input_ids=input_ids, position_ids=position_ids)
        if (
            InferenceMode.is_active()
            and inference_context is not None
            and inference_context.is_dynamic_batching()
            and is_using_quantization_scales(model.config)
        ):
            decoder_input[inference_context.padding_slice] = 0.0
        if model.config.sequence_parallel and not model.embedding.scatter_to_sequence_parallel:
            decoder_input = tensor_parallel.scatter_to_sequence_parallel_region(
                decoder_input, group=model.pg_collection.tp
            )
        if add_noise is not None:
            decoder_input = add_noise(decoder_input)

    # HybridModel.forward, hybrid_model.py:479-496.
    rotary_pos_emb = None
    packed = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
    if model.position_embedding_type == "rope" and not model.config.multi_latent_attention:
        rotary_seq_len = model.rotary_pos_emb.get_rotary_seq_len(
            inference_context, model.decoder, decoder_input, model.config, packed_seq_params
        )
        rotary_pos_emb = model.rotary_pos_emb(rotary_seq_len, packed_seq=packed)
    elif model.position_embedding_type == "yarn":
        rotary_seq_len = model.rotary_pos_emb.get_rotary_seq_len(
            inference_context, model.decoder, decoder_input, model.config, packed_seq_params
        )
        rotary_pos_emb, _ = model.rotary_pos_emb(rotary_seq_len, packed_seq=packed)
    return decoder_input, rotary_pos_emb, None, None, None, padding_mask


HYBRID_PLAN_METHODS: dict[str, Callable] = {"_preprocess": hybrid_preprocess, "_postprocess": hybrid_postprocess}
"""What a ``HybridModel`` chunk without noise (a later pipeline stage) needs for the plan's pre/post nodes."""
