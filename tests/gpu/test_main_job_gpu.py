"""The main job on a GPU: the tiny recipe through Bridge's real training loop, checkpoint, resume, report."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _main_job(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "nemo_noise_plugin", *args], capture_output=True, text=True, timeout=900
    )


def test_tiny_recipe_trains_saves_resumes_and_reports_on_bridges_loop(tmp_path):
    first = _main_job("--steps", "20", "--output-dir", str(tmp_path))
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "Bridge's training loop" in first.stdout
    losses = [float(value) for value in re.findall(r"lm loss: ([0-9.E+-]+)", first.stdout)]
    assert len(losses) >= 10 and losses[-1] < losses[0] - 0.5, losses
    checkpoints = tmp_path / "tiny_noise_sft" / "checkpoints"
    assert (checkpoints / "iter_0000020").is_dir()
    report = json.loads((tmp_path / "robustness.json").read_text())
    assert report["after"][0]["loss"] < report["before"][0]["loss"]

    resumed = _main_job("--steps", "30", "--output-dir", str(tmp_path))  # same directory: Bridge resumes at 20
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "iteration       21/" in resumed.stdout or "iteration 21" in resumed.stdout
    assert (checkpoints / "iter_0000030").is_dir()
