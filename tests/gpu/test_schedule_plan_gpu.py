"""The fine-grained schedule plan on 2 GPUs, EP=2: plan vs normal path within bf16 tolerance (noise, noise + KD).

Runs ``benchmarks/schedule_plan_step.py`` under torchrun (small sizes) and checks its equivalence results; its step
times are measurements, printed and recorded in ``benchmarks/SCHEDULE_PLAN.md``, not asserted here.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from tests.support.training_processes import torchrun

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (EP=2)"),
]

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "schedule_plan_step.py"


def test_plan_matches_the_normal_path_on_two_gpus(tmp_path):
    results_path = tmp_path / "plan.json"
    command = [*torchrun(2), str(SCRIPT)]
    command += ["--seq-length", "512", "--microbatches", "3", "--warmup", "1", "--rounds", "2"]
    command += ["--json", str(results_path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    print(result.stdout[-3000:])
    results = json.loads(results_path.read_text())
    for name, equivalence in results["equivalence"].items():
        assert equivalence["microbatches"] == 3, name
        assert equivalence["same parameters with gradients"], name
        assert equivalence["max |loss difference|"] <= 2e-2, (name, equivalence)
        assert equivalence["max relative gradient difference"] <= 2e-2, (name, equivalence)
