"""Output folders that are never left half-written: checked before a run, written all at once after it.

``check_output_dir`` turns the usual mistakes (an empty path, a path that is a file, a folder that cannot be created
or written) into one clear error before anything runs. ``RunReport`` collects one run's report files in a hidden
partial folder and moves it into place in one rename when the report is complete, under a run id
(``<root>/reports/<run id>/``), then points ``<root>/reports/latest`` at it (an atomic symlink swap). An
interrupted or failed write leaves the earlier reports exactly as they were; a disk-full or read-only error becomes
``ArtifactWriteError`` saying what was kept.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["ArtifactWriteError", "RunReport", "check_output_dir", "new_run_id"]

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


def check_output_dir(path: str | os.PathLike[str], setting: str = "--output-dir") -> Path:
    """The folder ``path``, created if missing and checked writable; ``ValueError`` naming ``setting`` otherwise."""
    text = os.fspath(path)
    if not text.strip():
        raise ValueError(f"{setting}={text!r} is invalid: expected the path of a folder, e.g. outputs/main_job.")
    folder = Path(text)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{setting}={text!r} is invalid: it is a file, not a folder; give a folder path.")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        raise ValueError(f"{setting}={text!r} is invalid: the folder cannot be written ({_reason(error)}).") from None
    return folder


def new_run_id() -> str:
    """A run id that sorts by start time and does not collide between processes: ``20261201-063512-4711``."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"


class RunReport:
    """One run's report files, moved into ``<root>/reports/<run_id>/`` together when ``finish`` is called."""

    def __init__(self, root: str | os.PathLike[str], run_id: str | None = None) -> None:
        self.run_id = run_id or new_run_id()
        self.reports = Path(root) / "reports"
        self.folder = self.reports / self.run_id
        self._partial: Path | None = None

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
        """Write ``data`` as indented JSON."""

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
        return self.folder

    def discard(self) -> None:
        """Remove an unfinished report (nothing of it becomes visible)."""
        if self._partial is not None:
            shutil.rmtree(self._partial, ignore_errors=True)
            self._partial = None
