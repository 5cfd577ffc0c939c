"""The clean teacher: a frozen copy of the student's own (pretrained) weights that never carries noise.

Built from the student *after* its weights are loaded (a copy taken earlier holds random weights). The copy shares
the student's process groups, CUDA streams and ``TransformerConfig`` (under Bridge, the provider), never copies gradient
buffers that data-parallel wrappers attach to parameters (``main_grad`` views into DDP's buffer, ``.grad``), is
frozen and in eval mode, and is a plain model: the noise mixin is removed. With ``share_frozen_modules`` the
student's already-frozen submodules (e.g. a frozen embedding or output layer) are shared instead of copied, which
saves their memory; the teacher then sees the student's values for them, which is exact because they never change.

Memory: a full copy costs one more set of model weights in the training dtype (2 bytes per parameter in bf16) and
no gradients or optimizer state; shared frozen modules cost nothing.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from nemo_noise_plugin.model.make_noisy import make_plain
from nemo_noise_plugin.utils import freeze_module, process_group_memo

ATTACHED_TEACHER_ATTRIBUTE = "_nemo_noise_clean_teacher"
"""Where ``teacher_weights.attach_teacher`` keeps a student chunk's teacher (outside its module tree)."""

_DATA_PARALLEL_PARAMETER_ATTRIBUTES = ("main_grad", "grad_added_to_main_grad")


def frozen_submodules(module: nn.Module) -> list[nn.Module]:
    """The outermost submodules whose parameters are all frozen (and which have parameters)."""
    found: list[nn.Module] = []

    def visit(child: nn.Module) -> None:
        parameters = list(child.parameters())
        if parameters and not any(p.requires_grad for p in parameters):
            found.append(child)
            return
        for grandchild in child.children():
            visit(grandchild)

    for child in module.children():
        visit(child)
    return found


def build_clean_teacher(student: nn.Module, *, share_frozen_modules: bool = False) -> nn.Module:
    """A frozen, clean, eval-mode copy of ``student`` (unwrapped from DDP/``Float16Module``) for distillation.

    Args:
        student: the student model chunk, after its weights were loaded; wrapped or not.
        share_frozen_modules: share the student's fully frozen submodules instead of copying them.

    Returns:
        The teacher: same architecture and weights, no noise, every parameter ``requires_grad=False``.
    """
    from megatron.core.utils import unwrap_model

    inner = unwrap_model(student)
    memo: dict[int, Any] = process_group_memo(inner)
    # Bridge's modules hold the provider as their config, and after setup the provider references the optimizer
    # and DDP: share it (it is read-only to a frozen forward) instead of copying all of that.
    config = getattr(inner, "config", None)
    if config is not None:
        memo[id(config)] = config
    for parameter in inner.parameters():
        if parameter.grad is not None:
            memo[id(parameter.grad)] = None
        for name in _DATA_PARALLEL_PARAMETER_ATTRIBUTES:
            value = getattr(parameter, name, None)
            if isinstance(value, torch.Tensor):
                memo[id(value)] = None
    attached = inner.__dict__.get(ATTACHED_TEACHER_ATTRIBUTE)
    if attached is not None:  # a teacher kept with the student is not part of it
        memo[id(attached)] = None
    if share_frozen_modules:
        for module in frozen_submodules(inner):
            memo[id(module)] = module
    teacher = copy.deepcopy(inner, memo)
    for parameter in teacher.parameters():
        parameter.grad = None
        for name in _DATA_PARALLEL_PARAMETER_ATTRIBUTES:
            if name in parameter.__dict__:
                delattr(parameter, name)
    make_plain(teacher)
    freeze_module(teacher)
    teacher.eval()
    return teacher
