"""The CPU loop's checkpoints: a run stopped and resumed trains exactly as an uninterrupted one (same noise, same
batches, same optimizer state), a checkpoint is what its recorded settings say (never loaded for other settings,
whatever its name; resumed from a moved folder), and a save is all or nothing and on disk when it returns."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from nemo_noise_plugin.jobs.cpu.checkpoint import CheckpointMismatchError, CpuCheckpoint, run_fingerprint
from nemo_noise_plugin.jobs.cpu.loop import run_cpu_loop
from nemo_noise_plugin.recipes.tiny import tiny_noise_sft_config
from nemo_noise_plugin.training.forward_step import noise_forward_step
from nemo_noise_plugin.upstream.bridge_imports import import_bridge

STEPS = 4

_Callback = import_bridge("megatron.bridge.training.callbacks").Callback


class Record(_Callback):
    """The loss of every step (a function of the weights, the batch and the step's noise) and the final weights."""

    def __init__(self) -> None:
        self.losses: dict[int, float] = {}
        self.weights: dict[str, torch.Tensor] | None = None

    def on_train_step_end(self, context):
        self.losses[context.state.train_state.step] = float(context.loss_dict["lm loss"])

    def on_train_end(self, context):
        self.weights = {k: v.clone() for k, v in context.model[0].state_dict().items() if torch.is_tensor(v)}


def _config(folder, *, exit_interval=None, alpha=10.0):
    config = tiny_noise_sft_config(dir=str(folder), train_iters=STEPS, lr=1e-3)
    config.model.noise.alpha = alpha
    config.checkpoint.save_interval = 1
    config.train.exit_interval = exit_interval
    return config


def _run(config) -> Record:
    record = Record()
    run_cpu_loop(config, noise_forward_step, [record])
    return record


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return _run(_config(tmp_path_factory.mktemp("straight")))


def test_a_stopped_and_resumed_run_equals_an_uninterrupted_one_bitwise(tmp_path, uninterrupted, capsys):
    stopped = _run(_config(tmp_path, exit_interval=2))
    assert sorted(stopped.losses) == [0, 1] and stopped.weights is None  # stopped after iteration 2, no train end
    assert "stopped at iteration 2" in capsys.readouterr().out
    resumed = _run(_config(tmp_path))
    assert "at iteration 2 of 4" in capsys.readouterr().out
    assert sorted(resumed.losses) == [2, 3]
    assert {**stopped.losses, **resumed.losses} == uninterrupted.losses  # exact floats: same noise, data, state
    assert resumed.weights.keys() == uninterrupted.weights.keys()
    for name, value in resumed.weights.items():
        assert torch.equal(value, uninterrupted.weights[name]), name


def test_a_checkpoint_of_other_settings_is_neither_loaded_nor_overwritten(tmp_path, capsys):
    _run(_config(tmp_path, exit_interval=2))
    (saved,) = (tmp_path / "tiny_noise_sft" / "checkpoints").glob("cpu_state-*.pt")
    before = saved.read_bytes()
    capsys.readouterr()
    other = _run(_config(tmp_path, exit_interval=1, alpha=5.0))
    out = capsys.readouterr().out
    assert "resumed" not in out and sorted(other.losses) == [0]
    assert (
        f"holds 1 state of other settings (the newest, {saved.name}: model.noise.alpha (saved 10.0, this run 5.0))"
        in out
    )
    assert saved.read_bytes() == before
    assert len(list(saved.parent.glob("cpu_state-*.pt"))) == 2


def test_the_fingerprint_ignores_when_a_run_stops_but_not_what_it_computes(tmp_path):
    base = run_fingerprint(_config(tmp_path))
    assert run_fingerprint(_config(tmp_path, exit_interval=2)) == base
    assert run_fingerprint(_config(tmp_path, alpha=5.0)) != base
    steps = _config(tmp_path)
    steps.train.train_iters = STEPS + 1
    assert run_fingerprint(steps) != base
    seed = _config(tmp_path)
    seed.rng.seed += 1
    assert run_fingerprint(seed) != base


def test_a_checkpoint_under_this_runs_name_with_other_settings_is_refused_naming_the_difference(tmp_path):
    _run(_config(tmp_path, exit_interval=2, alpha=5.0))
    (saved,) = (tmp_path / "tiny_noise_sft" / "checkpoints").glob("cpu_state-*.pt")
    planted = saved.with_name(f"cpu_state-{run_fingerprint(_config(tmp_path))}.pt")  # the alpha-10 run's name
    saved.rename(planted)
    with pytest.raises(CheckpointMismatchError) as refused:
        _run(_config(tmp_path))
    message = str(refused.value)
    assert message.startswith(f"checkpoint {planted} was saved by other settings: ")
    assert "model.noise.alpha (saved 5.0, this run 10.0); it is kept" in message and "\n" not in message
    assert planted.is_file()


def test_a_moved_run_folder_resumes_from_its_checkpoint(tmp_path, capsys):
    _run(_config(tmp_path / "first", exit_interval=2))
    shutil.move(tmp_path / "first", tmp_path / "moved")
    capsys.readouterr()
    resumed = _run(_config(tmp_path / "moved"))
    assert "at iteration 2 of 4" in capsys.readouterr().out
    assert sorted(resumed.losses) == [2, 3]


def test_a_save_is_on_disk_before_it_returns_the_file_then_the_rename(tmp_path, monkeypatch):
    """The real write path, with ``os.fsync`` and ``os.replace`` recorded as they run: the state's bytes are flushed
    before the rename, and the folder after it (else a crash can leave the new name pointing at no data, or the old
    name back)."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(descriptor):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{descriptor}")))
        real_fsync(descriptor)

    def replace(source, target):
        events.append(("replace", str(target)))
        real_replace(source, target)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    checkpoint = CpuCheckpoint(str(tmp_path), str(tmp_path), "0123456789abcdef")
    checkpoint.save({"iteration": 1})
    (kind, first), *rest = events
    assert kind == "fsync" and first.startswith(str(tmp_path / f".{checkpoint.name}.")) and first.endswith(".partial")
    assert rest == [("replace", str(checkpoint.save_path)), ("fsync", str(tmp_path))]


def test_an_interrupted_save_keeps_the_previous_state_and_leaves_no_partial_file(tmp_path, monkeypatch):
    checkpoint = CpuCheckpoint(str(tmp_path), str(tmp_path), "0123456789abcdef")
    checkpoint.save({"iteration": 1})

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save({"iteration": 2})
    assert checkpoint.load() == {"iteration": 1}
    assert os.listdir(tmp_path) == [checkpoint.name]


class RecordBoth(Record):
    """Also the KD loss of every step (a function of the clean teacher's weights too)."""

    def __init__(self) -> None:
        super().__init__()
        self.kd: dict[int, float] = {}

    def on_train_step_end(self, context):
        super().on_train_step_end(context)
        self.kd[context.state.train_state.step] = float(context.loss_dict["kd loss"])


def _distillation(folder, exit_interval=None):
    from nemo_noise_plugin.recipes.tiny import tiny_noise_distillation_config

    config = tiny_noise_distillation_config(dir=str(folder), train_iters=STEPS, lr=1e-3)
    config.checkpoint.save_interval = 1
    config.train.exit_interval = exit_interval
    return config


def test_a_resumed_distillation_run_distils_from_the_weights_it_started_from(tmp_path):
    from nemo_noise_plugin.jobs.launch.warm_start import CaptureWeights, StartFromWeights
    from nemo_noise_plugin.training.forward_step import distillation_forward_step

    capture = CaptureWeights()  # a clean start that differs from the initialisation: the teacher to distil from
    clean = _config(tmp_path / "clean")
    clean.model.noise.enabled = False
    run_cpu_loop(clean, noise_forward_step, [capture])

    def run(folder, exit_interval=None) -> RecordBoth:
        record = RecordBoth()
        run_cpu_loop(
            _distillation(folder, exit_interval), distillation_forward_step, [StartFromWeights(capture.weights), record]
        )
        return record

    straight = run(tmp_path / "straight")
    stopped = run(tmp_path / "resumed", exit_interval=2)
    resumed = run(tmp_path / "resumed")
    assert sorted(resumed.kd) == [2, 3]
    assert {**stopped.kd, **resumed.kd} == straight.kd  # the same teacher after the restart
    assert {**stopped.losses, **resumed.losses} == straight.losses
    for name, value in resumed.weights.items():
        assert torch.equal(value, straight.weights[name]), name


def test_a_damaged_checkpoint_is_a_clear_error_and_is_kept(tmp_path):
    _run(_config(tmp_path, exit_interval=2))
    (saved,) = (tmp_path / "tiny_noise_sft" / "checkpoints").glob("cpu_state-*.pt")
    saved.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match=rf"checkpoint {saved} cannot be resumed from .*move or delete it"):
        _run(_config(tmp_path))
    assert saved.read_bytes() == b"not a checkpoint"
