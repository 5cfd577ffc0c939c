"""``nemo noise audit run=<span run>``: a run trained with ``NoiseConfig.tokens='spans'`` is audited on its private
spans only (its own data and canaries, masks as training builds them), with the ledger's epsilon per span, and a
span run without span data is refused in one line before any model loads.

The run folder holds a tiny Llama export (the SmolLM2 architecture) with the tiny chat tokenizer of
``tests.support.chat_sft``, and the shipped ``support`` family's chats (three private spans each: name, address,
account), so everything runs on the CPU in seconds. The expected span tokens are counted here independently of the
plugin's mapping: a token is private when its character offsets in the rendered chat overlap a span's characters.
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
from nemo_noise_plugin.data.instruction_set import instruction_files
from nemo_noise_plugin.data.tasks.shipped import task_examples, task_files
from nemo_noise_plugin.jobs.audit import report as audit_report
from nemo_noise_plugin.jobs.audit.run_folder import read_run_folder
from nemo_noise_plugin.jobs.audit.settings import parse_audit_arguments
from nemo_noise_plugin.jobs.audit.spans import span_sources
from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.privacy.span_ledger import span_ledger
from nemo_noise_plugin.validation import SettingError
from tests.support.chat_sft import VOCAB_SIZE, write_chat_tokenizer

SPAN_NOISE = NoiseConfig(mechanism="gaussian_mechanism", epsilon=2.0, clip_norm=1.0, tokens="spans")
SEQ_LENGTH, EPOCHS, TRAINING_CHATS, VALIDATION_CHATS, CANARIES = 512, 2, 40, 6, 6


@pytest.fixture(scope="module")
def hf_export(tmp_path_factory) -> Path:
    """A Hugging Face folder of the SmolLM2 architecture (Llama, tied embeddings), tiny and random."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("span_export") / "hf"
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=SEQ_LENGTH,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    write_chat_tokenizer(folder)
    return folder


def make_span_run(root: Path, hf_export: Path, *, training: list[str], validation: Path | list[str]) -> Path:
    """A run folder as the span recipe leaves it: data/ (its family's files), reports/latest/{hf,task_report.json}."""
    run = root / "smollm2_135m_private_span_sft"
    report = run / "reports" / "20261203-000000-1"
    shutil.copytree(hf_export, report / "hf")
    (run / "reports" / "latest").symlink_to(report.name)
    saved = {"noise": dataclasses.asdict(SPAN_NOISE), "seq_length": SEQ_LENGTH, "epochs": EPOCHS}
    (report / "task_report.json").write_text(json.dumps({"after": {"exact_match": 0.0}, "run": saved}))
    (run / "data").mkdir()
    (run / "data" / "training.jsonl").write_text("\n".join(training) + "\n")
    if isinstance(validation, Path):
        shutil.copyfile(validation, run / "data" / "validation.jsonl")
    else:
        (run / "data" / "validation.jsonl").write_text("\n".join(validation) + "\n")
    return run


@pytest.fixture
def span_run(tmp_path, hf_export) -> Path:
    """A support-family run: its first training and validation chats."""
    training = task_files("support")["training"].read_text().splitlines()[:TRAINING_CHATS]
    validation = task_files("support")["validation"].read_text().splitlines()[:VALIDATION_CHATS]
    return make_span_run(tmp_path, hf_export, training=training, validation=validation)


def span_token_counts_by_offsets(tokenizer, example: dict) -> list[int]:
    """Per span of ``example``, the tokens of its rendered chat whose characters overlap the span's."""
    rendered = tokenizer.apply_chat_template(example["messages"], tokenize=False)
    offsets = tokenizer(rendered, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    counts = []
    for span in example["private_spans"]:
        content = example["messages"][span["message"]]["content"]
        first = rendered.index("user\n" + content) + len("user\n")
        low, high = first + span["start"], first + span["end"]
        counts.append(sum(1 for begin, end in offsets if end > begin and begin < high and end > low))
    return counts


def read_report(folder: Path) -> dict:
    return json.loads((folder / "privacy_audit.json").read_text())


def test_a_span_run_attacks_only_its_span_tokens_and_its_canaries(span_run, hf_export, tmp_path, capsys):
    from transformers import AutoTokenizer

    canary_lines = task_files("support")["canaries"].read_text().splitlines()[:CANARIES]
    (span_run / "data" / "canaries.jsonl").write_text("\n".join(canary_lines) + "\n")  # the run's own canaries
    out = tmp_path / "out"
    run_audit(
        [
            f"run={span_run}",
            "tokens=150",
            "task_sequences=4",
            "neighbour_sample=128",
            f"output_dir={out}",
        ]
    )
    report = read_report(out)
    tokenizer = AutoTokenizer.from_pretrained(str(hf_export))
    # the training chats in order until their span tokens reach tokens=150, every span token counted once
    spans, total = [], 0
    for example in task_examples("support", "training")[:TRAINING_CHATS]:
        spans.append(span_token_counts_by_offsets(tokenizer, example))
        total += sum(spans[-1])
        if total >= 150:
            break
    assert report["tokens"] == total == report["protected"]["span_tokens"]
    assert (report["protected"]["spans"], report["protected"]["chats"]) == (sum(map(len, spans)), len(spans))
    rendered = [tokenizer.apply_chat_template(e["messages"], tokenize=False) for e in task_examples("support")]
    assert total < 0.4 * sum(len(tokenizer(text)["input_ids"]) for text in rendered[: len(spans)])  # not the prompt
    assert [row["attack"] for row in report["rows"]] == ["nn_l2", "nn_cosine"]
    for row in report["rows"]:
        assert row["recovery"]["overall"]["total"] == total
        # epsilon 2 at clip 1 hides the span tokens; counting the clean prompt tokens would give > 60 %
        assert row["recovery"]["overall"]["rate"] < 0.2
        assert NoiseConfig(**row["noise_config"]).tokens == "spans"
    # the ledger per span: n tokens of a span, E = 2 epochs, composed as privacy.span_ledger composes them
    ledger = report["rows"][0]["span_ledger"]
    expected = span_ledger(NoiseConfig(**report["rows"][0]["noise_config"]), spans, epochs=EPOCHS)
    assert ledger["spans"] == sum(map(len, spans)) > len(spans) and ledger["epochs"] == EPOCHS
    for span in (span for example in expected.spans for span in example):
        assert ledger["per_span_epsilon"]["by_tokens"][str(span.tokens)] == pytest.approx(span.epsilon)
    assert ledger["per_example_epsilon"]["max"] == pytest.approx(max(e.epsilon for e in expected.examples))
    assert ledger["per_span_epsilon"]["max"] > ledger["per_token_epsilon"] == 2.0
    # the held-out metrics under span noise, on the run's validation chats
    row = report["rows"][0]
    assert row["task_loss"] != report["clean_task_loss"] and 0.0 <= row["task_exact_match"] <= 1.0
    # the run's canaries: every span token of every canary
    canaries = report["canaries"]
    canary_total = sum(sum(span_token_counts_by_offsets(tokenizer, json.loads(line))) for line in canary_lines)
    assert canaries["span_tokens"] == canary_total and canaries["data"].startswith(str(span_run / "data"))
    assert [row["recovery"]["overall"]["total"] for row in canaries["rows"]] == [canary_total] * 2
    printed = capsys.readouterr().out
    assert f"attacked: {total} private-span tokens ({sum(map(len, spans))} spans in {len(spans)} chats)" in printed
    assert f"canaries: {canary_total} private-span tokens" in printed


def test_a_span_runs_canaries_are_its_own_file_else_its_shipped_familys_else_none(tmp_path, hf_export):
    training = task_files("support")["training"].read_text().splitlines()[:4]
    shipped = make_span_run(
        tmp_path / "a", hf_export, training=training, validation=task_files("support")["validation"]
    )
    assert span_sources(read_run_folder(str(shipped))).canaries == task_files("support")["canaries"]
    own = shipped / "data" / "canaries.jsonl"
    own.write_text("\n".join(task_files("support")["canaries"].read_text().splitlines()[:2]) + "\n")
    assert span_sources(read_run_folder(str(shipped))).canaries == own
    other = make_span_run(tmp_path / "b", hf_export, training=training, validation=training)  # not a shipped file
    sources = span_sources(read_run_folder(str(other)))
    assert sources.canaries is None and sources.data == other / "data" / "training.jsonl"


@pytest.fixture
def no_model(monkeypatch):
    """Loading any audit model fails the test: the span data errors must come first."""

    def must_not_load(*args, **kwargs):
        raise AssertionError("a model was loaded before the span data was checked")

    for name in ("smollm2_target", "tiny_target", "span_targets"):
        monkeypatch.setattr(audit_report, name, must_not_load)


def test_a_span_run_without_span_data_is_a_setting_error_before_any_model(tmp_path, hf_export, no_model):
    chats = instruction_files()["training"].read_text().splitlines()[:8]  # chats without private_spans
    run = make_span_run(tmp_path, hf_export, training=chats, validation=chats)
    with pytest.raises(SettingError, match=r"run data=.*training.jsonl.* is invalid: .*no chat there marks"):
        parse_audit_arguments([f"run={run}", f"output_dir={tmp_path / 'out'}"])
    with pytest.raises(SettingError, match=r"data='uniform' is invalid with run=.*tokens='spans'"):
        parse_audit_arguments([f"run={run}", "data=uniform", f"output_dir={tmp_path / 'out'}"])
    assert not (tmp_path / "out").exists()


def test_the_command_names_missing_span_data_in_one_line(tmp_path, hf_export, capsys, no_model):
    chats = instruction_files()["training"].read_text().splitlines()[:8]
    run = make_span_run(tmp_path, hf_export, training=chats, validation=chats)
    with pytest.raises(SystemExit) as exit_:
        audit_command.cli_entrypoint._execute_simple([f"run={run}", f"output_dir={tmp_path / 'out'}"], None)
    assert exit_.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "no chat there marks a 'private_spans' span to audit" in error[0]
