"""Packaging: Python version, the nemo_run.cli entry point, and `nemo --help` with the plugin installed."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tomllib
from importlib import metadata

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_metadata_requires_python_312_and_keeps_ranges():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["requires-python"] == ">=3.12,<3.13"
    assert all("==" not in requirement for requirement in project["dependencies"])
    assert any(requirement.startswith("megatron-core>=0.19,<0.20") for requirement in project["dependencies"])


def test_plugin_is_registered_under_the_nemo_run_cli_group():
    entry_points = {ep.name: ep.value for ep in metadata.entry_points(group="nemo_run.cli")}
    assert entry_points.get("noise") == "nemo_noise_plugin.cli"


def test_nemo_help_lists_the_noise_group_and_succeeds():
    nemo = pathlib.Path(sys.executable).with_name("nemo")
    result = subprocess.run(
        [str(nemo), "--help"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "noise" in result.stdout
    assert "Couldn't load entrypoint" not in result.stdout + result.stderr


def test_importing_the_cli_entry_point_is_cheap():
    script = "import sys, nemo_noise_plugin.cli; print(any(m.startswith('megatron') for m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
