"""How the plugin's commands end: one exit status per kind of ending, one line on standard error.

Every front door (``python -m nemo_noise_plugin``, ``python -m nemo_noise_plugin.cli.finetune``, ``nemo llm
finetune``) runs its work through ``run_command``, so the same mistake ends the same way whichever door it came
through:

- a usage error (an invalid option, override, config file or location: ``ValueError``, ``FinetuneError``) exits 2
  with one line naming the setting, the value and what is allowed (``UsageParser`` does the same for argparse);
- a failed run (a loss that is not finite, a report or checkpoint that cannot be written, no GPU) exits 1 with one
  line; a full disk is named as such;
- Ctrl-C exits 130, SIGTERM 143 (``stop_on_sigterm``), with one line saying truthfully whether and where a
  checkpoint exists (``jobs.launch.launcher.saved_checkpoints``).

``--verbose`` keeps the one line and adds nothing; a bug (any other exception) still shows its traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator

__all__ = [
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_TERMINATED",
    "EXIT_USAGE",
    "Terminated",
    "UsageParser",
    "checkpoint_sentence",
    "describe_failure",
    "end_sigterm_stop",
    "rank_zero_says_it",
    "run_command",
    "stop_on_sigterm",
]

EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED, EXIT_TERMINATED = 1, 2, 130, 128 + signal.SIGTERM

_DISK_FULL = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exceeded"}


class Terminated(KeyboardInterrupt):
    """SIGTERM, turned into the same clean stop as Ctrl-C (exit status 143 instead of 130)."""


def stop_on_sigterm() -> None:
    """Make SIGTERM raise ``Terminated`` in the main thread, so the run stops as it does on Ctrl-C."""

    def terminate(signum: int, frame: object) -> None:
        raise Terminated()

    terminate.stops_the_run = True  # type: ignore[attr-defined]
    signal.signal(signal.SIGTERM, terminate)


def end_sigterm_stop() -> None:
    """Once the command's work has ended, SIGTERM ends the process as it would any other (status 143, nothing
    printed): raised during interpreter shutdown, ``Terminated`` would only show up as an "Exception ignored in
    atexit callback" traceback of some package's clean-up, with status 0."""
    if getattr(signal.getsignal(signal.SIGTERM), "stops_the_run", False):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


class UsageParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line (``prog: error: ...``) and exit status 2, without the usage."""

    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"{self.prog}: error: {_one_line(message)} (--help lists the options)", file=sys.stderr)
        sys.exit(EXIT_USAGE)


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def checkpoint_sentence() -> str:
    """Whether and where this process's runs have a checkpoint on disk now, in words.

    Imports nothing: an interrupt can come while a module is still being imported (torchrun stops its other ranks
    when one fails), and importing it again here would fail half-way (torch: a traceback, even a crash). A launcher
    that is not imported yet has started no run."""
    launcher = sys.modules.get("nemo_noise_plugin.jobs.launch.launcher")
    saved = launcher.saved_checkpoints() if hasattr(launcher, "saved_checkpoints") else []
    if not saved:
        return "no checkpoint was saved yet, so the same command starts from iteration 0"
    return f"checkpoint{'s' if len(saved) > 1 else ''}: {', '.join(saved)} (the same command resumes from there)"


def describe_failure(error: BaseException) -> tuple[int, str] | None:
    """``(exit status, one line)`` for an error that is the user's or the machine's, not a bug; else None."""
    from nemo_noise_plugin.jobs.launch.finetune import FinetuneError

    for name in ("NonFiniteLossError", "GPUUnavailableError", "ArtifactWriteError", "CheckpointWriteError"):
        if any(kind.__name__ == name for kind in type(error).__mro__):  # their messages name the file and reason
            return EXIT_FAILED, _one_line(error.strerror if isinstance(error, OSError) and error.strerror else error)
    if isinstance(error, OSError) and error.errno in _DISK_FULL:
        where = f" writing {error.filename}" if error.filename else ""
        return EXIT_FAILED, f"{_DISK_FULL[error.errno]}{where} ({_one_line(error.strerror or error)})"
    if isinstance(error, (ValueError, FinetuneError)):
        return EXIT_USAGE, _one_line(error)
    if type(error).__name__ == "RunContextError":  # NeMo-Run's; from one of the errors above: that one's status
        cause = describe_failure(error.__cause__) if error.__cause__ is not None else None
        return (cause[0] if cause else EXIT_USAGE), _one_line(error)
    if isinstance(error, RuntimeError) and "Unexpected result" in str(error):  # Megatron's rerun state machine
        return EXIT_FAILED, f"{str(error).splitlines()[-1]}; training stopped."
    return None


RANK_ZERO_WAIT_S = 300
"""How long a rank other than 0 waits, after an error every rank meets, for torchrun to stop it (torchrun stops the
other ranks as soon as rank 0 has said it and exited)."""


@contextlib.contextmanager
def rank_zero_says_it() -> Iterator[None]:
    """Under torchrun, an error that every rank meets alike (a setting, no GPU) is said once, by rank 0: the other
    ranks wait quietly (``RANK_ZERO_WAIT_S``) for torchrun to stop them once rank 0 has exited, so that their own
    exit does not make torchrun stop rank 0 before its line is out, then exit with the same status."""
    try:
        yield
    except Exception as error:
        known = describe_failure(error)
        kinds = {type(error).__name__, type(error.__cause__).__name__}  # NeMo-Run's RunContextError wraps them
        alike = known is not None and (known[0] == EXIT_USAGE or "GPUUnavailableError" in kinds)
        if not alike or int(os.environ.get("RANK", "0")) == 0:
            raise
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # torchrun's stop ends this rank without a word
        time.sleep(RANK_ZERO_WAIT_S)
        raise SystemExit(known[0]) from None


def run_command(body: Callable[[], int | None], *, interrupted: str = "", prefix: str = "error") -> int:
    """Run ``body`` and return its exit status: 0 (or its own), 2, 1, 130 or 143 as the module docstring says.

    ``interrupted`` starts the interrupt line (e.g. "this run's report was not written; "); ``prefix`` starts an
    error line (``error: ...`` or ``prog: error: ...``).
    """
    try:
        return body() or 0
    except KeyboardInterrupt as interrupt:
        terminated = isinstance(interrupt, Terminated)
        how = "terminated" if terminated else "interrupted"
        print(f"\n{how}: {interrupted}{checkpoint_sentence()}.", file=sys.stderr)
        return EXIT_TERMINATED if terminated else EXIT_INTERRUPTED
    except Exception as error:
        known = describe_failure(error)
        if known is None:
            raise
        status, line = known
        print(f"{prefix}: {line}", file=sys.stderr)
        return status
    finally:
        end_sigterm_stop()
