"""``nemo llm finetune --dryrun`` reports the bad run settings a real run would (issue 24): it runs the plugin's
``check_run_settings``, in-process and on the launching side of an executor (for the job's world size), creating
nothing; folders on the cluster or container side (Slurm, Lepton, DGX Cloud, a Docker container) are not checked on
this machine, where they do not exist.

Real NeMo-Run run contexts and executors, NeMo-Run's home in a temporary folder; one ``nemo`` subprocess for the exit
status and the one-line error.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest
from nemo_run.cli.api import RunContextError
from nemo_run.config import get_nemorun_home, set_nemorun_home

from nemo_noise_plugin.jobs.launch.finetune import run_finetune
from nemo_noise_plugin.jobs.reports.artifacts import check_output_dir

NEMO = pathlib.Path(sys.executable).with_name("nemo")
IMAGE = "nvcr.io/nvidia/nemo:25.11"
BAD_MICRO_BATCH = "train.micro_batch_size=3 is invalid with train.global_batch_size=8 and 1 data-parallel rank(s)"


@pytest.fixture(autouse=True)
def nemorun_home(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "stdin", open(os.devnull))  # NeMo-Run's local tunnel hands stdin to its subprocesses
    previous = get_nemorun_home()
    set_nemorun_home(str(tmp_path / "nemo_run_home"))
    yield tmp_path / "nemo_run_home"
    set_nemorun_home(previous)


@pytest.fixture
def not_a_folder(tmp_path) -> str:
    """A checkpoint folder that cannot exist on this machine: its parent is a file."""
    (tmp_path / "a_file").write_text("x")
    return str(tmp_path / "a_file" / "checkpoints")


def _dry_run(args: list[str], factory: str = "tiny_noise_sft") -> None:
    from nemo_noise_plugin.cli import nemo_llm

    context = nemo_llm.FinetuneRunContext(name="finetune", factory=factory, dryrun=True)
    context.cli_execute(nemo_llm.finetune, list(args))


@pytest.mark.slow
@pytest.mark.skipif(not NEMO.exists(), reason="the nemo script is not next to this Python")
def test_a_dry_run_with_a_bad_setting_exits_2_with_the_one_line_error(tmp_path):
    env = {**os.environ, "NEMORUN_HOME": str(tmp_path / "home")}
    result = subprocess.run(
        [str(NEMO), "llm", "finetune", "-f", "tiny_noise_sft", "--dryrun", "train.micro_batch_size=3"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env=env,
    )
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if BAD_MICRO_BATCH in line]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]


def test_an_in_process_dry_run_checks_the_run_settings_and_creates_nothing(tmp_path, not_a_folder):
    with pytest.raises(ValueError, match=r"^train\.micro_batch_size=3 is invalid with train\.global_batch_size=8"):
        run_finetune("tiny_noise_sft", ["train.micro_batch_size=3"], dryrun=True, print_fn=lambda _: None)
    with pytest.raises(ValueError, match=r"checkpoint\.save=.*a_file/checkpoints' is invalid: the folder cannot be"):
        run_finetune("tiny_noise_sft", [f"checkpoint.save={not_a_folder}"], dryrun=True, print_fn=lambda _: None)
    new = tmp_path / "not yet" / "checkpoints"
    run_finetune("tiny_noise_sft", [f"checkpoint.save={new}"], dryrun=True, print_fn=lambda _: None)
    assert not (tmp_path / "not yet").exists()  # a dry run writes nothing


@pytest.mark.parametrize(
    "override",
    ["model.num_layers=0", "model.hidden_size=0", "model.num_attention_heads=0", "dataset.seq_length=-4"],
)
def test_a_dry_run_refuses_model_and_data_sizes_below_one(override):
    """A fresh bad-input pass: 0 layers dry-ran clean, then a real run died in a ZeroDivisionError traceback."""
    setting, value = override.split("=")
    with pytest.raises(ValueError, match=f"^{re.escape(setting)}={value} is invalid: expected an integer >= 1"):
        run_finetune("tiny_noise_sft", [override], dryrun=True, print_fn=lambda _: None)


@pytest.mark.parametrize(
    ("recipe", "overrides", "words"),
    [
        (
            "tiny_noise_sft",
            ["checkpoint.save_interval=-1"],
            "checkpoint.save_interval=-1 is invalid: expected an integer >= 0",
        ),
        (
            "tiny_noise_sft",
            ["model.hidden_size=255", "model.num_attention_heads=4"],
            "model.hidden_size=255 is invalid: expected a multiple of model.num_attention_heads=4 (e.g. 252), or "
            "model.kv_channels set",
        ),
        (
            "tiny_noise_sft",
            ["train.train_iters=100000000000000000000"],
            "train.train_iters=100000000000000000000 is invalid: expected an integer >= 1 and <= 1152921504606846975",
        ),
        (
            "tiny_noise_distillation",
            ["model.kd.top_k=100000"],
            "model.kd.top_k=100000 is invalid with model.vocab_size=257: expected an integer in [1, 257]",
        ),
        (
            "tiny_noise_sft",
            ["model.noise.alpha=1e30"],
            "NoiseConfig.alpha=1e+30 is invalid with mechanism='uniform', hidden_size=256 and bfloat16: expected a "
            "noise level whose per-token noise norm stays below",
        ),
        (
            "tiny_noise_sft",
            ["model.noise.mechanism=metric_dp", "model.noise.eta=1e-20"],
            "NoiseConfig.eta=1e-20 is invalid with mechanism='metric_dp', hidden_size=256 and bfloat16",
        ),
    ],
    ids=[
        "negative save interval",
        "heads do not divide hidden",
        "1e20 iterations",
        "top_k past the vocabulary",
        "alpha whose noise overflows (issue 36, finding 5)",
        "eta whose noise overflows (issue 36, finding 5)",
    ],
)
def test_a_dry_run_refuses_sizes_megatron_would_misuse(recipe, overrides, words):
    """Each passed the dry run before (issue 36, finding 8) and then failed or did something else at run time."""
    with pytest.raises(ValueError) as refused:
        run_finetune(recipe, overrides, dryrun=True, print_fn=lambda _: None)
    assert str(refused.value).startswith(words), str(refused.value)


def test_a_hidden_size_heads_do_not_divide_is_accepted_with_kv_channels():
    run_finetune(
        "tiny_noise_sft",
        ["model.hidden_size=255", "model.num_attention_heads=4", "model.kv_channels=64"],
        dryrun=True,
        print_fn=lambda _: None,
    )


def test_a_folder_that_os_access_calls_writable_but_cannot_be_made_is_refused():
    """As root, ``os.access`` says /proc is writable; a real ``mkdir`` there fails, and so does the dry check."""
    with pytest.raises(ValueError, match=r"^output_dir='/proc/nope/out' is invalid: the folder cannot be written"):
        check_output_dir("/proc/nope/out", "output_dir", create=False)


def test_a_dry_run_through_an_executor_checks_the_settings_for_the_jobs_world_size(capsys):
    with pytest.raises(RunContextError, match="micro_batch_size=3 is invalid"):
        _dry_run(["executor=local", "train.micro_batch_size=3"])
    # 2 nodes x 8 GPUs = 16 data-parallel ranks: each rank's launch() would refuse global batch 8, micro batch 2
    slurm = ["executor=slurm", "executor.account=a", "executor.nodes=2"]
    with pytest.raises(RunContextError, match=r"global_batch_size=8 and 16 data-parallel rank\(s\)"):
        _dry_run(slurm)
    _dry_run([*slurm, "train.global_batch_size=32"])
    assert "#SBATCH --nodes=2" in capsys.readouterr().out


def test_a_local_executor_checks_the_checkpoint_folder_on_this_machine(not_a_folder):
    with pytest.raises(RunContextError, match=r"checkpoint\.save=.* is invalid: the folder cannot be written"):
        _dry_run(["executor=local", f"checkpoint.save={not_a_folder}"])


@pytest.mark.parametrize(
    "executor",
    [
        ["executor=slurm", "executor.account=a", "executor.gpus_per_node=1", "executor.ntasks_per_node=1"],
        [
            "executor=lepton",
            "executor.gpus_per_node=1",
            "executor.nprocs_per_node=1",
            f"executor.container_image={IMAGE}",
            "executor.resource_shape=gpu.1xh100-80gb",
            "executor.node_group=noise-nodes",
            'executor.mounts=[{"path": "/", "mount_path": "/shared"}]',
            "executor.nemo_run_dir=/shared/nemo_run",
        ],
        [
            "executor=docker",
            "executor.num_gpus=1",
            "executor.ntasks_per_node=1",
            f"executor.container_image={IMAGE}",
            'executor.volumes=["/cluster_data:/data"]',
        ],
    ],
    ids=["slurm", "lepton", "docker"],
)
def test_a_checkpoint_folder_on_the_cluster_or_container_side_is_not_checked_here(executor, not_a_folder, capsys):
    """``/data/ckpt`` under the container's volume, or any path of a Slurm / Lepton job: not on this machine."""
    for path in (not_a_folder, "/data/noise_run/checkpoints"):
        _dry_run([*executor, f"checkpoint.save={path}"])
        assert "Would launch" in capsys.readouterr().out
    assert not pathlib.Path("/data/noise_run").exists()


@pytest.mark.parametrize("case", ["parent is a file", "path is a file", "empty"])
def test_the_dry_folder_check_says_what_the_real_one_says(tmp_path, case):
    (tmp_path / "a_file").write_text("x")
    path = {"parent is a file": tmp_path / "a_file" / "ckpt", "path is a file": tmp_path / "a_file", "empty": ""}[case]
    messages = []
    for create in (False, True):
        with pytest.raises(ValueError) as error:
            check_output_dir(str(path), "checkpoint.save", create=create)
        messages.append(str(error.value))
    assert messages[0] == messages[1]
    check_output_dir(str(tmp_path / "new" / "ckpt"), "checkpoint.save", create=False)
    assert not (tmp_path / "new").exists()
