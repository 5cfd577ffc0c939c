"""The plugin's checks of a built NeMo-Run executor before anything starts: ``ExecutorSettingError`` naming a setting.

One check per executor (``jobs.executors.kinds.EXECUTORS`` names it in each entry: one rank per GPU, Slurm's account,
the container image, Lepton's shape and node group) and the checks every executor shares: positive node and rank
counts (``check_counts``), the job directory on mounted storage (``check_mounted_job_dir``) and a world size that is
a multiple of TP x PP x CP (``check_layout``). Importing this module is cheap (NeMo-Run, no torch or Bridge).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from nemo_run.core.execution.launcher import Torchrun

from nemo_noise_plugin.jobs.launch.finetune import FinetuneError

__all__ = [
    "ExecutorSettingError",
    "MountedJobDir",
    "check_counts",
    "check_dgxcloud",
    "check_docker",
    "check_layout",
    "check_lepton",
    "check_local",
    "check_mounted_job_dir",
    "check_slurm",
]


class ExecutorSettingError(FinetuneError):
    """An ``executor=`` / ``executor.KEY=VALUE`` setting that cannot work; the message names it and what is allowed."""


@dataclass(frozen=True)
class MountedJobDir:
    """Where a cluster job's job directory is copied: ``executor.<dir_setting>``, an absolute folder under the
    ``path_key`` of one of the ``executor.<mounts_setting>`` entries (the storage the job mounts)."""

    dir_setting: str
    mounts_setting: str
    path_key: str


def _setting_error(key: str, value: Any, allowed: str) -> ExecutorSettingError:
    return ExecutorSettingError(f"executor.{key}={value!r} is invalid: {allowed}.")


def _required(key: str, name: str, example: str) -> ExecutorSettingError:
    return ExecutorSettingError(f"executor.{key} is required for executor={name} (e.g. executor.{key}={example}).")


def check_counts(executor: Any, nodes_key: str | None, ranks_key: str) -> None:
    """``executor.<nodes_key>`` (None: always one node) and ``executor.<ranks_key>`` are whole numbers >= 1.

    A setting the executor does not have (an executor class outside the table) is not checked.
    """
    if nodes_key is not None and hasattr(executor, nodes_key):
        nodes = getattr(executor, nodes_key)
        if not isinstance(nodes, int) or nodes < 1:
            raise _setting_error(nodes_key, nodes, "expected a whole number of nodes >= 1")
    if hasattr(executor, ranks_key):
        ranks = getattr(executor, ranks_key)
        if not isinstance(ranks, int) or ranks < 1:
            what = "GPUs" if ranks_key == "gpus_per_node" else "ranks"
            raise _setting_error(ranks_key, ranks, f"expected a whole number of {what} per node >= 1")


def check_local(executor: Any, *, cpu_loop: bool = False, gpus_here: int | None = None) -> None:
    """``executor=local``: one node; several ranks need torchrun; at most one rank per GPU of this machine
    (``gpus_here``, None: not checked); without a GPU only a CPU-loop recipe (``cpu_loop``), in one process."""
    from nemo_noise_plugin.jobs.launch.launcher import GPU_REQUIRED_MESSAGE

    tasks = executor.ntasks_per_node
    if executor.nodes != 1:
        raise _setting_error(
            "nodes", executor.nodes, "executor=local runs on this machine (1 node); use executor=slurm"
        )
    if tasks > 1 and not isinstance(executor.get_launcher(), Torchrun):
        raise _setting_error("launcher", executor.launcher, f"{tasks} ranks per node need executor.launcher=torchrun")
    if gpus_here == 0 and not cpu_loop:
        raise ExecutorSettingError(f"executor=local on this machine: {GPU_REQUIRED_MESSAGE}")
    if gpus_here == 0 and tasks > 1:
        raise _setting_error(
            "ntasks_per_node", tasks, "this machine has no GPU, and the CPU loop runs in one process (use 1)"
        )
    if gpus_here and tasks > gpus_here:
        raise _setting_error("ntasks_per_node", tasks, f"this machine has {gpus_here} GPU(s); use at most that")


def check_slurm(executor: Any, **_: Any) -> None:
    """``executor=slurm``/``slurm_ssh``: an account, and one torchrun rank per requested GPU."""
    if not executor.account:
        raise _setting_error("account", executor.account, "executor=slurm needs a Slurm account")
    gpus = executor.gpus_per_node
    if isinstance(executor.get_launcher(), Torchrun) and gpus and executor.nproc_per_node() != gpus:
        raise _setting_error(
            "ntasks_per_node", executor.nproc_per_node(), f"one rank per GPU expected: executor.gpus_per_node={gpus}"
        )


def check_docker(executor: Any, **_: Any) -> None:
    """``executor=docker``: a GPU count (or -1: all), and one rank per GPU."""
    gpus, tasks = executor.num_gpus, executor.ntasks_per_node
    if gpus not in (None, -1) and (not isinstance(gpus, int) or gpus < 1):
        raise _setting_error("num_gpus", gpus, "expected a whole number of GPUs >= 1, or -1 for all of them")
    if isinstance(gpus, int) and gpus >= 1 and gpus != tasks:
        raise _setting_error("ntasks_per_node", tasks, f"one rank per GPU expected: executor.num_gpus={gpus}")


def _check_cluster_job(executor: Any, name: str) -> None:
    """Lepton and DGX Cloud: a container image and one torchrun rank per GPU."""
    if not executor.container_image:
        raise _required("container_image", name, "nvcr.io/nvidia/nemo:25.11 with the plugin installed")
    if executor.nprocs_per_node != executor.gpus_per_node:
        raise _setting_error(
            "nprocs_per_node",
            executor.nprocs_per_node,
            f"torchrun starts one rank per GPU here, executor.gpus_per_node={executor.gpus_per_node}",
        )


def check_lepton(executor: Any, **_: Any) -> None:
    """``executor=lepton``: a container, one rank per GPU, a resource shape, a node group, well-formed mounts."""
    _check_cluster_job(executor, "lepton")
    if not executor.resource_shape:
        raise _required("resource_shape", "lepton", "gpu.8xh100-80gb")
    if not executor.node_group:
        raise _required("node_group", "lepton", "the node group's name from `lep node list`")
    for mount in executor.mounts:
        if not isinstance(mount, dict) or not {"path", "mount_path"} <= set(mount):
            raise _setting_error("mounts", executor.mounts, "each entry needs a 'path' and a 'mount_path'")


def check_dgxcloud(executor: Any, **_: Any) -> None:
    """``executor=dgxcloud``: a container and one rank per GPU."""
    _check_cluster_job(executor, "dgxcloud")


def _under_one_of(path: str, roots: Sequence[str]) -> bool:
    path = os.path.abspath(path)
    return any(os.path.commonpath([path, os.path.abspath(root)]) == os.path.abspath(root) for root in roots)


def check_mounted_job_dir(executor: Any, where: MountedJobDir) -> None:
    """The job directory is copied to ``where.dir_setting`` on shared storage, so it must lie under one of the
    mounts."""
    mounts_key, path_key, dir_key = where.mounts_setting, where.path_key, where.dir_setting
    mounts = getattr(executor, mounts_key)
    for mount in mounts:
        if not isinstance(mount, dict) or path_key not in mount:
            raise _setting_error(mounts_key, mounts, f"each entry needs a {path_key!r} (a dict per mount)")
    roots = [mount[path_key] for mount in mounts]
    run_dir = getattr(executor, dir_key)
    if not run_dir or not os.path.isabs(run_dir) or not _under_one_of(run_dir, roots):
        place = f"an executor.{mounts_key} entry's {path_key}"
        place += f" ({', '.join(roots)})" if roots else " (there is none)"
        raise _setting_error(dir_key, run_dir, f"expected an absolute folder under {place}")


def check_layout(executor: Any, model: Any) -> None:
    """The executor's world size (NeMo-Run's ``nnodes() x nproc_per_node()``) is a multiple of TP x PP x CP."""
    sizes = {
        key: getattr(model, key, 1) or 1
        for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size")
    }
    model_parallel = 1
    for size in sizes.values():
        model_parallel *= size
    world = executor.nnodes() * executor.nproc_per_node()
    if world % model_parallel:
        layout = " x ".join(f"model.{key}={value}" for key, value in sizes.items())
        raise ExecutorSettingError(
            f"{executor.nnodes()} node(s) x {executor.nproc_per_node()} ranks per node = {world} ranks is invalid "
            f"for {layout}: the number of ranks must be a multiple of {model_parallel}."
        )
