"""What ``nemo noise audit`` runs: the target built, ``audit_sweep`` over it, the JSON, table and PNG written.

``run_audit_report`` takes the settings ``jobs.audit.settings.parse_audit_arguments`` checked; ``audit_provenance``
is the report's provenance (the command, the plugin's version, the settings, the data file's sha256, the run's).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nemo_noise_plugin.jobs.audit.data import AUDIT_DATA, check_audit_data
from nemo_noise_plugin.jobs.audit.run_folder import TrainedRun
from nemo_noise_plugin.jobs.audit.spans import add_span_results, format_span_results, span_sources, span_targets
from nemo_noise_plugin.jobs.audit.targets import MODELS, AuditTarget, smollm2_target, tiny_target
from nemo_noise_plugin.jobs.reports.provenance import (
    command_line,
    compact_provenance,
    file_sha256,
    plugin_version,
    source_commit,
)
from nemo_noise_plugin.noise.config import NoiseConfig
from nemo_noise_plugin.privacy.audit.sweep import audit_sweep, format_sweep, write_sweep_report

__all__ = ["audit_provenance", "run_audit_report"]


def audit_provenance(settings: dict[str, Any], run: TrainedRun | None = None) -> dict[str, Any]:
    """The ``provenance`` of a ``nemo noise audit`` report: the command, the plugin's version, the audit's
    ``settings``, the sha256 of the audited data file (``data`` a JSONL path) and, with ``run``, the provenance of
    the run's latest report (``reports/latest/task_report.json``; without its config: ``config_sha256`` names it)."""
    data = settings.get("data")
    files = {str(data): file_sha256(data)} if data and data not in AUDIT_DATA and Path(data).is_file() else {}
    provenance: dict[str, Any] = {
        "command": "nemo noise audit",
        "command_line": command_line(),
        "plugin_version": plugin_version(),
        "source": source_commit(),
        "settings": settings,
        "data_files": files,
    }
    if run is not None:
        report = run.folder / "reports" / "latest" / "task_report.json"
        saved = json.loads(report.read_text()).get("provenance") if report.is_file() else None
        provenance["run"] = None if saved is None else compact_provenance(saved)
    return provenance


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
    ``Sweep.at_level_of`` of it). A run with ``NoiseConfig.tokens='spans'`` is audited on its private spans only
    (``jobs.audit.spans``: ``data`` a JSONL file of chats with ``private_spans``, default its training data; the
    canaries too where it has them; ``protected``, ``canaries`` and each row's ``span_ledger`` in the report).
    Example::

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
    spans = span_sources(run, data) if run is not None and run.noise.tokens == "spans" else None
    if spans is not None:
        data = str(spans.data)
    elif data is None:
        if run is not None and run.training_data is None:
            raise ValueError(
                f"run={str(run.folder)!r} has no data/training.jsonl (the run's training data, audited by default): "
                "expected that file, or give data=<a JSONL file>, data=validation or data=uniform."
            )
        data = str(run.training_data) if run is not None else ("corpus" if model == "tiny" else "validation")
    if spans is None:
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
    canaries = None
    try:
        if spans is not None:
            target, canaries = span_targets(run, spans, tokens=tokens, task_sequences=task_sequences)
        elif model == "tiny":
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
        common = dict(sequence_length=sequence_length, epochs=epochs or 1, neighbour_sample=neighbour_sample, **chunks)

        def sweep_of(audited: AuditTarget, **extra: Any) -> dict[str, Any]:
            """``audit_sweep`` of one target (the data's or a canary set's) at this audit's levels and attacks."""
            return audit_sweep(
                audited.table.to(device),
                audited.token_ids,
                base_config,
                sweeps,
                attacks,
                lm_log_probs=audited.lm_log_probs if "lm_beam" in attacks else None,
                padding_mask=audited.padding_mask,
                private_mask=audited.private_mask,
                special_ids=audited.special_ids,
                **common,
                **extra,
            )

        report = sweep_of(
            target,
            task_loss=target.task_loss if task_loss else None,
            task_exact_match=target.task_exact_match if task_loss else None,
            metadata={
                "model": target.name,
                "data": target.data,
                **metadata,
                "task_loss_note": target.task_loss_note if task_loss else "not measured",
            },
        )
        if spans is not None:
            add_span_results(report, target, canaries, sweep_of, epochs or 1)
    finally:
        if model == "tiny":
            from nemo_noise_plugin.jobs.cpu import destroy_cpu_parallel

            destroy_cpu_parallel()
    print(format_sweep(report) + ("\n" + format_span_results(report) if spans is not None else ""))
    paths = write_sweep_report(report, output_dir)
    print("report: " + ", ".join(paths.values()))
    return paths
