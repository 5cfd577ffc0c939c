"""Packaging: Python version, the nemo_run.cli entry point, and `nemo --help` with the plugin installed."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from importlib import metadata

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_metadata_requires_python_312_and_keeps_ranges():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["requires-python"] == ">=3.12,<3.13"
    assert all("==" not in requirement for requirement in project["dependencies"])
    assert any(requirement.startswith("megatron-core>=0.19,<0.20") for requirement in project["dependencies"])


def test_plugin_is_registered_under_the_nemo_run_cli_group():
    entry_points = {ep.name: ep.value for ep in metadata.entry_points(group="nemo_run.cli")}
    assert entry_points.get("noise") == "nemo_noise_plugin.cli.nemo_noise"
    assert entry_points.get("llm") == "nemo_noise_plugin.cli.nemo_llm"


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
    script = "import sys, nemo_noise_plugin.cli.nemo_noise; print(any(m.startswith('megatron') for m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_the_wheel_ships_the_presets_and_the_corpus(tmp_path):
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path)]
    result = subprocess.run(
        [*build, str(REPO)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (wheel,) = tmp_path.glob("nemo_noise_plugin-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    presets = {name for name in names if name.startswith("nemo_noise_plugin/presets/") and name.endswith(".yaml")}
    assert "nemo_noise_plugin/presets/noise/neftune_alpha5.yaml" in presets
    assert "nemo_noise_plugin/presets/kd/forward_kl_t2.yaml" in presets
    assert len(presets) == len(list((REPO / "nemo_noise_plugin" / "presets").glob("*/*.yaml")))
    assert "nemo_noise_plugin/data/corpus.txt" in names
    assert not any(name.startswith(("tests/", "nemo_noise_plugin/testing/")) for name in names)


@pytest.mark.slow
def test_the_wheel_installed_outside_the_checkout_runs_its_commands_and_presets(tmp_path):
    """A fresh virtual environment holding only the built wheel (dependencies borrowed from this one)."""
    wheels, venv, elsewhere = tmp_path / "wheels", tmp_path / "venv", tmp_path / "elsewhere"
    elsewhere.mkdir()
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels)]
    subprocess.run([*build, str(REPO)], check=True, capture_output=True, timeout=300)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = pathlib.Path(
        subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                       check=True, capture_output=True, text=True).stdout.strip()
    )  # fmt: skip
    dependencies = pathlib.Path(sysconfig.get_paths()["purelib"])
    (site / "borrowed_dependencies.pth").write_text(f"{dependencies}\n")  # appended after the venv's own packages
    (wheel,) = wheels.glob("nemo_noise_plugin-*.whl")
    install = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)]
    subprocess.run(install, check=True, capture_output=True, timeout=300)

    def run(*args: str) -> str:
        result = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=600, cwd=elsewhere)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
        return result.stdout

    check = (
        "import pathlib, sys, nemo_noise_plugin as p; from nemo_noise_plugin.corpus import corpus_bytes; "
        "from nemo_noise_plugin.distillation.config import load_kd_config; "
        "print(pathlib.Path(p.__file__).is_relative_to(pathlib.Path(sys.argv[1])), "
        "p.load_noise_config('neftune_alpha15').alpha, load_kd_config('forward_kl_t2').temperature, "
        "len(corpus_bytes()) > 1000)"
    )
    assert run(python, "-c", check, venv).split() == ["True", "15.0", "2.0", "True"]
    assert "--recipe" in run(venv / "bin" / "nemo-noise-main-job", "--help")
    nemo = "import sys; from nemo_run.__main__ import app; sys.argv[0] = 'nemo'; app()"
    ledger = run(python, "-c", nemo, "noise", "ledger", "config=dp_gaussian_mechanism", "sequence_length=8")
    assert "Privacy ledger:" in ledger
