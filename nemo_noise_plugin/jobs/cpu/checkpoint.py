"""The CPU loop's checkpoints: its resumable state and the settings that define it, written atomically.

Bridge's checkpoints need Megatron's optimizer and a GPU; the CPU loop trains with torch's AdamW, so it keeps its own
file, ``<checkpoint.save>/cpu_state-<fingerprint>.pt``: the model, optimizer and learning-rate scheduler states, the
iteration, torch's random state, the Bridge callbacks' ``user_state`` and the run's settings. The noise of an
iteration is a function of the seed and the iteration (``noise.layer``) and the loop's batches follow from the
iteration, so a resumed run continues with exactly the noise and data of an uninterrupted one.

``run_settings`` lists the settings that decide the computation (model and noise, data, tokenizer, optimizer,
schedule, steps, seed; not the checkpoint or exit settings), flat and readable, with paths by their last part (the
content-named data folder, the model folder), so a run folder that is copied or moved resumes; ``run_fingerprint`` is
their digest, which names the file. A checkpoint is what its recorded settings say, not what its name says: a file
whose settings are not this run's (renamed, copied over) is refused with ``CheckpointMismatchError`` naming each
difference (setting, saved value, this run's value), and a folder that holds only states of other settings is named
with how the newest differs (``CpuCheckpoint.others``) before the run trains from the start beside them.

A save goes to a temporary file in the same folder, is flushed to disk (``os.fsync``), renamed over the previous one,
and the folder is flushed too, so a crash or an interrupt at any moment leaves either the previous state or the new
one; Ctrl-C or SIGTERM during a save is held until the save is complete (``_signals_held``), so the interrupt's
message can say truthfully that the state exists. A save that fails raises ``CheckpointWriteError``, one line naming
the folder and the reason: for a full disk (or quota, or ``ulimit -f``) the space the save needs and the space free,
also when torch's writer reports the failed write only as ``RuntimeError: ... unexpected pos``.
``CpuCheckpoint.on_disk`` lists the states of this process's runs that exist now (what an interrupt leaves).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import torch

__all__ = [
    "CheckpointMismatchError",
    "CheckpointWriteError",
    "CpuCheckpoint",
    "run_fingerprint",
    "run_settings",
    "setting_differences",
    "settings_digest",
]

_FINGERPRINT_SECTIONS = ("rng", "train", "model", "optimizer", "scheduler", "dataset", "tokenizer", "peft")
_NOT_COMPUTATION = {"exit_interval", "exit_duration_in_mins", "exit_signal_handler", "exit_signal"}
"""``train`` fields that decide when a run stops, not what it computes: a run stopped with ``--stop-after`` resumes
under the same command without it."""


def _stable(value: Any) -> Any:
    """A JSON-able, process-independent form of a config value (functions by name, not by address)."""
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '')}.{value.__qualname__}"
    return repr(value)


def _location_free(value: str) -> str:
    """A path by its last part (``/runs/a/data/corpus_bytes_7de5`` -> ``corpus_bytes_7de5``), anything else as it is:
    a checkpoint's identity is what it computes, so a run folder that is copied or moved keeps its checkpoints."""
    if "/" in value and (os.path.isabs(value) or os.path.exists(value)):
        return os.path.basename(value.rstrip("/")) or value
    return value


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for key in sorted(value, key=str):
            _flatten(f"{prefix}.{key}" if prefix else str(key), value[key], out)
    elif isinstance(value, (list, tuple)):
        out[prefix] = [_location_free(item) if isinstance(item, str) else _plain(item) for item in value]
    else:
        out[prefix] = _location_free(value) if isinstance(value, str) else _plain(value)


def _plain(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return json.loads(json.dumps(value, default=_stable))


def run_settings(config: Any) -> dict[str, Any]:
    """The settings that decide the computation ``config`` (a ``ConfigContainer``) describes, flat and readable
    (``{"model.noise.alpha": 10.0, "rng.seed": 1234, ...}``): model and noise, data, tokenizer, optimizer, schedule,
    steps and seed; not the checkpoint or exit settings, and paths by their last part (``_location_free``)."""
    settings = config if isinstance(config, dict) else config.to_dict()  # a dict: a run_config.yaml, read
    chosen = {name: settings.get(name) for name in _FINGERPRINT_SECTIONS}
    chosen["train"] = {key: value for key, value in (chosen["train"] or {}).items() if key not in _NOT_COMPUTATION}
    flat: dict[str, Any] = {}
    _flatten("", chosen, flat)
    return flat


def settings_digest(settings: dict[str, Any]) -> str:
    """16 hex digits naming ``settings`` (``run_settings``' form); equal for equal settings."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=_stable).encode()).hexdigest()[:16]


def run_fingerprint(config: Any) -> str:
    """16 hex digits naming the computation ``config`` (a ``ConfigContainer``) describes; equal for equal settings,
    wherever the run folder lies (``settings_digest(run_settings(config))``)."""
    return settings_digest(run_settings(config))


def setting_differences(saved: dict[str, Any], current: dict[str, Any], limit: int = 4) -> str:
    """The settings that differ, as ``name (saved X, this run Y)``: at most ``limit``, then a count of the rest."""
    names = sorted(
        name for name in saved.keys() | current.keys() if saved.get(name, _ABSENT) != current.get(name, _ABSENT)
    )
    shown = [
        f"{name} (saved {_shown(saved.get(name, _ABSENT))}, this run {_shown(current.get(name, _ABSENT))})"
        for name in names[:limit]
    ]
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(shown) + more


_ABSENT = "<not set>"


def _shown(value: Any) -> str:
    text = value if value == _ABSENT else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class CheckpointMismatchError(ValueError):
    """A checkpoint whose recorded settings are not this run's: the message names each difference (setting, saved
    value, this run's value) and keeps the file."""


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (e.g. the disk is full); the message names the file and what was kept."""


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Hold SIGINT and SIGTERM until the block is done, then deliver the first one that came (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)}
    for number in previous:
        signal.signal(number, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        if caught:
            signal.raise_signal(caught[0])


class CpuCheckpoint:
    """The state file of one run configuration: loaded from ``load_dir``, saved into ``save_dir``.

    With ``settings`` (``run_settings`` of the run) every save records them beside the state, and ``load`` refuses
    a file whose recorded settings are not these (``CheckpointMismatchError`` naming the differences): the file's
    name is only where to look, its recorded settings say what it is.
    """

    _OPENED: ClassVar[list[Path]] = []
    """The state files of the runs this process has started (saved or not yet)."""

    def __init__(
        self, save_dir: str | None, load_dir: str | None, fingerprint: str, settings: dict[str, Any] | None = None
    ) -> None:
        self.fingerprint, self.settings = fingerprint, settings
        self.name = f"cpu_state-{fingerprint}.pt"
        self.save_path = Path(save_dir) / self.name if save_dir else None
        self.load_path = Path(load_dir) / self.name if load_dir else None
        for path in (self.save_path, self.load_path):
            if path is not None and path not in self._OPENED:
                self._OPENED.append(path)

    @classmethod
    def on_disk(cls) -> list[Path]:
        """The state files of this process's runs that exist now (saved by it, or by an earlier run it resumed)."""
        return [path for path in cls._OPENED if path.is_file()]

    def load(self) -> dict[str, Any] | None:
        """The saved state, or None when this configuration has none; ``CheckpointMismatchError`` when the file's
        recorded settings are not this run's (or it records none)."""
        if self.load_path is None or not self.load_path.is_file():
            return None
        saved = torch.load(self.load_path, map_location="cpu", weights_only=False)  # our own file, pickled dicts
        if self.settings is not None:
            recorded = saved.get("settings") if isinstance(saved, dict) else None
            if not isinstance(recorded, dict):
                raise CheckpointMismatchError(
                    f"checkpoint {self.load_path} records no settings, so it cannot be told to be this run's; it is "
                    "kept: move or delete it to train these settings from the start."
                )
            if settings_digest(recorded) != self.fingerprint:
                raise CheckpointMismatchError(
                    f"checkpoint {self.load_path} was saved by other settings: "
                    f"{setting_differences(recorded, self.settings)}; it is kept: rerun with its settings to resume "
                    "it, or train these in another folder (--output-dir, or checkpoint.save and checkpoint.load)."
                )
        return saved

    def others(self) -> str | None:
        """When ``load_dir`` holds states of other settings but none of these: how the newest differs, in words."""
        if self.load_path is None or self.settings is None or self.load_path.is_file():
            return None
        found = [path for path in self.load_path.parent.glob("cpu_state-*.pt") if path.name != self.name]
        if not found:
            return None
        newest = max(found, key=lambda path: path.stat().st_mtime)
        try:  # mmap: the recorded settings without reading the tensors
            recorded = torch.load(newest, map_location="cpu", weights_only=False, mmap=True).get("settings")
        except Exception:  # a damaged or foreign file: only say that it is there
            recorded = None
        how = setting_differences(recorded, self.settings) if isinstance(recorded, dict) else "records no settings"
        count = f"{len(found)} state{'s' if len(found) > 1 else ''} of other settings"
        return f"{self.load_path.parent} holds {count} (the newest, {newest.name}: {how})"

    def save(self, state: dict[str, Any]) -> Path | None:
        """Replace the saved state by ``state`` (with the run's settings) in one rename, the file and then its folder
        flushed to disk (``os.fsync``); returns the file (None without ``checkpoint.save``)."""
        if self.save_path is None:
            return None
        if self.settings is not None:
            state = {**state, "fingerprint": self.fingerprint, "settings": self.settings}
        folder = self.save_path.parent
        needed = _state_bytes(state)
        with _signals_held():  # an interrupt now stops the run after the save, with the state on disk
            try:
                folder.mkdir(parents=True, exist_ok=True)
                handle, temporary = tempfile.mkstemp(prefix=f".{self.name}.", suffix=".partial", dir=folder)
            except OSError as error:
                raise self._write_error(error, needed) from None
            try:
                with os.fdopen(handle, "wb") as stream:
                    torch.save(state, stream)
                    stream.flush()
                    os.fsync(stream.fileno())  # the bytes on disk before the name points at them
                os.replace(temporary, self.save_path)
                _fsync_folder(folder)  # the rename on disk: a crash now cannot bring the old name back
            except BaseException as error:  # a failed save: the previous state stays, the partial file goes
                with contextlib.suppress(OSError):
                    os.unlink(temporary)
                cause = _os_error_of(error, folder, needed)
                if cause is not None:
                    raise self._write_error(cause, needed) from None
                raise
        return self.save_path

    def _write_error(self, error: OSError, needed: int) -> CheckpointWriteError:
        folder = self.save_path.parent
        kept = "the previous state is kept" if self.save_path.is_file() else "no earlier state exists"
        reason = _SPACE_ERRORS.get(error.errno)
        if reason is None:
            what = error.strerror or str(error)
        else:
            what = f"{reason}: the save needs about {_megabytes(needed)} free there, {_megabytes(_free(folder))} are"
        return CheckpointWriteError(error.errno, f"cannot write the checkpoint into {folder}: {what}; {kept}.")


_SPACE_ERRORS = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EFBIG: "the file size limit is reached (ulimit -f)",
}


def _megabytes(size: int) -> str:
    return f"{size / 1e6:,.1f} MB"


def _free(folder: Path) -> int:
    """Free bytes on the file system holding ``folder`` (or its nearest existing parent)."""
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return shutil.disk_usage(folder).free


def _state_bytes(state: Any) -> int:
    """About the size of ``state`` as ``torch.save`` writes it: each tensor storage once, plus 1 MB for the rest."""
    seen: dict[int, int] = {}

    def walk(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item)

    walk(state)
    return sum(seen.values()) + 2**20


def _os_error_of(error: BaseException, folder: Path, needed: int) -> OSError | None:
    """The file-system error behind a failed save: ``error`` or one it was raised from (torch's writer turns a
    failed write into ``RuntimeError: [enforce fail at inline_container.cc] unexpected pos``), else, for such a
    ``RuntimeError`` on a folder with less free space than the save needs, a full disk."""
    current: BaseException | None = error
    for _ in range(6):
        if current is None or isinstance(current, (KeyboardInterrupt, SystemExit)):
            return None
        if isinstance(current, OSError):
            return current
        current = current.__cause__ or current.__context__
    if isinstance(error, RuntimeError) and "inline_container" in str(error) and _free(folder) < needed:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return None


def _fsync_folder(folder: Path) -> None:
    """Flush ``folder``'s entries (a rename into it) to disk."""
    descriptor = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
