"""Reports that reproduce their run (issue 26): every report JSON holds the run's provenance (recipe, resolved config
and its hash, mechanism and level, steps, seeds, version, data hashes), figure titles come from it (``noise off``
for a run without noise), and ``keep_last`` keeps only the newest report folders and checkpoints, safely."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from nemo_noise_plugin.jobs.reports.artifacts import (
    CPU_STATE_PATTERN,
    ITERATION_PATTERN,
    TRACKER_FILE,
    RunReport,
    prune_checkpoints,
    prune_reports,
)
from nemo_noise_plugin.jobs.reports.provenance import data_files, run_provenance, run_title
from tests.jobs import test_sft_callbacks_bridge_state as bridge_fixtures

bridge_state = bridge_fixtures.bridge_state
"""Bridge's ``GlobalState`` and a tiny chat GPT after ``setup()``'s tokenizer and data steps (NEFTune alpha 5)."""
clean_attention_settings = bridge_fixtures.clean_attention_settings

FIELDS = {"recipe", "plugin_version", "mechanism", "level", "train_iters", "global_batch_size", "seeds"}
FIELDS |= {"data_files", "config_sha256", "config", "source", "command_line"}


def _context(state, model, user_state):
    from nemo_noise_plugin.upstream.bridge_imports import import_bridge

    callbacks = import_bridge("megatron.bridge.training.callbacks")
    return callbacks.CallbackContext(state=state, model=model, user_state=user_state)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory):
    from nemo_noise_plugin.recipes import tiny_noise_sft_config

    return tiny_noise_sft_config(dir=str(tmp_path_factory.mktemp("runs")), train_iters=12)


def test_the_provenance_of_the_tiny_recipe_holds_every_field(tiny_config):
    provenance = run_provenance(tiny_config, "tiny_noise_sft")
    assert set(provenance) == FIELDS
    assert provenance["recipe"] == "tiny_noise_sft"
    assert provenance["plugin_version"] == importlib.metadata.version("nemo-noise-plugin")
    noise = tiny_config.model.noise
    assert provenance["mechanism"] == "uniform"
    assert provenance["level"] == {"field": "alpha", "value": noise.alpha}
    assert provenance["train_iters"] == 12 and provenance["global_batch_size"] == tiny_config.train.global_batch_size
    assert provenance["seeds"] == {"rng": 1234, "noise": noise.seed, "dataset": tiny_config.dataset.random_seed}
    assert provenance["config"]["train"]["train_iters"] == 12  # the whole resolved config, Bridge's to_dict
    assert provenance["config"]["model"]["noise"]["alpha"] == noise.alpha
    json.dumps(provenance, allow_nan=False)  # JSON as it is


def test_the_provenance_names_the_commit_of_the_checkout_and_the_command_line(tiny_config):
    """Issue 36, finding 10: reports recorded the version (0.1.0 at every commit) but no commit and no command."""
    import shlex
    import subprocess
    import sys

    provenance = run_provenance(tiny_config, "tiny_noise_sft")
    assert provenance["command_line"] == shlex.join(sys.orig_argv)
    repository = Path(__file__).resolve().parents[2]
    if not (repository / ".git").exists():
        assert provenance["source"] is None  # an installed copy of the tests: no checkout to name
        return
    head = subprocess.run(["git", "-C", str(repository), "rev-parse", "HEAD"], capture_output=True, text=True)
    assert provenance["source"]["commit"] == head.stdout.strip() and len(head.stdout.strip()) == 40
    assert isinstance(provenance["source"]["modified"], bool)


def test_the_command_line_is_the_one_the_shell_would_take_again(tmp_path):
    import os
    import shlex
    import subprocess
    import sys

    code = "from nemo_noise_plugin.jobs.reports.provenance import command_line; print(command_line())"
    repository = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([repository, os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-c", code, "--alpha", "5", "a name with spaces"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert shlex.split(result.stdout.strip()) == command


def test_the_data_hashes_are_the_sha256_of_the_corpus_file_the_run_reads(tiny_config):
    provenance = run_provenance(tiny_config, "tiny_noise_sft")
    corpus = Path(tiny_config.dataset.data_path + ".bin")
    assert provenance["data_files"] == {str(corpus): _sha256(corpus)}  # the data; not the .idx index file


def test_the_config_hash_is_stable_and_changes_when_a_setting_changes(tiny_config):
    first, second = (run_provenance(tiny_config, "tiny_noise_sft")["config_sha256"] for _ in range(2))
    assert first == second and len(first) == 64
    expected = hashlib.sha256(
        json.dumps(run_provenance(tiny_config)["config"], sort_keys=True, separators=(",", ":")).encode()
    ).hexdigest()
    assert first == expected
    tiny_config.train.train_iters += 1
    try:
        assert run_provenance(tiny_config, "tiny_noise_sft")["config_sha256"] != first
    finally:
        tiny_config.train.train_iters -= 1
    assert run_provenance(tiny_config, "tiny_noise_sft")["config_sha256"] == first


def test_noise_off_is_mechanism_off_and_the_title_says_noise_off(tiny_config):
    quiet = dataclasses.replace(tiny_config.model.noise, enabled=False)
    original, tiny_config.model.noise = tiny_config.model.noise, quiet
    try:
        provenance = run_provenance(tiny_config, "tiny_noise_sft")
    finally:
        tiny_config.model.noise = original
    assert provenance["mechanism"] == "off" and provenance["level"] == "off"
    assert run_title(provenance) == "tiny_noise_sft: noise off, 12 steps, seed 1234"
    assert (
        run_title(run_provenance(tiny_config, "tiny_noise_sft"))
        == "tiny_noise_sft: uniform alpha=5, 12 steps, seed 1234"
    )
    assert run_title(provenance, 25) == "tiny_noise_sft: noise off, 12 steps after 25 clean, seed 1234"


def test_a_finetuning_dataset_hashes_its_jsonl_files_and_skips_bridges_index_files(tmp_path):
    for name in ("training.jsonl", "validation.jsonl"):
        (tmp_path / name).write_text(f'{{"name": "{name}"}}\n')
    (tmp_path / "training.jsonl.idx.npy").write_bytes(b"index")
    (tmp_path / "training.jsonl.idx.info").write_text("{}")
    found = data_files(SimpleNamespace(dataset_root=str(tmp_path)))
    assert found == {str(tmp_path / n): _sha256(tmp_path / n) for n in ("training.jsonl", "validation.jsonl")}


@pytest.mark.parametrize("bridge_state", [None], indirect=True, ids=["unpacked"])
def test_the_robustness_report_json_holds_the_provenance_and_its_title_says_noise_off(bridge_state, tmp_path, capsys):
    from nemo_noise_plugin.jobs.reports.robustness import RobustnessReport

    state, model = bridge_state
    state.cfg.model.noise = dataclasses.replace(state.cfg.model.noise, enabled=False)  # the control's setting
    robustness = RobustnessReport(state.cfg.model.noise, RunReport(tmp_path, recipe="tiny_chat"))
    user_state: dict = {}
    robustness.on_train_start(_context(state, model, user_state))
    robustness.on_train_end(_context(state, model, user_state))
    written = json.loads((robustness.folder / "robustness.json").read_text())
    provenance = written["provenance"]
    assert set(provenance) == FIELDS and provenance["recipe"] == "tiny_chat"
    assert provenance["mechanism"] == "off" and provenance["train_iters"] == state.cfg.train.train_iters
    root = Path(state.cfg.dataset.dataset_root)
    assert provenance["data_files"] == {str(path): _sha256(path) for path in sorted(root.glob("*.jsonl"))}
    assert provenance["data_files"]  # the instruction data's training, validation and test files
    assert set(written) == {"provenance", "before", "after"}
    out = capsys.readouterr().out
    assert f"robustness report (tiny_chat: noise off, {state.cfg.train.train_iters} steps, seed" in out
    assert "alpha" not in out.split("robustness report (")[1].split(")")[0]


@pytest.mark.parametrize("bridge_state", [None], indirect=True, ids=["unpacked"])
def test_the_task_report_json_holds_the_same_provenance(bridge_state, tmp_path):
    from nemo_noise_plugin.jobs.reports.task_report import TaskReport

    state, model = bridge_state
    report = RunReport(tmp_path, recipe="tiny_chat")
    task = TaskReport(report, export=False, frontier=False)
    user_state: dict = {}
    task.on_train_start(_context(state, model, user_state))
    task.on_train_end(_context(state, model, user_state))
    report.finish()
    written = json.loads((report.folder / "task_report.json").read_text())
    assert written["provenance"] == run_provenance(state.cfg, "tiny_chat")
    assert written["provenance"]["level"] == {"field": "alpha", "value": 5.0}
    assert written["run"]["train_iters"] == written["provenance"]["train_iters"]  # the older section stays


def test_the_audit_report_provenance_holds_its_settings_version_and_data_hash(tmp_path):
    from nemo_noise_plugin.jobs.audit.report import audit_provenance

    data = tmp_path / "chats.jsonl"
    data.write_text('{"text": "hello"}\n')
    provenance = audit_provenance({"model": "tiny", "data": str(data), "tokens": 100})
    assert provenance["command"] == "nemo noise audit"
    assert provenance["command_line"] and "source" in provenance  # the call and the code behind the report
    assert provenance["plugin_version"] == importlib.metadata.version("nemo-noise-plugin")
    assert provenance["settings"] == {"model": "tiny", "data": str(data), "tokens": 100}
    assert provenance["data_files"] == {str(data): _sha256(data)}
    assert audit_provenance({"model": "tiny", "data": "corpus"})["data_files"] == {}  # a named source, no file


# keep-last-N


def _runs(reports: Path, count: int) -> list[str]:
    names = [f"20260101-00000{index}-{100 + index}" for index in range(1, count + 1)]  # oldest first
    for name in names:
        (reports / name).mkdir(parents=True)
        (reports / name / "robustness.json").write_text("{}")
    return names


def test_prune_reports_keeps_exactly_the_newest_n_and_ignores_unrelated_folders(tmp_path):
    names = _runs(tmp_path, 5)
    (tmp_path / "latest").symlink_to(names[-1])
    folders = ["my-run", ".20260101-000009-9.partial-x1", "20260101-000009"]  # not a run id; a write in progress
    for name in folders:
        (tmp_path / name).mkdir()
    (tmp_path / "20260101-000008-8").write_text("a file, not a report folder")
    unrelated = [*folders, "20260101-000008-8"]
    deleted = prune_reports(tmp_path, 2)
    assert sorted(path.name for path in deleted) == names[:3]
    assert sorted(os.listdir(tmp_path)) == sorted([*names[3:], "latest", *unrelated])


def test_prune_reports_never_deletes_the_folder_latest_points_at(tmp_path):
    names = _runs(tmp_path, 4)
    (tmp_path / "latest").symlink_to(names[0])  # e.g. a newer run that never finished its report
    prune_reports(tmp_path, 1)
    assert sorted(name for name in os.listdir(tmp_path) if name != "latest") == [names[0], names[-1]]


def test_a_run_report_with_keep_last_keeps_the_newest_n_after_each_finish(tmp_path):
    for index in range(1, 5):
        report = RunReport(tmp_path, f"20260101-00000{index}-7", keep_last=2)
        report.write_json("robustness.json", {"value": index})
        report.finish()
    reports = tmp_path / "reports"
    assert sorted(os.listdir(reports)) == ["20260101-000003-7", "20260101-000004-7", "latest"]
    assert os.readlink(reports / "latest") == "20260101-000004-7"


@pytest.mark.parametrize("keep", [0, -1, 1.5, True])
def test_keep_last_must_be_a_positive_integer(tmp_path, keep):
    with pytest.raises(ValueError, match=f"keep_last={keep!r} is invalid: expected an integer >= 1"):
        RunReport(tmp_path, keep_last=keep)


def _iterations(folder: Path, steps: list[int], tracked: int | None) -> None:
    for step in steps:
        (folder / f"iter_{step:07d}").mkdir(parents=True)
        (folder / f"iter_{step:07d}" / "run_config.yaml").write_text("x")
    if tracked is not None:
        (folder / TRACKER_FILE).write_text(str(tracked))


def test_prune_checkpoints_keeps_the_newest_n_and_the_tracked_one_never_a_save_in_progress(tmp_path):
    _iterations(tmp_path, [2, 4, 6, 8], tracked=6)  # iteration 8: an asynchronous save not yet tracked
    _iterations(tmp_path / "control", [3, 6, 9], tracked=9)  # a phase's own folder, pruned on its own
    for name in ("iter_final", "iter_12", "release"):
        (tmp_path / name).mkdir()
    deleted = prune_checkpoints(tmp_path, 2)
    assert sorted(path.relative_to(tmp_path).as_posix() for path in deleted) == ["control/iter_0000003", "iter_0000002"]
    left = sorted(os.listdir(tmp_path))
    kept = ["iter_0000004", "iter_0000006", "iter_0000008", "iter_12", "iter_final"]
    assert left == ["control", *kept, TRACKER_FILE, "release"]
    assert sorted(os.listdir(tmp_path / "control")) == ["iter_0000006", "iter_0000009", TRACKER_FILE]


def test_prune_checkpoints_without_a_tracker_deletes_no_iteration(tmp_path):
    _iterations(tmp_path, [2, 4, 6], tracked=None)
    assert prune_checkpoints(tmp_path, 1) == []
    assert len(os.listdir(tmp_path)) == 3


def test_prune_checkpoints_keeps_the_newest_cpu_loop_states_and_ignores_partial_and_other_files(tmp_path):
    states = [tmp_path / f"cpu_state-{index:016x}.pt" for index in range(3)]
    for age, path in enumerate(states):
        path.write_bytes(b"state")
        os.utime(path, (1_000_000 + age, 1_000_000 + age))  # states[2] is the newest
    others = [".cpu_state-0000000000000009.pt.abc.partial", "cpu_state-notes.pt", "bridge.log"]
    for name in others:
        (tmp_path / name).write_text("x")
    deleted = prune_checkpoints(tmp_path, 1)
    assert sorted(deleted) == states[:2]
    assert sorted(os.listdir(tmp_path)) == sorted([states[2].name, *others])


def test_the_patterns_match_the_names_bridge_and_the_cpu_loop_give():
    from nemo_noise_plugin.jobs.cpu.checkpoint import CpuCheckpoint
    from nemo_noise_plugin.upstream.bridge_imports import import_bridge

    utils = import_bridge("megatron.bridge.training.utils.checkpoint_utils")
    assert ITERATION_PATTERN.fullmatch(os.path.basename(utils.get_checkpoint_name("ckpt", 60)))
    assert os.path.basename(utils.get_checkpoint_tracker_filename("ckpt")) == TRACKER_FILE
    assert CPU_STATE_PATTERN.fullmatch(CpuCheckpoint("ckpt", None, "0123456789abcdef").name)


def test_the_main_job_offers_keep_last_in_its_help(capsys):
    import inspect

    from nemo_noise_plugin.cli import main_job
    from nemo_noise_plugin.jobs.main_job import launch_with_report

    with pytest.raises(SystemExit):
        main_job.parse_args(["--help"])
    assert "--keep-last N" in capsys.readouterr().out
    assert main_job.parse_args(["--keep-last", "3"]).keep_last == 3
    assert main_job.parse_args([]).keep_last is None
    assert {"keep_last", "recipe"} <= set(inspect.signature(launch_with_report).parameters)


@pytest.mark.parametrize("bridge_state", [None], indirect=True, ids=["unpacked"])
def test_each_line_of_the_audit_callback_holds_the_provenance_without_the_config(bridge_state, tmp_path):
    from nemo_noise_plugin.jobs.reports.audit_callback import PrivacyAuditCallback
    from nemo_noise_plugin.jobs.reports.provenance import compact_provenance

    state, model = bridge_state
    callback = PrivacyAuditCallback(state.cfg.model.noise, str(tmp_path), held_out_batches=1, recipe="tiny_chat")
    callback.on_eval_end(_context(state, model, {}))
    (line,) = (tmp_path / "privacy_audit.jsonl").read_text().splitlines()
    provenance = json.loads(line)["provenance"]
    assert provenance == compact_provenance(run_provenance(state.cfg, "tiny_chat"))
    assert "config" not in provenance and len(provenance["config_sha256"]) == 64


@pytest.mark.parametrize("bridge_state", [None], indirect=True, ids=["unpacked"])
def test_the_audit_callback_a_recipe_names_carries_the_recipe_in_its_provenance(bridge_state, tmp_path):
    """``report_callbacks`` builds the privacy audit like the other reports: the run report's recipe reaches it."""
    from nemo_noise_plugin.jobs.reports.artifacts import RunReport
    from nemo_noise_plugin.jobs.reports.audit_callback import PrivacyAuditCallback
    from nemo_noise_plugin.jobs.reports.callbacks import report_callbacks
    from nemo_noise_plugin.jobs.reports.provenance import compact_provenance

    state, model = bridge_state
    (callback,) = report_callbacks(["privacy_audit"], state.cfg, RunReport(tmp_path, recipe="tiny_noise_sft"))
    assert isinstance(callback, PrivacyAuditCallback) and callback.recipe == "tiny_noise_sft"
    callback.held_out_count = 1
    callback.on_eval_end(_context(state, model, {}))
    (line,) = (tmp_path / "privacy_audit" / "privacy_audit.jsonl").read_text().splitlines()
    provenance = json.loads(line)["provenance"]
    assert provenance["recipe"] == "tiny_noise_sft"
    assert provenance == compact_provenance(run_provenance(state.cfg, "tiny_noise_sft"))
