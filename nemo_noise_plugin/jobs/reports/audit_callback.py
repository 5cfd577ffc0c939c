"""The privacy audit during training: a Bridge callback that attacks the current embedding table on held-out tokens."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import torch

from nemo_noise_plugin.jobs.reports.provenance import compact_provenance, run_provenance
from nemo_noise_plugin.jobs.reports.robustness import held_out_batches
from nemo_noise_plugin.jobs.reports.task_frontier import input_embedding_table
from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.privacy.audit import audit
from nemo_noise_plugin.upstream.bridge_imports import import_bridge

__all__ = ["PrivacyAuditCallback"]


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
