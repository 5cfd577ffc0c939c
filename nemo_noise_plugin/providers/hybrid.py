"""Megatron-Bridge providers for noisy hybrid models (Megatron-Core ``HybridModel``, ``GPTModel``'s successor).

``NoisyHybridModelProvider`` is Bridge's ``HybridModelProvider`` with the ``noise`` field, and
``NoisyHybridDistillationProvider`` adds the ``kd`` settings and the frozen clean teacher: the same two mixins as
the GPT providers (``providers.NoiseProviderMixin``, ``providers.DistillationProviderMixin``), so the same gate
(``finalize``, ``provide``, the override checks), the same error messages and the same teacher code
(``distillation.teacher.build_clean_teacher``: a frozen deep copy sharing the student's process groups). ``provide``
builds Bridge's ``HybridModel`` and turns it into a ``NoisyHybridModel`` (``model.hybrid``) on the first stage.

What the hybrid provider adds to the gate, as ``validation.SettingError`` before any model is built: the layer
pattern (``hybrid_layer_pattern``, symbols of Megatron-Core's ``Symbols.VALID_LAYERS``, its length equal to
``num_layers`` when both are set), ``virtual_pipeline_model_parallel_size`` (Bridge's hybrid provider asserts it
away inside ``provide``) and, with ``overlap_moe_expert_parallel_comm`` (the fine-grained schedule plan), a pattern
of attention, MLP and MoE layers only (``schedule_plan.hybrid.check_schedule_plan_pattern``: no Mamba, no MTP).

``local_hybrid_stack_spec`` is a hybrid stack of Megatron-Core's local (non-Transformer-Engine) attention, MLP and
MoE layers, so a hybrid model without Mamba layers builds on any machine, the CPU included; Mamba layers need
mamba_ssm's and causal_conv1d's CUDA kernels and Bridge's default (Transformer Engine) spec. See
``docs/hybrid_model.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron.core.models.hybrid.hybrid_layer_allocation import Symbols, get_hybrid_total_layer_count
from megatron.core.models.hybrid.hybrid_model import HybridModel

from nemo_noise_plugin.providers import DistillationProviderMixin, NoiseProviderMixin
from nemo_noise_plugin.schedule_plan.hybrid import check_schedule_plan_pattern
from nemo_noise_plugin.upstream.bridge_imports import import_bridge
from nemo_noise_plugin.validation import SettingError

HybridModelProvider = import_bridge("megatron.bridge.models.hybrid.hybrid_provider").HybridModelProvider

__all__ = [
    "HybridModelProvider",
    "NoisyHybridDistillationProvider",
    "NoisyHybridModelProvider",
    "hybrid_layer_count",
    "local_hybrid_stack_spec",
    "mamba_kernels_missing",
]

MAMBA_KERNEL_MODULES = ("mamba_ssm", "causal_conv1d", "transformer_engine")
"""What a Mamba layer (``M``) of Megatron-Core 0.19.2 needs: its mixer's kernels and the Transformer Engine spec."""


def mamba_kernels_missing() -> str | None:
    """Why Mamba layers cannot be built here (no CUDA device, or a missing kernel package), or None when they can."""
    import importlib.util

    import torch

    missing = [name for name in MAMBA_KERNEL_MODULES if importlib.util.find_spec(name) is None]
    reasons = [] if torch.cuda.is_available() else ["no CUDA device"]
    reasons += [f"{name} is not installed" for name in missing]
    if not reasons:
        return None
    needs = "Mamba layers (M) need mamba_ssm's and causal_conv1d's CUDA kernels and Transformer Engine"
    return f"{needs}: {'; '.join(reasons)}"


def hybrid_layer_count(provider: Any) -> int | None:
    """The decoder layers ``provider`` builds: its main layer pattern's length (``|`` and MTP depths not counted),
    else ``num_layers``; ``SettingError`` for a pattern Megatron-Core cannot parse."""
    setting = "hybrid_layer_pattern" if provider.hybrid_layer_pattern is not None else "hybrid_override_pattern"
    pattern = getattr(provider, setting)
    if pattern is None:
        return provider.num_layers
    allowed = f"a string of the layer symbols {''.join(sorted(Symbols.VALID_LAYERS))}, e.g. '*-*-' or 'M*-'"
    if not isinstance(pattern, str) or not pattern.split(Symbols.MTP_SEPARATOR)[0].replace(Symbols.PIPE, ""):
        raise SettingError(f"{provider.provider_name}.{setting}", pattern, allowed)
    try:
        return get_hybrid_total_layer_count(pattern)
    except ValueError as error:
        raise SettingError(f"{provider.provider_name}.{setting}", pattern, allowed, why=f" ({error})") from None


class _HybridGate:
    """The hybrid provider's own checks, run with the noise settings at ``finalize`` and ``provide``."""

    decoder_layer_count = staticmethod(hybrid_layer_count)

    def validate_noise(self) -> None:
        """The noise settings (as on GPT), then the layer pattern and the virtual pipeline size."""
        super().validate_noise()
        layers = hybrid_layer_count(self)
        if self.num_layers is not None and layers is not None and self.num_layers != layers:
            raise SettingError(
                f"{self.provider_name}.num_layers",
                self.num_layers,
                f"None or {layers}, the length of hybrid_layer_pattern",
                context=f" with hybrid_layer_pattern={self.hybrid_layer_pattern or self.hybrid_override_pattern!r}",
            )
        if self.overlap_moe_expert_parallel_comm:  # the fine-grained schedule plan: attention, MLP and MoE only
            setting = "hybrid_layer_pattern" if self.hybrid_layer_pattern is not None else "hybrid_override_pattern"
            check_schedule_plan_pattern(f"{self.provider_name}.{setting}", getattr(self, setting))
        if self.virtual_pipeline_model_parallel_size is not None:
            raise SettingError(
                f"{self.provider_name}.virtual_pipeline_model_parallel_size",
                self.virtual_pipeline_model_parallel_size,
                "None",
                why=": Megatron-Bridge 0.6.2 builds hybrid models without virtual pipeline stages",
            )


@dataclass
class NoisyHybridModelProvider(_HybridGate, NoiseProviderMixin, HybridModelProvider):
    """A Bridge ``HybridModelProvider`` whose first-stage model chunk adds embedding noise (``NoisyHybridModel``)."""

    def provide(self, pre_process=None, post_process=None, vp_stage=None) -> HybridModel:
        """Build the chunk as ``HybridModelProvider.provide`` does; a ``NoisyHybridModel`` on the first stage.

        A pattern with Mamba layers where their kernels are absent is a ``RuntimeError`` saying which are missing
        (``mamba_kernels_missing``), before anything is built.
        """
        pattern = self.hybrid_layer_pattern or self.hybrid_override_pattern or ""
        reason = mamba_kernels_missing() if Symbols.MAMBA in pattern else None
        if reason is not None:
            name = self.provider_name
            raise RuntimeError(f"{name}: hybrid_layer_pattern={pattern!r} cannot be built here. {reason}.")
        return super().provide(pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)


@dataclass
class NoisyHybridDistillationProvider(DistillationProviderMixin, NoisyHybridModelProvider):
    """A ``NoisyHybridModelProvider`` whose model chunks carry a frozen clean ``HybridModel`` teacher."""


def local_hybrid_stack_spec(config: Any) -> Any:
    """A ``HybridStack`` spec of Megatron-Core's local attention (``*``), MLP (``-``) and MoE (``E``) layers.

    No Transformer Engine and no Mamba layer: it builds wherever megatron-core does. The stack has no final norm
    (``post_layer_norm=False``), because ``HybridStack`` builds it as ``TENorm`` only (``hybrid_block.py:213-219``).
    The MoE layer has ``config.num_moe_experts`` local experts. Name it as the provider's ``hybrid_stack_spec``
    (``hybrid_stack_spec=local_hybrid_stack_spec``, with ``attention_backend=local``).
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules
    from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import (
        MoETransformerLayer,
        TransformerLayer,
        TransformerLayerSubmodules,
    )

    dense = get_gpt_layer_local_submodules()
    experts = getattr(config, "num_moe_experts", None)
    submodules = HybridStackSubmodules(
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
    )
    if experts:
        moe = get_gpt_layer_local_submodules(num_experts=experts)
        submodules.moe_layer = ModuleSpec(
            module=MoETransformerLayer,
            submodules=TransformerLayerSubmodules(
                pre_mlp_layernorm=moe.pre_mlp_layernorm, mlp=moe.mlp, mlp_bda=moe.mlp_bda
            ),
        )
    return ModuleSpec(module=HybridStack, params={"post_layer_norm": False}, submodules=submodules)
