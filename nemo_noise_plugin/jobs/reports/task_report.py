"""The task metric of the instruction recipes, and the trained model exported to Hugging Face and generated from.

Exact match on the held-out splits (``TASK_REPORT_SPLITS``: validation and test, overall and per task) with greedy
decoding: an answer counts when greedy decoding from the prompt
reproduces the reference answer's tokens and then stops (the end-of-turn token). Greedy decoding yields exactly
that sequence iff, fed the reference, the model's argmax at every answer position is the next reference token, so
one teacher-forced forward pass per batch computes it exactly (the tests check it against the plain greedy loop,
``tests/support/generation.py``). ``TaskReport`` is a Megatron-Bridge callback: exact match before and after training
(on the datasets and tokenizer as Bridge's loop has them: ``jobs.batches.recipe_datasets``), then the model exported
with Bridge's ``AutoBridge.save_hf_pretrained``, reloaded with transformers, checked against Megatron's logits
(``hf_logit_agreement``) and asked the first held-out questions; written as ``task_report.{json,png}`` and ``hf/``
into the run's report folder. With noise on, the report also states the run's frontier point (``frontier_point``):
held-out exact match with the run's own noise on the model's inputs at inference, the token recovery of the privacy
audit on the trained embedding table over noised held-out tokens, and the ledger's epsilon; and it records the run's
noise config (``run`` in ``task_report.json``), which ``nemo noise audit run=<run folder>`` reads back.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nemo_noise_plugin.jobs.batches import collate, recipe_datasets, recipe_tokenizer
from nemo_noise_plugin.jobs.cpu.parallel import causal_attention_mask
from nemo_noise_plugin.jobs.reports.artifacts import RunReport
from nemo_noise_plugin.jobs.reports.provenance import describe_report, run_title
from nemo_noise_plugin.upstream.bridge_imports import import_bridge

__all__ = [
    "FRONTIER_ATTACKS",
    "FRONTIER_TOKENS",
    "TASK_REPORT_SPLITS",
    "TaskReport",
    "answer_positions",
    "exact_match",
    "export_hf",
    "frontier_point",
    "hf_generate",
    "hf_logit_agreement",
    "input_embedding_table",
    "noise_level",
    "run_settings",
]


def answer_positions(labels: torch.Tensor, loss_mask: torch.Tensor, eos_id: int) -> list[torch.Tensor]:
    """Per row: the positions whose labels are the answer, up to and including the first ``eos_id`` label."""
    rows = []
    for row_labels, row_mask in zip(labels, loss_mask, strict=True):
        positions = row_mask.nonzero().flatten()
        ends = (row_labels[positions] == eos_id).nonzero().flatten()
        rows.append(positions[: int(ends[0]) + 1] if len(ends) else positions)
    return rows


def exact_match(
    model: nn.Module, batches: Sequence[dict[str, Any]], eos_id: int, *, noise_inputs: bool = False
) -> tuple[float, dict[str, float], list[bool]]:
    """Greedy exact match of ``model`` on ``batches`` (Bridge SFT batches): overall, per task, and per example.

    ``noise_inputs``: ``model`` is a noisy model noising in eval mode (``make_noisy`` with ``training_only=False``);
    batch ``i`` is its noise's iteration ``i`` and hands its loss mask to the noise layer, as training does.
    """
    hits: list[bool] = []
    tasks: list[str] = []
    with torch.no_grad():
        for index, batch in enumerate(batches):
            if noise_inputs:
                model.noise_clock.start_iteration(index)
                with model.noise_batch_inputs(batch["loss_mask"]):
                    logits = model(batch["tokens"], batch["position_ids"], batch["attention_mask"])
            else:
                logits = model(batch["tokens"], batch["position_ids"], batch["attention_mask"])
            predicted = logits.argmax(-1)
            for row, positions in enumerate(answer_positions(batch["labels"], batch["loss_mask"], eos_id)):
                hits.append(bool(torch.equal(predicted[row, positions], batch["labels"][row, positions])))
                tasks.append((batch.get("metadata") or [{}] * len(predicted))[row].get("task", "all"))
    per_task = {
        task: sum(h for h, t in zip(hits, tasks, strict=True) if t == task) / tasks.count(task)
        for task in sorted(set(tasks))
    }
    return sum(hits) / len(hits), per_task, hits


def export_hf(model: nn.Module, hf_source: str, output_dir: str) -> str:
    """Write ``model`` (a Megatron chunk of the ``hf_source`` architecture) as an HF folder with Bridge's exporter."""
    auto_bridge = import_bridge("megatron.bridge").AutoBridge
    bridge = auto_bridge.from_hf_pretrained(hf_source)
    bridge.save_hf_pretrained([model], output_dir)
    return output_dir


def hf_generate(folder: str, questions: Sequence[list[dict[str, str]]], max_new_tokens: int = 64) -> list[str]:
    """Reload an HF folder with transformers and answer each chat (greedy), returning the decoded replies."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    replies = []
    for messages in questions:
        inputs = tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        with torch.no_grad():
            output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        replies.append(tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True))
    return replies


TASK_REPORT_SPLITS = ("validation", "test")
"""The held-out splits the task report scores: ``validation`` (Bridge's evaluation split) and ``test`` (never used
in training or model selection; absent when the dataset has no ``test.jsonl``)."""


def task_batches(state: Any, device: Any, held_out: int | None = None) -> dict[str, list[dict[str, Any]]]:
    """Batches of every ``TASK_REPORT_SPLITS`` split the run's dataset has, one example per row, whole batches only
    (of the first ``held_out`` examples of each split when given).

    Built from Bridge's dataset provider and tokenizer as the run has them (``recipe_datasets``, unpacked); the CPU
    gets an explicit causal mask, a GPU none (the attention's own causal mask).
    """
    _, valid, test = recipe_datasets(state, test=True, unpacked=True)
    size = state.cfg.train.micro_batch_size
    mask = causal_attention_mask(state.cfg.model.seq_length) if torch.device(device).type == "cpu" else None
    found = dict(zip(TASK_REPORT_SPLITS, (valid, test), strict=True))
    counts = {split: len(data) if held_out is None else min(len(data), held_out) for split, data in found.items()}
    return {split: collate(data, counts[split] // size, size, mask, device) for split, data in found.items() if data}


def hf_logit_agreement(model: nn.Module, folder: str, batches: Sequence[dict[str, Any]]) -> dict[str, float]:
    """How closely the HF folder, reloaded with transformers, reproduces ``model``'s logits on ``batches``.

    The HF model runs in the dtype of ``model``'s parameters (bf16 on a GPU: both sides then round alike) on the same
    device; compared at every position of every row (both causal, so right padding changes no earlier position).
    Returns the largest and the mean absolute logit difference and the fraction of positions whose argmax agrees.
    """
    import transformers

    parameter = next(model.parameters())
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=parameter.dtype)
    hf_model = hf_model.to(parameter.device).eval()
    largest = total = agree = count = 0.0
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for batch in batches:
            ours = model(batch["tokens"], batch["position_ids"], batch["attention_mask"]).float()
            theirs = hf_model(input_ids=batch["tokens"]).logits.float()
            difference = (ours - theirs).abs()
            largest = max(largest, float(difference.max()))
            total += float(difference.mean(-1).sum())
            agree += float((ours.argmax(-1) == theirs.argmax(-1)).sum())
            count += ours.shape[0] * ours.shape[1]
    model.train(was_training)
    del hf_model
    return {
        "max_abs_logit_difference": largest,
        "mean_abs_logit_difference": total / count,
        "argmax_agreement": agree / count,
        "dtype": str(parameter.dtype).removeprefix("torch."),
    }


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


def run_settings(state: Any) -> dict[str, Any]:
    """What the run was trained with, for its ledger and for ``nemo noise audit run=``: the noise config (None
    without one), the sequence length, steps, global batch size, the training examples (lines of the dataset
    folder's ``training.jsonl``; None without it) and the epochs, ``ceil(steps * global batch / examples)``."""
    config = state.cfg
    noise = getattr(config.model, "noise", None)
    root = getattr(config.dataset, "dataset_root", None)
    training = Path(str(root)) / "training.jsonl" if root else None
    examples = None
    if training is not None and training.is_file():
        with open(training) as handle:
            examples = sum(1 for line in handle if line.strip())
    samples = int(config.train.train_iters) * int(config.train.global_batch_size)
    return {
        "noise": None if noise is None else dataclasses.asdict(noise),
        "seq_length": int(getattr(config.dataset, "seq_length", None) or config.model.seq_length),
        "train_iters": int(config.train.train_iters),
        "global_batch_size": int(config.train.global_batch_size),
        "training_examples": examples,
        "epochs": max(1, math.ceil(samples / examples)) if examples else None,
    }


def _held_out_tokens(batches: Sequence[dict[str, Any]], tokens: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole rows of ``batches`` (right-padded with ``pad_id`` to one width) until they hold ``tokens`` real tokens
    (a row's real tokens end at its last loss-carrying position, as the noise layer counts them); ids, loss mask."""
    rows: list[torch.Tensor] = []
    masks: list[torch.Tensor] = []
    total = 0
    for batch in batches:
        for ids, mask in zip(batch["tokens"], batch["loss_mask"], strict=True):
            carrying = mask.nonzero()
            total += int(carrying.max()) + 1 if len(carrying) else mask.numel()
            rows.append(ids)
            masks.append(mask)
            if total >= tokens:
                break
        if total >= tokens:
            break
    width = max(row.numel() for row in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long, device=rows[0].device)
    loss_mask = torch.zeros(len(rows), width, dtype=torch.float32, device=rows[0].device)
    for index, (row, mask) in enumerate(zip(rows, masks, strict=True)):
        ids[index, : row.numel()], loss_mask[index, : mask.numel()] = row, mask.float()
    return ids, loss_mask


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
    (``audited_tokens``, ``distinct_ids``; the whole audit under ``audit``); ``per_token_epsilon``,
    ``per_sequence_epsilon`` and ``ledger``: ``privacy_ledger`` at ``sequence_length`` and ``epochs`` (None where
    the mechanism has no formal guarantee). ``model`` is not modified. Example::

        point = frontier_point(model, {"validation": batches}, noise, eos_id, sequence_length=128)
        point["exact_match"], point["recovery"]["nn_l2"], point["per_sequence_epsilon"]
    """
    from nemo_noise_plugin.distillation.teacher import build_clean_teacher
    from nemo_noise_plugin.model.make_noisy import make_noisy
    from nemo_noise_plugin.privacy.audit import audit
    from nemo_noise_plugin.privacy.ledger import privacy_ledger

    inference = dataclasses.replace(noise, training_only=False, schedule="constant", warmup_steps=0)
    clean = build_clean_teacher(model)
    noisy = make_noisy(build_clean_teacher(clean), inference).eval()
    splits = {}
    for split, split_batches in batches.items():
        accuracy, per_task, _ = exact_match(noisy, split_batches, eos_id, noise_inputs=True)
        splits[split] = {"exact_match": accuracy, "per_task": per_task}
    del noisy
    ids, loss_mask = _held_out_tokens(next(iter(batches.values())), tokens, eos_id)
    table = input_embedding_table(model)
    prior = _lm_prior(clean) if "lm_beam" in attacks else None
    report = audit(table, ids, inference, tuple(attacks), prior, loss_mask=loss_mask, noised_only=True)
    ledger = privacy_ledger(inference, sequence_length=sequence_length, epochs=epochs, hidden_size=table.size(1))

    def entries(guarantees: Sequence[Any]) -> list[dict[str, Any]]:
        return [{"epsilon": g.epsilon, "delta": g.delta, "how": g.how} for g in guarantees]

    return {
        "noise": noise_level(inference),
        "noise_config": dataclasses.asdict(inference),
        **splits[next(iter(splits))],
        "splits": splits,
        "recovery": {name: result["overall"]["rate"] for name, result in report["attacks"].items()},
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


def _format_frontier(point: dict[str, Any], clean: dict[str, Any]) -> str:
    def epsilon(value: float | None) -> str:
        return "none (no formal guarantee)" if value is None else f"{value:.3g}"

    scores = ", ".join(f"{split} {result['exact_match']:.3f}" for split, result in point["splits"].items())
    rates = ", ".join(f"{name} {100 * rate:.1f} %" for name, rate in point["recovery"].items() if rate is not None)
    ledger = point["ledger"]
    return (
        f"frontier point ({point['noise']}, on the inputs at inference): held-out exact match {scores} (clean "
        f"{clean['exact_match']:.3f}); token recovery over {point['audited_tokens']} noised held-out tokens "
        f"({point['distinct_ids']} distinct ids): {rates or 'no noised token'}; epsilon per token "
        f"{epsilon(point['per_token_epsilon'])}, per sequence {epsilon(point['per_sequence_epsilon'])} "
        f"(L={ledger['sequence_length']}, {ledger['epochs']} epoch{'s' if ledger['epochs'] != 1 else ''})"
    )


_BEFORE_KEY = "task_report_before"
"""Where the 'before' exact match is kept in the callbacks' ``user_state`` (saved by CPU-loop checkpoints)."""


def _plot(results: dict[str, Any], path: str, title: str = "") -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    tasks = list(results["before"]["per_task"])
    figure, axis = plt.subplots(figsize=(8, 4))
    width = 0.4
    for offset, name in ((-width / 2, "before"), (width / 2, "after")):
        if name in results:
            values = [results[name]["per_task"][task] for task in tasks]
            axis.bar([i + offset for i in range(len(tasks))], values, width, label=name)
    axis.set_xticks(range(len(tasks)), tasks)
    heading = "Held-out exact match per task"
    axis.set(ylabel="exact match (greedy)", ylim=(0, 1), title=f"{heading}\n{title}" if title else heading)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


class TaskReport(import_bridge("megatron.bridge.training.callbacks").Callback):
    """Bridge callback for the instruction recipes: held-out exact match before and after training, and the export.

    ``task_report.json`` holds, for ``before`` and ``after``, ``splits`` (per split: ``exact_match`` and
    ``per_task``) and the validation split's two numbers at the top level; ``export_logits`` (the reloaded HF
    model against Megatron's logits) and ``transformers_replies`` with the export; ``run`` (``run_settings``: the
    noise config as trained, sequence length, epochs, which ``nemo noise audit run=`` reads); ``provenance``
    (``RunReport.describe``: recipe, resolved config and its hash, noise, steps, seeds, version, data hashes; the
    figure's title is ``jobs.reports.provenance.run_title`` of it); and, when the run
    trains with noise and ``frontier`` is on, ``frontier`` (``frontier_point`` of the trained model at the run's own
    noise: exact match under that noise, token recovery of ``frontier_attacks`` over ``frontier_tokens`` noised
    held-out tokens, epsilon per token and per sequence).

    At the end (rank 0) it exports the model into ``report`` (a ``RunReport``, shared with the ``RobustnessReport``
    that finishes it: list this callback before that one) as ``hf/`` (``export=True``), reloads it with
    transformers, answers the first ``samples`` held-out questions, and writes ``task_report.{json,png}`` there;
    the run's report folder then appears with all its files at once. The 'before' measurement is kept in the callbacks'
    ``user_state``, so a run resumed from a CPU-loop checkpoint reports the one of iteration 0.
    """

    def __init__(
        self,
        report: RunReport,
        *,
        export: bool = True,
        samples: int = 4,
        frontier: bool = True,
        frontier_tokens: int = FRONTIER_TOKENS,
        frontier_attacks: Sequence[str] = FRONTIER_ATTACKS,
        held_out: int | None = None,
    ) -> None:
        from nemo_noise_plugin.privacy.audit.run import ATTACKS

        if isinstance(frontier_tokens, bool) or not isinstance(frontier_tokens, int) or frontier_tokens < 1:
            raise ValueError(f"frontier_tokens={frontier_tokens!r} is invalid: expected an integer >= 1.")
        unknown = [attack for attack in frontier_attacks if attack not in ATTACKS or attack == "direction"]
        if isinstance(frontier_attacks, str) or not frontier_attacks or unknown:
            raise ValueError(
                f"frontier_attacks={frontier_attacks!r} is invalid: expected a non-empty list from nn_l2, nn_cosine, "
                "lm_beam."
            )
        self.report, self.export, self.samples = report, export, samples
        self.frontier, self.frontier_tokens, self.frontier_attacks = frontier, frontier_tokens, tuple(frontier_attacks)
        if held_out is not None and (isinstance(held_out, bool) or not isinstance(held_out, int) or held_out < 1):
            raise ValueError(f"held_out={held_out!r} is invalid: expected an integer >= 1 (or None: every example).")
        self.held_out = held_out
        self.results: dict[str, Any] = {}
        self.batches: list[dict[str, Any]] | None = None

    def _measure(self, context: Any, name: str) -> None:
        from megatron.core.utils import unwrap_model

        model = unwrap_model(context.model[0])
        if self.batches is None:
            self.batches = task_batches(context.state, next(model.parameters()).device, self.held_out)
        was_training = model.training
        model.eval()
        eos = recipe_tokenizer(context.state).eod
        splits = {}
        for split, batches in self.batches.items():
            accuracy, per_task, _ = exact_match(model, batches, eos)
            splits[split] = {"exact_match": accuracy, "per_task": per_task}
        model.train(was_training)
        # the validation split's numbers at the top level (as before), every split's under "splits"
        self.results[name] = {**splits[TASK_REPORT_SPLITS[0]], "splits": splits}
        scores = ", ".join(f"{split} {result['exact_match']:.3f}" for split, result in splits.items())
        print(f"held-out exact match ({name} training, greedy): {scores}")

    def on_train_start(self, context: Any) -> None:
        saved = context.user_state.get(_BEFORE_KEY) if context.state.train_state.step else None
        if saved is not None:
            self.results["before"] = saved
            return
        self._measure(context, "before")
        context.user_state[_BEFORE_KEY] = self.results["before"]

    def on_train_end(self, context: Any) -> None:
        self._measure(context, "after")
        self.results["run"] = run = run_settings(context.state)
        noise = getattr(context.state.cfg.model, "noise", None)
        if self.frontier and noise is not None and noise.is_active_configuration:
            self._frontier(context, noise, run)
        if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
            return
        title = run_title(describe_report(self.report, context.state.cfg))
        if self.export:
            self._export(context)
        self.report.write_json("task_report.json", self.results)
        self.report.write("task_report.png", lambda path: _plot(self.results, str(path), title))
        print(f"task report: {self.report.path('task_report.json')} (with task_report.png)")

    def _frontier(self, context: Any, noise: Any, run: dict[str, Any]) -> None:
        from megatron.core.utils import unwrap_model

        model = unwrap_model(context.model[0])
        was_training = model.training
        model.eval()
        point = frontier_point(
            model,
            self.batches,
            noise,
            recipe_tokenizer(context.state).eod,
            sequence_length=run["seq_length"],
            epochs=run["epochs"] or 1,
            tokens=self.frontier_tokens,
            attacks=self.frontier_attacks,
        )
        model.train(was_training)
        self.results["frontier"] = point
        print(_format_frontier(point, self.results["after"]))

    def _export(self, context: Any) -> None:
        from megatron.core.utils import unwrap_model

        from nemo_noise_plugin.data.instruction_set import instruction_examples

        model = unwrap_model(context.model[0])
        source = context.state.cfg.tokenizer.tokenizer_model
        written = self.report.write("hf", lambda path: export_hf(model, source, str(path)))
        examples = instruction_examples("validation")[: self.samples]
        questions = [[m for m in example["messages"] if m["role"] != "assistant"] for example in examples]
        replies = hf_generate(str(written), questions)
        self.results["exported"] = str(self.report.path("hf"))
        compared = next(iter(self.batches.values()))[:2]
        agreement = self.results["export_logits"] = hf_logit_agreement(model, str(written), compared)
        self.results["transformers_replies"] = [
            {"question": q[-1]["content"], "reply": r, "answer": e["messages"][-1]["content"]}
            for q, r, e in zip(questions, replies, examples, strict=True)
        ]
        print(
            f"exported to {self.report.path('hf')}; reloaded in transformers ({agreement['dtype']}), logits against "
            f"Megatron's: max |difference| {agreement['max_abs_logit_difference']:.3g}, mean "
            f"{agreement['mean_abs_logit_difference']:.3g}, argmax agreement {agreement['argmax_agreement']:.4f}; "
            "its answers:"
        )
        for item in self.results["transformers_replies"]:
            print(f"  {item['question']} -> {item['reply']!r} (reference {item['answer']!r})")
