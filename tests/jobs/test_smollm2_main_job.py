"""``python -m nemo_noise_plugin --recipe smollm2_135m_noise_sft`` end to end on the CPU: the real pretrained model
trained with noise on the instruction set, exported with Bridge's exporter, reloaded with transformers, and its
report folder (robustness, task metric, HF export) appearing all at once."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from nemo_noise_plugin.jobs.models.fetch_wheel import MODEL_CACHE_ENV
from tests.support.smollm2 import smollm2_hf_dir  # noqa: F401  (the session fixture)

pytestmark = pytest.mark.slow

HELD_OUT, CHATS = 8, 2
"""The task report scores the first 8 examples of each held-out split and the export answers 2 questions: the same
code paths as the default (all 440 per split, 4 answers), which made this run outlast a 1,500 s timeout on a loaded
2-core CI machine (issue 36)."""


TIMEOUT_S = 2400
"""Measured: 387 s of wall time in the project's CI run of 2026-12-03 (fresh clone, 2-core machine, the slow pass
running one test at a time; `issues ci`), so this is over 6x the uncontended run. On a machine at load 20-47 the
same run with every held-out example and 4 chats outlasted 1,500 s (issue 36)."""


def test_the_main_job_trains_exports_and_reports_the_real_model(smollm2_hf_dir, tmp_path):  # noqa: F811
    env = {**os.environ, MODEL_CACHE_ENV: str(smollm2_hf_dir.parent)}
    result = subprocess.run(
        [sys.executable, "-m", "nemo_noise_plugin", "--recipe", "smollm2_135m_noise_sft", "--steps", "2",
         "--no-control", "--held-out", str(HELD_OUT), "--chats", str(CHATS), "--output-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=TIMEOUT_S, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.splitlines()[0].startswith("== nemo-noise-plugin main job: recipe smollm2_135m_noise_sft")
    progress = [line.split()[0] for line in result.stdout.splitlines() if line.split()[:1] in (["1/2"], ["2/2"])]
    assert progress == ["1/2", "2/2"], result.stdout[-3000:]
    folder = tmp_path / "smollm2_135m_noise_sft" / "reports" / "latest"
    assert {"robustness.json", "robustness.png", "task_report.json", "task_report.png", "hf"} <= set(os.listdir(folder))
    assert (folder / "hf" / "config.json").is_file() and list((folder / "hf").glob("*.safetensors"))
    task = json.loads((folder / "task_report.json").read_text())
    assert set(task["before"]) == set(task["after"]) == {"exact_match", "per_task", "splits"}
    assert set(task["after"]["splits"]) == {"validation", "test"}
    assert "held-out exact match (before training, greedy)" in result.stdout
    assert 0.0 <= task["after"]["exact_match"] <= 1.0
    exported = task["export_logits"]  # the reloaded HF model against Megatron's logits, both float32 on the CPU
    assert exported["dtype"] == "float32" and exported["argmax_agreement"] >= 0.999, exported
    assert exported["decisive_argmax_agreement"] == 1.0 and 0.5 < exported["decisive_fraction"] <= 1.0, exported
    assert exported["max_abs_logit_difference"] < 1e-3, exported
    assert task["exported"] == str(tmp_path / "smollm2_135m_noise_sft" / "reports" / os.readlink(folder) / "hf")
    assert len(task["transformers_replies"]) == CHATS
    assert all(isinstance(item["reply"], str) for item in task["transformers_replies"])
    robustness = json.loads((folder / "robustness.json").read_text())
    assert set(robustness) == {"provenance", "before", "after"}  # --no-control: no reference curve
    reports = folder.parent
    assert [name for name in os.listdir(reports) if ".partial" in name] == []
