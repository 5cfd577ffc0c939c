"""``NoisyDistillationProvider``: a noisy student trained against a frozen clean copy of itself (Megatron-Bridge).

A dataclass provider like Bridge's ``GPTModelProvider``: the noise (``noise``) and distillation (``kd``) settings are
fields, so recipes, Hydra overrides (``model.kd.temperature=2``) and run-config YAML reach them. Unlike Bridge's
``DistillationProvider`` it has no second provider to keep in sync: the teacher is the student's own weights, it
never mirrors attributes onto a teacher, and it changes no class globally. ``provide`` builds the student only;
``provide_distributed_model`` also snapshots a teacher per model chunk (see ``teacher_weights`` for how its weights
are settled after Bridge loads checkpoints). Checkpoints, exports and the optimizer see the student only.

Train with ``nemo_noise_plugin.forward_step.distillation_forward_step``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nemo_noise_plugin.distillation.kd_config import KDConfig
from nemo_noise_plugin.distillation.teacher import build_clean_teacher
from nemo_noise_plugin.distillation.teacher_weights import attach_teacher
from nemo_noise_plugin.providers import NoisyGPTModelProvider

__all__ = ["NoisyDistillationProvider"]


@dataclass
class NoisyDistillationProvider(NoisyGPTModelProvider):
    """A ``NoisyGPTModelProvider`` whose model chunks carry a frozen clean teacher for distillation."""

    kd: KDConfig = field(default_factory=KDConfig)
    """Distillation settings (loss, temperature, weights, tokens, hidden-state matching)."""
    teacher_shares_frozen_modules: bool = False
    """Share the student's fully frozen submodules with the teacher instead of copying them (saves their memory)."""

    def finalize(self) -> None:
        """Bridge's checks, plus the distillation constraints (before any GPU memory is touched)."""
        super().finalize()
        self.validate_distillation()

    def validate_distillation(self) -> None:
        """Reject settings the distillation path does not support, naming the setting and the value."""
        if not isinstance(self.kd, KDConfig):
            raise TypeError(f"NoisyDistillationProvider.kd must be a KDConfig, got {type(self.kd).__name__}.")
        if not self.kd.enabled:
            return
        if (self.pipeline_model_parallel_size or 1) > 1:
            raise ValueError(
                f"NoisyDistillationProvider: pipeline_model_parallel_size={self.pipeline_model_parallel_size} is "
                "not supported with distillation (the teacher's logits exist only on the last stage's teacher "
                "chunk); use pipeline_model_parallel_size=1, or kd.enabled=false."
            )
        if getattr(self, "overlap_moe_expert_parallel_comm", False) and self.kd.hidden_loss != "none":
            raise ValueError(
                f"NoisyDistillationProvider: kd.hidden_loss={self.kd.hidden_loss!r} is not supported with "
                "overlap_moe_expert_parallel_comm=True: in the fine-grained schedule plan only the post-process "
                "node's output carries gradients, and intermediate layers' outputs are not part of it; use "
                "kd.hidden_loss=none or turn overlap_moe_expert_parallel_comm off."
            )
        if self.kd.hidden_loss != "none":
            for index in self.kd.hidden_layers:
                if not 0 <= index < self.num_layers:
                    raise ValueError(
                        f"KDConfig.hidden_layers={self.kd.hidden_layers!r} is invalid: layer {index} is outside "
                        f"0..{self.num_layers - 1} (num_layers={self.num_layers})."
                    )

    def provide_distributed_model(self, *args: Any, **kwargs: Any) -> list:
        """Bridge's model building and wrapping, then a clean teacher snapshot for each model chunk."""
        self.validate_distillation()
        model = super().provide_distributed_model(*args, **kwargs)
        if self.kd.enabled:
            for chunk in model:
                attach_teacher(
                    chunk, build_clean_teacher(chunk, share_frozen_modules=self.teacher_shares_frozen_modules)
                )
        return model
