"""The main job on a GPU: the tiny recipe through Bridge's real training loop, checkpoint, resume, report.

Bridge's own output (its configuration summary, its ``iteration N/ M | ... lm loss`` lines) is in the run folder's
``bridge.log``, not on the console (``jobs.launch.bridge_console``); the tests read Bridge's lines from there.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

from tests.support.training_processes import training_env

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROGRESS_LINE = re.compile(r"^\s*(\d+)/(\d+)\s+([0-9.]+)\s+(\S+)\s+(\d+)\s*$", re.MULTILINE)


def _run(module: str, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", module, *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, env=training_env())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    print(result.stdout[-4000:])
    return result


def _console(*args: str) -> list[str]:
    """The main job's console as a terminal shows it (standard error merged into standard output), line by line."""
    result = subprocess.run(
        [sys.executable, "-m", "nemo_noise_plugin", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=900,
        env=training_env(),
    )
    assert result.returncode == 0, result.stdout[-6000:]
    print(result.stdout)
    return result.stdout.splitlines()


def _losses_by_step(stdout: str) -> dict[int, float]:
    """Step -> training loss from the main job's progress lines (``step/total  loss  kd  tokens/s``)."""
    lines = PROGRESS_LINE.findall(stdout)
    assert lines, "no progress lines in the output"
    assert all(int(tokens_per_second) > 0 for *_, tokens_per_second in lines)
    return {int(step): float(loss) for step, _, loss, _, _ in lines}


def test_tiny_recipe_trains_saves_resumes_with_the_same_noise_and_reports(tmp_path):
    interrupted, uninterrupted = tmp_path / "interrupted", tmp_path / "uninterrupted"
    # --no-control: the progress lines below are the noisy run's only (a control run prints its own 1..30 first)
    common = ("nemo_noise_plugin", "--steps", "30", "--no-control")
    first = _run(*common, "--stop-after", "20", "--output-dir", str(interrupted))
    assert "Bridge's training loop" in first.stdout
    first_losses = _losses_by_step(first.stdout)
    assert sorted(first_losses) == list(range(1, 21))
    assert first_losses[20] < first_losses[1] - 0.5, first_losses
    checkpoints = interrupted / "tiny_noise_sft" / "checkpoints"
    assert (checkpoints / "iter_0000020").is_dir()
    bridge_log = interrupted / "tiny_noise_sft" / "bridge.log"
    first_log = bridge_log.read_text()

    resumed = _run(*common, "--output-dir", str(interrupted))  # resumes at 20
    resumed_log = bridge_log.read_text()[len(first_log) :]  # the resumed run's part (each run appends)
    assert re.search(r"iteration\s+21/\s+30", resumed_log), "Bridge did not resume at iteration 21"
    assert (checkpoints / "iter_0000030").is_dir()
    resumed_losses = _losses_by_step(resumed.stdout)
    assert sorted(resumed_losses) == list(range(21, 31))
    assert "the model at iteration 20" in resumed.stdout  # the resumed run's report starts from its checkpoint

    whole_run = _run(*common, "--output-dir", str(uninterrupted))
    whole = _losses_by_step(whole_run.stdout)
    latest = uninterrupted / "tiny_noise_sft" / "reports" / "latest"
    report = json.loads((latest / "robustness.json").read_text())
    assert report["after"][0]["loss"] < report["before"][0]["loss"] - 0.5
    assert (latest / "robustness.png").stat().st_size > 10_000
    # Same data, weights and noise after the restart: the losses follow the uninterrupted run's up to the
    # GPU's non-deterministic reductions (atomics in the embedding backward), not a different noise draw.
    differences = [abs(resumed_losses[step] - whole[step]) for step in range(21, 31)]
    print("resumed - uninterrupted loss, steps 21..30:", [f"{d:.2e}" for d in differences])
    assert max(differences) < 2e-2, differences


def test_finetune_command_runs_distillation_through_bridge(tmp_path):
    result = _run(
        "nemo_noise_plugin.cli.finetune",
        "--factory",
        "tiny_noise_distillation",
        "train.train_iters=12",
        "checkpoint.save_interval=12",
        f"checkpoint.save={tmp_path}/checkpoints",
        "model.noise.alpha=5",
    )
    bridge_log = tmp_path / "bridge.log"  # the run folder: the parent of checkpoint.save
    assert f"Bridge's log (its configuration and per-step lines): {bridge_log};" in result.stdout
    log = bridge_log.read_text()
    lm = [float(v) for v in re.findall(r"iteration\s+\d+/\s+12 \|.*?lm loss: ([0-9.E+-]+)", log)]
    kd = [float(v) for v in re.findall(r"iteration\s+\d+/\s+12 \|.*?kd loss: ([0-9.E+-]+)", log)]
    assert len(lm) == 12 and len(kd) == 12, log[-3000:]
    assert len(_losses_by_step(result.stdout)) == 12  # the plugin's progress lines, on the console
    assert lm[-1] < lm[0] - 1.0 and all(value >= 0 for value in kd)
    assert (tmp_path / "checkpoints" / "iter_0000012").is_dir()


KD_PROGRESS_LINE = re.compile(r"^\s*(\d+)/(\d+)\s+([0-9.]+)\s+([0-9.]+)\s+(\d+)\s*$", re.MULTILINE)


def _lm_and_kd_by_step(stdout: str, total: int) -> dict[int, tuple[float, float]]:
    """Step -> (lm loss, kd loss) of the noisy run (``step/total`` lines of that run's length)."""
    return {int(s): (float(lm), float(kd)) for s, t, lm, kd, _ in KD_PROGRESS_LINE.findall(stdout) if int(t) == total}


def test_distillation_after_clean_pretraining_resumes_with_its_teacher(tmp_path):
    """Bridge's loop, the distillation recipe after 10 clean steps: stopped at 10 of 20 and resumed, the noisy run
    distils from the same clean teacher (the pre-trained weights, not the initialisation) as an uninterrupted run."""
    interrupted, uninterrupted = tmp_path / "interrupted", tmp_path / "uninterrupted"
    common = ["--recipe", "tiny_noise_distillation", "--clean-pretrain-steps", "10", "--steps", "20", "--no-control"]
    first = _run("nemo_noise_plugin", *common, "--stop-after", "10", "--output-dir", str(interrupted))
    checkpoints = interrupted / "tiny_noise_distillation" / "checkpoints"
    assert (checkpoints / "clean_pretrain_10" / "iter_0000010").is_dir()
    assert (checkpoints / "after_clean_10" / "iter_0000010").is_dir()
    resumed = _run("nemo_noise_plugin", *common, "--output-dir", str(interrupted))
    whole = _run("nemo_noise_plugin", *common, "--output-dir", str(uninterrupted))
    before, after = _lm_and_kd_by_step(first.stdout, 20), _lm_and_kd_by_step(resumed.stdout, 20)
    reference = _lm_and_kd_by_step(whole.stdout, 20)
    assert sorted(before) == list(range(1, 11)) and sorted(after) == list(range(11, 21)), resumed.stdout[-3000:]
    print("kd resumed vs uninterrupted:", [(after[s][1], reference[s][1]) for s in range(11, 21)])
    for step in range(11, 21):  # up to the GPU's non-deterministic reductions
        assert abs(after[step][0] - reference[step][0]) < 2e-2, (step, after[step], reference[step])
        assert abs(after[step][1] - reference[step][1]) < 2e-2, (step, after[step], reference[step])


BRIDGE_STEP_LINE = re.compile(r"iteration\s+\d+/\s+10 \|.*lm loss: ")
CONFIGURATION_SUMMARY = "Configuration Summary (Non-Default Values vs Megatron Core)"


def test_the_main_job_console_is_short_and_bridges_output_is_in_the_run_folders_log(tmp_path):
    """10 steps with the control run: the header, one line per step, the report; Bridge's ~230-line configuration
    summary and its own step lines are in ``<run dir>/bridge.log``, which the console names in one line."""
    console = _console("--steps", "10", "--output-dir", str(tmp_path))
    bridge_log = tmp_path / "tiny_noise_sft" / "bridge.log"
    text = "\n".join(console)
    assert len(console) < 60, f"{len(console)} lines"
    first_progress = next(i for i, line in enumerate(console) if PROGRESS_LINE.match(line))
    assert first_progress < 20, f"first progress line is line {first_progress + 1}"
    assert len(PROGRESS_LINE.findall(text)) == 20  # the control's 10 steps, then the noisy run's
    assert [line for line in console if line.startswith("Bridge's log")] == [
        f"Bridge's log (its configuration and per-step lines): {bridge_log}; -v shows it here too"
    ]
    assert CONFIGURATION_SUMMARY not in text and not BRIDGE_STEP_LINE.search(text)
    assert "Traceback" not in text
    log = bridge_log.read_text()
    assert log.count(CONFIGURATION_SUMMARY) == 2  # one per call into Bridge: the control, the noisy run
    assert len(log.splitlines()) > 200
    assert len(BRIDGE_STEP_LINE.findall(log)) == 20


def test_verbose_main_job_shows_bridges_output_and_still_logs_it(tmp_path):
    console = _console("--steps", "3", "--no-control", "-v", "--output-dir", str(tmp_path))
    text = "\n".join(console)
    bridge_log = tmp_path / "tiny_noise_sft" / "bridge.log"
    assert f"Bridge's log (its configuration and per-step lines): {bridge_log}; also shown here (-v)" in console
    step_line = re.compile(r"iteration\s+\d+/\s+3 \|.*lm loss: ")
    assert CONFIGURATION_SUMMARY in text and len(step_line.findall(text)) == 3
    assert len(PROGRESS_LINE.findall(text)) == 3
    log = bridge_log.read_text()
    assert CONFIGURATION_SUMMARY in log and len(step_line.findall(log)) == 3
