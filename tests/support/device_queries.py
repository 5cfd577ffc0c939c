"""Run a command in this process while recording ``CUDA_VISIBLE_DEVICES`` at each CUDA device query.

``python tests/support/device_queries.py nemo llm finetune ... --dryrun`` (or ``... python-m MODULE args``) runs
the ``nemo`` command (NeMo-Run's app) or ``python -m MODULE`` in-process and prints, at exit, one line
``DEVICE QUERIES <values>``: the value ``CUDA_VISIBLE_DEVICES`` had each time torch asked the driver for the GPU
count (the call that initialises CUDA), and ``CUDA INITIALIZED <bool>``. A dry run that hid the GPUs first shows
only ``''``. Used by ``tests/cli/test_gpu_free_dry_run.py`` and its GPU twin.
"""

from __future__ import annotations

import atexit
import os
import runpy
import sys

import torch

_seen: list[str | None] = []
_device_count = torch._C._cuda_getDeviceCount


def _recording_device_count() -> int:
    _seen.append(os.environ.get("CUDA_VISIBLE_DEVICES"))
    return _device_count()


def _report() -> None:
    values = sorted({repr(value) for value in _seen})
    print(f"DEVICE QUERIES {' '.join(values) or '(none)'}", file=sys.__stderr__, flush=True)
    print(f"CUDA INITIALIZED {torch.cuda.is_initialized()}", file=sys.__stderr__, flush=True)


def main(argv: list[str]) -> None:
    torch._C._cuda_getDeviceCount = _recording_device_count
    atexit.register(_report)
    if argv[0] == "nemo":
        sys.argv = argv
        from nemo_run.__main__ import app

        app()
    elif argv[0] == "python-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        raise SystemExit(f"usage: {sys.argv[0]} nemo ARGS... | python-m MODULE ARGS...")


if __name__ == "__main__":
    main(sys.argv[1:])
