"""Where a training step's time goes: a few steps of each runner under ``torch.profiler`` (issue 34, item 2).

For each runner: the wall time per step, the device (kernel) time per step and the number of kernel launches per
step, so ``device busy = kernel time / wall time`` says whether the step is launch-bound (the GPU waits on the host:
busy well under 1) or compute-bound; and the top operators by host time and by device time.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path


def _device_time_us(event) -> float:
    """An averaged event's own device time in microseconds (``self_device_time_total``; older torch: cuda)."""
    for name in ("self_device_time_total", "self_cuda_time_total"):
        if hasattr(event, name):
            return float(getattr(event, name))
    return 0.0


def profile_steps(steps: Callable[[int], list[float]], count: int, device: str) -> tuple[dict, str]:
    """Run ``steps(count)`` under the profiler; ``(summary, tables)``: per-step wall, device and host-operator
    times and kernel launches, and the top-20 operator tables by host time and by device time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        steps(count)
        if device == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    averages = prof.key_averages()
    kernels = [e for e in prof.events() if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
    device_us = sum(_device_time_us(e) for e in averages)
    summary = {
        "steps": count,
        "wall_ms_per_step": 1000 * wall / count,
        "device_kernel_ms_per_step": device_us / 1000 / count,
        "device_busy_fraction": device_us / 1e6 / wall if wall else None,
        "kernel_launches_per_step": len(kernels) / count,
    }
    by_device = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
    tables = (
        "top operators by host time\n"
        + averages.table(sort_by="self_cpu_time_total", row_limit=20)
        + "\n\ntop operators by device time\n"
        + averages.table(sort_by=by_device, row_limit=20)
    )
    return summary, tables


def profile_runners(runners: dict[str, Callable[[int], list[float]]], count: int, out: Path, device: str) -> dict:
    """Profile ``count`` steps of every runner; write ``out/profile_<name>.txt`` and ``out/profile.json``."""
    found = {}
    for name, steps in runners.items():
        summary, tables = profile_steps(steps, count, device)
        found[name] = summary
        (out / f"profile_{name}.txt").write_text(json.dumps(summary, indent=1) + "\n\n" + tables + "\n")
        print(f"profile {name}: {json.dumps(summary)}", flush=True)
    (out / "profile.json").write_text(json.dumps(found, indent=1) + "\n")
    return found
