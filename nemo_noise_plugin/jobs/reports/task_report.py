"""The task report of the instruction recipes: exact match before and after training, the export, the frontier.

``TaskReport`` is a Megatron-Bridge callback: held-out exact match (``task_metric``) before and after training (on
the datasets and tokenizer as Bridge's loop has them: ``jobs.batches.recipe_datasets``), then the model exported to
Hugging Face, reloaded with transformers, checked against Megatron's logits and asked the first held-out questions
(``hf_export``); written as ``task_report.{json,png}`` and ``hf/`` into the run's report folder. With noise on, the
report also states the run's frontier point (``task_frontier.frontier_point``): held-out exact match with the run's
own noise on the model's inputs at inference, the token recovery of the privacy audit on the trained embedding
table over noised held-out tokens, and the ledger's epsilon; and it records the run's noise config (``run`` in
``task_report.json``, ``run_settings``), which ``nemo noise audit run=<run folder>`` reads back.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from nemo_noise_plugin.jobs.batches import recipe_tokenizer
from nemo_noise_plugin.jobs.reports.artifacts import RunReport
from nemo_noise_plugin.jobs.reports.hf_export import DECISIVE_MARGIN, export_hf, hf_generate, hf_logit_agreement
from nemo_noise_plugin.jobs.reports.provenance import describe_report, run_title
from nemo_noise_plugin.jobs.reports.task_frontier import (
    FRONTIER_ATTACKS,
    FRONTIER_TOKENS,
    format_frontier,
    frontier_point,
)
from nemo_noise_plugin.jobs.reports.task_metric import TASK_REPORT_SPLITS, exact_match, task_batches
from nemo_noise_plugin.upstream.bridge_imports import import_bridge

__all__ = ["TaskReport", "run_settings"]


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
        print(format_frontier(point, self.results["after"]))

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
            f"{agreement['mean_abs_logit_difference']:.3g}, argmax agreement {agreement['argmax_agreement']:.4f} "
            f"({agreement['decisive_argmax_agreement']:.4f} where Megatron's top token leads by > {DECISIVE_MARGIN}); "
            "its answers:"
        )
        for item in self.results["transformers_replies"]:
            print(f"  {item['question']} -> {item['reply']!r} (reference {item['answer']!r})")
