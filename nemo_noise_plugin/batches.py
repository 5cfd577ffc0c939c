"""Micro-batches from a recipe's Bridge datasets, for loops that do not use Bridge's data loader.

The CPU training loop and the robustness report read the recipe's own datasets (``config.dataset``) and collate
consecutive samples into Megatron-style batches: Bridge's GPT pretraining pipeline (``GPTDatasetConfig``, the tiny
recipes) or Bridge's finetuning pipeline (``GPTSFTDatasetConfig``: chat template, answer-only loss mask, optionally
packed with ``cu_seqlens``; the SmolLM2 recipes). A finetuning dataset is finite: indices wrap around (epochs), and
its batches are made by the dataset's own ``collate_fn``.
"""

from __future__ import annotations

from typing import Any

import torch

from nemo_noise_plugin.bridge_imports import import_bridge

__all__ = ["collate", "is_finetuning_dataset", "recipe_datasets"]


def is_finetuning_dataset(dataset_config: Any) -> bool:
    """Whether ``dataset_config`` is Bridge's finetuning (SFT) dataset config rather than a pretraining one."""
    builders = import_bridge("megatron.bridge.data.builders.gpt_sft")
    return isinstance(dataset_config, builders.GPTSFTDatasetConfig)


def recipe_datasets(config: Any, train_samples: int, valid_samples: int) -> tuple[Any, Any]:
    """The train and validation datasets of ``config.dataset`` (its tokenizer already set), with these sizes.

    For a finetuning dataset the sizes are those of its files; Bridge prepares packed files first when packing is on.
    """
    if is_finetuning_dataset(config.dataset):
        builders = import_bridge("megatron.bridge.data.builders.gpt_sft")
        builder = builders.GPTSFTDatasetBuilder(config.dataset, config.dataset.tokenizer)
        builder.prepare_data()
        train, valid, _ = builder.build()
        return train, valid
    data = import_bridge("megatron.bridge.data.utils")
    train, valid, _ = data.pretrain_train_valid_test_datasets_provider(
        [train_samples, valid_samples, 0], config.dataset
    )
    return train, valid


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
