"""The recipe-name walk (issue 24, scripts/recipe_name_walk.py): its figures, and that the walk does not grow back."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
MEASURED_AT_HEAD = {"stops": 7, "climbs": 2, "returns": 2}
"""``nemo llm finetune --factory tiny_noise_sft --dryrun`` as measured in docs/development.md ("Recipe-name walk")."""
MEASURED_REAL_RUN_AT_HEAD = {"stops": 17, "climbs": 5, "returns": 7}
# 47a2818: recipes.common is one more stop; issue 36 put jobs.reports.artifacts/provenance on a floor below the
# report callbacks ("report files"), so the same call order RunReport -> report_callbacks now counts as a climb
"""``nemo llm finetune --factory tiny_noise_sft -y train.train_iters=2`` (``--train-steps 2``), the same section."""


def _walk_script():
    name = "recipe_name_walk"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / "recipe_name_walk.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_figures_of_a_hand_made_walk():
    walk = _walk_script()
    floors = {"cli": 0, "jobs": 3, "recipes": 5, "launcher": 2}
    modules = ["cli", "cli", "jobs", "recipes", "recipes", "jobs", "cli", "launcher"]
    assert walk.collapse(modules) == ["cli", "jobs", "recipes", "jobs", "cli", "launcher"]
    figures = walk.figures(modules, floors.__getitem__)
    # climbs: recipes -> jobs (5 -> 3) and jobs -> cli (3 -> 0); returns: jobs and cli, entered again after leaving
    assert (figures.stops, figures.climbs, figures.returns) == (6, 2, 2)
    assert walk.figures([], floors.__getitem__) == walk.Figures(0, 0, 0)
    assert walk.figures(["cli", "cli"], floors.__getitem__) == walk.Figures(1, 0, 0)


def test_what_holds_the_recipe_name():
    walk = _walk_script()
    pattern = walk.name_pattern("tiny_noise_sft")
    factory = "tiny_noise_sft"

    class Entry:
        def __init__(self, path):
            self.path = path

    def tiny_noise_sft_config():
        pass

    assert all(
        walk.holds(value, pattern)
        for value in (
            "tiny_noise_sft",
            "tiny_noise_sft(seq_length=64)",
            "nemo_noise_plugin.recipes.tiny:tiny_noise_sft_config",
            ["--factory", "tiny_noise_sft", "--dryrun"],
            Entry("nemo_noise_plugin.recipes.tiny:tiny_noise_sft_config"),
            tiny_noise_sft_config,
            lambda: factory,  # a closure cell
        )
    )
    assert not any(
        walk.holds(value, pattern)
        for value in (
            "tiny_noise_sft_2",
            "/runs/tiny_noise_sft/checkpoints",  # the name as a folder
            {"tiny_noise_sft": Entry("x")},  # a registry of names
            Entry(Entry("tiny_noise_sft")),  # two steps away
            None,
        )
    )


def test_a_module_todays_layout_lacks_sits_on_the_highest_floor_it_imports(tmp_path):
    walk = _walk_script()
    checker = walk._floors_module()
    files = {
        "__init__.py": "",
        "cli/__init__.py": "",
        "cli/finetune.py": "from nemo_noise_plugin.old_flow import run\n",
        "recipes/__init__.py": "",
        "old_flow.py": """
            from nemo_noise_plugin import recipes

            def run():
                from nemo_noise_plugin.cli import finetune
            """,
        "old_leaf.py": "",
    }
    for relative, source in files.items():
        path = tmp_path / "nemo_noise_plugin" / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))
    floors = walk.floor_table(tmp_path, REPO)
    assert floors["nemo_noise_plugin.recipes"] == checker.floor_of("nemo_noise_plugin.recipes", "nemo_noise_plugin")
    assert floors["nemo_noise_plugin.old_flow"] == floors["nemo_noise_plugin.cli.finetune"] == 0  # lazy import, up
    assert floors["nemo_noise_plugin.old_leaf"] == len(checker.FLOORS) - 1


def test_a_real_run_trains_the_given_steps_without_asking():
    walk = _walk_script()
    assert walk.command_line("tiny_noise_sft") == ["llm", "finetune", "--factory", "tiny_noise_sft", "--dryrun"]
    assert walk.command_line("tiny_noise_sft", "module", train_steps=2) == [
        "--factory",
        "tiny_noise_sft",
        "-y",
        "train.train_iters=2",
    ]
    banner = "== nemo-noise-plugin main job: factory tiny_noise_sft on the embedded corpus ==\n 1/2 5.6\n"
    assert walk.MAIN_JOB_LINE.findall(banner) == [banner.splitlines()[0]]


def _run_walk(*arguments: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "recipe_name_walk.py"), "--json", *arguments],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


@pytest.mark.slow
def test_the_walk_from_nemo_llm_finetune_does_not_grow_back():
    walk = _run_walk()
    assert walk["exit_status"] in (0, None), walk["output_tail"]
    assert walk["handed_to_launcher"] and walk["walk"][0]["module"] == "nemo_noise_plugin.cli.nemo_llm"
    assert any(stop["module"] == "nemo_noise_plugin.recipes.tiny" for stop in walk["walk"])
    figures = {key: walk[key] for key in MEASURED_AT_HEAD}
    assert all(figures[key] <= MEASURED_AT_HEAD[key] for key in MEASURED_AT_HEAD), (figures, walk["walk"])


@pytest.mark.slow
def test_the_walk_of_a_real_nemo_llm_finetune_run_does_not_grow_back():
    """The whole run (CPU loop, 2 steps, the robustness report): about 2 minutes on 2 cores."""
    walk = _run_walk("--train-steps", "2")
    assert walk["exit_status"] in (0, None), walk["output_tail"]
    assert walk["handed_to_launcher"] and walk["walk"][0]["module"] == "nemo_noise_plugin.cli.nemo_llm"
    assert walk["main_job_lines"] == []  # no fork into the main job's orchestration (62da161's launch_with_report)
    assert not any("launch_with_report" in stop["functions"] for stop in walk["walk"])
    assert walk["walk"][-1]["module"] == "nemo_noise_plugin.jobs.reports.artifacts"  # ends writing the report
    figures = {key: walk[key] for key in MEASURED_REAL_RUN_AT_HEAD}
    assert all(figures[key] <= MEASURED_REAL_RUN_AT_HEAD[key] for key in MEASURED_REAL_RUN_AT_HEAD), (
        figures,
        walk["walk"],
    )
