"""The catalogue of bad inputs a new user may type, by surface, each with the words its error must contain.

Every case is run by ``tests/cli/test_bad_inputs.py`` (each must end in one clear error: the expected exception or exit
status, a message naming the setting and the offending value, no traceback) and tabulated in
``docs/bad_inputs.md`` by ``scripts/bad_inputs_table.py``. Cases run in-process and stop before any model is built.
"""

from __future__ import annotations

import contextlib
import io
import math
import pathlib
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

REPO = pathlib.Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class BadInput:
    """One bad input: where it is typed, what is typed, and the words its error must contain."""

    surface: str
    text: str
    run: Callable[[], None]
    must_mention: tuple[str, ...]


@dataclass(frozen=True)
class Outcome:
    """What a case did: ``clear error`` (with the message), ``unclear error``, ``traceback`` or ``accepted``."""

    kind: str
    message: str


class UserError(Exception):
    """A command's clear failure: a one-line message and the exit status it returned."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def run_case(case: BadInput) -> Outcome:
    """Run ``case`` and classify what happened."""
    from nemo_noise_plugin.jobs.launch.finetune import FinetuneError

    try:
        case.run()
    except (ValueError, FinetuneError, FileNotFoundError, UserError) as error:
        message = " ".join(str(error).split())
        clear = all(word in message for word in case.must_mention) and "Traceback" not in message
        return Outcome("clear error" if clear else "unclear error", message)
    except Exception as error:  # anything else would reach the user as a raw traceback
        return Outcome("traceback", f"{type(error).__name__}: {error}")
    return Outcome("accepted", "")


def _noise(**fields) -> Callable[[], None]:
    def run() -> None:
        from nemo_noise_plugin.noise.config import NoiseConfig

        NoiseConfig(**fields)

    return run


def _kd(**fields) -> Callable[[], None]:
    def run() -> None:
        from nemo_noise_plugin.distillation.config import KDConfig

        KDConfig(**fields)

    return run


def _main_job(*argv: str) -> Callable[[], None]:
    def run() -> None:
        from nemo_noise_plugin.cli.main_job import main

        stderr = io.StringIO()
        try:
            with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
                status = main(list(argv))
        except SystemExit as exit_:
            status = exit_.code
        if status:
            lines = [line for line in stderr.getvalue().splitlines() if line.strip()]
            raise UserError(lines[-1] if lines else f"exit {status}", status)

    return run


def _finetune(*overrides: str, config_file_text: str | None = None) -> Callable[[], None]:
    def run() -> None:
        from nemo_noise_plugin.jobs.launch.finetune import run_finetune

        with tempfile.TemporaryDirectory() as folder:
            config_file = None
            if config_file_text is not None:
                config_file = str(pathlib.Path(folder) / "run.yaml")
                pathlib.Path(config_file).write_text(config_file_text)
            run_finetune(
                "tiny_noise_distillation",
                [f"checkpoint.save={folder}/checkpoints", *overrides],
                config_file=config_file,
                dryrun=True,
                print_fn=lambda _: None,
            )

    return run


def _executor(*arguments: str) -> Callable[[], None]:
    """``nemo llm finetune -f tiny_noise_sft --dryrun <arguments>`` (NeMo-Run's home in a temporary folder)."""

    def run() -> None:
        from nemo_run.cli.api import RunContextError
        from nemo_run.config import get_nemorun_home, set_nemorun_home

        from nemo_noise_plugin.cli import nemo_llm

        previous = get_nemorun_home()
        with tempfile.TemporaryDirectory() as folder, contextlib.redirect_stdout(io.StringIO()):
            set_nemorun_home(folder)
            try:
                context = nemo_llm.FinetuneRunContext(name="finetune", factory="tiny_noise_sft", dryrun=True)
                context.cli_execute(nemo_llm.finetune, list(arguments))
            except RunContextError as error:
                raise UserError(str(error), 1) from None
            finally:
                set_nemorun_home(previous)

    return run


def _main_job_noise_file(text: str, name: str) -> Callable[[], None]:
    """The main job with ``--noise-config`` a file holding ``text``."""

    def run() -> None:
        with tempfile.TemporaryDirectory() as folder:
            path = pathlib.Path(folder) / name
            path.write_text(text)
            _main_job("--noise-config", str(path), "--output-dir", f"{folder}/out")()

    return run


def _ledger_file(text: str, *arguments: str) -> Callable[[], None]:
    """``nemo noise ledger config=<a file holding text> <arguments>``."""

    def run() -> None:
        with tempfile.TemporaryDirectory() as folder:
            path = pathlib.Path(folder) / "noise.yaml"
            path.write_text(text)
            _ledger(f"config={path}", *arguments)()

    return run


def _ledger(*arguments: str) -> Callable[[], None]:
    def run() -> None:
        from nemo_noise_plugin.cli.nemo_noise import run_ledger

        run_ledger(list(arguments))

    return run


def _audit(*arguments: str) -> Callable[[], None]:
    def run() -> None:
        from nemo_noise_plugin.cli.nemo_noise import run_audit

        with tempfile.TemporaryDirectory() as folder:
            run_audit([*arguments, f"output_dir={folder}"])

    return run


def _audit_into(output_dir: str, *arguments: str) -> Callable[[], None]:
    def run() -> None:
        from nemo_noise_plugin.cli.nemo_noise import run_audit

        run_audit([*arguments, f"output_dir={output_dir}"])

    return run


def _preset(text: str, loader: str = "noise") -> Callable[[], None]:
    def run() -> None:
        from nemo_noise_plugin.distillation.config import load_kd_config
        from nemo_noise_plugin.noise.config import load_noise_config

        with tempfile.TemporaryDirectory() as folder:
            path = pathlib.Path(folder) / "preset.yaml"
            path.write_text(text)
            (load_noise_config if loader == "noise" else load_kd_config)(path)

    return run


def _preset_bytes(data: bytes) -> Callable[[], None]:
    def run() -> None:
        from nemo_noise_plugin.noise.config import load_noise_config

        with tempfile.TemporaryDirectory() as folder:
            path = pathlib.Path(folder) / "preset.yaml"
            path.write_bytes(data)
            load_noise_config(path)

    return run


NON_NUMBERS = (("abc", "'abc'"), (True, "True"), (None, "None"), (math.nan, "nan"), (math.inf, "inf"))


def _noise_cases() -> list[BadInput]:
    cases = []
    for field in ("alpha", "sigma", "quantization_step", "relative_scale", "eta", "delta", "min_factor"):
        for value, shown in (*NON_NUMBERS, (-1.0, "-1.0")):
            cases.append(BadInput("NoiseConfig", f"{field}={shown}", _noise(**{field: value}), (field, shown)))
    for field in ("clip_norm", "epsilon"):
        for value, shown in (("abc", "'abc'"), (0.0, "0.0"), (-2.0, "-2.0"), (math.nan, "nan")):
            cases.append(BadInput("NoiseConfig", f"{field}={shown}", _noise(**{field: value}), (field, shown)))
    for field in ("mechanism", "scaling", "tokens", "schedule", "calibration"):
        for value in ("bogus", 3):
            cases.append(BadInput("NoiseConfig", f"{field}={value!r}", _noise(**{field: value}), (field, repr(value))))
    for field in ("enabled", "training_only"):
        for value in ("yes", 1):
            cases.append(BadInput("NoiseConfig", f"{field}={value!r}", _noise(**{field: value}), (field, repr(value))))
    for field in ("seed", "warmup_steps", "decay_steps"):
        for value in (-1, 1.5, "3"):
            cases.append(BadInput("NoiseConfig", f"{field}={value!r}", _noise(**{field: value}), (field, repr(value))))
    cases += [
        BadInput("NoiseConfig", "seed=2**32", _noise(seed=2**32), ("seed", str(2**32))),
        BadInput("NoiseConfig", "special_token_ids=5", _noise(special_token_ids=5), ("special_token_ids", "5")),
        BadInput("NoiseConfig", "special_token_ids=[-1]", _noise(special_token_ids=[-1]), ("special_token_ids",)),
        BadInput("NoiseConfig", "special_token_ids=['a']", _noise(special_token_ids=["a"]), ("special_token_ids",)),
        BadInput(
            "NoiseConfig",
            "gaussian_mechanism without clip_norm",
            _noise(mechanism="gaussian_mechanism", epsilon=1.0),
            ("clip_norm", "gaussian_mechanism"),
        ),
        BadInput(
            "NoiseConfig",
            "gaussian_mechanism without epsilon",
            _noise(mechanism="gaussian_mechanism", clip_norm=1.0),
            ("epsilon", "gaussian_mechanism"),
        ),
        BadInput(
            "NoiseConfig",
            "classical calibration with epsilon 2",
            _noise(mechanism="gaussian_mechanism", clip_norm=1.0, epsilon=2.0, calibration="classical"),
            ("epsilon", "classical"),
        ),
        BadInput(
            "NoiseConfig",
            "cosine schedule without decay_steps",
            _noise(schedule="cosine"),
            ("decay_steps", "cosine"),
        ),
        BadInput(
            "NoiseConfig",
            "privacy mechanism with a warm-up",
            _noise(mechanism="metric_dp", warmup_steps=10),
            ("schedule", "metric_dp"),
        ),
    ]
    return cases


def _kd_cases() -> list[BadInput]:
    cases = []
    for field in ("temperature", "kd_weight", "ce_weight", "hidden_weight", "jsd_beta"):
        for value, shown in (*NON_NUMBERS, (-1.0, "-1.0")):
            cases.append(BadInput("KDConfig", f"{field}={shown}", _kd(**{field: value}), (field, shown)))
    cases += [
        BadInput("KDConfig", "temperature=0.0", _kd(temperature=0.0), ("temperature", "0.0")),
        BadInput("KDConfig", "jsd_beta=1.0", _kd(jsd_beta=1.0), ("jsd_beta", "1.0")),
        BadInput("KDConfig", "loss='kl'", _kd(loss="kl"), ("loss", "'kl'")),
        BadInput("KDConfig", "tokens='prompt'", _kd(tokens="prompt"), ("tokens", "'prompt'")),
        BadInput("KDConfig", "hidden_loss='l1'", _kd(hidden_loss="l1"), ("hidden_loss", "'l1'")),
        BadInput("KDConfig", "top_k=0", _kd(top_k=0), ("top_k", "0")),
        BadInput("KDConfig", "top_k=2.5", _kd(top_k=2.5), ("top_k", "2.5")),
        BadInput("KDConfig", "hidden_layers=[1, 1]", _kd(hidden_loss="mse", hidden_layers=[1, 1]), ("hidden_layers",)),
        BadInput("KDConfig", "hidden_loss='mse' without layers", _kd(hidden_loss="mse"), ("hidden_layers",)),
        BadInput("KDConfig", "all weights zero", _kd(ce_weight=0.0, kd_weight=0.0), ("kd_weight=0", "ce_weight=0")),
        BadInput("KDConfig", "enabled='no'", _kd(enabled="no"), ("enabled", "'no'")),
    ]
    return cases


def _main_job_cases() -> list[BadInput]:
    readme = str(REPO / "README.md")
    return [
        BadInput("python -m nemo_noise_plugin", "--steps 0", _main_job("--steps", "0"), ("--steps=0",)),
        BadInput("python -m nemo_noise_plugin", "--steps -3", _main_job("--steps", "-3"), ("--steps=-3",)),
        BadInput("python -m nemo_noise_plugin", "--steps abc", _main_job("--steps", "abc"), ("--steps", "abc")),
        BadInput(
            "python -m nemo_noise_plugin",
            "--clean-pretrain-steps -1",
            _main_job("--clean-pretrain-steps", "-1"),
            ("--clean-pretrain-steps=-1", ">= 0"),
        ),
        BadInput("python -m nemo_noise_plugin", "--lr nan", _main_job("--lr", "nan"), ("--lr=nan",)),
        BadInput("python -m nemo_noise_plugin", "--lr inf", _main_job("--lr", "inf"), ("--lr=inf",)),
        BadInput("python -m nemo_noise_plugin", "--lr 0", _main_job("--lr", "0"), ("--lr=0",)),
        BadInput("python -m nemo_noise_plugin", "--lr=-1e-3", _main_job("--lr=-1e-3"), ("--lr=-0.001",)),
        BadInput("python -m nemo_noise_plugin", "--alpha -1", _main_job("--alpha", "-1"), ("alpha", "-1.0")),
        BadInput("python -m nemo_noise_plugin", "--alpha nan", _main_job("--alpha", "nan"), ("alpha", "nan")),
        BadInput(
            "python -m nemo_noise_plugin",
            "--sigma -2",
            _main_job("--mechanism", "gaussian", "--sigma", "-2"),
            ("sigma", "-2.0"),
        ),
        BadInput(
            "python -m nemo_noise_plugin",
            "--sigma 3 with NEFTune",
            _main_job("--sigma", "3"),
            ("--sigma=3.0", "'uniform'", "alpha"),
        ),
        BadInput(
            "python -m nemo_noise_plugin",
            "--alpha 5 with gaussian",
            _main_job("--mechanism", "gaussian", "--alpha", "5"),
            ("--alpha=5.0", "'gaussian'", "sigma"),
        ),
        BadInput(
            "python -m nemo_noise_plugin",
            "--scaling with metric_dp",
            _main_job("--mechanism", "metric_dp", "--scaling", "absolute"),
            ("--scaling", "'metric_dp'"),
        ),
        BadInput(
            "python -m nemo_noise_plugin",
            "--mechanism cauchy",
            _main_job("--mechanism", "cauchy"),
            ("--mechanism", "cauchy"),
        ),
        BadInput(
            "python -m nemo_noise_plugin", "--scaling padded", _main_job("--scaling", "padded"), ("--scaling", "padded")
        ),
        BadInput("python -m nemo_noise_plugin", "--recipe nope", _main_job("--recipe", "nope"), ("--recipe", "nope")),
        BadInput("python -m nemo_noise_plugin", "--stop-after 0", _main_job("--stop-after", "0"), ("--stop-after=0",)),
        BadInput(
            "python -m nemo_noise_plugin",
            "--stop-after = --steps",
            _main_job("--steps", "5", "--stop-after", "5"),
            ("--stop-after=5",),
        ),
        BadInput(
            "python -m nemo_noise_plugin",
            "--output-dir README.md",
            _main_job("--output-dir", readme),
            ("--output-dir", "README.md", "a file"),
        ),
        BadInput("python -m nemo_noise_plugin", "--output-dir ''", _main_job("--output-dir", ""), ("--output-dir",)),
        BadInput(
            "python -m nemo_noise_plugin",
            "--output-dir under a file",
            _main_job("--output-dir", readme + "/run"),
            ("--output-dir", "cannot be written"),
        ),
        BadInput(
            "python -m nemo_noise_plugin",
            "--noise-config missing.yaml",
            _main_job("--noise-config", "missing.yaml"),
            ("--noise-config", "missing.yaml"),
        ),
        BadInput(
            "python -m nemo_noise_plugin",
            "--noise-config unknown preset name",
            _main_job("--noise-config", "neftune_alpha7"),
            ("neftune_alpha7", "available"),
        ),
        BadInput("python -m nemo_noise_plugin", "--seed -1", _main_job("--seed", "-1"), ("seed", "-1")),
        BadInput("python -m nemo_noise_plugin", "--seed 2**32", _main_job("--seed", str(2**32)), ("seed",)),
        BadInput(
            "python -m nemo_noise_plugin",
            "--noise-config empty.yaml",
            _main_job_noise_file("", "empty.yaml"),
            ("--noise-config", "empty.yaml", "the file is empty"),
        ),
        BadInput(
            "python -m nemo_noise_plugin",
            "--noise-config with a repeated key",
            _main_job_noise_file("alpha: 5\nalpha: 15\n", "noise.yaml"),
            ("--noise-config", "noise.yaml", "line 2", "duplicate key 'alpha'"),
        ),
        BadInput("python -m nemo_noise_plugin", "unknown option --stpes", _main_job("--stpes", "3"), ("--stpes",)),
    ]


def _finetune_cases() -> list[BadInput]:
    surface = "nemo llm finetune (overrides)"
    cases = [
        BadInput(surface, "model.noise.alpha=-1", _finetune("model.noise.alpha=-1"), ("model.noise.alpha=-1",)),
        BadInput(surface, "model.noise.alpha=abc", _finetune("model.noise.alpha=abc"), ("model.noise.alpha",)),
        BadInput(surface, "model.noise.alpha=1e30", _finetune("model.noise.alpha=1e30"), ("alpha=1e+30", "inf")),
        BadInput(surface, "model.noise.alpah=3", _finetune("model.noise.alpah=3"), ("model.noise.alpah",)),
        BadInput(surface, "model.num_layers=0", _finetune("model.num_layers=0"), ("model.num_layers=0", ">= 1")),
        BadInput(surface, "dataset.seq_length=-4", _finetune("dataset.seq_length=-4"), ("dataset.seq_length=-4",)),
        BadInput(
            surface,
            "model.noise.mechanism=cauchy",
            _finetune("model.noise.mechanism=cauchy"),
            ("model.noise.mechanism", "cauchy"),
        ),
        BadInput(surface, "model.noise=5", _finetune("model.noise=5"), ("model.noise",)),
        BadInput(
            surface,
            "model.noise.special_token_ids=5",
            _finetune("model.noise.special_token_ids=5"),
            ("special_token_ids", "5"),
        ),
        BadInput(surface, "model.kd.temperature=0", _finetune("model.kd.temperature=0"), ("model.kd.temperature",)),
        BadInput(surface, "model.kd.loss=kl", _finetune("model.kd.loss=kl"), ("model.kd.loss", "kl")),
        BadInput(
            surface,
            "model.kd.hidden_layers=[9]",
            _finetune("model.kd.hidden_loss=mse", "model.kd.hidden_layers=[9]", "model.kd.hidden_weight=1"),
            ("hidden_layers", "9"),
        ),
        BadInput(
            surface,
            "model.pipeline_model_parallel_size=abc",
            _finetune("model.pipeline_model_parallel_size=abc"),
            ("pipeline_model_parallel_size",),
        ),
        BadInput(surface, "train.train_iters=0", _finetune("train.train_iters=0"), ("train.train_iters=0",)),
        BadInput(surface, "train.train_iters=-5", _finetune("train.train_iters=-5"), ("train.train_iters=-5",)),
        BadInput(surface, "train.itres=3 (typo)", _finetune("+train.itres=3"), ("train.itres",)),
        BadInput(surface, "optimizer.lr=nan", _finetune("optimizer.lr=nan"), ("optimizer.lr",)),
        BadInput(surface, "optimizer.lr=-1", _finetune("optimizer.lr=-1"), ("optimizer.lr",)),
        BadInput(
            surface,
            "~model.noise.clip_norm (already null)",
            _finetune("~model.noise.clip_norm"),
            ("model.noise.clip_norm",),
        ),
        BadInput(surface, "an option among overrides", _finetune("--dry-run"), ("--dry-run",)),
        BadInput(surface, "a bare word", _finetune("alpha"), ("alpha",)),
        BadInput(
            "nemo llm finetune --config-file",
            "YAML syntax error",
            _finetune(config_file_text="model: [1, 2\n"),
            ("not valid YAML",),
        ),
        BadInput(
            "nemo llm finetune --config-file",
            "a list, not a mapping",
            _finetune(config_file_text="- 1\n"),
            ("mapping",),
        ),
        BadInput(
            "nemo llm finetune --config-file",
            "an integer key",
            _finetune(config_file_text="1: 2\n"),
            ("field names", "1"),
        ),
        BadInput(
            "nemo llm finetune --config-file",
            "unknown field",
            _finetune(config_file_text="model:\n  noise:\n    alpah: 3\n"),
            ("model.noise.alpah",),
        ),
        BadInput(
            "nemo llm finetune --config-file",
            "invalid value",
            _finetune(config_file_text="model:\n  kd:\n    temperature: -1\n"),
            ("model.kd.temperature",),
        ),
        BadInput(
            "nemo llm finetune --config-file",
            "another provider class",
            _finetune(config_file_text="model:\n  _target_: megatron.bridge.models.gpt_provider.GPTModelProvider\n"),
            ("model._target_", "GPTModelProvider"),
        ),
        BadInput(
            "nemo llm finetune --config-file",
            "an empty file",
            _finetune(config_file_text="# nothing yet\n"),
            ("run.yaml", "the file is empty"),
        ),
        BadInput(
            "nemo llm finetune --config-file",
            "a repeated key",
            _finetune(config_file_text="train:\n  train_iters: 5\n  train_iters: 50\n"),
            ("run.yaml", "line 3", "duplicate key 'train_iters'"),
        ),
    ]
    return cases


LEPTON = (
    "executor=lepton",
    "executor.container_image=nvcr.io/nvidia/nemo:25.11",
    "executor.resource_shape=gpu.8xh100-80gb",
    "executor.node_group=my-nodes",
)
DGXCLOUD = (
    "executor=dgxcloud",
    "executor.container_image=nvcr.io/nvidia/nemo:25.11",
    "executor.base_url=https://dgx.example/api/v1",
    "executor.kube_apiserver_url=https://k8s.example",
    "executor.client_id=me",
    "executor.client_secret=secret",
    "executor.project_name=noise",
)


def _executor_cases() -> list[BadInput]:
    surface = "nemo llm finetune executor="
    mounts = 'executor.mounts=[{"path": "/shared", "mount_path": "/shared"}]'
    pvcs = 'executor.pvcs=[{"name": "ws", "path": "/workspace", "claimName": "ws-pvc"}]'
    cases = [
        ("executor=lokal", ["executor=lokal"], ("lokal", "local, slurm")),
        ("executor= (no name)", ["executor="], ("executor=", "local")),
        ("executor.nodes=2 without executor=", ["executor.nodes=2"], ("executor.nodes=2", "executor=NAME")),
        ("executor.env_vars (no value)", ["executor=local", "executor.env_vars"], ("executor.env_vars", "KEY=VALUE")),
        ("plugins=nsys", ["plugins=nsys"], ("plugins=nsys", "executor.KEY=VALUE")),
        ("local: ntask_per_node (typo)", ["executor=local", "executor.ntask_per_node=2"], ("ntasks_per_node",)),
        ("local: ntasks_per_node=two", ["executor=local", "executor.ntasks_per_node=two"], ("two", "whole number")),
        ("local: ntasks_per_node=0", ["executor=local", "executor.ntasks_per_node=0"], ("ntasks_per_node=0", ">= 1")),
        ("local: nodes=2", ["executor=local", "executor.nodes=2"], ("executor.nodes=2", "executor=slurm")),
        ("slurm: no account", ["executor=slurm"], ("executor.account", "required")),
        (
            "slurm: 4 ranks on 8 GPUs",
            ["executor=slurm", "executor.account=a", "executor.ntasks_per_node=4"],
            ("ntasks_per_node=4", "gpus_per_node=8"),
        ),
        (
            "slurm: 3 ranks for TP=2",
            [
                "executor=slurm",
                "executor.account=a",
                "executor.gpus_per_node=3",
                "executor.ntasks_per_node=3",
                "model.tensor_model_parallel_size=2",
            ],
            ("3 ranks", "tensor_model_parallel_size=2", "multiple of 2"),
        ),
        ("docker: no image", ["executor=docker"], ("executor.container_image", "required")),
        (
            "docker: 4 GPUs, 8 ranks",
            ["executor=docker", "executor.container_image=i", "executor.num_gpus=4"],
            ("ntasks_per_node=8", "num_gpus=4"),
        ),
        (
            "docker: volumes=abc",
            ["executor=docker", "executor.container_image=i", "executor.volumes=abc"],
            ("executor.volumes='abc'", "list[str]"),
        ),
        ("lepton: no image, no folder", ["executor=lepton"], ("executor.container_image", "executor.nemo_run_dir")),
        (
            "lepton: no resource shape",
            ["executor=lepton", "executor.container_image=i", "executor.nemo_run_dir=/shared/nemo_run", mounts],
            ("executor.resource_shape", "required"),
        ),
        (
            "lepton: folder not mounted",
            [*LEPTON, mounts, "executor.nemo_run_dir=/scratch/nemo_run"],
            ("executor.nemo_run_dir='/scratch/nemo_run'", "mount_path", "/shared"),
        ),
        (
            "lepton: mount without mount_path",
            [*LEPTON, 'executor.mounts=[{"path": "/shared"}]', "executor.nemo_run_dir=/shared/nemo_run"],
            ("executor.mounts", "mount_path"),
        ),
        (
            "lepton: 4 ranks on 8 GPUs",
            [*LEPTON, mounts, "executor.nemo_run_dir=/shared/nemo_run", "executor.nprocs_per_node=4"],
            ("nprocs_per_node=4", "gpus_per_node=8"),
        ),
        ("dgxcloud: nothing set", ["executor=dgxcloud"], ("executor.base_url", "executor.pvc_nemo_run_dir")),
        (
            "dgxcloud: folder not on a PVC",
            [*DGXCLOUD, pvcs, "executor.pvc_nemo_run_dir=/scratch/nemo_run"],
            ("executor.pvc_nemo_run_dir='/scratch/nemo_run'", "/workspace"),
        ),
        (
            "dgxcloud: nodes=0",
            [*DGXCLOUD, pvcs, "executor.pvc_nemo_run_dir=/workspace/nemo_run", "executor.nodes=0"],
            ("executor.nodes=0", ">= 1"),
        ),
    ]
    return [BadInput(surface, text, _executor(*arguments), words) for text, arguments, words in cases]


def _ledger_cases() -> list[BadInput]:
    surface = "nemo noise ledger"
    preset = "config=dp_gaussian_mechanism"
    return [
        BadInput(surface, "no arguments", _ledger(), ("config", "sequence_length")),
        BadInput(surface, "no sequence_length", _ledger(preset), ("sequence_length",)),
        BadInput(surface, "sequence_length=0", _ledger(preset, "sequence_length=0"), ("sequence_length=0",)),
        BadInput(surface, "sequence_length=abc", _ledger(preset, "sequence_length=abc"), ("sequence_length",)),
        BadInput(surface, "epochs=0", _ledger(preset, "sequence_length=8", "epochs=0"), ("epochs=0",)),
        BadInput(surface, "epochs=1.5", _ledger(preset, "sequence_length=8", "epochs=1.5"), ("epochs=1.5",)),
        BadInput(surface, "delta=2", _ledger(preset, "sequence_length=8", "delta=2"), ("delta",)),
        BadInput(surface, "hidden_size=0", _ledger(preset, "sequence_length=8", "hidden_size=0"), ("hidden_size",)),
        BadInput(surface, "unknown key", _ledger(preset, "sequence_length=8", "epsilom=4"), ("epsilom",)),
        BadInput(surface, "not key=value", _ledger(preset, "sequence_length"), ("sequence_length",)),
        BadInput(surface, "missing preset", _ledger("config=nope", "sequence_length=8"), ("nope", "available")),
        BadInput(
            surface,
            "missing file",
            _ledger("config=/nonexistent/x.yaml", "sequence_length=8"),
            ("/nonexistent/x.yaml",),
        ),
        BadInput(
            surface,
            "override breaks the config",
            _ledger(preset, "sequence_length=8", "clip_norm=null"),
            ("clip_norm",),
        ),
        BadInput(surface, "epsilon=-1", _ledger(preset, "sequence_length=8", "epsilon=-1"), ("epsilon",)),
        BadInput(
            surface,
            "a value that is not YAML",
            _ledger(preset, "sequence_length=8", "special_token_ids=[1, 2"),
            ("special_token_ids=[1, 2", "not valid YAML"),
        ),
        BadInput(surface, "an empty config file", _ledger_file("", "sequence_length=8"), ("noise.yaml", "empty")),
    ]


def _audit_cases() -> list[BadInput]:
    surface = "nemo noise audit"
    return [
        BadInput(surface, "model=gpt5", _audit("model=gpt5", "sweep=alpha:1"), ("model='gpt5'", "tiny, smollm2")),
        BadInput(surface, "no sweep", _audit("model=tiny"), ("sweep",)),
        BadInput(surface, "sweep=alpha:1,x", _audit("model=tiny", "sweep=alpha:1,x"), ("field:level",)),
        BadInput(surface, "sweep field of another mechanism", _audit("model=tiny", "sweep=eta:1"), ("eta", "alpha")),
        BadInput(surface, "tokens=many", _audit("model=tiny", "sweep=alpha:1", "tokens=many"), ("tokens='many'",)),
        BadInput(surface, "sweep=alpha: (no levels)", _audit("model=tiny", "sweep=alpha:"), ("sweep='alpha:'",)),
        BadInput(
            surface,
            "output_dir where no folder can be made",
            _audit_into("/proc/nope", "model=tiny", "sweep=alpha:1"),
            ("output_dir='/proc/nope'", "cannot be written"),
        ),
        BadInput(surface, "attacks=nn_l3", _audit("model=tiny", "sweep=alpha:1", "attacks=nn_l3"), ("nn_l3",)),
        BadInput(surface, "a sweep level twice", _audit("model=tiny", "sweep=alpha:1,5,1"), ("uniform/alpha:1",)),
        BadInput(
            surface, "an attack twice", _audit("model=tiny", "sweep=alpha:1", "attacks=nn_l2,nn_l2"), ("nn_l2 is",)
        ),
        BadInput(surface, "unknown key", _audit("model=tiny", "sweep=alpha:1", "tokenz=5"), ("tokenz",)),
        BadInput(
            surface,
            "hf_dir with model=tiny",
            _audit("model=tiny", "sweep=alpha:1", "hf_dir=/tmp"),
            ("hf_dir", "smollm2"),
        ),
        BadInput(
            surface,
            "hf_dir that is not an HF folder",
            _audit("model=smollm2", "sweep=alpha:1", "hf_dir=/nonexistent/hf"),
            ("hf_dir='/nonexistent/hf'", "config.json"),
        ),
    ]


def _preset_cases() -> list[BadInput]:
    return [
        BadInput("load_noise_config (YAML)", "syntax error", _preset("alpha: [1, 2\n"), ("not valid YAML",)),
        BadInput("load_noise_config (YAML)", "a list", _preset("- 1\n"), ("mapping", "list")),
        BadInput("load_noise_config (YAML)", "an integer key", _preset("5: 1\n"), ("unknown NoiseConfig field", "5")),
        BadInput("load_noise_config (YAML)", "unknown field", _preset("alpah: 3\n"), ("alpah",)),
        BadInput(
            "load_noise_config (YAML)",
            "special_token_ids: 5",
            _preset("special_token_ids: 5\n"),
            ("special_token_ids", "5"),
        ),
        BadInput("load_noise_config (YAML)", "alpha: -1", _preset("alpha: -1\n"), ("alpha", "-1")),
        BadInput("load_noise_config (YAML)", "alpha: .nan", _preset("alpha: .nan\n"), ("alpha", "nan")),
        BadInput("load_noise_config (YAML)", "mechanism: cauchy", _preset("mechanism: cauchy\n"), ("mechanism",)),
        BadInput("load_kd_config (YAML)", "temperature: 0", _preset("temperature: 0\n", "kd"), ("temperature",)),
        BadInput("load_kd_config (YAML)", "unknown field", _preset("temprature: 2\n", "kd"), ("temprature",)),
        BadInput("load_kd_config (YAML)", "syntax error", _preset("loss: [\n", "kd"), ("not valid YAML",)),
        BadInput("load_noise_config (YAML)", "an empty file", _preset(""), ("preset.yaml", "the file is empty")),
        BadInput(
            "load_noise_config (YAML)", "only comments", _preset("# alpha: 5\n"), ("preset.yaml", "the file is empty")
        ),
        BadInput(
            "load_noise_config (YAML)",
            "a repeated key",
            _preset("alpha: 5\nalpha: 15\n"),
            ("preset.yaml", "line 2", "duplicate key 'alpha'", "first set on line 1"),
        ),
        BadInput(
            "load_noise_config (YAML)",
            "a binary file",
            _preset_bytes(b"\x89PNG\r\n\x1a\n"),
            ("preset.yaml", "not a text file"),
        ),
        BadInput("load_kd_config (YAML)", "an empty file", _preset("\n", "kd"), ("preset.yaml", "the file is empty")),
    ]


def all_cases() -> list[BadInput]:
    """Every catalogued bad input."""
    return [
        *_noise_cases(),
        *_kd_cases(),
        *_main_job_cases(),
        *_finetune_cases(),
        *_executor_cases(),
        *_ledger_cases(),
        *_audit_cases(),
        *_preset_cases(),
    ]
