"""A free rendezvous port for every training process a test starts, so that tests under ``pytest -n`` do not collide.

Bridge's training loop falls back to ``MASTER_PORT=29500`` and torchrun defaults to it: two tests training at once
would both take it. The GPU tests start their training processes with ``training_env()`` or ``torchrun()``.
"""

from __future__ import annotations

import os
import sys

from tests.support.models import free_port


def training_env(**extra: str) -> dict[str, str]:
    """This process's environment with ``MASTER_ADDR=127.0.0.1``, a free ``MASTER_PORT`` and ``extra``."""
    return {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), **extra}


def torchrun(nproc_per_node: int) -> list[str]:
    """``python -m torch.distributed.run`` with ``nproc_per_node`` processes, meeting on a free loopback port."""
    rendezvous = ["--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc_per_node), *rendezvous]
