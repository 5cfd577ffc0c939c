"""Packaging: Python version, the nemo_run.cli entry point, `nemo --help`, and the presets of configs/ in the wheel."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import sysconfig
import tarfile
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
        timeout=300,  # `nemo --help`: 4.9 s of CPU measured 2026-12-03 (21 s wall at load 21 on 2 cores)
        env={**os.environ, "COLUMNS": "200"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "noise" in result.stdout
    assert "Couldn't load entrypoint" not in result.stdout + result.stderr


def test_importing_the_cli_entry_point_is_cheap():
    script = "import sys, nemo_noise_plugin.cli.nemo_noise; print(any(m.startswith('megatron') for m in sys.modules))"
    # 4.3 s of CPU measured 2026-12-03 (19 s wall at load 19 on 2 cores)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


CONFIGS = sorted(path.relative_to(REPO).as_posix() for path in (REPO / "configs").glob("*/*.yaml"))


def _build_wheel(source: pathlib.Path, into: pathlib.Path) -> pathlib.Path:
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(into)]
    result = subprocess.run([*build, str(source)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    (wheel,) = into.glob("nemo_noise_plugin-*.whl")
    return wheel


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> pathlib.Path:
    """The wheel built from the checkout, as ``pip wheel .`` builds it."""
    return _build_wheel(REPO, tmp_path_factory.mktemp("wheel"))


def test_the_wheel_ships_configs_as_the_package_presets_and_the_corpus(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    presets = sorted(name for name in names if name.endswith(".yaml"))
    assert presets == [f"nemo_noise_plugin/{name}" for name in CONFIGS]  # no copy left in nemo_noise_plugin/presets/
    assert "nemo_noise_plugin/configs/noise/neftune_alpha5.yaml" in presets
    assert "nemo_noise_plugin/configs/kd/forward_kl_t2.yaml" in presets
    assert "nemo_noise_plugin/data/corpus.txt" in names
    assert not any(name.startswith(("tests/", "recipes/", "nemo_noise_plugin/testing/")) for name in names)


def test_the_sdist_carries_configs_and_a_wheel_built_from_it_ships_them(tmp_path):
    hook = "import sys; from setuptools import build_meta; print(build_meta.build_sdist(sys.argv[1]))"
    result = subprocess.run([sys.executable, "-c", hook, str(tmp_path)], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    (sdist,) = tmp_path.glob("nemo_noise_plugin-*.tar.gz")
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    assert {"setup.py", *CONFIGS} <= names
    wheel = _build_wheel(sdist, tmp_path / "wheel")
    assert {f"nemo_noise_plugin/{name}" for name in CONFIGS} <= set(zipfile.ZipFile(wheel).namelist())


@pytest.fixture(scope="module")
def installed_wheel(wheel, tmp_path_factory):
    """A fresh virtual environment holding only the built wheel (dependencies borrowed from this one).

    ``(run, python, venv)``: ``run(*args)`` runs a command in a folder outside the checkout, without PYTHONPATH, and
    returns its output; ``python`` is the environment's interpreter.
    """
    root = tmp_path_factory.mktemp("installed_wheel")
    venv, elsewhere = root / "venv", root / "elsewhere"
    elsewhere.mkdir()
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = pathlib.Path(
        subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                       check=True, capture_output=True, text=True).stdout.strip()
    )  # fmt: skip
    dependencies = pathlib.Path(sysconfig.get_paths()["purelib"])
    (site / "borrowed_dependencies.pth").write_text(f"{dependencies}\n")  # appended after the venv's own packages
    install = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)]
    subprocess.run(install, check=True, capture_output=True, timeout=300)
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}

    def run(*args: str | os.PathLike[str]) -> str:
        result = subprocess.run(
            [str(a) for a in args], capture_output=True, text=True, timeout=600, cwd=elsewhere, env=env
        )
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
        return result.stdout

    return run, python, venv


@pytest.mark.slow  # about 30 s on 2 cores: a virtual environment, the install, a fresh import of torch
def test_the_installed_wheel_finds_every_preset_of_configs_without_the_checkout(installed_wheel):
    run, python, venv = installed_wheel
    check = (
        "import json, pathlib, sys, nemo_noise_plugin as p; "
        "from nemo_noise_plugin.distillation.config import load_kd_config; "
        "from nemo_noise_plugin.presets import available_presets, preset_path; "
        "repo = pathlib.Path(sys.argv[1]); "
        "print(json.dumps(dict(checkout_on_path=any(pathlib.Path(e or '.').resolve() == repo for e in sys.path), "
        "package=str(p.__file__), preset=str(preset_path('noise', 'neftune_alpha5')), "
        "alpha=p.load_noise_config('neftune_alpha5').alpha, temperature=load_kd_config('forward_kl_t2').temperature, "
        "noise=available_presets('noise'), kd=available_presets('kd'))))"
    )
    found = json.loads(run(python, "-c", check, REPO))
    assert not found["checkout_on_path"]
    assert pathlib.Path(found["package"]).is_relative_to(venv)
    assert pathlib.Path(found["preset"]).is_relative_to(venv)
    assert found["preset"].endswith("nemo_noise_plugin/configs/noise/neftune_alpha5.yaml")
    assert (found["alpha"], found["temperature"]) == (5.0, 2.0)
    assert found["noise"] == sorted(path.stem for path in (REPO / "configs" / "noise").glob("*.yaml"))
    assert found["kd"] == sorted(path.stem for path in (REPO / "configs" / "kd").glob("*.yaml"))


@pytest.mark.slow
def test_the_wheel_installed_outside_the_checkout_runs_its_commands_and_presets(installed_wheel):
    run, python, venv = installed_wheel
    check = (
        "import pathlib, sys, nemo_noise_plugin as p; from nemo_noise_plugin.data.corpus import corpus_bytes; "
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
