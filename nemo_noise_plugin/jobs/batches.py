"""The recipe's tokenizer and datasets as Megatron-Bridge's loop has them, and micro-batches made from them.

Bridge's ``setup()`` builds the tokenizer from ``config.tokenizer``, gives it to ``config.dataset`` only when that
config has a ``tokenizer`` field (Megatron-Core's pretraining ``GPTDatasetConfig``; Bridge's finetuning
``GPTSFTDatasetConfig`` has none), and builds the datasets with ``get_dataset_provider(config.dataset)``, to which it
passes the tokenizer when the provider takes one. The plugin's callbacks (robustness report, task report, privacy
audit) and the CPU loop read the tokenizer and datasets the same way, on CPU and GPU alike:

- ``recipe_tokenizer(state)``: Bridge's ``GlobalState.tokenizer`` (built from ``config.tokenizer`` by Bridge's own
  ``build_tokenizer``); ``setup_tokenizer(state)`` is the step of Bridge's ``setup()`` the CPU loop repeats;
- ``recipe_datasets(state, ...)``: the train, validation and test datasets from Bridge's dataset provider for
  ``config.dataset``, over the files Bridge prepared (index files, packed files: prepared once, on rank 0).

``collate`` turns consecutive samples into Megatron-style batches: a pretraining dataset's with torch's default
collation, a finetuning dataset's (finite: indices wrap around, i.e. epochs) with its own ``collate_fn`` (chat
template, answer-only loss mask, ``cu_seqlens`` when packed).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch

from nemo_noise_plugin.upstream.bridge_imports import import_bridge

__all__ = [
    "collate",
    "is_finetuning_dataset",
    "recipe_datasets",
    "recipe_tokenizer",
    "setup_tokenizer",
]


def is_finetuning_dataset(dataset_config: Any) -> bool:
    """Whether ``dataset_config`` is Bridge's finetuning (SFT) dataset config rather than a pretraining one."""
    builders = import_bridge("megatron.bridge.data.builders.gpt_sft")
    return isinstance(dataset_config, builders.GPTSFTDatasetConfig)


def recipe_tokenizer(state: Any) -> Any:
    """The run's tokenizer: Bridge's ``GlobalState.tokenizer`` (built once from ``state.cfg.tokenizer``)."""
    return state.tokenizer


def setup_tokenizer(state: Any) -> Any:
    """Do what Bridge's ``setup()`` does with the tokenizer before it builds the datasets; returns the tokenizer.

    The tokenizer goes to ``state.cfg.dataset.tokenizer`` only where that config declares the field (the pretraining
    dataset config), exactly as Bridge leaves it: a finetuning config gets none, so code that reads datasets must go
    through ``recipe_tokenizer``/``recipe_datasets``, never ``config.dataset.tokenizer``.
    """
    tokenizer = recipe_tokenizer(state)
    if hasattr(state.cfg.dataset, "tokenizer"):
        state.cfg.dataset.tokenizer = tokenizer
    return tokenizer


def recipe_datasets(
    state: Any, train_samples: int = 0, valid_samples: int = 0, *, test: bool = False, unpacked: bool = False
) -> tuple[Any, Any, Any]:
    """The train, validation and test datasets of ``state.cfg.dataset`` from Bridge's own dataset provider.

    Args:
        state: Bridge's ``GlobalState`` (``context.state`` in a callback); its ``cfg`` is the run's config.
        train_samples: samples of the train split (pretraining datasets; a finetuning split is its whole file).
        valid_samples: samples of the validation split (likewise).
        test: also build a finetuning config's test split (``test.jsonl``) when the run's config does not
            (``do_test=False``); the run's config is not changed.
        unpacked: read a finetuning config's splits one example per row even when the run packs them (for
            evaluations that score each example on its own).

    The provider gets the tokenizer (``recipe_tokenizer``) when it takes one, as Bridge's ``setup()`` binds it. A
    split the config does not build is None. Example::

        _, valid, _ = recipe_datasets(context.state)
        batches = collate(valid, 4, context.state.cfg.train.micro_batch_size, None, "cuda")
    """
    dataset_config = state.cfg.dataset
    if is_finetuning_dataset(dataset_config):
        changes: dict[str, Any] = {}
        if test and not dataset_config.do_test:
            changes["do_test"] = True
        if unpacked and dataset_config.enable_offline_packing:
            changes.update(enable_offline_packing=False, offline_packing_specs=None)
        if changes:
            dataset_config = dataclasses.replace(dataset_config, **changes)
    provider = import_bridge("megatron.bridge.data.utils").get_dataset_provider(dataset_config)
    parameters = inspect.signature(provider).parameters
    extra: dict[str, Any] = {}
    if "tokenizer" in parameters:
        extra["tokenizer"] = recipe_tokenizer(state)
    if "pg_collection" in parameters:
        extra["pg_collection"] = _process_groups()
    train, valid, test_set = provider([train_samples, valid_samples, 0], dataset_config, **extra)
    return train, valid, test_set


def _process_groups() -> Any:
    """Megatron's process groups when model parallelism is initialised, else None (a provider then ignores them)."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    from megatron.core.process_groups_config import ProcessGroupCollection

    return ProcessGroupCollection.use_mpu_process_groups()


def collate(
    dataset: Any,
    count: int,
    size: int,
    attention_mask: torch.Tensor | None,
    device: Any,
    start: int = 0,
) -> list[dict[str, torch.Tensor]]:
    """``count`` micro-batches of ``size`` consecutive samples from ``start`` on ``device``, with ``attention_mask``.

    A finetuning dataset's batches are as wide as their longest sample (its ``collate_fn``); ``attention_mask``
    (a causal ``[1, 1, s, s]`` mask for the CPU) is cut to that width. Packed batches carry their own ``cu_seqlens``.
    """
    finetuning = hasattr(dataset, "collate_fn")
    indices = [(start + index) % len(dataset) if finetuning else start + index for index in range(count * size)]
    items = [dataset[index] for index in indices]
    batches = []
    for index in range(count):
        chunk = items[index * size : (index + 1) * size]
        batch = dataset.collate_fn(chunk) if finetuning else torch.utils.data.default_collate(chunk)
        batch = {key: value.to(device) if torch.is_tensor(value) else value for key, value in batch.items()}
        width = batch["tokens"].shape[-1]
        mask = attention_mask
        if mask is not None and mask.shape[-1] > width:
            mask = mask[..., :width, :width]
        batch["attention_mask"] = mask
        batches.append(batch)
    return batches
