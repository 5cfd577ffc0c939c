"""The plugin's one dialect of setting checks: errors that name the setting, the value and what is allowed.

Every scalar check of the plugin goes through these helpers: the dataclass configs (``NoiseConfig``, ``KDConfig``,
validated in ``__post_init__`` and once more at their gate), the privacy math (``noise.calibration``,
``privacy.accounting``), the privacy audit's arguments (``privacy.audit``: its tensor shape and dtype checks stay
there) and the HF inference helpers. ``setting`` is the name as the user wrote it: ``NoiseConfig.alpha`` for a
field, ``gaussian_mechanism_delta: sigma`` for a function argument, ``top_k`` for an audit argument.

Each failure is a ``SettingError`` (a ``ValueError``, so callers catching ``ValueError`` keep working) whose message
has one shape::

    {setting}={value!r} is invalid[ with {other settings}]: expected {what is allowed}[{why}].

Checked at the boundary, trusted inside: a config is checked when it is constructed (``__post_init__``) and once
more, for assignments made after that, at the one gate where it starts work (a provider's ``finalize``, which
Bridge's ``ConfigContainer.validate`` calls; ``make_noisy`` for a model built without Bridge). Code between and after
the two trusts it (docs/bridge_config.md, "Where settings are checked").
"""

from __future__ import annotations

import math
import numbers

__all__ = [
    "FLOAT32_MAX",
    "SettingError",
    "check_bool",
    "check_choice",
    "check_float32",
    "check_int",
    "check_number",
    "is_finite_number",
    "shown_value",
    "type_note",
]

FLOAT32_MAX = 3.4028234663852886e38
"""The largest finite float32 (``torch.finfo(torch.float32).max``): a larger magnitude is inf in the model."""


class SettingError(ValueError):
    """A value a setting cannot take: ``setting``, ``value`` and ``expected`` (what is allowed) as attributes.

    The message is ``{setting}={value!r} is invalid{context}: expected {expected}{why}.``; ``context`` names other
    settings the verdict depends on (`` with mechanism='gaussian'``), ``why`` the reason (``: the noise would be
    inf``).
    """

    def __init__(self, setting: str, value: object, expected: str, *, context: str = "", why: str = "") -> None:
        self.setting, self.value, self.expected, self.context, self.why = setting, value, expected, context, why
        super().__init__(f"{setting}={shown_value(value)} is invalid{context}: expected {expected}{why}.")

    def __reduce__(self):  # picklable although __init__ takes more than the message (torchrun, multiprocessing)
        return _rebuild_setting_error, (type(self), self.setting, self.value, self.expected, self.context, self.why)


def _rebuild_setting_error(kind: type, setting: str, value: object, expected: str, context: str, why: str):
    return kind(setting, value, expected, context=context, why=why)


def shown_value(value: object, limit: int = 80) -> str:
    """``repr(value)``; a number's middle cut out when longer than ``limit`` characters (a 400-digit integer). Other
    values (paths, lists) are shown whole."""
    text = repr(value)
    if len(text) <= limit or not isinstance(value, numbers.Number):
        return text
    return f"{text[: limit // 2]}...{text[-12:]} ({len(text)} characters)"


def type_note(value: object, wanted: str) -> str:
    """Why ``value`` is not of the ``wanted`` kind (``number``, ``integer``, ``bool``) when its type is the reason:
    a quoted YAML value, a bool, a float for an integer, a numpy/torch/Decimal/Fraction number; "" otherwise."""
    if isinstance(value, str):
        if not _reads_as(value, wanted):
            return ""  # plain text (alpha=abc): "expected a finite number" already says it all
        plain = "true or false" if wanted == "bool" else "the number"
        return f": {value!r} is a string (quoted?); write {plain} without quotes"
    if isinstance(value, bool) and wanted != "bool":
        return f": {value!r} is a bool, not a {wanted}"
    if wanted == "integer" and isinstance(value, float):
        return f": {value!r} is a float; write an integer"
    kind = type(value)
    if kind.__module__ != "builtins" and (hasattr(value, "item") or isinstance(value, numbers.Number)):
        convert = "int" if wanted == "integer" else "float"
        return f": it is a {kind.__module__}.{kind.__qualname__}, not a Python {wanted}; pass {convert}(...) of it"
    if isinstance(value, int) and wanted == "number" and not is_finite_number(value):
        return ": it is larger than any float"
    return ""


def _reads_as(text: str, wanted: str) -> bool:
    """True when ``text`` would be a value of the ``wanted`` kind without its quotes ('5', 'false')."""
    if wanted == "bool":
        return text.strip().lower() in ("true", "false")
    try:
        (int if wanted == "integer" else float)(text)
    except ValueError:
        return False
    return True


def is_finite_number(value: object) -> bool:
    """True for an int or float (not a bool) that is finite as a float (an int past 1.8e308 is not)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


def check_choice(setting: str, value: object, allowed: tuple[str, ...]) -> None:
    """``SettingError`` unless ``value`` is one of ``allowed``."""
    if value not in allowed:
        raise SettingError(setting, value, f"one of {', '.join(allowed)}")


def check_bool(setting: str, value: object) -> None:
    """``SettingError`` unless ``value`` is a bool."""
    if not isinstance(value, bool):
        raise SettingError(setting, value, "true or false", why=type_note(value, "bool"))


def _range(minimum: float | None, maximum: float | None, inclusive: bool) -> str:
    if minimum is not None and maximum is not None:
        return f"in [{minimum:g}, {maximum:g}]" if inclusive else f"in ({minimum:g}, {maximum:g})"
    if minimum is not None:
        return f">= {minimum:g}" if inclusive else f"> {minimum:g}"
    if maximum is not None:
        return f"<= {maximum:g}" if inclusive else f"< {maximum:g}"
    return ""


def check_number(
    setting: str,
    value: object,
    *,
    minimum: float | None,
    maximum: float | None = None,
    inclusive: bool = True,
    optional: bool = False,
    why: str = "",
) -> None:
    """``SettingError`` unless ``value`` is a finite number (int or float, not a bool) in the range: closed, or open
    at both ends when not ``inclusive``; ``minimum=None`` leaves it unbounded below.

    ``optional`` only adds "(or null)" to the message: the caller decides whether None is allowed. ``why`` follows
    what is allowed (e.g. ``" (Dwork & Roth, Theorem A.1)"``).
    """
    valid = is_finite_number(value)
    if valid and minimum is not None:
        valid = value >= minimum if inclusive else value > minimum
    if valid and maximum is not None:
        valid = value <= maximum if inclusive else value < maximum
    if not valid:
        bound = _range(minimum, maximum, inclusive)
        expected = f"a finite number {bound}".rstrip() + (" (or null)" if optional else "")
        raise SettingError(setting, value, expected, why=why or type_note(value, "number"))


def check_int(
    setting: str, value: object, *, minimum: int = 0, maximum: int | None = None, optional: bool = False, why: str = ""
) -> None:
    """``SettingError`` unless ``value`` is an int (not a bool) in ``[minimum, maximum]``; ``optional`` as in
    ``check_number``."""
    valid = not isinstance(value, bool) and isinstance(value, int) and value >= minimum
    if not valid or (maximum is not None and value > maximum):
        limit = f" and <= {maximum}" if maximum is not None else ""
        expected = f"an integer >= {minimum}{limit}" + (" (or null)" if optional else "")
        raise SettingError(setting, value, expected, why=why or type_note(value, "integer"))


def check_float32(setting: str, value: float, *, what: str = "the noise") -> None:
    """``SettingError`` unless the finite number ``value`` stays finite as a float32 (``|value| <= FLOAT32_MAX``):
    the model computes in float32 (or narrower), where a larger magnitude is inf and makes ``what`` inf."""
    if abs(value) > FLOAT32_MAX:
        raise SettingError(
            setting,
            value,
            f"a magnitude <= {FLOAT32_MAX!r} (the largest float32)",
            why=f": a larger one is inf in float32, so {what} in the model would be inf",
        )
