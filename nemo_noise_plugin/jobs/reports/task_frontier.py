"""The privacy frontier point of a trained instruction model: task score and token recovery at its own noise.

``frontier_point`` measures, at the run's own noise on the inputs at inference, the held-out exact match
(``task_metric.exact_match``), the privacy audit's token recovery on the trained embedding table over noised
held-out tokens (``input_embedding_table``, all-gathered over tensor parallelism) and the ledger's epsilon; the
task report writes it as ``frontier``. A run with ``NoiseConfig.tokens='spans'`` is noised and audited on its
private spans only (the batches' ``private_mask``), with the ledger's epsilon per span and per example.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from nemo_noise_plugin.jobs.cpu.parallel import causal_attention_mask
from nemo_noise_plugin.jobs.reports.task_metric import exact_match

__all__ = [
    "FRONTIER_ATTACKS",
    "FRONTIER_TOKENS",
    "format_frontier",
    "frontier_point",
    "input_embedding_table",
    "noise_level",
]

FRONTIER_TOKENS = 256
"""Held-out tokens (at least; whole rows) the task report's frontier point audits: cheap beside the exact match."""
FRONTIER_ATTACKS: tuple[str, ...] = ("nn_l2", "nn_cosine", "lm_beam")
"""The frontier point's attacks; ``lm_beam`` has the trained model itself (noise off) as its language-model prior."""


def input_embedding_table(model: nn.Module) -> torch.Tensor:
    """The whole ``[V, h]`` input embedding table of a model chunk (vocabulary-parallel shards all-gathered)."""
    from megatron.core import parallel_state

    shard = model.embedding.word_embeddings.weight.detach().float()
    if not parallel_state.model_parallel_is_initialized():
        return shard
    group = parallel_state.get_tensor_model_parallel_group()
    if torch.distributed.get_world_size(group) == 1:
        return shard
    parts = [torch.empty_like(shard) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(parts, shard.contiguous(), group=group)
    return torch.cat(parts)


def _held_out_tokens(
    batches: Sequence[dict[str, Any]], tokens: int, pad_id: int, spans: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Whole rows of ``batches`` (right-padded with ``pad_id`` to one width) until they hold ``tokens`` real tokens
    (a row's real tokens end at its last loss-carrying position, as the noise layer counts them), or with ``spans``
    ``tokens`` private-span tokens (the batches' ``private_mask``); ids, loss mask, private mask (None without
    ``spans``)."""
    rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
    total = 0
    for batch in batches:
        private = batch.get("private_mask") if spans else None
        for index, (ids, mask) in enumerate(zip(batch["tokens"], batch["loss_mask"], strict=True)):
            carrying = mask.nonzero()
            if spans:
                total += int(private[index].sum())
            else:
                total += int(carrying.max()) + 1 if len(carrying) else mask.numel()
            rows.append((ids, mask, None if private is None else private[index]))
            if total >= tokens:
                break
        if total >= tokens:
            break
    width = max(row.numel() for row, _, _ in rows)
    device = rows[0][0].device
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long, device=device)
    loss_mask = torch.zeros(len(rows), width, dtype=torch.float32, device=device)
    private_mask = torch.zeros(len(rows), width, dtype=torch.bool, device=device) if spans else None
    for index, (row, mask, private_row) in enumerate(rows):
        ids[index, : row.numel()], loss_mask[index, : mask.numel()] = row, mask.float()
        if private_mask is not None:
            private_mask[index, : private_row.numel()] = private_row.bool()
    return ids, loss_mask, private_mask


def _lm_prior(model: nn.Module) -> Any:
    """``prefix [rows, t] -> [rows, V]`` next-token log-probabilities of a Megatron model chunk (the beam's prior)."""

    def log_probs(prefix: torch.Tensor) -> torch.Tensor:
        width = prefix.size(1)
        positions = torch.arange(width, device=prefix.device).unsqueeze(0).expand_as(prefix)
        mask = causal_attention_mask(width).to(prefix.device) if prefix.device.type == "cpu" else None
        with torch.no_grad():
            return model(prefix, positions, mask)[:, -1].float().log_softmax(-1)

    return log_probs


def noise_level(noise: Any) -> str:
    """``gaussian_mechanism epsilon=50``: the mechanism and the field that sets its level."""
    from nemo_noise_plugin.privacy.audit.sweep import Sweep

    level = Sweep.at_level_of(noise)
    return f"{level.mechanism} {level.field}={level.levels[0]:g}"


def frontier_point(
    model: nn.Module,
    batches: dict[str, list[dict[str, Any]]],
    noise: Any,
    eos_id: int,
    *,
    sequence_length: int,
    epochs: int = 1,
    tokens: int = FRONTIER_TOKENS,
    attacks: Sequence[str] = FRONTIER_ATTACKS,
) -> dict[str, Any]:
    """Where a trained model stands between task and privacy at its own noise ``noise`` (JSON-serialisable).

    ``exact_match``/``splits``: held-out exact match (``exact_match``) of a frozen copy of ``model`` with ``noise``
    on its inputs in eval mode (``make_noisy`` with ``training_only=False``, constant schedule: the full level);
    ``recovery``: each attack's token recovery rate by ``privacy.audit.audit`` on ``model``'s input embedding table
    over at least ``tokens`` held-out tokens of the first split, counting only the tokens that received noise
    (``audited_tokens``, ``distinct_ids``; the whole audit under ``audit``); with ``tokens='spans'`` the rows
    until they hold ``tokens`` private-span tokens, noised through the batches' ``private_mask`` and recovered on
    those tokens only, and ``protected`` has the span count and ``span_ledger`` (``privacy.span_ledger``: epsilon
    per span and per example at ``epochs``); ``per_token_epsilon``,
    ``per_sequence_epsilon`` and ``ledger``: ``privacy_ledger`` at ``sequence_length`` and ``epochs`` (None where
    the mechanism has no formal guarantee). ``model`` is not modified. Example::

        point = frontier_point(model, {"validation": batches}, noise, eos_id, sequence_length=128)
        point["exact_match"], point["recovery"]["nn_l2"], point["per_sequence_epsilon"]
    """
    from nemo_noise_plugin.distillation.teacher import build_clean_teacher
    from nemo_noise_plugin.model.make_noisy import make_noisy
    from nemo_noise_plugin.privacy.audit import audit, noised_tokens
    from nemo_noise_plugin.privacy.ledger import privacy_ledger
    from nemo_noise_plugin.privacy.span_ledger import protected_span_counts, span_ledger, span_ledger_summary

    inference = dataclasses.replace(noise, training_only=False, schedule="constant", warmup_steps=0)
    clean = build_clean_teacher(model)
    noisy = make_noisy(build_clean_teacher(clean), inference).eval()
    splits = {}
    for split, split_batches in batches.items():
        accuracy, per_task, _ = exact_match(noisy, split_batches, eos_id, noise_inputs=True)
        splits[split] = {"exact_match": accuracy, "per_task": per_task}
    del noisy
    spans = inference.tokens == "spans"
    ids, loss_mask, private = _held_out_tokens(next(iter(batches.values())), tokens, eos_id, spans)
    table = input_embedding_table(model)
    prior = _lm_prior(clean) if "lm_beam" in attacks else None
    masks = dict(loss_mask=loss_mask, private_mask=private)
    report = audit(table, ids, inference, tuple(attacks), prior, noised_only=True, **masks)
    ledger = privacy_ledger(inference, sequence_length=sequence_length, epochs=epochs, hidden_size=table.size(1))
    protected: dict[str, Any] = {"tokens": "held-out tokens that received noise"}
    if spans:
        counts = protected_span_counts(private, noised_tokens(inference, ids, **masks))
        summary = span_ledger_summary(span_ledger(inference, counts, epochs=epochs, hidden_size=table.size(1)))
        protected = {"tokens": "private-span tokens", "spans": summary["spans"], "span_ledger": summary}

    def entries(guarantees: Sequence[Any]) -> list[dict[str, Any]]:
        return [{"epsilon": g.epsilon, "delta": g.delta, "how": g.how} for g in guarantees]

    return {
        "noise": noise_level(inference),
        "noise_config": dataclasses.asdict(inference),
        **splits[next(iter(splits))],
        "splits": splits,
        "recovery": {name: result["overall"]["rate"] for name, result in report["attacks"].items()},
        "protected": protected,
        "audited_tokens": report["tokens"]["real"],
        "distinct_ids": report["tokens"]["distinct_ids"],
        "per_token_epsilon": ledger.per_token[0].epsilon if ledger.per_token else None,
        "per_sequence_epsilon": ledger.per_sequence[0].epsilon if ledger.per_sequence else None,
        "ledger": {
            "per_token": entries(ledger.per_token),
            "per_sequence": entries(ledger.per_sequence),
            "sequence_length": sequence_length,
            "epochs": epochs,
            "assumptions": list(ledger.assumptions),
        },
        "audit": {key: value for key, value in report.items() if key != "noise_config"},
    }


def format_frontier(point: dict[str, Any], clean: dict[str, Any]) -> str:
    """The frontier point in one line, beside the clean exact match ``clean`` (the task report's ``after``)."""

    def epsilon(value: float | None) -> str:
        return "none (no formal guarantee)" if value is None else f"{value:.3g}"

    scores = ", ".join(f"{split} {result['exact_match']:.3f}" for split, result in point["splits"].items())
    rates = ", ".join(f"{name} {100 * rate:.1f} %" for name, rate in point["recovery"].items() if rate is not None)
    ledger = point["ledger"]
    epochs = f"{ledger['epochs']} epoch{'s' if ledger['epochs'] != 1 else ''}"
    protected = point.get("protected") or {}
    spans = protected.get("span_ledger")
    if spans is not None:
        audited = f"{point['audited_tokens']} noised private-span tokens ({protected['spans']} spans, "
        budget = (
            f"per span {epsilon(spans['per_span_epsilon']['median'])} (median, {spans['span_tokens']['median'] or 0:g} "
            f"tokens), per example {epsilon(spans['per_example_epsilon']['median'])} (median; {epochs})"
        )
    else:
        audited = f"{point['audited_tokens']} noised held-out tokens ("
        budget = f"per sequence {epsilon(point['per_sequence_epsilon'])} (L={ledger['sequence_length']}, {epochs})"
    return (
        f"frontier point ({point['noise']}, on the inputs at inference): held-out exact match {scores} (clean "
        f"{clean['exact_match']:.3f}); token recovery over {audited}{point['distinct_ids']} distinct ids): "
        f"{rates or 'no noised token'}; epsilon per token {epsilon(point['per_token_epsilon'])}, {budget}"
    )
