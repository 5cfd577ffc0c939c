"""Micro-batches from a recipe's Bridge datasets, for loops that do not use Bridge's data loader.

The CPU training loop and the robustness report read the recipe's own datasets (``config.dataset``, built by
Bridge's GPT dataset provider) and collate consecutive samples into Megatron-style batches.
"""

from __future__ import annotations

from typing import Any

import torch

from nemo_noise_plugin.bridge_imports import import_bridge

__all__ = ["collate", "recipe_datasets"]


def recipe_datasets(config: Any, train_samples: int, valid_samples: int) -> tuple[Any, Any]:
    """The train and validation datasets of ``config.dataset`` (its tokenizer already set), with these sizes."""
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
    """``count`` micro-batches of ``size`` consecutive samples from ``start`` on ``device``, with ``attention_mask``."""
    items = [dataset[start + index] for index in range(count * size)]
    batches = []
    for index in range(count):
        batch = torch.utils.data.default_collate(items[index * size : (index + 1) * size])
        batch = {key: value.to(device) if torch.is_tensor(value) else value for key, value in batch.items()}
        batch["attention_mask"] = attention_mask
        batches.append(batch)
    return batches
