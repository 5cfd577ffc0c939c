"""Launching the finetune flow through NeMo-Run executors: the executor factories, the task, checks and dry run.

``nemo llm finetune ... executor=local|slurm|slurm_ssh executor.KEY=VALUE`` (``cli.nemo_llm``) resolves the
recipe and its overrides here on the launching side where it can (bad overrides and executor settings that cannot
work are errors before anything starts), builds the task as a ``run.Partial`` of the command's own entry point
(factory name, overrides, YAML file: the worker resolves the same config), and runs it in a NeMo-Run
``Experiment`` with that executor. ``RunDirectory`` points the task at its job directory as the worker sees it, so
the experiment folder holds the resolved ``config.yaml``, the logs and the robustness report. A dry run prints
exactly what would be launched (the torchrun command, the sbatch script, the scheduler request) and starts nothing.

Importing this module is cheap (NeMo-Run, no torch or Bridge): ``nemo`` imports it with ``cli.nemo_llm``.
"""

from __future__ import annotations

import os
import pprint
import re
import shutil
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import nemo_run as run
from nemo_run.config import RUNDIR_NAME
from nemo_run.core.execution.launcher import Torchrun

from nemo_noise_plugin.training.finetune import FinetuneError, apply_overrides, build_config

__all__ = [
    "EXECUTOR_FACTORIES",
    "ExecutorSettingError",
    "RunDirectory",
    "check_executor",
    "build_executor",
    "describe_launch",
    "finetune_task",
    "launch_finetune",
    "local_executor",
    "resolve_on_launcher",
    "run_on_executor",
    "slurm_executor",
    "slurm_ssh_executor",
    "worker_run_dir",
]

DEFAULT_ENV_VARS = {"TORCH_NCCL_AVOID_RECORD_STREAMS": "1", "NCCL_NVLS_ENABLE": "0"}
"""Environment every factory sets (Megatron's usual NCCL settings); ``+executor.env_vars.K=V`` adds more."""


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


EXECUTOR_FACTORIES: dict[str, Callable[..., Any]] = {
    "local": local_executor,
    "slurm": slurm_executor,
    "slurm_ssh": slurm_ssh_executor,
}
"""``executor=NAME`` -> factory; ``cli.nemo_llm`` registers them with NeMo-Run for ``finetune``'s run context."""


def worker_run_dir(executor: Any) -> str:
    """The job directory of an assigned ``executor`` as the task's processes see it.

    Local runs see NeMo-Run's job directory itself; a Slurm job without a container sees it under the tunnel's
    directory; containers (Slurm with ``container_image``, Docker, Skypilot, Lepton, ...) see it mounted at
    ``/nemo_run``.
    """
    if isinstance(executor, run.LocalExecutor):
        return executor.job_dir
    if isinstance(executor, run.SlurmExecutor) and executor.container_image is None:
        return os.path.join(executor.tunnel.job_dir, os.path.basename(executor.job_dir))
    return f"/{RUNDIR_NAME}"


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
    recipe: Callable[[], Any], factory: str, overrides: Sequence[str], config_file: str | None
) -> tuple[Any, str | None]:
    """``(config, None)`` with the overrides applied and checked, or ``(None, why)`` when the recipe cannot be built
    here (e.g. it reads its HF config from a hub this machine cannot reach): the worker then resolves it.

    Unknown factories, bad overrides and bad YAML are ``FinetuneError`` either way.
    """
    for override in overrides:
        if override.startswith("-"):
            raise FinetuneError(f"unknown option {override!r}; overrides look like key=value, +key=value or ~key.")
    try:
        base = build_config(recipe, factory)
    except FinetuneError:
        raise
    except Exception as error:  # the recipe itself failed: network, missing files, ...
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
        return None, f"{type(error).__name__}: {first_line}"[:300]
    return apply_overrides(base, overrides, config_file), None


def _setting_error(key: str, value: Any, allowed: str) -> ExecutorSettingError:
    return ExecutorSettingError(f"executor.{key}={value!r} is invalid: {allowed}.")


def _world_size(executor: Any) -> int:
    return executor.nnodes() * executor.nproc_per_node()


def check_executor(executor: Any, config: Any = None, *, cpu_loop: bool = False, gpus_here: int | None = None) -> None:
    """Reject executor settings that cannot work, before anything starts (``ExecutorSettingError``).

    Counts must be positive; a local run has one node and several ranks need the torchrun launcher; with a resolved
    ``config`` the world size must be a multiple of TP x PP x CP. For a local run ``gpus_here`` (this machine's GPU
    count) bounds the ranks; with no GPU only a recipe with a CPU loop (``cpu_loop``) runs, in one process.
    """
    from nemo_noise_plugin.training.launch import GPU_REQUIRED_MESSAGE

    nodes, tasks = executor.nodes, executor.ntasks_per_node
    if not isinstance(nodes, int) or nodes < 1:
        raise _setting_error("nodes", nodes, "expected a whole number of nodes >= 1")
    if not isinstance(tasks, int) or tasks < 1:
        raise _setting_error("ntasks_per_node", tasks, "expected a whole number of ranks per node >= 1")
    launcher = executor.get_launcher()
    if isinstance(executor, run.LocalExecutor):
        if nodes != 1:
            raise _setting_error("nodes", nodes, "executor=local runs on this machine (1 node); use executor=slurm")
        if tasks > 1 and not isinstance(launcher, Torchrun):
            raise _setting_error(
                "launcher", executor.launcher, f"{tasks} ranks per node need executor.launcher=torchrun"
            )
        if gpus_here == 0 and not cpu_loop:
            raise ExecutorSettingError(f"executor=local on this machine: {GPU_REQUIRED_MESSAGE}")
        if gpus_here == 0 and tasks > 1:
            raise _setting_error(
                "ntasks_per_node", tasks, "this machine has no GPU, and the CPU loop runs in one process (use 1)"
            )
        if gpus_here and tasks > gpus_here:
            raise _setting_error("ntasks_per_node", tasks, f"this machine has {gpus_here} GPU(s); use at most that")
    if isinstance(executor, run.SlurmExecutor):
        if not executor.account:
            raise _setting_error("account", executor.account, "executor=slurm needs a Slurm account")
        gpus = executor.gpus_per_node
        if isinstance(launcher, Torchrun) and gpus and executor.nproc_per_node() != gpus:
            raise _setting_error(
                "ntasks_per_node",
                executor.nproc_per_node(),
                f"one rank per GPU expected: executor.gpus_per_node={gpus}",
            )
    if config is not None:
        model = config.model
        sizes = {
            "tensor_model_parallel_size": getattr(model, "tensor_model_parallel_size", 1) or 1,
            "pipeline_model_parallel_size": getattr(model, "pipeline_model_parallel_size", 1) or 1,
            "context_parallel_size": getattr(model, "context_parallel_size", 1) or 1,
        }
        model_parallel = sizes["tensor_model_parallel_size"] * sizes["pipeline_model_parallel_size"]
        model_parallel *= sizes["context_parallel_size"]
        world = _world_size(executor)
        if world % model_parallel:
            layout = " x ".join(f"model.{key}={value}" for key, value in sizes.items())
            raise ExecutorSettingError(
                f"executor.nodes={nodes} x {executor.nproc_per_node()} ranks per node = {world} ranks is invalid for "
                f"{layout}: the number of ranks must be a multiple of {model_parallel}."
            )


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
    """What a prepared and dry-run NeMo-Run job would launch: the sbatch script, the local command, or the request."""
    info = job._dryrun_info  # set by Job.launch(dryrun=True); NeMo-Run offers no public accessor
    request = info.request
    if isinstance(job.executor, run.SlurmExecutor):
        return str(request)
    if isinstance(job.executor, run.LocalExecutor):
        lines = []
        for role, replicas in request.role_params.items():
            for index, params in enumerate(replicas):
                env = " ".join(f"{key}={value}" for key, value in sorted(params.env.items()))
                lines += [
                    f"  role {role}, replica {index}",
                    f"    cwd     {params.cwd}",
                    f"    env     {env}",
                    f"    command {' '.join(params.args)}",
                    f"    stdout  {params.stdout}",
                    f"    stderr  {params.stderr}",
                ]
        return "\n".join(lines)
    return pprint.pformat(request, width=120)


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

    if isinstance(executor, run.LocalExecutor):
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
    launching side. Everything that can be checked here is checked before anything starts; a dry run skips only the
    checks against this machine's GPUs. Returns the NeMo-Run job (None when ``confirm`` declines).
    """
    from nemo_noise_plugin.recipes import RECIPES
    from nemo_noise_plugin.training.finetune import describe

    if config_file is not None and not os.path.isfile(config_file):
        raise FinetuneError(f"--config-file {config_file!r} is not a file.")
    config, why = resolve_on_launcher(recipe, factory, overrides, config_file)
    local = isinstance(executor, run.LocalExecutor)
    gpus_here = _gpu_count() if local and not dryrun else None
    check_executor(
        executor, config, cpu_loop=factory in RECIPES and RECIPES[factory].embedded_corpus, gpus_here=gpus_here
    )
    if local and gpus_here == 0:  # the CPU loop: one process that makes its own gloo group, so no torchrun agent
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


def build_executor(config: Any, name: str, settings: Sequence[str]) -> Any:
    """Apply ``executor.KEY=VALUE`` ``settings`` (prefix removed: ``KEY=VALUE``) to an executor factory's
    ``run.Config`` and build it; ``KEY`` may be nested (``tunnel.host=...``) or a dict entry (``env_vars.NAME=V``).

    Each bad setting is an ``ExecutorSettingError`` naming it, its value and what is allowed.
    """
    import difflib
    import typing

    import fiddle as fdl
    from nemo_run.cli.cli_parser import CLIException, parse_cli_args

    executor_class = config.__fn_or_cls__
    fields = typing.get_type_hints(executor_class)
    for setting in settings:
        key, sep, value = setting.partition("=")
        if not sep:
            raise ExecutorSettingError(f"executor.{setting} has no value; settings look like executor.KEY=VALUE.")
        head, _, rest = key.partition(".")
        public = sorted(field for field in fields if not field.startswith("_"))
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
        try:
            parse_cli_args(config, [setting])
        except CLIException as error:
            raise ExecutorSettingError(
                f"executor.{key}={value!r} is invalid for {executor_class.__name__}: expected {fields[head]} "
                f"({str(error).splitlines()[0][:200]})"
            ) from None
    try:
        return fdl.build(config)
    except TypeError as error:
        missing = re.search(r"missing \d+ required (?:keyword-only )?arguments?: '(\w+)'", str(error))
        if missing:
            raise ExecutorSettingError(
                f"executor.{missing.group(1)} is required for executor={name} (e.g. executor.{missing.group(1)}=...)."
            ) from None
        raise ExecutorSettingError(f"executor={name}: {str(error).splitlines()[0]}") from None
