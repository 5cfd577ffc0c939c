"""The main job as a user meets it: a quiet console, clear stops, and an output folder that is never a mix.

Runs ``python -m nemo_noise_plugin`` in subprocesses on the CPU loop (a few steps each).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from nemo_noise_plugin.jobs.progress import FiniteLossGuard, NonFiniteLossError

pytestmark = pytest.mark.slow  # minutes on 2 cores: run by `make test` after the main suite

MAIN_JOB = [sys.executable, "-m", "nemo_noise_plugin"]
HEADER = "== nemo-noise-plugin main job"


def _main_job(*args: str, **kwargs) -> subprocess.CompletedProcess:
    # a 6-step main job with its control: 240 s of CPU measured 2026-12-03 (887 s wall at load 38 on 2 cores)
    return subprocess.run([*MAIN_JOB, *args], capture_output=True, text=True, timeout=1800, **kwargs)


def _latest(output_dir) -> tuple[str, dict]:
    reports = output_dir / "tiny_noise_sft" / "reports"
    run_id = os.readlink(reports / "latest")
    folder = reports / run_id
    assert (folder / "robustness.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return run_id, json.loads((folder / "robustness.json").read_text())


def _same_run(report: dict) -> dict:
    """A report as two runs of the same settings in different folders must agree on it: every number bit for bit and
    what ran (the provenance without the folder-dependent config body, its hash, the data files' paths and the
    command line's output folder)."""
    provenance = dict(report["provenance"])
    for folder_dependent in ("config", "config_sha256"):
        provenance.pop(folder_dependent)
    provenance["command_line"] = re.sub(r"--output-dir \S+", "--output-dir DIR", provenance["command_line"])
    provenance["data_files"] = sorted(provenance["data_files"].values())  # the hashes; the paths name the folder
    return {**report, "provenance": provenance}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """One complete 2-step run: its output folder and what the process printed."""
    output_dir = tmp_path_factory.mktemp("main_job")
    result = _main_job("--steps", "2", "--output-dir", str(output_dir))
    assert result.returncode == 0, result.stderr[-3000:]
    return output_dir, result


def test_the_first_line_is_the_users_information_and_no_third_party_warning_shows(finished_run):
    _, result = finished_run
    assert result.stdout.splitlines()[0].startswith(HEADER)
    assert "Warning" not in result.stderr and "Traceback" not in result.stdout + result.stderr, result.stderr
    assert "INFO:" not in result.stdout


def test_each_run_keeps_its_report_under_its_run_id(finished_run):
    output_dir, result = finished_run
    run_id, report = _latest(output_dir)
    assert f"reports/{run_id}/robustness.json" in result.stdout
    assert set(report) == {"provenance", "before", "no noise", "after"}


def test_verbose_shows_the_third_party_warnings(tmp_path):
    quiet = subprocess.run(
        [sys.executable, "-m", "nemo_noise_plugin.cli.finetune", "-f", "tiny_noise_sft", "--dryrun",
         f"checkpoint.save={tmp_path}/checkpoints"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    verbose = subprocess.run(
        [sys.executable, "-m", "nemo_noise_plugin.cli.finetune", "-f", "tiny_noise_sft", "--dryrun", "--verbose",
         f"checkpoint.save={tmp_path}/checkpoints"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert quiet.returncode == verbose.returncode == 0, quiet.stderr[-2000:] + verbose.stderr[-2000:]
    lines_before = quiet.stdout.splitlines().index("Dry run (nothing launched):")
    assert lines_before == 0, quiet.stdout[:2000]
    assert "Warning" not in quiet.stderr, quiet.stderr
    assert "Apex is not installed" in verbose.stderr


def test_a_non_finite_loss_stops_the_run_with_a_message_naming_the_step(tmp_path):
    result = _main_job("--steps", "4", "--lr", "1e30", "--output-dir", str(tmp_path))
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    line = [line for line in result.stderr.splitlines() if line.strip()][-1]
    assert line.startswith("error: step ") and "training stopped" in line, result.stderr
    assert "nan" in line.lower() or "inf" in line.lower(), line
    assert not (tmp_path / "tiny_noise_sft" / "reports" / "latest").exists()


def test_the_guard_names_the_step_and_the_loss():
    from types import SimpleNamespace

    import torch

    context = SimpleNamespace(
        state=SimpleNamespace(train_state=SimpleNamespace(step=6)),
        loss_dict={"lm loss": torch.tensor(2.0), "kd loss": torch.tensor(float("nan"))},
    )
    with pytest.raises(NonFiniteLossError, match=r"^step 7: kd loss = nan"):
        FiniteLossGuard().on_train_step_end(context)
    context.loss_dict["kd loss"] = torch.tensor(0.5)
    FiniteLossGuard().on_train_step_end(context)  # finite: training goes on


@pytest.fixture(scope="module")
def uninterrupted_report(tmp_path_factory) -> dict:
    """The report of an uninterrupted 3-step run: what a rerun after any interrupt must reproduce exactly."""
    output_dir = tmp_path_factory.mktemp("uninterrupted")
    result = _main_job("--steps", "3", "--output-dir", str(output_dir))
    assert result.returncode == 0, result.stderr[-3000:]
    return _latest(output_dir)[1]


@pytest.mark.parametrize(("signum", "word"), [(signal.SIGINT, "interrupted"), (signal.SIGTERM, "terminated")])
def test_an_interrupt_at_a_random_point_keeps_the_folder_consistent_and_a_rerun_resumes_exactly(
    finished_run, uninterrupted_report, tmp_path, signum, word
):
    output_dir = tmp_path / "main_job"
    shutil.copytree(finished_run[0], output_dir, symlinks=True)  # an earlier run's consistent state
    before = _latest(output_dir)
    checkpoints = output_dir / "tiny_noise_sft" / "checkpoints"
    earlier_states = set(checkpoints.rglob("cpu_state-*.pt"))
    process = subprocess.Popen(
        [*MAIN_JOB, "--steps", "3", "--output-dir", str(output_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    for line in process.stdout:  # wait until training runs, then interrupt somewhere in the rest of the run
        if line.strip().startswith("step"):
            break
    seed = time.time_ns()
    time.sleep(random.Random(seed).uniform(0.0, 20.0))
    process.send_signal(signum)
    stdout, stderr = process.communicate(timeout=300)
    finished = process.returncode == 0 or (process.returncode == -signum and _latest(output_dir) != before)
    if finished:  # it ended before the signal (one during interpreter shutdown ends it by default): the new report
        assert _latest(output_dir)[0] != before[0], (seed, stderr[-3000:])
        assert _same_run(_latest(output_dir)[1]) == _same_run(uninterrupted_report), seed
        return
    assert process.returncode == 128 + signum, (seed, stderr[-3000:])  # 130 for Ctrl-C, 143 for SIGTERM
    assert "Traceback" not in stderr, (seed, stderr[-3000:])
    (message,) = [line for line in stderr.splitlines() if line.strip()]
    assert message.startswith(f"{word}: this run's report was not written (earlier reports in"), message
    assert _latest(output_dir) == before, seed  # the old consistent state
    reports = output_dir / "tiny_noise_sft" / "reports"
    assert [name for name in os.listdir(reports) if ".partial" in name] == [], seed
    assert not [path for path in checkpoints.rglob("*.partial")], seed
    saved_before_the_interrupt = set(checkpoints.rglob("cpu_state-*.pt")) - earlier_states
    assert ("no checkpoint was saved yet" in message) == (not saved_before_the_interrupt), (seed, message)
    assert all(str(path) in message for path in saved_before_the_interrupt), (seed, message)

    rerun = _main_job("--steps", "3", "--output-dir", str(output_dir))
    assert rerun.returncode == 0, (seed, rerun.stderr[-3000:])
    assert ("resumed from" in rerun.stdout) == bool(saved_before_the_interrupt), (seed, rerun.stdout[-3000:])
    assert _same_run(_latest(output_dir)[1]) == _same_run(uninterrupted_report), (seed, rerun.stdout[-3000:])
