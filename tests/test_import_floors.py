"""The import floors: two wings, imports pointing down only, no cycles, no floor too wide (check_import_floors.py)."""

from __future__ import annotations

import importlib.util
import pathlib
import sys
import textwrap

REPO = pathlib.Path(__file__).resolve().parents[1]


def _checker():
    spec = importlib.util.spec_from_file_location("check_import_floors", REPO / "scripts" / "check_import_floors.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _package(root: pathlib.Path, files: dict[str, str]) -> None:
    for relative, source in files.items():
        path = root / "nemo_noise_plugin" / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))


def test_the_package_keeps_its_floors_its_wings_and_its_widths():
    checker = _checker()
    report = checker.check(REPO)
    assert len(report.modules) > 40
    assert (report.cycles, report.upward, report.across_wings, report.unplaced) == ([], [], [], [])
    assert (report.folder_cycles, report.misplaced) == ([], [])
    assert len(report.root_modules) <= checker.MAX_ROOT_MODULES
    assert report.widest_floor[1] <= checker.MAX_FLOOR_WIDTH
    assert not report.failed


def test_the_checker_finds_a_lazy_upward_import_and_a_cycle(tmp_path):
    _package(
        tmp_path,
        {
            "__init__.py": "",
            "utils.py": "def helper():\n    from nemo_noise_plugin.jobs.launch import launcher\n",
            "jobs/__init__.py": "",
            "jobs/launch/__init__.py": "",
            "jobs/launch/launcher.py": "from nemo_noise_plugin.jobs.launch.finetune import run\n",
            "jobs/launch/finetune.py": "from nemo_noise_plugin.jobs.launch import launcher\nrun = 1\n",
        },
    )
    report = _checker().check(tmp_path)
    assert report.upward == [("nemo_noise_plugin.utils", "nemo_noise_plugin.jobs.launch.launcher")]
    assert report.cycles == [["nemo_noise_plugin.jobs.launch.finetune", "nemo_noise_plugin.jobs.launch.launcher"]]


def test_a_library_module_importing_the_jobs_wing_or_the_command_line_fails_the_check(tmp_path):
    _package(
        tmp_path,
        {
            "__init__.py": "",
            "recipes/__init__.py": "from nemo_noise_plugin.jobs.reports import robustness\n",
            "providers.py": "def build():\n    import nemo_noise_plugin.cli.console\n",
            "jobs/__init__.py": "",
            "jobs/reports/__init__.py": "",
            "jobs/reports/robustness.py": "from nemo_noise_plugin import providers\n",  # jobs -> library: allowed
            "cli/__init__.py": "",
            "cli/console.py": "",
        },
    )
    checker = _checker()
    report = checker.check(tmp_path)
    assert report.across_wings == [
        ("nemo_noise_plugin.providers", "nemo_noise_plugin.cli.console"),
        ("nemo_noise_plugin.recipes", "nemo_noise_plugin.jobs.reports.robustness"),
    ]
    assert report.failed
    assert checker.main(["--root", str(tmp_path)]) == 1


def test_the_checker_resolves_relative_imports_and_flags_modules_on_no_floor(tmp_path):
    _package(
        tmp_path,
        {
            "__init__.py": "",
            "noise/__init__.py": "from .layer import Layer\n",
            "noise/layer.py": "from ..model import gpt\nLayer = 1\n",
            "model/__init__.py": "",
            "model/gpt.py": "",
            "attic/__init__.py": "",
        },
    )
    report = _checker().check(tmp_path)
    assert report.upward == [("nemo_noise_plugin.noise.layer", "nemo_noise_plugin.model.gpt")]
    assert report.unplaced == ["nemo_noise_plugin.attic"]
    assert report.cycles == []


def test_a_root_of_six_modules_and_a_floor_of_nine_fail_the_check(tmp_path):
    root_modules = {f"{name}.py": "" for name in ("providers", "utils", "validation", "yaml_files", "extra1", "extra2")}
    model_modules = {f"model/m{index}.py": "" for index in range(8)}
    _package(tmp_path, {"__init__.py": "", "__main__.py": "", **root_modules, "model/__init__.py": "", **model_modules})
    checker = _checker()
    report = checker.check(tmp_path)
    assert len(report.root_modules) == 6  # __init__ and __main__ do not count
    assert report.too_wide == [("model", 9)]
    assert report.widest_floor == ("model", 9)
    assert report.failed


def test_two_sibling_folders_importing_each_other_are_a_folder_cycle_without_a_module_cycle(tmp_path):
    _package(
        tmp_path,
        {
            "__init__.py": "",
            "noise/__init__.py": "",
            "noise/layer.py": "from nemo_noise_plugin.model import gpt\n",  # noise -> model
            "model/__init__.py": "",
            "model/gpt.py": "",
            "model/mixin.py": "from nemo_noise_plugin.noise import config\n",  # model -> noise
            "noise/config.py": "",
            "jobs/__init__.py": "",
            "jobs/main_job.py": "from nemo_noise_plugin.jobs.launch import launcher\n",  # into its own subfolder
            "jobs/launch/__init__.py": "",
            "jobs/launch/launcher.py": "from nemo_noise_plugin.jobs.reports import robustness\n",
            "jobs/reports/__init__.py": "",
            "jobs/reports/robustness.py": "def run():\n    from nemo_noise_plugin.jobs.launch import finetune\n",
            "jobs/launch/finetune.py": "from nemo_noise_plugin.jobs import progress\n",
            "jobs/progress.py": "",
        },
    )
    checker = _checker()
    report = checker.check(tmp_path)
    assert report.cycles == []
    assert report.folder_cycles == [["jobs.launch", "jobs.reports"], ["model", "noise"]]
    assert report.failed
    assert checker.main(["--root", str(tmp_path)]) == 1


def test_the_wing_comes_from_the_first_folder_not_from_the_floors_table(tmp_path, monkeypatch):
    checker = _checker()
    floors = [(wing, name, prefixes) for wing, name, prefixes in checker.FLOORS if name != "main job"]
    floors.insert(3, (checker.JOBS, "main job", ("jobs.main_job", "training.launch")))  # an alias listed as jobs
    monkeypatch.setattr(checker, "FLOORS", floors)
    _package(
        tmp_path,
        {
            "__init__.py": "",
            "training/__init__.py": "",
            "training/launch.py": "from nemo_noise_plugin.jobs.launch.launcher import run\n",
            "jobs/__init__.py": "",
            "jobs/launch/__init__.py": "",
            "jobs/launch/launcher.py": "run = 1\n",
        },
    )
    report = checker.check(tmp_path)
    assert report.upward == []  # the floors alone would let it pass
    assert report.across_wings == [("nemo_noise_plugin.training.launch", "nemo_noise_plugin.jobs.launch.launcher")]
    assert report.misplaced == ["nemo_noise_plugin.training.launch"]
    assert checker.wing_of_module("nemo_noise_plugin.__main__", "nemo_noise_plugin") == checker.CLI
    assert checker.wing_of_module("nemo_noise_plugin.utils", "nemo_noise_plugin") == checker.LIBRARY


def test_no_library_module_runs_pip_or_writes_a_model_cache():
    """Fetching and converting a pretrained model is the jobs wing's (``jobs/models/``): the library builds models
    from the ``hf_path`` it is given."""
    checker = _checker()
    report = checker.check(REPO)
    library = [name for name in report.modules if checker.wing_of_module(name, checker.PACKAGE) == checker.LIBRARY]
    assert "nemo_noise_plugin.recipes.smollm2" in library and len(library) > 60
    marks = ('"pip"', "pip download", "NEMO_NOISE_MODEL_CACHE", "model_cache_dir", "ensure_smollm2_hf")
    found = {name: [mark for mark in marks if mark in report.modules[name].read_text()] for name in library}
    assert {name: hits for name, hits in found.items() if hits} == {}
    jobs_models = report.modules["nemo_noise_plugin.jobs.models.fetch_wheel"].read_text()
    assert '"pip"' in jobs_models and "NEMO_NOISE_MODEL_CACHE" in jobs_models  # the marks are where they belong
