"""A quiet console for the plugin's commands: the user's information first, known third-party chatter hidden.

Megatron-Core, Megatron-Bridge, torch and NeMo-Run print a few dozen warnings and log records on a machine without
Transformer Engine or Apex (fallback notices, deprecations, an import traceback logged twice). The command entry
points call ``quiet_third_party()`` before they import those libraries; ``--verbose`` shows everything. The library
itself never filters warnings or logs. Bridge's own console output during training (its configuration summary and a
line per step) goes to the run folder's ``bridge.log`` (``jobs.launch.bridge_console``), and with ``--verbose`` to the
console too.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path

from nemo_noise_plugin.jobs.launch.bridge_console import log_bridge_output

__all__ = [
    "INFO_ONLY_LOGGERS",
    "KNOWN_LOG_RECORDS",
    "KNOWN_WARNINGS",
    "TASK_RUNNERS",
    "VERBOSE_ENV",
    "quiet_for_nemo_command",
    "quiet_third_party",
    "running_the_nemo_command",
    "running_the_plugin_command",
]

KNOWN_WARNINGS: tuple[str, ...] = (
    "Apex is not installed",
    "Transformer Engine and Apex are not installed",
    "Only transformer-engine>=",
    "The pynvml package is deprecated",
    "MimoModelConfig is experimental",
    "nemo_noise_plugin substituted modules",
    "full scope is deprecated",
    "`torch.jit.script` is deprecated",
    "`build_tokenizer` is deprecated",
    "Could not determine local rank from LOCAL_RANK",
    # seen on an H200 image (torch 2.11, transformers 5.17) in every single-GPU run through Bridge's loop:
    "Could not determine rank from torch.distributed",
    "Could not determine world size from torch.distributed",
    "Could not determine master address from MASTER_ADDR",
    "Could not determine master port from MASTER_PORT",
    "is experimental. APIs in this module are subject to change",
    "barrier(): using the device under current context",
    "The AccumulateGrad node's stream does not match",
    "is not tested with current version of modelopt",
    "invalid escape sequence",
)
"""Warnings that every run without Transformer Engine or Apex shows and that need no action (message prefixes)."""

KNOWN_LOG_RECORDS: dict[str, tuple[str, ...]] = {
    "megatron.bridge.utils.import_utils": ("Import of ",),
    "megatron.bridge.utils.fusions": ("gradient_accumulation_fusion requires",),
    "megatron.core.models.gpt.gpt_model": ("GPTModel IS DEPRECATED",),
    "megatron.core.rerun_state_machine": ("Implicit initialization of Rerun State Machine", "RerunStateMachine "),
    "torch.utils.cpp_extension": ("No CUDA runtime is found",),
    "transformers.configuration_utils": ("`torch_dtype` is deprecated",),
    "transformers.tokenization_utils_tokenizers": ("Ignoring clean_up_tokenization_spaces",),
}
"""Logger name -> message prefixes of log records that are hidden (an optional import failing, known notices)."""

VERBOSE_ENV = "NEMO_NOISE_VERBOSE"
"""Environment variable that keeps a launched task's console verbose (``1``), set by ``nemo ... --verbose``."""

TASK_RUNNERS: tuple[str, ...] = ("fdl_runner.py",)
"""Programs that run a NeMo-Run task (``python -m nemo_run.core.runners.fdl_runner``) as ``sys.argv[0]`` names them."""

INFO_ONLY_LOGGERS: tuple[str, ...] = ("megatron", "nemo_run", "datasets")
"""Loggers whose INFO records (set-up details, Bridge's config dumps) are hidden; their warnings still show."""


class _DropKnownRecords(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


def quiet_third_party(verbose: bool = False) -> None:
    """Hide ``KNOWN_WARNINGS`` and ``KNOWN_LOG_RECORDS`` in this process (nothing when ``verbose``).

    Logger filters hold whatever level or handlers the libraries set on their loggers when they are imported later.
    """
    if verbose:
        return
    for message in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=f".*{re.escape(message)}")
    for name, prefixes in KNOWN_LOG_RECORDS.items():
        logging.getLogger(name).addFilter(_DropKnownRecords(prefixes))
    for name in INFO_ONLY_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


def running_the_nemo_command() -> bool:
    """Whether this process is NeMo-Run's ``nemo`` command (which imports the plugin's entry-point modules)."""
    return Path(sys.argv[0]).name == "nemo"


PLUGIN_COMMANDS: tuple[tuple[str, ...], ...] = (("llm", "finetune"), ("noise",))
"""The ``nemo`` sub-commands the plugin registers (``nemo noise ...``; ``nemo llm finetune`` unless NeMo 2's
``llm`` is installed, then the plugin's ``finetune`` is ``nemo noise finetune`` and NeMo 2's runs its recipes)."""


def running_the_plugin_command(argv: Sequence[str] | None = None) -> bool:
    """Whether ``argv`` (default ``sys.argv``) runs one of the plugin's own ``nemo`` sub-commands.

    NeMo-Run's ``nemo`` imports every registered entry-point module at start-up, other packages' commands included,
    so the plugin changes the process (quiet logging, GPUs hidden for a dry run) only when its own command runs::

        running_the_plugin_command(["nemo", "llm", "finetune", "-f", "tiny_noise_sft"])  # True
        running_the_plugin_command(["nemo", "other", "train", "--dryrun"])                # False
    """
    argv = list(sys.argv if argv is None else argv)
    if not argv or Path(argv[0]).name != "nemo":
        return False
    words = [arg for arg in argv[1:] if not arg.startswith("-")]
    return any(tuple(words[: len(command)]) == command for command in PLUGIN_COMMANDS)


def quiet_for_nemo_command() -> None:
    """``quiet_third_party`` for the ``nemo`` command and for the tasks it launches through executors, as soon as
    the plugin's entry-point modules are loaded (before they import Megatron).

    The ``nemo`` program is quiet unless given ``--verbose``/``-v``; a task's process (NeMo-Run's ``fdl_runner``) is
    quiet unless ``VERBOSE_ENV`` is ``1`` (``nemo ... -v`` sets it for the task). Both send Bridge's console output
    to the run folder's ``bridge.log`` (``jobs.launch.bridge_console.log_bridge_output``; verbose: to the console too).
    Other programs are left alone.
    """
    if running_the_nemo_command():
        if not running_the_plugin_command():
            return  # another package's nemo command: leave its process alone
        verbose = "--verbose" in sys.argv or "-v" in sys.argv
    elif Path(sys.argv[0]).name in TASK_RUNNERS:
        verbose = os.environ.get(VERBOSE_ENV) == "1"
    else:
        return
    quiet_third_party(verbose)
    log_bridge_output(verbose)
