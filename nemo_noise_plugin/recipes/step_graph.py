"""One CUDA graph per training step: the recipe settings of Bridge's ``full_iteration`` graph, and what it requires.

A small model's step is host-bound: the GPU waits while Python launches a few thousand kernels (SmolLM2-135M at
micro-batch 4: benchmarks/SFT_THROUGHPUT.md). Megatron-Core's ``FullCudaGraphWrapper`` captures every
micro-batch's forward and backward once and replays them each step; it is the one graph mode Bridge's loop offers
without Transformer Engine. It needs, and ``use_step_graph`` sets together:

- ``model.cuda_graph_impl="full_iteration"`` and ``model.cuda_graph_warmup_steps`` eager steps before the capture;
- ``model.use_te_rng_tracker=True``: the graph-safe RNG tracker (Megatron's own tracker without TE);
- ``rerun_state_machine.check_for_nan_in_loss=False``: Bridge refuses the NaN check's host read inside the graph (the
  noise keeps its own finiteness check, read outside the graph: ``noise/replayable.py``);
- fixed-width batches: the graph copies each micro-batch into static buffers, so an SFT dataset pads every row to
  ``seq_length`` (``dataset.dataset_kwargs["pad_to_max_length"]``; losses are unchanged: the padding is masked and
  the noise's NEFTune length comes from the loss mask).

The noise under the graph: the provider builds replayable noise keys and the plugin's launchers publish each step's
keys before the replay (``training.noise_step_publisher``), so every replayed step adds its own noise.
"""

from __future__ import annotations

from typing import Any

from nemo_noise_plugin.validation import SettingError

__all__ = ["STEP_GRAPH_WARMUP_STEPS", "check_fixed_width_batches", "use_step_graph"]

STEP_GRAPH_WARMUP_STEPS = 2
"""Eager steps before the capture (Megatron's warm-up: allocations and lazy initialisation happen outside it)."""


def use_step_graph(config: Any, warmup_steps: int = STEP_GRAPH_WARMUP_STEPS) -> Any:
    """Set ``config`` (a Bridge ``ConfigContainer``) to replay each training step from one CUDA graph; returns it.

    The settings are listed in the module docstring; every one is an ordinary config field, so an override
    (``model.cuda_graph_impl=none``) turns the graph off again (then ``check_for_nan_in_loss`` and the padding stay
    as set here unless overridden too).
    """
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 1:
        raise SettingError("warmup_steps", warmup_steps, "an integer >= 1 (eager steps before the capture)")
    if getattr(config.dataset, "enable_offline_packing", False):
        raise SettingError(
            "dataset.enable_offline_packing",
            True,
            "False with the step graph",
            why=": packed rows under a full-iteration graph also need padded cu_seqlens and Transformer Engine's "
            "attention, and were not measured here; train packed rows eagerly (a recipe's step_graph=False)",
        )
    model = config.model
    model.cuda_graph_impl = "full_iteration"
    model.cuda_graph_warmup_steps = warmup_steps
    model.use_te_rng_tracker = True
    config.rerun_state_machine.check_for_nan_in_loss = False
    if _is_finetuning_dataset(config.dataset):
        config.dataset.dataset_kwargs = {**(config.dataset.dataset_kwargs or {}), "pad_to_max_length": True}
    return config


def check_fixed_width_batches(config: Any) -> None:
    """Refuse a full-iteration graph over an SFT dataset whose batches are as wide as their longest row.

    ``SettingError`` naming the setting: the replay would copy a narrower batch into the captured static buffers and
    fail there, after the model is built. Packed SFT data is Bridge's own check (``pad_cu_seqlens``).
    """
    from nemo_noise_plugin.upstream.bridge_imports import import_bridge

    is_full_iteration = import_bridge("megatron.bridge.utils.cuda_graph").is_full_iteration_cuda_graph
    dataset = getattr(config, "dataset", None)
    if not is_full_iteration(config.model) or not _is_finetuning_dataset(dataset):
        return
    if getattr(dataset, "enable_offline_packing", False):
        return
    kwargs = getattr(dataset, "dataset_kwargs", None) or {}
    if kwargs.get("pad_to_max_length") is not True:
        raise SettingError(
            "dataset.dataset_kwargs.pad_to_max_length",
            kwargs.get("pad_to_max_length"),
            "true",
            context=" with model.cuda_graph_impl=full_iteration",
            why=": the graph replays fixed-shape batches and SFT rows are otherwise as wide as the longest in their "
            "batch (set dataset.dataset_kwargs={pad_to_max_length:true}, or use recipes.step_graph.use_step_graph)",
        )


def _is_finetuning_dataset(dataset: Any) -> bool:
    """Bridge's SFT dataset config (``GPTSFTDatasetConfig``: rows padded per batch unless ``pad_to_max_length``)."""
    return dataset is not None and hasattr(dataset, "dataset_kwargs") and hasattr(dataset, "preprocessing")
