"""The task metric of the instruction recipes, and the trained model exported to Hugging Face and generated from.

Exact match on the held-out splits (``TASK_REPORT_SPLITS``: validation and test, overall and per task) with greedy
decoding: an answer counts when greedy decoding from the prompt
reproduces the reference answer's tokens and then stops (the end-of-turn token). Greedy decoding yields exactly
that sequence iff, fed the reference, the model's argmax at every answer position is the next reference token, so
one teacher-forced forward pass per batch computes it exactly (``greedy_decode`` is the plain loop, which the tests
check it against). ``TaskReport`` is a Megatron-Bridge callback: exact match before and after training (on the
datasets and tokenizer as Bridge's loop has them: ``batches.recipe_datasets``), then the model exported with
Bridge's ``AutoBridge.save_hf_pretrained``, reloaded with transformers, checked against Megatron's logits
(``hf_logit_agreement``) and asked the first held-out questions; written as ``task_report.{json,png}`` and ``hf/``
into the run's report folder.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from nemo_noise_plugin.artifacts import RunReport
from nemo_noise_plugin.batches import collate, recipe_datasets, recipe_tokenizer
from nemo_noise_plugin.bridge_imports import import_bridge
from nemo_noise_plugin.cpu.parallel import causal_attention_mask

__all__ = [
    "TASK_REPORT_SPLITS",
    "TaskReport",
    "answer_positions",
    "exact_match",
    "export_hf",
    "greedy_decode",
    "hf_generate",
    "hf_logit_agreement",
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
    model: nn.Module, batches: Sequence[dict[str, Any]], eos_id: int
) -> tuple[float, dict[str, float], list[bool]]:
    """Greedy exact match of ``model`` on ``batches`` (Bridge SFT batches): overall, per task, and per example."""
    hits: list[bool] = []
    tasks: list[str] = []
    with torch.no_grad():
        for batch in batches:
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


def greedy_decode(model: nn.Module, prompt: Sequence[int], eos_id: int, max_new_tokens: int = 16) -> list[int]:
    """Greedy decoding with a Megatron model chunk (full recompute per token): the new tokens, up to ``eos_id``."""
    tokens = list(prompt)
    new: list[int] = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            width = len(tokens)
            ids = torch.tensor([tokens])
            logits = model(ids, torch.arange(width).unsqueeze(0), causal_attention_mask(width))
            token = int(logits[0, -1].argmax())
            new.append(token)
            if token == eos_id:
                break
            tokens.append(token)
    return new


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


def task_batches(state: Any, device: Any) -> dict[str, list[dict[str, Any]]]:
    """Batches of every ``TASK_REPORT_SPLITS`` split the run's dataset has, one example per row, whole batches only.

    Built from Bridge's dataset provider and tokenizer as the run has them (``recipe_datasets``, unpacked); the CPU
    gets an explicit causal mask, a GPU none (the attention's own causal mask).
    """
    _, valid, test = recipe_datasets(state, test=True, unpacked=True)
    size = state.cfg.train.micro_batch_size
    mask = causal_attention_mask(state.cfg.model.seq_length) if torch.device(device).type == "cpu" else None
    found = dict(zip(TASK_REPORT_SPLITS, (valid, test), strict=True))
    return {split: collate(data, len(data) // size, size, mask, device) for split, data in found.items() if data}


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


_BEFORE_KEY = "task_report_before"
"""Where the 'before' exact match is kept in the callbacks' ``user_state`` (saved by CPU-loop checkpoints)."""


def _plot(results: dict[str, Any], path: str) -> bool:
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
    axis.set(ylabel="exact match (greedy)", ylim=(0, 1), title="Held-out exact match per task")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


class TaskReport(import_bridge("megatron.bridge.training.callbacks").Callback):
    """Bridge callback for the instruction recipes: held-out exact match before and after training, and the export.

    ``task_report.json`` holds, for ``before`` and ``after``, ``splits`` (per split: ``exact_match`` and
    ``per_task``) and the validation split's two numbers at the top level; ``export_logits`` (the reloaded HF
    model against Megatron's logits) and ``transformers_replies`` with the export.

    At the end (rank 0) it exports the model into ``report`` (a ``RunReport``, shared with the ``RobustnessReport``
    that finishes it: list this callback before that one) as ``hf/`` (``export=True``), reloads it with
    transformers, answers the first ``samples`` held-out questions, and writes ``task_report.{json,png}`` there;
    the run's report folder then appears with all its files at once. The 'before' measurement is kept in the callbacks'
    ``user_state``, so a run resumed from a CPU-loop checkpoint reports the one of iteration 0.
    """

    def __init__(self, report: RunReport, *, export: bool = True, samples: int = 4) -> None:
        self.report, self.export, self.samples = report, export, samples
        self.results: dict[str, Any] = {}
        self.batches: list[dict[str, Any]] | None = None

    def _measure(self, context: Any, name: str) -> None:
        from megatron.core.utils import unwrap_model

        model = unwrap_model(context.model[0])
        if self.batches is None:
            self.batches = task_batches(context.state, next(model.parameters()).device)
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
        if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
            return
        if self.export:
            self._export(context)
        self.report.write_json("task_report.json", self.results)
        self.report.write("task_report.png", lambda path: _plot(self.results, str(path)))
        print(f"task report: {self.report.path('task_report.json')} (with task_report.png)")

    def _export(self, context: Any) -> None:
        from megatron.core.utils import unwrap_model

        from nemo_noise_plugin.instructions import instruction_examples

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
