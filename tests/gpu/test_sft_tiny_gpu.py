"""The instruction (SFT) path through Megatron-Bridge's GPU loop with a tiny GPT and a tiny chat tokenizer: Bridge's
finetuning data (chat template, answer-only loss) and the plugin's report callbacks on the datasets and tokenizer
as Bridge's ``setup()`` leaves them (at 62da161 the task report crashed here before step 1). No model download."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.support.training_processes import training_env

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

LAUNCHER = """
import sys
from nemo_noise_plugin.jobs.reports.artifacts import RunReport
from nemo_noise_plugin.jobs.reports.task_report import TaskReport
from nemo_noise_plugin.jobs.reports.robustness import RobustnessReport
from nemo_noise_plugin.jobs.launch.launcher import launch
from nemo_noise_plugin.jobs.progress import ProgressLine
from tests.support.chat_sft import tiny_chat_sft_config, write_chat_tokenizer

if __name__ == "__main__":  # Bridge's checkpoint workers re-import this script
    work = sys.argv[1]
    config = tiny_chat_sft_config(work + "/run", write_chat_tokenizer(work + "/tokenizer"), train_iters=30)
    report = RunReport(work + "/out")
    callbacks = [TaskReport(report, export=False), RobustnessReport(config.model.noise, report, "tiny chat"),
                 ProgressLine()]
    launch(config, callbacks=callbacks)
    print("REPORT", report.folder)
"""


def test_tiny_chat_recipe_trains_through_bridge_with_the_task_and_robustness_reports(tmp_path):
    script = tmp_path / "launch_tiny_chat.py"
    script.write_text(textwrap.dedent(LAUNCHER))
    path = os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))  # tests.support
    result = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=600,
        env=training_env(PYTHONPATH=path),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    losses = [float(m) for m in re.findall(r"^\s*\d+/30\s+([0-9.]+)", result.stdout, re.MULTILINE)]
    assert len(losses) == 30 and losses[-1] < losses[0], losses
    folder = re.search(r"^REPORT (.+)$", result.stdout, re.MULTILINE).group(1)
    task = json.loads(open(f"{folder}/task_report.json").read())
    assert set(task["after"]["splits"]) == {"validation", "test"}
    robustness = json.loads(open(f"{folder}/robustness.json").read())
    assert len(robustness["after"]) == 6
    print(result.stdout[-2500:])
