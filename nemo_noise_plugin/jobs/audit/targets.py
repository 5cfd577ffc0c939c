"""The audit targets: the models ``nemo noise audit`` attacks (embedding table, held-out text, task loss, LM prior).

``privacy.audit`` attacks a table; this module supplies what needs a model: ``tiny_target`` (a randomly initialised
tiny Megatron-Core GPT on the CPU, offline, with the held-out loss measured like ``robustness.robustness_curve``:
a frozen copy made noisy, in eval mode) and ``smollm2_target`` (the real SmolLM2-135M-Instruct table, read from the
HF folder it is given, with transformers' model on the CPU for the held-out loss, noise added to ``inputs_embeds``
by the plugin's noise layer, and for the LM prior). What is audited comes from ``jobs.audit.data``.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

import torch

from nemo_noise_plugin.data.corpus import CORPUS_VOCAB_SIZE, END_OF_DOCUMENT, load_corpus_tokens
from nemo_noise_plugin.jobs.audit.data import (
    AUDIT_DATA,
    DATA_SEED,
    answer_spans,
    audit_data_rows,
    chat_texts,
    check_audit_data,
    padded,
    row_text,
    take_tokens,
    uniform_sequences,
)
from nemo_noise_plugin.jobs.audit.run_folder import check_hf_dir
from nemo_noise_plugin.jobs.reports.robustness import logits_of
from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.privacy.audit.beam import LmLogProbs
from nemo_noise_plugin.privacy.audit.sweep import TaskLoss

__all__ = [
    "MODELS",
    "TINY_AUDIT_MODEL",
    "AuditTarget",
    "hf_exact_match",
    "hf_lm_prior",
    "hf_task_loss",
    "load_hf_model",
    "smollm2_target",
    "tiny_target",
]

MODELS: tuple[str, ...] = ("tiny", "smollm2")
"""The models ``nemo noise audit`` attacks (``model=``)."""
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
    private_mask: torch.Tensor | None = None
    """``[b, s]`` True inside a private span (``tokens='spans'``: the protected tokens, the only ones attacked)."""
    data: str = ""
    """Where the audited tokens come from, in words (the report's ``data``)."""


# The tiny Megatron-Core GPT


def _tiny_gpt(seed: int) -> torch.nn.Module:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from nemo_noise_plugin.jobs.cpu import init_cpu_parallel
    from nemo_noise_plugin.recipes.common import CUDA_FREE_SETTINGS

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
        sequences = uniform_sequences([i for i in range(CORPUS_VOCAB_SIZE) if i != END_OF_DOCUMENT], tokens, max_length)
        described = f"{AUDIT_DATA['uniform']} ({CORPUS_VOCAB_SIZE - 1} ids, seed {DATA_SEED})"
    else:
        available = corpus[: corpus.numel() - held_out.numel()].tolist()
        windows = [available[start : start + max_length] for start in range(0, len(available), max_length)]
        sequences = take_tokens(windows, tokens, max_length, "the embedded corpus")
        described = AUDIT_DATA["corpus"]
    token_ids, padding = padded(sequences, END_OF_DOCUMENT)
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


def hf_exact_match(
    model: Any,
    table: torch.Tensor,
    ids: torch.Tensor,
    padding: torch.Tensor,
    answers: list[tuple[int, int]],
    private_mask: torch.Tensor | None = None,
) -> TaskLoss:
    """Held-out exact match of transformers' ``model`` with the noise on its input embeddings: row ``i`` of ``ids``
    counts when the argmax at every position of its answer ``answers[i]`` (``[start, end)``, teacher-forced) is the
    reference token, i.e. greedy decoding reproduces the answer and then ends the turn (as ``task_metric.
    exact_match`` computes it for Megatron models). ``private_mask`` is the rows' for ``tokens='spans'``."""
    from nemo_noise_plugin.privacy.audit import noised_embeddings

    def exact_match(config: NoiseConfig) -> float:
        with torch.no_grad():
            embeds = noised_embeddings(table, ids, config, padding_mask=padding, private_mask=private_mask)
            predicted = model(inputs_embeds=embeds, attention_mask=(~padding).long()).logits.argmax(-1)
        correct = [
            bool((predicted[row, start - 1 : end - 1] == ids[row, start:end]).all())
            for row, (start, end) in enumerate(answers)
        ]
        return sum(correct) / len(correct)

    return exact_match


def hf_task_loss(
    model: Any, table: torch.Tensor, ids: torch.Tensor, padding: torch.Tensor, private_mask: torch.Tensor | None = None
) -> TaskLoss:
    """``config -> `` held-out next-token loss of transformers' ``model`` over every real next token of ``ids``, with
    the noise on its input embeddings (``private_mask`` the rows' for ``tokens='spans'``)."""
    from nemo_noise_plugin.privacy.audit import noised_embeddings

    def task_loss(config: NoiseConfig) -> float:
        with torch.no_grad():
            embeds = noised_embeddings(table, ids, config, padding_mask=padding, private_mask=private_mask)
            logits = model(inputs_embeds=embeds, attention_mask=(~padding).long()).logits.float()
            log_probs = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
            mask = (~padding[:, 1:]).float()
            return float(-(log_probs * mask).sum() / mask.sum())

    return task_loss


def hf_lm_prior(model: Any) -> LmLogProbs:
    """``prefix -> [rows, V]`` next-token log-probabilities of transformers' ``model`` (the beam attack's prior)."""

    def lm_log_probs(prefix: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return model(input_ids=prefix).logits[:, -1].float().log_softmax(-1)

    return lm_log_probs


def load_hf_model(hf_dir: str | os.PathLike[str] | None) -> tuple[Any, torch.Tensor, Any, Any]:
    """The folder (SmolLM2-135M-Instruct's converted one for None), its float32 input embedding table, tokenizer and
    transformers model (CPU, eval mode)."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nemo_noise_plugin.jobs.models.smollm2_folder import ensure_smollm2_hf

    folder = ensure_smollm2_hf() if hf_dir is None else check_hf_dir(str(hf_dir))
    with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
        table = handle.get_tensor("model.embed_tokens.weight").float()
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    return folder, table, tokenizer, model


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
    check_audit_data(data, "smollm2")
    folder, table, tokenizer, model = load_hf_model(hf_dir)
    texts = chat_texts(tokenizer, held_out)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 2
    special_ids = sorted(set(tokenizer.all_special_ids))
    if data == "uniform":
        eligible = [i for i in range(min(len(tokenizer), table.size(0))) if i not in set(special_ids)]
        sequences = uniform_sequences(eligible, tokens, max_length)
        described = f"{AUDIT_DATA['uniform']} ({len(eligible)} ids, seed {DATA_SEED})"
    elif data == "validation":
        sequences = take_tokens(
            texts[task_sequences:], tokens, max_length, f"the validation chats after {task_sequences}"
        )
        described = f"{AUDIT_DATA['validation'].split(' (')[0]} {task_sequences + 1}-{len(texts)}"
    else:
        rows = audit_data_rows(data)
        encoded = [tokenizer(row_text(row, tokenizer), add_special_tokens=False)["input_ids"] for row in rows]
        sequences = take_tokens(encoded, tokens, max_length, f"data={data!r}")
        described = f"{data} ({len(rows)} rows)"
    token_ids, padding = padded(sequences, pad_id)
    held_ids, held_padding = padded([text[:max_length] for text in texts[:task_sequences]], pad_id)
    answered, answers = answer_spans(tokenizer, held_out)
    if not answered:
        raise ValueError(
            f"held-out chats {held_out or 'validation'!r} hold no chat that splits at its answer: expected "
            '{"messages": [..., {"role": "assistant", ...}]} rows.'
        )
    answer_ids, answer_padding = padded(answered, pad_id)
    return AuditTarget(
        name="smollm2" if hf_dir is None else f"smollm2 ({folder})",
        table=table,
        token_ids=token_ids,
        padding_mask=padding,
        special_ids=special_ids,
        task_loss=hf_task_loss(model, table, held_ids, held_padding),
        lm_log_probs=hf_lm_prior(model),
        task_loss_note=(
            f"held-out next-token loss of {folder.name} (transformers, CPU) on {task_sequences} held-out chats, and "
            f"held-out exact match (greedy, teacher-forced) on {held_out or 'the instruction set validation split'}, "
            "with the noise on inputs_embeds"
        ),
        task_exact_match=hf_exact_match(model, table, answer_ids, answer_padding, answers),
        data=described,
    )
