"""The clean teacher under pipeline parallelism: its hidden state rides along the student's own pipeline schedule.

Under pipeline parallelism each student model chunk carries a teacher copy of that chunk, so the teacher's logits
exist only after the teacher's hidden state has passed through every stage. ``distillation_forward_step`` uses this
module for ``pipeline_model_parallel_size > 1`` (interleaved or not, normal path or fine-grained schedule plan):

- in the forward step of (model chunk c, microbatch m), after the student's forward, ``PipelineTeacherStep.run``
  receives the teacher's hidden state for m from the previous stage (unless c embeds the tokens), runs the teacher
  chunk on it under ``no_grad`` and sends the result to the next stage, on a process group of its own with the
  pipeline group's ranks (``TeacherPipe``);
- the chunk that holds the output layer keeps only the received ``[s, b, h]`` hidden state and runs its teacher
  chunk + output layer when the student's loss for m is computed (``PipelineTeacherStep.logits``), so the
  ``[b, s, V]`` teacher logits live only inside that one loss call.

Each microbatch costs exactly one teacher forward of every layer; nothing of the teacher is kept across the
schedule besides the sends still in flight. The sends and receives pair up without tags: Megatron's schedules run
the forward steps of every pipeline rank in the same (chunk, microbatch) order, and a stage's forward step for m
starts only after the previous stage's forward step for m (the student's activation it waits for is sent after it),
so the teacher's send for m has always been posted when its receive runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.utils import unwrap_model
from torch import nn

__all__ = [
    "PipelineTeacherStep",
    "TeacherPipe",
    "attach_teacher_pipe",
    "attached_teacher_pipe",
    "build_teacher_pipes",
    "lazy_teacher_logits",
]

_PIPE = "_nemo_noise_teacher_pipe"


class TeacherPipe:
    """Point-to-point channel for the teacher's hidden states between neighbouring stages of one pipeline group.

    ``group`` has exactly the ranks of ``pp_group`` (a communicator of its own, so its messages never pair up with
    the student's). The next stage of the last rank is the first rank (interleaved schedules wrap around). Sends
    are asynchronous; each keeps its tensor alive until completed, and finished ones are dropped at the next send.
    """

    def __init__(self, group: dist.ProcessGroup, pp_group: dist.ProcessGroup) -> None:
        ranks = dist.get_process_group_ranks(pp_group)
        if sorted(dist.get_process_group_ranks(group)) != sorted(ranks):
            raise ValueError(f"TeacherPipe: group ranks {dist.get_process_group_ranks(group)} != pipeline {ranks}.")
        position = ranks.index(dist.get_rank())
        self.group = group
        self.next_rank = ranks[(position + 1) % len(ranks)]
        self.previous_rank = ranks[(position - 1) % len(ranks)]
        self.in_flight: list[tuple[Any, torch.Tensor]] = []

    def send(self, hidden: torch.Tensor) -> None:
        """Start sending ``hidden`` to the next stage (returns at once)."""
        self.in_flight = [(work, tensor) for work, tensor in self.in_flight if not work.is_completed()]
        hidden = hidden.contiguous()
        self.in_flight.append((dist.isend(hidden, dst=self.next_rank, group=self.group), hidden))

    def receive(self, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The next hidden state the previous stage sent (in send order)."""
        buffer = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(buffer, src=self.previous_rank, group=self.group)
        return buffer

    def wait_all(self) -> None:
        """Block until every send has completed (tests and shutdown)."""
        for work, _ in self.in_flight:
            work.wait()
        self.in_flight.clear()


def build_teacher_pipes(pp_group: dist.ProcessGroup) -> TeacherPipe:
    """This rank's ``TeacherPipe``; collective over the whole world (every rank must call it, once per model).

    Every rank learns every pipeline group's ranks and creates one new group per pipeline group, in the same order
    on all ranks, as ``torch.distributed.new_group`` requires.
    """
    mine = dist.get_process_group_ranks(pp_group)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    own_group = None
    for ranks in sorted({tuple(ranks) for ranks in gathered}):
        group = dist.new_group(list(ranks))
        if tuple(mine) == ranks:
            own_group = group
    return TeacherPipe(own_group, pp_group)


def attach_teacher_pipe(student: nn.Module, pipe: TeacherPipe) -> None:
    """Keep ``pipe`` with the (unwrapped) student chunk, outside its module tree."""
    object.__setattr__(unwrap_model(student), _PIPE, pipe)


def attached_teacher_pipe(student: nn.Module) -> TeacherPipe | None:
    """The pipe kept with this student chunk, or None (no pipeline parallelism)."""
    return unwrap_model(student).__dict__.get(_PIPE)


class PipelineTeacherStep:
    """The teacher's share of one (model chunk, microbatch) forward step under pipeline parallelism.

    ``run`` does the chunk's teacher work in the forward step; on the chunk with the output layer it only keeps the
    received hidden state, and ``logits`` (called by the loss) finishes the teacher's forward there and drops it.

    Args:
        teacher: the teacher copy of this chunk (frozen, eval mode).
        pipe: this rank's ``TeacherPipe``.
        inputs: the model inputs Bridge's batch gave this chunk (``input_ids``, ``position_ids``,
            ``attention_mask``, optionally ``packed_seq_params``), the same the student chunk ran on.
        student_input: the hidden state the schedule handed the student chunk (its shape is the teacher's too);
            None on the chunk that embeds the tokens.
        pipeline_dtype: the dtype of the pipeline's messages (``config.pipeline_dtype``).
    """

    def __init__(
        self,
        teacher: nn.Module,
        pipe: TeacherPipe,
        inputs: dict[str, Any],
        student_input: torch.Tensor | None,
        pipeline_dtype: torch.dtype,
    ) -> None:
        self.teacher, self.pipe, self.inputs = teacher, pipe, inputs
        self.student_input, self.pipeline_dtype = student_input, pipeline_dtype
        self.received: torch.Tensor | None = None

    @property
    def holds_output_layer(self) -> bool:
        """Whether this chunk computes the logits (the last virtual stage of the last pipeline rank)."""
        return bool(self.teacher.post_process)

    def run(self) -> None:
        """Receive (unless this chunk embeds the tokens), then run the chunk and send, or keep the input (loss)."""
        if not self.teacher.pre_process:
            if self.student_input is None:
                raise RuntimeError("pipeline teacher: the schedule gave this model chunk no input tensor.")
            self.received = self.pipe.receive(self.student_input.shape, self.pipeline_dtype, self.student_input.device)
        if self.holds_output_layer:
            return
        with torch.no_grad():
            hidden = self._forward()
        self.pipe.send(hidden.to(self.pipeline_dtype))

    def logits(self) -> torch.Tensor:
        """The teacher's logits for this microbatch (the chunk with the output layer only); runs its forward now."""
        if not self.holds_output_layer:
            raise RuntimeError("pipeline teacher: logits exist only on the chunk that holds the output layer.")
        with torch.no_grad():
            logits = self._forward()
        self.received = None  # one use: the hidden state is not kept past the loss
        return logits

    def _forward(self) -> torch.Tensor:
        self.teacher.set_input_tensor(self.received)  # None on the embedding chunk: the model embeds the tokens
        try:
            return self.teacher(**self.inputs)
        finally:
            self.teacher.set_input_tensor(None)


def lazy_teacher_logits(source: torch.Tensor | Callable[[], torch.Tensor] | None) -> torch.Tensor | None:
    """Teacher logits given either as a tensor or as a function computing them on demand (``logits``)."""
    return source() if callable(source) else source
