"""The mixin that gives a Megatron-Core GPT or hybrid model chunk the plugin's fine-grained schedule plan.

Every model chunk a plugin provider builds has it, noisy or not: under pipelining the chunks without noise (later
stages, holding the last layer and the loss) need the plugin's nodes as much as the first one.
``NoiseInjectionMixin`` (``nemo_noise_plugin.model``) builds on it and hands its batch inputs to the plan through
``schedule_plan_noise_inputs``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.utils import unwrap_model

from nemo_noise_plugin.schedule_plan.hybrid import (
    HYBRID_PLAN_METHODS,
    NoisyHybridModelChunkSchedulePlan,
    check_hybrid_schedule_plan,
)
from nemo_noise_plugin.schedule_plan.nodes import NoisyModelChunkSchedulePlan

__all__ = ["PluginSchedulePlanMixin", "use_plugin_schedule_plan"]


class PluginSchedulePlanMixin:
    """``build_schedule_plan`` returning the plugin's fine-grained schedule plan (``schedule_plan.nodes``)."""

    def schedule_plan_noise_inputs(
        self, loss_mask: torch.Tensor | None, padding_mask: torch.Tensor | None
    ) -> Any | None:
        """What the plan's pre-process node hands to the noise layer when it runs; None for a chunk without noise.

        The plan's pre-process node runs later, when Megatron schedules it, so the batch inputs a noise layer needs
        are stored in the plan's chunk state when the plan is built. ``NoiseInjectionMixin`` overrides this.
        """
        return None

    def build_schedule_plan(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        decoder_input: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        inference_context: Any = None,
        packed_seq_params: Any = None,
        extra_block_kwargs: dict | None = None,
        runtime_gather_output: bool | None = None,
        inference_params: Any = None,
        loss_mask: torch.Tensor | None = None,
        padding_mask: torch.Tensor | None = None,
        *,
        output_processor: Any = None,
        output_processor_context: Any = None,
    ):
        """``GPTModel.build_schedule_plan`` (megatron-core 0.19.2, ``gpt_model.py``) with the plugin's nodes.

        A copy of upstream's method with the plan class as the change (``nemo_noise_plugin.upstream.copies``). A
        ``HybridModel`` chunk gets ``NoisyHybridModelChunkSchedulePlan`` (``schedule_plan.hybrid``, the plan
        upstream lacks) after ``check_hybrid_schedule_plan``; other model classes raise ``NotImplementedError``.
        """
        plan_class = _plan_class_for(self)
        if self.config.fine_grained_activation_offloading:
            self.preprocess_for_fine_grained_offloading()
        if self.config.moe_paged_stash:
            self.preprocess_for_paged_stash()
        plan = plan_class(
            self,
            input_ids,
            position_ids,
            attention_mask,
            decoder_input,
            labels,
            packed_seq_params,
            extra_block_kwargs,
            runtime_gather_output,
            loss_mask,
            padding_mask,
            output_processor=output_processor,
            output_processor_context=output_processor_context,
        )
        plan.state.noise_inputs = self.schedule_plan_noise_inputs(loss_mask, padding_mask)
        return plan


def _plan_class_for(model: torch.nn.Module) -> type:
    """The plugin's plan class for ``model``'s class: GPT's, or (checked first) the hybrid one."""
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    if isinstance(model, GPTModel):
        return NoisyModelChunkSchedulePlan
    if isinstance(model, HybridModel):
        check_hybrid_schedule_plan(model)
        return NoisyHybridModelChunkSchedulePlan
    raise NotImplementedError(
        f"{type(model).__name__} has no fine-grained schedule plan (the plugin has GPTModel's and HybridModel's); "
        "turn overlap_moe_expert_parallel_comm off."
    )


@functools.cache
def _plugin_plan_class_for(model_class: type) -> type:
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    name = f"{model_class.__name__}WithPluginPlan"
    namespace: dict[str, Any] = {"__module__": __name__}
    if issubclass(model_class, HybridModel):  # HybridModel has no _preprocess / _postprocess for the plan's nodes
        namespace.update(HYBRID_PLAN_METHODS)
    return type(name, (PluginSchedulePlanMixin, model_class), namespace)


def use_plugin_schedule_plan(model: torch.nn.Module) -> torch.nn.Module:
    """Give an already built ``GPTModel`` or ``HybridModel`` chunk (not noisy) the plugin's schedule plan, in place;
    return it unwrapped.

    Only the class changes (a subclass adding ``PluginSchedulePlanMixin``, and for a hybrid model the
    ``_preprocess`` / ``_postprocess`` methods the plan's nodes call); parameters and state-dict keys do not.
    """
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    inner = unwrap_model(model)
    if isinstance(inner, PluginSchedulePlanMixin):
        return inner
    if not isinstance(inner, (GPTModel, HybridModel)):
        raise TypeError(
            f"use_plugin_schedule_plan expects a megatron.core GPTModel or HybridModel, got {type(inner).__name__}."
        )
    inner.__class__ = _plugin_plan_class_for(type(inner))
    return inner
