"""The privacy audit's domain checks (tensor shapes, dtypes, devices), with errors that name the argument.

Scalar arguments (counts, numbers, choices) are checked with the plugin's one dialect, ``nemo_noise_plugin.validation``
(``check_int``, ``check_number``, ``check_choice``: a ``SettingError`` naming the argument, the value and what is
allowed); ``check_confidence`` and ``check_search_args`` use it too.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from nemo_noise_plugin.validation import check_int, check_number

__all__ = [
    "INTEGER_DTYPES",
    "check_confidence",
    "check_masks",
    "check_search_args",
    "check_table",
    "check_token_ids",
    "shape_of",
    "to_device",
]

INTEGER_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def to_device(device: torch.device, tensor: torch.Tensor | None) -> torch.Tensor | None:
    """``tensor`` on ``device`` (None stays None)."""
    return None if tensor is None else tensor.to(device)


def shape_of(value: object) -> str:
    """A tensor's shape as ``[a, b]`` for error messages, else the value's repr."""
    return str(list(value.shape)) if isinstance(value, torch.Tensor) else repr(value)


def check_confidence(confidence: object) -> None:
    """A confidence level in (0, 1)."""
    check_number("confidence", confidence, minimum=0.0, maximum=1.0, inclusive=False, why=", e.g. 0.95")


def check_table(name: str, table: object) -> None:
    """A floating-point ``[V, h]`` tensor with at least one row."""
    if not isinstance(table, torch.Tensor) or table.dim() != 2 or not table.is_floating_point() or table.size(0) == 0:
        raise ValueError(f"{name} has shape {shape_of(table)}: expected a floating-point [V, h] tensor with V >= 1.")


def check_token_ids(token_ids: object, vocab_size: int) -> None:
    """An integer ``[b, s]`` tensor of ids in ``[0, vocab_size)``."""
    if not isinstance(token_ids, torch.Tensor) or token_ids.dim() != 2 or token_ids.dtype not in INTEGER_DTYPES:
        raise ValueError(f"token_ids has shape {shape_of(token_ids)}: expected an integer [b, s] tensor.")
    if token_ids.numel() and (int(token_ids.min()) < 0 or int(token_ids.max()) >= vocab_size):
        raise ValueError(
            f"token_ids has values in [{int(token_ids.min())}, {int(token_ids.max())}]: expected ids in "
            f"[0, {vocab_size - 1}] (the embedding table's rows)."
        )


def check_masks(token_ids: torch.Tensor, **masks: torch.Tensor | None) -> None:
    """Each given mask has ``token_ids``'s shape."""
    for name, mask in masks.items():
        if mask is not None and (not isinstance(mask, torch.Tensor) or mask.shape != token_ids.shape):
            raise ValueError(f"{name} has shape {shape_of(mask)}: expected token_ids's shape {shape_of(token_ids)}.")


def check_search_args(
    queries: object,
    table: object,
    *,
    top_k: int,
    vocab_chunk: int,
    query_chunk: int,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Queries ``[N, h]`` on the table's device, and valid ``top_k`` and chunk sizes."""
    check_table("table", table)
    if not isinstance(queries, torch.Tensor) or queries.dim() != 2 or queries.size(1) != table.size(1):
        raise ValueError(
            f"noised has shape {shape_of(queries)}: expected [N, h] with h = the table's hidden size {table.size(1)}."
        )
    if queries.device != table.device:
        raise ValueError(f"noised is on {queries.device} and table on {table.device}: expected one device.")
    sharded = group is not None and dist.get_world_size(group) > 1
    check_int("top_k", top_k, minimum=1, maximum=None if sharded else table.size(0))
    check_int("vocab_chunk", vocab_chunk, minimum=1)
    check_int("query_chunk", query_chunk, minimum=1)
