"""Output folders that are never left half-written: checked before a run, written all at once after it.

``check_output_dir`` turns the usual mistakes (an empty path, a path that is a file, a folder that cannot be created
or written) into one clear error before anything runs. ``RunReport`` collects one run's report files in a hidden
partial folder and moves it into place in one rename when the report is complete, under a run id
(``<root>/reports/<run id>/``), then points ``<root>/reports/latest`` at it (an atomic symlink swap). An
interrupted or failed write leaves the earlier reports exactly as they were; a disk-full or read-only error becomes
``ArtifactWriteError`` saying what was kept.

Every JSON file of a report carries the run's ``provenance`` (``provenance.run_provenance``: recipe, resolved
config and its hash, noise, steps, seeds, version, data hashes) once ``RunReport.describe`` has recorded it.
``RunReport(keep_last=N)`` keeps only the newest N report folders after each finished report (``prune_reports``);
``prune_checkpoints`` does the same for a run's checkpoint folders. Both delete only what the plugin or Bridge named
by their patterns, never the folder ``latest`` or a tracker names, never a partial write.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["ArtifactWriteError", "RunReport", "check_output_dir", "new_run_id", "prune_checkpoints", "prune_reports"]

_REASONS = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
}


class ArtifactWriteError(OSError):
    """A report could not be written; the message says why and what was kept."""


def _reason(error: OSError) -> str:
    return _REASONS.get(error.errno, error.strerror or str(error))


def check_output_dir(path: str | os.PathLike[str], setting: str = "--output-dir", *, create: bool = True) -> Path:
    """The folder ``path``, created if missing and checked writable; ``ValueError`` naming ``setting`` otherwise.

    ``create=False`` (a dry run) creates nothing: the folder, or the nearest folder above it that exists, must be a
    folder this process can write to, so that a real run could create and write it.
    """
    text = os.fspath(path)
    if not text.strip():
        raise ValueError(f"{setting}={text!r} is invalid: expected the path of a folder, e.g. outputs/main_job.")
    folder = Path(text)
    try:
        if folder.is_symlink() and not folder.exists():
            raise ValueError(
                f"{setting}={text!r} is invalid: it is a symbolic link to {os.readlink(folder)!r}, which does not "
                "exist; create that folder or give another path."
            )
        if folder.exists() and not folder.is_dir():
            raise ValueError(f"{setting}={text!r} is invalid: it is a file, not a folder; give a folder path.")
        if not create:
            _check_could_create(folder)
            return folder
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        raise ValueError(f"{setting}={text!r} is invalid: the folder cannot be written ({_reason(error)}).") from None
    return folder


def _check_could_create(folder: Path) -> None:
    """``OSError`` as ``mkdir`` + a write would raise it, leaving nothing behind: the nearest existing folder at or
    above ``folder`` must be a folder, writable, on a writable file system, where a folder can be made (one is made
    and removed at once)."""
    existing = folder.absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(existing))
    if os.statvfs(existing).f_flag & os.ST_RDONLY:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(existing))
    if not os.access(existing, os.W_OK | os.X_OK):
        raise OSError(errno.EACCES, os.strerror(errno.EACCES), str(existing))
    os.rmdir(tempfile.mkdtemp(dir=existing))  # what os.access cannot tell (root in /proc, some mounts): a real mkdir


def new_run_id() -> str:
    """A run id that sorts by start time and does not collide between processes: ``20261201-063512-4711``."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"


RUN_ID_PATTERN = re.compile(r"\d{8}-\d{6}-\d+")
"""The folder names ``new_run_id`` gives: the only report folders ``prune_reports`` deletes."""
ITERATION_PATTERN = re.compile(r"iter_(\d{7})")
"""Bridge's checkpoint folder of one iteration (``checkpoint_utils.get_checkpoint_name``: ``iter_{:07d}``)."""
TRACKER_FILE = "latest_checkpointed_iteration.txt"
"""Bridge's tracker of the checkpoint to resume from (``checkpoint_utils.get_checkpoint_tracker_filename``)."""
CPU_STATE_PATTERN = re.compile(r"cpu_state-[0-9a-f]{16}\.pt")
"""The CPU loop's state file of one run configuration (``training.cpu_checkpoint.CpuCheckpoint``)."""


def _check_keep(keep: int, setting: str = "keep_last") -> int:
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"{setting}={keep!r} is invalid: expected an integer >= 1 (how many to keep).")
    return keep


def _remove(paths: list[Path]) -> list[Path]:
    for path in paths:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    return paths


def prune_reports(reports: str | os.PathLike[str], keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` report folders in ``reports`` (a ``<root>/reports``); returns the deleted.

    Only folders named like ``new_run_id``'s ids count (newest: latest start time, then latest change); the folder
    ``latest`` points at is never deleted, nor hidden partial folders, nor any other file or folder. Example::

        prune_reports("outputs/main_job/tiny_noise_sft/reports", keep=3)
    """
    _check_keep(keep)
    folder = Path(reports)
    if not folder.is_dir():
        return []
    link = folder / "latest"
    current = os.readlink(link) if link.is_symlink() else None
    runs = [p for p in folder.iterdir() if RUN_ID_PATTERN.fullmatch(p.name) and p.is_dir() and not p.is_symlink()]
    runs.sort(key=lambda p: (p.name.rsplit("-", 1)[0], p.stat().st_mtime), reverse=True)
    return _remove([p for p in runs[keep:] if p.name != current])


def _tracked_iteration(folder: Path) -> int | None:
    try:
        text = (folder / TRACKER_FILE).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def prune_checkpoints(checkpoints: str | os.PathLike[str], keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` checkpoints in ``checkpoints`` and its run-phase subfolders (``control/``,
    ...); returns the deleted.

    Bridge's ``iter_NNNNNNN`` folders: only in a folder whose tracker (``latest_checkpointed_iteration.txt``) names
    an iteration, only folders of iterations up to that one (a later one may be an asynchronous save still being
    written), and never the tracked one. The CPU loop's ``cpu_state-<fingerprint>.pt`` files (one per run
    configuration, written by rename, so never partial): the newest by change time. Nothing else is touched.
    Example::

        prune_checkpoints("outputs/main_job/tiny_noise_sft/checkpoints", keep=2)
    """
    _check_keep(keep)
    deleted: list[Path] = []
    for directory, subfolders, files in os.walk(checkpoints):
        folder = Path(directory)
        subfolders[:] = [name for name in subfolders if not ITERATION_PATTERN.fullmatch(name)]
        tracked = _tracked_iteration(folder)
        if tracked is not None:
            iterations = {
                int(match.group(1)): folder / match.group(0)
                for path in folder.iterdir()
                if (match := ITERATION_PATTERN.fullmatch(path.name)) and path.is_dir() and not path.is_symlink()
            }
            done = sorted((step for step in iterations if step <= tracked), reverse=True)
            deleted += _remove([iterations[step] for step in done[keep:] if step != tracked])
        states = [folder / name for name in files if CPU_STATE_PATTERN.fullmatch(name)]
        states.sort(key=lambda path: path.stat().st_mtime, reverse=True)
        deleted += _remove(states[keep:])
    return deleted


class RunReport:
    """One run's report files, moved into ``<root>/reports/<run_id>/`` together when ``finish`` is called.

    ``recipe`` names the run's recipe in its provenance (``provenance.describe_report``); ``keep_last`` (an integer
    >= 1) deletes all but the newest that many report folders after ``finish`` (``prune_reports``).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        run_id: str | None = None,
        *,
        recipe: str | None = None,
        keep_last: int | None = None,
    ) -> None:
        self.run_id = run_id or new_run_id()
        self.reports = Path(root) / "reports"
        self.folder = self.reports / self.run_id
        self.recipe = recipe
        self.keep_last = None if keep_last is None else _check_keep(keep_last)
        self.provenance: dict[str, Any] | None = None
        """What the run was (``describe``), written under ``provenance`` into every JSON file of the report."""
        self._partial: Path | None = None

    def describe(self, provenance: dict[str, Any]) -> dict[str, Any]:
        """Record what the run was (``provenance.describe_report`` computes it from the run's config: this floor
        knows no configs); the first call's record stays. Returns the record."""
        if self.provenance is None:
            self.provenance = provenance
        return self.provenance

    def _partial_folder(self) -> Path:
        if self._partial is None:
            self.reports.mkdir(parents=True, exist_ok=True)
            self._partial = Path(tempfile.mkdtemp(prefix=f".{self.run_id}.partial-", dir=self.reports))
        return self._partial

    def path(self, name: str) -> Path:
        """Where the report file ``name`` will be once the report is finished."""
        return self.folder / name

    def write(self, name: str, writer: Callable[[Path], Any]) -> Path:
        """Write the file ``name`` of this report by calling ``writer(path)`` on a path in the partial folder; returns
        that path (readable until ``finish`` moves the folder to ``path(name)``)."""
        try:
            target = self._partial_folder() / name
            writer(target)
        except BaseException as error:  # an interrupt mid-write leaves nothing half-written behind either
            self.discard()
            if not isinstance(error, OSError):
                raise
            raise ArtifactWriteError(
                error.errno,
                f"cannot write {self.path(name)}: {_reason(error)}; this run's report was not kept, earlier reports "
                f"in {self.reports} are unchanged.",
            ) from None
        return target

    def write_json(self, name: str, data: Any) -> None:
        """Write ``data`` as indented JSON; a dict gets the run's ``provenance`` first once ``describe`` recorded it."""
        if self.provenance is not None and isinstance(data, dict):
            data = {"provenance": self.provenance, **{k: v for k, v in data.items() if k != "provenance"}}

        def dump(path: Path) -> None:
            with open(path, "w") as handle:
                json.dump(data, handle, indent=2)

        self.write(name, dump)

    def finish(self) -> Path:
        """Move the complete report into place and point ``reports/latest`` at it; returns its folder."""
        partial = self._partial_folder()
        try:
            os.replace(partial, self.folder)
            link = self.reports / f".latest-{self.run_id}"
            link.unlink(missing_ok=True)
            link.symlink_to(self.run_id)
            os.replace(link, self.reports / "latest")
        except BaseException as error:
            self.discard()
            if not isinstance(error, OSError):
                raise
            raise ArtifactWriteError(
                error.errno, f"cannot finish the report in {self.folder}: {_reason(error)}; earlier reports unchanged."
            ) from None
        self._partial = None
        if self.keep_last is not None:
            try:
                prune_reports(self.reports, self.keep_last)
            except OSError as error:  # the report itself is complete: say so and keep going
                print(f"warning: keep_last={self.keep_last}: could not delete old reports in {self.reports}: {error}")
        return self.folder

    def discard(self) -> None:
        """Remove an unfinished report (nothing of it becomes visible)."""
        if self._partial is not None:
            shutil.rmtree(self._partial, ignore_errors=True)
            self._partial = None
