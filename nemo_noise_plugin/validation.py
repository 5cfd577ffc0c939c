"""Checks for configuration values, with errors that name the setting, the value and what is allowed.

Shared by the dataclass configs (``NoiseConfig``, ``KDConfig``, validated in ``__post_init__``) and the privacy
math (``noise.calibration``, ``privacy.accounting``). ``setting`` is the name as the user wrote it:
``NoiseConfig.alpha`` for a field, ``gaussian_zcdp_rho: sigma`` for a function argument.
"""

from __future__ import annotations

import math

__all__ = ["check_bool", "check_choice", "check_int", "check_number", "is_finite_number"]


def is_finite_number(value: object) -> bool:
    """True for an int or float (not a bool) that is finite as a float (an int past 1.8e308 is not)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


def check_choice(setting: str, value: object, allowed: tuple[str, ...]) -> None:
    """Raise ``ValueError`` unless ``value`` is one of ``allowed``."""
    if value not in allowed:
        raise ValueError(f"{setting}={value!r} is invalid: expected one of {', '.join(allowed)}.")


def check_bool(setting: str, value: object) -> None:
    """Raise ``ValueError`` unless ``value`` is a bool."""
    if not isinstance(value, bool):
        raise ValueError(f"{setting}={value!r} is invalid: expected true or false.")


def check_number(
    setting: str,
    value: object,
    *,
    minimum: float,
    maximum: float | None = None,
    inclusive: bool = True,
    optional: bool = False,
) -> None:
    """Raise ``ValueError`` unless ``value`` is a finite number in the range (closed, or open when not inclusive).

    ``optional`` only adds "(or null)" to the message: the caller decides whether None is allowed.
    """
    in_range = is_finite_number(value) and (value >= minimum if inclusive else value > minimum)
    if in_range and maximum is not None:
        in_range = value <= maximum if inclusive else value < maximum
    if not in_range:
        bound = f">= {minimum:g}" if inclusive else f"> {minimum:g}"
        if maximum is not None:
            bound = f"in [{minimum:g}, {maximum:g}]" if inclusive else f"in ({minimum:g}, {maximum:g})"
        also = " (or null)" if optional else ""
        raise ValueError(f"{setting}={value!r} is invalid: expected a finite number {bound}{also}.")


def check_int(setting: str, value: object, *, minimum: int = 0, maximum: int | None = None) -> None:
    """Raise ``ValueError`` unless ``value`` is an int (not a bool) in ``[minimum, maximum]``."""
    valid = not isinstance(value, bool) and isinstance(value, int) and value >= minimum
    if not valid or (maximum is not None and value > maximum):
        limit = f" and <= {maximum}" if maximum is not None else ""
        raise ValueError(f"{setting}={value!r} is invalid: expected an integer >= {minimum}{limit}.")
