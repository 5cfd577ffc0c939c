"""The finetune command lines: ``nemo llm finetune`` (NeMo-Run) and ``python -m nemo_noise_plugin.cli.finetune``.

Both resolve a recipe by ``--factory`` name, apply trailing Hydra overrides through Megatron-Bridge's override path,
then print (``--dryrun``), export (``--to-yaml``) or launch Bridge's training with the plugin's forward step. Most
behaviour is checked in-process; the ``nemo`` executable (slow to start: it loads every plugin) runs a few times.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest
import torch
import yaml

from nemo_noise_plugin.cli import finetune as finetune_cli
from nemo_noise_plugin.jobs.launch.finetune import FinetuneError, UnknownFactoryError, run_finetune
from nemo_noise_plugin.jobs.launch.launcher import GPU_REQUIRED_MESSAGE, GPUUnavailableError
from nemo_noise_plugin.recipes import RECIPES
from tests.support.nemo2 import write_nemo2_llm

REPO = pathlib.Path(__file__).resolve().parents[2]
NEMO = pathlib.Path(sys.executable).with_name("nemo")
HAS_CUDA = torch.cuda.is_available()
ALL_FACTORIES = ", ".join(sorted(RECIPES))
DISTILLATION_OVERRIDES = ["model.noise.alpha=10", "train.train_iters=7", "model.kd.temperature=2"]


def _quiet(_: str) -> None:
    pass


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def fake_training(monkeypatch):
    """A GPU that is not used: Bridge's training entry is replaced by a recorder."""
    from nemo_noise_plugin.jobs.launch import launcher as launch

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(launch, "require_gpu", lambda: None)
    monkeypatch.setattr(launch, "use_prebuilt_dataset_helpers", lambda: calls.append("prebuilt helpers") or True)
    monkeypatch.setattr(launch, "training_entry_for", lambda config: lambda *args, **kwargs: calls.append(args))
    return calls


def _nemo(*args: str, cwd: pathlib.Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(NEMO), *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=cwd,
        env={**os.environ, "COLUMNS": "200"},
    )


# --- the shared flow (python -m and nemo) -------------------------------------------------------------------------


def test_distillation_overrides_reach_the_config():
    from nemo_noise_plugin.providers import NoisyDistillationProvider

    config = run_finetune("tiny_noise_distillation", DISTILLATION_OVERRIDES, dryrun=True, print_fn=_quiet)
    assert type(config.model) is NoisyDistillationProvider
    assert (config.model.noise.alpha, config.train.train_iters, config.model.kd.temperature) == (10.0, 7, 2.0)


def test_plus_adds_and_tilde_deletes_keys():
    overrides = ["+env_vars.NCCL_DEBUG=INFO", "+env_vars.EXTRA=1", "~env_vars.EXTRA", "model.noise.alpha=3"]
    config = run_finetune("tiny_noise_sft", overrides, dryrun=True, print_fn=_quiet)
    assert config.env_vars == {"NCCL_DEBUG": "INFO"}
    assert config.model.noise.alpha == 3.0


def test_tilde_on_a_field_restores_its_declared_default():
    config = run_finetune("tiny_noise_sft", ["~train.train_iters"], dryrun=True, print_fn=_quiet)
    assert config.train.train_iters is None  # TrainingConfig.train_iters: int | None = None; the recipe sets 40


def test_dry_run_says_what_would_run():
    lines = []
    run_finetune("tiny_noise_distillation", DISTILLATION_OVERRIDES, dryrun=True, print_fn=lines.append)
    (text,) = lines
    assert text.startswith("Dry run (nothing launched):")
    assert "NoisyDistillationProvider" in text
    assert "forward step  nemo_noise_plugin.training.forward_step.distillation_forward_step" in text
    assert "entry         megatron.bridge.training.pretrain.pretrain" in text
    assert "7 iterations" in text and "alpha=10.0" in text and "temperature=2.0" in text


def test_unknown_factory_lists_the_available_ones():
    with pytest.raises(UnknownFactoryError) as error:
        run_finetune("tiny_noise_sf", dryrun=True, print_fn=_quiet)
    assert "Unknown factory 'tiny_noise_sf'" in str(error.value)
    assert ALL_FACTORIES in str(error.value)


def test_factory_may_be_an_import_path():
    config = run_finetune(
        "nemo_noise_plugin.recipes:tiny_noise_sft_config", ["model.noise.alpha=4"], dryrun=True, print_fn=_quiet
    )
    assert config.model.noise.alpha == 4.0


def test_an_import_path_to_a_function_that_needs_arguments_is_refused_naming_them():
    with pytest.raises(UnknownFactoryError, match=r"^--factory 'json:dumps' is not a recipe: it needs the argument"):
        run_finetune("json:dumps", dryrun=True, print_fn=_quiet)


def test_a_misspelled_key_is_an_error_naming_it():
    with pytest.raises(FinetuneError, match=r"model\.noise\.alpah is not a field of NoiseConfig"):
        run_finetune("tiny_noise_sft", ["model.noise.alpah=3"], dryrun=True, print_fn=_quiet)


def test_an_invalid_value_is_an_error_naming_the_key():
    with pytest.raises(FinetuneError, match=r"model\.noise\.alpha=-1 is invalid"):
        run_finetune("tiny_noise_sft", ["model.noise.alpha=-1"], dryrun=True, print_fn=_quiet)


def test_an_option_among_the_overrides_is_an_error():
    with pytest.raises(FinetuneError, match="unknown option '--dry-run'"):
        run_finetune("tiny_noise_sft", ["--dry-run"], dryrun=True, print_fn=_quiet)


def test_to_yaml_writes_bridges_yaml_with_the_overrides(tmp_path, no_cuda):
    path = tmp_path / "run.yaml"
    run_finetune("tiny_noise_distillation", DISTILLATION_OVERRIDES, to_yaml=str(path), print_fn=_quiet)
    written = yaml.safe_load(path.read_text())
    assert written["_target_"] == "megatron.bridge.training.config.ConfigContainer"
    assert written["model"]["_target_"] == "nemo_noise_plugin.providers.NoisyDistillationProvider"
    assert written["model"]["noise"]["alpha"] == 10.0
    assert written["model"]["kd"]["temperature"] == 2.0
    assert written["train"]["train_iters"] == 7


def test_to_yaml_refuses_an_override_as_its_path():
    with pytest.raises(FinetuneError, match="looks like an override"):
        run_finetune("tiny_noise_sft", to_yaml="train.train_iters=3", print_fn=_quiet)


def test_dry_run_and_to_yaml_need_no_gpu(tmp_path, no_cuda):
    run_finetune("tiny_noise_sft", ["train.train_iters=3"], dryrun=True, print_fn=_quiet)
    run_finetune("tiny_noise_sft", ["train.train_iters=3"], to_yaml=str(tmp_path / "a.yaml"), print_fn=_quiet)
    assert not torch.cuda.is_initialized()


def test_a_real_run_without_cuda_stops_before_building_the_config(no_cuda):
    built = []
    with pytest.raises(GPUUnavailableError) as error:
        run_finetune(lambda: built.append(1), ["train.train_iters=3"], print_fn=_quiet)
    assert str(error.value) == GPU_REQUIRED_MESSAGE
    assert "needs a GPU; use --dryrun/--to-yaml, or `python -m nemo_noise_plugin`" in GPU_REQUIRED_MESSAGE
    assert built == []


def test_a_real_run_trains_with_the_distillation_forward_step(fake_training):
    from nemo_noise_plugin.training.forward_step import distillation_forward_step

    config = run_finetune("tiny_noise_distillation", DISTILLATION_OVERRIDES, print_fn=_quiet)
    assert fake_training[0] == "prebuilt helpers"
    assert fake_training[1] == (config, distillation_forward_step)
    assert config.model.noise.alpha == 10.0


def test_a_declined_confirmation_launches_nothing(fake_training):
    run_finetune("tiny_noise_sft", print_fn=_quiet, confirm=lambda: False)
    assert fake_training == []


def test_forward_step_and_entry_follow_the_config():
    from nemo_noise_plugin.jobs.launch.launcher import forward_step_for, training_entry_for
    from nemo_noise_plugin.training.forward_step import distillation_forward_step, noise_forward_step
    from nemo_noise_plugin.upstream.bridge_imports import import_bridge

    sft = run_finetune("tiny_noise_sft", dryrun=True, print_fn=_quiet)
    distillation = run_finetune("tiny_noise_distillation", dryrun=True, print_fn=_quiet)
    assert forward_step_for(sft) is noise_forward_step
    assert forward_step_for(distillation) is distillation_forward_step
    assert training_entry_for(sft) is import_bridge("megatron.bridge.training.pretrain").pretrain
    sft.checkpoint.pretrained_checkpoint = "/weights/iter_0000100"
    assert training_entry_for(sft) is import_bridge("megatron.bridge.training.finetune").finetune


# --- python -m nemo_noise_plugin.cli.finetune ----------------------------------------------------------------------


def test_python_module_dry_run(capsys):
    argv = ["--factory", "tiny_noise_sft", "--dryrun", "model.noise.alpha=6", "train.train_iters=2"]
    assert finetune_cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "Dry run (nothing launched):" in out and "alpha=6.0" in out and "2 iterations" in out


def test_python_module_unknown_factory_exits_2_listing_the_factories(capsys):
    assert finetune_cli.main(["--factory", "nope", "--dryrun"]) == 2  # cli.exits: one line, status 2
    error = capsys.readouterr().err
    assert f"Available factories: {ALL_FACTORIES}" in error and len(error.strip().splitlines()) == 1


def test_python_module_without_cuda_exits_1_with_the_message(capsys, no_cuda):
    assert finetune_cli.main(["--factory", "llama32_1b_noise_sft", "train.train_iters=2"]) == 1
    assert GPU_REQUIRED_MESSAGE in capsys.readouterr().err


def test_python_module_to_yaml_prints_only_yaml_on_stdout():
    result = subprocess.run(
        [sys.executable, "-m", "nemo_noise_plugin.cli.finetune", "--factory", "tiny_noise_distillation"]
        + DISTILLATION_OVERRIDES
        + ["--to-yaml"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    written = yaml.safe_load(result.stdout)
    assert (written["model"]["noise"]["alpha"], written["model"]["kd"]["temperature"]) == (10.0, 2.0)


# --- nemo llm finetune: NeMo-Run's machinery, in-process -------------------------------------------------------------


@pytest.fixture(scope="module")
def cli_llm():
    from nemo_noise_plugin.cli import nemo_llm

    return nemo_llm


def _context(cli_llm, **options):
    return cli_llm.FinetuneRunContext(name="finetune", **options)


def test_recipes_are_nemo_run_factories_of_finetune(cli_llm):
    assert cli_llm.registered_factories() == sorted(RECIPES)
    assert cli_llm.finetune.cli_entrypoint.namespace == "llm"


def test_importing_the_entry_points_loads_neither_bridge_nor_what_the_recipes_build_with():
    # The recipe modules are imported (their decorators register the factories) but their tops are cheap: no
    # Megatron, no providers, no data pipelines (tests/test_recipe_registry.py checks torch for the registry alone).
    script = (
        "import sys, nemo_noise_plugin.cli.nemo_noise, nemo_noise_plugin.cli.nemo_llm; "
        "print(sorted({m.split('.')[0] for m in sys.modules if m.startswith(('megatron', 'transformer_engine'))}), "
        "sorted(m for m in sys.modules if m.startswith(('nemo_noise_plugin.providers', 'nemo_noise_plugin.data.'))))"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "[] []"


def test_nemo_context_hands_the_trailing_arguments_to_bridge(cli_llm, capsys):
    _context(cli_llm, factory="tiny_noise_distillation", dryrun=True).cli_execute(
        cli_llm.finetune, DISTILLATION_OVERRIDES + ["+env_vars.NCCL_DEBUG=INFO"]
    )
    out = capsys.readouterr().out
    assert "distillation_forward_step" in out and "alpha=10.0" in out and "temperature=2.0" in out


def test_nemo_factory_accepts_recipe_arguments(cli_llm):
    config = cli_llm._resolve_factory("tiny_noise_sft(train_iters=3)")
    assert config.train.train_iters == 3


def test_nemo_factory_takes_the_plugins_import_path_form(cli_llm):
    config = cli_llm._resolve_factory("nemo_noise_plugin.recipes:tiny_noise_sft_config")
    assert type(config).__name__ == "ConfigContainer" and config.model.noise.alpha == 5.0


@pytest.mark.parametrize("name", ["json:dumps", "json.dumps"])
def test_nemo_factory_refuses_a_function_that_needs_arguments(cli_llm, name):
    with pytest.raises(UnknownFactoryError, match=rf"^--factory '{re.escape(name)}' is not a recipe: .* obj;"):
        cli_llm._resolve_factory(name)


def test_nemo_context_errors_are_run_context_errors(cli_llm, monkeypatch):
    from nemo_run.cli.api import RunContextError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cases = [
        (dict(factory="nope", dryrun=True), [], f"Available factories: {ALL_FACTORIES}"),
        (dict(dryrun=True), [], f"--factory is required; available: {ALL_FACTORIES}"),
        (dict(factory="tiny_noise_sft", dryrun=True), ["model.noise.alpah=1"], "model.noise.alpah is not a field"),
        (dict(factory="tiny_noise_sft", dryrun=True), ["--yaml", "a.yaml"], "unknown option '--yaml'"),
        (dict(factory="tiny_noise_sft"), ["executor=nope"], "executor='nope' is not a known executor"),
        (dict(factory="llama32_1b_noise_sft", skip_confirmation=True), [], GPU_REQUIRED_MESSAGE),
    ]
    for options, args, message in cases:
        with pytest.raises(RunContextError) as error:
            _context(cli_llm, **options).cli_execute(cli_llm.finetune, args)
        assert message in str(error.value), options


def test_nemo_context_runs_in_process_with_yes(cli_llm, fake_training, monkeypatch):
    monkeypatch.setattr(cli_llm.FinetuneRunContext, "_should_continue", lambda self, skip: skip)
    _context(cli_llm, factory="tiny_noise_sft", skip_confirmation=True).cli_execute(cli_llm.finetune, [])
    assert len(fake_training) == 2


def test_nemo_context_without_yes_or_terminal_asks_for_yes(cli_llm, fake_training, monkeypatch):
    from nemo_run.cli.api import RunContextError

    monkeypatch.setattr(sys, "stdin", open(os.devnull))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(RunContextError, match=r"pass -y \(--yes\)"):
        _context(cli_llm, factory="tiny_noise_sft").cli_execute(cli_llm.finetune, [])
    assert fake_training == []


def test_under_torchrun_nemo_does_not_ask(cli_llm, fake_training, monkeypatch):
    monkeypatch.setattr(sys, "stdin", open(os.devnull))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    _context(cli_llm, factory="tiny_noise_sft").cli_execute(cli_llm.finetune, [])
    assert len(fake_training) == 2


def test_with_nemo2_installed_the_plugin_does_not_shadow_its_llm_finetune(tmp_path):
    write_nemo2_llm(tmp_path)
    script = textwrap.dedent(
        """
        import catalogue
        from nemo_run.cli.cli_parser import parse_cli_args, parse_factory
        from nemo.collections.llm import finetune as nemo2_finetune
        from nemo_noise_plugin.cli import nemo2 as cli_nemo2
        from nemo_noise_plugin.cli import nemo_llm as cli_llm

        root = "nemo_run.cli.entrypoints"
        print(cli_nemo2.nemo2_llm_finetune() is nemo2_finetune)
        print(catalogue._get((root, "llm", "finetune")).fn is nemo2_finetune)
        print(catalogue._get((root, "noise", "finetune")).fn is cli_llm.finetune)
        task = parse_factory(nemo2_finetune, "", nemo2_finetune, "tiny_noise_sft")
        task = parse_cli_args(task, ['overrides=["model.noise.alpha=10"]'])
        print(task.__fn_or_cls__ is cli_llm.finetune, task.factory, task.overrides)
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split("\n")[-5:-1] == [
        "True",
        "True",
        "True",
        "True tiny_noise_sft ['model.noise.alpha=10']",
    ]


# --- nemo llm finetune: the executable -----------------------------------------------------------------------------


@pytest.mark.slow
def test_nemo_help_lists_both_groups_and_llm_help_lists_finetune():
    top = _nemo("--help")
    assert top.returncode == 0, top.stderr[-3000:]
    assert "│ noise" in top.stdout and "│ llm" in top.stdout
    llm = _nemo("llm", "--help")
    assert llm.returncode == 0, llm.stderr[-3000:]
    assert "finetune" in llm.stdout


def test_nemo_llm_finetune_dry_run_applies_the_overrides(tmp_path):
    result = _nemo(
        "llm",
        "finetune",
        "--factory",
        "tiny_noise_distillation",
        "--dryrun",
        *DISTILLATION_OVERRIDES,
        "+env_vars.NCCL_DEBUG=INFO",
        f"checkpoint.save={tmp_path}",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert out.splitlines()[0] == "Dry run (nothing launched):", out[:2000]  # the user's information first
    chatter = [line for line in result.stderr.splitlines() if "Warning" in line or "INFO" in line]
    assert [line for line in chatter if "pynvml" not in line] == [], result.stderr[-3000:]  # only NeMo-Run's own
    assert "forward step  nemo_noise_plugin.training.forward_step.distillation_forward_step" in out
    assert "7 iterations" in out and "alpha=10.0" in out and "temperature=2.0" in out
    assert f"save={tmp_path} " in out


def test_nemo_llm_finetune_to_yaml_writes_valid_yaml(tmp_path):
    path = tmp_path / "run.yaml"
    result = _nemo(
        "llm", "finetune", "-f", "tiny_noise_sft", "--to-yaml", str(path), "model.noise.alpha=10", "~train.train_iters"
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"Resolved config written to {path}" in result.stdout
    written = yaml.safe_load(path.read_text())
    assert written["model"]["noise"]["alpha"] == 10.0
    assert written["train"]["train_iters"] is None


@pytest.mark.skipif(HAS_CUDA, reason="checks the message shown where CUDA is missing")
def test_nemo_llm_finetune_without_cuda_stops_with_the_message(tmp_path):
    result = _nemo("llm", "finetune", "--factory", "llama32_1b_noise_sft", "-y", cwd=tmp_path)
    assert result.returncode == 1
    assert f"Error: {GPU_REQUIRED_MESSAGE}" in result.stderr
    assert not (tmp_path / "nemo_experiments").exists()


@pytest.mark.skipif(HAS_CUDA, reason="checks the CPU loop, which runs where CUDA is missing")
@pytest.mark.slow
def test_nemo_llm_finetune_of_a_tiny_recipe_without_cuda_runs_the_cpu_loop_and_reports(tmp_path):
    result = _nemo("llm", "finetune", "-f", "tiny_noise_sft", "-y", "train.train_iters=3", cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "CPU loop (Bridge's training loop needs CUDA)" in result.stdout
    progress = re.findall(r"^\s+(\d+)/3\s+([0-9.]+)\s+-\s+(\d+)$", result.stdout, flags=re.MULTILINE)
    assert [int(step) for step, _, _ in progress] == [1, 2, 3]
    run_dir = tmp_path / "nemo_experiments" / "tiny_noise_sft"
    assert "robustness report" in result.stdout
    latest = run_dir / "reports" / "latest"
    assert (latest / "robustness.json").is_file() and (latest / "robustness.png").stat().st_size > 10_000


@pytest.mark.parametrize("factory", ["tiny_noise_sft", "tiny_noise_distillation"])
def test_finetune_calls_the_plain_launcher_once_with_the_report_callbacks_its_recipe_names(
    factory, monkeypatch, tmp_path, capsys
):
    """No clean pre-training and no control run under ``nemo llm finetune``: those are the main job's."""
    from nemo_noise_plugin.jobs.launch import launcher
    from nemo_noise_plugin.jobs.progress import ProgressLine
    from nemo_noise_plugin.jobs.reports.robustness import RobustnessReport

    calls, printed = [], []
    monkeypatch.setattr(launcher, "launch", lambda config, overrides=(), **kwargs: calls.append((config, kwargs)))
    config = run_finetune(factory, [f"checkpoint.save={tmp_path / 'checkpoints'}"], print_fn=printed.append)
    assert printed[-1] == "no robustness report: training ended before its last iteration"  # the launch trained nothing
    assert len(calls) == 1
    launched, kwargs = calls[0]
    assert launched is config and kwargs["allow_cpu_loop"] is True
    assert [type(callback) for callback in kwargs["callbacks"]] == [RobustnessReport, ProgressLine]
    assert config.checkpoint.save == str(tmp_path / "checkpoints")  # not a main-job side run's subfolder
    assert "main job" not in capsys.readouterr().out


def test_every_registered_recipe_names_reports_the_jobs_wing_can_build():
    from nemo_noise_plugin.jobs.reports.callbacks import REPORT_BUILDERS
    from nemo_noise_plugin.recipes import REPORTS, Recipe

    assert list(REPORT_BUILDERS) == list(REPORTS)
    assert {name for recipe in RECIPES.values() for name in recipe.reports} <= set(REPORTS)
    assert RECIPES["smollm2_135m_noise_sft"].reports == ("task", "robustness")
    with pytest.raises(ValueError, match=r"reports=\('nope',\) is invalid: expected distinct names from"):
        Recipe("pkg.module:config", reports=("nope",))
