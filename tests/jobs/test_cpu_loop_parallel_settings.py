"""The single-process CPU loop refuses model-parallel settings it cannot honour (issue 26: PP=2 trained only the first
stage and exited 0), naming the setting, before any model is built or any file is written."""

from __future__ import annotations

import pytest

from nemo_noise_plugin.jobs.cpu.loop import CPU_LOOP_PARALLEL_SETTINGS, check_cpu_loop_settings, run_cpu_loop
from nemo_noise_plugin.jobs.launch.launcher import launch
from nemo_noise_plugin.recipes.tiny import tiny_noise_sft_config
from nemo_noise_plugin.training.forward_step import noise_forward_step


@pytest.mark.parametrize("setting", sorted(CPU_LOOP_PARALLEL_SETTINGS))
def test_each_model_parallel_setting_above_one_is_refused_by_name(setting, tmp_path):
    config = tiny_noise_sft_config(dir=str(tmp_path / "run"), train_iters=1)
    setattr(config.model, setting, 2)
    with pytest.raises(ValueError, match=rf"model\.{setting}=2 is invalid on the CPU loop.*expected 1"):
        check_cpu_loop_settings(config)


def test_the_default_sizes_pass(tmp_path):
    check_cpu_loop_settings(tiny_noise_sft_config(dir=str(tmp_path), train_iters=1))


def test_run_cpu_loop_refuses_pipeline_parallel_before_building_anything(tmp_path):
    config = tiny_noise_sft_config(dir=str(tmp_path / "run"), train_iters=1)
    config.model.pipeline_model_parallel_size = 2
    config.checkpoint.save = str(tmp_path / "checkpoints")
    with pytest.raises(ValueError, match=r"model\.pipeline_model_parallel_size=2"):
        run_cpu_loop(config, noise_forward_step)
    assert not (tmp_path / "checkpoints").exists()


def test_launch_on_the_cpu_refuses_tensor_parallel_before_the_checkpoint_folder_exists(tmp_path):
    config = tiny_noise_sft_config(dir=str(tmp_path / "run"), train_iters=1)
    config.checkpoint.save = str(tmp_path / "checkpoints")
    with pytest.raises(ValueError, match=r"model\.tensor_model_parallel_size=2"):
        launch(config, ["model.tensor_model_parallel_size=2"], allow_cpu_loop=True)
    assert not (tmp_path / "checkpoints").exists()
