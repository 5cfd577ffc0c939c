"""Bridge's console output in the run folder's ``bridge.log``, so that the plugin's commands show their own lines.

Megatron-Bridge 0.6.2 prints its configuration summary (``ConfigContainer.log_non_default_values``, about 230 lines),
its set-up notices and a line per step (``training_log``: ``iteration N/ M | ... lm loss: ...``) with Python
``print`` (``print_rank_0`` / ``print_rank_last``), and Megatron's root log handler (``megatron.training``'s
``CustomHandler``) is bound to ``sys.stdout`` when Megatron is imported. No Bridge switch moves them elsewhere:
``logger.log_interval`` only thins the step lines and the summary has no switch at all. So ``stdout_to_file``
points file descriptor 1 (and ``sys.stdout``) at the log file: whatever Bridge, Megatron, torch, a C library or a
worker process started meanwhile writes to standard output lands there, however it writes it. Standard error is left
alone (warnings, tracebacks), and log records of level ERROR are copied to it. The plugin's callbacks (progress line,
reports) run with ``sys.stdout`` on the real console (``on_console``). Verbose: the same output goes to the file and
to the console (a pipe and a copying thread, in order).

Only the plugin's commands turn this on, and ``launch`` wraps its call into Bridge in ``bridge_output``: the main
job and ``python -m nemo_noise_plugin.cli.finetune`` run inside ``bridge_log``; the ``nemo`` program and the tasks
it launches call ``log_bridge_output`` (``cli.console.quiet_for_nemo_command``); the main job and
``jobs.launch.finetune.run_finetune`` name the run folder (``run_folder``). A Python caller of ``launch`` keeps
Bridge's console as Bridge leaves it, and the CPU loop is never redirected. Under torchrun every rank writes its own
file: ``bridge.log`` for rank 0 (Bridge's configuration summary), ``bridge.rank<N>.log`` for rank N (the last rank
holds Bridge's per-step lines, as Bridge prints them there); rank 0 says in one line where the log is.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

__all__ = [
    "LOG_NAME",
    "bridge_log",
    "bridge_output",
    "log_bridge_output",
    "log_path",
    "on_console",
    "run_folder",
    "stdout_to_file",
]

LOG_NAME = "bridge.log"
"""Rank 0's log file in the run folder; rank N writes ``bridge.rank<N>.log``."""

_verbose: bool | None = None  # None: no command asked for the log; Bridge prints as it always does
_folder: Path | None = None
_console: TextIO | None = None  # the real console while stdout_to_file is active
_announced: set[Path] = set()


def log_bridge_output(verbose: bool | None = False) -> None:
    """From now on in this process, ``bridge_output`` sends Bridge's console output to the run folder's log
    (``verbose``: to the console as well; ``None``: no more). For a program that is one command (``nemo``); a
    command's function uses ``bridge_log``."""
    global _verbose
    _verbose = verbose


@contextlib.contextmanager
def bridge_log(verbose: bool = False) -> Iterator[None]:
    """``log_bridge_output(verbose)`` while active (around a command's run), then the setting before it."""
    previous = _verbose
    log_bridge_output(verbose)
    try:
        yield
    finally:
        log_bridge_output(previous)


@contextlib.contextmanager
def run_folder(folder: str | os.PathLike[str]) -> Iterator[None]:
    """While active, ``bridge_output`` writes its log in ``folder`` (the run's folder)."""
    global _folder
    previous, _folder = _folder, Path(folder)
    try:
        yield
    finally:
        _folder = previous


def log_path(folder: str | os.PathLike[str], rank: int = 0) -> Path:
    """``folder/bridge.log`` for rank 0, ``folder/bridge.rank<rank>.log`` for the others."""
    return Path(folder) / (LOG_NAME if rank == 0 else f"bridge.rank{rank}.log")


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))  # torchrun's global rank, as Bridge's get_rank_safe reads it before init


@contextlib.contextmanager
def bridge_output(config: Any) -> Iterator[None]:
    """Around a call into Bridge's training loop: when a command asked for it (``bridge_log``,
    ``log_bridge_output``), ``stdout_to_file`` on this rank's log in the ``run_folder`` (else the parent of
    ``config.checkpoint.save``); otherwise nothing.

    Rank 0 says where the log is, in one line, once per path and process. A log that cannot be written is said on
    standard error and Bridge's output stays on the console.
    """
    if _verbose is None:
        yield
        return
    rank = _rank()
    path = log_path(_folder or _default_folder(config), rank)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
    except OSError as error:
        print(f"Bridge's log cannot be written to {path} ({error.strerror or error}); it stays here.", file=sys.stderr)
        yield
        return
    if rank == 0 and path not in _announced:
        _announced.add(path)
        others = "; rank N's: bridge.rankN.log" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
        shown = "also shown here (-v)" if _verbose else "-v shows it here too"
        print(f"Bridge's log (its configuration and per-step lines): {path}{others}; {shown}", flush=True)
    with stdout_to_file(path, verbose=_verbose):
        yield


def _default_folder(config: Any) -> Path:
    save = getattr(getattr(config, "checkpoint", None), "save", None)
    return Path(save).absolute().parent if save else Path.cwd()


@contextlib.contextmanager
def stdout_to_file(path: str | os.PathLike[str], *, verbose: bool = False) -> Iterator[TextIO]:
    """Point file descriptor 1 and ``sys.stdout`` at ``path`` (appended, after a header line) while active; yields a
    stream on the real console, which ``on_console`` also uses.

    Python ``print``, logging handlers bound to ``sys.stdout`` before the switch, C writes and child processes
    started meanwhile all go to the file. ``verbose``: to the file and the console, in the order written (then the
    yielded stream writes into both too). Standard error is untouched; when the root logger has a handler on standard
    output, records of level ERROR are also written to standard error (not with ``verbose``, where the console shows
    them already), except those of a clean ``SystemExit`` or an interrupt::

        with stdout_to_file("run/bridge.log") as console:
            pretrain(config, forward_step)  # Bridge's prints, logs and C writes: run/bridge.log
            print("done", file=console)  # the user's terminal
    """
    global _console
    _flush_standard_streams()
    log_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    header = f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} pid {os.getpid()}: {' '.join(sys.argv)} ===\n"
    os.write(log_fd, header.encode())
    errors_to_stderr = None if verbose else _ErrorsToStderr.install()
    saved_fd = os.dup(1)
    copier = None
    if verbose:
        read_fd, write_fd = os.pipe()
        copier = threading.Thread(
            target=_copy, args=(read_fd, log_fd, os.dup(saved_fd)), name="bridge-log", daemon=True
        )
        copier.start()
        os.dup2(write_fd, 1)
        os.close(write_fd)
    else:
        os.dup2(log_fd, 1)
        os.close(log_fd)
    stdout = sys.stdout
    encoding = getattr(stdout, "encoding", None) or "utf-8"
    if not _writes_to_fd_1(stdout):  # e.g. under contextlib.redirect_stdout: the switch must reach print() too
        sys.stdout = open(1, "w", buffering=1, encoding=encoding, errors="backslashreplace", closefd=False)
    console = sys.stdout if verbose else open(os.dup(saved_fd), "w", buffering=1, encoding=encoding)
    previous_console, _console = _console, console
    try:
        yield console
    finally:
        _console = previous_console
        if errors_to_stderr is not None:
            logging.getLogger().removeHandler(errors_to_stderr)
        _flush_standard_streams()
        if console is not sys.stdout:
            console.close()
        sys.stdout = stdout  # a stream opened above stays open: a handler created meanwhile may still hold it
        os.dup2(saved_fd, 1)
        os.close(saved_fd)
        if copier is not None:  # ends when every writer closed the pipe; a worker process may keep it open longer
            copier.join(timeout=2)


def on_console(callbacks: Sequence[Any]) -> Any:
    """``callbacks`` for Bridge, each event method run with ``sys.stdout`` on the real console while
    ``stdout_to_file`` is active (a Bridge ``CallbackManager``); otherwise the list as given."""
    if _console is None:
        return list(callbacks)
    from nemo_noise_plugin.upstream.bridge_imports import import_bridge

    bridge = import_bridge("megatron.bridge.training.callbacks")
    manager = bridge.CallbackManager()
    for callback in callbacks:
        for event in sorted(bridge.VALID_EVENTS):  # the methods a callback overrides, as CallbackManager.add finds them
            method = getattr(callback, event, None)
            if method is not None and getattr(method, "__func__", None) is not getattr(bridge.Callback, event, None):
                manager.register(event, _on_console(method))
    return manager


def _on_console(method: Callable[[Any], None]) -> Callable[[Any], None]:
    @functools.wraps(method)
    def call(context: Any) -> None:
        with contextlib.redirect_stdout(_console or sys.stdout):
            method(context)

    return call


class _ErrorsToStderr(logging.StreamHandler):
    """Copies ERROR records to standard error while standard output goes to a file (root logger handler)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)
        self.setLevel(logging.ERROR)
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, KeyboardInterrupt) or (isinstance(error, SystemExit) and error.code in (0, None)):
            return False  # Bridge logs "Pretrain failed ... SystemExit: 0" when train.exit_interval ends a run
        return super().filter(record)

    @classmethod
    def install(cls) -> _ErrorsToStderr | None:
        root = logging.getLogger()
        if not any(_writes_to_fd_1(getattr(handler, "stream", None)) for handler in root.handlers):
            return None
        handler = cls()
        root.addHandler(handler)
        return handler


def _writes_to_fd_1(stream: Any) -> bool:
    try:
        return stream.fileno() == 1
    except (AttributeError, OSError, ValueError):
        return False


def _flush_standard_streams() -> None:
    """Python's and the C library's buffered standard output, so that nothing crosses the switch."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, OSError, ValueError):
            stream.flush()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).fflush(None)


def _copy(read_fd: int, log_fd: int, console_fd: int) -> None:
    """The verbose copier: everything written to the pipe, to the log file and to the console."""
    targets = [log_fd, console_fd]
    try:
        while chunk := os.read(read_fd, 65536):
            for target in list(targets):
                try:
                    _write_all(target, chunk)
                except OSError:  # a closed console must not stop the log
                    targets.remove(target)
    finally:
        for fd in (read_fd, log_fd, console_fd):
            os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
