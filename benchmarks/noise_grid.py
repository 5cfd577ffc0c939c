"""What noise training buys on SmolLM2-135M-Instruct: the NEFTune grid and the privacy-utility frontier (issue 25).

One driver runs a whole grid of fine-tuning runs ("cells") through Megatron-Bridge's own training loop on one GPU,
several cells at a time (each its own process, its own port: the 135M model is launch-bound, so concurrent processes
fill the GPU), and resumes a partial grid: a cell whose ``result.json`` exists is skipped, and cells that would not
finish before ``--deadline-s`` are not started. Every cell is the SmolLM2 SFT recipe on the shipped instruction set
(``recipes/smollm2.instruction_finetuning_config``: Bridge's finetuning data pipeline, chat template, loss on the
answers), ``--epochs`` passes over the 4,400 training chats, and its seed sets the data order
(``dataset.seed``), the initialisation-independent randomness (``rng.seed``) and the training noise
(``NoiseConfig.seed``), so noise-free training has a spread too. At the end of training a Bridge callback scores
the trained model (``evaluate_cell``) and writes ``<out>/<cell>/result.json``.

Grids (``cells_for``):

- ``neftune``: ``plain`` and NEFTune (uniform noise on every input token) alpha 5 / 10 / 15 with true lengths, and
  alpha 5 with HF's padded length. Scored: noise-off training loss (first ``TRAIN_SCORED`` training chats),
  held-out loss and exact match per task (validation and test), and free-running greedy answers on the test split
  (length in tokens, verbatim copies of a training answer at ROUGE-L >= 0.9, 2-gram repetition).
- ``frontier``: the Gaussian mechanism on clipped embeddings (per-token eps 100 / 50 / 20, delta 1e-5) and metric-DP
  d_chi (eta 100 / 30; eta 50 with model b only, ``WITHOUT_KD_CELLS``), both at ``clip_norm`` ``CLIP_NORM``, on the
  prompt's tokens (``tokens="prompt"``: the user's question and the template text; the chat markers, special ids,
  and the model's own answer are not noised). Per
  level: ``<level>`` is fine-tuned with that noise (model b), ``<level>_kd`` the same plus forward-KL distillation
  from the seed's clean fine-tuned ``plain`` model (model c; ``teacher_checkpoint``); ``plain`` is model a, and
  model a without noise is the ceiling d. Each is scored under its level's noise on its inputs at inference
  (exact match and loss), and the nearest-neighbour (L2, cosine) and LM-prior beam attacks recover the noised
  prompt tokens of held-out chats from its own embedding table at that level (Wilson 95 % intervals).

    python benchmarks/noise_grid.py run --grid frontier,neftune --seeds 1,2,3 --out /tmp/grid --parallel 8 \\
        --deadline-s 540 [--hf-path DIR]
    python benchmarks/noise_grid.py summarize --out benchmarks/results/noise_grid
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks.*, from a checkout

SEQ, GLOBAL_BATCH, MICRO_BATCH, LR = 128, 64, 64, 2e-4
TRAIN_CHATS = 4400
TRAIN_SCORED = 448
"""The first training chats (file order) whose noise-off loss measures fitting (NEFTune's 'training loss')."""
ATTACK_CHATS = 48
"""Held-out test chats whose noised prompt tokens the attacks try to recover."""
CLIP_NORM = 3.0
"""SmolLM2's median embedding row norm is 3.15 (docs/privacy.md): clipping at 3 keeps most rows' scale."""
EVAL_NOISE_SEED = 777
MAX_NEW_TOKENS = 64

NEFTUNE_VARIANTS: dict[str, dict[str, Any] | None] = {
    "plain": None,
    "neftune_a5": dict(mechanism="uniform", alpha=5.0, scaling="true_length"),
    "neftune_a10": dict(mechanism="uniform", alpha=10.0, scaling="true_length"),
    "neftune_a15": dict(mechanism="uniform", alpha=15.0, scaling="true_length"),
    "neftune_a5_padded": dict(mechanism="uniform", alpha=5.0, scaling="padded_length"),
}
_PRIVATE = dict(clip_norm=CLIP_NORM, tokens="prompt")
FRONTIER_LEVELS: dict[str, dict[str, Any]] = {
    "gm_eps100": dict(mechanism="gaussian_mechanism", epsilon=100.0, delta=1e-5, **_PRIVATE),
    "gm_eps50": dict(mechanism="gaussian_mechanism", epsilon=50.0, delta=1e-5, **_PRIVATE),
    "gm_eps20": dict(mechanism="gaussian_mechanism", epsilon=20.0, delta=1e-5, **_PRIVATE),
    "mdp_eta100": dict(mechanism="metric_dp", eta=100.0, **_PRIVATE),
    "mdp_eta30": dict(mechanism="metric_dp", eta=30.0, **_PRIVATE),
    "mdp_eta50": dict(mechanism="metric_dp", eta=50.0, **_PRIVATE),
}
WITHOUT_KD_CELLS = frozenset({"mdp_eta50"})
"""Levels fine-tuned with noise (model b) but not distilled (no model c): the band probe between metric-DP eta 30
(nearest neighbour recovers 33 % of the question tokens) and eta 100 (99.8 %), added in the second GPU window."""


@dataclass(frozen=True)
class Cell:
    """One fine-tuning run of a grid: a variant at a seed."""

    variant: str
    seed: int
    noise: dict[str, Any] | None = None
    """``NoiseConfig`` fields of the training noise (None: plain fine-tuning, noise off)."""
    kd: bool = False
    """Distil from the seed's ``plain`` cell (its final checkpoint as ``teacher_checkpoint``)."""
    neftune_scores: bool = False
    """Score free-running answers (length, copying, repetition)."""
    frontier_levels: tuple[str, ...] = ()
    """``FRONTIER_LEVELS`` this cell is scored under (noise on its inputs at inference) and attacked at."""
    save: bool = False
    """Keep the final checkpoint (a teacher for other cells)."""

    @property
    def name(self) -> str:
        return f"{self.variant}_s{self.seed}"

    @property
    def teacher(self) -> str | None:
        return f"plain_s{self.seed}" if self.kd else None


def cells_for(grids: Sequence[str], seeds: Sequence[int]) -> list[Cell]:
    """The cells of ``grids`` at ``seeds``, in the order they run: every variant's seeds together, the plain
    models first (the teachers), then one privacy level's noise-aware and distilled models, then one NEFTune alpha,
    and so on, so that a partial grid holds whole variants."""
    unknown = sorted(set(grids) - {"neftune", "frontier"})
    if unknown:
        raise SystemExit(f"--grid {','.join(grids)} is invalid: {unknown} are not grids (expected neftune, frontier)")
    frontier = "frontier" in grids
    variants: list[Cell] = [
        Cell(
            "plain",
            0,
            neftune_scores="neftune" in grids,
            frontier_levels=tuple(FRONTIER_LEVELS) if frontier else (),
            save=frontier,
        )
    ]
    neftune = [Cell(name, 0, noise=noise, neftune_scores=True) for name, noise in NEFTUNE_VARIANTS.items() if noise]
    private = []
    for level, noise in FRONTIER_LEVELS.items():
        private.append(Cell(level, 0, noise=noise, frontier_levels=(level,)))
        if level not in WITHOUT_KD_CELLS:
            private.append(Cell(f"{level}_kd", 0, noise=noise, kd=True, frontier_levels=(level,)))
    rest = []
    while neftune or private:  # interleave: a privacy level's cells, one NEFTune cell
        level_cells = 1 if private and private[0].variant in WITHOUT_KD_CELLS else 2
        rest.extend(private[:level_cells] if frontier else [])
        private = private[level_cells:]
        rest.extend(neftune[:1] if "neftune" in grids else [])
        neftune = neftune[1:]
    variants.extend(rest)
    return [dataclasses.replace(cell, seed=seed) for cell in variants for seed in seeds]


# ----------------------------------------------------------------------------------------------- scoring (in a cell)


def _eos_id(state: Any) -> int:
    from nemo_noise_plugin.jobs.batches import recipe_tokenizer

    return int(recipe_tokenizer(state).eod)


def _forward(model: Any, batch: dict[str, Any]) -> Any:
    import torch

    from nemo_noise_plugin.jobs.cpu.parallel import causal_attention_mask

    tokens = batch["tokens"]
    mask = batch.get("attention_mask")
    if mask is None and tokens.device.type == "cpu":
        mask = causal_attention_mask(tokens.size(1))
    positions = torch.arange(tokens.size(1), device=tokens.device).unsqueeze(0).expand_as(tokens)
    return model(tokens, positions, mask)


def score_batches(model: Any, batches: Sequence[dict[str, Any]], eos_id: int, noise: Any = None) -> dict[str, Any]:
    """Exact match (greedy, teacher-forced: every answer position's argmax is the reference, through the
    end-of-turn token) overall and per task, and the loss in nats per answer token, of ``model`` on ``batches``;
    with ``noise`` (a ``NoiseConfig`` active in eval mode) the noise is on the model's inputs (a noisy copy)."""
    import torch

    from nemo_noise_plugin.distillation.teacher import build_clean_teacher
    from nemo_noise_plugin.jobs.reports.task_metric import answer_positions
    from nemo_noise_plugin.model.make_noisy import make_noisy

    scored = model
    if noise is not None:
        scored = make_noisy(build_clean_teacher(model), noise)
    scored.eval()
    hits, tasks, loss, tokens = [], [], 0.0, 0
    with torch.no_grad():
        for index, batch in enumerate(batches):
            if noise is not None:
                scored.noise_clock.start_iteration(index)
                with scored.noise_batch_inputs(batch["loss_mask"]):
                    logits = _forward(scored, batch).float()
            else:
                logits = _forward(scored, batch).float()
            mask = batch["loss_mask"].float()
            picked = logits.log_softmax(-1).gather(-1, batch["labels"].long().unsqueeze(-1)).squeeze(-1)
            loss += float(-(picked * mask).sum())
            tokens += int(mask.sum())
            predicted = logits.argmax(-1)
            metadata = batch.get("metadata") or [{}] * len(predicted)
            for row, positions in enumerate(answer_positions(batch["labels"], batch["loss_mask"], eos_id)):
                hits.append(bool(torch.equal(predicted[row, positions], batch["labels"][row, positions])))
                tasks.append(metadata[row].get("task", "all"))
    per_task = {t: sum(h for h, k in zip(hits, tasks, strict=True) if k == t) / tasks.count(t) for t in set(tasks)}
    return {
        "exact_match": sum(hits) / len(hits),
        "examples": len(hits),
        "per_task": dict(sorted(per_task.items())),
        "loss": loss / max(tokens, 1),
        "hits": hits,
    }


def prompts_and_answers(batches: Sequence[dict[str, Any]], eos_id: int) -> list[tuple[list[int], list[int], str]]:
    """Per example of SFT ``batches``: the prompt's token ids (through the generation prompt), the reference answer's
    ids (without the end-of-turn token) and the task."""
    from nemo_noise_plugin.jobs.reports.task_metric import answer_positions

    examples = []
    for batch in batches:
        metadata = batch.get("metadata") or [{}] * batch["tokens"].size(0)
        for row, positions in enumerate(answer_positions(batch["labels"], batch["loss_mask"], eos_id)):
            start = int(positions[0])
            answer = [int(t) for t in batch["labels"][row, positions].tolist() if int(t) != eos_id]
            examples.append((batch["tokens"][row, : start + 1].tolist(), answer, metadata[row].get("task", "all")))
    return examples


def greedy_answers(
    model: Any, prompts: Sequence[Sequence[int]], eos_id: int, *, max_new_tokens: int, batch_size: int, device: Any
) -> list[list[int]]:
    """Free-running greedy answers of a Megatron model chunk, batched with right padding (full recompute per step;
    causal attention keeps each row's earlier positions independent of the padding): the new ids up to ``eos_id``
    (excluded), at most ``max_new_tokens`` and never past the model's ``max_sequence_length``."""
    import torch
    from megatron.core.utils import unwrap_model

    limit = getattr(unwrap_model(model), "max_sequence_length", None)

    answers: list[list[int]] = []
    model.eval()
    for first in range(0, len(prompts), batch_size):
        rows = [list(p) for p in prompts[first : first + batch_size]]
        lengths = torch.tensor([len(r) for r in rows], device=device)
        width = int(lengths.max()) + max_new_tokens
        width = min(width, limit) if limit else width
        tokens = torch.zeros(len(rows), width, dtype=torch.long, device=device)
        for index, row in enumerate(rows):
            tokens[index, : len(row)] = torch.tensor(row, device=device)
        done = torch.zeros(len(rows), dtype=torch.bool, device=device)
        new: list[list[int]] = [[] for _ in rows]
        with torch.no_grad():
            for _ in range(max_new_tokens):
                used = int(lengths.max())
                logits = _forward(model, {"tokens": tokens[:, :used]})
                next_ids = logits[torch.arange(len(rows), device=device), lengths - 1].argmax(-1)
                for index in (~done).nonzero().flatten().tolist():
                    token = int(next_ids[index])
                    if token == eos_id or int(lengths[index]) >= width:
                        done[index] = True
                    else:
                        new[index].append(token)
                        tokens[index, lengths[index]] = token
                        lengths[index] += 1
                if bool(done.all()) or int(lengths.max()) >= width:
                    break
        answers.extend(new)
    return answers


def rouge_l(candidate: Sequence[int], reference: Sequence[int]) -> float:
    """ROUGE-L F1 of two token sequences (longest common subsequence)."""
    if not candidate or not reference:
        return float(list(candidate) == list(reference))
    previous = [0] * (len(reference) + 1)
    for token in candidate:
        current = [0]
        for index, other in enumerate(reference):
            current.append(previous[index] + 1 if token == other else max(previous[index + 1], current[index]))
        previous = current
    lcs = previous[-1]
    return 2 * lcs / (len(candidate) + len(reference))


def copies_a_training_answer(answer: Sequence[int], training: dict[int, set[tuple[int, ...]]]) -> bool:
    """Whether ``answer`` is ROUGE-L >= 0.9 to some training answer (``training``: the answers by length). F1 >= 0.9
    needs the shorter length to be at least 9/11 of the longer, so only those lengths are compared."""
    length = len(answer)
    if tuple(answer) in training.get(length, ()):
        return True
    low, high = math.ceil(length * 9 / 11), math.floor(length * 11 / 9)
    return any(
        rouge_l(answer, candidate) >= 0.9 for size in range(low, high + 1) for candidate in training.get(size, ())
    )


def repeated_bigram_fraction(answer: Sequence[int]) -> float | None:
    """1 - distinct 2-grams / 2-grams of ``answer`` (None below two tokens)."""
    grams = list(zip(answer, answer[1:], strict=False))
    return 1 - len(set(grams)) / len(grams) if grams else None


def answer_statistics(
    answers: Sequence[Sequence[int]],
    references: Sequence[Sequence[int]],
    tasks: Sequence[str],
    training: dict[int, set[tuple[int, ...]]],
) -> dict[str, Any]:
    """NEFTune's answer measurements: mean length in tokens, verbatim copies of a training answer (ROUGE-L >= 0.9;
    also those that are not the reference), 2-gram repetition, free-running exact match; overall and per task."""

    def summary(indices: list[int]) -> dict[str, Any]:
        copies = [copies_a_training_answer(answers[i], training) for i in indices]
        wrong_copies = [c and list(answers[i]) != list(references[i]) for c, i in zip(copies, indices, strict=True)]
        repeats = [r for r in (repeated_bigram_fraction(answers[i]) for i in indices) if r is not None]
        return {
            "answers": len(indices),
            "mean_length": statistics.fmean(len(answers[i]) for i in indices),
            "reference_length": statistics.fmean(len(references[i]) for i in indices),
            "copy_rate": sum(copies) / len(indices),
            "copy_not_reference_rate": sum(wrong_copies) / len(indices),
            "repeated_bigrams": statistics.fmean(repeats) if repeats else 0.0,
            "free_running_exact_match": sum(list(answers[i]) == list(references[i]) for i in indices) / len(indices),
        }

    result = summary(list(range(len(answers))))
    result["per_task"] = {task: summary([i for i, t in enumerate(tasks) if t == task]) for task in sorted(set(tasks))}
    return result


def level_config(level: str, *, inference: bool) -> Any:
    """The ``NoiseConfig`` of a ``FRONTIER_LEVELS`` level (``inference``: on in eval mode, fixed seed)."""
    from nemo_noise_plugin.noise.config import NoiseConfig

    extra = dict(training_only=False, seed=EVAL_NOISE_SEED) if inference else {}
    return NoiseConfig(**FRONTIER_LEVELS[level], **extra)


def attack_level(
    model: Any, batches: Sequence[dict[str, Any]], noise: Any, special_ids: Sequence[int], eos_id: int
) -> dict[str, Any]:
    """Token recovery of the noised prompt tokens of ``batches`` (first ``ATTACK_CHATS`` chats) by nearest neighbour
    (L2, cosine) and the LM-prior beam attack (candidates 8, beam 4; the prior is the model itself, clean), from
    the model's own embedding table under ``noise`` (the noise training and inference draw). Only tokens that
    received noise are counted."""
    import torch
    from megatron.core.utils import unwrap_model

    from nemo_noise_plugin.privacy.audit import noised_embeddings
    from nemo_noise_plugin.privacy.audit.attacks import nearest_neighbour_attack
    from nemo_noise_plugin.privacy.audit.beam import lm_beam_attack
    from nemo_noise_plugin.privacy.audit.statistics import wilson_interval

    examples = prompts_and_answers(batches, eos_id)[:ATTACK_CHATS]
    prompts = [prompt for prompt, _, _ in examples]
    width = max(len(p) for p in prompts)
    device = batches[0]["tokens"].device
    ids = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
    padding = torch.ones(len(prompts), width, dtype=torch.bool, device=device)
    for row, prompt in enumerate(prompts):
        ids[row, : len(prompt)] = torch.tensor(prompt, device=device)
        padding[row, : len(prompt)] = False
    loss_mask = torch.zeros_like(ids, dtype=torch.float32)  # the prompt: no loss tokens, all selected
    inner = unwrap_model(model)
    table = inner.embedding.word_embeddings.weight.detach().float()
    config = dataclasses.replace(noise, special_token_ids=list(special_ids))
    noised = noised_embeddings(table, ids, config, loss_mask=loss_mask, padding_mask=padding)
    got_noise = ((noised - table[ids]).abs().sum(-1) > 0) & ~padding
    true_ids = ids[got_noise]
    model.eval()

    def lm_log_probs(prefix: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return _forward(model, {"tokens": prefix})[:, -1].float().log_softmax(-1)

    guesses = {
        "nn_l2": nearest_neighbour_attack(noised[got_noise], table, "l2").ids.flatten(),
        "nn_cosine": nearest_neighbour_attack(noised[got_noise], table, "cosine").ids.flatten(),
        "lm_beam": lm_beam_attack(noised, table, config, lm_log_probs, loss_mask=loss_mask, padding_mask=padding)[
            got_noise
        ],
    }
    report = {
        "chats": len(prompts),
        "noised_tokens": int(got_noise.sum()),
        "distinct_ids": int(true_ids.unique().numel()),
    }
    for name, guess in guesses.items():
        correct = int((guess.to(true_ids.device) == true_ids).sum())
        low, high = wilson_interval(correct, int(true_ids.numel()))
        report[name] = {"recovery": correct / max(int(true_ids.numel()), 1), "interval": [low, high]}
    return report


def privacy_of(level: str, hidden_size: int, tokens_per_sequence: float) -> dict[str, Any]:
    """The privacy ledger's per-token and per-sequence guarantees of a level, for one inference pass over a prompt of
    the mean noised length (``privacy.ledger.privacy_ledger``, epochs=1)."""
    from nemo_noise_plugin.privacy.ledger import privacy_ledger

    config = level_config(level, inference=False)
    ledger = privacy_ledger(config, sequence_length=max(round(tokens_per_sequence), 1), hidden_size=hidden_size)
    first = lambda guarantees: guarantees[0] if guarantees else None  # noqa: E731
    token, sequence = first(ledger.per_token), first(ledger.per_sequence)
    return {
        "eps_per_token": token.epsilon if token else None,
        "eps_per_sequence": sequence.epsilon if sequence else None,
        "delta_per_sequence": sequence.delta if sequence else None,
        "sequence_tokens": ledger.sequence_length,
        "sigma": config.dp_sigma if config.mechanism == "gaussian_mechanism" else None,
    }


def evaluate_cell(model: Any, state: Any, cell: Cell) -> dict[str, Any]:
    """Every score of a trained cell (see the module docstring); JSON-serialisable."""
    import torch
    from megatron.core.utils import unwrap_model

    from nemo_noise_plugin.jobs.batches import collate, recipe_datasets, recipe_tokenizer
    from nemo_noise_plugin.jobs.reports.task_metric import task_batches

    inner = unwrap_model(model)
    device = next(inner.parameters()).device
    eos = _eos_id(state)
    held = task_batches(state, device)
    train, _, _ = recipe_datasets(_one_pass(state), unpacked=True)
    size = state.cfg.train.micro_batch_size
    train_batches = collate(train, max(TRAIN_SCORED // size, 1), size, None, device)
    started = time.perf_counter()
    result: dict[str, Any] = {"cell": dataclasses.asdict(cell), "name": cell.name}
    result["train_clean"] = _without_hits(score_batches(inner, train_batches, eos))
    result["clean"] = {split: score_batches(inner, batches, eos) for split, batches in held.items()}
    if cell.neftune_scores:
        examples = prompts_and_answers(held["test"], eos)
        training: dict[int, set[tuple[int, ...]]] = {}
        for _, answer, _ in prompts_and_answers(collate(train, len(train) // size, size, None, device), eos):
            training.setdefault(len(answer), set()).add(tuple(answer))
        answers = greedy_answers(
            inner, [p for p, _, _ in examples], eos, max_new_tokens=MAX_NEW_TOKENS, batch_size=size, device=device
        )
        result["answers_test"] = answer_statistics(
            answers, [a for _, a, _ in examples], [t for _, _, t in examples], training
        )
    if cell.frontier_levels:
        tokenizer = recipe_tokenizer(state)
        special = special_ids(tokenizer)
        result["frontier"] = {}
        for level in cell.frontier_levels:
            noise = dataclasses.replace(level_config(level, inference=True), special_token_ids=special)
            scored = {split: score_batches(inner, batches, eos, noise) for split, batches in held.items()}
            attacks = attack_level(inner, held["test"], noise, special, eos)
            noised_per_chat = attacks["noised_tokens"] / attacks["chats"]
            result["frontier"][level] = {
                "noised": scored,
                "attacks": attacks,
                "privacy": privacy_of(level, inner.config.hidden_size, noised_per_chat),
            }
    result["evaluation_seconds"] = time.perf_counter() - started
    result["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return result


def _one_pass(state: Any) -> Any:
    """``state`` with its training split read once, in file order (not the run's epochs)."""
    import copy

    view = copy.copy(state)
    view.cfg = copy.copy(state.cfg)
    view.cfg.dataset = dataclasses.replace(state.cfg.dataset, max_train_samples=None)
    return view


def special_ids(tokenizer: Any) -> list[int]:
    """The HF tokenizer's special ids (chat markers, end of text) under Bridge's tokenizer wrapper."""
    candidates, seen = [tokenizer], 0
    while seen < len(candidates) and seen < 6:  # Megatron's text tokenizer -> its library -> the HF tokenizer
        candidate = candidates[seen]
        seen += 1
        ids = getattr(candidate, "all_special_ids", None)
        if ids:
            return sorted({int(i) for i in ids})
        candidates += [getattr(candidate, name) for name in ("_tokenizer", "tokenizer") if hasattr(candidate, name)]
    raise ValueError(f"cannot find the special token ids of {type(tokenizer).__name__}")


def _without_hits(scores: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in scores.items() if key != "hits"}


# --------------------------------------------------------------------------------------------------- one cell's run


def cell_config(cell: Cell, out: Path, hf_path: str, epochs: float) -> Any:
    """The cell's Bridge ``ConfigContainer``: the SmolLM2 SFT (or distillation) recipe's config at the grid's
    batch, learning rate and length, seeded by the cell."""
    from nemo_noise_plugin.distillation.config import KDConfig
    from nemo_noise_plugin.noise.config import NoiseConfig
    from nemo_noise_plugin.recipes.smollm2 import instruction_finetuning_config, smollm2_provider

    noise = NoiseConfig(**cell.noise, seed=cell.seed) if cell.noise else NoiseConfig(enabled=False)
    provider, hf_path = smollm2_provider(hf_path, noise, KDConfig() if cell.kd else None)
    if cell.kd:
        provider.teacher_checkpoint = str(out / cell.teacher / "checkpoints")
    train_iters = max(round(epochs * TRAIN_CHATS / GLOBAL_BATCH), 1)
    config = instruction_finetuning_config(
        provider,
        hf_path,
        run_dir=str(out / cell.name / "run"),
        train_iters=train_iters,
        seq_length=SEQ,
        lr=LR,
        packed_sequence_size=None,
        global_batch_size=GLOBAL_BATCH,
        micro_batch_size=MICRO_BATCH,
    )
    config.dataset.seed = config.rng.seed = cell.seed
    config.dataset.max_train_samples = train_iters * GLOBAL_BATCH  # several passes over the training split
    shuffle_training_file(config.dataset.dataset_root, cell.seed)
    config.validation.eval_interval, config.validation.eval_iters = train_iters, 0
    config.logger.log_interval = 10
    if cell.save:
        config.checkpoint.save = str(out / cell.name / "checkpoints")
        config.checkpoint.save_interval = train_iters
        config.checkpoint.load = None
    else:
        config.checkpoint.save = config.checkpoint.load = None
    return config


def shuffle_training_file(data_dir: str, seed: int) -> None:
    """Put the run's ``training.jsonl`` in a seed's order (same chats), dropping Bridge's index of the old file.

    The seed must set the data order, and Bridge 0.6.2 does not: with ``max_train_samples`` its finetuning dataset
    draws the epochs from ``_OnlineSampleMapping(dataset_size, num_samples)``, built without the dataset's ``seed``
    (its own default, 1), so ``dataset.seed`` changes nothing and noise-free runs at different seeds are the same
    run (measured: the first grid's three plain seeds were bit-identical). Shuffling the file gives each seed its
    own order under the same mapping.
    """
    import random

    path = Path(data_dir) / "training.jsonl"
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    random.Random(seed).shuffle(lines)
    path.write_text("\n".join(lines) + "\n")
    for index in path.parent.glob("training.jsonl.idx*"):
        index.unlink()


def run_cell(cell: Cell, out: Path, hf_path: str, epochs: float) -> None:
    """Train one cell through Bridge's loop and write its ``result.json`` (atomically) from the end-of-training
    callback; the losses of every logged step are kept."""
    from nemo_noise_plugin.jobs.launch.launcher import forward_step_for, training_entry_for
    from nemo_noise_plugin.upstream.bridge_imports import import_bridge, use_prebuilt_dataset_helpers

    callbacks = import_bridge("megatron.bridge.training.callbacks")
    config = cell_config(cell, out, hf_path, epochs)
    losses: list[float] = []
    started = time.perf_counter()

    class Scores(callbacks.Callback):
        def on_train_step_end(self, context: Any) -> None:
            loss = (context.loss_dict or {}).get("lm loss")
            if loss is not None:
                losses.append(float(loss))

        def on_train_end(self, context: Any) -> None:
            result = evaluate_cell(context.model[0], context.state, cell)
            result.update(
                train_iters=config.train.train_iters,
                epochs=epochs,
                global_batch_size=GLOBAL_BATCH,
                lr=LR,
                seq_length=SEQ,
                losses=losses,
                wall_seconds=time.perf_counter() - started,
                noise_config=dataclasses.asdict(config.model.noise),
            )
            path = out / cell.name / "result.json"
            partial = path.with_suffix(".json.partial")
            partial.write_text(json.dumps(result, indent=1))
            partial.replace(path)

    use_prebuilt_dataset_helpers()
    training_entry_for(config)(config, forward_step_for(config), callbacks=[Scores()])


# ------------------------------------------------------------------------------------------------------- the driver


@dataclass
class Running:
    cell: Cell
    process: subprocess.Popen
    started: float
    log: Any = field(repr=False, default=None)


def run_grid(args: argparse.Namespace) -> int:
    """Run the grid's missing cells, ``--parallel`` at a time, until done or the deadline; returns 0 when the grid
    is complete, 3 when cells are left for the next call."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    seeds = [int(s) for s in args.seeds.split(",")]
    cells = cells_for(args.grid.split(","), seeds)
    done = lambda cell: (out / cell.name / "result.json").is_file()  # noqa: E731
    todo = [cell for cell in cells if not done(cell)]
    print(f"grid {args.grid} seeds {seeds}: {len(cells)} cells, {len(cells) - len(todo)} done, {len(todo)} to run")
    start = time.monotonic()
    running: list[Running] = []
    durations: dict[bool, list[float]] = {True: [], False: []}
    """Finished cells' wall times by ``Cell.save`` (the plain cells save a checkpoint and score every level)."""
    port = 29600
    failures = 0
    while todo or running:
        for item in list(running):
            code = item.process.poll()
            if code is None:
                continue
            running.remove(item)
            item.log.close()
            elapsed = time.monotonic() - item.started
            status = "done" if done(item.cell) else f"FAILED (exit {code}; see {item.cell.name}/cell.log)"
            if done(item.cell):
                durations[item.cell.save].append(elapsed)
            else:
                failures += 1
            print(f"[{time.monotonic() - start:6.0f} s] {item.cell.name}: {status} in {elapsed:.0f} s", flush=True)
        if failures >= 2 and not any(durations.values()) and not any(done(cell) for cell in cells):
            print("the first cells failed and none finished: stopping (see their cell.log)")
            for item in running:
                item.process.kill()
            break
        left = args.deadline_s - (time.monotonic() - start)

        def expected(cell: Cell) -> float:
            """The longest finished cell of its kind, else of any kind, else ``--expected-cell-s``."""
            seen = durations[cell.save] or durations[not cell.save]
            return max(seen) if seen else args.expected_cell_s

        busy = {item.cell.name for item in running}
        ready = [c for c in todo if c.teacher is None or (done(Cell("plain", c.seed)) and c.teacher not in busy)]
        names_left = {c.name for c in todo} | busy
        for cell in [c for c in todo if c.teacher and c.teacher not in names_left and not done(Cell("plain", c.seed))]:
            todo.remove(cell)
            print(f"{cell.name}: skipped, its teacher {cell.teacher} did not finish")
        ready = [c for c in ready if left > expected(c)]
        while ready and len(running) < args.parallel:
            cell = ready.pop(0)
            todo.remove(cell)
            folder = out / cell.name
            folder.mkdir(parents=True, exist_ok=True)
            port += 1
            env = dict(os.environ, MASTER_PORT=str(port), MASTER_ADDR="127.0.0.1", RANK="0", LOCAL_RANK="0")
            env["WORLD_SIZE"] = "1"
            log = open(folder / "cell.log", "w")  # noqa: SIM115
            command = [sys.executable, __file__, "cell", "--spec", json.dumps(dataclasses.asdict(cell))]
            command += ["--out", str(out), "--epochs", str(args.epochs)]
            command += ["--hf-path", args.hf_path] if args.hf_path else []
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
            running.append(Running(cell, process, time.monotonic(), log))
            print(f"[{time.monotonic() - start:6.0f} s] {cell.name}: started (port {port})", flush=True)
        if not running and todo and not ready:
            break
        if time.monotonic() - start > args.deadline_s + args.grace_s:
            for item in running:
                item.process.kill()
                print(f"{item.cell.name}: killed at the deadline (it reruns next call)")
            break
        time.sleep(2)
    missing = [cell.name for cell in cells if not done(cell)]
    print(f"{len(cells) - len(missing)} of {len(cells)} cells done; left: {', '.join(missing) or 'none'}")
    return 3 if missing else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run (or resume) a grid")
    run.add_argument("--grid", default="frontier,neftune")
    run.add_argument("--seeds", default="1,2,3")
    run.add_argument("--out", required=True)
    run.add_argument("--parallel", type=int, default=8)
    run.add_argument("--epochs", type=float, default=3.0)
    run.add_argument("--deadline-s", type=float, default=540.0, help="start no cell expected to end after this")
    run.add_argument("--grace-s", type=float, default=30.0, help="kill cells still running this long after it")
    run.add_argument("--expected-cell-s", type=float, default=240.0, help="a cell's time before one has finished")
    run.add_argument("--hf-path")
    cell = commands.add_parser("cell", help="one cell (what run starts)")
    cell.add_argument("--spec", required=True)
    cell.add_argument("--out", required=True)
    cell.add_argument("--epochs", type=float, required=True)
    cell.add_argument("--hf-path")
    summarize = commands.add_parser("summarize", help="tables and figure from a grid's results")
    summarize.add_argument("--out", required=True)
    summarize.add_argument("--markdown")
    summarize.add_argument("--figure")
    args = parser.parse_args()
    if args.command == "run":
        raise SystemExit(run_grid(args))
    if args.command == "cell":
        spec = json.loads(args.spec)
        spec["frontier_levels"] = tuple(spec["frontier_levels"])
        hf_path = args.hf_path
        if hf_path is None:
            from nemo_noise_plugin.jobs.models.smollm2_folder import ensure_smollm2_hf

            hf_path = str(ensure_smollm2_hf())
        run_cell(Cell(**spec), Path(args.out), hf_path, args.epochs)
        return
    from benchmarks.noise_grid_summary import summarize_grid

    summarize_grid(Path(args.out), args.markdown, args.figure)


if __name__ == "__main__":
    main()
