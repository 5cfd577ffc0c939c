"""Launching the finetune flow through NeMo-Run executors: the task, its job directory, the launch and dry run.

``nemo llm finetune ... executor=NAME executor.KEY=VALUE`` (``cli.nemo_llm``; the executors and their checks are in
``jobs.executors.settings``) resolves the recipe and its overrides here on the launching side where it can (bad
overrides and executor settings that cannot work are errors before anything starts), builds the task as a
``run.Partial`` of the command's own entry point (factory name, overrides, YAML file: the worker resolves the same
config), and runs it in a NeMo-Run ``Experiment`` with that executor. ``RunDirectory`` points the task at its job
directory as the worker sees it, so the experiment folder holds the resolved ``config.yaml``, the logs and the
robustness report. A dry run prints exactly what would be launched (the torchrun command, the sbatch script, the
container or cluster job) and starts nothing.

Importing this module is cheap (NeMo-Run, no torch or Bridge): ``nemo`` imports it with ``cli.nemo_llm``.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import nemo_run as run

from nemo_noise_plugin.jobs.executors.kinds import kind_of
from nemo_noise_plugin.jobs.executors.settings import check_executor
from nemo_noise_plugin.jobs.launch.finetune import FinetuneError, HubMissError, apply_overrides, build_config
from nemo_noise_plugin.jobs.launch.offline_hub import HUB_MISS

__all__ = [
    "RunDirectory",
    "describe_launch",
    "describe_request",
    "experiment_name",
    "finetune_task",
    "launch_finetune",
    "resolve_on_launcher",
    "run_on_executor",
    "worker_run_dir",
]


def worker_run_dir(executor: Any) -> str:
    """The job directory of an assigned ``executor`` as the task's processes see it (its ``EXECUTORS`` entry's
    ``run_dir``).

    Local runs see NeMo-Run's job directory itself; a Slurm job without a container sees it under the tunnel's
    directory; containers (Slurm with ``container_image``, Docker, Skypilot, Lepton, ...) see it mounted at
    ``/nemo_run``.
    """
    return kind_of(executor).run_dir(executor)


@dataclass(kw_only=True)
class RunDirectory(run.Plugin):
    """Point the finetune task at its job directory: ``config.yaml``, the report and a copy of ``--config-file``.

    NeMo-Run calls ``setup`` once the job's executor knows its directory. A ``--config-file`` is copied into the
    job's ``configs/`` folder (which NeMo-Run ships with the job), so the worker reads the same YAML anywhere.
    """

    def setup(self, task: Any, executor: Any) -> None:
        run_dir = worker_run_dir(executor)
        task.run_dir = run_dir
        if getattr(task, "config_file", None):
            configs = os.path.join(executor.job_dir, "configs")
            os.makedirs(configs, exist_ok=True)
            name = os.path.basename(task.config_file)
            shutil.copyfile(task.config_file, os.path.join(configs, name))
            task.config_file = os.path.join(run_dir, "configs", name)


def resolve_on_launcher(
    recipe: Callable[[], Any], factory: str, overrides: Sequence[str], config_file: str | None, *, dryrun: bool = False
) -> tuple[Any, str | None]:
    """``(config, None)`` with the overrides applied and checked, or ``(None, why)`` when the recipe cannot be built
    here (e.g. it reads its HF config from a hub this machine cannot reach, or, in a ``dryrun``, which reaches for
    no hub, has not cached): the worker then resolves it.

    Unknown factories, bad overrides and bad YAML are ``FinetuneError`` either way.
    """
    for override in overrides:
        if override.startswith("-"):
            raise FinetuneError(f"unknown option {override!r}; overrides look like key=value, +key=value or ~key.")
    try:
        base = build_config(recipe, factory, dryrun=dryrun)
    except HubMissError:
        return None, HUB_MISS
    except FinetuneError:
        raise
    except Exception as error:  # the recipe itself failed: network, missing files, ...
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
        return None, f"{type(error).__name__}: {first_line}"[:300]
    return apply_overrides(base, overrides, config_file), None


def finetune_task(entry: Callable, factory: str, overrides: Sequence[str], config_file: str | None) -> run.Partial:
    """The task every rank runs: ``entry(factory=..., overrides=..., config_file=...)`` (``run_dir`` set at launch)."""
    return run.Partial(
        entry,
        factory=factory,
        overrides=list(overrides),
        config_file=os.path.abspath(config_file) if config_file else None,
    )


def experiment_name(factory: str) -> str:
    """A directory-safe experiment title for ``--factory`` (``my_pkg.recipes:cfg`` -> ``my_pkg_recipes_cfg``)."""
    return re.sub(r"\W+", "_", factory).strip("_") or "finetune"


def describe_request(job: Any) -> str:
    """What a prepared and dry-run NeMo-Run job would launch: the sbatch script, the local command, the container
    or cluster job (image, nodes and GPUs, command, environment, mounts, job directory), or the scheduler request
    (the executor's ``EXECUTORS`` entry's ``describe``; NeMo-Run's own dry-run text outside the table)."""
    info = job._dryrun_info  # set by Job.launch(dryrun=True); NeMo-Run offers no public accessor
    return kind_of(job.executor).describe(info, job.executor)


def describe_launch(task: Any, executor: Any, resolved: str) -> str:
    """The launching side's summary: task, executor, and the resolved config (or why the worker resolves it)."""
    return "\n".join(
        [
            f"  task          {task.__fn_or_cls__.__module__}.{task.__fn_or_cls__.__qualname__}"
            f"(factory={task.factory!r}, overrides={task.overrides!r}, config_file={task.config_file!r})",
            f"  executor      {executor.info()}: {executor.nnodes()} node(s) x {executor.nproc_per_node()} rank(s)",
            resolved,
        ]
    )


def run_on_executor(
    task: Any,
    executor: Any,
    *,
    name: str,
    dryrun: bool = False,
    detach: bool = False,
    plugins: Sequence[Any] = (),
    print_fn: Callable[[str], None] = print,
) -> Any:
    """Run ``task`` (a ``run.Partial``) as a one-job NeMo-Run experiment on ``executor``; returns the job.

    A dry run prepares the job (packaging, scripts) in a temporary experiment folder, prints what would be launched
    (``describe_request``) and removes the folder. A real run waits for the job unless ``detach`` (Slurm and
    Skypilot only) and raises ``RuntimeError`` when it did not succeed; the job's ``executor.job_dir`` holds its logs.
    """
    from torchx.specs import AppState

    if kind_of(executor).runs_here:
        use_this_environment(executor)
    with run.Experiment(name, executor=executor) as experiment:
        experiment.add(task, name=name, plugins=list(plugins), tail_logs=not detach)
        job = experiment.jobs[0]
        if dryrun:
            experiment.dryrun(log=False)
            print_fn(f"Would launch ({job.executor.info()}):\n{describe_request(job)}")
            return job
        experiment.run(detach=detach, tail_logs=not detach)
    print_fn(f"Experiment folder: {job.executor.job_dir} (state {job.state.name})")
    if not detach and job.state != AppState.SUCCEEDED:
        raise RuntimeError(f"job {job.id} ended in state {job.state.name}; logs under {job.executor.job_dir}")
    return job


def use_this_environment(executor: Any) -> None:
    """Let a local job's ``torchrun`` be the one next to this Python (a virtual environment need not be active).

    torchx's local scheduler puts ``env_vars["PATH"]`` before the inherited ``PATH``; an explicit one is kept.
    """
    bin_dir = os.path.dirname(sys.executable)
    if "PATH" not in executor.env_vars and os.path.isfile(os.path.join(bin_dir, "torchrun")):
        executor.env_vars["PATH"] = bin_dir


def launch_finetune(
    entry: Callable,
    recipe: Callable[[], Any],
    factory: str,
    overrides: Sequence[str],
    executor: Any,
    *,
    config_file: str | None = None,
    dryrun: bool = False,
    detach: bool = False,
    confirm: Callable[[], bool] | None = None,
    print_fn: Callable[[str], None] = print,
) -> Any:
    """Check and launch the finetune flow of ``factory`` + ``overrides`` on a NeMo-Run ``executor``.

    ``entry`` is the command's entry point (its ``run.Partial`` is the task), ``recipe`` resolves ``--factory`` on the
    launching side. Everything that can be checked here is checked before anything starts: the executor
    (``check_executor``) and, with the config resolved here, the run settings each rank's launch checks
    (``check_run_settings`` for the job's world size, creating nothing; ``checkpoint.save`` only when the ranks run
    on this machine, since a cluster's or container's folders do not exist here). A dry run skips only the checks
    against this machine's GPUs. Returns the NeMo-Run job (None when ``confirm`` declines).
    """
    from nemo_noise_plugin.jobs.launch.finetune import describe
    from nemo_noise_plugin.jobs.launch.launcher import check_run_settings
    from nemo_noise_plugin.recipes import RECIPES

    if config_file is not None and not os.path.isfile(config_file):
        raise FinetuneError(f"--config-file {config_file!r} is not a file.")
    config, why = resolve_on_launcher(recipe, factory, overrides, config_file, dryrun=dryrun)
    kind = kind_of(executor)
    gpus_here = _gpu_count() if kind.runs_here and not dryrun else None
    check_executor(
        executor, config, cpu_loop=factory in RECIPES and RECIPES[factory].embedded_corpus, gpus_here=gpus_here
    )
    if config is not None:  # what each rank's launch() checks, for the job's world size, before anything starts
        check_run_settings(
            config, world_size=executor.nnodes() * executor.nproc_per_node(), dry=True, folders_here=kind.runs_here
        )
    if kind.runs_here and gpus_here == 0:  # the CPU loop: one process with its own gloo group, so no torchrun agent
        executor.launcher = None
    task = finetune_task(entry, factory, overrides, config_file)
    if config is not None:
        resolved = f"  resolved here, and again by each rank:\n{describe(config, factory, overrides, config_file)}"
    else:
        resolved = f"  config        resolved by each rank: the recipe cannot be built here ({why})"
    print_fn(f"{'Dry run' if dryrun else 'Launching'} with an executor:\n{describe_launch(task, executor, resolved)}")
    if not dryrun and confirm is not None and not confirm():
        print_fn("Exiting without launching.")
        return None
    return run_on_executor(
        task,
        executor,
        name=experiment_name(factory),
        dryrun=dryrun,
        detach=detach,
        plugins=[RunDirectory()],
        print_fn=print_fn,
    )


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
