"""NeMo-Run's ``nemo`` imports every entry-point module at start-up: the plugin's change the process (quiet logging,
GPUs hidden for a dry run) only when the plugin's own sub-command runs, never for another package's command."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from nemo_noise_plugin.cli.console import INFO_ONLY_LOGGERS, running_the_plugin_command

PROBE = """
import json, logging, os, sys
sys.argv = json.loads(sys.argv[1])
import nemo_noise_plugin.cli.nemo_llm, nemo_noise_plugin.cli.nemo_noise  # what nemo does at start-up
print(json.dumps({"cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
                  "levels": [logging.getLogger(name).level for name in %r]}))
"""


@pytest.mark.parametrize(
    ("argv", "ours"),
    [
        (["nemo", "llm", "finetune", "-f", "tiny_noise_sft", "-y"], True),
        (["/usr/bin/nemo", "noise", "audit", "model=tiny"], True),
        (["nemo", "--verbose", "llm", "finetune", "--dryrun"], True),
        (["nemo", "llm", "pretrain", "--dryrun"], False),
        (["nemo", "other_package", "train", "--dryrun"], False),
        (["nemo"], False),
        (["python", "llm", "finetune"], False),
    ],
)
def test_the_plugin_command_is_recognised_by_its_words(argv, ours):
    assert running_the_plugin_command(argv) is ours


def _probe(argv: list[str]) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    result = subprocess.run(
        [sys.executable, "-c", PROBE % (list(INFO_ONLY_LOGGERS),), json.dumps(argv)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=True,
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_another_packages_nemo_command_keeps_its_gpus_and_its_logging():
    other = _probe(["nemo", "other_package", "train", "--dryrun"])
    assert other["cuda"] is None
    assert all(level == 0 for level in other["levels"])  # NOTSET: untouched
    ours = _probe(["nemo", "llm", "finetune", "-f", "tiny_noise_sft", "--dryrun"])
    assert ours["cuda"] == ""
    assert any(level != 0 for level in ours["levels"])
