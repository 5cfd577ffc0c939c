"""The executors of ``executor=NAME`` as one table: ``EXECUTORS`` (name -> ``ExecutorKind``), and ``kind_of``.

Each entry says everything the plugin decides per executor: the NeMo-Run executor class and the factory
(``jobs.executors.factories``) that ``cli.nemo_llm`` registers with NeMo-Run, the settings that count nodes and
ranks, the plugin's check (``jobs.executors.checks``: one rank per GPU, ...), where the job directory must be
mounted, where the task sees its job directory, how its dry run is described (``jobs.executors.describe``) and
whether its ranks run on this machine. ``kind_of(executor)`` finds the entry of a built executor (its class or the
nearest base class in the table; ``OTHER`` for executors registered elsewhere), so adding an executor is one entry.
Importing this module is cheap (NeMo-Run, no torch or Bridge).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import nemo_run as run
from nemo_run.config import RUNDIR_NAME

from nemo_noise_plugin.jobs.executors import checks, describe, factories
from nemo_noise_plugin.jobs.executors.checks import MountedJobDir

__all__ = ["EXECUTORS", "OTHER", "ExecutorKind", "MountedJobDir", "container_run_dir", "kind_of"]


def container_run_dir(executor: Any) -> str:
    """The job directory as a container's or cluster job's ranks see it: NeMo-Run mounts it at ``/nemo_run``."""
    return f"/{RUNDIR_NAME}"


def _local_run_dir(executor: Any) -> str:
    return executor.job_dir


def _slurm_run_dir(executor: Any) -> str:
    """Without a container, NeMo-Run puts the job directory under the tunnel's ``job_dir`` on the cluster."""
    if executor.container_image is None:
        return os.path.join(executor.tunnel.job_dir, os.path.basename(executor.job_dir))
    return container_run_dir(executor)


def _no_check(executor: Any, **_: Any) -> None:
    """Executors outside the table: only the shared checks (counts, layout)."""


@dataclass(frozen=True)
class ExecutorKind:
    """One executor of ``executor=NAME``: what the plugin builds, checks and prints for it.

    Attributes:
        name: the ``executor=`` name (the one in messages).
        executor_class: the NeMo-Run executor class the factory builds (``kind_of`` matches instances of it).
        factory: the ``run.Config`` factory registered with NeMo-Run (None: ``OTHER``, registered elsewhere).
        check: the plugin's own check of a built executor, called as ``check(executor, cpu_loop=...,
            gpus_here=...)``; raises ``ExecutorSettingError``.
        describe: ``describe(dry-run info, executor)``, what a dry run prints as the launch.
        nodes_setting: the setting that counts nodes (None: always one node).
        ranks_setting: the setting that counts ranks (or GPUs) per node.
        job_dir_mount: where the job directory is copied to mounted storage (None: NeMo-Run ships it itself).
        run_dir: the job directory as the task's processes see it (``RunDirectory`` points the task there).
        runs_here: the ranks are processes of this machine, in this Python environment and file system: this
            machine's GPUs bound them, torchrun comes from this environment, a CPU-loop recipe runs without
            torchrun, and the run's folders (``checkpoint.save``) are checked here. Otherwise those folders are on
            the cluster or container side and do not exist on this machine.
    """

    name: str
    executor_class: type
    factory: Callable[..., run.Config] | None
    check: Callable[..., None]
    describe: Callable[[Any, Any], str]
    nodes_setting: str | None = "nodes"
    ranks_setting: str = "ntasks_per_node"
    job_dir_mount: MountedJobDir | None = None
    run_dir: Callable[[Any], str] = container_run_dir
    runs_here: bool = False


_SLURM = {
    "executor_class": run.SlurmExecutor,
    "check": checks.check_slurm,
    "describe": describe.nemo_run_dry_run_text,
    "run_dir": _slurm_run_dir,
}

EXECUTORS: dict[str, ExecutorKind] = {
    kind.name: kind
    for kind in (
        ExecutorKind(
            "local",
            run.LocalExecutor,
            factories.local_executor,
            checks.check_local,
            describe.describe_local_command,
            run_dir=_local_run_dir,
            runs_here=True,
        ),
        ExecutorKind(name="slurm", factory=factories.slurm_executor, **_SLURM),
        ExecutorKind(name="slurm_ssh", factory=factories.slurm_ssh_executor, **_SLURM),
        ExecutorKind(
            "docker",
            run.DockerExecutor,
            factories.docker_executor,
            checks.check_docker,
            describe.describe_docker_containers,
            nodes_setting=None,
        ),
        ExecutorKind(
            "lepton",
            run.LeptonExecutor,
            factories.lepton_executor,
            checks.check_lepton,
            describe.describe_lepton_job,
            job_dir_mount=MountedJobDir("nemo_run_dir", "mounts", "mount_path"),
            ranks_setting="gpus_per_node",
        ),
        ExecutorKind(
            "dgxcloud",
            run.DGXCloudExecutor,
            factories.dgxcloud_executor,
            checks.check_dgxcloud,
            describe.describe_dgxcloud_job,
            job_dir_mount=MountedJobDir("pvc_nemo_run_dir", "pvcs", "path"),
            ranks_setting="gpus_per_node",
        ),
    )
}
"""``executor=NAME`` -> its ``ExecutorKind``; ``cli.nemo_llm`` registers each ``factory`` with NeMo-Run."""

OTHER = ExecutorKind("other", run.Executor, None, _no_check, describe.nemo_run_dry_run_text)
"""An executor outside the table (registered with NeMo-Run elsewhere): shared checks, NeMo-Run's dry-run text."""


def kind_of(executor: Any) -> ExecutorKind:
    """The table's entry of a built NeMo-Run ``executor``: its class's, else its nearest base class's, else
    ``OTHER`` (one lookup instead of ``isinstance`` chains). Of two entries with one class (``slurm``,
    ``slurm_ssh``), the first: they differ only in their factory."""
    for cls in type(executor).__mro__:
        for kind in EXECUTORS.values():
            if kind.executor_class is cls:
                return kind
    return OTHER
