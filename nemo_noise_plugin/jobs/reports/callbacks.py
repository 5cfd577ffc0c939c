"""The report callbacks a recipe names (``Recipe.reports``), built for one run: the jobs wing's half of the fork.

A recipe (the library) only names its reports; this module builds them, so that the library never imports report
code. ``nemo llm finetune`` and the main job both call it; only the main job adds side runs (clean pre-training, the
control) around it. Usage::

    run_report = RunReport("outputs/run")
    callbacks = report_callbacks(RECIPES["tiny_noise_sft"].reports, config, run_report)
    launch(config, callbacks=[*callbacks, ProgressLine()], allow_cpu_loop=True)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from nemo_noise_plugin.jobs.reports.artifacts import RunReport
from nemo_noise_plugin.recipes import REPORTS

__all__ = ["REPORT_BUILDERS", "report_callbacks", "robustness_report"]


def _task_report(config: Any, run_report: RunReport, title: str, references: dict[str, Any], **options: Any) -> Any:
    from nemo_noise_plugin.jobs.reports.task_report import TaskReport

    return TaskReport(run_report, **options)


def _robustness_report(config: Any, run_report: RunReport, title: str, references: dict[str, Any]) -> Any:
    from nemo_noise_plugin.jobs.reports.robustness import RobustnessReport

    return RobustnessReport(config.model.noise, run_report, title, references)


def _privacy_audit(config: Any, run_report: RunReport, title: str, references: dict[str, Any]) -> Any:
    from nemo_noise_plugin.jobs.reports.audit_callback import PrivacyAuditCallback

    folder = run_report.reports.parent / "privacy_audit"
    return PrivacyAuditCallback(config.model.noise, str(folder), recipe=run_report.recipe)


REPORT_BUILDERS = {"task": _task_report, "privacy_audit": _privacy_audit, "robustness": _robustness_report}
"""Report name (``recipes.REPORTS``) -> ``builder(config, run_report, title, references)``, in the order the
callbacks run: the robustness report finishes the report folder, so it comes last."""


def report_callbacks(
    names: Sequence[str],
    config: Any,
    run_report: RunReport,
    *,
    title: str = "",
    references: dict[str, Any] | None = None,
    task_options: dict[str, Any] | None = None,
) -> list[Any]:
    """The Bridge callbacks of the reports ``names`` for a run of ``config`` writing into ``run_report``.

    ``title`` and ``references`` (curves of other runs, e.g. the control's) go to the robustness report,
    ``task_options`` to the task report (``TaskReport``'s keywords: ``held_out``, ``samples``). Raises
    ``ValueError`` naming an unknown report.
    """
    unknown = sorted(set(names) - set(REPORT_BUILDERS))
    if unknown:
        raise ValueError(f"reports={list(names)!r} is invalid: {unknown} unknown; expected names from {list(REPORTS)}.")
    return [
        build(config, run_report, title, dict(references or {}), **(task_options or {}) if name == "task" else {})
        for name, build in REPORT_BUILDERS.items()
        if name in names
    ]


def robustness_report(callbacks: Sequence[Any]) -> Any | None:
    """The robustness report among ``callbacks`` (to read its curves after the run), or None."""
    from nemo_noise_plugin.jobs.reports.robustness import RobustnessReport

    return next((callback for callback in callbacks if isinstance(callback, RobustnessReport)), None)
