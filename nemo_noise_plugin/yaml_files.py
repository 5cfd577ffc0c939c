"""Every YAML the plugin reads, read one way: ``1e-3`` is a number, a key appears once, an empty file is an error.

PyYAML implements YAML 1.1, where a float needs a dot (``1.0e-3``): ``lr: 1e-3``, the way most people write a
learning rate, arrives as the string ``'1e-3'``, while OmegaConf (``OmegaConf.load``) and Hydra's ``key=value``
overrides read it as 0.001. PyYAML also lets a repeated key silently win and reads an empty file as ``None``. The
readers of ``--config-file`` (``training.overrides``), ``--noise-config`` and the presets (``presets``), the
ledger and audit configs and their ``key=value`` arguments (``parse_key_values``) all go through this module.

Rules (``PluginYAMLLoader``, a ``yaml.SafeLoader``: no Python tags):

- floats as in YAML 1.2 and OmegaConf: ``1e-3``, ``1E3``, ``-2.5e+4``, ``1.e3``, ``.5``, ``-.5``, ``.inf``,
  ``.nan``; integers stay integers (``3``, ``-7``, ``0x1F``), and so does YAML 1.1's ``1_000`` (the int 1000, as
  in OmegaConf, Hydra and Python); quote a string that looks like a number (``revision: "1e3"``);
- a key repeated in one mapping is an error naming the key and both lines (a ``<<`` merge is not a repeat);
- ``load_yaml_file``: an empty file (nothing but whitespace, comments or ``null``), a top level that is not a
  mapping, a binary or non-UTF-8 file, an unreadable one and a YAML syntax error raise ``YAMLInputError``, one line
  naming the file (and the line), what was wrong and what is allowed. A missing file raises ``FileNotFoundError``,
  as ``open`` does (the command lines report it as a file that cannot be read).
"""

from __future__ import annotations

import os
import re
from collections.abc import Collection, Sequence
from typing import Any

import yaml

__all__ = ["PluginYAMLLoader", "YAMLInputError", "load_yaml_file", "load_yaml_value", "parse_key_values"]

_FLOAT_TAG = "tag:yaml.org,2002:float"
_FLOAT = re.compile(
    r"""^(?:[-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+
    |[-+]?\.[0-9_]+(?:[eE][-+]?[0-9]+)?
    |[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+\.[0-9_]*
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.X,
)
"""YAML 1.1's float pattern with the exponent's sign optional and a dot-free mantissa allowed (``1e3``), as in
OmegaConf's loader, plus a sign before a leading dot (``-.5``, YAML 1.2). It never matches a plain integer."""


class YAMLInputError(ValueError):
    """A YAML file or command-line value the plugin cannot take; the message names the file (or the value)."""


class _DuplicateKeyError(yaml.constructor.ConstructorError):
    """A key repeated in one mapping (PyYAML would keep the last value)."""


class PluginYAMLLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` with YAML 1.2's exponent floats and mappings that reject a repeated key.

    Its resolver table is its own copy (``yaml.SafeLoader`` and other loaders are unchanged).
    """

    yaml_implicit_resolvers = {
        first: [(tag, regexp) for tag, regexp in resolvers if tag != _FLOAT_TAG]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        """The mapping of ``node``; raises a ``ConstructorError`` at the second occurrence of a repeated key."""
        if isinstance(node, yaml.MappingNode):
            first_lines: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = first_lines.get(key)
                except TypeError:
                    continue  # an unhashable key: the base constructor rejects it with its own message
                if first is not None:
                    raise _DuplicateKeyError(
                        None,
                        None,
                        f"duplicate key {key!r} (first set on line {first}); each key may appear once in a mapping",
                        key_node.start_mark,
                    )
                first_lines[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


PluginYAMLLoader.add_implicit_resolver(_FLOAT_TAG, _FLOAT, list("-+0123456789."))


def load_yaml_file(path: str | os.PathLike[str], *, what: str) -> dict:
    """The mapping in the YAML file at ``path``, read by ``PluginYAMLLoader``; ``what`` says what it must hold.

    Raises ``YAMLInputError`` naming the file for an empty file, a top level that is not a mapping, a repeated key,
    a syntax error, a binary or unreadable file; ``FileNotFoundError`` when there is no file. Example::

        values = load_yaml_file("my_noise.yaml", what="a mapping of NoiseConfig fields, e.g. alpha: 5")
        # my_noise.yaml "alpha: 1e1" -> {"alpha": 10.0}
    """
    name = os.fspath(path)
    try:
        with open(name, "rb") as handle:
            data = handle.read()
    except FileNotFoundError:
        raise  # as open() raises it: the command lines say which file is missing
    except OSError as error:
        raise YAMLInputError(f"{name}: cannot be read ({error.strerror or error}); expected {what}.") from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise YAMLInputError(
            f"{name}: not a text file (byte {error.object[error.start]:#04x} at position {error.start} is not UTF-8); "
            f"expected {what}, in UTF-8 text."
        ) from None
    try:
        loader = PluginYAMLLoader(text)
        try:
            node = loader.get_single_node()
            values = None if node is None else loader.construct_document(node)
        finally:
            loader.dispose()
    except yaml.reader.ReaderError as error:
        raise YAMLInputError(
            f"{name}: not a text file (character U+{error.character:04X} at position {error.position}); "
            f"expected {what}, in UTF-8 text."
        ) from None
    except yaml.YAMLError as error:
        raise YAMLInputError(f"{name}{_explain(error)}.") from None
    if values is None:
        raise YAMLInputError(f"{name}: the file is empty (nothing but whitespace, comments or null); expected {what}.")
    if not isinstance(values, dict):
        raise YAMLInputError(f"{name}: expected {what}, got {_kind(values)}.")
    return values


def load_yaml_value(text: str, *, what: str = "value") -> Any:
    """``text`` read as one YAML value by ``PluginYAMLLoader`` (``"1e3"`` -> 1000.0, ``""`` -> None).

    For ``key=value`` command-line arguments; raises ``YAMLInputError`` naming ``what`` for a syntax error or a
    repeated key in a ``{...}`` mapping. Example::

        load_yaml_value("1e-3")     # 0.001
        load_yaml_value("[1, 2]")   # [1, 2]
    """
    try:
        return yaml.load(text, Loader=PluginYAMLLoader)  # a SafeLoader subclass: no Python tags
    except _DuplicateKeyError as error:
        raise YAMLInputError(f"{what}{_explain(error)}.") from None
    except yaml.YAMLError as error:
        raise YAMLInputError(
            f"{what}{_explain(error)}; expected a YAML value, e.g. 3, 1e-3, true, null, [1, 2] or text."
        ) from None


def parse_key_values(arguments: Sequence[str], text_keys: Collection[str] = ()) -> dict[str, Any]:
    """``["epochs=3", "clip_norm=null", "tokens=1e3"]`` -> ``{"epochs": 3, "clip_norm": None, "tokens": 1000.0}``
    (values read as YAML by ``yaml_files.load_yaml_value``: ``1e-3`` is a number). The values of ``text_keys``
    (names, paths, ``sweep=alpha:1,5``) stay the text as typed, so YAML cannot turn ``alpha:`` into a mapping."""
    values: dict[str, Any] = {}
    for argument in arguments:
        key, separator, value = argument.partition("=")
        if not separator or not key:
            raise ValueError(f"argument {argument!r} is invalid: expected key=value, e.g. sequence_length=512.")
        if key in values:  # the last one would win without a word
            raise ValueError(f"argument {key}= is given more than once: expected each argument once ({argument!r}).")
        values[key] = value if key in text_keys else load_yaml_value(value, what=f"argument {argument!r}")
    return values


def _explain(error: yaml.YAMLError) -> str:
    """``, line 3: duplicate key 'alpha' ...`` or ``: not valid YAML: ...`` for a PyYAML error, on one line."""
    if isinstance(error, _DuplicateKeyError):
        return f", line {error.problem_mark.line + 1}: {error.problem}"
    parts = [part for part in (getattr(error, "context", None), getattr(error, "problem", None)) if part]
    message = "; ".join(parts) if parts else str(error)
    mark = getattr(error, "problem_mark", None)
    where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
    return f": not valid YAML: {' '.join(message.split())}{where}"


def _kind(value: Any) -> str:
    names = {list: "a list", str: "a string", int: "an integer", float: "a number", bool: "true or false"}
    return f"{names.get(type(value), type(value).__name__)} ({value!r:.60})"
