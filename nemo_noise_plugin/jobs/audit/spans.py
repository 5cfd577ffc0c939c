"""The audit of a span-private run (``NoiseConfig.tokens='spans'``): its private spans, read as training reads them.

A run that noises only its examples' private spans protects nothing else, so ``nemo noise audit run=`` attacks
those tokens only. ``span_sources`` finds what is audited: the run's training data (or ``data=``, a JSONL file of
chats with ``private_spans``) and the canaries (the run folder's ``data/canaries.jsonl``, else the shipped family's
when the run's held-out files are that family's: ``data.tasks.shipped``), checked before any model loads.
``span_targets`` builds the audit targets: each chat rendered with the export's chat template and its spans mapped
to tokens by ``data.private_spans.private_token_mask`` (the code ``data.span_dataset.PrivateSpanChatDataset``
trains with), the held-out loss and exact match under span noise on the run's validation chats.
``add_span_results`` adds the canary sweep and the ledger's epsilon per span (``privacy.span_ledger``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nemo_noise_plugin.data.private_spans import PRIVATE_SPANS_FIELD, private_token_mask, read_private_spans
from nemo_noise_plugin.jobs.audit.data import AUDIT_CHATS, AUDIT_DATA, padded
from nemo_noise_plugin.jobs.audit.run_folder import TrainedRun
from nemo_noise_plugin.jobs.audit.targets import AuditTarget, hf_exact_match, hf_lm_prior, hf_task_loss, load_hf_model
from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.validation import SettingError

__all__ = ["CANARIES_FILE", "SpanRows", "SpanSources", "add_span_results", "span_sources", "span_targets"]

CANARIES_FILE = "canaries.jsonl"
"""A run folder's own canaries, ``data/canaries.jsonl`` (chats with ``private_spans``, never trained on)."""
_EXPECTED = 'a JSONL file of {"messages": [...], "private_spans": [...]} chats (data.private_spans)'


@dataclass(frozen=True)
class SpanSources:
    """What a span run's audit reads: the audited chats and the canaries (None without)."""

    data: Path
    canaries: Path | None


@dataclass
class SpanRows:
    """Chats encoded with their private-token masks (one list entry per chat that marks a span)."""

    ids: list[list[int]]
    private: list[torch.Tensor]
    answers: list[tuple[int, int]]
    """Per chat, ``[start, end)`` of its answer and end-of-turn token (with ``answers=True``; else empty)."""


def _examples(path: Path, setting: str) -> list[tuple[str, dict[str, Any]]]:
    """``(where, example)`` of every chat of ``path`` whose spans are checked (``read_private_spans``)."""
    if not path.is_file():
        raise SettingError(setting, str(path), _EXPECTED, why=" (no such file)")
    found = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        example = json.loads(line)
        where = f"{path.name} line {number}"
        if isinstance(example, dict) and isinstance(example.get("messages"), list):
            if read_private_spans(example, example["messages"], where):
                found.append((where, example))
    if not found:
        raise SettingError(
            setting, str(path), _EXPECTED, why=f" (no chat there marks a '{PRIVATE_SPANS_FIELD}' span to audit)"
        )
    return found


def _shipped_canaries(data: Path) -> Path | None:
    """The canaries of the shipped family whose validation or test file the run's ``data`` folder holds unchanged."""
    from nemo_noise_plugin.data.tasks.shipped import CANARY_SPLIT, TASK_FAMILIES, task_files

    for family in TASK_FAMILIES:
        files = task_files(family)
        if CANARY_SPLIT not in files:
            continue
        for split in ("validation", "test"):
            copy = data / f"{split}.jsonl"
            if copy.is_file() and copy.read_bytes() == files[split].read_bytes():
                return files[CANARY_SPLIT]
    return None


def span_sources(run: TrainedRun, data: str | None = None) -> SpanSources:
    """The chats a span run's audit attacks (``data``, default the run's ``data/training.jsonl``) and its canaries,
    their spans checked; a ``SettingError`` naming ``run=`` or ``data=`` when there is no span data. Loads no model.

    Example::

        sources = span_sources(read_run_folder("runs/smollm2_135m_private_span_sft"))
        sources.data, sources.canaries  # data/training.jsonl, the support family's canaries.jsonl
    """
    context = f" with run={str(run.folder)!r} (NoiseConfig.tokens='spans': only the private spans are noised)"
    if data in AUDIT_DATA:
        raise SettingError("data", data, _EXPECTED + " (default: the run's data/training.jsonl)", context=context)
    if data is None and run.training_data is None:
        raise SettingError(
            "run",
            str(run.folder),
            f"a run folder with data/training.jsonl, {_EXPECTED}, or data=<such a file>",
            why=" (a span run's audit attacks its private spans only)",
        )
    path = Path(data).expanduser() if data is not None else run.training_data
    _examples(path, "data" if data is not None else "run data")
    folder = run.folder / "data"
    canaries = folder / CANARIES_FILE if (folder / CANARIES_FILE).is_file() else _shipped_canaries(folder)
    if canaries is not None:
        _examples(canaries, "canaries")
    return SpanSources(path, canaries)


def encode_span_chats(
    tokenizer: Any,
    examples: Sequence[tuple[str, dict[str, Any]]],
    *,
    tokens: int | None = None,
    max_length: int | None = None,
    answers: bool = False,
    limit: int | None = None,
) -> SpanRows:
    """Chats in the chat template and their ``[n]`` private-token masks (``private_token_mask``), each cut to
    ``max_length``, in order until they hold ``tokens`` private tokens (all without); ``answers``: only chats whose
    template splits at the answer, with its span; ``limit``: at most that many chats."""
    end_of_turn = tokenizer.eos_token_id
    rows = SpanRows([], [], [])
    total = 0
    for where, example in examples:
        messages = example["messages"]
        spans = read_private_spans(example, messages, where)
        rendered = tokenizer.apply_chat_template(messages, tokenize=False)
        ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
        mask = private_token_mask(tokenizer, messages, spans, where, input_ids=ids)
        if answers:
            prompt_text = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
            start = len(tokenizer(prompt_text, add_special_tokens=False)["input_ids"])
            if ids[:start] != tokenizer(prompt_text, add_special_tokens=False)["input_ids"]:
                continue
            if end_of_turn not in ids[start:] or (
                max_length is not None and ids.index(end_of_turn, start) >= max_length
            ):
                continue
            rows.answers.append((start, ids.index(end_of_turn, start) + 1))
        cut = len(ids) if max_length is None else max_length
        rows.ids.append(ids[:cut])
        rows.private.append(mask[:cut])
        total += int(mask[:cut].sum())
        if (tokens is not None and total >= tokens) or (limit is not None and len(rows.ids) >= limit):
            break
    return rows


def _padded_rows(rows: SpanRows, pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids, padding = padded(rows.ids, pad_id)
    private = torch.zeros_like(ids, dtype=torch.bool)
    for row, mask in enumerate(rows.private):
        private[row, : mask.numel()] = mask
    return ids, padding, private


def span_targets(
    run: TrainedRun, sources: SpanSources, *, tokens: int, task_sequences: int
) -> tuple[AuditTarget, AuditTarget | None]:
    """The audit target of a span run (its export's table and model; the private spans of ``sources.data`` until
    they hold ``tokens`` tokens, rows cut at the run's sequence length; held-out loss on ``task_sequences`` and exact
    match on the first ``AUDIT_CHATS`` span chats of its ``data/validation.jsonl`` with span noise) and that of its
    canaries (every canary; None without)."""
    folder, table, tokenizer, model = load_hf_model(run.hf_dir)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 2
    special_ids = sorted(set(tokenizer.all_special_ids))
    examples = _examples(sources.data, "data")
    audited = encode_span_chats(tokenizer, examples, tokens=tokens, max_length=run.sequence_length)
    ids, padding, private = _padded_rows(audited, pad_id)
    held = _examples(run.validation_data, "run data") if run.validation_data is not None else []
    task_loss = exact_match = None
    note = "not measured (the run folder has no data/validation.jsonl with private spans)"
    if held:
        loss_rows = encode_span_chats(tokenizer, held, max_length=run.sequence_length, limit=task_sequences)
        task_loss = hf_task_loss(model, table, *_padded_rows(loss_rows, pad_id))
        answer_rows = encode_span_chats(
            tokenizer, held, max_length=run.sequence_length, answers=True, limit=AUDIT_CHATS
        )
        if answer_rows.ids:
            answer_ids, answer_padding, answer_private = _padded_rows(answer_rows, pad_id)
            exact_match = hf_exact_match(model, table, answer_ids, answer_padding, answer_rows.answers, answer_private)
        note = (
            f"held-out next-token loss of {folder.name} on {len(loss_rows.ids)} and exact match on "
            f"{len(answer_rows.ids)} span chats of {run.validation_data}, with the noise on their private spans"
        )
    common = dict(table=table, special_ids=special_ids, lm_log_probs=hf_lm_prior(model))
    target = AuditTarget(
        name=f"smollm2 ({folder})",
        token_ids=ids,
        padding_mask=padding,
        private_mask=private,
        task_loss=task_loss,
        task_exact_match=exact_match,
        task_loss_note=note,
        data=f"{sources.data} ({len(audited.ids)} chats, their private spans)",
        **common,
    )
    if sources.canaries is None:
        return target, None
    canary_rows = encode_span_chats(tokenizer, _examples(sources.canaries, "canaries"), max_length=run.sequence_length)
    canary_ids, canary_padding, canary_private = _padded_rows(canary_rows, pad_id)
    canaries = AuditTarget(
        name=target.name,
        token_ids=canary_ids,
        padding_mask=canary_padding,
        private_mask=canary_private,
        data=f"{sources.canaries} ({len(canary_rows.ids)} canary chats)",
        **common,
    )
    return target, canaries


def _span_counts(target: AuditTarget, config: NoiseConfig) -> list[list[int]]:
    from nemo_noise_plugin.privacy.audit import noised_tokens
    from nemo_noise_plugin.privacy.span_ledger import protected_span_counts

    masks = dict(padding_mask=target.padding_mask, private_mask=target.private_mask)
    return protected_span_counts(target.private_mask, noised_tokens(config, target.token_ids, **masks))


def add_span_results(
    report: dict[str, Any],
    target: AuditTarget,
    canaries: AuditTarget | None,
    sweep: Callable[[AuditTarget], dict[str, Any]],
    epochs: int,
) -> None:
    """Add to a span run's sweep ``report``: ``protected`` (what was attacked: the private-span tokens, their spans
    and chats), each row's ``span_ledger`` (``span_ledger_summary`` over the audited chats' spans at ``epochs``), and
    ``canaries`` (``sweep`` of the canary target: its rows' recovery; None without canaries)."""
    from nemo_noise_plugin.privacy.span_ledger import span_ledger, span_ledger_summary

    hidden = target.table.size(1)
    for row in report["rows"]:
        config = NoiseConfig(**row["noise_config"])
        row["span_ledger"] = span_ledger_summary(
            span_ledger(config, _span_counts(target, config), epochs=epochs, hidden_size=hidden)
        )
    first = NoiseConfig(**report["rows"][0]["noise_config"]) if report["rows"] else None
    counts = _span_counts(target, first) if first is not None else []
    report["protected"] = {
        "tokens": "private-span tokens (NoiseConfig.tokens='spans'): the only tokens noised and attacked",
        "span_tokens": report["tokens"],
        "spans": sum(len(row) for row in counts),
        "chats": int(target.token_ids.size(0)),
    }
    if canaries is None:
        report["canaries"] = None
        return
    canary_report = sweep(canaries)
    report["canaries"] = {
        "data": canaries.data,
        "span_tokens": canary_report["tokens"],
        "distinct_ids": canary_report["distinct_ids"],
        "rows": [
            {key: row[key] for key in ("mechanism", "field", "level", "attack", "recovery")}
            for row in canary_report["rows"]
        ],
    }


def format_span_results(report: dict[str, Any]) -> str:
    """The protected tokens, each row's epsilon per span and example, and the canaries' recovery, in plain text."""
    protected = report["protected"]
    lines = [
        f"attacked: {protected['span_tokens']} private-span tokens ({protected['spans']} spans in "
        f"{protected['chats']} chats); every other token is clean and not counted"
    ]
    for row in report["rows"]:
        ledger = row["span_ledger"]
        spread = ledger["per_span_epsilon"]
        lines.append(
            f"{row['mechanism']} {row['field']}={row['level']:g} {row['attack']}: epsilon per span median "
            f"{_shown(spread['median'])}, max {_shown(spread['max'])}; per example median "
            f"{_shown(ledger['per_example_epsilon']['median'])} ({ledger['epochs']} epoch(s))"
        )
    canaries = report.get("canaries")
    if canaries is not None:
        lines.append(f"canaries: {canaries['span_tokens']} private-span tokens from {canaries['data']}")
        for row in canaries["rows"]:
            overall = row["recovery"]["overall"]
            lines.append(
                f"  {row['mechanism']} {row['field']}={row['level']:g} {row['attack']}: recovery "
                f"{100 * overall['rate']:.1f} % [{100 * overall['ci_low']:.1f}, {100 * overall['ci_high']:.1f}]"
            )
    return "\n".join(lines)


def _shown(value: float | None) -> str:
    return "unbounded" if value is None else f"{value:.4g}"
