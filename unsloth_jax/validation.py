"""Argument checks that fail at once, naming the argument and the value (TypeError for a wrong type,
ValueError for a wrong value), instead of failing later inside jax or optax."""
from __future__ import annotations

import math
import numbers


def check_int(name: str, value, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """`value` as an int (bools and floats are refused), within [minimum, maximum] when given."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    return value


def check_number(name: str, value, *, minimum: float | None = None, maximum: float | None = None,
                 exclusive_minimum: bool = False, exclusive_maximum: bool = False) -> float:
    """`value` as a finite float (strings and bools are refused), within the given bounds."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if minimum is not None and (value < minimum or (exclusive_minimum and value == minimum)):
        raise ValueError(f"{name} must be {'>' if exclusive_minimum else '>='} {minimum}, got {value:g}")
    if maximum is not None and (value > maximum or (exclusive_maximum and value == maximum)):
        raise ValueError(f"{name} must be {'<' if exclusive_maximum else '<='} {maximum}, got {value:g}")
    return value


def check_bool(name: str, value) -> bool:
    """`value` as a bool (ints other than bools, and strings, are refused)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")
    return value


def check_choice(name: str, value, choices) -> str:
    """`value` when it is one of `choices`."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")
    return value
