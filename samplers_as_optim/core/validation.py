"""One validator per argument kind, shared by every front end.

The optimizers, the torchopt transforms and the wrappers all validate through these
functions, so the same bad input gives the same message everywhere. Messages have the
shape ``Invalid temperature: nan (expected a finite number >= 0)``; ``where`` adds a
location such as ``" in param group 1"`` right after the argument's name.

NaN and infinity are rejected explicitly: every numeric check is written so that a NaN
fails it (``not value >= low`` rather than ``value < low``).
"""

from __future__ import annotations

import math
import numbers
import operator
import sys
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

import torch

__all__ = [
    "check_bool",
    "check_choice",
    "check_chunk_size",
    "check_finite",
    "check_foreach",
    "check_learning_rate",
    "check_momentum",
    "check_nonnegative",
    "check_nonnegative_integer",
    "check_num_data",
    "check_open_unit_interval",
    "check_positive",
    "check_positive_int",
    "check_seed",
    "check_step_counter",
    "check_temperature",
    "user_stacklevel",
]

_SEED_LIMIT = 2**64


def refuse(
    name: str, value: Any, expected: str, where: str, error: type[Exception] = ValueError
) -> NoReturn:
    raise error(f"Invalid {name}{where}: {value!r} (expected {expected})")


def check_state_fields(state: Any, fields: Sequence[str], *, source: str) -> None:
    """A loaded state: a mapping holding every one of ``fields``, as ``source`` writes it.

    Raises:
        TypeError: ``state`` is not a mapping.
        ValueError: a field is missing.
    """
    if not isinstance(state, Mapping):
        raise TypeError(
            f"Invalid state_dict: {type(state).__name__} (expected a mapping from {source})"
        )
    missing = [field for field in fields if field not in state]
    if missing:
        raise ValueError(
            f"Invalid state_dict: missing field(s) {missing} (expected a state from {source})"
        )


def _real(name: str, value: Any, expected: str, where: str) -> float:
    """Return ``value`` as a Python float, or raise TypeError naming ``name``.

    Accepts Python and NumPy reals and one-element tensors; rejects bools, complex
    numbers and anything else.
    """
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex() or value.dtype == torch.bool:
            refuse(name, value, expected, where, TypeError)
        return float(value.item())
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        refuse(name, value, expected, where, TypeError)
    return float(value)


def _integer(
    name: str, value: Any, expected: str, where: str, *, low: int, high: int | None
) -> int:
    """Return ``value`` as an int in [low, high) (Python, NumPy or 0-dim tensor integers).

    TypeError for bools and non-integers, ValueError outside the range; ``expected``
    describes the allowed values in the message.
    """
    if isinstance(value, bool):
        refuse(name, value, expected, where, TypeError)
    try:
        number = operator.index(value)
    except TypeError:
        refuse(name, value, expected, where, TypeError)
    if number < low or (high is not None and number >= high):
        refuse(name, value, expected, where)
    return number


def check_finite(name: str, value: Any, *, where: str = "") -> float:
    """Check that ``value`` is a finite real number and return it as a float."""
    expected = "a finite number"
    number = _real(name, value, expected, where)
    if not math.isfinite(number):
        refuse(name, value, expected, where)
    return number


def check_nonnegative(name: str, value: Any, *, where: str = "") -> float:
    """Check that ``value`` is a finite real number >= 0 and return it as a float."""
    expected = "a finite number >= 0"
    number = _real(name, value, expected, where)
    if not (math.isfinite(number) and number >= 0.0):
        refuse(name, value, expected, where)
    return number


def check_learning_rate(value: Any, *, where: str = "") -> float:
    """Check ``lr``: a finite number >= 0 (a float or a one-element tensor).

    A tensor of several elements is a ``ValueError``, as in ``torch.optim``.
    """
    if isinstance(value, torch.Tensor) and value.numel() != 1:
        refuse("lr", value, "a finite number >= 0; Tensor lr must be 1-element", where)
    return check_nonnegative("lr", value, where=where)


def check_temperature(
    value: Any, *, where: str = "", positive: bool = False, reason: str = ""
) -> float:
    """Check ``temperature``: finite and >= 0 (or > 0 when ``positive``, saying ``reason``)."""
    if not positive:
        return check_nonnegative("temperature", value, where=where)
    expected = "a finite number > 0" + (f": {reason}" if reason else "")
    number = _real("temperature", value, expected, where)
    if not (math.isfinite(number) and number > 0.0):
        refuse("temperature", value, expected, where)
    return number


def check_momentum(value: Any, *, where: str = "") -> float:
    """Check ``momentum``: a number in [0, 1).

    ``torch.optim.SGD`` accepts any momentum >= 0; a sampler needs a positive friction
    ``1 - momentum``, so 1 and above are rejected here.
    """
    expected = "a number in [0, 1)"
    number = _real("momentum", value, expected, where)
    if not (0.0 <= number < 1.0):
        refuse("momentum", value, expected, where)
    return number


def check_num_data(value: Any, *, where: str = "") -> int:
    """Check ``num_data``: the training-set size, a positive integer."""
    expected = "a positive integer: the number of training examples"
    return _integer("num_data", value, expected, where, low=1, high=None)


def check_seed(value: Any, *, where: str = "") -> int | None:
    """Check ``seed``: None or an integer in [0, 2**64)."""
    if value is None:
        return None
    expected = "None or an integer in [0, 2**64)"
    return _integer("seed", value, expected, where, low=0, high=_SEED_LIMIT)


def check_bool(name: str, value: Any, *, where: str = "") -> bool:
    """Check that a flag is a real bool (``maximize``, ``nesterov``, ...)."""
    if not isinstance(value, bool):
        refuse(name, value, "True or False", where, TypeError)
    return value


def check_foreach(value: Any, *, where: str = "") -> bool | None:
    """Check ``foreach``: None (choose automatically), True or False."""
    if value is not None and not isinstance(value, bool):
        refuse("foreach", value, "None, True or False", where, TypeError)
    return value


def check_nonnegative_integer(name: str, value: Any, *, where: str = "") -> int:
    """Check that ``value`` is an integer >= 0 (not a bool) and return it as an int."""
    return _integer(name, value, "an integer >= 0", where, low=0, high=None)


def check_step_counter(value: torch.Tensor, *, where: str = "") -> int:
    """Check a capturable step counter: a 0-d integer tensor holding a value >= 0.

    Reads the value (a host synchronisation off the CPU): when a group is planned or a
    state loaded, never in a step that may be captured.
    """
    expected = "an integer >= 0, or a 0-d integer tensor holding one"
    if value.dim() != 0 or value.dtype.is_floating_point or value.dtype.is_complex:
        refuse("step", value, expected, where)
    if value.dtype == torch.bool or int(value) < 0:
        refuse("step", value, expected, where)
    return int(value)


def check_positive(name: str, value: Any, *, where: str = "") -> float:
    """Check that ``value`` is a finite real number > 0 and return it as a float."""
    expected = "a finite number > 0"
    number = _real(name, value, expected, where)
    if not (math.isfinite(number) and number > 0.0):
        refuse(name, value, expected, where)
    return number


def check_chunk_size(value: Any, *, where: str = "") -> int | None:
    """Check ``chunk_size``: None (no chunking) or an integer >= 1."""
    if value is None:
        return None
    return _integer("chunk_size", value, "None or an integer >= 1", where, low=1, high=None)


def check_positive_int(name: str, value: Any, *, where: str = "") -> int:
    """Check that ``value`` is an integer >= 1 (bools rejected) and return it."""
    return _integer(name, value, "an integer >= 1", where, low=1, high=None)


def check_choice(name: str, value: Any, choices: tuple[str, ...], *, where: str = "") -> str:
    """Check that ``value`` is one of the strings in ``choices`` and return it."""
    if not isinstance(value, str) or value not in choices:
        expected = "one of " + ", ".join(repr(choice) for choice in choices)
        refuse(name, value, expected, where)
    return value


def check_open_unit_interval(name: str, value: Any, *, where: str = "") -> float:
    """Check that ``value`` is a real number in the open interval (0, 1) and return it."""
    expected = "a number in (0, 1)"
    number = _real(name, value, expected, where)
    if not 0.0 < number < 1.0:
        refuse(name, value, expected, where)
    return number


def user_stacklevel(inside: tuple[str, ...] = ("samplers_as_optim", "torch/optim")) -> int:
    """``warnings.warn``'s ``stacklevel``, from its caller, of the first frame not in ``inside``."""
    level, frame = 1, sys._getframe(1)
    while frame.f_back is not None and any(
        part in frame.f_code.co_filename.replace("\\", "/") for part in inside
    ):
        level, frame = level + 1, frame.f_back
    return level
