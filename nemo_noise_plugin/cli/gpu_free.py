"""Keep a dry run or YAML export off the GPU: the commands hide this machine's GPUs before any library asks for them.

Megatron-Bridge imports ModelOpt, whose Triton kernel module asks for the device capability when it is imported;
on a machine with a GPU that creates a CUDA context on GPU 0 (a few hundred MiB, and an error on a GPU in exclusive
mode), although a dry run computes nothing there. ``nemo`` even imports Bridge at start-up (Bridge registers its own
``nemo_run.cli`` entry point). So the commands hide the GPUs for ``--dryrun`` or ``--to-yaml`` before anything
asks for them: ``nemo`` calls ``hide_gpus_for_dry_run`` as soon as it loads the plugin, ``python -m ...cli.finetune``
calls ``hide_gpus`` after parsing its options. That sets ``CUDA_VISIBLE_DEVICES`` to empty in this process, before
CUDA is initialised, and the libraries then see no GPU. A real run is left alone. The library itself never does
this: a Python caller of ``run_finetune(dryrun=True)`` may still train in the same process.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

__all__ = ["DRY_RUN_OPTIONS", "hide_gpus", "hide_gpus_for_dry_run"]

DRY_RUN_OPTIONS: tuple[str, ...] = ("--dryrun", "--to-yaml")
"""Options after which a command computes nothing on a GPU."""


def hide_gpus_for_dry_run(argv: Sequence[str] | None = None) -> bool:
    """``hide_gpus()`` when ``argv`` (default ``sys.argv``) asks for a dry run or YAML export; returns whether it
    hid them."""
    argv = sys.argv if argv is None else argv
    if not any(arg == option or arg.startswith(f"{option}=") for arg in argv for option in DRY_RUN_OPTIONS):
        return False
    return hide_gpus()


def hide_gpus() -> bool:
    """Hide the GPUs from this process (``CUDA_VISIBLE_DEVICES=""``) unless CUDA is initialised already (then it is
    too late); returns whether it did."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return False
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    return True
