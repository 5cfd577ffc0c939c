"""A dry run reaches for no model hub (issue 36, finding 10): the Slurm dry run of ``llama31_8b_noise_distillation``
printed ~90 lines of hub retries first (117 s) on a machine that cannot reach the hub.

The subprocesses run with an empty Hugging Face cache (``HF_HOME``), so the model's config is not cached: a dry run
must then say so in one line at once, whether or not this machine can reach the hub.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from nemo_noise_plugin.jobs.launch.offline_hub import HUB_MISS, hub_miss, hub_offline

REPO = pathlib.Path(__file__).resolve().parents[2]


def _environment(tmp_path: pathlib.Path) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    return {
        **env,
        "HF_HOME": str(tmp_path / "hf_home"),  # an empty cache
        "NEMORUN_HOME": str(tmp_path / "nemo_run_home"),
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "COLUMNS": "200",
    }


@pytest.mark.parametrize("before", [None, "0"])
def test_the_offline_mode_holds_inside_the_block_only(monkeypatch, before):
    from huggingface_hub import constants, is_offline_mode

    if before is None:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    else:
        monkeypatch.setenv("HF_HUB_OFFLINE", before)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    with hub_offline():
        assert is_offline_mode() and os.environ["HF_HUB_OFFLINE"] == "1"
    assert not is_offline_mode() and os.environ.get("HF_HUB_OFFLINE") == before


def test_a_config_missing_from_the_cache_is_a_hub_miss(tmp_path, monkeypatch):
    from transformers import AutoConfig

    with hub_offline(), pytest.raises(OSError) as missing:
        AutoConfig.from_pretrained("meta-llama/Meta-Llama-3.1-8B", cache_dir=str(tmp_path))
    assert hub_miss(missing.value)
    assert not hub_miss(ValueError("model.noise.alpha=-1 is invalid"))


def test_an_in_process_dry_run_of_a_hub_model_is_one_line_without_retries(tmp_path):
    command = [sys.executable, "-m", "nemo_noise_plugin.cli.finetune", "-f", "llama32_1b_noise_sft", "--dryrun"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=_environment(tmp_path))
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Retrying" not in result.stderr and "huggingface.co" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "python -m nemo_noise_plugin.cli.finetune: error: --factory 'llama32_1b_noise_sft' cannot be built here: "
        f"{HUB_MISS}."
    )


@pytest.mark.slow  # one nemo process: 30 s at load 16 on 2 cores (before: 155 s, 89 hub lines, without network)
def test_the_slurm_dry_run_of_the_readme_reaches_for_no_hub(tmp_path):
    nemo = pathlib.Path(sys.executable).with_name("nemo")
    arguments = ["llm", "finetune", "-f", "llama31_8b_noise_distillation", "executor=slurm", "executor.nodes=2"]
    command = [str(nemo), *arguments, "executor.account=acct", "--dryrun", "-y"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=_environment(tmp_path))
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "Retrying" not in output and "huggingface.co" not in output
    assert f"config        resolved by each rank: the recipe cannot be built here ({HUB_MISS})" in output
    assert "#SBATCH --nodes=2" in output
