"""``nemo llm finetune ... executor=local|slurm|docker|lepton|dgxcloud``: launches through NeMo-Run's executors (its
real packaging, dry run, torchx local scheduler and torchrun), checked before anything starts.

The dry runs print what NeMo-Run would launch (the sbatch script, the torchrun command, the container or cluster job)
and contact no Docker daemon or cluster (that the commands' dry runs open no CUDA context is
``tests/cli/test_gpu_free_dry_run.py``); the local executor really starts torchrun processes here (gloo on the CPU).
Every bad executor setting is also in the bad-input catalogue (``tests/support/bad_inputs.py``).
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import nemo_run as run
import pytest
import torch
import yaml
from nemo_run.config import get_nemorun_home, set_nemorun_home
from nemo_run.core.execution.launcher import Torchrun

from nemo_noise_plugin.jobs.executors.factories import local_executor, slurm_executor
from nemo_noise_plugin.jobs.executors.settings import (
    EXECUTOR_FACTORIES,
    ExecutorSettingError,
    build_executor,
    check_executor,
)
from nemo_noise_plugin.jobs.executors.task import run_on_executor
from tests.support.hub_configs import write_offline_hub
from tests.support.nemo2 import write_nemo2_llm

REPO = pathlib.Path(__file__).resolve().parents[2]
NEMO = pathlib.Path(sys.executable).with_name("nemo")
if not NEMO.exists():  # the plugin installed with --target (the GPU machine): its scripts are on PATH
    NEMO = pathlib.Path(shutil.which("nemo") or NEMO)
IMAGE = "nvcr.io/nvidia/nemo:25.11"


@pytest.fixture
def nemorun_home(tmp_path):
    """NeMo-Run's home (experiment folders) in a temporary directory."""
    previous = get_nemorun_home()
    home = tmp_path / "nemo_run_home"
    set_nemorun_home(str(home))
    yield home
    set_nemorun_home(previous)


@pytest.fixture(scope="module")
def cli_llm():
    from nemo_noise_plugin.cli import nemo_llm

    return nemo_llm


def _execute(cli_llm, args, **options):
    context = cli_llm.FinetuneRunContext(name="finetune", **options)
    context.cli_execute(cli_llm.finetune, list(args))


def _experiment_folders(home: pathlib.Path) -> list[pathlib.Path]:
    return sorted((home / "experiments").glob("*/*")) if (home / "experiments").exists() else []


def _nemo(tmp_path: pathlib.Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """The ``nemo`` command run in ``tmp_path`` with NeMo-Run's home under it (and ``env`` added)."""
    env = {**os.environ, "COLUMNS": "200", "NEMORUN_HOME": str(tmp_path / "home"), **env}
    return subprocess.run([str(NEMO), *args], capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)


@pytest.fixture
def offline_hub_with_llama_config(tmp_path, monkeypatch):
    """An offline Hugging Face cache holding the published ``meta-llama/Meta-Llama-3.1-8B`` config (and the other
    recipes' configs, ``tests/support/hub_configs.py``), which Bridge's llama31_8b SFT recipe reads when called."""
    hub = write_offline_hub(tmp_path / "hf") / "hub"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    import huggingface_hub.constants as hub_constants

    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(hub))
    return hub


# --- dry runs -------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_slurm_dry_run_of_llama31_8b_distillation_on_two_nodes_of_eight_gpus(
    cli_llm, nemorun_home, offline_hub_with_llama_config, capsys, monkeypatch
):
    monkeypatch.setattr(sys, "stdin", open(os.devnull))  # NeMo-Run's local tunnel hands stdin to its subprocesses
    args = [
        "executor=slurm",
        "executor.nodes=2",
        "executor.account=noise-acct",
        "executor.partition=batch",
        f"executor.container_image={IMAGE}",
        "executor.env_vars.NCCL_DEBUG=INFO",
        "model.noise.alpha=10",
        "model.kd.temperature=2",
        "checkpoint.pretrained_checkpoint=/ckpt/llama31_8b",
    ]
    _execute(cli_llm, args, factory="llama31_8b_noise_distillation", dryrun=True)
    out = capsys.readouterr().out
    summary, _, script = out.partition("#SBATCH")
    # resolved on the launching side: Bridge's layout, the plugin's settings, the task every rank runs
    assert "executor      SlurmExecutor on @localhost: 2 node(s) x 8 rank(s)" in summary
    assert "NoisyDistillationProvider" in summary and "TP=2, PP=1" in summary
    assert "alpha=10.0" in summary and "temperature=2.0" in summary
    assert "entry         megatron.bridge.training.finetune.finetune" in summary
    assert (
        "nemo_noise_plugin.cli.nemo_llm.finetune(factory='llama31_8b_noise_distillation', overrides=["
        "'model.noise.alpha=10', 'model.kd.temperature=2', 'checkpoint.pretrained_checkpoint=/ckpt/llama31_8b']"
    ) in summary
    sbatch = {key: value for key, _, value in (line.partition("=") for line in out.splitlines() if "=" in line)}
    assert sbatch["#SBATCH --nodes"] == "2"
    assert sbatch["#SBATCH --ntasks-per-node"] == "1"  # one torchrun per node ...
    assert sbatch["#SBATCH --gpus-per-node"] == "8"
    assert sbatch["#SBATCH --account"] == "noise-acct" and sbatch["#SBATCH --partition"] == "batch"
    (srun,) = [line for line in script.splitlines() if line.startswith("srun ")]
    assert f"--container-image {IMAGE}" in srun and ":/nemo_run --container-workdir /nemo_run/code" in srun
    # ... which starts 8 ranks on each of the 2 nodes, rendezvous on the head node
    assert "torchrun --rdzv-backend c10d --rdzv-endpoint $head_node_ip:29500" in srun
    assert "--nnodes 2 --nproc-per-node 8 --node-rank $SLURM_NODEID" in srun
    assert srun.endswith(
        "-m nemo_run.core.runners.fdl_runner -n llama31_8b_noise_distillation "
        "/nemo_run/configs/llama31_8b_noise_distillation_fn_or_script"
    )
    exports = {line.removeprefix("export ") for line in script.splitlines() if line.startswith("export ")}
    assert {"NCCL_DEBUG=INFO", "TORCH_NCCL_AVOID_RECORD_STREAMS=1", "NCCL_NVLS_ENABLE=0"} <= exports
    assert _experiment_folders(nemorun_home) == []  # the dry run's folder is removed; nothing was submitted


def _job_lines(out: str) -> dict[str, str]:
    """The ``Would launch`` block of a container or cluster job dry run: each line's label -> its value."""
    block = out.partition("Would launch (")[2]
    pairs = (re.split(r"\s{2,}", line.strip(), maxsplit=1) for line in block.splitlines()[1:] if line.strip())
    return {pair[0]: pair[1] for pair in pairs if len(pair) == 2}


def test_docker_dry_run_shows_the_container_its_gpus_mounts_and_torchrun_line(cli_llm, nemorun_home, capsys):
    args = [
        "executor=docker",
        f"executor.container_image={IMAGE}",
        'executor.volumes=["/data:/data"]',
        "executor.env_vars.NCCL_DEBUG=INFO",
        "model.noise.alpha=10",
        "train.global_batch_size=16",  # micro batch 2 x 8 data-parallel ranks (check_run_settings)
    ]
    _execute(cli_llm, args, factory="tiny_noise_distillation", dryrun=True)
    out = capsys.readouterr().out
    assert "executor      DockerExecutor: 1 node(s) x 8 rank(s)" in out
    assert "NoisyDistillationProvider" in out and "alpha=10.0" in out
    job = _job_lines(out)
    assert job["image"] == IMAGE
    assert job["resources"] == "8 GPU(s), runtime nvidia, ipc_mode host, shm_size 16g, network nemo_run"
    mounts = job["mounts"].split(", ")
    assert mounts[0] == "/data:/data"
    assert mounts[1].endswith("/tiny_noise_distillation:/nemo_run (the job directory)")
    assert pathlib.Path(mounts[1].split(":")[0]).is_relative_to(nemorun_home / "experiments")
    assert {"NCCL_DEBUG=INFO", "TORCH_NCCL_AVOID_RECORD_STREAMS=1", "NCCL_NVLS_ENABLE=0"} <= set(job["env"].split())
    assert job["command"].startswith("torchrun --rdzv-backend c10d --rdzv-endpoint localhost:0")
    assert "--nnodes 1 --nproc-per-node 8 --node-rank 0" in job["command"]
    assert job["command"].endswith(
        "-m nemo_run.core.runners.fdl_runner -n tiny_noise_distillation "
        "/nemo_run/configs/tiny_noise_distillation_fn_or_script"
    )
    assert _experiment_folders(nemorun_home) == []


@pytest.mark.slow
def test_lepton_dry_run_of_llama31_8b_distillation_on_two_nodes_of_eight_gpus(
    cli_llm, nemorun_home, offline_hub_with_llama_config, capsys
):
    args = [
        "executor=lepton",
        "executor.nodes=2",
        f"executor.container_image={IMAGE}",
        "executor.resource_shape=gpu.8xh100-80gb",
        "executor.node_group=noise-nodes",
        'executor.mounts=[{"path": "/", "mount_path": "/shared", "from": "node-nfs:shared"}]',
        "executor.nemo_run_dir=/shared/nemo_run",
        "executor.env_vars.NCCL_DEBUG=INFO",
        "model.noise.alpha=10",
    ]
    _execute(cli_llm, args, factory="llama31_8b_noise_distillation", dryrun=True)
    out = capsys.readouterr().out
    assert "executor      LeptonExecutor: 2 node(s) x 8 rank(s)" in out and "TP=2, PP=1" in out
    job = _job_lines(out)
    assert "  job Lepton job: 2 replica(s) of shape gpu.8xh100-80gb in node group noise-nodes\n" in out
    assert job["image"] == IMAGE and job["ranks"].startswith("2 node(s) x 8 GPU(s)")
    local_dir, _, rest = job["job dir"].partition(" is copied to ")
    remote_dir = rest.removesuffix(", linked at /nemo_run in the job")
    assert remote_dir.startswith("/shared/nemo_run/experiments/llama31_8b_noise_distillation/")
    assert remote_dir.removeprefix("/shared/nemo_run/") == str(pathlib.Path(local_dir).relative_to(nemorun_home))
    assert {"NCCL_DEBUG=INFO", "TORCH_NCCL_AVOID_RECORD_STREAMS=1", "NCCL_NVLS_ENABLE=0"} <= set(job["env"].split())
    assert job["command"] == (
        "torchrun --nnodes 2 --nproc-per-node 8 --node-rank $NODE_RANK --master-addr $MASTER_ADDR "
        "--master-port $MASTER_PORT -m nemo_run.core.runners.fdl_runner -n llama31_8b_noise_distillation "
        "/nemo_run/configs/llama31_8b_noise_distillation_fn_or_script"
    )
    assert _experiment_folders(nemorun_home) == []


def test_dgxcloud_dry_run_is_a_distributed_workload_and_prints_no_secret(cli_llm, nemorun_home, capsys):
    args = [
        "executor=dgxcloud",
        "executor.nodes=2",
        f"executor.container_image={IMAGE}",
        "executor.base_url=https://dgx.example/api/v1",
        "executor.kube_apiserver_url=https://k8s.example",
        "executor.client_id=noise-app",
        "executor.client_secret=do-not-print-me",
        "executor.project_name=noise",
        'executor.pvcs=[{"name": "ws", "path": "/workspace", "claimName": "ws-pvc"}]',
        "executor.pvc_nemo_run_dir=/workspace/nemo_run",
        "model.tensor_model_parallel_size=2",
        "train.global_batch_size=16",  # micro batch 2 x 8 data-parallel ranks (check_run_settings)
    ]
    _execute(cli_llm, args, factory="tiny_noise_sft", dryrun=True)
    out = capsys.readouterr().out
    assert "do-not-print-me" not in out
    assert "executor      DGXCloudExecutor: 2 node(s) x 8 rank(s)" in out and "TP=2" in out
    job = _job_lines(out)
    title = "  job DGX Cloud distributed (PyTorch, 2 workers) workload in project noise (https://dgx.example/api/v1)"
    assert f"{title}\n" in out
    assert "is copied to /workspace/nemo_run/experiments/tiny_noise_sft/" in job["job dir"]
    assert job["command"] == (
        "torchrun --nnodes 2 --nproc-per-node 8 -m nemo_run.core.runners.fdl_runner -n tiny_noise_sft "
        "/nemo_run/configs/tiny_noise_sft_fn_or_script"
    )
    assert _experiment_folders(nemorun_home) == []


def test_a_recipe_that_cannot_be_built_here_is_resolved_by_each_rank(cli_llm, nemorun_home, capsys):
    factory = "tests.support.executor_tasks.recipe_needing_the_hub"
    _execute(cli_llm, ["executor=local", "model.noise.alpha=3"], factory=factory, dryrun=True)
    out = capsys.readouterr().out
    assert "resolved by each rank: the recipe cannot be built here (OSError: huggingface.co unreachable)" in out
    (command,) = [line for line in out.splitlines() if line.strip().startswith("command ")]
    assert command.split()[1:6] == ["torchrun", "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0"]
    assert "--nnodes 1 --nproc-per-node 1" in command
    name = "tests_support_executor_tasks_recipe_needing_the_hub"
    assert f"-m nemo_run.core.runners.fdl_runner -n {name} {nemorun_home}/experiments/{name}/" in command
    assert command.endswith(f"/{name}/configs/{name}_fn_or_script")


@pytest.mark.slow
def test_nemo_llm_finetune_dry_run_with_a_local_executor_prints_the_torchrun_command(tmp_path):
    result = _nemo(
        tmp_path, "llm", "finetune", "-f", "tiny_noise_sft", "--dryrun", "executor=local", "train.train_iters=3"
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "executor      LocalExecutor: 1 node(s) x 1 rank(s)" in result.stdout
    assert "3 iterations" in result.stdout
    assert "--nnodes 1 --nproc-per-node 1 --node-rank 0 --tee 3 -m nemo_run.core.runners.fdl_runner" in result.stdout
    assert _experiment_folders(tmp_path / "home") == []


@pytest.mark.slow
def test_with_nemo2_installed_nemo_noise_finetune_launches_through_an_executor(tmp_path):
    """Where NeMo 2 owns ``nemo llm``, the plugin's command is ``nemo noise finetune``, executors included."""
    write_nemo2_llm(tmp_path / "nemo2")
    path = os.pathsep.join(filter(None, [str(tmp_path / "nemo2"), str(REPO), os.environ.get("PYTHONPATH")]))
    arguments = ["-f", "tiny_noise_sft", "--dryrun", "executor=slurm", "executor.account=acct", "executor.nodes=2"]
    arguments.append("train.global_batch_size=32")  # micro batch 2 x 16 data-parallel ranks (check_run_settings)
    result = _nemo(tmp_path, "noise", "finetune", *arguments, PYTHONPATH=path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "executor      SlurmExecutor on @localhost: 2 node(s) x 8 rank(s)" in result.stdout
    assert "#SBATCH --nodes=2" in result.stdout and "--nnodes 2 --nproc-per-node 8" in result.stdout
    assert _experiment_folders(tmp_path / "home") == []


# --- bad executor settings: one clear error, nothing started ---------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["executor=lokal"],
            "executor='lokal' is not a known executor; available: dgxcloud, docker, lepton, local, slurm, slurm_ssh",
        ),
        (
            ["executor.nodes=2"],
            "'executor.nodes=2' needs an executor: add executor=NAME "
            "(dgxcloud, docker, lepton, local, slurm, slurm_ssh)",
        ),
        (
            ["executor=local", "executor.ntask_per_node=2"],
            "executor.ntask_per_node is not a setting of LocalExecutor (executor=local); "
            "did you mean executor.ntasks_per_node?",
        ),
        (["executor=local", "executor.ntasks_per_node=two"], "executor.ntasks_per_node='two' is invalid"),
        (
            ["executor=slurm", "executor.account="],
            "executor.account= has an empty value: expected str; leave the setting out for SlurmExecutor's default.",
        ),
        (["executor=slurm", "executor.nodes=2"], "executor.account is required for executor=slurm"),
        (["executor=local", "executor.nodes=2"], "executor.nodes=2 is invalid: executor=local runs on this machine"),
        (["executor=local", "executor.ntasks_per_node=0"], "executor.ntasks_per_node=0 is invalid: expected a whole"),
        (["plugins=nsys"], "NeMo-Run plugins are not supported"),
    ],
)
def test_bad_executor_settings_are_one_clear_error_before_anything_starts(cli_llm, nemorun_home, args, message):
    from nemo_run.cli.api import RunContextError

    with pytest.raises(RunContextError) as error:
        _execute(cli_llm, args, factory="tiny_noise_sft", skip_confirmation=True)
    assert message in str(error.value)
    assert _experiment_folders(nemorun_home) == []


def test_ranks_that_do_not_fit_the_model_parallel_layout_are_an_error(cli_llm, nemorun_home):
    from nemo_run.cli.api import RunContextError

    args = [
        "executor=slurm",
        "executor.account=a",
        "executor.gpus_per_node=3",
        "executor.ntasks_per_node=3",
        "model.tensor_model_parallel_size=2",
    ]
    with pytest.raises(
        RunContextError,
        match=r"1 node\(s\) x 3 ranks per node = 3 ranks is invalid for "
        r"model\.tensor_model_parallel_size=2 x .*multiple of 2",
    ):
        _execute(cli_llm, args, factory="tiny_noise_sft", dryrun=True)
    assert _experiment_folders(nemorun_home) == []


def test_a_bad_override_is_an_error_before_the_executor_starts(cli_llm, nemorun_home):
    from nemo_run.cli.api import RunContextError

    with pytest.raises(RunContextError, match=r"model\.noise\.alpah is not a field of NoiseConfig"):
        _execute(cli_llm, ["executor=local", "model.noise.alpah=3"], factory="tiny_noise_sft", skip_confirmation=True)
    assert _experiment_folders(nemorun_home) == []


def test_the_cpu_loop_runs_in_one_process_and_other_recipes_need_a_gpu():
    executor = build_executor(local_executor(), "local", ["ntasks_per_node=2"])
    with pytest.raises(ExecutorSettingError, match="no GPU, and the CPU loop runs in one process"):
        check_executor(executor, cpu_loop=True, gpus_here=0)
    with pytest.raises(ExecutorSettingError, match="Bridge's training loop needs a GPU"):
        check_executor(build_executor(local_executor(), "local", []), cpu_loop=False, gpus_here=0)
    with pytest.raises(ExecutorSettingError, match="this machine has 1 GPU"):
        check_executor(executor, gpus_here=1)


def test_slurm_factory_gives_one_torchrun_rank_per_gpu():
    executor = build_executor(slurm_executor(), "slurm", ["account=a", "nodes=4", "env_vars.NCCL_DEBUG=WARN"])
    check_executor(executor)
    assert isinstance(executor.get_launcher(), Torchrun)
    assert (executor.nnodes(), executor.nproc_per_node(), executor.ntasks_per_node) == (4, 8, 1)
    assert executor.env_vars["NCCL_DEBUG"] == "WARN" and executor.container_image is None


GPUS = 8
RANK_SETTINGS = {
    "slurm": (["account=a"], "gpus_per_node", "ntasks_per_node"),
    "slurm_ssh": (
        ["account=a", "tunnel.host=login", "tunnel.user=me", "tunnel.job_dir=/jobs"],
        "gpus_per_node",
        "ntasks_per_node",
    ),
    "docker": ([f"container_image={IMAGE}"], "num_gpus", "ntasks_per_node"),
    "lepton": (
        [
            f"container_image={IMAGE}",
            "resource_shape=gpu.8xh100-80gb",
            "node_group=noise-nodes",
            'mounts=[{"path": "/", "mount_path": "/shared"}]',
            "nemo_run_dir=/shared/nemo_run",
        ],
        "gpus_per_node",
        "nprocs_per_node",
    ),
    "dgxcloud": (
        [
            f"container_image={IMAGE}",
            "base_url=https://dgx.example/api/v1",
            "kube_apiserver_url=https://k8s.example",
            "client_id=noise-app",
            "client_secret=secret",
            "project_name=noise",
            'pvcs=[{"name": "ws", "path": "/workspace", "claimName": "ws-pvc"}]',
            "pvc_nemo_run_dir=/workspace/nemo_run",
        ],
        "gpus_per_node",
        "nprocs_per_node",
    ),
}
"""Per executor that launches on GPUs it requests: its other required settings, the setting that counts GPUs per
node and the one that counts torchrun ranks per node (docs/cli.md: they must be equal)."""


@pytest.mark.parametrize("ranks", [GPUS // 2, GPUS, 2 * GPUS], ids=["fewer", "equal", "more"])
@pytest.mark.parametrize("name", sorted(RANK_SETTINGS))
def test_cluster_and_container_executors_run_exactly_one_rank_per_requested_gpu(name, ranks):
    settings, gpus_key, ranks_key = RANK_SETTINGS[name]
    executor = build_executor(
        EXECUTOR_FACTORIES[name](), name, [*settings, f"{gpus_key}={GPUS}", f"{ranks_key}={ranks}"]
    )
    if ranks == GPUS:
        check_executor(executor)
        assert executor.nproc_per_node() == GPUS
        return
    message = rf"^executor\.{ranks_key}={ranks} is invalid: .*one rank per GPU.*executor\.{gpus_key}={GPUS}\.$"
    with pytest.raises(ExecutorSettingError, match=message):
        check_executor(executor)


@pytest.mark.parametrize("ranks", [GPUS // 2, GPUS, 2 * GPUS], ids=["fewer", "equal", "more"])
def test_the_local_executor_runs_at_most_one_rank_per_gpu_of_this_machine(ranks):
    """docs/cli.md: ``executor=local`` may leave GPUs of this machine idle, but never runs two ranks on one."""
    executor = build_executor(local_executor(), "local", [f"ntasks_per_node={ranks}"])
    if ranks <= GPUS:
        check_executor(executor, gpus_here=GPUS)
        assert executor.nproc_per_node() == ranks
        return
    message = rf"^executor\.ntasks_per_node={ranks} is invalid: this machine has {GPUS} GPU\(s\); use at most that\.$"
    with pytest.raises(ExecutorSettingError, match=message):
        check_executor(executor, gpus_here=GPUS)


def test_verbose_reaches_the_task_through_the_executor_environment(cli_llm):
    from nemo_noise_plugin.cli.console import VERBOSE_ENV

    quiet = cli_llm.FinetuneRunContext(name="finetune", factory="tiny_noise_sft")
    assert VERBOSE_ENV not in quiet._executor("slurm", ["account=a"]).env_vars
    verbose = cli_llm.FinetuneRunContext(name="finetune", factory="tiny_noise_sft")
    verbose.verbose = True
    assert verbose._executor("slurm", ["account=a"]).env_vars[VERBOSE_ENV] == "1"


# --- real launches on this machine -----------------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="the task runs Megatron on gloo with the CPU substitutes")
@pytest.mark.multiprocess
@pytest.mark.slow
def test_local_executor_runs_a_gloo_task_on_two_torchrun_ranks_with_logs_in_the_experiment_folder(
    nemorun_home, tmp_path, megatron_cpu
):
    from nemo_noise_plugin.noise.config import NoiseConfig
    from nemo_noise_plugin.noise.geometry import NoiseBatchInputs
    from nemo_noise_plugin.noise.layer import EmbeddingNoise
    from nemo_noise_plugin.noise.schedule import NoiseClock
    from tests.support.executor_tasks import NOISE_ITERATION, noise_batch, noisy_model_noise_under_tp

    out = tmp_path / "ranks"
    out.mkdir()
    executor = build_executor(local_executor(), "local", ["ntasks_per_node=2", f"env_vars.PYTHONPATH={REPO}"])
    task = run.Partial(noisy_model_noise_under_tp, out_dir=str(out))
    job = run_on_executor(task, executor, name="noise_layout", print_fn=lambda _: None)

    first, second = (torch.load(out / f"rank{rank}.pt") for rank in (0, 1))
    assert (first["world_size"], second["world_size"]) == (2, 2)
    tokens, loss_mask, _ = noise_batch()
    clock = NoiseClock(iteration=NOISE_ITERATION)
    layer = EmbeddingNoise(NoiseConfig(alpha=5.0, seed=99), sequence_parallel=False, pg_collection=None)
    reference = layer(torch.zeros(16, 4, 64), NoiseBatchInputs(loss_mask=loss_mask, input_ids=tokens), clock)
    assert torch.equal(first["noise"], second["noise"])  # TP=2 without SP: replicated, identical noise
    assert torch.equal(first["noise"], reference)  # and the single-process noise
    job_dir = pathlib.Path(job.executor.job_dir)
    assert job_dir.is_relative_to(nemorun_home / "experiments" / "noise_layout")
    logs = "".join(path.read_text() for path in job_dir.rglob("*.log"))
    assert "rank 0/2: noise (16, 4, 64) written" in logs and "rank 1/2: noise (16, 4, 64) written" in logs


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU loop, which runs where CUDA is missing")
@pytest.mark.slow
def test_finetune_through_the_local_executor_leaves_config_logs_and_report_in_the_experiment_folder(
    cli_llm, nemorun_home, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    _execute(
        cli_llm,
        ["executor=local", "train.train_iters=2", "model.noise.alpha=7"],
        factory="tiny_noise_sft",
        skip_confirmation=True,
    )
    assert "Experiment folder:" in capsys.readouterr().out
    (experiment,) = _experiment_folders(nemorun_home)
    job_dir = experiment / "tiny_noise_sft"
    config = yaml.safe_load((job_dir / "config.yaml").read_text())
    assert (config["train"]["train_iters"], config["model"]["noise"]["alpha"]) == (2, 7.0)
    (report,) = job_dir.rglob("robustness.json")  # jobs/reports/robustness.py puts each report in its own folder
    assert json.loads(report.read_text()) and report.with_suffix(".png").stat().st_size > 10_000
    logs = "".join(path.read_text() for path in job_dir.rglob("*.log"))
    assert "CPU loop (Bridge's training loop needs CUDA)" in logs and "2/2" in logs
    assert "Traceback" not in logs and "Transformer Engine and Apex are not installed" not in logs  # a quiet task
    assert (job_dir / "configs" / "tiny_noise_sft_config.yaml").is_file()  # NeMo-Run's record of the task
    # the run is reproducible from its folder: the factory + config.yaml resolve to the same config
    again = tmp_path / "again.yaml"
    cli_llm.finetune(factory="tiny_noise_sft", config_file=str(job_dir / "config.yaml"), to_yaml=str(again))
    assert again.read_text() == (job_dir / "config.yaml").read_text()
