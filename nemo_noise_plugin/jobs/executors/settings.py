"""The NeMo-Run executors ``finetune`` launches on: their factories, ``executor.KEY=VALUE`` settings and checks.

``executor=NAME`` picks a factory of ``EXECUTOR_FACTORIES`` (``cli.nemo_llm`` registers them with NeMo-Run),
``build_executor`` applies the command line's ``executor.KEY=VALUE`` settings to its ``run.Config`` and builds it,
and ``check_executor`` rejects what cannot work before anything starts. Every factory runs torchrun with one rank per
GPU, ships no code (the plugin is installed where the job runs: this environment, or the container image) and sets
``DEFAULT_ENV_VARS``. Importing this module is cheap (NeMo-Run, no torch or Bridge).
"""

from __future__ import annotations

import difflib
import logging
import os
import re
import typing
from collections.abc import Callable, Sequence
from typing import Any

import nemo_run as run
from nemo_run.core.execution.launcher import Torchrun

from nemo_noise_plugin.jobs.launch.finetune import FinetuneError

__all__ = [
    "DEFAULT_ENV_VARS",
    "EXECUTOR_FACTORIES",
    "ExecutorSettingError",
    "build_executor",
    "check_executor",
    "dgxcloud_executor",
    "docker_executor",
    "lepton_executor",
    "local_executor",
    "slurm_executor",
    "slurm_ssh_executor",
]

DEFAULT_ENV_VARS = {"TORCH_NCCL_AVOID_RECORD_STREAMS": "1", "NCCL_NVLS_ENABLE": "0"}
"""Environment every factory sets (Megatron's usual NCCL settings); ``executor.env_vars.K=V`` adds more."""


class ExecutorSettingError(FinetuneError):
    """An ``executor=`` / ``executor.KEY=VALUE`` setting that cannot work; the message names it and what is allowed."""


def local_executor(ntasks_per_node: int = 1) -> run.Config[run.LocalExecutor]:
    """``executor=local``: this machine, one torchrun process per GPU (``executor.ntasks_per_node=8``)."""
    return run.Config(
        run.LocalExecutor, ntasks_per_node=ntasks_per_node, launcher="torchrun", env_vars=dict(DEFAULT_ENV_VARS)
    )


def slurm_executor(nodes: int = 1, gpus_per_node: int = 8) -> run.Config[run.SlurmExecutor]:
    """``executor=slurm``: an sbatch job submitted from this (login) node; torchrun on each node, one rank per GPU.

    Set ``executor.account=...`` (required), ``executor.partition``, ``executor.nodes``, ``executor.time``,
    ``executor.container_image`` (a container with the plugin installed) and ``executor.container_mounts``.
    """
    return run.Config(
        run.SlurmExecutor,
        nodes=nodes,
        ntasks_per_node=gpus_per_node,
        gpus_per_node=gpus_per_node,
        time="04:00:00",
        exclusive=True,
        mem="0",
        launcher="torchrun",
        env_vars=dict(DEFAULT_ENV_VARS),
        packager=run.Config(run.Packager),
        tunnel=run.Config(run.LocalTunnel, job_dir=""),
    )


def slurm_ssh_executor(nodes: int = 1, gpus_per_node: int = 8) -> run.Config[run.SlurmExecutor]:
    """``executor=slurm_ssh``: as ``slurm``, submitted over SSH (``executor.tunnel.host/user/job_dir``)."""
    config = slurm_executor(nodes, gpus_per_node)
    config.tunnel = run.Config(run.SSHTunnel, host="", user="", job_dir="")
    return config


def docker_executor(gpus: int = 8) -> run.Config[run.DockerExecutor]:
    """``executor=docker``: a container on this machine's Docker daemon, torchrun with one rank per GPU.

    Set ``executor.container_image=...`` (required: an image with the plugin installed, e.g. a NeMo container after
    ``pip install --no-deps nemo-noise-plugin``) and ``executor.volumes='["/data:/data"]'``; the job directory is
    mounted at ``/nemo_run``. ``executor.num_gpus`` and ``executor.ntasks_per_node`` must stay equal.
    """
    return run.Config(
        run.DockerExecutor,
        num_gpus=gpus,
        ntasks_per_node=gpus,
        runtime="nvidia",
        ipc_mode="host",
        shm_size="16g",
        ulimits=["memlock:-1", "stack:67108864"],
        launcher="torchrun",
        env_vars=dict(DEFAULT_ENV_VARS),
        packager=run.Config(run.Packager),
    )


def lepton_executor(nodes: int = 1, gpus_per_node: int = 8) -> run.Config[run.LeptonExecutor]:
    """``executor=lepton``: a DGX Cloud Lepton job (``leptonai`` logged in on this machine), torchrun on each node.

    Set ``executor.container_image``, ``executor.resource_shape`` (``gpu.8xh100-80gb``), ``executor.node_group``,
    ``executor.mounts`` (``'[{"path": "/shared", "mount_path": "/shared", "from": "node-nfs:lepton-shared-fs"}]'``)
    and ``executor.nemo_run_dir`` (a folder under a mount's ``mount_path``: the job directory is copied there).
    """
    return _cluster_job(run.LeptonExecutor, nodes, gpus_per_node)


def dgxcloud_executor(nodes: int = 1, gpus_per_node: int = 8) -> run.Config[run.DGXCloudExecutor]:
    """``executor=dgxcloud``: a DGX Cloud (Run:ai) training workload, torchrun on each node.

    Set ``executor.base_url``, ``executor.kube_apiserver_url``, ``executor.client_id``, ``executor.client_secret``,
    ``executor.project_name``, ``executor.container_image``, ``executor.pvcs``
    (``'[{"name": "ws", "path": "/workspace", "claimName": "ws-pvc"}]'``) and ``executor.pvc_nemo_run_dir`` (a folder
    under a PVC's ``path``: the job directory is copied there).
    """
    return _cluster_job(run.DGXCloudExecutor, nodes, gpus_per_node)


def _cluster_job(executor_class: type, nodes: int, gpus_per_node: int) -> run.Config:
    """Lepton and DGX Cloud: ``nodes`` x one torchrun rank per GPU, the usual environment, no code packaged."""
    return run.Config(
        executor_class,
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        nprocs_per_node=gpus_per_node,
        launcher="torchrun",
        env_vars=dict(DEFAULT_ENV_VARS),
        packager=run.Config(run.Packager),
    )


EXECUTOR_FACTORIES: dict[str, Callable[..., Any]] = {
    "local": local_executor,
    "slurm": slurm_executor,
    "slurm_ssh": slurm_ssh_executor,
    "docker": docker_executor,
    "lepton": lepton_executor,
    "dgxcloud": dgxcloud_executor,
}
"""``executor=NAME`` -> factory; ``cli.nemo_llm`` registers them with NeMo-Run for ``finetune``'s run context."""

COUNT_SETTINGS: dict[type, tuple[str | None, str]] = {
    run.LocalExecutor: ("nodes", "ntasks_per_node"),
    run.SlurmExecutor: ("nodes", "ntasks_per_node"),
    run.DockerExecutor: (None, "ntasks_per_node"),
    run.LeptonExecutor: ("nodes", "gpus_per_node"),
    run.DGXCloudExecutor: ("nodes", "gpus_per_node"),
}
"""Per executor class: the setting that counts nodes (None: always one) and the one that counts ranks per node."""


def _setting_error(key: str, value: Any, allowed: str) -> ExecutorSettingError:
    return ExecutorSettingError(f"executor.{key}={value!r} is invalid: {allowed}.")


def _required(key: str, name: str, example: str) -> ExecutorSettingError:
    return ExecutorSettingError(f"executor.{key} is required for executor={name} (e.g. executor.{key}={example}).")


def _check_counts(executor: Any) -> None:
    nodes_key, ranks_key = COUNT_SETTINGS.get(type(executor), ("nodes", "ntasks_per_node"))
    if nodes_key is not None:
        nodes = getattr(executor, nodes_key)
        if not isinstance(nodes, int) or nodes < 1:
            raise _setting_error(nodes_key, nodes, "expected a whole number of nodes >= 1")
    ranks = getattr(executor, ranks_key)
    if not isinstance(ranks, int) or ranks < 1:
        what = "GPUs" if ranks_key == "gpus_per_node" else "ranks"
        raise _setting_error(ranks_key, ranks, f"expected a whole number of {what} per node >= 1")


def _check_local(executor: Any, cpu_loop: bool, gpus_here: int | None) -> None:
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


def _check_slurm(executor: Any) -> None:
    if not executor.account:
        raise _setting_error("account", executor.account, "executor=slurm needs a Slurm account")
    gpus = executor.gpus_per_node
    if isinstance(executor.get_launcher(), Torchrun) and gpus and executor.nproc_per_node() != gpus:
        raise _setting_error(
            "ntasks_per_node", executor.nproc_per_node(), f"one rank per GPU expected: executor.gpus_per_node={gpus}"
        )


def _check_docker(executor: Any) -> None:
    gpus, tasks = executor.num_gpus, executor.ntasks_per_node
    if gpus not in (None, -1) and (not isinstance(gpus, int) or gpus < 1):
        raise _setting_error("num_gpus", gpus, "expected a whole number of GPUs >= 1, or -1 for all of them")
    if isinstance(gpus, int) and gpus >= 1 and gpus != tasks:
        raise _setting_error("ntasks_per_node", tasks, f"one rank per GPU expected: executor.num_gpus={gpus}")


def _under_one_of(path: str, roots: Sequence[str]) -> bool:
    path = os.path.abspath(path)
    return any(os.path.commonpath([path, os.path.abspath(root)]) == os.path.abspath(root) for root in roots)


def _check_mounted_run_dir(executor: Any, dir_key: str, mounts_key: str, path_key: str) -> None:
    """The job directory is copied to ``dir_key`` on shared storage, so it must lie under one of the mounts."""
    mounts = getattr(executor, mounts_key)
    for mount in mounts:
        if not isinstance(mount, dict) or path_key not in mount:
            raise _setting_error(mounts_key, mounts, f"each entry needs a {path_key!r} (a dict per mount)")
    roots = [mount[path_key] for mount in mounts]
    run_dir = getattr(executor, dir_key)
    if not run_dir or not os.path.isabs(run_dir) or not _under_one_of(run_dir, roots):
        where = f"an executor.{mounts_key} entry's {path_key}"
        where += f" ({', '.join(roots)})" if roots else " (there is none)"
        raise _setting_error(dir_key, run_dir, f"expected an absolute folder under {where}")


def _check_cluster_job(executor: Any) -> None:
    """Lepton and DGX Cloud: a container, one rank per GPU, a job directory on the mounted shared storage."""
    name = "lepton" if isinstance(executor, run.LeptonExecutor) else "dgxcloud"
    if not executor.container_image:
        raise _required("container_image", name, "nvcr.io/nvidia/nemo:25.11 with the plugin installed")
    if executor.nprocs_per_node != executor.gpus_per_node:
        raise _setting_error(
            "nprocs_per_node",
            executor.nprocs_per_node,
            f"torchrun starts one rank per GPU here, executor.gpus_per_node={executor.gpus_per_node}",
        )
    if isinstance(executor, run.LeptonExecutor):
        if not executor.resource_shape:
            raise _required("resource_shape", name, "gpu.8xh100-80gb")
        if not executor.node_group:
            raise _required("node_group", name, "the node group's name from `lep node list`")
        for mount in executor.mounts:
            if not isinstance(mount, dict) or not {"path", "mount_path"} <= set(mount):
                raise _setting_error("mounts", executor.mounts, "each entry needs a 'path' and a 'mount_path'")
        _check_mounted_run_dir(executor, "nemo_run_dir", "mounts", "mount_path")
    else:
        _check_mounted_run_dir(executor, "pvc_nemo_run_dir", "pvcs", "path")


def check_executor(executor: Any, config: Any = None, *, cpu_loop: bool = False, gpus_here: int | None = None) -> None:
    """Reject executor settings that cannot work, before anything starts (``ExecutorSettingError``).

    Counts must be positive, with one rank per GPU; a local run has one node, several ranks need the torchrun
    launcher, ``gpus_here`` (this machine's GPU count, None: not checked) bounds the ranks, and with no GPU only a
    recipe with a CPU loop (``cpu_loop``) runs, in one process. Slurm needs an account; Docker, Lepton and DGX Cloud a
    container image, Lepton and DGX Cloud their job directory on mounted storage. With a resolved ``config`` the
    world size must be a multiple of TP x PP x CP.
    """
    _check_counts(executor)
    if isinstance(executor, run.LocalExecutor):
        _check_local(executor, cpu_loop, gpus_here)
    elif isinstance(executor, run.SlurmExecutor):
        _check_slurm(executor)
    elif isinstance(executor, run.DockerExecutor):
        _check_docker(executor)
    elif isinstance(executor, (run.LeptonExecutor, run.DGXCloudExecutor)):
        _check_cluster_job(executor)
    if config is not None:
        _check_layout(executor, config.model)


def _check_layout(executor: Any, model: Any) -> None:
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


def _expected(annotation: Any) -> str:
    """What a value of ``annotation`` looks like on the command line."""
    text = getattr(annotation, "__name__", None) if isinstance(annotation, type) else None
    text = text or str(annotation).replace("typing.", "")
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is list:
        item = '{"key": "value"}' if args and typing.get_origin(args[0]) is dict else '"a", "b"'
        return f"{text}, e.g. '[{item}]' (quoted for the shell)"
    if origin is dict:
        return f'{text}, e.g. \'{{"key": "value"}}\' (quoted for the shell)'
    if annotation is int or int in args:
        return "a whole number"
    if annotation is bool or bool in args:
        return "true or false"
    return text


def build_executor(config: Any, name: str, settings: Sequence[str]) -> Any:
    """Apply ``executor.KEY=VALUE`` ``settings`` (prefix removed: ``KEY=VALUE``) to an executor factory's
    ``run.Config`` and build it; ``KEY`` may be nested (``tunnel.host=...``) or a dict entry (``env_vars.NAME=V``).

    Each bad setting is an ``ExecutorSettingError`` naming it, its value and what is allowed.
    """
    import fiddle as fdl
    from nemo_run.cli.cli_parser import CLIException, parse_cli_args

    executor_class = config.__fn_or_cls__
    fields = typing.get_type_hints(executor_class)
    public = sorted(field for field in fields if not field.startswith("_"))
    for setting in settings:
        key, sep, value = setting.partition("=")
        if not sep:
            raise ExecutorSettingError(f"executor.{setting} has no value; settings look like executor.KEY=VALUE.")
        head, _, rest = key.partition(".")
        if head not in fields or head.startswith("_"):
            close = difflib.get_close_matches(head, public, n=1)
            hint = f"did you mean executor.{close[0]}? " if close else ""
            raise ExecutorSettingError(
                f"executor.{key} is not a setting of {executor_class.__name__} (executor={name}); {hint}"
                f"settings: {', '.join(public)}."
            )
        if head == "env_vars" and rest:
            config.env_vars = {**(config.env_vars or {}), rest: value}
            continue
        parser_log = logging.getLogger("nemo_run.cli.cli_parser")
        level = parser_log.level
        parser_log.setLevel(logging.CRITICAL)  # it logs each failure at ERROR before raising; the error says it once
        try:
            parse_cli_args(config, [setting])
        except CLIException:
            expected = _expected(fields[head])
            raise ExecutorSettingError(
                f"executor.{key}={value!r} is invalid for {executor_class.__name__}: expected {expected}."
            ) from None
        finally:
            parser_log.setLevel(level)
    try:
        return fdl.build(config)
    except TypeError as error:
        missing = re.search(r"missing \d+ required (?:keyword-only )?arguments?: (.+)$", str(error).splitlines()[0])
        if missing:
            keys = re.findall(r"'(\w+)'", missing.group(1))
            required = ", ".join(f"executor.{key}" for key in keys)
            raise ExecutorSettingError(
                f"{required} {'is' if len(keys) == 1 else 'are'} required for executor={name} "
                f"(e.g. executor.{keys[0]}=...)."
            ) from None
        raise ExecutorSettingError(f"executor={name}: {str(error).splitlines()[0]}") from None
    except (AssertionError, ImportError, ValueError) as error:  # an executor's own __post_init__ check
        raise ExecutorSettingError(f"executor={name}: {' '.join(str(error).split())}") from None
