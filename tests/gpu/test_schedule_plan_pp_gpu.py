"""Interleaved schedule plan (PP=2, VPP=2) vs the normal interleaved path on GPUs, with noise on one chunk.

4 GPUs: EP=2 with Megatron's validation satisfied (the run issue 7 asks for). 2 GPUs: EP=1, the plan flag set after
validation (streams and pipeline traffic only). Runs ``tests/gpu/interleaved_plan_check.py`` under torchrun.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from tests.support.training_processes import torchrun

pytestmark = pytest.mark.gpu

SCRIPT = Path(__file__).resolve().parent / "interleaved_plan_check.py"


@pytest.mark.parametrize("gpus", [4, 2])
def test_interleaved_plan_matches_the_normal_path(tmp_path, gpus):
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} CUDA GPUs")
    summary_path = tmp_path / "summary.json"
    command = [*torchrun(gpus), str(SCRIPT)]
    result = subprocess.run([*command, "--json", str(summary_path)], capture_output=True, text=True, timeout=600)
    print(result.stdout[-4000:])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    ranks = json.loads(summary_path.read_text())
    assert all(rank["ok"] for rank in ranks)
    assert [rank["noisy virtual stages"] for rank in ranks if rank["pp rank"] == 0] == [[0]] * (gpus // 2)
    assert all(rank["plan config validated by Megatron"] == (gpus == 4) for rank in ranks)
