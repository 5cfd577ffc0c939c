"""The README's main-job command on CPU: the tiny recipe on the embedded corpus, then the robustness report."""

from __future__ import annotations

import json
import re
import subprocess
import sys


def _run_demo(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "nemo_noise_plugin", *args], capture_output=True, text=True, timeout=900, cwd=cwd
    )


PROGRESS_LINE = re.compile(r"^\s+(\d+)/\d+\s+(\d+\.\d+)\s+(\S+)\s+(\d+)\s*$")


def _rows(out: str) -> list[list[str]]:
    """Progress lines ``step/steps  loss  kd  tokens/s`` as ``[step, loss, kd, tokens/s]``."""
    return [list(match.groups()) for line in out.splitlines() if (match := PROGRESS_LINE.match(line))]


def test_main_job_trains_the_tiny_recipe_and_writes_the_robustness_report(tmp_path):
    result = _run_demo("--steps", "6", "--output-dir", str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "recipe tiny_noise_sft on the embedded corpus" in out
    assert "CPU loop (Bridge's training loop needs CUDA)" in out and "CPU substitutes in use" in out
    rows = [row for row in _rows(out) if len(row) == 4]
    assert [int(row[0]) for row in rows] == [1, 2, 3, 4, 5, 6]
    losses = [float(row[1]) for row in rows]
    assert losses[-1] < losses[0] - 1.0  # it learns the corpus
    latest = tmp_path / "tiny_noise_sft" / "reports" / "latest"  # each run keeps its report under its run id
    report = json.loads((latest / "robustness.json").read_text())
    assert set(report) == {"before", "after"}
    before, after = report["before"], report["after"]
    assert [point["scale"] for point in before] == [0.0, 2.5, 5.0, 10.0, 20.0, 40.0]
    assert before[0]["kl"] == 0.0 and before[-1]["kl"] > before[1]["kl"] > 0  # more noise, more shift
    assert after[0]["loss"] < before[0]["loss"] - 1.0
    assert (latest / "robustness.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "tiny_noise_sft" / "data").is_dir()  # the corpus as a Megatron indexed dataset


def test_main_job_runs_the_distillation_recipe_and_reports_the_kd_loss(tmp_path):
    result = _run_demo("--recipe", "tiny_noise_distillation", "--steps", "2", "--output-dir", str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [row for row in _rows(result.stdout) if len(row) == 4]
    assert len(rows) == 2
    assert all(float(row[2]) >= 0 for row in rows) and float(rows[-1][2]) > 0


def test_main_job_rejects_bad_noise_settings_with_the_field_name():
    result = _run_demo("--alpha", "-1")
    assert result.returncode == 2
    assert "NoiseConfig.alpha=-1.0 is invalid: expected a finite number >= 0." in result.stderr


def test_main_job_takes_a_yaml_preset_and_flag_overrides(tmp_path):
    result = _run_demo("--steps", "1", "--noise-config", "gaussian", "--sigma", "3", "--output-dir", str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "mechanism='gaussian'" in result.stdout and "sigma=3.0" in result.stdout
    assert "against sigma" in result.stdout


def test_main_job_names_an_unreadable_preset():
    result = _run_demo("--noise-config", "configs/noise/missing.yaml")
    assert result.returncode == 2
    assert "--noise-config 'configs/noise/missing.yaml' cannot be read: No such file or directory" in result.stderr
