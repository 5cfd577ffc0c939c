"""``torchrun --nproc-per-node 8`` on a machine without a GPU (issue 36, finding 6): one line from the plugin, before
the stack is imported, instead of 241 lines and 5 tracebacks after minutes of imports.

Three parts: the rank count is checked before anything heavy (``check_torchrun_ranks``); an error every rank meets
alike is said by rank 0 only (``rank_zero_says_it``); and the line an interrupt prints imports nothing, so a rank that
torchrun stops in the middle of an import ends with that line, not with a second, failing import of torch.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch

from nemo_noise_plugin.cli import exits
from nemo_noise_plugin.cli import finetune as finetune_cli
from nemo_noise_plugin.jobs.launch.launcher import check_torchrun_ranks
from nemo_noise_plugin.validation import SettingError

REPO = pathlib.Path(__file__).resolve().parents[2]
no_gpu_here = pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without a GPU")


@no_gpu_here
@pytest.mark.parametrize(
    ("cpu_loop", "advice"),
    [(True, "the CPU loop runs in one process: run the command without torchrun"), (False, "needs a GPU")],
)
def test_torchrun_ranks_without_a_gpu_are_refused_naming_nproc_per_node(monkeypatch, cpu_loop, advice):
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with pytest.raises(SettingError) as refused:
        check_torchrun_ranks(cpu_loop=cpu_loop)
    message = str(refused.value)
    assert message.startswith(
        "torchrun --nproc-per-node=8 is invalid: expected a GPU per rank: this machine has no GPU; "
    )
    assert advice in message


@no_gpu_here
def test_one_rank_per_node_on_two_nodes_names_nnodes(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    with pytest.raises(SettingError, match=r"^torchrun --nnodes=2 is invalid"):
        check_torchrun_ranks(cpu_loop=True)


def test_one_process_is_not_checked(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    check_torchrun_ranks(cpu_loop=False)


@pytest.mark.parametrize("rank", ["0", "1"])
def test_an_error_every_rank_meets_is_said_by_rank_0_only(monkeypatch, capsys, rank):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setattr(exits, "RANK_ZERO_WAIT_S", 0.01)  # torchrun would stop rank 1 before this ends
    arguments = ["-f", "tiny_noise_sft", "--dryrun", "train.train_iters=0"]
    if rank == "0":
        assert finetune_cli.main(arguments) == 2
    else:
        with pytest.raises(SystemExit) as stopped:
            finetune_cli.main(arguments)
        assert stopped.value.code == 2
    error = capsys.readouterr().err
    assert error.count("train.train_iters=0 is invalid") == (1 if rank == "0" else 0), error


def test_nemo_llm_finetunes_wrapped_error_is_said_by_rank_0_only_too(monkeypatch, capsys):
    """``nemo llm finetune`` under torchrun: NeMo-Run wraps the error in its ``RunContextError``."""
    from nemo_run.cli.api import RunContextError

    from nemo_noise_plugin.cli.exits import rank_zero_says_it, run_command
    from nemo_noise_plugin.jobs.launch.launcher import GPU_REQUIRED_MESSAGE, GPUUnavailableError

    def body():
        try:
            raise GPUUnavailableError(GPU_REQUIRED_MESSAGE)
        except GPUUnavailableError as error:
            raise RunContextError(str(error)) from error

    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setattr(exits, "RANK_ZERO_WAIT_S", 0.01)
    monkeypatch.setenv("RANK", "3")
    with pytest.raises(SystemExit) as stopped:
        run_command(rank_zero_says_it()(body), prefix="Error")
    assert stopped.value.code == 1 and capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    assert run_command(rank_zero_says_it()(body), prefix="Error") == 1
    assert capsys.readouterr().err == f"Error: {GPU_REQUIRED_MESSAGE}\n"


def test_the_interrupt_line_imports_nothing():
    """torchrun stops the other ranks when one fails; one stopped while importing torch used to import it again to
    find its checkpoints (a traceback, even a segmentation fault). Not imported means no run started."""
    code = (
        "import sys\n"
        "from nemo_noise_plugin.cli.exits import checkpoint_sentence\n"
        "print(checkpoint_sentence())\n"
        "print(sorted(name for name in ('torch', 'nemo_noise_plugin.jobs.launch.launcher') if name in sys.modules))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.splitlines() == [
        "no checkpoint was saved yet, so the same command starts from iteration 0",
        "[]",
    ]


def test_the_interrupt_line_still_names_a_saved_state(tmp_path, monkeypatch):
    from nemo_noise_plugin.cli.exits import checkpoint_sentence
    from nemo_noise_plugin.jobs.cpu.checkpoint import CpuCheckpoint

    monkeypatch.setattr(CpuCheckpoint, "_OPENED", [])
    saved = CpuCheckpoint(str(tmp_path), str(tmp_path), "3" * 16).save({"iteration": 2})
    assert checkpoint_sentence() == f"checkpoint: {saved} (the same command resumes from there)"


@no_gpu_here
@pytest.mark.slow  # two ranks that stop before the stack is imported: 21 s for eight at load 16 on 2 cores
def test_torchrun_without_a_gpu_prints_the_plugins_line_once_and_no_traceback_of_its_own(tmp_path):
    torchrun = pathlib.Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    command = [str(torchrun), "--nproc-per-node", "2", "-m", "nemo_noise_plugin.cli.finetune", "-f", "tiny_noise_sft"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert output.count("error: torchrun --nproc-per-node=2 is invalid: expected a GPU per rank") == 1, output
    # torchrun's own agent adds its failure summary, a ChildFailedError traceback: the only one
    assert output.count("Traceback") == 1 and "ChildFailedError" in output, output
    assert not (tmp_path / "nemo_experiments").exists()  # refused before anything was built or written
