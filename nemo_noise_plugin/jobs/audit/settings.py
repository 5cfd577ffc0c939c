"""The arguments of ``nemo noise audit``: which are its own, their defaults and bounds, and their check.

``parse_audit_arguments`` turns the ``key=value`` list into the settings ``jobs.audit.report.run_audit_report``
takes, every value checked before a model is loaded (one ``ValueError`` naming the setting); ``cli.nemo_noise``
parses the command line over it. Importing this module stays cheap (NeMo-Run's ``nemo`` imports the command group
at start-up): everything heavier is imported inside ``parse_audit_arguments``.
"""

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

__all__ = [
    "AUDIT_COUNTS",
    "AUDIT_COUNT_LIMITS",
    "AUDIT_DEFAULTS",
    "AUDIT_SETTINGS",
    "check_writable_folder",
    "parse_audit_arguments",
]


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
    ``attacks`` (a tuple), ``run`` (a ``jobs.audit.run_folder.TrainedRun`` or None) and the run settings; raises
    ``ValueError`` naming a bad or missing argument. Reads the run folder's and data file's text; loads no model and
    writes nothing."""
    from nemo_noise_plugin.jobs.audit.data import check_audit_data
    from nemo_noise_plugin.jobs.audit.run_folder import TrainedRun, check_hf_dir, read_run_folder
    from nemo_noise_plugin.jobs.audit.targets import MODELS
    from nemo_noise_plugin.noise.config import NoiseConfig, load_noise_config, parse_noise_arguments
    from nemo_noise_plugin.privacy.audit.run import ATTACKS
    from nemo_noise_plugin.privacy.audit.sweep import Sweep, parse_sweeps
    from nemo_noise_plugin.validation import SettingError, check_choice, check_int

    values = parse_noise_arguments(
        arguments,
        AUDIT_SETTINGS,
        required=lambda values: ("output_dir",) if "run" in values else ("model", "sweep", "output_dir"),
        example="model=tiny mechanism=uniform sweep=alpha:1,5,10 output_dir=audit_out, or run=<training run folder> "
        "output_dir=audit_out",
        text_keys=[key for key, kind in AUDIT_SETTINGS.items() if kind is str],
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
        if trained.noise.tokens == "spans":
            from nemo_noise_plugin.jobs.audit.spans import span_sources

            span_sources(trained, settings.get("data"))  # a span run audits its spans: their data, checked now
    elif settings["config"]:
        config = load_noise_config(settings["config"], **overrides)
    else:
        config = NoiseConfig(**overrides)
    if settings.get("hf_dir") is not None:
        if model != "smollm2":
            raise ValueError(f"hf_dir={settings['hf_dir']!r} is only used with model=smollm2 (got model={model!r}).")
        check_hf_dir(settings["hf_dir"])
    if "data" in settings and not (
        isinstance(settings.get("run"), TrainedRun) and settings["run"].noise.tokens == "spans"
    ):
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
    repeated = sorted({attack for attack in settings["attacks"] if settings["attacks"].count(attack) > 1})
    if repeated:  # each attack once: a repeat only wrote the same rows twice
        raise SettingError(
            "attacks", values.get("attacks"), "each attack once", why=f": {', '.join(repeated)} is given more than once"
        )
    check_writable_folder(settings["output_dir"], "output_dir")
    return settings
