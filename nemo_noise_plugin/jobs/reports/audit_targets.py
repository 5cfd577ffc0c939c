"""The audit targets: the models ``nemo noise audit`` attacks (embedding table, held-out text, task loss, LM prior).

``privacy.audit`` attacks a table; this module supplies what needs a model: ``tiny_target`` (a randomly initialised
tiny Megatron-Core GPT on the CPU, offline, with the held-out loss measured like ``robustness.robustness_curve``:
a frozen copy made noisy, in eval mode) and ``smollm2_target`` (the real SmolLM2-135M-Instruct table, read from its
safetensors, with transformers' model on the CPU for the held-out loss, noise added to ``inputs_embeds`` by the
plugin's noise layer, and for the LM prior). What is audited is ``data``: the model's default text (the corpus, or
the shipped validation chats for SmolLM2), a uniform sample of the vocabulary (``uniform``) or a JSONL file of the
user's own chats or texts (``audit_data_rows``). ``read_run_folder`` reads a training run folder (its HF export, its
noise config as trained, its data) for ``nemo noise audit run=``. ``run_audit_report`` is what ``nemo noise audit``
runs; ``PrivacyAuditCallback`` audits the current embedding table of a training run (Megatron-Bridge callback).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nemo_noise_plugin.data.corpus import CORPUS_VOCAB_SIZE, END_OF_DOCUMENT, corpus_documents, load_corpus_tokens
from nemo_noise_plugin.jobs.reports.provenance import compact_provenance, file_sha256, plugin_version, run_provenance
from nemo_noise_plugin.jobs.reports.robustness import held_out_batches, logits_of
from nemo_noise_plugin.jobs.reports.task_report import input_embedding_table
from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.privacy.audit import audit
from nemo_noise_plugin.privacy.audit.beam import LmLogProbs
from nemo_noise_plugin.privacy.audit.sweep import TaskLoss, audit_sweep, format_sweep, write_sweep_report
from nemo_noise_plugin.upstream.bridge_imports import import_bridge

__all__ = [
    "AUDIT_CHATS",
    "AUDIT_DATA",
    "MODELS",
    "AuditTarget",
    "PrivacyAuditCallback",
    "audit_provenance",
    "TrainedRun",
    "audit_data_rows",
    "check_audit_data",
    "check_hf_dir",
    "read_run_folder",
    "run_audit_report",
    "smollm2_target",
    "tiny_target",
]

MODELS: tuple[str, ...] = ("tiny", "smollm2")
AUDIT_DATA: dict[str, str] = {
    "corpus": "the embedded corpus (model=tiny's default)",
    "validation": "the shipped validation chats (model=smollm2's default without run=)",
    "uniform": "a seeded uniform sample of the vocabulary's ids, special ids excluded",
}
"""The named sources of audited tokens (``data=``); any other value is the path of a JSONL file."""
DATA_SEED = 1234
"""The seed of ``data=uniform``'s sample."""
TINY_AUDIT_MODEL = dict(num_layers=2, hidden_size=256, ffn_hidden_size=1024, num_attention_heads=4)
"""The offline audit model: a randomly initialised tiny GPT (byte vocabulary of the embedded corpus)."""


@dataclass
class AuditTarget:
    """What an audit needs from a model: the table, the audited tokens, and optionally task loss and LM prior."""

    name: str
    table: torch.Tensor
    token_ids: torch.Tensor
    """``[b, s]`` audited token ids, right-padded."""
    padding_mask: torch.Tensor
    """``[b, s]`` True on padding."""
    special_ids: list[int]
    task_loss: TaskLoss | None = None
    lm_log_probs: LmLogProbs | None = None
    task_loss_note: str = ""
    task_exact_match: TaskLoss | None = None
    """``config -> held-out exact match`` (fraction) with that noise, where the model has a task metric."""
    data: str = ""
    """Where the audited tokens come from, in words (the report's ``data``)."""


def _padded(sequences: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    length = max(len(sequence) for sequence in sequences)
    tokens = torch.full((len(sequences), length), pad_id, dtype=torch.long)
    padding = torch.ones(len(sequences), length, dtype=torch.bool)
    for row, sequence in enumerate(sequences):
        tokens[row, : len(sequence)] = torch.tensor(list(sequence), dtype=torch.long)
        padding[row, : len(sequence)] = False
    return tokens, padding


def _take_tokens(
    sequences: Sequence[Sequence[int]], count: int, max_length: int, what: str = "the held-out text"
) -> list[list[int]]:
    """Sequences (each cut to ``max_length``) in order until they hold ``count`` tokens (the last one cut)."""
    chosen, total = [], 0
    for sequence in sequences:
        piece = list(sequence)[: min(max_length, count - total)]
        if len(piece) >= 2:
            chosen.append(piece)
            total += len(piece)
        if total >= count:
            return chosen
    raise ValueError(
        f"tokens={count} is invalid: {what} has only {total} tokens (in pieces of max_length={max_length}); "
        "expected at most that many."
    )


def _uniform_sequences(eligible: Sequence[int], count: int, max_length: int) -> list[list[int]]:
    """``count`` ids drawn from ``eligible`` without replacement (a new permutation once all are used; seeded with
    ``DATA_SEED``), in rows of ``max_length``."""
    generator = torch.Generator().manual_seed(DATA_SEED)
    pool = torch.as_tensor(list(eligible), dtype=torch.long)
    drawn = torch.cat([pool[torch.randperm(len(pool), generator=generator)] for _ in range(-(-count // len(pool)))])
    ids = drawn[:count].tolist()
    return [ids[start : start + max_length] for start in range(0, count, max_length)]


# What is audited: named sources and the user's JSONL files


def check_audit_data(data: str, model: str) -> str:
    """``data`` checked for ``model``: a name of ``AUDIT_DATA`` that the model has, or the path of a readable JSONL
    file whose rows ``audit_data_rows`` accepts; ``ValueError`` naming the setting, the value and what is allowed."""
    allowed = ("corpus", "uniform") if model == "tiny" else ("validation", "uniform")
    if data in AUDIT_DATA:
        if data not in allowed:
            raise ValueError(
                f"data={data!r} is invalid with model={model}: expected {', '.join(allowed)} or a JSONL file."
            )
        return data
    if model == "tiny":
        raise ValueError(
            f"data={data!r} is invalid with model=tiny: expected {' or '.join(allowed)} (the tiny model has no "
            "tokenizer for a JSONL file; audit a JSONL file with model=smollm2 or run=)."
        )
    audit_data_rows(data)
    return data


def audit_data_rows(path: str) -> list[dict[str, Any]]:
    """The rows of a JSONL file of audited text, checked: ``{"messages": [{"role", "content"}, ...]}`` (the shipped
    instruction format, rendered with the model's chat template), ``{"input", "output"}`` (input, a space, output)
    or ``{"text"}``; ``ValueError`` naming ``data=``, the line and what is expected."""
    file = Path(path).expanduser()
    expected = 'expected a JSONL file of {"messages": [...]}, {"input", "output"} or {"text"} rows'
    if not file.is_file():
        reason = "it is a folder" if file.is_dir() else "no such file"
        raise ValueError(f"data={path!r} is invalid: {reason}; {expected} (or one of {', '.join(AUDIT_DATA)}).")
    rows = []
    with open(file, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(
                    f"data={path!r} is invalid at line {number}: not JSON ({error.msg}); {expected}."
                ) from None
            if not _is_audit_row(row):
                raise ValueError(f"data={path!r} is invalid at line {number}: {line.strip()[:80]!r}; {expected}.")
            rows.append(row)
    if not rows:
        raise ValueError(f"data={path!r} is invalid: the file has no rows; {expected}.")
    return rows


def _is_audit_row(row: Any) -> bool:
    if not isinstance(row, dict):
        return False
    if "messages" in row:
        messages = row["messages"]
        return (
            isinstance(messages, list)
            and bool(messages)
            and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages
            )
        )
    if "text" in row:
        return isinstance(row["text"], str) and bool(row["text"])
    return isinstance(row.get("input"), str) and isinstance(row.get("output"), str)


def _row_text(row: dict[str, Any], tokenizer: Any) -> str:
    if "messages" in row:
        return tokenizer.apply_chat_template(row["messages"], tokenize=False)
    if "text" in row:
        return row["text"]
    return f"{row['input']} {row['output']}"


# A training run folder (nemo noise audit run=...)


@dataclass(frozen=True)
class TrainedRun:
    """A training run folder as ``nemo noise audit run=`` audits it: its HF export and its noise as trained.

    Read by ``read_run_folder`` from the folder a SmolLM2 recipe or the main job trains into (``<dir>/<recipe>``):
    ``reports/latest/hf`` (``task_report.TaskReport``'s export), the noise config from ``reports/latest/
    task_report.json`` (its ``run``) or else from the newest Bridge checkpoint's ``checkpoints/iter_*/
    run_config.yaml``, and the run's data (``data/training.jsonl``, ``data/validation.jsonl``).
    """

    folder: Path
    hf_dir: Path
    noise: NoiseConfig
    """The noise config the run trained with."""
    noise_source: str
    """The file it was read from."""
    sequence_length: int | None = None
    epochs: int | None = None
    training_data: Path | None = None
    validation_data: Path | None = None

    @property
    def noise_at_inference(self) -> NoiseConfig:
        """The run's noise at its full level in eval mode (constant schedule, no warm-up): what is audited."""
        return dataclasses.replace(self.noise, training_only=False, schedule="constant", warmup_steps=0)


def read_run_folder(run: str) -> TrainedRun:
    """The ``TrainedRun`` of the folder ``run``; one ``ValueError`` naming ``run=``, the value and what was expected
    when the folder lacks the export or a noise config. Reads JSON and YAML only (no model is loaded). Example::

        trained = read_run_folder("nemo_experiments/smollm2_135m_noise_sft")
        trained.noise.mechanism, trained.hf_dir
    """
    folder = Path(run).expanduser()
    if not folder.is_dir():
        raise ValueError(
            f"run={run!r} is invalid: {'not a folder' if folder.exists() else 'no such folder'}; expected a training "
            "run folder (the folder a SmolLM2 recipe trains into, e.g. <output-dir>/smollm2_135m_noise_sft)."
        )
    hf_dir = folder / "reports" / "latest" / "hf"
    missing = [name for name in ("config.json", "model.safetensors", "tokenizer.json") if not (hf_dir / name).is_file()]
    if missing:
        raise ValueError(
            f"run={run!r} is invalid: expected its trained model's Hugging Face export in reports/latest/hf (written "
            f"by the SmolLM2 recipes' task report at the end of training); missing {', '.join(missing)} there."
        )
    noise, source, settings = _run_noise(folder, run)
    data = folder / "data"
    training = data / "training.jsonl"
    epochs = settings.get("epochs")
    if epochs is None and settings.get("samples") and training.is_file():
        examples = sum(1 for line in training.read_text().splitlines() if line.strip())
        epochs = max(1, -(-settings["samples"] // examples)) if examples else None
    return TrainedRun(
        folder=folder,
        hf_dir=hf_dir,
        noise=noise,
        noise_source=source,
        sequence_length=settings.get("seq_length"),
        epochs=epochs,
        training_data=training if training.is_file() else None,
        validation_data=data / "validation.jsonl" if (data / "validation.jsonl").is_file() else None,
    )


def _run_noise(folder: Path, run: str) -> tuple[NoiseConfig, str, dict[str, Any]]:
    """The run's noise config, the file it came from, and the ledger's settings (seq_length, epochs or samples)."""
    from nemo_noise_plugin.yaml_files import load_yaml_file

    report = folder / "reports" / "latest" / "task_report.json"
    if report.is_file():
        saved = json.loads(report.read_text()).get("run") or {}
        if isinstance(saved.get("noise"), dict):
            settings = {key: saved.get(key) for key in ("seq_length", "epochs")}
            return _noise_from(saved["noise"], run, report), str(report), settings
    checkpoints = sorted(
        (folder / "checkpoints").glob("iter_*/run_config.yaml"), key=lambda path: path.parent.name, reverse=True
    )
    for path in checkpoints:
        config = load_yaml_file(path, what="a ConfigContainer mapping, as ConfigContainer.to_yaml writes it")
        model, dataset, train = (config.get(name) or {} for name in ("model", "dataset", "train"))
        if isinstance(model.get("noise"), dict):
            settings = {
                "seq_length": dataset.get("seq_length") or model.get("seq_length"),
                "samples": int(train.get("train_iters") or 0) * int(train.get("global_batch_size") or 0),
            }
            return _noise_from(model["noise"], run, path), str(path), settings
    raise ValueError(
        f"run={run!r} is invalid: no noise config found; expected reports/latest/task_report.json with its 'run' "
        "section (written by the task report) or a Bridge checkpoint's checkpoints/iter_*/run_config.yaml with "
        "model.noise."
    )


def _noise_from(fields: dict[str, Any], run: str, path: Path) -> NoiseConfig:
    known = {field.name for field in dataclasses.fields(NoiseConfig)}
    values = {key: value for key, value in fields.items() if key in known}
    try:
        return NoiseConfig(**values)
    except (TypeError, ValueError) as error:
        raise ValueError(f"run={run!r} is invalid: the noise config in {path} is not valid: {error}") from None


# The tiny Megatron-Core GPT


def _tiny_gpt(seed: int) -> torch.nn.Module:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from nemo_noise_plugin.jobs.cpu import init_cpu_parallel
    from nemo_noise_plugin.recipes.tiny import CUDA_FREE_SETTINGS

    init_cpu_parallel(seed=seed)
    config = TransformerConfig(
        **TINY_AUDIT_MODEL, **CUDA_FREE_SETTINGS, use_cpu_initialization=True, params_dtype=torch.float32
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=CORPUS_VOCAB_SIZE,
        max_sequence_length=512,
        position_embedding_type="rope",
    )
    return model.eval()


def _megatron_batch(tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    from nemo_noise_plugin.jobs.cpu import causal_attention_mask

    positions = torch.arange(tokens.size(1)).unsqueeze(0).expand_as(tokens)
    return {"tokens": tokens, "position_ids": positions, "attention_mask": causal_attention_mask(tokens.size(1))}


def _tiny_task_loss(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]]) -> TaskLoss:
    """Held-out loss with the noise on, in eval mode, as ``robustness_curve`` measures it (frozen noisy copy)."""
    from nemo_noise_plugin.distillation.teacher import build_clean_teacher
    from nemo_noise_plugin.model.make_noisy import make_noisy

    def task_loss(config: NoiseConfig) -> float:
        noisy = make_noisy(build_clean_teacher(model), dataclasses.replace(config, training_only=False)).eval()
        total = tokens = 0.0
        with torch.no_grad():
            for batch in batches:
                noisy.noise_clock.start_iteration(0)
                with noisy.noise_batch_inputs(batch["loss_mask"]):
                    log_probs = logits_of(noisy, batch).float().log_softmax(-1)
                picked = log_probs.gather(-1, batch["labels"].unsqueeze(-1)).squeeze(-1)
                total += float(-(picked * batch["loss_mask"]).sum())
                tokens += float(batch["loss_mask"].sum())
        return total / tokens

    return task_loss


def tiny_target(
    tokens: int = 2000, max_length: int = 64, task_sequences: int = 16, seed: int = 1234, data: str = "corpus"
) -> AuditTarget:
    """A randomly initialised tiny GPT (``TINY_AUDIT_MODEL``, vocabulary 257: bytes + end of document) on the
    embedded corpus (3,298 byte tokens): the held-out loss uses its last ``task_sequences`` windows of
    ``max_length + 1`` tokens, the audit consecutive ``max_length`` windows from its start (``data="corpus"``) or
    a uniform sample of the 256 byte ids (``data="uniform"``)."""
    check_audit_data(data, "tiny")
    model = _tiny_gpt(seed)
    corpus = load_corpus_tokens()
    held_out = corpus[corpus.numel() - task_sequences * (max_length + 1) :].view(task_sequences, max_length + 1)
    if data == "uniform":
        sequences = _uniform_sequences(
            [i for i in range(CORPUS_VOCAB_SIZE) if i != END_OF_DOCUMENT], tokens, max_length
        )
        described = f"{AUDIT_DATA['uniform']} ({CORPUS_VOCAB_SIZE - 1} ids, seed {DATA_SEED})"
    else:
        available = corpus[: corpus.numel() - held_out.numel()].tolist()
        windows = [available[start : start + max_length] for start in range(0, len(available), max_length)]
        sequences = _take_tokens(windows, tokens, max_length, "the embedded corpus")
        described = AUDIT_DATA["corpus"]
    token_ids, padding = _padded(sequences, END_OF_DOCUMENT)
    batch = {
        **_megatron_batch(held_out[:, :-1]),
        "labels": held_out[:, 1:],
        "loss_mask": torch.ones(task_sequences, max_length),
    }

    def lm_log_probs(prefix: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return logits_of(model, _megatron_batch(prefix))[:, -1].float().log_softmax(-1)

    return AuditTarget(
        name="tiny",
        table=model.embedding.word_embeddings.weight.detach().float(),
        token_ids=token_ids,
        padding_mask=padding,
        special_ids=[END_OF_DOCUMENT],
        task_loss=_tiny_task_loss(model, [batch]),
        lm_log_probs=lm_log_probs,
        task_loss_note=f"held-out loss of the random tiny GPT on {task_sequences} corpus windows (noise on, eval mode)",
        data=described,
    )


# SmolLM2-135M-Instruct

AUDIT_CHATS = 80
"""How many of the shipped validation chats (the first, a shuffled mix of every task) the SmolLM2 audit attacks and
scores: the 80 it audited before the set grew to 440, so its cost and its numbers stay comparable."""


def _validation_chats(held_out: str | os.PathLike[str] | None = None) -> list[dict[str, Any]] | None:
    """The first ``AUDIT_CHATS`` chats of ``held_out`` (a JSONL file), else of the shipped validation split; None
    when neither is there."""
    from importlib import resources

    path = resources.files("nemo_noise_plugin").joinpath("data/instructions/validation.jsonl")
    if held_out is not None:
        path = Path(held_out)
    if not path.is_file():
        return None
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [record for record in records if "messages" in record][:AUDIT_CHATS]


def _chat_texts(tokenizer: Any, held_out: str | os.PathLike[str] | None = None) -> list[list[int]]:
    """Token ids of the first ``AUDIT_CHATS`` validation chats (``held_out``'s, else the shipped split's) in the chat
    template, else the corpus lines."""
    records = _validation_chats(held_out)
    if records:
        texts = [tokenizer.apply_chat_template(r["messages"], tokenize=False) for r in records]
        return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    return [tokenizer(bytes(doc[:-1]).decode("utf-8", "replace"))["input_ids"] for doc in corpus_documents()]


def _answer_spans(
    tokenizer: Any, held_out: str | os.PathLike[str] | None = None
) -> tuple[list[list[int]], list[tuple[int, int]]]:
    """The first ``AUDIT_CHATS`` validation chats (``held_out``'s, else the shipped split's) as token ids and, for
    each, the span ``[start, end)`` of the reference answer and its end-of-turn token (what greedy decoding must
    produce for an exact match)."""
    sequences, spans = [], []
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for example in _validation_chats(held_out) or []:
        messages = example["messages"]
        prompt_text = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
        full = tokenizer(tokenizer.apply_chat_template(messages, tokenize=False), add_special_tokens=False)["input_ids"]
        prompt = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
        if full[: len(prompt)] != prompt or end_of_turn not in full[len(prompt) :]:
            continue  # the chat template does not split at the answer: not a well-defined exact match
        sequences.append(full)
        spans.append((len(prompt), full.index(end_of_turn, len(prompt)) + 1))
    return sequences, spans


def _task_exact_match(
    model: Any, table: torch.Tensor, tokenizer: Any, held_out: str | os.PathLike[str] | None = None
) -> TaskLoss:
    """Held-out exact match of transformers' ``model`` with the noise on its input embeddings: an answer counts when
    the argmax at every answer position (teacher-forced) is the reference token, i.e. greedy decoding reproduces
    the answer and then ends the turn (as ``task_report.exact_match`` computes it for Megatron models)."""
    from nemo_noise_plugin.privacy.audit import noised_embeddings

    sequences, spans = _answer_spans(tokenizer, held_out)
    if not sequences:
        raise ValueError(
            f"held-out chats {held_out or 'validation'!r} hold no chat that splits at its answer: expected "
            '{"messages": [..., {"role": "assistant", ...}]} rows.'
        )
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 2
    ids, padding = _padded(sequences, pad_id)

    def exact_match(config: NoiseConfig) -> float:
        with torch.no_grad():
            embeds = noised_embeddings(table, ids, config, padding_mask=padding)
            predicted = model(inputs_embeds=embeds, attention_mask=(~padding).long()).logits.argmax(-1)
        correct = [
            bool((predicted[row, start - 1 : end - 1] == ids[row, start:end]).all())
            for row, (start, end) in enumerate(spans)
        ]
        return sum(correct) / len(correct)

    return exact_match


def smollm2_target(
    tokens: int = 2000,
    max_length: int = 64,
    task_sequences: int = 16,
    hf_dir: str | None = None,
    data: str = "validation",
    held_out: str | os.PathLike[str] | None = None,
) -> AuditTarget:
    """The real SmolLM2-135M-Instruct embedding table ``[49152, 576]`` and chat text; task loss, held-out exact
    match and LM prior from transformers' model on the CPU (the held-out loss over every real next token of
    ``task_sequences`` held-out chats; exact match on the shipped instruction set's validation split, or on the
    chats of the JSONL file ``held_out``; the noise added to ``inputs_embeds`` by the plugin's noise layer).
    ``hf_dir`` audits another folder of the same architecture instead, e.g. a fine-tuned export (the main job's
    ``reports/latest/hf``). The audited tokens are ``data``: the validation chats after the first
    ``task_sequences`` (``validation``), a uniform sample of the tokenizer's ids without its special ids
    (``uniform``), or the rows of a JSONL file (``audit_data_rows``), in pieces of ``max_length`` tokens."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nemo_noise_plugin.data.smollm2_wheel import ensure_smollm2_hf
    from nemo_noise_plugin.privacy.audit import noised_embeddings

    check_audit_data(data, "smollm2")
    folder = ensure_smollm2_hf() if hf_dir is None else check_hf_dir(hf_dir)
    with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
        table = handle.get_tensor("model.embed_tokens.weight").float()
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    texts = _chat_texts(tokenizer, held_out)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 2
    special_ids = sorted(set(tokenizer.all_special_ids))
    if data == "uniform":
        eligible = [i for i in range(min(len(tokenizer), table.size(0))) if i not in set(special_ids)]
        sequences = _uniform_sequences(eligible, tokens, max_length)
        described = f"{AUDIT_DATA['uniform']} ({len(eligible)} ids, seed {DATA_SEED})"
    elif data == "validation":
        sequences = _take_tokens(
            texts[task_sequences:], tokens, max_length, f"the validation chats after {task_sequences}"
        )
        described = f"{AUDIT_DATA['validation'].split(' (')[0]} {task_sequences + 1}-{len(texts)}"
    else:
        rows = audit_data_rows(data)
        encoded = [tokenizer(_row_text(row, tokenizer), add_special_tokens=False)["input_ids"] for row in rows]
        sequences = _take_tokens(encoded, tokens, max_length, f"data={data!r}")
        described = f"{data} ({len(rows)} rows)"
    token_ids, padding = _padded(sequences, pad_id)
    held_ids, held_padding = _padded([text[:max_length] for text in texts[:task_sequences]], pad_id)
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()

    def task_loss(config: NoiseConfig) -> float:
        with torch.no_grad():
            embeds = noised_embeddings(table, held_ids, config, padding_mask=held_padding)
            logits = model(inputs_embeds=embeds, attention_mask=(~held_padding).long()).logits.float()
            log_probs = logits[:, :-1].log_softmax(-1).gather(-1, held_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
            mask = (~held_padding[:, 1:]).float()
            return float(-(log_probs * mask).sum() / mask.sum())

    def lm_log_probs(prefix: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return model(input_ids=prefix).logits[:, -1].float().log_softmax(-1)

    return AuditTarget(
        name="smollm2" if hf_dir is None else f"smollm2 ({folder})",
        table=table,
        token_ids=token_ids,
        padding_mask=padding,
        special_ids=special_ids,
        task_loss=task_loss,
        lm_log_probs=lm_log_probs,
        task_loss_note=(
            f"held-out next-token loss of {folder.name} (transformers, CPU) on {task_sequences} held-out chats, and "
            f"held-out exact match (greedy, teacher-forced) on {held_out or 'the instruction set validation split'}, "
            "with the noise on inputs_embeds"
        ),
        task_exact_match=_task_exact_match(model, table, tokenizer, held_out),
        data=described,
    )


def audit_provenance(settings: dict[str, Any], run: TrainedRun | None = None) -> dict[str, Any]:
    """The ``provenance`` of a ``nemo noise audit`` report: the command, the plugin's version, the audit's
    ``settings``, the sha256 of the audited data file (``data`` a JSONL path) and, with ``run``, the provenance of
    the run's latest report (``reports/latest/task_report.json``; without its config: ``config_sha256`` names it)."""
    data = settings.get("data")
    files = {str(data): file_sha256(data)} if data and data not in AUDIT_DATA and Path(data).is_file() else {}
    provenance: dict[str, Any] = {
        "command": "nemo noise audit",
        "plugin_version": plugin_version(),
        "settings": settings,
        "data_files": files,
    }
    if run is not None:
        report = run.folder / "reports" / "latest" / "task_report.json"
        saved = json.loads(report.read_text()).get("provenance") if report.is_file() else None
        provenance["run"] = None if saved is None else compact_provenance(saved)
    return provenance


def check_hf_dir(hf_dir: str) -> Path:
    """``hf_dir`` as a folder holding a SmolLM2-architecture HF model; ``ValueError`` naming the setting if not."""
    folder = Path(hf_dir).expanduser()
    missing = [name for name in ("config.json", "model.safetensors", "tokenizer.json") if not (folder / name).is_file()]
    if missing:
        raise ValueError(
            f"hf_dir={hf_dir!r} is invalid: expected a Hugging Face folder with config.json, model.safetensors and "
            f"tokenizer.json (e.g. a main job's reports/latest/hf); missing {', '.join(missing)}."
        )
    return folder


def run_audit_report(
    model: str | None,
    base_config: NoiseConfig,
    sweeps: Sequence[Any],
    attacks: Sequence[str],
    output_dir: str,
    *,
    tokens: int = 2000,
    max_length: int = 64,
    task_sequences: int = 16,
    task_loss: bool = True,
    hf_dir: str | None = None,
    data: str | None = None,
    run: TrainedRun | None = None,
    device: str = "cpu",
    epochs: int | None = None,
    vocab_chunk: int | None = None,
    query_chunk: int | None = None,
    neighbour_sample: int | None = None,
) -> dict[str, str]:
    """Build the ``model`` target, run ``audit_sweep`` and write the JSON, table and PNG; print the table.

    ``data`` picks the audited tokens (``check_audit_data``; default the model's own text). ``run`` (a
    ``TrainedRun``) audits a training run's export (``model`` None or ``smollm2``): ``data`` defaults to its training
    data, the held-out loss and exact match use its validation chats, and the ledger its sequence length and epochs
    (``epochs`` overrides); ``base_config`` and ``sweeps`` are the caller's (e.g. ``run.noise_at_inference`` and
    ``Sweep.at_level_of`` of it). Example::

        trained = read_run_folder("runs/smollm2_135m_noise_sft")
        config = trained.noise_at_inference
        run_audit_report(None, config, [Sweep.at_level_of(config)], ("nn_l2",), "audit_out", run=trained)
    """
    model = model or ("smollm2" if run is not None else None)
    if model not in MODELS:
        raise ValueError(f"model={model!r} is invalid: expected one of {', '.join(MODELS)}.")
    if run is not None and (model != "smollm2" or hf_dir is not None):
        raise ValueError(
            f"run={str(run.folder)!r} audits the run's own export (reports/latest/hf): expected no hf_dir and "
            f"model=smollm2 or none (got model={model!r}, hf_dir={hf_dir!r})."
        )
    if hf_dir is not None and model != "smollm2":
        raise ValueError(f"hf_dir={hf_dir!r} is only used with model=smollm2 (got model={model!r}).")
    if data is None:
        if run is not None and run.training_data is None:
            raise ValueError(
                f"run={str(run.folder)!r} has no data/training.jsonl (the run's training data, audited by default): "
                "expected that file, or give data=<a JSONL file>, data=validation or data=uniform."
            )
        data = str(run.training_data) if run is not None else ("corpus" if model == "tiny" else "validation")
    check_audit_data(data, model)
    settings = dict(model=model, data=data, attacks=list(attacks), tokens=tokens, max_length=max_length)
    settings.update(task_sequences=task_sequences, task_loss=task_loss, hf_dir=hf_dir, device=device, epochs=epochs)
    settings.update(vocab_chunk=vocab_chunk, query_chunk=query_chunk, neighbour_sample=neighbour_sample)
    settings.update(noise=dataclasses.asdict(base_config), sweeps=[dataclasses.asdict(sweep) for sweep in sweeps])
    metadata: dict[str, Any] = {"provenance": audit_provenance(settings, run)}
    sequence_length = None
    if run is not None:
        hf_dir, held_out = str(run.hf_dir), run.validation_data
        sequence_length, epochs = run.sequence_length, epochs or run.epochs
        metadata["run"] = {"folder": str(run.folder), "noise": dataclasses.asdict(run.noise), "from": run.noise_source}
        metadata["run"].update(sequence_length=run.sequence_length, epochs=run.epochs)
    else:
        held_out = None
    try:
        if model == "tiny":
            target = tiny_target(tokens=tokens, max_length=max_length, task_sequences=task_sequences, data=data)
        else:
            target = smollm2_target(
                tokens=tokens,
                max_length=max_length,
                task_sequences=task_sequences,
                hf_dir=hf_dir,
                data=data,
                held_out=held_out,
            )
        chunks = {k: v for k, v in dict(vocab_chunk=vocab_chunk, query_chunk=query_chunk).items() if v is not None}
        report = audit_sweep(
            target.table.to(device),
            target.token_ids,
            base_config,
            sweeps,
            attacks,
            lm_log_probs=target.lm_log_probs if "lm_beam" in attacks else None,
            task_loss=target.task_loss if task_loss else None,
            task_exact_match=target.task_exact_match if task_loss else None,
            padding_mask=target.padding_mask,
            special_ids=target.special_ids,
            sequence_length=sequence_length,
            epochs=epochs or 1,
            neighbour_sample=neighbour_sample,
            metadata={
                "model": target.name,
                "data": target.data,
                **metadata,
                "task_loss_note": target.task_loss_note if task_loss else "not measured",
            },
            **chunks,
        )
    finally:
        if model == "tiny":
            from nemo_noise_plugin.jobs.cpu import destroy_cpu_parallel

            destroy_cpu_parallel()
    print(format_sweep(report))
    paths = write_sweep_report(report, output_dir)
    print("report: " + ", ".join(paths.values()))
    return paths


class PrivacyAuditCallback(import_bridge("megatron.bridge.training.callbacks").Callback):
    """Bridge callback: audits the current embedding table with the run's ``NoiseConfig`` on held-out tokens.

    Runs at the end of each evaluation (``on_eval_end``) and, with ``every_steps``, after every that many training
    steps; on the first pipeline stage only (the one holding the input embedding). The noise is the one training
    adds at that iteration. Rank 0 prints the recovery rates and appends one JSON line per audit to
    ``output_dir/privacy_audit.jsonl``, each with the run's ``provenance`` (``run_provenance`` with ``recipe``,
    without the config itself: its ``config_sha256`` names it); ``self.history`` keeps them.
    """

    def __init__(
        self,
        noise: NoiseConfig,
        output_dir: str,
        *,
        every_steps: int | None = None,
        held_out_batches: int = 2,
        attacks: Sequence[str] = ("nn_l2", "nn_cosine"),
        recipe: str | None = None,
    ) -> None:
        if every_steps is not None and (
            isinstance(every_steps, bool) or not isinstance(every_steps, int) or every_steps < 1
        ):
            raise ValueError(f"every_steps={every_steps!r} is invalid: expected an integer >= 1 or None.")
        self.noise, self.output_dir, self.every_steps = noise, output_dir, every_steps
        self.held_out_count, self.attacks = held_out_batches, tuple(attacks)
        self.batches: list[dict[str, torch.Tensor]] | None = None
        self.history: list[dict[str, Any]] = []
        self.recipe = recipe
        self.provenance: dict[str, Any] | None = None

    def _audit(self, context: Any) -> None:
        from megatron.core.utils import unwrap_model

        model = unwrap_model(context.model[0])
        if getattr(model, "embedding", None) is None:
            return  # not the first pipeline stage
        table = input_embedding_table(model)
        if self.batches is None:
            self.batches = held_out_batches(context.state, self.held_out_count, table.device)
        tokens = torch.cat([batch["tokens"] for batch in self.batches])
        loss_mask = torch.cat([batch["loss_mask"] for batch in self.batches])
        step = int(context.state.train_state.step)
        private = [batch.get("private_mask") for batch in self.batches]  # tokens='spans': attack the spans only
        private_mask = torch.cat(private) if all(mask is not None for mask in private) else None
        report = audit(
            table, tokens, self.noise, self.attacks, iteration=step, loss_mask=loss_mask, private_mask=private_mask
        )
        if self.provenance is None:
            self.provenance = compact_provenance(run_provenance(context.state.cfg, self.recipe))
        entry = {"step": step, **report, "provenance": self.provenance}
        self.history.append(entry)
        if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
            return
        rates = ", ".join(f"{name} {100 * r['overall']['rate']:.1f}%" for name, r in report["attacks"].items())
        print(f"privacy audit at step {step}: {report['tokens']['real']} tokens recovered: {rates}")
        os.makedirs(self.output_dir, exist_ok=True)
        with open(os.path.join(self.output_dir, "privacy_audit.jsonl"), "a") as handle:
            handle.write(json.dumps(entry) + "\n")

    def on_eval_end(self, context: Any) -> None:
        self._audit(context)

    def on_train_step_end(self, context: Any) -> None:
        if self.every_steps and context.state.train_state.step % self.every_steps == 0:
            self._audit(context)
