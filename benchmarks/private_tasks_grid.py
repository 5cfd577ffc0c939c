"""Noise that pays? The privacy-utility frontier on tasks where privacy and utility can coexist (issue 33).

Hypothesis. Per-token embedding noise at a level that hides the tokens (beam recovery <= 10 %) destroys every
exact-answer task (``benchmarks/PRIVACY_FRONTIER.md``), but (H1) a *gist* task, whose label is spread over several
words, keeps most of its accuracy with noise-aware training, because the noise is independent per token and the
signal is repeated; and (H2) a *span* task, whose private span the answer does not need, keeps its exact match when
only the span is noised, while the span's tokens stay hidden (canary recovery <= 5 %). The baselines a reviewer asks
for are in the same table: the plain model under raw noise, the plain model behind nearest-row projection
(decode-then-answer) and a text-level substitution (SANTEXT-style exponential mechanism) at the same per-token eps.

Cells (``cells_for``), each SmolLM2-135M-Instruct fine-tuned through Megatron-Bridge's own loop on one GPU:

- task ``sentiment`` (gist, 4 classes) and ``support`` (span: ticket category or an arithmetic answer; the customer's
  name, account and address are the private spans), both shipped in ``nemo_noise_plugin/data/tasks/``;
- ``plain``: no noise (model a; scored clean it is the ceiling). Scored under every level: raw noise, behind
  nearest-row projection, and on SANTEXT-substituted text; the attacks (nearest neighbour L2 / cosine, LM-prior
  beam with this model as the prior) run here once per level;
- ``aware``: noise-aware training at a level (model b), served with the same noise;
- ``projected``: training and serving on projected inputs (``NoiseConfig.projection='nearest_row'``);
- ``denoised``: training and serving on the posterior mean of the clean embedding given the release
  (``projection='posterior_mean'``: the mechanism's own density, a uniform prior over the table; idea (d));
- ``denoised_prior``: the same with the task's vocabulary as prior (``projection_prior``: the frequencies of the
  training split's private-span tokens, ``data.span_token_prior``; span region only); the plain model is also
  scored behind it (serving mode ``denoised_prior``);
- ``kd``: noise-aware plus forward-KL distillation from the seed's ``plain`` model (model c);
- levels: the Gaussian mechanism on clipped embeddings at per-token eps 100 / 50 / 20 (delta 1e-5) and metric-DP
  eta 100 / 50 / 30, clip norm 3; regions ``span`` (``tokens='spans'``: only the private spans, the instruction,
  template and markers clean) and ``prompt`` (``tokens='prompt'``: the whole prompt but the special ids).

The seed sets the data order (the training file is shuffled by it; Bridge 0.6.2 ignores ``dataset.seed``), the
initialisation-independent randomness and the training noise; inference noise uses one fixed seed
(``EVAL_NOISE_SEED``) so a level's scored inputs are the same draw for every model (paired comparisons).

    python benchmarks/private_tasks_grid.py run --out /tmp/ptgrid --seeds 1,2,3 --parallel 10 --deadline-s 520
    python benchmarks/private_tasks_grid.py summarize --out benchmarks/results/private_tasks
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks.*, from a checkout

from benchmarks.grid_driver import run_cells, this_python, write_result  # noqa: E402
from benchmarks.noise_grid import shuffle_training_file, special_ids  # noqa: E402

SMOKE = os.environ.get("PRIVATE_GRID_SMOKE") == "1"
"""A CPU check of the whole cell path: one step of 4 examples, one batch scored, one level per region."""
SEQ, GLOBAL_BATCH, MICRO_BATCH, LR = (128, 4, 4, 2e-4) if SMOKE else (128, 64, 64, 2e-4)
CLIP_NORM = 3.0
EVAL_NOISE_SEED = 777
ATTACK_CHATS = 4 if SMOKE else 48
"""Held-out test chats (and canaries) whose noised tokens the attacks try to recover."""
SCORED_EXAMPLES = 400
"""Test examples scored per (model, level, serving mode)."""

TASKS: dict[str, dict[str, Any]] = {
    "sentiment": dict(epochs=1.5, regions=("span", "prompt"), chance=0.25, seq=SEQ),
    "support": dict(epochs=1.5, regions=("span",), chance=None, seq=SEQ),
    # about 6.5x the label-bearing words (gist_information_bound.py: what the eps-50 level needs); half the examples
    # at twice the length, three passes: the same steps as the short family; scored on the Gaussian span levels
    "sentiment_long": dict(
        epochs=3.0, regions=("span",), chance=0.25, seq=256, levels=("gm_eps100", "gm_eps50", "gm_eps20")
    ),
}
"""Each task family: passes over its training split, the noised regions it is scored under, chance accuracy, the
sequence length, and (optional) the levels its plain model is scored under (default: every level)."""
REGIONS = {"span": "spans", "prompt": "prompt"}
LEVELS: dict[str, dict[str, Any]] = {
    "gm_eps100": dict(mechanism="gaussian_mechanism", epsilon=100.0, delta=1e-5, clip_norm=CLIP_NORM),
    "gm_eps50": dict(mechanism="gaussian_mechanism", epsilon=50.0, delta=1e-5, clip_norm=CLIP_NORM),
    "gm_eps20": dict(mechanism="gaussian_mechanism", epsilon=20.0, delta=1e-5, clip_norm=CLIP_NORM),
    "mdp_eta100": dict(mechanism="metric_dp", eta=100.0, clip_norm=CLIP_NORM),
    "mdp_eta50": dict(mechanism="metric_dp", eta=50.0, clip_norm=CLIP_NORM),
    "mdp_eta30": dict(mechanism="metric_dp", eta=30.0, clip_norm=CLIP_NORM),
}
GM_LEVELS = ("gm_eps100", "gm_eps50", "gm_eps20")
MDP_LEVELS = ("mdp_eta100", "mdp_eta50", "mdp_eta30")
VARIANTS = ("plain", "aware", "projected", "denoised", "denoised_prior", "kd")
SERVING = {
    "aware": "none",
    "kd": "none",
    "projected": "nearest_row",
    "denoised": "posterior_mean",
    "denoised_prior": "posterior_mean",
}
"""The projection each trained variant is trained and served with."""


def has_denoiser() -> bool:
    """Whether this checkout's ``NoiseConfig`` offers ``projection='posterior_mean'``."""
    from nemo_noise_plugin.noise.config import PROJECTIONS

    return "posterior_mean" in PROJECTIONS


@dataclass(frozen=True)
class Cell:
    """One fine-tuning run: a task, a variant, its training level and region (None for ``plain``), a seed."""

    task: str
    variant: str
    seed: int
    level: str | None = None
    region: str | None = None
    lr_scale: float = 1.0
    epochs_scale: float = 1.0
    """Diagnostics (why an aim fails): the grid's learning rate and number of passes times these."""

    @property
    def name(self) -> str:
        noise = f"_{self.level}_{self.region}" if self.level else ""
        scales = (f"_lr{self.lr_scale:g}x" if self.lr_scale != 1.0 else "") + (
            f"_ep{self.epochs_scale:g}x" if self.epochs_scale != 1.0 else ""
        )
        return f"{self.task}_{self.variant}{noise}{scales}_s{self.seed}"

    @property
    def save(self) -> bool:
        """The plain cells keep their checkpoint: the teachers of the ``kd`` cells."""
        return self.variant == "plain"

    @property
    def teacher(self) -> str | None:
        return f"{self.task}_plain_s{self.seed}" if self.variant == "kd" else None


def cells_for(seeds: Sequence[int], tasks: Sequence[str] = tuple(TASKS)) -> list[Cell]:
    """The grid in the order it runs, so that a partial grid holds whole (variant, level) rows at every seed: the
    plain models first, then the span-region Gaussian levels (noise-aware, projected, denoised), the whole-prompt
    region, distillation at eps 20, then the metric-DP levels."""
    unknown = sorted(set(tasks) - set(TASKS))
    if unknown:
        raise SystemExit(f"--tasks {','.join(tasks)} is invalid: {unknown} are not tasks (expected {', '.join(TASKS)})")
    rows: list[tuple[str, str, str | None, str | None]] = [(task, "plain", None, None) for task in tasks]
    span_variants = ("aware", "projected", "denoised") if has_denoiser() else ("aware", "projected")
    rows += [(task, v, level, "span") for level in GM_LEVELS for task in tasks for v in span_variants]
    for task in tasks:
        if "prompt" in TASKS[task]["regions"]:
            rows += [(task, "aware", level, "prompt") for level in ("gm_eps50", "gm_eps20")]
    rows += [(task, "kd", "gm_eps20", "span") for task in tasks]
    rows += [(task, v, level, "span") for level in MDP_LEVELS for task in tasks for v in ("aware", "projected")]
    return [Cell(task, variant, seed, level, region) for task, variant, level, region in rows for seed in seeds]


def followup_cells(seeds: Sequence[int]) -> list[Cell]:
    """The follow-up GPU sessions' cells, in the order they run: the long gist family (plain, then training with the
    task-vocabulary denoiser, then projected, denoiser and noise-aware training at eps 50 on the review; the plain
    cell is scored behind both denoisers); the diagnostic of the noise-aware gist failure at eps 100 (5x the
    learning rate, 3x the passes); the metric-DP trained cells at eta 30 (the metric level that hides most); the
    whole-prompt trained cells at eps 20. The third session ran all but ``denoised_prior``, the plain cells' prior
    scoring, the 5x learning rate at seeds 2 and 3, the 3x passes and the whole-prompt cells."""
    rows: list[dict[str, Any]] = [dict(task="sentiment_long", variant="plain")]
    rows += [
        dict(task="sentiment_long", variant=v, level="gm_eps50", region="span")
        for v in ("denoised_prior", "projected", "denoised", "aware")
    ]
    rows += [dict(task="sentiment", variant="aware", level="gm_eps100", region="span", lr_scale=5.0)]
    rows += [dict(task="sentiment", variant="aware", level="gm_eps100", region="span", epochs_scale=3.0)]
    rows += [
        dict(task=t, variant=v, level="mdp_eta30", region="span")
        for t in ("sentiment", "support")
        for v in ("aware", "projected")
    ]
    rows += [dict(task="sentiment", variant=v, level="gm_eps20", region="prompt") for v in ("aware", "projected")]
    return [Cell(seed=seed, **row) for row in rows for seed in seeds]


def task_prior(task: str, hf_path: str) -> str:
    """The token-prior file of ``task``'s training spans under ``hf_path``'s tokenizer (written once per machine)."""
    import tempfile

    import transformers

    from nemo_noise_plugin.data.span_token_prior import write_span_token_prior
    from nemo_noise_plugin.data.tasks.shipped import task_files

    path = Path(tempfile.gettempdir()) / "nemo_noise_task_priors" / f"{task}.json"
    if not path.exists():
        tokenizer = transformers.AutoTokenizer.from_pretrained(hf_path)
        write_span_token_prior(task_files(task)["training"], tokenizer, path)
    return str(path)


def level_config(level: str, region: str, *, inference: bool, projection: str = "none", seed: int = 0) -> Any:
    """The ``NoiseConfig`` of ``level`` on ``region`` (``inference``: on in eval mode, the fixed inference seed)."""
    from nemo_noise_plugin.noise.config import NoiseConfig

    extra: dict[str, Any] = dict(training_only=False, seed=EVAL_NOISE_SEED) if inference else dict(seed=seed)
    extra["projection"] = projection
    return NoiseConfig(**LEVELS[level], tokens=REGIONS[region], **extra)


# ----------------------------------------------------------------------------------------------- scoring (in a cell)


def _forward(model: Any, tokens: Any) -> Any:
    import torch

    from nemo_noise_plugin.jobs.cpu.parallel import causal_attention_mask

    mask = causal_attention_mask(tokens.size(1)) if tokens.device.type == "cpu" else None
    positions = torch.arange(tokens.size(1), device=tokens.device).unsqueeze(0).expand_as(tokens)
    return model(tokens, positions, mask)


def score(model: Any, batches: Sequence[dict[str, Any]], eos_id: int, noise: Any = None) -> dict[str, Any]:
    """Exact match (teacher-forced greedy: every answer position's argmax is the reference, through the end-of-turn
    token; for a one-word label this is accuracy) overall and per task, and the answer loss, of ``model`` on
    ``batches``; with ``noise`` (active in eval mode) on a noisy copy, the batch's private mask handed over."""
    import torch

    from nemo_noise_plugin.distillation.teacher import build_clean_teacher
    from nemo_noise_plugin.jobs.reports.task_metric import answer_positions
    from nemo_noise_plugin.model.make_noisy import make_noisy

    scored = make_noisy(build_clean_teacher(model), noise) if noise is not None else model
    scored.eval()
    hits, tasks, loss, count = [], [], 0.0, 0
    with torch.no_grad():
        for index, batch in enumerate(batches):
            if noise is not None:
                scored.noise_clock.start_iteration(index)
                with scored.noise_batch_inputs(batch["loss_mask"], private_mask=batch.get("private_mask")):
                    logits = _forward(scored, batch["tokens"]).float()
            else:
                logits = _forward(scored, batch["tokens"]).float()
            mask = batch["loss_mask"].float()
            picked = logits.log_softmax(-1).gather(-1, batch["labels"].long().unsqueeze(-1)).squeeze(-1)
            loss += float(-(picked * mask).sum())
            count += int(mask.sum())
            predicted = logits.argmax(-1)
            metadata = batch.get("metadata") or [{}] * len(predicted)
            for row, positions in enumerate(answer_positions(batch["labels"], batch["loss_mask"], eos_id)):
                hits.append(bool(torch.equal(predicted[row, positions], batch["labels"][row, positions])))
                tasks.append(metadata[row].get("task", "all"))
    per_task = {t: sum(h for h, k in zip(hits, tasks, strict=True) if k == t) / tasks.count(t) for t in set(tasks)}
    return {
        "exact_match": sum(hits) / max(len(hits), 1),
        "examples": len(hits),
        "per_task": dict(sorted(per_task.items())),
        "loss": loss / max(count, 1),
        "hits": hits,
    }


def noised_token_mask(batch: dict[str, Any], region: str, special_ids: Sequence[int], eos_id: int) -> Any:
    """``[b, s]`` True for the tokens a level on ``region`` noises: the private spans, or the prompt's tokens (no
    loss, not special, not padding after the end of turn)."""
    import torch

    tokens = batch["tokens"]
    if region == "span":
        return batch["private_mask"].bool()
    special = torch.isin(tokens, torch.tensor(list(special_ids), device=tokens.device))
    prompt = batch["loss_mask"] == 0
    # prompt tokens come before the first answer token; padding (after the answer) carries no loss either
    first_answer = (batch["loss_mask"] > 0).float().argmax(-1, keepdim=True)
    before = torch.arange(tokens.size(1), device=tokens.device).unsqueeze(0) < first_answer
    return prompt & before & ~special


def substituted(
    batches: Sequence[dict[str, Any]], table: Any, level: str, region: str, special_ids: Sequence[int], eos_id: int
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """``batches`` with the region's tokens replaced by the SANTEXT-style exponential mechanism at the level's
    per-token parameter (``privacy.text_substitution``), and how many substituted tokens kept their id."""
    from nemo_noise_plugin.privacy.text_substitution import substitute_tokens

    parameters = LEVELS[level]
    kept = total = 0
    out = []
    for batch in batches:
        mask = noised_token_mask(batch, region, special_ids, eos_id)
        # "the same per-token eps": the Gaussian levels' eps (pure eps-DP here, delta 0); a metric-DP level's eta
        # as the same metric guarantee, eta * d, i.e. eps = eta * (2C) over the clipped table's diameter 2C
        eps = parameters["epsilon"] if "epsilon" in parameters else parameters["eta"] * 2 * CLIP_NORM
        ids = substitute_tokens(table, batch["tokens"], mask, eps, clip_norm=CLIP_NORM, seed=EVAL_NOISE_SEED + len(out))
        kept += int((ids[mask] == batch["tokens"][mask]).sum())
        total += int(mask.sum())
        out.append(dict(batch, tokens=ids))
    return out, {"kept_fraction": kept / max(total, 1), "substituted_tokens": total}


def attack(
    model: Any,
    batches: Sequence[dict[str, Any]],
    noise: Any,
    region: str,
    special_ids: Sequence[int],
    eos_id: int,
    *,
    beam: bool,
) -> dict[str, Any]:
    """Recovery of the noised tokens of the first ``ATTACK_CHATS`` prompts of ``batches`` under ``noise`` by nearest
    neighbour (L2, cosine) and, with ``beam``, the LM-prior beam attack (8 candidates, beam 4, ``model`` clean as
    the prior), from ``model``'s own embedding table; Wilson 95 % intervals. Only tokens that got noise count."""
    import torch
    from megatron.core.utils import unwrap_model

    from nemo_noise_plugin.jobs.reports.task_metric import answer_positions
    from nemo_noise_plugin.privacy.audit import noised_embeddings
    from nemo_noise_plugin.privacy.audit.attacks import nearest_neighbour_attack
    from nemo_noise_plugin.privacy.audit.beam import lm_beam_attack
    from nemo_noise_plugin.privacy.audit.statistics import wilson_interval

    prompts, privates = [], []
    for batch in batches:
        region_mask = noised_token_mask(batch, region, special_ids, eos_id)
        for row, positions in enumerate(answer_positions(batch["labels"], batch["loss_mask"], eos_id)):
            end = int(positions[0]) + 1
            prompts.append(batch["tokens"][row, :end])
            privates.append(region_mask[row, :end])
            if len(prompts) == ATTACK_CHATS:
                break
        if len(prompts) == ATTACK_CHATS:
            break
    width = max(len(p) for p in prompts)
    device = prompts[0].device
    ids = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
    padding = torch.ones(len(prompts), width, dtype=torch.bool, device=device)
    private = torch.zeros(len(prompts), width, dtype=torch.bool, device=device)
    for row, (prompt, mask) in enumerate(zip(prompts, privates, strict=True)):
        ids[row, : len(prompt)] = prompt
        padding[row, : len(prompt)] = False
        private[row, : len(prompt)] = mask
    loss_mask = torch.zeros_like(ids, dtype=torch.float32)  # the prompt: no loss tokens
    inner = unwrap_model(model)
    table = inner.embedding.word_embeddings.weight.detach().float()
    config = dataclasses.replace(noise, special_token_ids=list(special_ids), projection="none")
    masks = dict(loss_mask=loss_mask, padding_mask=padding, private_mask=private if region == "span" else None)
    noised = noised_embeddings(table, ids, config, **masks)
    got_noise = ((noised - table[ids]).abs().sum(-1) > 0) & ~padding
    true_ids = ids[got_noise]
    guesses = {
        "nn_l2": nearest_neighbour_attack(noised[got_noise], table, "l2").ids.flatten(),
        "nn_cosine": nearest_neighbour_attack(noised[got_noise], table, "cosine").ids.flatten(),
    }
    if beam:
        model.eval()

        def lm_log_probs(prefix: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                return _forward(model, prefix)[:, -1].float().log_softmax(-1)

        # the beam decodes every prompt token (clean ones have zero noise: their likelihood peaks at the token);
        # only the noised ones are counted
        beam_config = dataclasses.replace(config, tokens="prompt")
        guesses["lm_beam"] = lm_beam_attack(
            noised, table, beam_config, lm_log_probs, loss_mask=loss_mask, padding_mask=padding
        )[got_noise]
    report: dict[str, Any] = {"chats": len(prompts), "noised_tokens": int(got_noise.sum())}
    for name, guess in guesses.items():
        correct = int((guess.to(true_ids.device) == true_ids).sum())
        low, high = wilson_interval(correct, int(true_ids.numel()))
        report[name] = {"recovery": correct / max(int(true_ids.numel()), 1), "interval": [low, high]}
    return report


def privacy_of(level: str, region: str, hidden_size: int, noised_per_chat: float) -> dict[str, Any]:
    """The ledger's per-token and per-example guarantees of a level for one pass over a prompt of the mean noised
    length (``privacy.ledger.privacy_ledger``)."""
    from nemo_noise_plugin.privacy.ledger import privacy_ledger

    config = level_config(level, region, inference=False)
    ledger = privacy_ledger(config, sequence_length=max(round(noised_per_chat), 1), hidden_size=hidden_size)
    token = ledger.per_token[0] if ledger.per_token else None
    sequence = ledger.per_sequence[0] if ledger.per_sequence else None
    return {
        "eps_per_token": token.epsilon if token else None,
        "eps_per_example": sequence.epsilon if sequence else None,
        "delta_per_example": sequence.delta if sequence else None,
        "noised_tokens_per_example": noised_per_chat,
        "sigma": config.dp_sigma if config.mechanism == "gaussian_mechanism" else None,
    }


def _without_hits(scores: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in scores.items() if key != "hits"}


def canary_batches(state: Any, device: Any) -> list[dict[str, Any]]:
    """The span family's canaries as batches of the run's dataset class and tokenizer (never trained on)."""
    from nemo_noise_plugin.data.span_dataset import PrivateSpanChatDataset
    from nemo_noise_plugin.data.tasks.shipped import CANARY_SPLIT, task_files
    from nemo_noise_plugin.jobs.batches import collate, recipe_tokenizer

    dataset = PrivateSpanChatDataset(
        str(task_files("support")[CANARY_SPLIT]),
        recipe_tokenizer(state),
        max_seq_length=state.cfg.dataset.seq_length,
        is_test=True,
        use_hf_tokenizer_chat_template=True,
        loss_mode="assistant",
    )
    size = min(state.cfg.train.micro_batch_size, len(dataset))
    return collate(dataset, len(dataset) // size, size, None, device)


def evaluate_cell(model: Any, state: Any, cell: Cell) -> dict[str, Any]:
    """Every score of a trained cell (module docstring); JSON-serialisable."""
    import torch
    from megatron.core.utils import unwrap_model

    from nemo_noise_plugin.jobs.batches import recipe_tokenizer
    from nemo_noise_plugin.jobs.reports.task_metric import task_batches

    inner = unwrap_model(model)
    device = next(inner.parameters()).device
    eos = int(recipe_tokenizer(state).eod)
    special = special_ids(recipe_tokenizer(state))
    held = task_batches(state, device)
    if SMOKE:
        held = {split: batches[:1] for split, batches in held.items()}
    test = held["test"]
    table = inner.embedding.word_embeddings.weight.detach().float()
    started = time.perf_counter()
    result: dict[str, Any] = {"cell": dataclasses.asdict(cell), "name": cell.name}
    result["clean"] = {split: score(inner, batches, eos) for split, batches in held.items()}
    canaries, canary_error = None, None
    if cell.task == "support":
        try:  # a failure here must not cost the cell's other scores
            canaries = canary_batches(state, device)
        except Exception as error:  # noqa: BLE001
            canary_error = f"{type(error).__name__}: {error}"
    scored: dict[str, Any] = {}
    pairs = (
        [(level, region) for region in TASKS[cell.task]["regions"] for level in TASKS[cell.task].get("levels", LEVELS)]
        if cell.variant == "plain"
        else [(cell.level, cell.region)]
    )
    if SMOKE:
        pairs = [pair for pair in pairs if pair[0] == (cell.level or "gm_eps20")]
    for level, region in pairs:
        noise = dataclasses.replace(level_config(level, region, inference=True), special_token_ids=special)
        projected = dataclasses.replace(noise, projection="nearest_row")
        entry: dict[str, Any] = {
            "raw": score(inner, test, eos, noise),
            "projected": score(inner, test, eos, projected),
        }
        if cell.variant in ("plain", "denoised") and has_denoiser():
            entry["denoised"] = score(inner, test, eos, dataclasses.replace(noise, projection="posterior_mean"))
        if cell.variant in ("plain", "denoised_prior") and region == "span" and cell.task.startswith("sentiment"):
            prior = task_prior(cell.task, state.cfg.tokenizer.tokenizer_model)
            informed = dataclasses.replace(noise, projection="posterior_mean", projection_prior=prior)
            entry["denoised_prior"] = score(inner, test, eos, informed)
        beam = cell.variant == "plain"
        entry["attacks"] = attack(inner, test, noise, region, special, eos, beam=beam)
        if canaries is not None and region == "span":
            entry["canary_attacks"] = attack(inner, canaries, noise, region, special, eos, beam=beam)
        if cell.variant == "plain":
            try:  # a failure here must not cost the cell's other scores
                texts, kept = substituted(test, table, level, region, special, eos)
                entry["substituted"] = score(inner, texts, eos)
                entry["substitution"] = kept
            except Exception as error:  # noqa: BLE001
                entry["substitution_error"] = f"{type(error).__name__}: {error}"
        noised_per_chat = entry["attacks"]["noised_tokens"] / entry["attacks"]["chats"]
        entry["privacy"] = privacy_of(level, region, inner.config.hidden_size, noised_per_chat)
        scored[f"{level}/{region}"] = entry
    result["levels"] = scored
    result["canary_error"] = canary_error
    result["evaluation_seconds"] = time.perf_counter() - started
    result["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return result


# --------------------------------------------------------------------------------------------------- one cell's run


def cell_config(cell: Cell, out: Path, hf_path: str) -> Any:
    """The cell's Bridge ``ConfigContainer``: the SmolLM2 private-task recipe at the grid's batch, learning rate and
    length, seeded by the cell."""
    from nemo_noise_plugin.distillation.config import KDConfig
    from nemo_noise_plugin.noise.config import NoiseConfig
    from nemo_noise_plugin.recipes.smollm2 import smollm2_provider
    from nemo_noise_plugin.recipes.smollm2_private import private_task_finetuning_config

    if cell.level is None:
        noise = NoiseConfig(enabled=False)
    else:
        noise = level_config(cell.level, cell.region, inference=False, projection=SERVING[cell.variant])
        noise = dataclasses.replace(noise, seed=cell.seed)
        if cell.variant == "denoised_prior":
            noise = dataclasses.replace(noise, projection_prior=task_prior(cell.task, hf_path))
    provider, hf_path = smollm2_provider(hf_path, noise, KDConfig() if cell.variant == "kd" else None)
    if cell.teacher:
        provider.teacher_checkpoint = str(out / cell.teacher / "checkpoints")
    train_examples = TRAIN_EXAMPLES[cell.task]
    passes = TASKS[cell.task]["epochs"] * cell.epochs_scale
    train_iters = 1 if SMOKE else max(round(passes * train_examples / GLOBAL_BATCH), 1)
    config = private_task_finetuning_config(
        provider,
        hf_path,
        task=cell.task,
        run_dir=str(out / cell.name / "run"),
        train_iters=train_iters,
        seq_length=TASKS[cell.task]["seq"],
        lr=LR * cell.lr_scale,
        global_batch_size=GLOBAL_BATCH,
        micro_batch_size=MICRO_BATCH,
    )
    config.dataset.seed = config.rng.seed = cell.seed
    config.dataset.max_train_samples = train_iters * GLOBAL_BATCH
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


TRAIN_EXAMPLES = {"sentiment": 4000, "support": 4000, "sentiment_long": 2000}
"""Training examples of each task's shipped split (checked against the file when a cell starts)."""


def run_cell(cell: Cell, out: Path, hf_path: str) -> None:
    """Train one cell through Bridge's loop and write its ``result.json`` from the end-of-training callback."""
    from nemo_noise_plugin.jobs.launch.launcher import launch
    from nemo_noise_plugin.upstream.bridge_imports import import_bridge

    callbacks = import_bridge("megatron.bridge.training.callbacks")
    config = cell_config(cell, out, hf_path)
    lines = (Path(config.dataset.dataset_root) / "training.jsonl").read_text().count("\n")
    if lines != TRAIN_EXAMPLES[cell.task]:
        raise SystemExit(f"{cell.task}: training.jsonl has {lines} examples, the grid expects {TRAIN_EXAMPLES}")
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
                global_batch_size=GLOBAL_BATCH,
                lr=config.optimizer.lr,
                seq_length=config.dataset.seq_length,
                losses=losses,
                wall_seconds=time.perf_counter() - started,
                noise_config=dataclasses.asdict(config.model.noise),
            )
            write_result(out / cell.name / "result.json", result)

    launch(config, callbacks=[Scores()], allow_cpu_loop=True)  # Bridge's loop on a GPU, the CPU loop (smoke) without


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run (or resume) the grid")
    run.add_argument("--tasks", default=",".join(TASKS))
    run.add_argument("--seeds", default="1,2,3")
    run.add_argument("--out", required=True)
    run.add_argument("--parallel", type=int, default=10)
    run.add_argument("--deadline-s", type=float, default=520.0, help="start no cell expected to end after this")
    run.add_argument("--grace-s", type=float, default=20.0, help="kill cells still running this long after it")
    run.add_argument("--expected-cell-s", type=float, default=200.0, help="a cell's time before one has finished")
    run.add_argument("--hf-path", required=True)
    run.add_argument("--only", help="comma-separated cell names (a subset of the grid)")
    run.add_argument("--followup", action="store_true", help="the second session's cells (followup_cells)")
    cell = commands.add_parser("cell", help="one cell (what run starts)")
    cell.add_argument("--spec", required=True)
    cell.add_argument("--out", required=True)
    cell.add_argument("--hf-path", required=True)
    summarize = commands.add_parser("summarize", help="tables and figures from the grid's results")
    summarize.add_argument("--out", required=True)
    summarize.add_argument("--markdown")
    summarize.add_argument("--figures")
    args = parser.parse_args()
    if args.command == "run":
        seeds = [int(s) for s in args.seeds.split(",")]
        cells = followup_cells(seeds) if args.followup else cells_for(seeds, args.tasks.split(","))
        if args.only:
            wanted = set(args.only.split(","))
            cells = [c for c in cells if c.name in wanted]

        def command_for(cell: Cell) -> list[str]:
            spec = json.dumps(dataclasses.asdict(cell))
            return [this_python(), __file__, "cell", "--spec", spec, "--out", args.out, "--hf-path", args.hf_path]

        raise SystemExit(
            run_cells(
                cells,
                Path(args.out),
                command_for,
                parallel=args.parallel,
                deadline_s=args.deadline_s,
                grace_s=args.grace_s,
                expected_cell_s=args.expected_cell_s,
            )
        )
    if args.command == "cell":
        run_cell(Cell(**json.loads(args.spec)), Path(args.out), args.hf_path)
        return
    from benchmarks.private_tasks_summary import summarize_grid

    summarize_grid(Path(args.out), args.markdown, args.figures)


if __name__ == "__main__":
    main()
