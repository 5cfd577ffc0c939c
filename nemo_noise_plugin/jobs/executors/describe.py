"""What a dry run of each NeMo-Run executor would launch, from NeMo-Run's own dry-run info (``AppDryRunInfo``).

``jobs.executors.kinds.EXECUTORS`` names one of these per executor. Slurm's, and any executor's outside the table,
is NeMo-Run's own dry-run text (the sbatch script, the scheduler's request). The local command, the Docker container
and the Lepton / DGX Cloud jobs are spelled out here because NeMo-Run's text for them is a raw ``pprint`` or prints
the executor with its secrets. Importing this module is cheap (NeMo-Run, no torch or Bridge).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from nemo_run.config import RUNDIR_NAME

__all__ = [
    "WORKDIR_NOTE",
    "describe_dgxcloud_job",
    "describe_docker_containers",
    "describe_lepton_job",
    "describe_local_command",
    "nemo_run_dry_run_text",
]

WORKDIR_NOTE = f"/{RUNDIR_NAME}/code (the recipe's relative paths, e.g. its checkpoints, resolve there)"
"""Where a container or cluster job's ranks run: ``finetune`` resolves the recipe again there."""


def nemo_run_dry_run_text(info: Any, executor: Any) -> str:
    """NeMo-Run's own dry-run text of ``info`` (its scheduler's formatter: Slurm's is the sbatch script)."""
    return repr(info)


def _env_line(env: dict[str, str]) -> str:
    return " ".join(f"{key}={value}" for key, value in sorted(env.items()))


def _fields(title: str, fields: Sequence[tuple[str, str]]) -> str:
    """``title`` and one indented ``label  value`` line per field."""
    return "\n".join([f"  {title}", *(f"    {label:<10} {value}" for label, value in fields)])


def describe_local_command(info: Any, executor: Any) -> str:
    """The processes of NeMo-Run's local scheduler: per role and replica its folder, environment, command, logs."""
    lines = []
    for role, replicas in info.request.role_params.items():
        for index, params in enumerate(replicas):
            lines += [
                f"  role {role}, replica {index}",
                f"    cwd     {params.cwd}",
                f"    env     {_env_line(params.env)}",
                f"    command {' '.join(params.args)}",
                f"    stdout  {params.stdout}",
                f"    stderr  {params.stderr}",
            ]
    return "\n".join(lines)


def describe_docker_containers(info: Any, executor: Any) -> str:
    """Each ``docker run`` of NeMo-Run's Docker scheduler."""
    return "\n".join(_describe_container(container, executor) for container in info.request.containers)


def _describe_container(container: Any, executor: Any) -> str:
    """A ``docker run`` of NeMo-Run's Docker scheduler: the container, its resources, mounts and command."""
    resources = [f"{executor.num_gpus} GPU(s)" if executor.num_gpus else "no GPU request"]
    resources += [
        f"{key} {getattr(executor, key)}"
        for key in ("runtime", "ipc_mode", "shm_size")
        if getattr(executor, key) is not None
    ]
    mounts = [*executor.volumes, f"{executor.job_dir}:/{RUNDIR_NAME} (the job directory)"]
    return _fields(
        f"container {container.name} (docker run on this machine's daemon)",
        [
            ("image", executor.container_image),
            ("resources", f"{', '.join(resources)}, network {executor.network}"),
            ("ulimits", " ".join(executor.ulimits) or "-"),
            ("mounts", ", ".join(mounts)),
            ("workdir", WORKDIR_NOTE),
            ("env", _env_line(executor.env_vars | container.extra_env)),
            ("command", " ".join(container.command)),
            ("log", f"/{RUNDIR_NAME}/log_{container.name}.out"),
        ],
    )


def describe_lepton_job(info: Any, executor: Any) -> str:
    """A Lepton job: what NeMo-Run copies to the mounted storage, and the job (no secret values)."""
    job = f"Lepton job: {executor.nodes} replica(s) of shape {executor.resource_shape}"
    job += f" in node group {executor.node_group}"
    return _describe_cluster_job(
        info.request, executor, job, executor.lepton_job_dir, executor.mounts, sorted(executor.secret_vars)
    )


def describe_dgxcloud_job(info: Any, executor: Any) -> str:
    """A DGX Cloud workload: what NeMo-Run copies to the PVC, and the workload (no client secret)."""
    kind = "training"
    if executor.nodes > 1:
        kind = f"distributed ({executor.distributed_framework}, {executor.nodes} workers)"
    job = f"DGX Cloud {kind} workload in project {executor.project_name} ({executor.base_url})"
    return _describe_cluster_job(info.request, executor, job, executor.pvc_job_dir, executor.pvcs, [])


def _describe_cluster_job(
    request: Any, executor: Any, job: str, remote_dir: str, storage: Sequence[Any], secrets: Sequence[str]
) -> str:
    """A Lepton job or DGX Cloud workload: what NeMo-Run copies to shared storage and the job it then creates."""
    (role,) = request.app.roles
    fields = [
        ("image", executor.container_image),
        ("ranks", f"{executor.nnodes()} node(s) x {executor.nproc_per_node()} GPU(s), one torchrun rank per GPU"),
        ("storage", ", ".join(str(entry) for entry in storage)),
        ("job dir", f"{executor.job_dir} is copied to {remote_dir}, linked at /{RUNDIR_NAME} in the job"),
        ("workdir", WORKDIR_NOTE),
        ("env", _env_line(executor.env_vars | role.env)),
    ]
    if secrets:
        fields.append(("secrets", f"{', '.join(secrets)} (from the workspace's secrets)"))
    fields.append(("command", " ".join(request.cmd)))
    return _fields(f"job {job}", fields)
