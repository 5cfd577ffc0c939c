"""On a GPU machine, the commands' dry runs open no CUDA context; the same command without ``--dryrun`` does.

The control is ``nemo llm finetune --help``: ``nemo`` imports Megatron-Bridge's own entry point at start-up, whose
ModelOpt import opens a context on GPU 0 unless the GPUs are hidden first (``cli.gpu_free``).
"""

from __future__ import annotations

import pytest
import torch

from tests.cli.test_gpu_free_dry_run import device_queries

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize(
    "command",
    [
        ("nemo", "llm", "finetune", "-f", "tiny_noise_distillation", "--dryrun"),
        ("nemo", "llm", "finetune", "-f", "tiny_noise_sft", "--dryrun", "executor=local"),
        ("nemo", "llm", "finetune", "-f", "tiny_noise_sft", "--to-yaml", "run.yaml"),
        ("python-m", "nemo_noise_plugin.cli.finetune", "-f", "tiny_noise_distillation", "--dryrun"),
    ],
    ids=["nemo-dryrun", "nemo-dryrun-executor", "nemo-to-yaml", "python-m-dryrun"],
)
def test_dry_runs_open_no_cuda_context(tmp_path, command):
    assert device_queries(tmp_path, *command)[1] == "CUDA INITIALIZED False"


def test_control_the_nemo_command_opens_a_context_without_a_dry_run(tmp_path):
    assert device_queries(tmp_path, "nemo", "llm", "finetune", "--help")[1] == "CUDA INITIALIZED True"
