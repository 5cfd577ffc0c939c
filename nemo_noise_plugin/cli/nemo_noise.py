"""The ``noise`` command group of NeMo-Run's ``nemo`` command line: the plugin's own tools.

Registered under the ``nemo_run.cli`` entry-point group in ``pyproject.toml``; ``nemo`` imports this module to
build the group, so importing it must stay cheap and must not need Transformer Engine, a GPU or Megatron-Bridge.
``nemo noise ledger`` prints the privacy ledger of a noise config; ``nemo noise audit`` runs the token-recovery audit
report: its arguments are checked by ``jobs.audit.settings.parse_audit_arguments`` and run by
``jobs.audit.report.run_audit_report``. ``nemo llm finetune`` lives in
``cli.nemo_llm`` (the ``llm`` entry point; it moves to ``nemo noise finetune`` where NeMo 2's own ``llm`` group is
installed).
"""

# No ``from __future__ import annotations`` and no ``X | None``: NeMo-Run's argument parser (0.11) needs real
# types and rejects ``types.UnionType`` ("Unsupported type: float | None"), so the optional arguments use Optional.
import sys
from collections.abc import Sequence
from typing import Any, Optional

import nemo_run as run
from nemo_run.cli.api import Entrypoint

from nemo_noise_plugin.cli.console import quiet_for_nemo_command, quiet_third_party

quiet_for_nemo_command()  # before the imports below bring in Megatron (NeMo-Run imports this module at start-up)


LEDGER_SETTINGS: dict[str, type] = {
    "config": str,
    "sequence_length": int,
    "epochs": int,
    "delta": float,
    "hidden_size": int,
}
"""The ledger's own ``key=value`` arguments; every other key is a ``NoiseConfig`` field override."""


class KeyValueEntrypoint(Entrypoint):
    """A ``noise`` tool run in-process with its trailing ``key=value`` arguments as one list (``arguments``).

    NeMo-Run's own parser maps each ``key=value`` to a parameter of the function; the tools here also take the
    fields of a ``NoiseConfig`` as keys, so they parse the list themselves (``parse_key_values``).
    """

    def _execute_simple(self, args: list[str], console: Any) -> None:
        verbose = "--verbose" in args or "-v" in args
        quiet_third_party(verbose)
        try:
            self.fn(arguments=[arg for arg in args if arg not in ("--verbose", "-v")])
        except (OSError, ValueError) as error:  # a bad argument or file: one line, the usage exit status
            if verbose:
                raise
            print(f"Error: {' '.join(str(error).split())}", file=sys.stderr)
            raise SystemExit(2) from None


def run_ledger(arguments: Sequence[str]) -> str:
    """The ledger table for ``config=NAME_OR_PATH sequence_length=L [epochs=E] [delta=D] [hidden_size=d]
    [<NoiseConfig field>=<value> ...]``; raises ``ValueError`` naming a bad or missing argument."""
    from nemo_noise_plugin.noise.config import load_noise_config, parse_noise_arguments
    from nemo_noise_plugin.privacy.ledger import privacy_ledger
    from nemo_noise_plugin.privacy.ledger_format import format_ledger

    values = parse_noise_arguments(
        arguments,
        LEDGER_SETTINGS,
        required=("config", "sequence_length"),
        example="config=dp_gaussian_mechanism sequence_length=512",
    )
    overrides = {key: value for key, value in values.items() if key not in LEDGER_SETTINGS}
    config = load_noise_config(str(values["config"]), **overrides)
    ledger = privacy_ledger(
        config,
        sequence_length=values["sequence_length"],
        epochs=values.get("epochs", 1),
        delta=values.get("delta"),
        hidden_size=values.get("hidden_size"),
    )
    return format_ledger(ledger)


@run.cli.entrypoint(namespace="noise", enable_executor=False, entrypoint_cls=KeyValueEntrypoint)
def ledger(arguments: Optional[list[str]] = None) -> None:  # noqa: UP045
    """Print the privacy ledger of a noise config: per-token and per-sequence guarantees and their assumptions.

    Runs in-process; every argument is key=value::

        nemo noise ledger config=dp_gaussian_mechanism sequence_length=512 epochs=3
        nemo noise ledger config=my_noise.yaml sequence_length=512 epsilon=4 clip_norm=2

    Arguments: config (a preset name, see nemo_noise_plugin.presets, or a YAML file), sequence_length (tokens per
    sequence, L), epochs (passes over each sequence, E; default 1), delta (per-sequence delta; default the
    config's), hidden_size (d, for the expected noise norm); any other key overrides that NoiseConfig field.
    """
    print(run_ledger(arguments or []))


def run_audit(arguments: Sequence[str]) -> dict[str, str]:
    """Parse ``nemo noise audit`` arguments and run the report; the written files' paths."""
    from nemo_noise_plugin.jobs.audit.report import run_audit_report
    from nemo_noise_plugin.jobs.audit.settings import parse_audit_arguments

    settings = parse_audit_arguments(arguments)
    return run_audit_report(
        settings.pop("model", None),
        settings.pop("config"),
        settings.pop("sweeps"),
        settings.pop("attacks"),
        settings.pop("output_dir"),
        **settings,
    )


@run.cli.entrypoint(namespace="noise", enable_executor=False, entrypoint_cls=KeyValueEntrypoint)
def audit(arguments: Optional[list[str]] = None) -> None:  # noqa: UP045
    """Token-recovery audit: attack the noised embeddings at each noise level; write JSON, a table and a PNG.

    Runs in-process; every argument is key=value::

        nemo noise audit run=nemo_experiments/smollm2_135m_noise_sft output_dir=audit_out
        nemo noise audit run=nemo_experiments/smollm2_135m_noise_sft data=uniform sweep=epsilon:10,50 output_dir=out
        nemo noise audit model=smollm2 data=my_chats.jsonl sweep=standard output_dir=audit_out
        nemo noise audit model=tiny mechanism=uniform sweep=alpha:1,5,10,50 tokens=2000 output_dir=audit_out
        nemo noise audit model=smollm2 sweep="metric_dp/eta:100,10;gaussian_mechanism/epsilon:100,10" clip_norm=1

    Arguments: output_dir; and either run (a training run folder: its trained model's export reports/latest/hf is
    audited at the run's own noise mechanism and level, read from reports/latest/task_report.json or a checkpoint's
    run_config.yaml, with its held-out exact match under that noise and the ledger at its sequence length and
    epochs; sweep and NoiseConfig fields override the level) or model (tiny: a random tiny GPT, offline; smollm2:
    the real SmolLM2-135M-Instruct table) with sweep (field:level,... or mechanism/field:level,..., parts separated
    by ';', or standard). Optional: data (what is audited: a JSONL file of {"messages": [...]}, {"input", "output"}
    or {"text"} rows, the user's own text; uniform, a seeded sample of the vocabulary without special ids;
    validation, the shipped validation chats, smollm2's default without run=; corpus, tiny's default; with run= the
    default is the run's data/training.jsonl), tokens (audited tokens, default 2000), attacks (nn_l2, nn_cosine,
    direction, lm_beam; default nn_l2,nn_cosine), config (a noise preset or YAML as the base; not with run=),
    max_length (tokens per audited sequence, 64), task_sequences (held-out sequences for the task loss, 16),
    task_loss (false skips the task loss and exact match), hf_dir (with model=smollm2: audit this HF folder instead
    of the pretrained model), device (cpu or cuda), epochs (for the ledger), vocab_chunk, query_chunk,
    neighbour_sample (rows that estimate the median neighbour distance; default all); any other key overrides that
    NoiseConfig field (e.g. clip_norm=1). Counts are integers >= 1 and at most: tokens 10**6, max_length 8192,
    task_sequences and epochs 10,000, vocab_chunk 262,144, query_chunk 16,384, neighbour_sample 10**6
    (jobs.audit.settings.AUDIT_COUNT_LIMITS). The report states how many tokens and distinct ids were audited and from
    where. Bad arguments are reported in one line (exit 2) before any model is loaded.
    """
    run_audit(arguments or [])
