"""A Bridge checkpoint is resumed only by a run of its settings (issue 36, finding 1): the launcher reads the
``run_config.yaml`` Bridge writes into each ``iter_NNNNNNN`` folder (``ConfigContainer.to_yaml``, as Bridge's
``save_checkpoint`` calls it) before Bridge's loop would load the checkpoint whatever it was trained with."""

from __future__ import annotations

import copy
import os
import shutil

import pytest

from nemo_noise_plugin.jobs.cpu.checkpoint import CheckpointMismatchError
from nemo_noise_plugin.jobs.launch.launcher import check_bridge_resume
from nemo_noise_plugin.recipes.tiny import tiny_noise_sft_config


def _config(folder, alpha=5.0):
    config = tiny_noise_sft_config(dir=str(folder), train_iters=4)
    config.model.noise.alpha = alpha
    return config


def _bridge_checkpoint(config, iteration=4, *, set_up=False):
    """What Bridge leaves in ``checkpoint.save`` after a save: the iteration's folder with its run config, then the
    tracker (the weights themselves are not read here). ``set_up``: the config as Bridge's set-up leaves it before it
    saves (``ConfigContainer.validate``: derived fields filled in, the data ``blend`` with its full paths)."""
    if set_up:
        config = copy.deepcopy(config)
        config.validate()
    folder = f"{config.checkpoint.save}/iter_{iteration:07d}"
    os.makedirs(folder, exist_ok=True)
    config.to_yaml(f"{folder}/run_config.yaml")
    with open(f"{config.checkpoint.save}/latest_checkpointed_iteration.txt", "w") as tracker:
        tracker.write(str(iteration))


def test_a_bridge_checkpoint_of_another_alpha_is_refused_naming_the_difference(tmp_path):
    _bridge_checkpoint(_config(tmp_path, alpha=5.0))
    with pytest.raises(CheckpointMismatchError) as refused:
        check_bridge_resume(_config(tmp_path, alpha=10.0))
    message = str(refused.value)
    assert message.startswith(f"checkpoint {tmp_path}/tiny_noise_sft/checkpoints (iteration 4) was saved by other")
    assert "model.noise.alpha (saved 5.0, this run 10.0); it is kept" in message


def test_a_bridge_checkpoint_of_the_other_kernel_math_is_refused(tmp_path):
    """``model.noise.fast_math`` draws other Gaussian and Laplace bits from the same counters (issue 34, item 3): a
    checkpoint resumes only under the math it was saved with, either way round."""
    exact, fast = _config(tmp_path / "exact"), _config(tmp_path / "fast")
    fast.model.noise.fast_math = True
    for saved, resumed, values in (
        (exact, fast, "saved False, this run True"),
        (fast, exact, "saved True, this run False"),
    ):
        _bridge_checkpoint(saved)
        resumed.checkpoint.load = saved.checkpoint.save
        with pytest.raises(CheckpointMismatchError, match=rf"model\.noise\.fast_math \({values}\)"):
            check_bridge_resume(resumed)


def test_a_bridge_checkpoint_of_these_settings_in_a_moved_folder_resumes(tmp_path):
    _bridge_checkpoint(_config(tmp_path / "first"))
    shutil.move(tmp_path / "first", tmp_path / "moved")
    check_bridge_resume(_config(tmp_path / "moved"))  # no error: Bridge's loop then resumes from it


@pytest.mark.parametrize(
    ("override", "difference"),
    [
        ("model.num_layers=2", "model.num_layers (saved 4, this run 2)"),
        ("model.hidden_size=128", "model.hidden_size (saved 256, this run 128)"),
        ("dataset.random_seed=7", "dataset.random_seed (saved 1234, this run 7)"),
        ("dataset.split=8,2,0", "dataset.split (saved '9,1,0', this run '8,2,0')"),
    ],
)
def test_a_bridge_checkpoint_of_another_model_shape_or_data_is_refused_naming_it(tmp_path, override, difference):
    """Issue 36, finding 1: the model and the data define a checkpoint too; only noise, KD and seed were compared."""
    _bridge_checkpoint(_config(tmp_path), set_up=True)
    other = _config(tmp_path)
    key, value = override.split("=")
    section, field = key.split(".")
    setattr(getattr(other, section), field, type(getattr(getattr(other, section), field))(value))
    with pytest.raises(CheckpointMismatchError) as refused:
        check_bridge_resume(other)
    assert difference in str(refused.value)


def test_a_set_up_bridge_checkpoint_of_these_settings_in_a_moved_folder_resumes(tmp_path):
    """Bridge's set-up fills fields the recipe leaves unset (kv_channels, the blend with its full paths): neither is a
    difference, nor is the folder the run was moved from."""
    _bridge_checkpoint(_config(tmp_path / "first"), set_up=True)
    shutil.move(tmp_path / "first", tmp_path / "moved")
    check_bridge_resume(_config(tmp_path / "moved"))
