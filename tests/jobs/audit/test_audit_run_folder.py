"""``nemo noise audit run=<training run folder>`` and ``data=``: the run's own noise and level, the run's data or the
user's JSONL or a uniform vocabulary sample, the distinct ids counted, and bad arguments named before any model loads.

A tiny Llama (the SmolLM2 architecture: 1 layer, h=32) with the tiny chat tokenizer of ``tests.support.chat_sft``
stands in for a run's ``reports/latest/hf`` export, so everything runs on the CPU in seconds.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from nemo_noise_plugin.cli.nemo_noise import audit as audit_command
from nemo_noise_plugin.cli.nemo_noise import run_audit
from nemo_noise_plugin.data.instruction_set import instruction_examples, instruction_files
from nemo_noise_plugin.jobs.audit import data as audit_sources
from nemo_noise_plugin.jobs.audit import report as audit_report
from nemo_noise_plugin.jobs.audit.run_folder import read_run_folder
from nemo_noise_plugin.jobs.audit.settings import parse_audit_arguments
from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.privacy.audit.sweep import Sweep
from nemo_noise_plugin.privacy.ledger import privacy_ledger
from tests.support.chat_sft import VOCAB_SIZE, write_chat_tokenizer

RUN_NOISE = NoiseConfig(mechanism="gaussian_mechanism", epsilon=50.0, clip_norm=1.0)
SEQ_LENGTH, EPOCHS = 128, 2
SPECIAL_IDS = (0, 1, 2)


@pytest.fixture(scope="module")
def hf_export(tmp_path_factory) -> Path:
    """A Hugging Face folder of the SmolLM2 architecture (Llama, tied embeddings), tiny and random."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("export") / "hf"
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    write_chat_tokenizer(folder)
    return folder


def make_run(
    root: Path, hf_export: Path, *, report_run: dict | None = "default", checkpoint: str | None = None
) -> Path:
    """A run folder laid out as the SmolLM2 recipes and the main job leave it: data/, reports/<id>/ (latest)."""
    run = root / "smollm2_135m_noise_sft"
    report = run / "reports" / "20261201-000000-1"
    shutil.copytree(hf_export, report / "hf")
    (run / "reports" / "latest").symlink_to(report.name)
    saved = {"noise": dataclasses.asdict(RUN_NOISE), "seq_length": SEQ_LENGTH, "epochs": EPOCHS}
    task_report = {"after": {"exact_match": 0.0}, **({"run": saved} if report_run == "default" else {})}
    (report / "task_report.json").write_text(json.dumps(task_report))
    (run / "data").mkdir()
    for split in ("training", "validation"):
        lines = instruction_files()[split].read_text().splitlines()[:200]
        (run / "data" / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    if checkpoint is not None:
        (run / "checkpoints" / "iter_0000004").mkdir(parents=True)
        (run / "checkpoints" / "iter_0000004" / "run_config.yaml").write_text(checkpoint)
    return run


@pytest.fixture
def run_folder(tmp_path, hf_export) -> Path:
    return make_run(tmp_path, hf_export)


def read_report(folder: Path) -> dict:
    return json.loads((folder / "privacy_audit.json").read_text())


# --- the run's own noise -------------------------------------------------------------------------------------------


def test_run_gives_the_audit_the_runs_own_mechanism_and_level(run_folder, tmp_path):
    settings = parse_audit_arguments([f"run={run_folder}", f"output_dir={tmp_path / 'out'}"])
    assert settings["sweeps"] == [Sweep("gaussian_mechanism", "epsilon", (50.0,))]
    config = settings["config"]
    assert (config.mechanism, config.epsilon, config.clip_norm) == ("gaussian_mechanism", 50.0, 1.0)
    # the full level at inference, noised in eval mode
    assert (config.warmup_steps, config.schedule, config.training_only) == (0, "constant", False)
    trained = settings["run"]
    assert trained.hf_dir == run_folder / "reports" / "latest" / "hf" and trained.noise == RUN_NOISE
    assert (trained.sequence_length, trained.epochs) == (SEQ_LENGTH, EPOCHS)
    assert trained.training_data == run_folder / "data" / "training.jsonl"
    assert not (tmp_path / "out").exists()  # parsing writes nothing


def test_a_sweep_or_a_field_overrides_the_runs_level(run_folder, tmp_path):
    swept = parse_audit_arguments([f"run={run_folder}", "sweep=epsilon:10,300", f"output_dir={tmp_path}"])
    assert swept["sweeps"] == [Sweep("gaussian_mechanism", "epsilon", (10.0, 300.0))]
    assert swept["config"].clip_norm == 1.0
    field = parse_audit_arguments([f"run={run_folder}", "epsilon=20", "clip_norm=2", f"output_dir={tmp_path}"])
    assert field["sweeps"] == [Sweep("gaussian_mechanism", "epsilon", (20.0,))] and field["config"].clip_norm == 2.0


def test_without_a_task_report_the_noise_is_read_from_the_bridge_checkpoint(tmp_path, hf_export):
    checkpoint = (
        "model:\n  seq_length: 256\n  noise:\n    _target_: nemo_noise_plugin.noise.config.NoiseConfig\n"
        "    mechanism: metric_dp\n    eta: 300.0\n    clip_norm: 2.0\n"
        "dataset:\n  seq_length: 96\ntrain:\n  train_iters: 100\n  global_batch_size: 8\n"
    )
    run = make_run(tmp_path, hf_export, report_run=None, checkpoint=checkpoint)
    trained = read_run_folder(str(run))
    assert (trained.noise.mechanism, trained.noise.eta, trained.noise.clip_norm) == ("metric_dp", 300.0, 2.0)
    assert trained.noise_source.endswith("checkpoints/iter_0000004/run_config.yaml")
    assert trained.sequence_length == 96  # the dataset's sequence length, not the model's
    assert trained.epochs == 4  # ceil(100 steps * 8 / 200 training examples)


def test_run_audits_the_trained_export_on_its_training_data_with_exact_match_and_its_ledger(run_folder, tmp_path):
    out = tmp_path / "out"
    run_audit([f"run={run_folder}", "tokens=300", "task_sequences=4", "neighbour_sample=128", f"output_dir={out}"])
    report = read_report(out)
    assert [(row["mechanism"], row["level"], row["attack"]) for row in report["rows"]] == [
        ("gaussian_mechanism", 50.0, "nn_l2"),
        ("gaussian_mechanism", 50.0, "nn_cosine"),
    ]
    assert report["table_shape"] == [VOCAB_SIZE, 32] and report["tokens"] == 300
    assert report["data"].startswith(str(run_folder / "data" / "training.jsonl"))
    assert report["run"]["folder"] == str(run_folder) and report["run"]["noise"]["epsilon"] == 50.0
    row = report["rows"][0]
    ledger = privacy_ledger(NoiseConfig(**row["noise_config"]), sequence_length=SEQ_LENGTH, epochs=EPOCHS)
    assert row["per_token_epsilon"] == 50.0
    assert row["per_sequence_epsilon"] == pytest.approx(ledger.per_sequence[0].epsilon)
    assert (row["ledger"]["sequence_length"], row["ledger"]["epochs"]) == (SEQ_LENGTH, EPOCHS)
    assert 0.0 <= row["task_exact_match"] <= 1.0 and 0.0 <= report["clean_task_exact_match"] <= 1.0
    # the noise is the run's: epsilon 50 at clip 1 is |z| ~ 15 neighbour distances on this table, recovery ~ chance
    assert row["noise_to_neighbour_distance"] > 5 and row["recovery"]["overall"]["rate"] < 0.05


# --- what is audited -----------------------------------------------------------------------------------------------


def audit_data(hf_export: Path, out: Path, data: str, tokens: int = 300) -> dict:
    run_audit(
        [
            "model=smollm2",
            f"hf_dir={hf_export}",
            f"data={data}",
            f"tokens={tokens}",
            "task_loss=false",
            "task_sequences=4",
            "mechanism=uniform",
            "sweep=alpha:0",
            f"output_dir={out}",
        ]
    )
    return read_report(out)


def test_uniform_data_audits_many_more_distinct_ids_than_the_validation_chats(hf_export, tmp_path):
    validation = audit_data(hf_export, tmp_path / "validation", "validation")
    uniform = audit_data(hf_export, tmp_path / "uniform", "uniform")
    assert validation["tokens"] == uniform["tokens"] == 300
    assert uniform["distinct_ids"] == 300  # drawn without replacement from the 381 non-special ids
    assert validation["distinct_ids"] < 150  # chat text repeats its markers and its few words
    assert "uniform sample" in uniform["data"] and "validation chats" in validation["data"]
    first_line = (tmp_path / "uniform" / "privacy_audit.txt").read_text().splitlines()[0]
    assert first_line.startswith("tokens 300 (300 distinct ids) from a seeded uniform sample")


def test_the_uniform_sample_is_seeded_and_leaves_out_the_special_ids():
    eligible = [i for i in range(VOCAB_SIZE) if i not in SPECIAL_IDS]
    first = audit_sources.uniform_sequences(eligible, 500, 64)
    assert first == audit_sources.uniform_sequences(eligible, 500, 64)
    ids = [token for row in first for token in row]
    assert len(ids) == 500 and not set(ids) & set(SPECIAL_IDS)
    assert len(set(ids[: len(eligible)])) == len(eligible)  # every id once before any repeats


def test_a_users_jsonl_of_chats_inputs_and_texts_is_audited(hf_export, tmp_path):
    from transformers import AutoTokenizer

    rows = [
        instruction_examples("test")[0],
        {"input": "What is 12 plus 30?", "output": "42"},
        {"text": "zebra quartz jumps over the lazy fox"},
    ]
    data = tmp_path / "mine.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    report = audit_data(hf_export, tmp_path / "out", str(data), tokens=40)
    tokenizer = AutoTokenizer.from_pretrained(str(hf_export))
    texts = [
        tokenizer.apply_chat_template(rows[0]["messages"], tokenize=False),
        "What is 12 plus 30? 42",
        rows[2]["text"],
    ]
    ids = [token for text in texts for token in tokenizer(text, add_special_tokens=False)["input_ids"][:64]][:40]
    assert report["tokens"] == 40 and report["distinct_ids"] == len(set(ids))
    assert report["data"] == f"{data} (3 rows)"
    assert report["rows"][0]["recovery"]["overall"]["rate"] == 1.0  # alpha 0: every token recovered


# --- bad arguments: one line, before any model ---------------------------------------------------------------------


@pytest.fixture
def no_model(monkeypatch):
    """Loading any audit model fails the test: the argument errors must come first."""

    def must_not_load(*args, **kwargs):
        raise AssertionError("a model was loaded before the arguments were checked")

    monkeypatch.setattr(audit_report, "smollm2_target", must_not_load)
    monkeypatch.setattr(audit_report, "tiny_target", must_not_load)


def bad_argument_cases(tmp_path: Path, run_folder: Path) -> list[tuple[list[str], str]]:
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    bad_rows = tmp_path / "bad.jsonl"
    bad_rows.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n{"prompt": "no"}\n')
    empty_run = tmp_path / "empty_run"
    empty_run.mkdir()
    base = ["model=tiny", "sweep=alpha:1"]
    return [
        ([*base, "tokens=0", "output_dir=o"], "tokens=0 is invalid: expected an integer >= 1 and <= 1000000"),
        ([*base, "tokens=-5", "output_dir=o"], "tokens=-5 is invalid: expected an integer >= 1 and <= 1000000"),
        ([*base, "tokens=2.5", "output_dir=o"], "tokens=2.5 is invalid: expected an integer"),
        ([*base, "max_length=0", "output_dir=o"], "max_length=0 is invalid"),
        ([*base, f"output_dir={a_file}"], "output_dir=.* is invalid: it is a file"),
        (
            [*base, f"output_dir={a_file}/sub"],
            r"output_dir=.* is invalid: the folder cannot be written \(Not a directory\)",
        ),
        ([*base, "data=mine.jsonl", "output_dir=o"], "data='mine.jsonl' is invalid with model=tiny"),
        (["model=smollm2", "sweep=alpha:1", "data=/no/such.jsonl", "output_dir=o"], "no such file"),
        (["model=smollm2", "sweep=alpha:1", f"data={bad_rows}", "output_dir=o"], "is invalid at line 2"),
        (["run=/no/such/run", "output_dir=o"], "run='/no/such/run' is invalid: no such folder"),
        ([f"run={empty_run}", "output_dir=o"], "expected its trained model's Hugging Face export in reports/latest/hf"),
        ([f"run={run_folder}", "config=neftune_alpha5", "output_dir=o"], "config='neftune_alpha5' cannot be combined"),
        ([f"run={run_folder}", "model=tiny", "output_dir=o"], "model='tiny' is invalid with run="),
        ([f"run={run_folder}", "attacks=nn_l3", "output_dir=o"], "attacks='nn_l3' is invalid"),
    ]


def test_bad_arguments_are_named_before_any_model_is_loaded_or_file_written(tmp_path, run_folder, no_model):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    for arguments, message in bad_argument_cases(tmp_path, run_folder):
        with pytest.raises(ValueError, match=message):
            run_audit(arguments)
    assert not (Path.cwd() / "o").exists()


def test_a_run_folder_without_a_noise_config_names_what_was_expected(tmp_path, hf_export, no_model):
    run = make_run(tmp_path, hf_export, report_run=None)
    with pytest.raises(ValueError, match="no noise config found; expected reports/latest/task_report.json"):
        run_audit([f"run={run}", f"output_dir={tmp_path / 'out'}"])


def test_a_run_trained_without_noise_needs_a_sweep(tmp_path, hf_export, no_model):
    run = make_run(tmp_path, hf_export)
    task_report = run / "reports" / "latest" / "task_report.json"
    saved = json.loads(task_report.read_text())
    saved["run"]["noise"]["enabled"] = False
    task_report.write_text(json.dumps(saved))
    with pytest.raises(ValueError, match="trained without noise .*give sweep="):
        run_audit([f"run={run}", f"output_dir={tmp_path / 'out'}"])


def test_the_command_reports_a_bad_argument_in_one_line_with_exit_status_2(tmp_path, capsys, no_model):
    with pytest.raises(SystemExit) as exit_:
        audit_command.cli_entrypoint._execute_simple(["model=tiny", "sweep=alpha:1", "tokens=0", "output_dir=o"], None)
    assert exit_.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert error == [
        "Error: tokens=0 is invalid: expected an integer >= 1 and <= 1000000 (a real audit needs far fewer; more "
        "would only exhaust memory or time)."
    ]
