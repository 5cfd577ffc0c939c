"""The commands' dry runs and YAML exports hide the GPUs before anything can initialise CUDA (``cli.gpu_free``).

Each command runs in a subprocess under ``tests/support/device_queries.py``, which records ``CUDA_VISIBLE_DEVICES``
at every CUDA device query. On this CPU machine the queries still happen (torch asks the driver); what is checked is
that each one already saw the GPUs hidden, so on a GPU machine none can open a CUDA context. The GPU twin,
``tests/gpu/test_gpu_free_dry_run_gpu.py``, checks that no context is opened there.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from nemo_noise_plugin.cli.gpu_free import hide_gpus_for_dry_run

REPO = pathlib.Path(__file__).resolve().parents[2]
DEVICE_QUERIES = REPO / "tests" / "support" / "device_queries.py"


def device_queries(tmp_path: pathlib.Path, *command: str) -> tuple[str, str]:
    """``(DEVICE QUERIES line, CUDA INITIALIZED line)`` of ``command`` run under ``device_queries.py``."""
    env = {**os.environ, "NEMORUN_HOME": str(tmp_path / "home"), "COLUMNS": "200"}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    result = subprocess.run(
        [sys.executable, str(DEVICE_QUERIES), *command],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env=env,
    )
    lines = result.stderr.splitlines()
    queries = [line for line in lines if line.startswith("DEVICE QUERIES")]
    initialized = [line for line in lines if line.startswith("CUDA INITIALIZED")]
    assert queries and initialized, result.stdout[-2000:] + result.stderr[-3000:]
    return queries[-1], initialized[-1]


@pytest.mark.slow
@pytest.mark.parametrize(
    "command",
    [
        ("nemo", "llm", "finetune", "-f", "tiny_noise_distillation", "--dryrun"),
        (
            "nemo",
            "llm",
            "finetune",
            "-f",
            "tiny_noise_sft",
            "--dryrun",
            "executor=docker",
            "executor.container_image=i",
        ),
        ("nemo", "llm", "finetune", "-f", "tiny_noise_sft", "--to-yaml", "run.yaml"),
        ("python-m", "nemo_noise_plugin.cli.finetune", "-f", "tiny_noise_distillation", "--dryrun"),
    ],
    ids=["nemo-dryrun", "nemo-dryrun-executor", "nemo-to-yaml", "python-m-dryrun"],
)
def test_dry_runs_query_cuda_only_with_the_gpus_hidden(tmp_path, command):
    queries, _ = device_queries(tmp_path, *command)
    assert queries == "DEVICE QUERIES ''"  # every query saw CUDA_VISIBLE_DEVICES="", the first one included


@pytest.mark.slow
def test_a_command_that_is_not_a_dry_run_keeps_the_gpus(tmp_path):
    queries, _ = device_queries(
        tmp_path, "nemo", "noise", "ledger", "config=dp_gaussian_mechanism", "sequence_length=8"
    )
    assert queries in ("DEVICE QUERIES None", "DEVICE QUERIES (none)")


def test_only_dry_run_options_hide_the_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert not hide_gpus_for_dry_run(["nemo", "llm", "finetune", "-f", "tiny_noise_sft", "-y"])
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert hide_gpus_for_dry_run(["nemo", "llm", "finetune", "-f", "tiny_noise_sft", "--to-yaml=run.yaml"])
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
