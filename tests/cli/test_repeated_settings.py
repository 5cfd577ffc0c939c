"""A setting given twice is refused naming it (issue 36, finding 8): before, the last one won without a word."""

from __future__ import annotations

import pytest

from nemo_noise_plugin.cli.finetune import main as finetune_main
from nemo_noise_plugin.jobs.launch.finetune import run_finetune
from nemo_noise_plugin.validation import SettingError
from nemo_noise_plugin.yaml_files import parse_key_values


def test_an_override_given_twice_is_refused_naming_both_values():
    with pytest.raises(SettingError) as refused:
        run_finetune("tiny_noise_sft", ["model.noise.alpha=5", "model.noise.alpha=10"], dryrun=True, print_fn=print)
    assert str(refused.value) == (
        "model.noise.alpha=['5', '10'] is invalid: expected one value (the setting is given more than once; keep one)."
    )


@pytest.mark.parametrize("option", ["-f", "--config-file"])
def test_the_finetune_front_door_refuses_an_option_given_twice(option, capsys):
    arguments = ["-f", "tiny_noise_sft", "--dryrun"] if option == "--config-file" else ["--dryrun"]
    with pytest.raises(SystemExit) as stopped:
        finetune_main([*arguments, option, "recipes/a.yaml", option, "recipes/b.yaml"])
    assert stopped.value.code == 2
    line = capsys.readouterr().err.strip()
    assert "is given more than once ('recipes/b.yaml'): expected it once." in line and "\n" not in line


def test_a_nemo_noise_argument_given_twice_is_refused():
    with pytest.raises(ValueError, match=r"^argument alpha= is given more than once: expected each argument once"):
        parse_key_values(["config=neftune_alpha5", "alpha=5", "alpha=10"])


def test_checkpoint_save_moves_checkpoint_load_with_it(tmp_path):
    """Issue 36, finding 10: ``checkpoint.save=DIR`` left ``checkpoint.load`` at the recipe's default folder."""
    config = run_finetune("tiny_noise_sft", [f"checkpoint.save={tmp_path}/c"], dryrun=True, print_fn=lambda _: None)
    assert config.checkpoint.load == f"{tmp_path}/c"
    both = [f"checkpoint.save={tmp_path}/c", f"checkpoint.load={tmp_path}/other"]
    assert (
        run_finetune("tiny_noise_sft", both, dryrun=True, print_fn=lambda _: None).checkpoint.load
        == f"{tmp_path}/other"
    )


@pytest.mark.slow  # a nemo subprocess: about 5 s of CPU (measured 2026-12-03), 20 s on a loaded 2-core machine
def test_nemo_llm_finetune_refuses_a_factory_given_twice():
    import os
    import pathlib
    import subprocess
    import sys

    nemo = pathlib.Path(sys.executable).with_name("nemo")
    repository = pathlib.Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repository), os.environ.get("PYTHONPATH", "")])}
    arguments = ["llm", "finetune", "-f", "tiny_noise_sft", "-f", "tiny_noise_distillation", "--dryrun"]
    result = subprocess.run([str(nemo), *arguments], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 2, result.stderr[-3000:]
    assert (
        "Error: --factory/-f is given more than once (['tiny_noise_sft', 'tiny_noise_distillation']): expected it once."
        in result.stderr
    )
    assert "Dry run" not in result.stdout
