"""Output folders: checked before a run, reports written all at once, and disk-full / read-only as clear errors."""

from __future__ import annotations

import errno
import json
import os
import subprocess

import pytest

from nemo_noise_plugin.jobs.reports.artifacts import ArtifactWriteError, RunReport, check_output_dir


def _report(root, run_id: str, value: int) -> RunReport:
    report = RunReport(root, run_id)
    report.write_json("robustness.json", {"value": value})
    report.write("robustness.png", lambda path: path.write_bytes(b"png %d" % value))
    return report


def _visible(root) -> list[str]:
    return sorted(name for name in os.listdir(root / "reports") if not name.startswith("."))


def test_a_finished_report_appears_whole_under_its_run_id_and_latest_points_at_it(tmp_path):
    first = _report(tmp_path, "run-1", 1).finish()
    second = _report(tmp_path, "run-2", 2).finish()
    assert _visible(tmp_path) == ["latest", "run-1", "run-2"]
    assert os.readlink(tmp_path / "reports" / "latest") == "run-2"
    assert json.loads((first / "robustness.json").read_text()) == {"value": 1}  # earlier runs are kept
    assert (second / "robustness.png").read_bytes() == b"png 2"


def test_an_unfinished_report_is_invisible_and_leaves_the_previous_one(tmp_path):
    _report(tmp_path, "run-1", 1).finish()
    _report(tmp_path, "run-2", 2)  # written, never finished (the process was killed before finish)
    assert _visible(tmp_path) == ["latest", "run-1"]
    assert os.readlink(tmp_path / "reports" / "latest") == "run-1"


def test_an_interrupt_while_writing_leaves_nothing_behind(tmp_path):
    _report(tmp_path, "run-1", 1).finish()
    report = RunReport(tmp_path, "run-2")
    report.write_json("robustness.json", {"value": 2})

    def interrupted(path):
        path.write_bytes(b"half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        report.write("robustness.png", interrupted)
    assert sorted(os.listdir(tmp_path / "reports")) == ["latest", "run-1"]  # no partial folder either


def test_a_write_error_says_why_and_what_was_kept(tmp_path):
    _report(tmp_path, "run-1", 1).finish()
    report = RunReport(tmp_path, "run-2")

    def disk_full(path):
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(ArtifactWriteError, match=r"robustness\.png: the disk is full; this run's report was not kept"):
        report.write("robustness.png", disk_full)
    assert sorted(os.listdir(tmp_path / "reports")) == ["latest", "run-1"]


def test_a_really_full_disk_is_a_clear_error(tmp_path):
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48k", "tmpfs", str(mount_point)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        report = RunReport(mount_point, "run-1")
        with pytest.raises(ArtifactWriteError, match="the disk is full"):
            report.write("big.bin", lambda path: path.write_bytes(b"x" * 200_000))
        assert not (mount_point / "reports" / "run-1").exists()
    finally:
        subprocess.run(["umount", str(mount_point)], check=True)


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("", "expected the path of a folder"),
        ("   ", "expected the path of a folder"),
        ("FILE", "it is a file, not a folder"),
        ("FILE/inside", "the folder cannot be written"),
    ],
)
def test_an_unusable_output_folder_is_a_clear_error(tmp_path, path, message):
    (tmp_path / "FILE").write_text("not a folder")
    path = path.replace("FILE", str(tmp_path / "FILE"))
    with pytest.raises(ValueError, match=f"--output-dir=.* is invalid: {message}"):
        check_output_dir(path)


def test_a_read_only_file_system_is_a_clear_error(tmp_path):
    mount_point = tmp_path / "readonly"
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=16k", "tmpfs", str(mount_point)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        with pytest.raises(ValueError, match=r"cannot be written \(the file system is read-only\)"):
            check_output_dir(mount_point / "run")
    finally:
        subprocess.run(["umount", str(mount_point)], check=True)


def test_a_usable_output_folder_is_created(tmp_path):
    assert check_output_dir(tmp_path / "a" / "b").is_dir()


def test_an_output_folder_name_too_long_for_the_file_system_names_the_setting(tmp_path):
    """``Path.exists`` raised ENAMETOOLONG outside the check (the main job then blamed --noise-config)."""
    long_path = tmp_path / ("x" * 300)
    with pytest.raises(ValueError, match=r"^--output-dir='.*x{300}' is invalid: the folder cannot be written"):
        check_output_dir(long_path)


def test_a_dangling_symlink_output_folder_names_its_missing_target(tmp_path):
    """It was ``the folder cannot be written (File exists)``."""
    link = tmp_path / "out"
    link.symlink_to(tmp_path / "gone")
    for create in (True, False):
        with pytest.raises(ValueError, match=r"is a symbolic link to '.*gone', which does not exist"):
            check_output_dir(link, create=create)
    assert not (tmp_path / "gone").exists()


def test_the_main_job_blames_the_output_folder_not_the_noise_config_for_a_long_name(tmp_path, capsys):
    from nemo_noise_plugin.cli.main_job import main

    assert main(["--output-dir", str(tmp_path / ("y" * 300))]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: --output-dir=") and "--noise-config" not in last
