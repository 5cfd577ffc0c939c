"""Run a grid of GPU training cells, several at a time, each its own process and port, resumable across calls.

Shared by the grids of ``benchmarks/private_tasks_grid.py`` (and written so ``noise_grid.py`` can move onto it): a
cell is anything with a ``name``, a ``teacher`` (the name of a cell that must finish first, or None) and a ``save``
flag (cells that keep a checkpoint, timed apart); a cell whose ``<out>/<name>/result.json`` exists is done and
skipped, cells that would not finish before the deadline are not started, and the first call's failures stop the
grid early instead of burning the GPU window.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Running:
    """A started cell: its process, its start time and its open log file."""

    cell: Any
    process: subprocess.Popen
    started: float
    log: Any = field(repr=False, default=None)


def run_cells(
    cells: Sequence[Any],
    out: Path,
    command_for: Callable[[Any], list[str]],
    *,
    parallel: int,
    deadline_s: float,
    grace_s: float,
    expected_cell_s: float,
    first_port: int = 29600,
) -> int:
    """Run the cells not done yet, ``parallel`` at a time, until done or the deadline; 0 when every cell is done, 3
    when some are left for the next call. ``command_for(cell)`` is the cell's command line; each process gets its
    own ``MASTER_PORT`` (Bridge's default 29500 would collide) and writes ``<out>/<name>/cell.log``."""
    out.mkdir(parents=True, exist_ok=True)

    def done(name: str) -> bool:
        return (out / name / "result.json").is_file()

    todo = [cell for cell in cells if not done(cell.name)]
    print(f"{len(cells)} cells, {len(cells) - len(todo)} done, {len(todo)} to run", flush=True)
    start = time.monotonic()
    running: list[Running] = []
    durations: dict[bool, list[float]] = {True: [], False: []}
    port, failures = first_port, 0
    while todo or running:
        for item in list(running):
            code = item.process.poll()
            if code is None:
                continue
            running.remove(item)
            item.log.close()
            elapsed = time.monotonic() - item.started
            if done(item.cell.name):
                durations[bool(item.cell.save)].append(elapsed)
                status = "done"
            else:
                failures += 1
                status = f"FAILED (exit {code}; see {item.cell.name}/cell.log)"
            print(f"[{time.monotonic() - start:6.0f} s] {item.cell.name}: {status} in {elapsed:.0f} s", flush=True)
        if failures >= 2 and not any(durations.values()) and not any(done(cell.name) for cell in cells):
            print("the first cells failed and none finished: stopping (see their cell.log)", flush=True)
            for item in running:
                item.process.kill()
            break
        left = deadline_s - (time.monotonic() - start)

        def expected(cell: Any) -> float:
            seen = durations[bool(cell.save)] or durations[not cell.save]
            return max(seen) if seen else expected_cell_s

        busy = {item.cell.name for item in running}
        pending = {cell.name for cell in todo} | busy
        for cell in [c for c in todo if c.teacher and c.teacher not in pending and not done(c.teacher)]:
            todo.remove(cell)
            print(f"{cell.name}: skipped, its teacher {cell.teacher} did not finish", flush=True)
        ready = [c for c in todo if (c.teacher is None or done(c.teacher)) and left > expected(c)]
        while ready and len(running) < parallel:
            cell = ready.pop(0)
            todo.remove(cell)
            folder = out / cell.name
            folder.mkdir(parents=True, exist_ok=True)
            port += 1
            env = dict(os.environ, MASTER_PORT=str(port), MASTER_ADDR="127.0.0.1", RANK="0", LOCAL_RANK="0")
            env["WORLD_SIZE"] = "1"
            log = open(folder / "cell.log", "w")  # noqa: SIM115 (closed when the process ends)
            process = subprocess.Popen(command_for(cell), stdout=log, stderr=subprocess.STDOUT, env=env)
            running.append(Running(cell, process, time.monotonic(), log))
            print(f"[{time.monotonic() - start:6.0f} s] {cell.name}: started (port {port})", flush=True)
        if not running and todo and not ready:
            break
        if time.monotonic() - start > deadline_s + grace_s:
            for item in running:
                item.process.kill()
                print(f"{item.cell.name}: killed at the deadline (it reruns next call)", flush=True)
            break
        time.sleep(2)
    missing = [cell.name for cell in cells if not done(cell.name)]
    print(f"{len(cells) - len(missing)} of {len(cells)} cells done; left: {', '.join(missing) or 'none'}", flush=True)
    return 3 if missing else 0


def write_result(path: Path, result: dict[str, Any]) -> None:
    """Write a cell's ``result.json`` atomically (a partial file is never taken for a finished cell)."""
    partial = path.with_suffix(".json.partial")
    partial.write_text(json.dumps(result, indent=1))
    partial.replace(path)


def this_python() -> str:
    """The interpreter running the grid (each cell runs under the same one)."""
    return sys.executable
