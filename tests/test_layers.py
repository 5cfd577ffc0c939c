"""The house plan: imports point down the floors only and no modules import each other (scripts/check_layers.py)."""

from __future__ import annotations

import importlib.util
import pathlib
import sys
import textwrap

REPO = pathlib.Path(__file__).resolve().parents[1]


def _checker():
    spec = importlib.util.spec_from_file_location("check_layers", REPO / "scripts" / "check_layers.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _package(root: pathlib.Path, files: dict[str, str]) -> None:
    for relative, source in files.items():
        path = root / "nemo_noise_plugin" / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))


def test_the_package_has_no_import_cycle_no_upward_import_and_every_module_on_a_floor():
    report = _checker().check(REPO)
    assert len(report.modules) > 40
    assert (report.cycles, report.upward, report.unplaced) == ([], [], [])


def test_the_checker_finds_a_lazy_upward_import_and_a_cycle(tmp_path):
    _package(
        tmp_path,
        {
            "__init__.py": "",
            "utils.py": "def helper():\n    from nemo_noise_plugin.training import launch\n",
            "training/__init__.py": "",
            "training/launch.py": "from nemo_noise_plugin.training.loop import run\n",
            "training/loop.py": "from nemo_noise_plugin.training import launch\nrun = 1\n",
        },
    )
    report = _checker().check(tmp_path)
    assert report.upward == [("nemo_noise_plugin.utils", "nemo_noise_plugin.training.launch")]
    assert report.cycles == [["nemo_noise_plugin.training.launch", "nemo_noise_plugin.training.loop"]]


def test_the_checker_resolves_relative_imports_and_flags_modules_on_no_floor(tmp_path):
    _package(
        tmp_path,
        {
            "__init__.py": "",
            "noise/__init__.py": "from .layer import Layer\n",
            "noise/layer.py": "from ..model import gpt\nLayer = 1\n",
            "model/__init__.py": "",
            "model/gpt.py": "",
            "attic.py": "",
        },
    )
    report = _checker().check(tmp_path)
    assert report.upward == [("nemo_noise_plugin.noise.layer", "nemo_noise_plugin.model.gpt")]
    assert report.unplaced == ["nemo_noise_plugin.attic"]
    assert report.cycles == []
