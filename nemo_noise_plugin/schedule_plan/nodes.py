"""The plugin's schedule nodes for Megatron-Core's fine-grained schedule plan (combined 1F1B, MoE A2A overlap).

The plan (``overlap_moe_expert_parallel_comm``) splits a model chunk into nodes that Megatron runs itself,
bypassing ``model.forward``, the DDP / ``Float16Module`` wrappers and top-level hooks. Three upstream node classes
need changes for the plugin:

- ``NoisePreProcessNode``: hands the microbatch's loss mask (stored in the chunk state when the plan was built) to
  the noise layer for the one ``_preprocess`` call, so ``true_length`` scaling and prompt/response selection work
  as on the normal path, whose forward receives the mask.
- ``LossPostProcessNode``: applies ``decoder.final_layernorm`` after a dense last layer (a hybrid stack's
  ``final_norm`` after any last layer). Upstream applies it only
  in the MoE combine callable (``gpt/fine_grained_callables.py:251``) or for an empty decoder, so a chunk whose
  last layer is dense returns un-normalised hidden states to the output layer (see
  ``docs/schedule_plan.md`` for the reproduction). The loss (CE, or CE + KD through ``output_processor``) leaves
  through this node's single output.
- ``FrozenTolerantLayerNode``: backward only through outputs that need a gradient. Upstream passes every output to
  the autograd engine, which fails with "element 0 of tensors does not require grad" when a frozen embedding or
  frozen layer produces an output without a graph; delayed weight-gradient callables of fully frozen modules are
  skipped for the same reason.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from megatron.core.models.common.model_chunk_schedule_plan import (
    TransformerLayerSchedulePlan,
    TransformerModelChunkSchedulePlan,
)
from megatron.core.models.common.utils import PostProcessNode, PreProcessNode, TransformerLayerNode
from megatron.core.pipeline_parallel.utils import NoopScheduleNode
from megatron.core.transformer.transformer_layer import make_viewless_tensor

__all__ = [
    "FrozenTolerantLayerNode",
    "LossPostProcessNode",
    "NoisePreProcessNode",
    "NoisyLayerSchedulePlan",
    "NoisyModelChunkSchedulePlan",
    "backward_through_differentiable",
    "final_norm_left_to_post_process",
    "skips_final_layernorm_upstream",
]


def backward_through_differentiable(outputs: Sequence[Any], output_grads: Sequence[Any]) -> Sequence[Any]:
    """Run autograd from the ``outputs`` that need a gradient and received one; the others carry none back.

    Same engine call as ``ScheduleNode.default_backward_func``; returns ``output_grads`` as it does.
    """
    pairs = [
        (output, grad)
        for output, grad in zip(outputs, output_grads, strict=True)
        if isinstance(output, torch.Tensor) and output.requires_grad and grad is not None
    ]
    if pairs:
        tensors, grads = zip(*pairs, strict=True)
        torch.autograd.Variable._execution_engine.run_backward(
            tensors=tensors,
            grad_tensors=grads,
            keep_graph=False,
            create_graph=False,
            inputs=tuple(),
            allow_unreachable=True,
            accumulate_grad=True,
        )
    return output_grads


class NoisePreProcessNode(PreProcessNode):
    """``PreProcessNode`` whose ``_preprocess`` call sees the microbatch's loss mask; frozen embeddings are fine."""

    def __init__(self, model, chunk_state, event, stream) -> None:
        super().__init__(model, chunk_state, event, stream)
        self.backward_func = backward_through_differentiable

    def forward_impl(self):
        """Run the model's (noisy) ``_preprocess`` with the batch inputs stored when the plan was built."""
        inputs = getattr(self.chunk_state, "noise_inputs", None)
        if inputs is None:  # a chunk without noise (see PluginSchedulePlanMixin.schedule_plan_noise_inputs)
            return super().forward_impl()
        with self.model.noise_batch_inputs(
            inputs.loss_mask,
            padding_mask=inputs.padding_mask,
            packed_seq_params=inputs.packed_seq_params,
            private_mask=inputs.private_mask,
        ):
            return super().forward_impl()


def skips_final_layernorm_upstream(model) -> bool:
    """Whether Megatron-Core's plan nodes would leave out ``decoder.final_layernorm`` on this chunk.

    True when the chunk holds the final layernorm, its last decoder layer is dense (the MoE combine callable is the
    only upstream node applying it to a non-empty decoder) and there are no MTP layers (which take the hidden states
    before the norm in the plan).
    """
    from megatron.core.models.common.fine_grained_callables import get_layer_moe_metadata

    decoder = model.decoder
    final_layernorm = getattr(decoder, "final_layernorm", None)
    if final_layernorm is None or len(decoder.layers) == 0 or model.config.mtp_num_layers:
        return False
    is_moe, _ = get_layer_moe_metadata(decoder.layers[-1])
    return not is_moe


def final_norm_left_to_post_process(model) -> torch.nn.Module | None:
    """The decoder's final norm when no layer node of the plan applies it and ``PostProcessNode`` would not either.

    GPT: ``decoder.final_layernorm`` after a dense last layer (``skips_final_layernorm_upstream``). Hybrid stack:
    ``decoder.final_norm`` (present when the stack has ``post_process`` and ``post_layer_norm``) whatever the last
    layer, since the hybrid plan's layer nodes never apply it (``schedule_plan.hybrid``). None for an empty decoder
    (``PostProcessNode`` applies the norm itself) and with MTP layers.
    """
    from megatron.core.models.hybrid.hybrid_block import HybridStack

    decoder = model.decoder
    if isinstance(decoder, HybridStack):
        if len(decoder.layers) == 0 or model.config.mtp_num_layers:
            return None
        return getattr(decoder, "final_norm", None)
    return decoder.final_layernorm if skips_final_layernorm_upstream(model) else None


class LossPostProcessNode(PostProcessNode):
    """``PostProcessNode`` that normalises after a dense last layer, as ``TransformerBlock.forward`` does."""

    def forward_impl(self, hidden_states):
        """Final norm where upstream skips it, then ``_postprocess`` (loss or ``output_processor``)."""
        final_norm = final_norm_left_to_post_process(self.model)
        if final_norm is not None:
            hidden_states = final_norm(hidden_states)
            hidden_states = make_viewless_tensor(inp=hidden_states, requires_grad=True, keep_graph=True)
        return super().forward_impl(hidden_states)


class FrozenTolerantLayerNode(TransformerLayerNode):
    """``TransformerLayerNode`` whose backward and delayed weight gradients tolerate frozen parameters.

    It also keeps the dispatch and combine inputs when the expert all-to-all spans a single rank: that all-to-all
    returns its input, so upstream's ``free_input`` would release the output it just produced.
    """

    @staticmethod
    def _resolve_free_input(name, is_moe, config, num_local_experts):
        single_rank_all_to_all = config.expert_model_parallel_size * (config.expert_tensor_parallel_size or 1) == 1
        if name in ("moe_dispatch", "moe_combine") and single_rank_all_to_all:
            return False
        return TransformerLayerNode._resolve_free_input(name, is_moe, config, num_local_experts)

    def backward_impl(self, outputs, output_grad):
        """Backward from the outputs (and detached tensors) that need a gradient; return the input grads."""
        detached_grad = tuple(tensor.grad for tensor in self.detached)
        grads = output_grad + detached_grad
        backward_through_differentiable(outputs + self.before_detached, grads)
        return grads

    def backward_dw(self):
        """Delayed weight gradients of the modules that have a trainable parameter."""
        if self.delay_wgrad_compute and self.bwd_dw_callables:
            self.bwd_dw_callables = [
                module
                for module in self.bwd_dw_callables
                if any(parameter.requires_grad for parameter in module.parameters())
            ]
        return super().backward_dw()


class NoisyLayerSchedulePlan(TransformerLayerSchedulePlan):
    """``TransformerLayerSchedulePlan`` building ``FrozenTolerantLayerNode``s.

    ``_build_callable_nodes`` is upstream's (megatron-core 0.19.2,
    ``models/common/model_chunk_schedule_plan.py``) with the node class as the change (upstream constructs
    ``TransformerLayerNode`` directly) and the layer's callables taken from ``layer_callables`` (the hybrid plan's
    hook, ``schedule_plan.hybrid``).
    """

    NODE_CLASS: type[TransformerLayerNode] = FrozenTolerantLayerNode

    def layer_callables(self) -> tuple[list, dict]:
        """``(forward callables, delayed-wgrad map)`` of the layer: Megatron-Core's ``build_layer_callables``."""
        from megatron.core.models.common.fine_grained_callables import build_layer_callables

        return build_layer_callables(self.layer)

    def _build_callable_nodes(self, event, comp_stream, comm_stream, extra_args):
        from megatron.core.models.common.fine_grained_callables import get_layer_moe_metadata
        from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionLayer

        fwd_callables, bwd_dw_callable_map = self.layer_callables()
        is_moe, num_local_experts = get_layer_moe_metadata(self.layer)
        is_mtp = isinstance(self.layer, MultiTokenPredictionLayer)
        extra_args["config"] = self.layer.config
        extra_args["is_moe"] = is_moe
        extra_args["num_local_experts"] = num_local_experts
        extra_args["delay_wgrad_compute"] = self.layer.config.delay_wgrad_compute
        extra_args["is_mtp"] = is_mtp

        def create_node(stream, module, name):
            return self.NODE_CLASS(
                stream,
                event,
                self.layer_state,
                self.chunk_state,
                module,
                name=name,
                bwd_dw_callables=bwd_dw_callable_map.get(name, None),
                extra_args=extra_args,
            )

        pre_dispatch_module, moe_dispatch_module, mlp_module, moe_combine_module, mtp_post_process_module = (
            fwd_callables
        )
        self.pre_dispatch_computation = create_node(comp_stream, pre_dispatch_module, "pre_dispatch_computation")
        self.mlp = create_node(comp_stream, mlp_module, "mlp")
        if is_moe:
            self.moe_dispatch = create_node(comm_stream, moe_dispatch_module, "moe_dispatch")
            self.moe_combine = create_node(comm_stream, moe_combine_module, "moe_combine")
        else:
            self.moe_dispatch = NoopScheduleNode()
            self.moe_combine = NoopScheduleNode()
        if is_mtp:
            self.mtp_post_process = create_node(comp_stream, mtp_post_process_module, "mtp_post_process")
        else:
            self.mtp_post_process = NoopScheduleNode()


class NoisyModelChunkSchedulePlan(TransformerModelChunkSchedulePlan):
    """A GPT model chunk's schedule plan made of the plugin's nodes (see the module docstring)."""

    PRE_PROCESS_NODE_CLASS = NoisePreProcessNode
    POST_PROCESS_NODE_CLASS = LossPostProcessNode
    LAYER_SCHEDULE_PLAN_CLASS = NoisyLayerSchedulePlan
