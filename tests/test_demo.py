"""The README's main-job command on CPU: a few noisy training steps on the embedded default."""

from __future__ import annotations

import re
import subprocess
import sys


def _run_demo(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "nemo_noise_plugin", *args], capture_output=True, text=True, timeout=600
    )


def test_main_job_trains_and_reports_clean_and_noisy_loss_per_step():
    result = _run_demo("--steps", "6")
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "CPU loop on the embedded default" in out
    assert "CPU substitutes in use" in out
    rows = [line.split() for line in out.splitlines() if re.match(r"^\s+\d+\s+\d", line)]
    assert [int(row[0]) for row in rows] == [1, 2, 3, 4, 5, 6]
    train, clean, noisy = ([float(row[i]) for row in rows] for i in (1, 2, 3))
    assert train[-1] < train[0] - 0.5  # it learns
    assert all(c != n for c, n in zip(clean, noisy, strict=True))  # the noise changes the loss


def test_main_job_rejects_bad_noise_settings_with_the_field_name():
    result = _run_demo("--alpha", "-1")
    assert result.returncode == 2
    assert "NoiseConfig.alpha=-1.0 is invalid: expected a finite number >= 0." in result.stderr


def test_main_job_takes_a_yaml_preset_and_flag_overrides():
    result = _run_demo("--steps", "1", "--noise-config", "configs/noise/gaussian.yaml", "--sigma", "3")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "mechanism='gaussian'" in result.stdout and "sigma=3.0" in result.stdout


def test_main_job_names_an_unreadable_preset():
    result = _run_demo("--noise-config", "configs/noise/missing.yaml")
    assert result.returncode == 2
    assert "--noise-config 'configs/noise/missing.yaml' cannot be read: No such file or directory" in result.stderr
