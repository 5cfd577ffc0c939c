"""A CPU-loop checkpoint save that runs out of room ends in one line naming the folder, the space the save needs and
the space free, with the previous state kept and no partial file left.

The failures are real ones, not a patched ``torch.save``: torch's writer reports a failed write of its zip records
as ``RuntimeError: [enforce fail at inline_container.cc] unexpected pos`` (the ``OSError`` only as its context), which
is what a patched function raising ``OSError`` would hide. ``ulimit -f`` (``RLIMIT_FSIZE``, with ``SIGXFSZ``
ignored) makes any write past the limit fail with ``EFBIG`` in a child process, on any machine; a tiny tmpfs gives
the true ``ENOSPC`` where this process may mount one (root), and is skipped elsewhere.
"""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nemo_noise_plugin.jobs.cpu.checkpoint import CheckpointWriteError, CpuCheckpoint

REPOSITORY = Path(__file__).resolve().parents[2]
STATE_MB = 4.194304 + 1.048576  # a 4 MiB tensor and the 1 MiB allowance for the rest

_UNDER_ULIMIT = """
import json, resource, signal, sys, torch
from nemo_noise_plugin.jobs.cpu.checkpoint import CheckpointWriteError, CpuCheckpoint
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing us
checkpoint = CpuCheckpoint(sys.argv[1], sys.argv[1], "0123456789abcdef")
checkpoint.save({"iteration": 1})  # a few hundred bytes: under the limit
resource.setrlimit(resource.RLIMIT_FSIZE, (2**20, 2**20))
try:
    checkpoint.save({"iteration": 2, "weights": torch.zeros(2**20)})  # 4 MiB
except CheckpointWriteError as error:
    print(json.dumps({"errno": error.errno, "line": str(error.strerror), "kept": checkpoint.load()["iteration"]}))
"""


def test_a_save_past_the_file_size_limit_is_one_line_with_the_space_needed(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPOSITORY), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, "-c", _UNDER_ULIMIT, str(tmp_path)], capture_output=True, text=True, timeout=300, env=env
    )  # about 10 s uncontended (measured 2026-12-03: 8 s)
    assert result.returncode == 0, result.stderr[-3000:]
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    assert outcome["errno"] == errno.EFBIG and outcome["kept"] == 1
    assert re.fullmatch(
        rf"cannot write the checkpoint into {re.escape(str(tmp_path))}: the file size limit is reached \(ulimit -f\): "
        rf"the save needs about {STATE_MB:.1f} MB free there, [\d,.]+ MB are; the previous state is kept\.",
        outcome["line"],
    ), outcome["line"]
    assert sorted(os.listdir(tmp_path)) == ["cpu_state-0123456789abcdef.pt"]  # no partial file


@pytest.fixture
def tiny_disk(tmp_path):
    """A 1 MiB tmpfs (root only; skipped where this process may not mount one)."""
    folder = tmp_path / "tiny"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)


def test_a_save_on_a_full_disk_names_the_folder_and_the_free_space_needed(tiny_disk):
    checkpoint = CpuCheckpoint(str(tiny_disk), str(tiny_disk), "0123456789abcdef")
    with pytest.raises(CheckpointWriteError) as caught:
        checkpoint.save({"iteration": 2, "weights": torch.zeros(2**20)})  # 4 MiB on a 1 MiB disk
    assert caught.value.errno == errno.ENOSPC
    assert re.fullmatch(
        rf"cannot write the checkpoint into {re.escape(str(tiny_disk))}: the disk is full: the save needs about "
        rf"{STATE_MB:.1f} MB free there, 1\.0 MB are; no earlier state exists\.",
        caught.value.strerror,
    ), caught.value.strerror
    assert os.listdir(tiny_disk) == []
