"""Argument checks that fail at once, naming the argument and the value, instead of failing later inside jax
or optax: TypeError for a value of the wrong type (a string where a number belongs), ValueError for a value of
the right type outside its range."""
from __future__ import annotations

import math
import numbers
import os


def require_int(name: str, value, minimum: int | None = None, maximum: int | None = None) -> int:
    """`value` as an int; TypeError unless it is an integer (bools are not), ValueError outside [minimum, maximum]."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    return int(value)


def require_real(name: str, value, minimum: float | None = None, maximum: float | None = None,
                 min_exclusive: bool = False, max_exclusive: bool = False) -> float:
    """`value` as a float; TypeError unless it is a real number (a string such as "2e-4" is not), ValueError
    when it is not finite or lies outside [minimum, maximum] (open at an end marked exclusive)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if minimum is not None and (value <= minimum if min_exclusive else value < minimum):
        raise ValueError(f"{name} must be {'>' if min_exclusive else '>='} {minimum:g}, got {value:g}")
    if maximum is not None and (value >= maximum if max_exclusive else value > maximum):
        raise ValueError(f"{name} must be {'<' if max_exclusive else '<='} {maximum:g}, got {value:g}")
    return float(value)


def require_choice(name: str, value, choices) -> str:
    """`value` if it is one of `choices` (strings); TypeError for a non-string, ValueError for another name."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a string, got {value!r} ({type(value).__name__})")
    if value not in choices:
        raise ValueError(f"{name} {value!r} is not supported; use one of {', '.join(choices)}")
    return value


def require_bool(name: str, value) -> bool:
    """`value` when it is True or False (ints and strings are refused)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")
    return value


def require_optional_bool(name: str, value) -> None:
    """TypeError unless `value` is True, False or None."""
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"{name} must be True, False or None, got {value!r} ({type(value).__name__})")


def require_path(name: str, value) -> None:
    """TypeError unless `value` is a str or os.PathLike; ValueError for an empty string."""
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{name} must be a path (str or os.PathLike), got {value!r} ({type(value).__name__})")
    if isinstance(value, str) and not value:
        raise ValueError(f"{name} must not be empty")
