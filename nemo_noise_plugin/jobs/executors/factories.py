"""The NeMo-Run executor factories of ``executor=NAME``: each a ``run.Config`` with one torchrun rank per GPU.

Every factory ships no code (the plugin is installed where the job runs: this environment, or the container image)
and sets ``DEFAULT_ENV_VARS``; ``jobs.executors.kinds.EXECUTORS`` pairs each with its NeMo-Run class and checks.
Importing this module is cheap (NeMo-Run, no torch or Bridge).
"""

from __future__ import annotations

import nemo_run as run

__all__ = [
    "DEFAULT_ENV_VARS",
    "dgxcloud_executor",
    "docker_executor",
    "lepton_executor",
    "local_executor",
    "slurm_executor",
    "slurm_ssh_executor",
]

DEFAULT_ENV_VARS = {"TORCH_NCCL_AVOID_RECORD_STREAMS": "1", "NCCL_NVLS_ENABLE": "0"}
"""Environment every factory sets (Megatron's usual NCCL settings); ``executor.env_vars.K=V`` adds more."""


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
