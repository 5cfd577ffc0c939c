"""Run a Megatron-Bridge ``ConfigContainer`` on Bridge's own training loop with the plugin's forward step.

The launcher behind ``nemo llm finetune`` and ``python -m nemo_noise_plugin.finetune``, and usable from Python::

    from nemo_noise_plugin.launch import launch
    from nemo_noise_plugin.recipes import tiny_noise_sft_config

    if __name__ == "__main__":  # Bridge's checkpoint-save workers re-import the launching script
        launch(tiny_noise_sft_config(), ["train.train_iters=100", "model.noise.alpha=10"])

It decides three things from the config, so a recipe only has to return one:

- the overrides: Megatron-Bridge's Hydra path with the plugin's settings re-validated
  (``nemo_noise_plugin.config_io.apply_overrides``): ``key=value`` sets a field, ``+key=value`` adds a key (inside
  dict-valued fields such as ``env_vars``), ``~key`` deletes one (a dataclass field goes back to its default);
- the forward step: ``distillation_forward_step`` for a ``NoisyDistillationProvider``, else ``noise_forward_step``;
- the entry: Bridge's ``finetune`` when ``checkpoint.pretrained_checkpoint`` names weights to start from, else
  ``pretrain`` (the tiny recipes train from scratch on the embedded corpus; both resume from ``checkpoint.load``).

Bridge's loop needs a GPU, so ``launch`` checks for one first, before it imports Bridge or writes anything.
Importing this module is cheap: Bridge and torch are imported only when a function needs them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from nemo_noise_plugin.bridge_imports import import_bridge, use_prebuilt_dataset_helpers

__all__ = [
    "GPU_REQUIRED_MESSAGE",
    "GPUUnavailableError",
    "forward_step_for",
    "launch",
    "require_gpu",
    "training_entry_for",
]

GPU_REQUIRED_MESSAGE = (
    "Bridge's training loop needs a GPU; use --dryrun/--to-yaml, or `python -m nemo_noise_plugin` for the CPU main job"
)


class GPUUnavailableError(RuntimeError):
    """Raised by ``launch`` on a machine where CUDA is not available, before anything else happens."""


def require_gpu() -> None:
    """Raise ``GPUUnavailableError`` unless CUDA is available (the only CUDA call a real run makes before Bridge)."""
    import torch

    if not torch.cuda.is_available():
        raise GPUUnavailableError(GPU_REQUIRED_MESSAGE)


def forward_step_for(config: Any) -> Callable:
    """The plugin's forward step for ``config.model``: distillation for a ``NoisyDistillationProvider``, else noise."""
    from nemo_noise_plugin.distillation.provider import NoisyDistillationProvider
    from nemo_noise_plugin.forward_step import distillation_forward_step, noise_forward_step

    return distillation_forward_step if isinstance(config.model, NoisyDistillationProvider) else noise_forward_step


def training_entry_for(config: Any) -> Callable:
    """Bridge's ``finetune`` when ``checkpoint.pretrained_checkpoint`` is set, else ``pretrain``."""
    if config.checkpoint.pretrained_checkpoint is not None:
        return import_bridge("megatron.bridge.training.finetune").finetune
    return import_bridge("megatron.bridge.training.pretrain").pretrain


def launch(
    config: Any,
    overrides: Sequence[str] = (),
    *,
    forward_step: Callable | None = None,
    callbacks: Sequence[Any] | None = None,
) -> None:
    """Train ``config`` (after ``overrides``) with Bridge's real loop and the plugin's forward step.

    Checks for a GPU first (``GPUUnavailableError``), then applies the overrides, lets Bridge use megatron-core's
    prebuilt dataset helper (``use_prebuilt_dataset_helpers``) and calls ``training_entry_for(config)`` with
    ``forward_step`` (default: ``forward_step_for(config)``) and Bridge ``callbacks``. Under ``torchrun`` every
    rank calls this.
    """
    from nemo_noise_plugin.config_io import apply_overrides

    require_gpu()
    config = apply_overrides(config, list(overrides))
    use_prebuilt_dataset_helpers()
    entry = training_entry_for(config)
    step = forward_step or forward_step_for(config)
    if callbacks:
        entry(config, step, callbacks=list(callbacks))
    else:
        entry(config, step)
