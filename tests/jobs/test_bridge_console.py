"""Bridge's console output goes to the run folder's ``bridge.log``; the plugin's lines stay on the console.

Each case runs in a child process, because the mechanism (``jobs.launch.bridge_console``) moves file descriptor 1.
The child writes the way Bridge and Megatron do: ``print``, a logging handler bound to ``sys.stdout`` before the
switch (as ``megatron.training`` installs one at import), ``os.write(1, ...)``, C ``printf`` and a child process of
its own. The GPU twin (``tests/gpu/test_main_job_gpu.py``) checks the real main job's console on an H200.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]

BRIDGE_LINES = (
    "bridge: print",
    "bridge: logging",
    "bridge: os.write",
    "bridge: printf",
    "bridge: child process",
    "bridge: an error",
    "bridge: clean exit",
)

WRITES_LIKE_BRIDGE = textwrap.dedent(
    """
    import ctypes, logging, os, subprocess, sys
    from nemo_noise_plugin.jobs.launch.bridge_console import stdout_to_file

    logging.basicConfig(handlers=[logging.StreamHandler(sys.stdout)], level=logging.INFO, format="%(message)s")
    logger = logging.getLogger("megatron.bridge.training.fake")
    print("plugin: header")
    with stdout_to_file(sys.argv[1], verbose=sys.argv[2] == "1") as console:
        print("bridge: print")
        logger.info("bridge: logging")
        os.write(1, b"bridge: os.write\\n")
        ctypes.CDLL(None).printf(b"bridge: printf\\n")
        subprocess.run([sys.executable, "-c", "print('bridge: child process')"], check=True)
        print("plugin: progress line", file=console, flush=True)
        logger.error("bridge: an error")
        try:
            sys.exit(0)
        except SystemExit:
            logger.exception("bridge: clean exit")
    print("plugin: result")
    """
)

COMMAND_RUNS = textwrap.dedent(
    """
    import sys
    from types import SimpleNamespace
    from nemo_noise_plugin.jobs.launch.bridge_console import bridge_log, bridge_output, run_folder

    folder = sys.argv[1]
    config = SimpleNamespace(checkpoint=SimpleNamespace(save=folder + "/checkpoints"))
    with bridge_output(config):
        print("outside a command: on the console")
    with bridge_log(), run_folder(folder):
        for run in ("control", "noise"):
            with bridge_output(config):
                print(f"bridge: {run} run")
    with bridge_output(config):
        print("after the command: on the console")
    """
)


def _says_where(log: pathlib.Path) -> str:
    return f"Bridge's log (its configuration and per-step lines): {log}; -v shows it here too"


def _child(code: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
        env={**os.environ, **(env or {})},
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def quiet(tmp_path_factory) -> tuple[subprocess.CompletedProcess, str]:
    log = tmp_path_factory.mktemp("quiet") / "bridge.log"
    return _child(WRITES_LIKE_BRIDGE, str(log), "0"), log.read_text()


@pytest.fixture(scope="module")
def verbose(tmp_path_factory) -> tuple[subprocess.CompletedProcess, str]:
    log = tmp_path_factory.mktemp("verbose") / "bridge.log"
    return _child(WRITES_LIKE_BRIDGE, str(log), "1"), log.read_text()


def test_the_console_gets_only_the_plugins_lines(quiet):
    result, _ = quiet
    assert result.stdout.splitlines() == ["plugin: header", "plugin: progress line", "plugin: result"]


def test_the_file_gets_every_way_of_writing_to_standard_output(quiet):
    _, log = quiet
    lines = log.splitlines()
    assert lines[0].startswith("=== ") and lines[0].endswith(" ===")  # when, which process, which command
    assert all(line in lines for line in BRIDGE_LINES), log
    assert not any(line.startswith("plugin:") for line in lines), log


def test_errors_reach_standard_error_but_a_clean_exit_does_not(quiet):
    result, _ = quiet
    assert "ERROR megatron.bridge.training.fake: bridge: an error" in result.stderr.splitlines()
    assert "clean exit" not in result.stderr and "SystemExit" not in result.stderr


def test_verbose_shows_everything_on_the_console_in_order_and_keeps_the_file(verbose):
    result, log = verbose
    console = result.stdout.splitlines()
    assert console[0] == "plugin: header" and console[-1] == "plugin: result"
    assert all(line in console for line in BRIDGE_LINES), result.stdout
    order = ["bridge: print", "bridge: logging", "bridge: os.write", "bridge: child process", "plugin: progress line"]
    assert [console.index(line) for line in order] == sorted(console.index(line) for line in order)
    assert all(line in log.splitlines() for line in BRIDGE_LINES), log
    assert "bridge: an error" not in result.stderr  # shown once, on the console above


def test_bridge_output_is_on_only_inside_a_command_and_says_once_where_the_log_is(tmp_path):
    result = _child(COMMAND_RUNS, str(tmp_path))
    log = tmp_path / "bridge.log"
    assert result.stdout.splitlines() == [
        "outside a command: on the console",
        _says_where(log),
        "after the command: on the console",
    ]
    lines = log.read_text().splitlines()
    assert [line for line in lines if not line.startswith("=== ")] == ["bridge: control run", "bridge: noise run"]
    assert sum(line.startswith("=== ") for line in lines) == 2  # one header per call into Bridge


def test_each_rank_writes_its_own_log_and_only_rank_0_says_where(tmp_path):
    other = _child(COMMAND_RUNS, str(tmp_path), env={"RANK": "2", "WORLD_SIZE": "4"})
    first = _child(COMMAND_RUNS, str(tmp_path), env={"RANK": "0", "WORLD_SIZE": "4"})
    assert "bridge: noise run" in (tmp_path / "bridge.rank2.log").read_text()
    assert "bridge: noise run" in (tmp_path / "bridge.log").read_text()
    assert "Bridge's log" not in other.stdout
    assert f"{tmp_path / 'bridge.log'}; rank N's: bridge.rankN.log;" in first.stdout


def test_importing_the_entry_points_turns_nothing_on(tmp_path):
    code = textwrap.dedent(
        """
        import sys
        from types import SimpleNamespace
        import nemo_noise_plugin.__main__, nemo_noise_plugin.cli.finetune, nemo_noise_plugin.cli.main_job
        from nemo_noise_plugin.jobs.launch.bridge_console import bridge_output

        with bridge_output(SimpleNamespace(checkpoint=SimpleNamespace(save=sys.argv[1]))):
            print("bridge: on the console")
        """
    )
    result = _child(code, str(tmp_path / "checkpoints"))
    assert result.stdout.splitlines() == ["bridge: on the console"]
    assert list(tmp_path.iterdir()) == []


LAUNCH_WITH_A_FAKE_GPU = textwrap.dedent(
    """
    import sys
    from types import SimpleNamespace

    import torch

    from nemo_noise_plugin.recipes.tiny import tiny_noise_sft_config
    from nemo_noise_plugin.jobs.cpu import loop as cpu_loop
    from nemo_noise_plugin.jobs.launch import launcher as launching
    from nemo_noise_plugin.jobs.launch.bridge_console import bridge_log, run_folder
    from nemo_noise_plugin.jobs.progress import ProgressLine


    def fire(callbacks, config, *events):
        from megatron.bridge.training.callbacks import normalize_callbacks

        manager = normalize_callbacks(callbacks)
        state = SimpleNamespace(cfg=config, train_state=SimpleNamespace(step=0))
        context = SimpleNamespace(state=state, model=[], loss_dict={"lm loss": torch.tensor(5.25)})  # as Bridge's
        for event in events:
            manager.fire(event, context)


    def bridge_entry(config, step, callbacks):  # prints as Bridge's pretrain does, fires the events it fires
        print("Configuration Summary (Non-Default Values vs Megatron Core)")
        fire(callbacks, config, "on_train_start", "on_train_step_start")
        print(" iteration        1/       1 | lm loss: 5.250000E+00 |", flush=True)
        fire(callbacks, config, "on_train_step_end")


    def cpu_loop_run(config, step, callbacks):
        print("CPU loop (Bridge's training loop needs CUDA)")
        fire(callbacks, config, "on_train_start", "on_train_step_start", "on_train_step_end")


    folder = sys.argv[1]
    launching.training_entry_for = lambda config: bridge_entry
    launching.use_prebuilt_dataset_helpers = lambda: True
    cpu_loop.run_cpu_loop = cpu_loop_run
    with bridge_log(), run_folder(folder):
        for gpu in (True, False):
            torch.cuda.is_available = lambda: gpu
            print(f"-- {'GPU' if gpu else 'CPU'} --", flush=True)
            config = tiny_noise_sft_config(dir=folder, train_iters=1)
            launching.launch(config, callbacks=[ProgressLine()], allow_cpu_loop=True)
    """
)


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> tuple[list[str], pathlib.Path]:
    folder = tmp_path_factory.mktemp("launch")
    result = _child(LAUNCH_WITH_A_FAKE_GPU, str(folder))
    console = result.stdout.splitlines()
    return console, folder


def test_launch_under_a_command_shows_the_progress_line_and_logs_bridges_lines(launched):
    console, folder = launched
    gpu = console[console.index("-- GPU --") + 1 : console.index("-- CPU --")]
    assert gpu[0] == _says_where(folder / "bridge.log")
    assert gpu[1].split() == ["step", "loss", "kd", "loss", "tokens/s"]
    assert gpu[2].split()[:3] == ["1/1", "5.2500", "-"] and len(gpu) == 3, console
    log = (folder / "bridge.log").read_text()
    assert "Configuration Summary (Non-Default Values vs Megatron Core)" in log and "iteration        1/" in log
    assert not any(line.split()[:2] == ["1/1", "5.2500"] for line in log.splitlines())  # on the console only


def test_the_cpu_loop_prints_on_the_console_as_before(launched):
    console, folder = launched
    cpu = console[console.index("-- CPU --") + 1 :]
    assert cpu[0] == "CPU loop (Bridge's training loop needs CUDA)"
    assert cpu[2].split()[:3] == ["1/1", "5.2500", "-"] and len(cpu) == 3, console
    assert "CPU loop" not in (folder / "bridge.log").read_text()
