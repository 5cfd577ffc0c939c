"""The executors as one table (issue 24): ``jobs.executors.kinds.EXECUTORS`` holds, per ``executor=NAME``, the NeMo-Run
class, factory, checks, job-directory mount, dry-run description and whether the ranks run here; ``kind_of`` is the one
lookup by instance, so the plugin has no ``isinstance`` chain on executor classes and a new executor is one entry.

Real NeMo-Run executors throughout (built by the plugin's factories and NeMo-Run's ``fdl.build``).
"""

import pathlib
import re
from dataclasses import dataclass

import nemo_run as run
import pytest

from nemo_noise_plugin.jobs.executors import settings
from nemo_noise_plugin.jobs.executors.kinds import EXECUTORS, OTHER, ExecutorKind, kind_of
from nemo_noise_plugin.jobs.executors.settings import (
    EXECUTOR_FACTORIES,
    ExecutorSettingError,
    build_executor,
    check_executor,
)
from nemo_noise_plugin.jobs.executors.task import worker_run_dir
from tests.jobs.test_executors import RANK_SETTINGS

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "nemo_noise_plugin"


@dataclass(kw_only=True)
class BatchExecutor(run.Executor):
    """A NeMo-Run executor the plugin's table does not know (as one registered by another package)."""

    nodes: int = 1
    ntasks_per_node: int = 1

    def nnodes(self) -> int:
        return self.nodes

    def nproc_per_node(self) -> int:
        return self.ntasks_per_node


def test_each_entry_builds_its_class_and_kind_of_finds_the_entry_again():
    assert list(EXECUTORS) == ["local", "slurm", "slurm_ssh", "docker", "lepton", "dgxcloud"]
    for name, kind in EXECUTORS.items():
        assert kind.name == name and EXECUTOR_FACTORIES[name] is kind.factory
        required = RANK_SETTINGS[name][0] if name in RANK_SETTINGS else []  # e.g. DGX Cloud's URLs
        executor = build_executor(kind.factory(), name, required)
        assert type(executor) is kind.executor_class
        found = kind_of(executor)
        assert found.executor_class is kind.executor_class
        assert found is kind or (name, found.name) == ("slurm_ssh", "slurm")  # one class, same behaviour
    assert settings.COUNT_SETTINGS[run.DockerExecutor] == (None, "ntasks_per_node")
    assert settings.COUNT_SETTINGS[run.LeptonExecutor] == ("nodes", "gpus_per_node")


def test_the_nemo_command_registers_one_executor_factory_per_entry():
    from nemo_noise_plugin.cli import nemo_llm

    assert nemo_llm.registered_executors() == sorted(EXECUTORS)


def test_every_entry_is_in_the_one_rank_per_gpu_tests():
    """``tests/test_executors.py`` checks fewer / equal / more ranks than GPUs for each entry (local: this machine)."""
    assert set(RANK_SETTINGS) | {"local"} == set(EXECUTORS)


def test_no_isinstance_dispatch_on_executor_classes_in_the_plugin():
    pattern = re.compile(r"isinstance\([^,]+,\s*\(?\s*(run\.)?\w*Executor\b(?!Setting)")
    found = [
        f"{path.relative_to(PACKAGE)}:{number}"
        for path in PACKAGE.rglob("*.py")
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line) and "isinstance(config, Executor)" not in line
    ]
    assert found == []


def test_an_executor_outside_the_table_gets_the_shared_checks_and_nemo_runs_dry_run_text():
    executor = BatchExecutor(nodes=2, ntasks_per_node=4)
    assert kind_of(executor) is OTHER and worker_run_dir(executor) == "/nemo_run"
    check_executor(executor)
    with pytest.raises(ExecutorSettingError, match=r"^executor\.ntasks_per_node=0 is invalid: expected a whole"):
        check_executor(BatchExecutor(ntasks_per_node=0))


def test_a_subclass_of_a_table_class_is_that_entry():
    @dataclass(kw_only=True)
    class SiteSlurm(run.SlurmExecutor):
        pass

    assert kind_of(SiteSlurm(account="a")) is EXECUTORS["slurm"]


def test_adding_an_executor_is_one_table_entry(monkeypatch):
    def check_batch(executor, **_):
        if executor.nodes > 1:
            raise ExecutorSettingError("executor.nodes is invalid: the batch executor runs one node.")

    def batch_executor(nodes: int = 1) -> run.Config[BatchExecutor]:
        return run.Config(BatchExecutor, nodes=nodes)

    entry = ExecutorKind("batch", BatchExecutor, batch_executor, check_batch, lambda info, executor: "batch job")
    monkeypatch.setitem(EXECUTORS, "batch", entry)
    executor = build_executor(batch_executor(), "batch", ["nodes=2", "ntasks_per_node=2"])
    assert kind_of(executor) is entry
    with pytest.raises(ExecutorSettingError, match="the batch executor runs one node"):
        check_executor(executor)
    with pytest.raises(ExecutorSettingError, match=r"^1 node\(s\) x 4 ranks per node = 4 ranks is invalid"):
        check_executor(build_executor(batch_executor(), "batch", ["ntasks_per_node=4"]), _config(tp=8))


def test_where_the_task_sees_its_job_directory_comes_from_the_entry():
    local = build_executor(EXECUTORS["local"].factory(), "local", [])
    local.job_dir = "/home/me/nemo_run/experiments/x/task"
    slurm = build_executor(EXECUTORS["slurm"].factory(), "slurm", ["account=a", "tunnel.job_dir=/lustre/jobs"])
    slurm.job_dir = "/home/me/nemo_run/experiments/x/task"
    assert worker_run_dir(local) == local.job_dir
    assert worker_run_dir(slurm) == "/lustre/jobs/task"
    slurm.container_image = "nvcr.io/nvidia/nemo:25.11"
    assert worker_run_dir(slurm) == "/nemo_run"
    assert [name for name, kind in EXECUTORS.items() if kind.runs_here] == ["local"]


def _config(tp: int = 1):
    class Model:
        tensor_model_parallel_size = tp

    class Config:
        model = Model()

    return Config()
