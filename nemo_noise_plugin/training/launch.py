"""Run a Megatron-Bridge ``ConfigContainer`` with the plugin's forward step: Bridge's training loop, or the CPU loop.

The launcher behind ``nemo llm finetune`` and the main job, and usable from Python::

    from nemo_noise_plugin.training.launch import launch
    from nemo_noise_plugin.recipes import tiny_noise_sft_config

    if __name__ == "__main__":  # Bridge's checkpoint-save workers re-import the launching script
        launch(tiny_noise_sft_config(), ["train.train_iters=100", "model.noise.alpha=10"])

It decides three things from the config, so a recipe only has to return one:

- the overrides: Megatron-Bridge's Hydra path with the plugin's settings re-validated
  (``training.overrides.apply_overrides``): ``key=value`` sets a field, ``+key=value`` adds a key (inside
  dict-valued fields such as ``env_vars``), ``~key`` deletes one (a dataclass field goes back to its default);
- the forward step: ``distillation_forward_step`` for a ``NoisyDistillationProvider``, else ``noise_forward_step``;
- the entry: Bridge's ``finetune`` when ``checkpoint.pretrained_checkpoint`` names weights to start from, else
  ``pretrain`` (the tiny recipes train from scratch on the embedded corpus; both resume from ``checkpoint.load``).

Bridge's loop needs a GPU. Without one, ``launch`` runs the CPU loop when the caller allows it (recipes on the
embedded corpus), else raises ``GPUUnavailableError`` before it imports Bridge or writes anything.

Before either loop starts, ``check_run_settings`` turns the mistakes that Megatron would find only after start-up
(or, for the checkpoint folder, after training) into one ``ValueError`` naming the setting: a ``checkpoint.save``
that cannot be written, a micro batch that does not divide the global batch, a sequence length that differs from the
dataset's. A dataset path with spaces (a run folder such as ``/tmp/my runs``) is kept whole: Bridge splits a
``data_path`` string at whitespace into several datasets. ``saved_checkpoints`` says which checkpoints this process's
runs have on disk (what an interrupt leaves).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from nemo_noise_plugin.bridge_imports import import_bridge, use_prebuilt_dataset_helpers

__all__ = [
    "GPU_REQUIRED_MESSAGE",
    "GPUUnavailableError",
    "check_run_settings",
    "forward_step_for",
    "launch",
    "launch_with_report",
    "require_gpu",
    "saved_checkpoints",
    "training_entry_for",
]

GPU_REQUIRED_MESSAGE = (
    "Bridge's training loop needs a GPU; use --dryrun/--to-yaml, or `python -m nemo_noise_plugin` for the CPU main job"
)


class GPUUnavailableError(RuntimeError):
    """Raised by ``launch`` on a machine where CUDA is not available, before anything else happens."""


def cuda_available() -> bool:
    """Whether a CUDA device is available (the only CUDA call made before Bridge or the CPU loop starts)."""
    import torch

    return torch.cuda.is_available()


def require_gpu() -> None:
    """Raise ``GPUUnavailableError`` unless CUDA is available."""
    if not cuda_available():
        raise GPUUnavailableError(GPU_REQUIRED_MESSAGE)


_BRIDGE_SAVE_FOLDERS: list[Path] = []
"""``checkpoint.save`` of the runs this process started in Bridge's loop (``saved_checkpoints`` looks there)."""


def saved_checkpoints() -> list[str]:
    """The checkpoints of this process's runs that exist on disk now: CPU-loop state files, Bridge's folders."""
    from nemo_noise_plugin.training.cpu_checkpoint import CpuCheckpoint

    found = [str(path) for path in CpuCheckpoint.on_disk()]
    for folder in _BRIDGE_SAVE_FOLDERS:
        tracker = folder / "latest_checkpointed_iteration.txt"  # Bridge writes it after a complete save
        if tracker.is_file():
            found.append(f"{folder} (iteration {tracker.read_text().strip()})")
    return found


def check_run_settings(config: Any) -> None:
    """Check what Megatron would find only after start-up; ``ValueError`` naming the setting, the value and what is
    allowed. Creates ``checkpoint.save`` (checked writable) and keeps a dataset path with spaces whole."""
    import os

    from nemo_noise_plugin.artifacts import check_output_dir

    if config.checkpoint.save:
        check_output_dir(config.checkpoint.save, "checkpoint.save")
    train, model = config.train, config.model
    parallel = 1
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
        parallel *= getattr(model, name, 1) or 1
    data_parallel = max(1, int(os.environ.get("WORLD_SIZE", "1")) // parallel)
    micro, global_batch = train.micro_batch_size, train.global_batch_size
    if not _positive_int(micro):
        raise ValueError(f"train.micro_batch_size={micro!r} is invalid: expected an integer >= 1.")
    if global_batch is not None:
        if not _positive_int(global_batch):
            raise ValueError(f"train.global_batch_size={global_batch!r} is invalid: expected an integer >= 1.")
        if global_batch % (micro * data_parallel):
            per_rank = global_batch // data_parallel if global_batch % data_parallel == 0 else None
            allowed = [n for n in range(1, per_rank + 1) if per_rank % n == 0] if per_rank else []
            raise ValueError(
                f"train.micro_batch_size={micro} is invalid with train.global_batch_size={global_batch} and "
                f"{data_parallel} data-parallel rank(s): the global batch must be a multiple of micro batch x ranks; "
                f"expected one of {', '.join(map(str, allowed)) or 'none: change train.global_batch_size'}."
            )
    seq_length = getattr(model, "seq_length", None)
    if seq_length is not None and not _positive_int(seq_length):
        raise ValueError(f"model.seq_length={seq_length!r} is invalid: expected an integer >= 1.")
    dataset = config.dataset
    data_length = getattr(dataset, "seq_length", None)
    if seq_length is not None and data_length is not None and seq_length != data_length:
        raise ValueError(
            f"model.seq_length={seq_length} is invalid: expected dataset.seq_length={data_length} (the model and its "
            f"data must agree; set both, e.g. model.seq_length={data_length} or also dataset.seq_length={seq_length})."
        )
    path = getattr(dataset, "data_path", None)
    if isinstance(path, str) and len(path.split()) > 1 and os.path.isfile(path + ".idx"):  # one dataset, not several
        dataset.data_path = [path]
        if getattr(dataset, "blend", None) == (path.split(), None):
            dataset.blend = None


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def forward_step_for(config: Any) -> Callable:
    """The plugin's forward step for ``config.model``: distillation for a ``NoisyDistillationProvider``, else noise."""
    from nemo_noise_plugin.providers import NoisyDistillationProvider
    from nemo_noise_plugin.training.forward_step import distillation_forward_step, noise_forward_step

    return distillation_forward_step if isinstance(config.model, NoisyDistillationProvider) else noise_forward_step


def training_entry_for(config: Any) -> Callable:
    """Bridge's ``finetune`` when ``checkpoint.pretrained_checkpoint`` is set, else ``pretrain``."""
    if config.checkpoint.pretrained_checkpoint is not None:
        return import_bridge("megatron.bridge.training.finetune").finetune
    return import_bridge("megatron.bridge.training.pretrain").pretrain


def launch(
    config: Any,
    overrides: Sequence[str] = (),
    *,
    forward_step: Callable | None = None,
    callbacks: Sequence[Any] | None = None,
    allow_cpu_loop: bool = False,
) -> None:
    """Train ``config`` (after ``overrides``) with the plugin's forward step and Bridge ``callbacks``.

    With a GPU: Bridge's real loop (``training_entry_for(config)``), after letting Bridge use megatron-core's prebuilt
    dataset helper (``use_prebuilt_dataset_helpers``); under ``torchrun`` every rank calls this. Without one: the CPU
    loop (``training.cpu_loop``) when ``allow_cpu_loop``, else ``GPUUnavailableError`` before anything else happens.
    ``forward_step`` defaults to ``forward_step_for(config)``. The plugin's settings are validated again first
    (``validate_plugin_settings``: whatever set them), and ``FiniteLossGuard`` stops a run whose loss is not finite.
    Under the plugin's commands Bridge's console output goes to the run folder's ``bridge.log``
    (``training.bridge_console.bridge_output``), the callbacks' lines to the console.
    """
    from nemo_noise_plugin.training.overrides import apply_overrides, validate_plugin_settings
    from nemo_noise_plugin.training.progress import FiniteLossGuard

    on_gpu = cuda_available()
    if not on_gpu and not allow_cpu_loop:
        raise GPUUnavailableError(GPU_REQUIRED_MESSAGE)
    config = apply_overrides(config, list(overrides))
    validate_plugin_settings(config)
    check_run_settings(config)
    step = forward_step or forward_step_for(config)
    callbacks = [*(callbacks or []), FiniteLossGuard()]
    if not on_gpu:
        from nemo_noise_plugin.training.cpu_loop import run_cpu_loop

        run_cpu_loop(config, step, callbacks)
        return
    from nemo_noise_plugin.training.bridge_console import bridge_output, on_console

    use_prebuilt_dataset_helpers()
    if config.checkpoint.save:
        _BRIDGE_SAVE_FOLDERS.append(Path(config.checkpoint.save))
    with bridge_output(config):  # the plugin's commands: Bridge's console output to the run folder's bridge.log
        training_entry_for(config)(config, step, callbacks=on_console(callbacks))


def launch_with_report(
    config: Any,
    *,
    output_dir: str,
    label: str,
    control: bool = True,
    clean_pretrain_steps: int = 0,
    recipe: str | None = None,
    keep_last: int | None = None,
) -> Path | None:
    """Train a recipe on the embedded corpus with progress lines, then write the robustness report.

    Bridge's loop on a GPU, else the CPU loop, which says so; both save checkpoints under ``config.checkpoint.save``
    from which the same call resumes (each phase below in its own subfolder). The report is computed by a Bridge
    callback at the start and at the end of training, and written to ``output_dir/reports/<run id>/`` as
    ``robustness.{json,png}`` (with ``task_report.{json,png}`` and the ``hf/`` export for instruction recipes; all
    files or none; ``reports/latest`` points at the newest). Returns that folder, or None when training ended before
    its last iteration.

    ``clean_pretrain_steps`` > 0 first trains the model that many steps with noise and KD off, and every run after it
    starts from those weights (a distillation run's teacher is then that pre-trained model). ``control`` also trains
    the same recipe, steps and seed without noise, and the report shows its curve as ``no noise`` beside ``after``:
    what noise training changed, against what training alone did, with a verdict per noise level (``better``,
    ``worse`` or ``no difference``: ``robustness.compare_to_control``, a paired interval over the held-out batches).

    Every report JSON holds the run's ``provenance`` (``provenance.run_provenance`` with ``recipe``) and the figure
    titles come from it. ``keep_last`` (an integer >= 1) keeps, after a report is written, only the newest that many
    report folders (``artifacts.prune_reports``) and checkpoints under ``config.checkpoint.save``
    (``artifacts.prune_checkpoints``; on rank 0 only).
    """
    from nemo_noise_plugin.artifacts import RunReport, prune_checkpoints
    from nemo_noise_plugin.batches import is_finetuning_dataset
    from nemo_noise_plugin.provenance import run_provenance, run_title
    from nemo_noise_plugin.robustness import RobustnessReport
    from nemo_noise_plugin.training.progress import ProgressLine
    from nemo_noise_plugin.training.warm_start import CaptureWeights, StartFromWeights

    on_gpu = cuda_available()
    if clean_pretrain_steps < 0:
        raise ValueError(f"clean_pretrain_steps={clean_pretrain_steps} is invalid: expected an integer >= 0.")
    run_report = RunReport(output_dir, recipe=recipe, keep_last=keep_last)  # checks keep_last before any training
    where = ", Bridge's training loop" if on_gpu else ""
    print(f"== nemo-noise-plugin main job: {label} on the embedded corpus{where} ==")
    noise = config.model.noise
    start: list[Any] = []
    if clean_pretrain_steps:
        print(f"-- clean pre-training: {clean_pretrain_steps} steps, noise and KD off; the runs below start from it --")
        capture = CaptureWeights()
        pretrain = _variant(config, f"clean_pretrain_{clean_pretrain_steps}", noise=False, kd=False)
        pretrain.train.train_iters = clean_pretrain_steps
        pretrain.scheduler.lr_decay_iters = None  # derived from the new train_iters
        launch(
            pretrain,
            callbacks=[capture, ProgressLine()],
            allow_cpu_loop=True,
        )
        start = [StartFromWeights(capture.weights)]
        config = _variant(config, f"after_clean_{clean_pretrain_steps}", keep_exit=True)  # not a scratch run's folder
    references = {}
    if control and noise.enabled:
        print(f"-- control: the same {config.train.train_iters} steps without noise --")
        reference = RobustnessReport(noise, None)
        launch(
            _variant(config, "control", noise=False), callbacks=[*start, reference, ProgressLine()], allow_cpu_loop=True
        )
        if "after" in reference.curves:  # absent when the control stopped before its last iteration
            references["no noise"] = reference.curves["after"]
    title = run_title({**run_provenance(config, recipe), "recipe": recipe or label}, clean_pretrain_steps)
    print(f"-- noise training: {title} --")
    report = RobustnessReport(noise, run_report, title, references)
    callbacks = [*start, report, ProgressLine()]
    if is_finetuning_dataset(config.dataset):  # instruction recipes: held-out exact match, HF export, generation
        from nemo_noise_plugin.evaluation import TaskReport

        callbacks.insert(len(start), TaskReport(run_report))  # before the report that finishes the folder
    launch(config, callbacks=callbacks, allow_cpu_loop=True)
    if "after" not in report.curves:
        print("no robustness report: training ended before its last iteration")
    elif keep_last is not None and config.checkpoint.save and int(os.environ.get("RANK", "0")) == 0:
        deleted = prune_checkpoints(config.checkpoint.save, keep_last)
        if deleted:
            print(f"--keep-last {keep_last}: deleted {len(deleted)} older checkpoint(s) under {config.checkpoint.save}")
    return report.folder


def _variant(config: Any, name: str, *, noise: bool = True, kd: bool = True, keep_exit: bool = False) -> Any:
    """A copy of ``config`` for a side run: noise and/or KD off, its own checkpoint folder ``name`` (resumable on
    its own), and no ``train.exit_interval`` unless ``keep_exit``."""
    import copy
    import dataclasses

    variant = copy.deepcopy(config)
    if not noise:
        variant.model.noise = dataclasses.replace(variant.model.noise, enabled=False)
    if not kd and getattr(variant.model, "kd", None) is not None:
        variant.model.kd = dataclasses.replace(variant.model.kd, enabled=False)
    if not keep_exit:
        variant.train.exit_interval = None
    checkpoint = variant.checkpoint
    if checkpoint.save:
        checkpoint.save = str(Path(checkpoint.save) / name)
        checkpoint.load = checkpoint.save
    return variant
