"""The hybrid fine-grained schedule plan on GPUs: plan vs normal path within bf16 tolerance (noise, noise + KD).

Runs ``tests/gpu/hybrid_plan_check.py`` under torchrun: one GPU (EP=1, the plan's flag set after Megatron's
validation) on the local hybrid stack and on Bridge's Transformer Engine hybrid spec (where Transformer Engine is
installed), and two GPUs (EP=2, validated) where there are two.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest
import torch

from tests.support.training_processes import torchrun

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SCRIPT = Path(__file__).resolve().parent / "hybrid_plan_check.py"


def _check(tmp_path: Path, gpus: int, *flags: str) -> dict:
    results_path = tmp_path / "hybrid_plan.json"
    command = [*torchrun(gpus), str(SCRIPT), "--json", str(results_path), *flags]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    print(result.stdout[-4000:])
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-6000:]
    return json.loads(results_path.read_text())


def _assert_plan_matches(summary: dict) -> None:
    assert summary["all ranks ok"], summary
    assert set(summary["cases"]) == {"noise", "noise + KD"}
    for name, result in summary["cases"].items():
        assert result["microbatches"] == 3 and result["same parameters with gradients"], name
        assert result["final norm has a gradient"], name
        assert result["max |loss difference|"] <= 2e-2, (name, result)
        assert result["max relative gradient difference"] <= 2e-2, (name, result)


def test_hybrid_plan_matches_the_normal_path_on_one_gpu(tmp_path):
    _assert_plan_matches(_check(tmp_path, 1))


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None, reason="needs Transformer Engine")
def test_hybrid_plan_matches_the_normal_path_on_one_gpu_with_the_transformer_engine_spec(tmp_path):
    _assert_plan_matches(_check(tmp_path, 1, "--te"))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (EP=2)")
def test_hybrid_plan_matches_the_normal_path_on_two_gpus_at_ep2(tmp_path):
    summary = _check(tmp_path, 2)
    assert summary["validated"] and summary["world size"] == 2
    _assert_plan_matches(summary)
