"""Utilities for the Megatron noise-training integration.

Helpers shared across the Megatron noise layer, noisy model, and distillation provider:

- ``deepcopy_module_with_process_groups``: deep-copy an MCore module while sharing (not copying) its process
  groups and CUDA streams, which are not copyable.
- ``freeze_module``: disable gradients on every parameter of a module.
- ``should_attach_noise``: decide whether the current pipeline stage should carry the noise layer (only the first
  pipeline stage does).
- ``group_rank`` / ``group_size``: a process's rank in, and the size of, an optional process group.

Only ``should_attach_noise`` needs the Megatron runtime; it imports ``megatron.core`` lazily so the copy/freeze
helpers remain importable (and testable) without the NeMo container.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
from torch import nn

__all__ = [
    "deepcopy_module_with_process_groups",
    "freeze_module",
    "group_rank",
    "group_size",
    "should_attach_noise",
]

# Leaf types whose contents cannot hold a process group; skipping them keeps the walk cheap.
_ATOMIC_TYPES = (str, bytes, int, float, bool, complex, type(None), torch.dtype, torch.device, torch.Size)


def _shared_object_types() -> tuple[type, ...]:
    """Types that must be shared between a module and its copy rather than copied."""
    shared: list[type] = [torch.distributed.ProcessGroup]
    if hasattr(torch.cuda, "Stream"):
        shared.append(torch.cuda.Stream)
    try:  # optional: megatron-core may be absent where only the copy/freeze helpers are used
        from megatron.core.process_groups_config import ProcessGroupCollection
    except ImportError:
        pass
    else:
        shared.append(ProcessGroupCollection)
    return tuple(shared)


def _collect_shared_objects(root: Any, shared_types: tuple[type, ...]) -> list[Any]:
    """Every object of ``shared_types`` reachable from ``root`` through attributes and containers."""
    found: list[Any] = []
    seen: set[int] = set()
    stack: list[Any] = [root]
    while stack:
        obj = stack.pop()
        if isinstance(obj, _ATOMIC_TYPES) or isinstance(obj, torch.Tensor) or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, shared_types):
            found.append(obj)
            continue
        if isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif isinstance(obj, nn.Module):
            # Parameters and buffers are tensors; only plain attributes and submodules can hold groups.
            stack.extend(v for k, v in vars(obj).items() if k not in ("_parameters", "_buffers"))
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            stack.extend(getattr(obj, f.name, None) for f in dataclasses.fields(obj))
            stack.extend(getattr(obj, "__dict__", {}).values())
        elif hasattr(obj, "__dict__") and not isinstance(obj, type) and not callable(obj):
            stack.extend(vars(obj).values())
    return found


def deepcopy_module_with_process_groups(module: nn.Module) -> nn.Module:
    """Deep-copy an MCore module while sharing its process groups and CUDA streams.

    MCore modules hold references to ``torch.distributed.ProcessGroup`` and ``torch.cuda.Stream`` objects, which
    cannot be deep-copied. This collects those objects (and Megatron ``ProcessGroupCollection`` instances) and
    seeds ``copy.deepcopy``'s memo with them so they are shared with the original rather than copied; every other
    tensor/parameter is copied as usual.

    Args:
        module: The module to copy (e.g. an MCore transformer decoder block).

    Returns:
        A deep copy of ``module`` that shares the original's process groups and CUDA streams.
    """
    return copy.deepcopy(module, process_group_memo(module))


def process_group_memo(module: nn.Module) -> dict[int, Any]:
    """A ``copy.deepcopy`` memo that maps every process group, group collection and CUDA stream to itself."""
    return {id(obj): obj for obj in _collect_shared_objects(module, _shared_object_types())}


def freeze_module(module: nn.Module) -> None:
    """Disable gradient computation for every parameter of ``module`` in place.

    Args:
        module: The module whose parameters should be frozen.
    """
    for param in module.parameters():
        param.requires_grad_(False)


def should_attach_noise(vp_stage: int | None) -> bool:
    """Return whether the current pipeline stage should carry the noise layer.

    The noise layer is attached at the model's embedding, so only the first pipeline stage needs it. When
    distributed state is not initialized (e.g. a single-process build), the answer is always True. With virtual
    pipelining only model chunk ``vp_stage == 0`` of the first pipeline rank carries it, so noise is attached on
    exactly one chunk rather than replicated.

    Args:
        vp_stage: The virtual pipeline stage index, or None when virtual pipeline parallelism is not in use.

    Returns:
        True if the noise layer should be attached on this stage.
    """
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return True
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return True
    virtual_size = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    if virtual_size is not None and vp_stage is None:
        raise ValueError(
            f"should_attach_noise: vp_stage=None but virtual pipeline parallelism is enabled "
            f"(virtual_pipeline_model_parallel_size={virtual_size}); pass the model chunk's vp_stage "
            f"(0..{virtual_size - 1})."
        )
    return parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)


def group_rank(group: torch.distributed.ProcessGroup | None) -> int:
    """This process's rank in ``group``; 0 without a group or without torch.distributed."""
    return torch.distributed.get_rank(group) if group is not None and torch.distributed.is_initialized() else 0


def group_size(group: torch.distributed.ProcessGroup | None) -> int:
    """The size of ``group``; 1 without a group or without torch.distributed."""
    return torch.distributed.get_world_size(group) if group is not None and torch.distributed.is_initialized() else 1
