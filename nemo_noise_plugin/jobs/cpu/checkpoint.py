"""The CPU loop's checkpoints: its resumable state, written atomically, one file per run configuration.

Bridge's checkpoints need Megatron's optimizer and a GPU; the CPU loop trains with torch's AdamW, so it keeps its own
file, ``<checkpoint.save>/cpu_state-<fingerprint>.pt``: the model, optimizer and learning-rate scheduler states, the
iteration, torch's random state and the Bridge callbacks' ``user_state``. The noise of an iteration is a function of
the seed and the iteration (``noise.layer``) and the loop's batches follow from the iteration, so a resumed run
continues with exactly the noise and data of an uninterrupted one.

``run_fingerprint`` hashes the settings that decide the computation (model and noise, data, optimizer, schedule,
steps, seed; not the checkpoint or exit settings): a checkpoint of other settings is never loaded, and never
overwritten. A save goes to a temporary file in the same folder, is flushed to disk and renamed over the previous
one, so an interrupt at any moment leaves either the previous state or the new one; Ctrl-C or SIGTERM during a save
is held until the save is complete (``_signals_held``), so the interrupt's message can say truthfully that the state
exists. A save that fails (a full disk) raises ``CheckpointWriteError`` naming the file and the reason.
``CpuCheckpoint.on_disk`` lists the states of this process's runs that exist now (what an interrupt leaves).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import signal
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import torch

__all__ = ["CheckpointWriteError", "CpuCheckpoint", "run_fingerprint"]

_FINGERPRINT_SECTIONS = ("rng", "train", "model", "optimizer", "scheduler", "dataset", "tokenizer", "peft")
_NOT_COMPUTATION = {"exit_interval", "exit_duration_in_mins", "exit_signal_handler", "exit_signal"}
"""``train`` fields that decide when a run stops, not what it computes: a run stopped with ``--stop-after`` resumes
under the same command without it."""


def _stable(value: Any) -> Any:
    """A JSON-able, process-independent form of a config value (functions by name, not by address)."""
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '')}.{value.__qualname__}"
    return repr(value)


def run_fingerprint(config: Any) -> str:
    """16 hex digits naming the computation ``config`` (a ``ConfigContainer``) describes; equal for equal settings."""
    settings = config.to_dict()
    chosen = {name: settings.get(name) for name in _FINGERPRINT_SECTIONS}
    chosen["train"] = {key: value for key, value in (chosen["train"] or {}).items() if key not in _NOT_COMPUTATION}
    text = json.dumps(chosen, sort_keys=True, default=_stable)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


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
    """The state file of one run configuration: loaded from ``load_dir``, saved into ``save_dir``."""

    _OPENED: ClassVar[list[Path]] = []
    """The state files of the runs this process has started (saved or not yet)."""

    def __init__(self, save_dir: str | None, load_dir: str | None, fingerprint: str) -> None:
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
        """The saved state, or None when this configuration has none."""
        if self.load_path is None or not self.load_path.is_file():
            return None
        return torch.load(self.load_path, map_location="cpu", weights_only=False)  # our own file, pickled dicts

    def save(self, state: dict[str, Any]) -> Path | None:
        """Replace the saved state by ``state`` in one rename; returns the file (None without ``checkpoint.save``)."""
        if self.save_path is None:
            return None
        folder = self.save_path.parent
        with _signals_held():  # an interrupt now stops the run after the save, with the state on disk
            try:
                folder.mkdir(parents=True, exist_ok=True)
                handle, temporary = tempfile.mkstemp(prefix=f".{self.name}.", suffix=".partial", dir=folder)
            except OSError as error:
                raise self._write_error(error) from None
            try:
                with os.fdopen(handle, "wb") as stream:
                    torch.save(state, stream)
                    stream.flush()
                    os.fsync(stream.fileno())
                os.replace(temporary, self.save_path)
            except BaseException as error:  # a failed save: the previous state stays, the partial file goes
                with contextlib.suppress(OSError):
                    os.unlink(temporary)
                if isinstance(error, OSError):
                    raise self._write_error(error) from None
                raise
        return self.save_path

    def _write_error(self, error: OSError) -> CheckpointWriteError:
        kept = "the previous state is kept" if self.save_path.is_file() else "no earlier state exists"
        reason = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exceeded"}.get(error.errno)
        return CheckpointWriteError(
            error.errno, f"cannot write the checkpoint {self.save_path}: {reason or error.strerror or error}; {kept}."
        )
