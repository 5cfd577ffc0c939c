"""The main job: clean pre-training, a control run without noise, noise training, and the robustness report.

What ``python -m nemo_noise_plugin`` (``cli.main_job``) runs on a recipe that trains on shipped data, and only it:
``nemo llm finetune`` trains what it is given (``jobs.launch.finetune``). Each run goes through the plain launcher
(``jobs.launch.launcher.launch``) with the report callbacks of ``jobs.reports``. From Python::

    from nemo_noise_plugin.jobs.main_job import launch_with_report
    from nemo_noise_plugin.recipes import tiny_noise_sft_config

    if __name__ == "__main__":  # Bridge's checkpoint-save workers re-import the launching script
        launch_with_report(tiny_noise_sft_config(), output_dir="outputs/main_job", label="tiny_noise_sft")
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nemo_noise_plugin.jobs.launch.launcher import cuda_available, launch

__all__ = ["launch_with_report"]


def launch_with_report(
    config: Any,
    *,
    output_dir: str,
    label: str,
    control: bool = True,
    clean_pretrain_steps: int = 0,
    recipe: str | None = None,
    keep_last: int | None = None,
    reports: Sequence[str] | None = None,
    task_options: dict[str, Any] | None = None,
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
    ``worse`` or ``no difference``: ``robustness_statistics.compare_to_control``, a paired interval over the held-out
    batches).

    ``reports`` names the report callbacks of the noise-training run (``Recipe.reports``, built by
    ``jobs.reports.callbacks``); None: ``task`` and ``robustness`` for instruction data, else ``robustness``.

    Every report JSON holds the run's ``provenance`` (``provenance.run_provenance`` with ``recipe``) and the figure
    titles come from it. ``keep_last`` (an integer >= 1) keeps, after a report is written, only the newest that many
    report folders (``artifacts.prune_reports``) and checkpoints under ``config.checkpoint.save``
    (``artifacts.prune_checkpoints``; on rank 0 only).

    Args:
        config: the recipe's ``ConfigContainer`` (noise on; the control run switches it off).
        output_dir: the run folder: checkpoints, ``reports/`` and ``bridge.log``.
        label: the run's name in progress lines and report titles.
        control: also train without noise and compare.
        clean_pretrain_steps: steps of noise-free training first (teachers for distillation recipes).
        recipe: the recipe's name, recorded in every report's provenance.
        keep_last: keep only the newest N report folders and checkpoints (None keeps all).
        reports: report callbacks to run (names of ``recipes.REPORTS``); None picks by the data.
        task_options: keywords of the task report (``held_out``: score the first N held-out examples per split;
            ``samples``: the exported model's replies).

    Returns:
        The report folder, or None when training stopped before its last iteration.

    Example::

        launch_with_report(tiny_noise_sft_config(), output_dir="outputs/demo", label="tiny", recipe="tiny_noise_sft")
    """
    from nemo_noise_plugin.jobs.batches import is_finetuning_dataset
    from nemo_noise_plugin.jobs.launch.warm_start import CaptureWeights, StartFromWeights
    from nemo_noise_plugin.jobs.progress import ProgressLine
    from nemo_noise_plugin.jobs.reports.artifacts import RunReport, prune_checkpoints
    from nemo_noise_plugin.jobs.reports.callbacks import report_callbacks, robustness_report
    from nemo_noise_plugin.jobs.reports.provenance import run_provenance, run_title
    from nemo_noise_plugin.jobs.reports.robustness import RobustnessReport

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
    if reports is None:  # a config of no registered recipe: the reports of its kind of data
        reports = ("task", "robustness") if is_finetuning_dataset(config.dataset) else ("robustness",)
    callbacks = report_callbacks(
        reports, config, run_report, title=title, references=references, task_options=task_options
    )
    launch(config, callbacks=[*start, *callbacks, ProgressLine()], allow_cpu_loop=True)
    report = robustness_report(callbacks)
    if report is None:
        return None
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
