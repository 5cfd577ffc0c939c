"""A small MoE ``HybridModel`` for the schedule-plan tests: the GPT plan drivers' sizes on the hybrid providers.

``build_hybrid_provider`` is ``tests.support.schedule_plan.build_provider`` for ``NoisyHybridModelProvider`` /
``NoisyHybridDistillationProvider`` (Bridge's ``HybridModelProvider`` without noise) on the local hybrid stack
(``providers.hybrid.local_hybrid_stack_spec``). With ``final_norm=True`` the stack has a final norm:
``HybridStack`` builds it only as ``TENorm``, so ``LocalFinalNormHybridStack`` builds Megatron-Core's local
``WrappedTorchNorm`` in its place (the same place, the same ``decoder.final_norm`` name); everything else is the
real stack. The drivers (``run_normal_path``, ``run_plan_path``, ...) are the GPT ones.
"""

from __future__ import annotations

from typing import Any

from megatron.core.models.hybrid.hybrid_block import HybridStack

from tests.support.schedule_plan import moe_settings

__all__ = ["LocalFinalNormHybridStack", "build_hybrid_provider", "hybrid_moe_settings", "local_final_norm_stack_spec"]


class LocalFinalNormHybridStack(HybridStack):
    """``HybridStack`` whose final norm is Megatron-Core's local ``WrappedTorchNorm`` instead of ``TENorm``."""

    def __init__(self, *args: Any, post_layer_norm: bool = True, **kwargs: Any) -> None:
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        super().__init__(*args, post_layer_norm=False, **kwargs)
        self.post_layer_norm = post_layer_norm
        if self.post_process and post_layer_norm:  # hybrid_block.py:213-219, with the local norm
            self.final_norm = WrappedTorchNorm(
                config=self.config, hidden_size=self.config.hidden_size, eps=self.config.layernorm_epsilon
            )


def local_final_norm_stack_spec(config: Any) -> Any:
    """``local_hybrid_stack_spec`` with a final norm (``LocalFinalNormHybridStack``)."""
    from nemo_noise_plugin.providers.hybrid import local_hybrid_stack_spec

    spec = local_hybrid_stack_spec(config)
    spec.module = LocalFinalNormHybridStack
    spec.params = {"post_layer_norm": True}
    return spec


def hybrid_moe_settings(pattern: str, *, final_norm: bool = False, **overrides: Any) -> dict[str, Any]:
    """``moe_settings`` as hybrid-provider fields: ``pattern`` instead of ``num_layers`` and the GPT layer spec."""
    from megatron.core.transformer.enums import AttnBackend

    from nemo_noise_plugin.providers.hybrid import local_hybrid_stack_spec

    settings = moe_settings()
    for gpt_only in ("num_layers", "transformer_layer_spec"):
        settings.pop(gpt_only, None)
    settings.update(
        hybrid_layer_pattern=pattern,
        hybrid_stack_spec=local_final_norm_stack_spec if final_norm else local_hybrid_stack_spec,
        attention_backend=AttnBackend.local,
        position_embedding_type="rope",
    )
    settings.update(overrides)  # last, so that hybrid_stack_spec=None (Bridge's default spec) is kept
    return settings


def build_hybrid_provider(noise=None, kd=None, *, pattern: str = "*E*E", final_norm: bool = False, **overrides):
    """A finalized hybrid provider: noisy, noisy + KD (``kd``), or Bridge's plain one (``noise`` and ``kd`` None)."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    from nemo_noise_plugin.providers.hybrid import (
        HybridModelProvider,
        NoisyHybridDistillationProvider,
        NoisyHybridModelProvider,
    )

    settings = hybrid_moe_settings(pattern, final_norm=final_norm, **overrides)
    if kd is not None:
        provider = NoisyHybridDistillationProvider(**settings, noise=noise, kd=kd)
    elif noise is not None:
        provider = NoisyHybridModelProvider(**settings, noise=noise)
    else:
        provider = HybridModelProvider(**settings)
    provider.finalize()
    provider._pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    return provider
