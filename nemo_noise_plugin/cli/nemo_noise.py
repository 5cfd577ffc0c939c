"""The ``noise`` command group of NeMo-Run's ``nemo`` command line: the plugin's own tools.

Registered under the ``nemo_run.cli`` entry-point group in ``pyproject.toml``; ``nemo`` imports this module to
build the group, so importing it must stay cheap and must not need Transformer Engine, a GPU or Megatron-Bridge.
``nemo noise ledger`` prints the privacy ledger of a noise config; ``nemo noise audit`` runs the token-recovery audit
report (``jobs.reports.audit_targets.run_audit_report``). ``nemo llm finetune`` lives in
``cli.nemo_llm`` (the ``llm`` entry point; it moves to ``nemo noise finetune`` where NeMo 2's own ``llm`` group is
installed).
"""

# No ``from __future__ import annotations`` and no ``X | None``: NeMo-Run's argument parser (0.11) needs real
# types and rejects ``types.UnionType`` ("Unsupported type: float | None"), so the optional arguments use Optional.
import dataclasses
import os
import sys
from collections.abc import Collection, Sequence
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


def parse_key_values(arguments: Sequence[str], text_keys: Collection[str] = ()) -> dict[str, Any]:
    """``["epochs=3", "clip_norm=null", "tokens=1e3"]`` -> ``{"epochs": 3, "clip_norm": None, "tokens": 1000.0}``
    (values read as YAML by ``yaml_files.load_yaml_value``: ``1e-3`` is a number). The values of ``text_keys``
    (names, paths, ``sweep=alpha:1,5``) stay the text as typed, so YAML cannot turn ``alpha:`` into a mapping."""
    from nemo_noise_plugin.yaml_files import load_yaml_value

    values: dict[str, Any] = {}
    for argument in arguments:
        key, separator, value = argument.partition("=")
        if not separator or not key:
            raise ValueError(f"argument {argument!r} is invalid: expected key=value, e.g. sequence_length=512.")
        if key in values:  # the last one would win without a word
            raise ValueError(f"argument {key}= is given more than once: expected each argument once ({argument!r}).")
        values[key] = value if key in text_keys else load_yaml_value(value, what=f"argument {argument!r}")
    return values


def run_ledger(arguments: Sequence[str]) -> str:
    """The ledger table for ``config=NAME_OR_PATH sequence_length=L [epochs=E] [delta=D] [hidden_size=d]
    [<NoiseConfig field>=<value> ...]``; raises ``ValueError`` naming a bad or missing argument."""
    from nemo_noise_plugin.noise.config import NoiseConfig, load_noise_config
    from nemo_noise_plugin.privacy.ledger import format_ledger, privacy_ledger

    values = parse_key_values(arguments)
    fields = [field.name for field in dataclasses.fields(NoiseConfig)]
    unknown = sorted(key for key in values if key not in LEDGER_SETTINGS and key not in fields)
    if unknown:
        raise ValueError(
            f"unknown argument(s) {', '.join(unknown)}: expected {', '.join(LEDGER_SETTINGS)} or a NoiseConfig field "
            f"({', '.join(fields)})."
        )
    missing = [key for key in ("config", "sequence_length") if key not in values]
    if missing:
        raise ValueError(
            f"missing argument(s) {', '.join(missing)}: e.g. config=dp_gaussian_mechanism sequence_length=512."
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


AUDIT_SETTINGS: dict[str, type] = {
    "model": str,
    "run": str,
    "data": str,
    "config": str,
    "sweep": str,
    "tokens": int,
    "attacks": str,
    "output_dir": str,
    "max_length": int,
    "task_sequences": int,
    "task_loss": bool,
    "hf_dir": str,
    "device": str,
    "epochs": int,
    "vocab_chunk": int,
    "query_chunk": int,
    "neighbour_sample": int,
}
"""The audit's own ``key=value`` arguments; every other key is a ``NoiseConfig`` field override."""
AUDIT_DEFAULTS: dict[str, Any] = {"config": None, "tokens": 2000, "attacks": "nn_l2,nn_cosine", "max_length": 64}
AUDIT_COUNT_LIMITS: dict[str, int] = {
    "tokens": 1_000_000,
    "max_length": 8192,
    "task_sequences": 10_000,
    "epochs": 10_000,
    "vocab_chunk": 262_144,
    "query_chunk": 16_384,
    "neighbour_sample": 1_000_000,
}
"""The audit's counts (integers >= 1) and the largest each may be, far past what a real audit needs, so that a typo
(``tokens=10**12``) is refused in one line instead of exhausting memory or running for days:

- ``tokens`` <= 10**6: the audited tokens, each noised and searched against the whole vocabulary (the default
  2,000 already gives recovery rates to about +-2%); a million tokens of SmolLM2's 576-wide table is 2.3 GB;
- ``max_length`` <= 8192: tokens per audited sequence, SmolLM2's context length (the tiny GPT's is shorter);
- ``task_sequences`` <= 10,000: held-out sequences for the task loss, more than the shipped validation split;
- ``epochs`` <= 10,000: passes over each sequence, for the ledger's composition;
- ``vocab_chunk`` <= 2**18 (262,144): table rows per search chunk, more than any vocabulary the plugin supports
  (a larger chunk is the whole table);
- ``query_chunk`` <= 2**14 (16,384): noised tokens per search chunk; the chunk's distances are
  ``query_chunk * vocab_chunk`` floats (the defaults 1024 * 4096 are 16 MiB);
- ``neighbour_sample`` <= 10**6: rows that estimate the median neighbour distance, past any vocabulary.
"""
AUDIT_COUNTS = tuple(AUDIT_COUNT_LIMITS)
"""The audit's settings that are counts: integers in ``[1, AUDIT_COUNT_LIMITS[name]]``."""


def check_writable_folder(path: str, setting: str) -> None:
    """``ValueError`` naming ``setting`` unless ``path`` is a folder that exists and can be written, or can be
    created (``artifacts.check_output_dir`` without creating it)."""
    from nemo_noise_plugin.jobs.reports.artifacts import check_output_dir

    check_output_dir(os.path.expanduser(path), setting, create=False)


def parse_audit_arguments(arguments: Sequence[str]) -> dict[str, Any]:
    """The ``nemo noise audit`` arguments checked and converted: ``config`` (a ``NoiseConfig``), ``sweeps``,
    ``attacks`` (a tuple), ``run`` (an ``jobs.reports.audit_targets.TrainedRun`` or None) and the run settings; raises
    ``ValueError`` naming a bad or missing argument. Reads the run folder's and data file's text; loads no model and
    writes nothing."""
    from nemo_noise_plugin.jobs.reports.audit_targets import MODELS, check_audit_data, check_hf_dir, read_run_folder
    from nemo_noise_plugin.noise.config import NoiseConfig, load_noise_config
    from nemo_noise_plugin.privacy.audit.run import ATTACKS
    from nemo_noise_plugin.privacy.audit.sweep import Sweep, parse_sweeps
    from nemo_noise_plugin.validation import check_choice, check_int

    values = parse_key_values(arguments, text_keys=[key for key, kind in AUDIT_SETTINGS.items() if kind is str])
    fields = [field.name for field in dataclasses.fields(NoiseConfig)]
    unknown = sorted(key for key in values if key not in AUDIT_SETTINGS and key not in fields)
    if unknown:
        raise ValueError(
            f"unknown argument(s) {', '.join(unknown)}: expected {', '.join(AUDIT_SETTINGS)} or a NoiseConfig field "
            f"({', '.join(fields)})."
        )
    required = ("output_dir",) if "run" in values else ("model", "sweep", "output_dir")
    missing = [key for key in required if key not in values]
    if missing:
        raise ValueError(
            f"missing argument(s) {', '.join(missing)}: e.g. model=tiny mechanism=uniform sweep=alpha:1,5,10 "
            "output_dir=audit_out, or run=<training run folder> output_dir=audit_out."
        )
    settings = {**AUDIT_DEFAULTS, **{key: value for key, value in values.items() if key in AUDIT_SETTINGS}}
    for key, kind in AUDIT_SETTINGS.items():
        value = settings.get(key)
        if value is not None and not (isinstance(value, kind) and (kind is bool or not isinstance(value, bool))):
            expected = {bool: "true or false", int: "an integer", float: "a number", str: "text"}.get(
                kind, kind.__name__
            )
            raise ValueError(f"{key}={value!r} is invalid: expected {expected}.")
    for key, limit in AUDIT_COUNT_LIMITS.items():
        if settings.get(key) is not None:
            check_int(
                key,
                settings[key],
                minimum=1,
                maximum=limit,
                why=" (a real audit needs far fewer; more would only exhaust memory or time)",
            )
    device = settings.get("device", "cpu")
    if device != "cpu" and device.split(":")[0] != "cuda":
        raise ValueError(f"device={device!r} is invalid: expected cpu or cuda (or cuda:N).")
    model = settings.get("model")
    if model is not None and model not in MODELS:
        raise ValueError(f"model={model!r} is invalid: expected one of {', '.join(MODELS)}.")
    overrides = {key: value for key, value in values.items() if key not in AUDIT_SETTINGS}
    trained = None
    if "run" in settings:
        for key in ("config", "hf_dir"):
            if settings.get(key) is not None:
                raise ValueError(
                    f"{key}={settings[key]!r} cannot be combined with run=: the run's own noise config and export are "
                    "audited; override single NoiseConfig fields (e.g. epsilon=10) or give sweep= instead."
                )
        if model not in (None, "smollm2"):
            raise ValueError(f"model={model!r} is invalid with run=: expected smollm2 or none (the run's HF export).")
        trained = settings["run"] = read_run_folder(settings["run"])
        config = dataclasses.replace(trained.noise_at_inference, **overrides)
        if "sweep" not in settings and not config.is_active_configuration:
            raise ValueError(
                f"run={str(trained.folder)!r} trained without noise ({trained.noise_source}: enabled="
                f"{trained.noise.enabled}, mechanism={trained.noise.mechanism!r}): there is no level of its own to "
                "audit; give sweep=, e.g. sweep=alpha:1,5,10."
            )
    elif settings["config"]:
        config = load_noise_config(settings["config"], **overrides)
    else:
        config = NoiseConfig(**overrides)
    if settings.get("hf_dir") is not None:
        if model != "smollm2":
            raise ValueError(f"hf_dir={settings['hf_dir']!r} is only used with model=smollm2 (got model={model!r}).")
        check_hf_dir(settings["hf_dir"])
    if "data" in settings:
        check_audit_data(settings["data"], model or "smollm2")
    settings["config"] = config
    sweep = settings.pop("sweep", None)
    settings["sweeps"] = [Sweep.at_level_of(config)] if sweep is None else parse_sweeps(str(sweep), config.mechanism)
    settings["attacks"] = tuple(a.strip() for a in str(settings["attacks"]).split(",") if a.strip())
    if not settings["attacks"]:
        raise ValueError(
            f"attacks={values.get('attacks')!r} is invalid: expected a comma-separated list from {', '.join(ATTACKS)}."
        )
    for attack in settings["attacks"]:
        check_choice("attacks", attack, ATTACKS)
    check_writable_folder(settings["output_dir"], "output_dir")
    return settings


def run_audit(arguments: Sequence[str]) -> dict[str, str]:
    """Parse ``nemo noise audit`` arguments and run the report; the written files' paths."""
    from nemo_noise_plugin.jobs.reports.audit_targets import run_audit_report

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
    (AUDIT_COUNT_LIMITS). The report states how many tokens and distinct ids were audited and from
    where. Bad arguments are reported in one line (exit 2) before any model is loaded.
    """
    run_audit(arguments or [])
