"""Every front door ends the same way (issue 26): a usage error is one line naming the setting, exit status 2; an
interrupt is 130 (SIGTERM 143) with one line saying whether and where a checkpoint exists; a full disk is named;
output and checkpoint locations (spaces included) are checked before training.

Subprocess runs of ``python -m nemo_noise_plugin``, ``python -m nemo_noise_plugin.cli.finetune`` and ``nemo llm
finetune``; the ones that start training are marked slow.
"""

from __future__ import annotations

import errno
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

MAIN_JOB = [sys.executable, "-m", "nemo_noise_plugin"]
FINETUNE = [sys.executable, "-m", "nemo_noise_plugin.cli.finetune"]
NEMO = [str(Path(sys.executable).parent / "nemo"), "llm", "finetune"]
KNOWN_NOISE = ("FutureWarning: The pynvml package is deprecated", "import pynvml")
"""Lines torch prints on import inside ``nemo`` before the plugin's entry point can quiet it."""


def _run(command: list[str], *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    # a front door's dry run: 14.6 s of CPU measured 2026-12-03 (40 s wall at load 24 on 2 cores); a 2-step CPU
    # main job without control 128 s of CPU (448 s wall at load 25)
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=timeout)


def _one_line(result: subprocess.CompletedProcess) -> str:
    """The only line on standard error (apart from torch's import warning); fails on a traceback or more lines."""
    assert "Traceback" not in result.stderr and "│" not in result.stderr, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.strip() and not any(n in line for n in KNOWN_NOISE)]
    assert len(lines) == 1, result.stderr[-3000:]
    return lines[0]


# -- usage errors: one line, status 2 (no training starts) ------------------------------------------------------


def test_a_recipe_keyword_typo_is_one_line_naming_it_with_status_2_in_both_finetune_commands():
    for command in (FINETUNE, NEMO):
        result = _run(command, "-f", "tiny_noise_sft(bogus=1)", "--dryrun")
        assert result.returncode == 2, (command, result.stderr[-3000:])
        line = _one_line(result)
        assert "bogus=1 is invalid" in line and "seq_length" in line, line  # the value and the allowed arguments


def test_nemo_llm_finetune_usage_errors_exit_2():
    result = _run(NEMO, "--dryrun")
    assert result.returncode == 2, result.stderr[-3000:]
    assert "--factory is required" in _one_line(result)


def test_an_argparse_error_is_one_line_without_the_usage_block():
    result = _run(MAIN_JOB, "--steps", "0")
    assert result.returncode == 2
    assert _one_line(result).startswith("python -m nemo_noise_plugin: error: --steps=0 is invalid")


def test_to_yaml_into_a_missing_folder_creates_it(tmp_path):
    target = tmp_path / "not yet" / "there" / "run.yaml"
    result = _run(FINETUNE, "-f", "tiny_noise_sft", "--to-yaml", str(target))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "train_iters" in target.read_text()


def test_to_yaml_into_an_unwritable_place_is_one_line_naming_the_option(tmp_path):
    result = _run(FINETUNE, "-f", "tiny_noise_sft", "--to-yaml", "/proc/no such/run.yaml")
    assert result.returncode == 2, result.stderr[-3000:]
    assert "--to-yaml='/proc/no such/run.yaml'" in _one_line(result)


@pytest.mark.parametrize(
    ("text", "words"),
    [(b"5\n", "got an integer (5)"), (b"\x89PNG\r\n\x1a\n\x00", "not a text file")],
    ids=["scalar", "binary"],
)
def test_a_config_file_that_is_not_a_mapping_is_one_line_with_status_2(tmp_path, text, words):
    path = tmp_path / "run.yaml"
    path.write_bytes(text)
    result = _run(FINETUNE, "-f", "tiny_noise_sft", "--config-file", str(path), "--dryrun")
    assert result.returncode == 2, result.stderr[-3000:]
    assert words in _one_line(result)


# -- checked before training: the CPU loop is never reached ---------------------------------------------------


@pytest.mark.parametrize(
    ("override", "words"),
    [
        ("train.micro_batch_size=3", "train.micro_batch_size=3 is invalid with train.global_batch_size=8"),
        pytest.param(  # each case is a whole nemo process (about 15 s): two of them run with the slow tests
            "model.seq_length=1", "model.seq_length=1 is invalid: expected dataset.seq_length=", marks=pytest.mark.slow
        ),
        pytest.param(
            "dataset.seq_length=-4",
            "dataset.seq_length=-4 is invalid: expected an integer >= 1",
            marks=pytest.mark.slow,
        ),
        ("checkpoint.save=/proc/nope/checkpoints", "checkpoint.save='/proc/nope/checkpoints' is invalid"),
    ],
    ids=["micro batch", "seq length", "data seq length", "unwritable checkpoint.save"],
)
def test_a_setting_megatron_finds_late_is_refused_before_training(tmp_path, override, words):
    save = [] if override.startswith("checkpoint.save=") else [f"checkpoint.save={tmp_path}/c"]  # each setting once
    result = _run(FINETUNE, "-f", "tiny_noise_sft", "train.train_iters=2", *save, override)
    assert result.returncode == 2, result.stderr[-3000:]
    assert words in _one_line(result)
    assert "CPU loop" not in result.stdout  # refused before the loop started


# -- the checks themselves, in-process ------------------------------------------------------------------------


def test_a_checkpoint_that_cannot_be_written_names_the_full_disk(tmp_path, monkeypatch):
    import torch

    from nemo_noise_plugin.cli.exits import describe_failure
    from nemo_noise_plugin.jobs.cpu.checkpoint import CheckpointWriteError, CpuCheckpoint

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    checkpoint = CpuCheckpoint(str(tmp_path), str(tmp_path), "0" * 16)
    with pytest.raises(CheckpointWriteError) as caught:
        checkpoint.save({"iteration": 1})
    status, line = describe_failure(caught.value)
    assert status == 1 and "the disk is full" in line and f"checkpoint into {tmp_path}:" in line
    assert "no earlier state exists" in line
    assert list(tmp_path.iterdir()) == []  # no partial file left


def test_an_interrupt_during_a_save_waits_for_the_save_and_then_stops(tmp_path, monkeypatch):
    import torch

    from nemo_noise_plugin.jobs.cpu.checkpoint import CpuCheckpoint

    real_save = torch.save

    def interrupted_save(state, stream):
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C in the middle of writing
        real_save(state, stream)

    monkeypatch.setattr(torch, "save", interrupted_save)
    # Python's own Ctrl-C handler, whatever an earlier test or library in this process installed (the save hands the
    # held signal to the handler that was in place before it)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    monkeypatch.setattr(CpuCheckpoint, "_OPENED", [])
    checkpoint = CpuCheckpoint(str(tmp_path), str(tmp_path), "1" * 16)
    try:
        with pytest.raises(KeyboardInterrupt):
            checkpoint.save({"iteration": 3})
    finally:
        signal.signal(signal.SIGINT, previous)
    assert torch.load(checkpoint.save_path)["iteration"] == 3  # complete on disk, then the interrupt
    assert checkpoint.save_path in CpuCheckpoint.on_disk()


def test_the_interrupt_line_says_no_checkpoint_when_none_was_saved(tmp_path, monkeypatch, capsys):
    from nemo_noise_plugin.cli.exits import EXIT_TERMINATED, Terminated, run_command
    from nemo_noise_plugin.jobs.cpu.checkpoint import CpuCheckpoint

    monkeypatch.setattr(CpuCheckpoint, "_OPENED", [])
    CpuCheckpoint(str(tmp_path), str(tmp_path), "2" * 16)  # a run started, nothing saved yet

    def body():
        raise Terminated()

    assert run_command(body) == EXIT_TERMINATED
    line = capsys.readouterr().err.strip()
    assert line == "terminated: no checkpoint was saved yet, so the same command starts from iteration 0."


def test_a_dataset_path_with_spaces_is_kept_whole(tmp_path):
    from nemo_noise_plugin.jobs.launch.launcher import check_run_settings
    from nemo_noise_plugin.recipes import tiny_noise_sft_config

    config = tiny_noise_sft_config(dir=str(tmp_path / "my runs"), train_iters=2)
    check_run_settings(config)
    (prefix,) = config.dataset.data_path
    assert " " in prefix and os.path.isfile(prefix + ".idx")


# -- whole runs (slow) ----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_main_job_trains_in_an_output_dir_with_spaces(tmp_path):
    output_dir = tmp_path / "x y"
    result = _run(MAIN_JOB, "--steps", "2", "--no-control", "--output-dir", str(output_dir))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert (output_dir / "tiny_noise_sft" / "reports" / "latest" / "robustness.json").is_file()


def _default_interrupt_disposition() -> None:
    """In the child before it execs: SIGINT back to the default, whatever the test run inherited."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
@pytest.mark.parametrize(("signum", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["INT", "TERM"])
def test_an_interrupt_before_any_checkpoint_says_so_and_exits_128_plus_the_signal(tmp_path, signum, status):
    """The child gets SIGINT's default disposition: under a test run started in the background (POSIX shells start
    ``&`` jobs with SIGINT ignored) it would inherit the ignore, so Python would install no KeyboardInterrupt handler,
    and the run would end with status 0 (what two fresh-clone CI runs saw). Long enough that the signal reaches a
    running loop, with no save before the end."""
    process = subprocess.Popen(
        [
            *FINETUNE,
            "-f",
            "tiny_noise_sft",
            "train.train_iters=5000",
            "checkpoint.save_interval=100000",
            f"checkpoint.save={tmp_path}/checkpoints",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_default_interrupt_disposition,
    )
    header = None
    for line in process.stdout:  # the header of the progress lines: training starts, nothing saved yet
        if re.search(r"step\s+loss", line):  # anywhere in the line: another writer's unfinished line may precede it
            header = line
            break
    assert header is not None and process.poll() is None, "the run ended before its progress header was seen"
    process.send_signal(signum)
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == status, stderr[-3000:]
    result = subprocess.CompletedProcess(process.args, process.returncode, "", stderr)
    word = "interrupted" if signum == signal.SIGINT else "terminated"
    assert _one_line(result) == f"{word}: no checkpoint was saved yet, so the same command starts from iteration 0."
    assert not list((tmp_path / "checkpoints").glob("cpu_state-*.pt"))


def test_a_sigterm_after_the_command_ended_ends_the_process_quietly():
    """A fresh bad-input pass sent SIGTERM just after a dry run had printed: the plugin's handler was still set, so
    ``Terminated`` was raised inside a package's atexit clean-up ("Exception ignored ... Traceback", status 0)."""
    from nemo_noise_plugin.cli.exits import EXIT_TERMINATED, run_command, stop_on_sigterm

    previous = signal.getsignal(signal.SIGTERM)
    try:
        stop_on_sigterm()

        def body() -> int:
            assert getattr(signal.getsignal(signal.SIGTERM), "stops_the_run", False)  # set while the work runs
            return 0

        assert run_command(body) == 0
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # after it: the default, killed with 143

        stop_on_sigterm()

        def terminated() -> int:
            signal.raise_signal(signal.SIGTERM)
            return 0

        assert run_command(terminated) == EXIT_TERMINATED
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, previous)
