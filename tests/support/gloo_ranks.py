"""Run a function on N gloo CPU processes (spawned) and collect what each rank returns."""

from __future__ import annotations

import pickle
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from tests.support.models import free_port


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue: Any) -> None:
    import os

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    try:
        # Plain pickle bytes: torch's queue would share tensors through file descriptors of an exiting process.
        queue.put((rank, "ok", pickle.dumps(fn(rank, world_size, port, *args))))
    except BaseException:  # report every failure, including assertion errors, to the parent
        queue.put((rank, "error", traceback.format_exc()))


def run_on_gloo_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 240.0) -> list[Any]:
    """``fn(rank, world_size, port, *args)`` on ``world_size`` processes; returns results ordered by rank."""
    context = mp.get_context("spawn")
    queue = context.Queue()
    port = free_port()
    processes = [
        context.Process(target=_worker, args=(rank, world_size, port, fn, args, queue)) for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    results: dict[int, Any] = {}
    try:
        for _ in range(world_size):
            rank, status, value = queue.get(timeout=timeout)
            if status == "error":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            results[rank] = pickle.loads(value)
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    return [results[rank] for rank in range(world_size)]
