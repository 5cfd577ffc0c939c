"""What the override check says when it refuses a key: Hydra's complaints restated, the key named, its source.

``training.overrides`` raises ``ConfigOverrideError`` with these messages: an unknown key with the closest field
names (``unknown_key``), Hydra's grammar or merge failure in one line (``explain_hydra_error``), a config's own
message with its full key path (``name_key``: ``NoiseConfig.alpha=-1`` -> ``model.noise.alpha=-1``), and the
overrides that touched a key (``touching``).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from typing import Any

__all__ = [
    "explain_hydra_error",
    "join_key",
    "name_key",
    "override_key",
    "touching",
    "unknown_key",
    "unreadable_override",
]

_FIELD_LIST_LIMIT = 20
_MESSAGE_KEY = re.compile(r"^(?P<owner>\w+)(?:\.|: )(?P<field>\w+)=")


def explain_hydra_error(config: Any, message: str, overrides: list[str], culprit: str | None = None) -> str:
    """Hydra's complaints about a key restated in terms of the config: which class lacks the field, or why.

    ``culprit`` is the override Hydra's parser named (its ``OverrideParseException.override``), when the message
    Bridge re-raises no longer quotes it.
    """
    match = re.search(r"Could not (override|delete from config\.) '([^']+)'", message)
    if not match:
        return unreadable_override(message, overrides, culprit)
    key = match.group(2)
    owner = config
    for part in key.split(".")[:-1]:
        owner = getattr(owner, part, None)
    name = key.rpartition(".")[2]
    if not dataclasses.is_dataclass(owner):
        return message
    if not hasattr(owner, name):
        return unknown_key(owner, key, overrides)
    if match.group(1) != "override" and getattr(owner, name) is None:
        return f"~{key} is invalid: its value is already null, and Hydra cannot delete a null key." + touching(
            key, overrides
        )
    return message


def unreadable_override(message: str, overrides: list[str], culprit: str | None = None) -> str:
    """Hydra's grammar or merge failure restated in one line naming the override and what a value may be."""
    said = " ".join(message.split())
    if culprit not in overrides:
        culprit = next((item for item in overrides if item in message), None)
    if culprit is None and len(overrides) == 1:
        culprit = overrides[0]
    if culprit is None:
        return said
    grammar = "LexerNoViableAltException" in message or "mismatched input" in message or "no viable" in message
    why = "Hydra's override grammar cannot read it" if grammar else "Hydra cannot merge its value into the field"
    return (
        f"{culprit} is invalid: {why}; expected key=value with a number, true/false, null, a [list] or a string "
        f"(quote one with spaces or other characters: key='a b'). Hydra said: {said}"
    )


def unknown_key(owner: Any, key: str, overrides: list[str]) -> str:
    """``key is not a field of Owner; did you mean ...?`` (or the fields, when few), and the overrides that set it."""
    owner_type = owner if isinstance(owner, type) else type(owner)
    names = [f.name for f in dataclasses.fields(owner_type) if not f.name.startswith("_")]
    parent, _, name = key.rpartition(".")
    message = f"{key} is not a field of {owner_type.__name__}"
    close = difflib.get_close_matches(name, names, n=3)
    if close:
        message += f"; did you mean {' or '.join(join_key(parent, match) for match in close)}?"
    elif len(names) <= _FIELD_LIST_LIMIT:
        message += f"; fields: {', '.join(names)}."
    else:
        message += "."
    return message + touching(key, overrides)


def touching(key: str, overrides: list[str]) -> str:
    """`` (from a=1, a.b=2)``: the overrides that set ``key`` or a key under it (empty when none did)."""
    mine = [item for item in overrides if override_key(item) == key or override_key(item).startswith(key + ".")]
    return f" (from {', '.join(mine)})" if mine else ""


def name_key(message: str, owners: dict[str, str]) -> tuple[str, str]:
    """``NoiseConfig.alpha=-1 is invalid: ...`` -> ``model.noise.alpha=-1 is invalid: ...``, and the key it names.

    ``owners`` maps the class names that messages start with to their key paths in the config.
    """
    match = _MESSAGE_KEY.match(message)
    if match and match.group("owner") in owners:
        key = join_key(owners[match.group("owner")], match.group("field"))
        return f"{key}={message[match.end() :]}", key
    owner = next((path for name, path in owners.items() if message.startswith(name)), "")
    return (f"{owner}: {message}" if owner else message), owner


def override_key(override: str) -> str:
    """The key an override sets: ``+model.noise.alpha=3`` -> ``model.noise.alpha``."""
    return override.lstrip("+~").partition("=")[0].strip()


def join_key(path: str, name: str) -> str:
    """``path.name`` (``name`` alone at the top)."""
    return f"{path}.{name}" if path else name
