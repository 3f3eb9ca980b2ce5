"""One-line checks of values a caller hands the library (the Python API's arguments): a whole
number is not a bool, a float or a string, and a number is finite, each named in the error."""

from __future__ import annotations

import math
import numbers
import os
from typing import Any

PACKAGE = os.path.dirname(os.path.abspath(__file__))  # (shardwise's own code)


def whole_number(name: str, value: Any, least: int = 0) -> int:
    """`value` if it is a whole number >= `least` (a bool is not), else a one-line ValueError."""
    # (numpy's integers are whole numbers too)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
        raise ValueError(f"{name} must be a whole number >= {least}, got {value!r}")
    return int(value)


def finite_number(
    name: str, value: Any, above: float | None = None, least: float | None = None
) -> float:
    """`value` if it is a finite number (a bool is not), > `above` and >= `least` where given,
    else a one-line ValueError."""
    number = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if not number or not _finite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if above is not None and not value > above:
        raise ValueError(f"{name} must be > {above}, got {value!r}")
    if least is not None and not value >= least:
        raise ValueError(f"{name} must be >= {least}, got {value!r}")
    return value


def _finite(value: numbers.Real) -> bool:
    try:
        return math.isfinite(float(value))
    except OverflowError:  # (an int past a float's range)
        return False


def our_refusal(error: BaseException) -> bool:
    """A ValueError raised by shardwise's own code: a refusal whose message says it all, which
    a command or a rank prints as one line. One raised in a user's dataset, model or loss (or
    in torch) keeps its type and traceback: in one line, its place was lost."""
    if not isinstance(error, ValueError):
        return False
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is None or tb.tb_frame.f_code.co_filename.startswith(PACKAGE + os.sep)
