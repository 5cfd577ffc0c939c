"""Megatron-Bridge forward steps: noisy fine-tuning, and noisy-student / clean-teacher distillation.

Both wrap Bridge's own GPT step (``megatron.bridge.training.gpt_step``: batch fetch, CP slicing, packed sequences,
timers) and add what the plugin needs around it:

- the noise clock follows Bridge's ``train_state.step`` (restored on resume), so the noise of an iteration does
  not depend on restarts;
- the noise layer sees the batch's loss mask, which Bridge fetches only on the last pipeline stage and does not pass
  to the model, so ``true_length`` scaling and prompt/response selection work on the first stage too, and the
  batch's ``private_mask`` when it has one (``tokens='spans'``, ``data.span_dataset``), CP-sliced like the tokens;
- ``distillation_forward_step`` runs the clean teacher under ``no_grad`` on the same batch, once per microbatch,
  outside the student's autograd graph, and returns the combined CE + KD loss with its parts for logging. The
  teacher's logits live only in the loss function's closure, freed when the schedule drops it after the loss.
  Under pipeline parallelism each chunk runs its teacher chunk in its forward step and passes the teacher's hidden
  state to the next stage; the last chunk runs its teacher chunk and output layer inside the loss
  (``nemo_noise_plugin.distillation.pipeline_teacher``).
  Under the fine-grained schedule plan (``return_schedule_plan=True``) the loss is computed inside the plan's
  post-process node instead (``nemo_noise_plugin.distillation.plan_loss``), where its gradient can leave.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from functools import partial
from typing import Any

import torch
from megatron.core.utils import unwrap_model

from nemo_noise_plugin.model.mixin import NoiseInjectionMixin
from nemo_noise_plugin.noise.layer import NoiseBatchInputs
from nemo_noise_plugin.upstream.bridge_imports import import_bridge

__all__ = ["distillation_forward_step", "noise_forward_step", "sync_noise_clock"]


def sync_noise_clock(model: torch.nn.Module, iteration: int) -> None:
    """Point a noisy chunk's clock at ``iteration`` unless it is already there (keeps the microbatch count).

    A chunk with replayable noise keys (built for a full-iteration CUDA graph) must have had them published for
    ``iteration`` before the step (``training.noise_step_publisher.PublishNoiseStep``): the graph's replays do not run
    this function, so without the callback every replayed step would add the captured step's noise. A clear
    ``RuntimeError`` otherwise, at the first (eager) step."""
    inner = unwrap_model(model)
    if not isinstance(inner, NoiseInjectionMixin) or not inner.training:
        return
    replayable = inner.noise_layer.replayable_step
    if replayable is not None and replayable.published != iteration:
        raise RuntimeError(
            f"the noise keys of step {iteration} were not published before it (they hold step "
            f"{replayable.published}): a model built for cuda_graph_impl='full_iteration' needs "
            "nemo_noise_plugin.training.noise_step_publisher.PublishNoiseStep() in Bridge's callbacks (the plugin's "
            "launchers add it)."
        )
    if inner.noise_clock.iteration != iteration:
        inner.noise_clock.start_iteration(iteration)


class _CapturingBatch:
    """Bridge's ``get_batch`` that also keeps the batch for the plugin (loss mask on every stage, labels).

    Use as a context manager around the step's forward: for a noisy chunk it opens the model's
    ``noise_batch_inputs`` block and fills in the loss mask once Bridge has fetched the batch.
    """

    def __init__(self, model: torch.nn.Module, strip_labels: bool) -> None:
        inner = unwrap_model(model)
        self.noisy = inner if isinstance(inner, NoiseInjectionMixin) else None
        self.strip_labels = strip_labels
        self.tokens = self.labels = self.loss_mask = self.attention_mask = self.position_ids = None
        self.packed_seq_metadata: dict[str, Any] | None = None
        self.noise_inputs: NoiseBatchInputs | None = None
        self._block: contextlib.ExitStack | None = None

    def __enter__(self) -> _CapturingBatch:
        self._block = contextlib.ExitStack()
        if self.noisy is not None:
            self.noise_inputs = self._block.enter_context(self.noisy.noise_batch_inputs())
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._block.close()

    def __call__(self, data_iterator: Iterable, cfg: Any, use_mtp: bool = False, *, pg_collection, vp_stage=None):
        gpt_step = import_bridge("megatron.bridge.training.gpt_step")
        recorder = _RecordingIterator(data_iterator)
        batch = gpt_step.get_batch(recorder, cfg, use_mtp, pg_collection=pg_collection, vp_stage=vp_stage)
        self.tokens, self.labels, self.loss_mask, self.attention_mask, self.position_ids, self.packed_seq_metadata = (
            batch
        )
        if self.noise_inputs is not None:  # read by the noisy forward that follows
            loss_mask = self.loss_mask
            if loss_mask is None and recorder.raw is not None and recorder.raw.get("loss_mask") is not None:
                loss_mask = _on_this_cp_rank(recorder.raw, "loss_mask", pg_collection)
            self.noise_inputs.loss_mask = loss_mask
            if recorder.raw is not None and recorder.raw.get("private_mask") is not None:  # tokens='spans'
                self.noise_inputs.private_mask = _on_this_cp_rank(recorder.raw, "private_mask", pg_collection)
        if self.strip_labels:  # the model then returns logits, which the distillation loss needs
            return (self.tokens, None, *batch[2:])
        return batch


class _RecordingIterator(Iterator):
    """Passes one batch through and remembers it (before Bridge drops the keys this stage does not need)."""

    def __init__(self, source: Iterable) -> None:
        self.source = source
        self.raw: dict[str, Any] | None = None

    def __next__(self) -> dict[str, Any]:
        self.raw = next(self.source)
        return self.raw if not isinstance(self.raw, dict) else dict(self.raw)


def _on_this_cp_rank(raw: dict[str, Any], key: str, pg_collection: Any) -> torch.Tensor:
    """A ``[b, s]`` batch entry (loss mask, private mask) sliced for this context-parallel rank as Bridge slices the
    tokens (zig-zag, or per packed sequence), on the device the tokens go to."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    gpt_step = import_bridge("megatron.bridge.training.gpt_step")
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    batch = {name: raw.get(name) for name in (key, "cu_seqlens_q", "cu_seqlens_q_padded", "cu_seqlens")}
    batch[key] = batch[key].to(device)
    batch = {name: value for name, value in batch.items() if value is not None}
    if gpt_step._has_packed_sequence_metadata(batch) and pg_collection.cp.size() > 1:
        return gpt_step._partition_packed_batch_for_cp(batch, pg_collection.cp)[key]
    return get_batch_on_this_cp_rank({key: batch[key]}, is_hybrid_cp=False, cp_group=pg_collection.cp)[key]


def noise_forward_step(
    state: Any, data_iterator: Iterable, model: torch.nn.Module, return_schedule_plan: bool = False
) -> tuple[torch.Tensor, partial]:
    """Bridge's GPT forward step for a noisy model: same batch, loss and logging, plus the noise clock and mask.

    Args:
        state: Bridge's ``GlobalState`` (its train state's step drives the noise schedule and the noise stream).
        data_iterator: the batch iterator Bridge's loop passes in.
        model: a model chunk built by ``NoisyGPTModelProvider`` (or made noisy with ``make_noisy``).
        return_schedule_plan: build the fine-grained schedule plan (MoE A2A overlap) instead of running the forward.

    Returns:
        The output tensor (or schedule plan) and the loss function, as Bridge's ``forward_step`` returns them.

    Example::

        pretrain(tiny_noise_sft_config(), forward_step_func=noise_forward_step)
    """
    gpt_step = import_bridge("megatron.bridge.training.gpt_step")
    sync_noise_clock(model, state.train_state.step)
    with _CapturingBatch(model, strip_labels=False) as capture:
        output, loss_mask = gpt_step._forward_step_common(
            state, data_iterator, model, return_schedule_plan, _get_batch_fn=capture
        )
    loss_function = gpt_step._create_loss_function(
        loss_mask,
        check_for_nan_in_loss=state.cfg.rerun_state_machine.check_for_nan_in_loss,
        check_for_spiky_loss=state.cfg.rerun_state_machine.check_for_spiky_loss,
    )
    return output, loss_function


def distillation_forward_step(
    state: Any, data_iterator: Iterable, model: torch.nn.Module, return_schedule_plan: bool = False
) -> tuple[torch.Tensor, partial]:
    """Noisy student + clean teacher: returns the student's logits and the combined CE + KD loss function.

    The model chunk must come from ``NoisyDistillationProvider`` (it carries the teacher). The loss function returns
    Bridge's ``(loss_sum, num_tokens, report)`` with ``lm loss``, ``kd loss``, ``hidden loss`` and ``total loss``.

    Args:
        state: Bridge's ``GlobalState``.
        data_iterator: the batch iterator Bridge's loop passes in.
        model: a model chunk built by ``NoisyDistillationProvider``.
        return_schedule_plan: build the fine-grained schedule plan, the teacher's forward included.

    Returns:
        The student's output tensor (or schedule plan) and the CE + KD loss function.

    Example::

        pretrain(tiny_noise_distillation_config(), forward_step_func=distillation_forward_step)
    """
    from nemo_noise_plugin.distillation.losses import combined_distillation_loss
    from nemo_noise_plugin.distillation.teacher_weights import ready_teacher

    gpt_step = import_bridge("megatron.bridge.training.gpt_step")
    inner = unwrap_model(model)
    kd_config = inner.config.kd if hasattr(inner.config, "kd") else None
    if kd_config is None:
        raise TypeError(
            "distillation_forward_step needs a model built by NoisyDistillationProvider (its config has no 'kd')."
        )
    teacher = ready_teacher(state, model) if kd_config.enabled else None
    sync_noise_clock(model, state.train_state.step)
    if return_schedule_plan:
        return _distillation_schedule_plan(state, data_iterator, model, inner, kd_config, teacher, gpt_step)
    hidden = _HiddenStateCapture(inner, teacher, kd_config.hidden_layers if kd_config.hidden_loss != "none" else [])
    with _CapturingBatch(model, strip_labels=True) as capture, hidden.student():
        student_logits, loss_mask = gpt_step._forward_step_common(state, data_iterator, model, _get_batch_fn=capture)
    teacher_logits = None
    pipeline_step = _pipeline_teacher_step(model, inner, teacher, capture, gpt_step)
    if pipeline_step is not None:  # pipeline parallel: the teacher's hidden state rides along the schedule
        pipeline_step.run()
        if pipeline_step.holds_output_layer and kd_config.kd_weight > 0:
            teacher_logits = pipeline_step.logits  # run when the loss is computed
    elif teacher is not None and student_logits is not None and (kd_config.kd_weight > 0 or hidden.layers):
        with torch.no_grad(), hidden.teacher():
            teacher_logits = teacher(**_teacher_inputs(capture, gpt_step))
    loss_function = partial(
        _distillation_loss,
        combined_distillation_loss,
        kd_config,
        loss_mask,
        capture.labels,
        teacher_logits,
        hidden,
        inner,
    )
    return student_logits, loss_function


def _distillation_schedule_plan(state, data_iterator, model, inner, kd_config, teacher, gpt_step):
    """The plan path: the student's plan computes CE + KD in its post-process node from the teacher's logits.

    The teacher runs here, under ``no_grad`` and before the plan does; its logits reach the loss through the
    post-process node's ``output_processor`` (``nemo_noise_plugin.distillation.plan_loss.DistillationOutputProcessor``).
    """
    from nemo_noise_plugin.distillation.plan_loss import (
        DistillationLossParts,
        DistillationOutputProcessor,
        plan_distillation_loss,
    )

    if kd_config.hidden_loss != "none":
        raise ValueError(
            f"KDConfig.hidden_loss={kd_config.hidden_loss!r} is not supported under the fine-grained schedule plan "
            "(overlap_moe_expert_parallel_comm); use hidden_loss=none."
        )
    with _CapturingBatch(model, strip_labels=False) as capture:
        plan, loss_mask = gpt_step._forward_step_common(
            state, data_iterator, model, return_schedule_plan=True, _get_batch_fn=capture
        )
    teacher_logits = None
    pipeline_step = _pipeline_teacher_step(model, inner, teacher, capture, gpt_step)
    if pipeline_step is not None:  # pipeline parallel: the teacher's hidden state rides along the schedule
        pipeline_step.run()
        if pipeline_step.holds_output_layer and kd_config.kd_weight > 0:
            teacher_logits = pipeline_step.logits  # run inside the post-process node, when the loss is computed
    elif teacher is not None and kd_config.kd_weight > 0:
        with torch.no_grad():
            teacher_logits = teacher(**_teacher_inputs(capture, gpt_step))
    parts = DistillationLossParts()
    plan.state.output_processor = DistillationOutputProcessor(
        kd_config,
        teacher_logits,
        loss_mask,
        capture.labels,
        inner.pg_collection.tp,
        bool(inner.config.sequence_parallel),
    )
    plan.state.output_processor_context = parts
    return plan, partial(plan_distillation_loss, parts)


def _pipeline_teacher_step(model, inner, teacher, capture, gpt_step):
    """The teacher's share of this forward step under pipeline parallelism (``distillation.pipeline_teacher``)."""
    from nemo_noise_plugin.distillation.pipeline_teacher import PipelineTeacherStep, attached_teacher_pipe

    pipe = attached_teacher_pipe(model) if teacher is not None else None
    if pipe is None:
        return None
    return PipelineTeacherStep(
        teacher,
        pipe,
        _teacher_inputs(capture, gpt_step),
        getattr(inner.decoder, "input_tensor", None),
        inner.config.pipeline_dtype or next(inner.parameters()).dtype,
    )


def _teacher_inputs(capture: _CapturingBatch, gpt_step: Any) -> dict[str, Any]:
    inputs = {
        "input_ids": capture.tokens,
        "position_ids": capture.position_ids,
        "attention_mask": capture.attention_mask,
    }
    if capture.packed_seq_metadata is not None:
        inputs["packed_seq_params"] = gpt_step.get_packed_seq_params(capture.packed_seq_metadata)
    return inputs


def _distillation_loss(
    combined_distillation_loss, kd_config, loss_mask, labels, teacher_logits, hidden, inner, student_logits
):
    if callable(teacher_logits):  # pipeline parallel: the teacher's last chunk runs now, under no_grad
        teacher_logits = teacher_logits()
    result = combined_distillation_loss(
        kd_config,
        student_logits,
        teacher_logits,
        loss_mask,
        labels=labels,
        hidden_pairs=hidden.pairs(),
        tp_group=inner.pg_collection.tp,
        sequence_parallel=bool(inner.config.sequence_parallel),
    )
    hidden.clear()
    return result.bridge_outputs()


class _HiddenStateCapture:
    """Forward hooks that keep the outputs of the chosen decoder layers of the student and the teacher."""

    def __init__(self, student: torch.nn.Module, teacher: torch.nn.Module | None, layers: list[int]) -> None:
        self.student_model, self.teacher_model, self.layers = student, teacher, list(layers)
        self.student_outputs: dict[int, torch.Tensor] = {}
        self.teacher_outputs: dict[int, torch.Tensor] = {}

    @contextlib.contextmanager
    def _hooks(self, model: torch.nn.Module | None, outputs: dict[int, torch.Tensor]) -> Iterator[None]:
        handles = []
        if model is not None:
            for index in self.layers:
                layer = model.decoder.layers[index]
                handles.append(layer.register_forward_hook(partial(self._keep, outputs, index)))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    @staticmethod
    def _keep(outputs: dict[int, torch.Tensor], index: int, module, args, output) -> None:
        outputs[index] = output[0] if isinstance(output, tuple) else output

    def student(self):
        return self._hooks(self.student_model, self.student_outputs)

    def teacher(self):
        return self._hooks(self.teacher_model, self.teacher_outputs)

    def pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(self.student_outputs[i], self.teacher_outputs[i]) for i in self.layers]

    def clear(self) -> None:
        self.student_outputs.clear()
        self.teacher_outputs.clear()
