"""The NeMo-Run executors ``finetune`` launches on: ``executor.KEY=VALUE`` settings and the checks before a launch.

``executor=NAME`` picks an entry of ``jobs.executors.kinds.EXECUTORS`` (its factory: ``EXECUTOR_FACTORIES``;
``cli.nemo_llm`` registers them with NeMo-Run), ``build_executor`` applies the command line's
``executor.KEY=VALUE`` settings to its ``run.Config`` with NeMo-Run's own parser and builds it, and
``check_executor`` rejects what cannot work before anything starts (the entry's check and the shared ones of
``jobs.executors.checks``); the factories live in ``jobs.executors.factories``. Importing this module is cheap
(NeMo-Run, no torch or Bridge).
"""

from __future__ import annotations

import difflib
import logging
import re
import typing
from collections.abc import Callable, Sequence
from typing import Any

from nemo_noise_plugin.jobs.executors.checks import (
    ExecutorSettingError,
    check_counts,
    check_layout,
    check_mounted_job_dir,
)
from nemo_noise_plugin.jobs.executors.kinds import EXECUTORS, kind_of

__all__ = [
    "COUNT_SETTINGS",
    "EXECUTOR_FACTORIES",
    "ExecutorSettingError",
    "build_executor",
    "check_executor",
]

EXECUTOR_FACTORIES: dict[str, Callable[..., Any]] = {name: kind.factory for name, kind in EXECUTORS.items()}
"""``executor=NAME`` -> factory (each ``EXECUTORS`` entry's); ``cli.nemo_llm`` registers them with NeMo-Run."""

COUNT_SETTINGS: dict[type, tuple[str | None, str]] = {
    kind.executor_class: (kind.nodes_setting, kind.ranks_setting) for kind in EXECUTORS.values()
}
"""Per executor class: the setting that counts nodes (None: always one) and the one that counts ranks per node
(each ``EXECUTORS`` entry's ``nodes_setting`` and ``ranks_setting``)."""


def check_executor(executor: Any, config: Any = None, *, cpu_loop: bool = False, gpus_here: int | None = None) -> None:
    """Reject executor settings that cannot work, before anything starts (``ExecutorSettingError``).

    Counts must be positive, with one rank per GPU; a local run has one node, several ranks need the torchrun
    launcher, ``gpus_here`` (this machine's GPU count, None: not checked) bounds the ranks, and with no GPU only a
    recipe with a CPU loop (``cpu_loop``) runs, in one process. Slurm needs an account; Docker, Lepton and DGX Cloud a
    container image, Lepton and DGX Cloud their job directory on mounted storage. With a resolved ``config`` the
    world size must be a multiple of TP x PP x CP. Which checks apply is the executor's ``EXECUTORS`` entry.
    """
    kind = kind_of(executor)
    check_counts(executor, kind.nodes_setting, kind.ranks_setting)
    kind.check(executor, cpu_loop=cpu_loop, gpus_here=gpus_here)
    if kind.job_dir_mount is not None:
        check_mounted_job_dir(executor, kind.job_dir_mount)
    if config is not None:
        check_layout(executor, config.model)


def _expected(annotation: Any) -> str:
    """What a value of ``annotation`` looks like on the command line."""
    text = getattr(annotation, "__name__", None) if isinstance(annotation, type) else None
    text = text or str(annotation).replace("typing.", "")
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is list:
        item = '{"key": "value"}' if args and typing.get_origin(args[0]) is dict else '"a", "b"'
        return f"{text}, e.g. '[{item}]' (quoted for the shell)"
    if origin is dict:
        return f'{text}, e.g. \'{{"key": "value"}}\' (quoted for the shell)'
    if annotation is int or int in args:
        return "a whole number"
    if annotation is bool or bool in args:
        return "true or false"
    return text


def build_executor(config: Any, name: str, settings: Sequence[str]) -> Any:
    """Apply ``executor.KEY=VALUE`` ``settings`` (prefix removed: ``KEY=VALUE``) to an executor factory's
    ``run.Config`` and build it; ``KEY`` may be nested (``tunnel.host=...``) or a dict entry (``env_vars.NAME=V``).

    Each bad setting is an ``ExecutorSettingError`` naming it, its value and what is allowed.
    """
    import fiddle as fdl
    from nemo_run.cli.cli_parser import CLIException, parse_cli_args

    executor_class = config.__fn_or_cls__
    fields = typing.get_type_hints(executor_class)
    public = sorted(field for field in fields if not field.startswith("_"))
    for setting in settings:
        key, sep, value = setting.partition("=")
        if not sep:
            raise ExecutorSettingError(f"executor.{setting} has no value; settings look like executor.KEY=VALUE.")
        head, _, rest = key.partition(".")
        if head not in fields or head.startswith("_"):
            close = difflib.get_close_matches(head, public, n=1)
            hint = f"did you mean executor.{close[0]}? " if close else ""
            raise ExecutorSettingError(
                f"executor.{key} is not a setting of {executor_class.__name__} (executor={name}); {hint}"
                f"settings: {', '.join(public)}."
            )
        if head == "env_vars" and rest:
            config.env_vars = {**(config.env_vars or {}), rest: value}
            continue
        parser_log = logging.getLogger("nemo_run.cli.cli_parser")
        level = parser_log.level
        parser_log.setLevel(logging.CRITICAL)  # it logs each failure at ERROR before raising; the error says it once
        try:
            parse_cli_args(config, [setting])
        except CLIException:
            expected = _expected(fields[head])
            if not value:  # NeMo-Run's parser takes no empty value, whatever the type
                raise ExecutorSettingError(
                    f"executor.{key}= has an empty value: expected {expected}; leave the setting out for "
                    f"{executor_class.__name__}'s default."
                ) from None
            raise ExecutorSettingError(
                f"executor.{key}={value!r} is invalid for {executor_class.__name__}: expected {expected}."
            ) from None
        finally:
            parser_log.setLevel(level)
    try:
        return fdl.build(config)
    except TypeError as error:
        missing = re.search(r"missing \d+ required (?:keyword-only )?arguments?: (.+)$", str(error).splitlines()[0])
        if missing:
            keys = re.findall(r"'(\w+)'", missing.group(1))
            required = ", ".join(f"executor.{key}" for key in keys)
            raise ExecutorSettingError(
                f"{required} {'is' if len(keys) == 1 else 'are'} required for executor={name} "
                f"(e.g. executor.{keys[0]}=...)."
            ) from None
        raise ExecutorSettingError(f"executor={name}: {str(error).splitlines()[0]}") from None
    except (AssertionError, ImportError, ValueError) as error:  # an executor's own __post_init__ check
        raise ExecutorSettingError(f"executor={name}: {' '.join(str(error).split())}") from None
