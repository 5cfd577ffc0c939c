"""The plugin's fine-grained schedule plan: noise and distillation under MoE A2A overlap (combined 1F1B).

``NoiseInjectionMixin.build_schedule_plan`` returns a ``NoisyModelChunkSchedulePlan`` (``nodes``); the distillation
forward step feeds the clean teacher's logits to the plan's post-process node through ``output_processor``
(``distillation``). See ``docs/schedule_plan.md``.
"""

from nemo_noise_plugin.schedule_plan import nodes
from nemo_noise_plugin.schedule_plan.nodes import *  # noqa: F403 - the package exports what ``nodes`` does

__all__ = list(nodes.__all__)  # the package exports what ``nodes`` does
