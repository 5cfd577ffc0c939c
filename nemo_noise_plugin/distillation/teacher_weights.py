"""Getting the right weights into the clean teacher under Megatron-Bridge, for every loading route.

Bridge loads a student's weights at two different moments: HF weights (AutoBridge providers) in a pre-wrap hook
while the model is built, and a Megatron ``pretrained_checkpoint`` or a resume checkpoint after it is built and
wrapped (``setup()``). So the teacher is made in two steps:

1. ``NoisyDistillationProvider.provide_distributed_model`` snapshots the wrapped student (HF or initial weights);
2. the first ``distillation_forward_step`` call settles it, after every load has happened:
   - with ``teacher_checkpoint`` set on the provider (a clean fine-tuned model, say), the teacher is loaded from
     it (Megatron or HF format), at iteration 0 and after a resume alike;
   - at iteration 0 the student has not trained yet and holds exactly the weights to distil from (pretrained
     checkpoint, HF or initial): they are copied into the teacher;
   - after a resume the student holds fine-tuned weights, so the teacher is reloaded from
     ``checkpoint.pretrained_checkpoint`` (Megatron or HF format) when one is configured, and otherwise keeps the
     snapshot (HF weights, or the seeded initialisation the run started from).

The teacher lives outside the student's module tree (not a submodule), so checkpoints, the optimizer, DDP's
buffers, ``model.train()`` and HF export never see it.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from megatron.core.utils import unwrap_model
from torch import nn

from nemo_noise_plugin.distillation.teacher import ATTACHED_TEACHER_ATTRIBUTE as _TEACHER
from nemo_noise_plugin.upstream.bridge_imports import import_bridge

_SETTLED = "_nemo_noise_clean_teacher_settled"


def attach_teacher(student: nn.Module, teacher: nn.Module) -> None:
    """Keep ``teacher`` with the (unwrapped) student chunk without registering it as a submodule."""
    inner = unwrap_model(student)
    object.__setattr__(inner, _TEACHER, teacher)
    object.__setattr__(inner, _SETTLED, False)


def attached_teacher(student: nn.Module) -> nn.Module | None:
    """The teacher kept with this student chunk, or None."""
    return unwrap_model(student).__dict__.get(_TEACHER)


def copy_student_into_teacher(student: nn.Module, teacher: nn.Module) -> None:
    """Overwrite the teacher's parameters and buffers with the student's current values, in place."""
    source = unwrap_model(student).state_dict(keep_vars=True)
    with torch.no_grad():
        for name, tensor in teacher.state_dict(keep_vars=True).items():
            if isinstance(tensor, torch.Tensor) and name in source and tensor is not source[name]:
                tensor.copy_(source[name])


def load_weights(module: nn.Module, weights: dict[str, torch.Tensor], what: str) -> None:
    """``module.load_state_dict(weights)``, where only Transformer Engine's ``_extra_state`` entries may be missing;
    ``RuntimeError`` naming ``what`` otherwise."""
    missing, unexpected = module.load_state_dict(weights, strict=False)
    if unexpected or [name for name in missing if not name.endswith("_extra_state")]:
        raise RuntimeError(f"{what} do not fit this model: missing {missing[:5]}, unexpected {unexpected[:5]}")


def settle_teacher_from(student: nn.Module, weights: dict[str, torch.Tensor]) -> bool:
    """Load ``weights`` (a state dict of the student's architecture) into the chunk's teacher and mark it settled;
    False when the chunk has no teacher. For a resumed run whose start weights are known (the main job's clean
    pre-training): the weights the teacher was copied from at iteration 0."""
    inner = unwrap_model(student)
    teacher = inner.__dict__.get(_TEACHER)
    if teacher is None:
        return False
    load_weights(teacher, weights, "the teacher's start weights")
    object.__setattr__(inner, _SETTLED, True)
    return True


def ready_teacher(state: Any, model: nn.Module) -> nn.Module:
    """The chunk's teacher with settled weights (see the module docstring); settles it on the first call."""
    inner = unwrap_model(model)
    teacher = inner.__dict__.get(_TEACHER)
    if teacher is None:
        raise ValueError(
            "this model chunk has no clean teacher: build it with NoisyDistillationProvider "
            "(provide_distributed_model attaches the teacher)."
        )
    if not inner.__dict__.get(_SETTLED):
        settle_teacher_weights(state, inner, teacher)
        object.__setattr__(inner, _SETTLED, True)
    teacher.eval()
    return teacher


def check_teacher_checkpoint(path: object) -> None:
    """``teacher_checkpoint`` is None or an existing folder; ``ValueError`` naming the setting otherwise."""
    if path is None:
        return
    if not isinstance(path, str | os.PathLike) or not str(path).strip():
        raise ValueError(
            f"NoisyDistillationProvider.teacher_checkpoint={path!r} is invalid: expected None or the path of a "
            "Megatron checkpoint folder (a run's checkpoints/ or one iter_* folder) or a Hugging Face model folder."
        )
    if not os.path.isdir(path):
        raise ValueError(
            f"NoisyDistillationProvider.teacher_checkpoint={os.fspath(path)!r} is invalid: no such folder (expected a "
            "Megatron checkpoint folder, a run's checkpoints/ or one iter_* folder, or a Hugging Face model folder)."
        )


def settle_teacher_weights(state: Any, student: nn.Module, teacher: nn.Module) -> str:
    """Give the teacher the weights to distil from; returns where they came from (for the log)."""
    given = getattr(state.cfg.model, "teacher_checkpoint", None)
    if given is not None:
        return load_teacher_weights(state, teacher, os.fspath(given), "model.teacher_checkpoint")
    if state.train_state.step == 0:
        copy_student_into_teacher(student, teacher)
        return "student at iteration 0"
    pretrained = getattr(state.cfg.checkpoint, "pretrained_checkpoint", None)
    if pretrained is None:
        return "snapshot taken when the model was built (HF or initial weights)"
    return load_teacher_weights(state, teacher, pretrained, "checkpoint.pretrained_checkpoint")


def load_teacher_weights(state: Any, teacher: nn.Module, path: str, setting: str) -> str:
    """Load the weights at ``path`` (HF folder or Megatron checkpoint) into ``teacher``; returns their source."""
    checkpointing = import_bridge("megatron.bridge.training.checkpointing")
    if checkpointing.is_hf_checkpoint_dir(path):
        bridge = checkpointing._build_auto_bridge_for_save(state.cfg, hf_source=path)
        bridge.load_hf_weights([teacher], hf_path=path)
        return f"HF checkpoint {path}"
    iteration_dir = _iteration_dir(checkpointing, path, setting)
    checkpointing._load_model_weights_from_checkpoint(
        iteration_dir, [teacher], dist_ckpt_strictness=state.cfg.checkpoint.dist_ckpt_strictness
    )
    return f"Megatron checkpoint {iteration_dir}"


def _iteration_dir(checkpointing: Any, base: str, setting: str = "checkpoint.pretrained_checkpoint") -> str:
    iteration, release = checkpointing._resolve_checkpoint_iteration(base, None)
    if iteration == -1:
        raise FileNotFoundError(f"{setting}={base!r}: no checkpoint found there.")
    if iteration == getattr(checkpointing, "_DIRECT_ITERATION_DIR_SENTINEL", object()):
        return base
    return os.fspath(checkpointing.get_checkpoint_name(base, iteration, release=release))
