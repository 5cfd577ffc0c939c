"""The tiny hybrid recipes (issue 35) through Megatron-Bridge's own GPU training loop, as ``nemo llm finetune`` runs
them (``python -m nemo_noise_plugin.cli.finetune --factory ...``): a real ``HybridModel`` from the plugin's hybrid
providers, Bridge's ``pretrain``, its checkpoints and its resume.

Checked: SFT and KD lower the loss over 30 steps (KD's term stays >= 0); a run stopped at step 15 and resumed from
Bridge's checkpoint gives the uninterrupted run's losses (to the GPU's non-deterministic reductions); the Mamba
recipe (``M*-M*-`` on Bridge's Transformer Engine hybrid spec) trains where mamba_ssm, causal_conv1d and Transformer
Engine are installed, and is skipped with the reason where they are not. No model download. Set
``NEMO_NOISE_GPU_RESULTS`` to a folder to keep each run's stdout there.
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.training_processes import training_env

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

STEPS, STOP = 30, 15
PROGRESS = re.compile(r"^\s*(\d+)/(\d+)\s+([0-9.]+)\s+(\S+)\s+(\d+)\s*$", re.MULTILINE)


def _mamba_kernels_missing() -> str | None:
    from nemo_noise_plugin.providers.hybrid import mamba_kernels_missing

    return mamba_kernels_missing()


def _finetune(name: str, factory: str, folder: Path, *overrides: str) -> subprocess.CompletedProcess:
    command = [
        sys.executable, "-m", "nemo_noise_plugin.cli.finetune", "--factory", factory, f"train.train_iters={STEPS}",
        f"checkpoint.save={folder}/checkpoints", f"checkpoint.load={folder}/checkpoints", *overrides,
    ]  # fmt: skip
    path = os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, env=training_env(PYTHONPATH=path))
    keep = os.environ.get("NEMO_NOISE_GPU_RESULTS")
    if keep:
        os.makedirs(keep, exist_ok=True)
        Path(keep, f"{name}.log").write_text(result.stdout + "\n--- stderr ---\n" + result.stderr[-20000:])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def _losses(stdout: str, column: int = 2) -> dict[int, float]:
    lines = PROGRESS.findall(stdout)
    assert lines, "no progress lines in the output:\n" + stdout[-3000:]
    return {int(line[0]): float(line[column]) for line in lines if int(line[1]) == STEPS}


def _falls(losses: dict[int, float]) -> tuple[float, float]:
    assert sorted(losses) == list(range(1, STEPS + 1)), losses
    first = statistics.mean(losses[step] for step in range(1, 6))
    last = statistics.mean(losses[step] for step in range(STEPS - 4, STEPS + 1))
    return first, last


def test_the_hybrid_sft_recipe_trains_through_bridge_and_resumes_from_its_checkpoint(tmp_path):
    whole = _finetune("hybrid_sft.whole", "tiny_hybrid_noise_sft", tmp_path / "whole")
    losses = _losses(whole.stdout)
    first, last = _falls(losses)
    print(f"tiny_hybrid_noise_sft: mean loss steps 1-5 {first:.4f}, steps {STEPS - 4}-{STEPS} {last:.4f}")
    assert last < first - 1.0, (first, last)

    stopped = tmp_path / "stopped"
    _finetune("hybrid_sft.stopped", "tiny_hybrid_noise_sft", stopped, f"train.exit_interval={STOP}")
    assert (stopped / "checkpoints" / f"iter_{STOP:07d}").is_dir()
    resumed = _losses(_finetune("hybrid_sft.resumed", "tiny_hybrid_noise_sft", stopped).stdout)
    assert sorted(resumed) == list(range(STOP + 1, STEPS + 1)), resumed
    differences = [abs(resumed[step] - losses[step]) for step in resumed]
    print(f"tiny_hybrid_noise_sft: resumed - uninterrupted loss, steps {STOP + 1}..{STEPS}: max {max(differences):.2e}")
    assert max(differences) < 2e-2, differences


def test_the_hybrid_distillation_recipe_trains_through_bridge(tmp_path):
    result = _finetune("hybrid_kd", "tiny_hybrid_noise_distillation", tmp_path)
    first, last = _falls(_losses(result.stdout))
    print(f"tiny_hybrid_noise_distillation: mean loss steps 1-5 {first:.4f}, steps {STEPS - 4}-{STEPS} {last:.4f}")
    assert last < first - 1.0, (first, last)
    assert all(float(kd) >= 0 for kd in _losses(result.stdout, column=3).values())


@pytest.mark.skipif(_mamba_kernels_missing() is not None, reason=str(_mamba_kernels_missing()))
def test_the_mamba_hybrid_recipe_trains_through_bridge(tmp_path):
    result = _finetune("mamba_hybrid_sft", "tiny_mamba_hybrid_noise_sft", tmp_path)
    first, last = _falls(_losses(result.stdout))
    print(f"tiny_mamba_hybrid_noise_sft: mean loss steps 1-5 {first:.4f}, steps {STEPS - 4}-{STEPS} {last:.4f}")
    assert last < first - 1.0, (first, last)
