"""The main job on a GPU: the tiny recipe through Bridge's real training loop, checkpoint, resume, report."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROGRESS_LINE = re.compile(r"^\s*(\d+)/(\d+)\s+([0-9.]+)\s+(\S+)\s+(\d+)\s*$", re.MULTILINE)


def _run(module: str, *args: str) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    print(result.stdout[-4000:])
    return result


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

    resumed = _run(*common, "--output-dir", str(interrupted))  # resumes at 20
    assert re.search(r"iteration\s+21/\s+30", resumed.stdout), "Bridge did not resume at iteration 21"
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
    lm = [float(v) for v in re.findall(r"iteration\s+\d+/\s+12 \|.*?lm loss: ([0-9.E+-]+)", result.stdout)]
    kd = [float(v) for v in re.findall(r"iteration\s+\d+/\s+12 \|.*?kd loss: ([0-9.E+-]+)", result.stdout)]
    assert len(lm) == 12 and len(kd) == 12, result.stdout[-3000:]
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
