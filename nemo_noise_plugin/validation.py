"""The plugin's one dialect of setting checks: errors that name the setting, the value and what is allowed.

Every scalar check of the plugin goes through these helpers: the dataclass configs (``NoiseConfig``, ``KDConfig``,
validated in ``__post_init__`` and at each gate), the privacy math (``noise.calibration``, ``privacy.accounting``),
the privacy audit's arguments (``privacy.audit``: its tensor shape and dtype checks stay there) and the HF inference
helpers. ``setting`` is the name as the user wrote it: ``NoiseConfig.alpha`` for a field, ``gaussian_mechanism_delta:
sigma`` for a function argument, ``top_k`` for an audit argument.

Each failure is a ``SettingError`` (a ``ValueError``, so callers catching ``ValueError`` keep working) whose message
has one shape::

    {setting}={value!r} is invalid[ with {other settings}]: expected {what is allowed}[{why}].

``ValidatedSettings`` gives a settings dataclass a ``validate()`` that runs its checks once per distinct field values:
the gates that re-check a config (a provider's ``finalize``, ``make_noisy``, the launcher) cost nothing on an
unchanged config, while any assignment after construction is checked at the next gate.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from typing import Any

__all__ = [
    "FLOAT32_MAX",
    "SettingError",
    "ValidatedSettings",
    "check_bool",
    "check_choice",
    "check_float32",
    "check_int",
    "check_number",
    "is_finite_number",
    "settings_fingerprint",
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
        super().__init__(f"{setting}={value!r} is invalid{context}: expected {expected}{why}.")

    def __reduce__(self):  # picklable although __init__ takes more than the message (torchrun, multiprocessing)
        return _rebuild_setting_error, (type(self), self.setting, self.value, self.expected, self.context, self.why)


def _rebuild_setting_error(kind: type, setting: str, value: object, expected: str, context: str, why: str):
    return kind(setting, value, expected, context=context, why=why)


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
        raise SettingError(setting, value, "true or false")


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
        raise SettingError(setting, value, expected, why=why)


def check_int(
    setting: str, value: object, *, minimum: int = 0, maximum: int | None = None, optional: bool = False, why: str = ""
) -> None:
    """``SettingError`` unless ``value`` is an int (not a bool) in ``[minimum, maximum]``; ``optional`` as in
    ``check_number``."""
    valid = not isinstance(value, bool) and isinstance(value, int) and value >= minimum
    if not valid or (maximum is not None and value > maximum):
        limit = f" and <= {maximum}" if maximum is not None else ""
        expected = f"an integer >= {minimum}{limit}" + (" (or null)" if optional else "")
        raise SettingError(setting, value, expected, why=why)


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


def settings_fingerprint(settings: Any) -> tuple:
    """The field values of a settings dataclass as a comparable tuple: each field's name, type and ``repr`` (so
    ``1`` and ``True``, ``1`` and ``1.0``, a list and a tuple, and an in-place change of a list all differ)."""
    return tuple(
        (field.name, type(value), repr(value))
        for field in dataclasses.fields(settings)
        for value in (getattr(settings, field.name),)
    )


_CHECKED: dict[int, tuple] = {}
"""``id(settings)`` -> the fingerprint of its fields after its last successful check (dropped when it is collected)."""


class ValidatedSettings:
    """Mixin of a settings dataclass whose checks (``_check``) run once per distinct field values.

    ``validate()`` is what the gates call (construction, a provider's ``finalize``, ``make_noisy``, the launcher):
    it runs ``_check`` unless the fields are exactly as they were after the last successful check (a fingerprint:
    ``settings_fingerprint``), so an unchanged config is checked once per build, and any assignment after
    construction (``config.alpha = -1``, ``config.special_token_ids.append(-1)``) is checked at the next gate.
    The fingerprint is kept outside the object (keyed by its id while it lives), so its ``__dict__``, equality,
    YAML, copies and ``dataclasses.replace`` never see it; a copy is checked afresh.
    """

    def validate(self) -> None:
        """Check every field as it is now (``_check``), unless unchanged since the last successful check."""
        key = id(self)
        if _CHECKED.get(key) == settings_fingerprint(self):
            return
        if _CHECKED.pop(key, None) is None:
            weakref.finalize(self, _CHECKED.pop, key, None)
        self._check()
        _CHECKED[key] = settings_fingerprint(self)  # after _check's normalisations

    def _check(self) -> None:
        raise NotImplementedError
