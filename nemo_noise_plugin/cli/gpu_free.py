"""Keep a dry run or YAML export off the GPU: the commands hide this machine's GPUs before any library asks for them.

Megatron-Bridge imports ModelOpt, whose Triton kernel module asks for the device capability when it is imported;
on a machine with a GPU that creates a CUDA context on GPU 0 (a few hundred MiB, and an error on a GPU in exclusive
mode), although a dry run computes nothing there. ``nemo`` even imports Bridge at start-up (Bridge registers its own
``nemo_run.cli`` entry point). So the commands call ``hide_gpus_for_dry_run`` as soon as they are loaded: for
``--dryrun`` or ``--to-yaml`` it sets ``CUDA_VISIBLE_DEVICES`` to empty in this process, before CUDA is initialised,
and the libraries then see no GPU. A real run is left alone. The library itself never does this: a Python caller of
``run_finetune(dryrun=True)`` may still train in the same process.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

__all__ = ["DRY_RUN_OPTIONS", "hide_gpus_for_dry_run"]

DRY_RUN_OPTIONS: tuple[str, ...] = ("--dryrun", "--to-yaml")
"""Options after which a command computes nothing on a GPU."""


def hide_gpus_for_dry_run(argv: Sequence[str] | None = None) -> bool:
    """Hide the GPUs from this process (``CUDA_VISIBLE_DEVICES=""``) when ``argv`` (default ``sys.argv``) asks for a
    dry run or YAML export and CUDA is not initialised yet; returns whether it did."""
    argv = sys.argv if argv is None else argv
    if not any(arg == option or arg.startswith(f"{option}=") for arg in argv for option in DRY_RUN_OPTIONS):
        return False
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return False
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    return True
