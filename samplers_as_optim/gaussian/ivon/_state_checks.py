"""What ``IVON.load_state_dict`` checks of a saved state before it loads anything.

A state that IVON cannot have written used to load and fail later, far from its cause: a
NaN or too negative ``hess`` made every draw NaN (then refused as an invalid weight
decay), an infinite ``momentum`` made every step refused as a non-finite gradient, a
missing entry was silently re-initialised or raised a raw ``KeyError``, a wrong shape
failed at the next draw. Here each is refused by name, before anything changes:

* the param groups hold IVON's hyperparameters, the chain's ``seed`` and ``step`` and
  the draw counters ``train_draws`` and ``eval_draws`` (integers >= 0);
* a parameter's state is empty (not drawn yet) or holds both ``"momentum"`` and
  ``"hess"``; within a step (``train_draws > 0``) every parameter that requires a
  gradient also holds the step's averages, ``"avg_grad"`` and the statistic of the
  group's ``hess_approx``;
* each of these is a floating-point tensor of the parameter's shape (torch's loader casts
  it to the parameter's dtype and device);
* ``momentum``, ``hess`` and, within a step, the averages are finite, and
  ``hess + weight_decay > 0`` everywhere (the group's weight decay): the invariant the
  update keeps (h itself may go below 0, down to -weight_decay), from
  ``hess_init > 0``.

The values are read with one device read per device and dtype (each tensor's minimum and
maximum, which NaN propagates to); only a load pays for it, never a step.
"""

from __future__ import annotations

import math
import reprlib
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

import torch
from torch import Tensor

from ...core.chain import CHAIN_KEYS, at_group
from ...core.validation import check_nonnegative_integer
from ...names import parameter_name
from ._checks import COUNTERS, HYPERPARAMETERS
from ._kernel import STATISTIC

__all__ = ["check_saved_groups", "check_saved_state"]

#: the entries every parameter's state holds once the parameter has been drawn
REQUIRED = ("momentum", "hess")
#: the buffers a state may hold (all of the parameter's shape)
BUFFERS = (*REQUIRED, "avg_grad", *STATISTIC.values())

#: one tensor whose values are checked: where, its entry, it, the group's weight decay
#: (for ``hess``: hess + weight_decay > 0) or None (finite values only)
_Item = tuple[str, str, Tensor, "float | None"]


def check_saved_groups(groups: Any) -> None:
    """Raise unless every saved param group holds IVON's hyperparameters and counters.

    Raises:
        ValueError: a group lacks one of them (another optimizer's state), or a draw
            counter is not an integer >= 0.
    """
    needed = (*CHAIN_KEYS, *COUNTERS, *HYPERPARAMETERS)
    if not all(isinstance(g, Mapping) and all(k in g for k in needed) for g in groups):
        raise ValueError(
            "Invalid state_dict: its param groups lack IVON's hyperparameters or its "
            "'seed', 'step', 'train_draws' and 'eval_draws' (expected the state_dict() of "
            "an IVON optimizer)"
        )
    for index, group in enumerate(groups):
        for name in COUNTERS:
            check_nonnegative_integer(name, group[name], where=at_group(index))


def check_saved_state(param_groups: Sequence[dict[str, Any]], state_dict: dict[str, Any]) -> None:
    """Raise unless each parameter's saved state is one IVON can continue from.

    Args:
        param_groups: the optimizer's param groups, which the state is loaded into.
        state_dict: the state, whose param groups :func:`check_saved_groups` and the
            hyperparameter checks passed. Where its groups do not match ``param_groups``
            in number or sizes nothing is checked here: torch's loader refuses it.

    Raises:
        ValueError: naming the param group, the parameter, the entry and what is allowed.
    """
    saved_groups = state_dict.get("param_groups", [])
    saved_state = state_dict.get("state", {})
    if not isinstance(saved_state, Mapping) or len(saved_groups) != len(param_groups):
        return
    if any(
        len(s.get("params", ())) != len(g["params"])
        for s, g in zip(saved_groups, param_groups, strict=True)
    ):
        return
    items: list[_Item] = []
    for index, (group, saved_group) in enumerate(zip(param_groups, saved_groups, strict=True)):
        names = saved_group.get("param_names") or group.get("param_names")
        for position, (param, param_id) in enumerate(
            zip(group["params"], saved_group["params"], strict=True)
        ):
            name = names[position] if names and position < len(names) else None
            name = parameter_name(param) if name is None else name
            label = "" if name is None else f" ({name!r})"
            where = f"parameter {position}{label} of param group {index}"
            items += _checked_entries(where, param, saved_state.get(param_id), saved_group)
    _check_values(items)


def _checked_entries(
    where: str, param: Tensor, entries: Any, group: Mapping[str, Any]
) -> list[_Item]:
    """Check one parameter's saved entries' presence, types and shapes; their values' items."""
    within = group["train_draws"] > 0 and param.requires_grad
    averages = ("avg_grad", STATISTIC[group["hess_approx"]])
    if entries is None:
        entries = {}
    if not isinstance(entries, Mapping):
        _refuse(where, f"a state {reprlib.repr(entries)}", "a dict of its buffers")
    if entries or within:
        for key in REQUIRED:
            if key not in entries:
                expected = "both 'momentum' and 'hess' once a parameter has a state"
                _refuse(where, f"no {key!r}", expected + ": IVON writes them together")
    if within:
        for key in averages:
            if key not in entries:
                _refuse(
                    where,
                    f"no {key!r}",
                    f"{averages[0]!r} and {averages[1]!r} within a step: train_draws = "
                    f"{group['train_draws']} in the param group, so these hold the averages "
                    "of the step's draws",
                )
    items: list[_Item] = []
    shape = tuple(param.shape)
    for key in BUFFERS:
        if key not in entries:
            continue
        value = entries[key]
        expected = f"a floating-point tensor of shape {shape}, the parameter's"
        if not isinstance(value, Tensor):
            _refuse(where, f"{key!r} is {reprlib.repr(value)}", expected)
        if not value.is_floating_point():
            _refuse(where, f"{key!r} is a {value.dtype} tensor", expected)
        if tuple(value.shape) != shape:
            _refuse(where, f"{key!r} of shape {tuple(value.shape)}", expected)
        if key in REQUIRED or (within and key in averages):
            decay = float(group["weight_decay"]) if key == "hess" else None
            items.append((where, key, value, decay))
    return items


def _check_values(items: list[_Item]) -> None:
    """Raise at the first tensor that is not finite, or a ``hess`` with hess + δ <= 0."""
    for (where, key, _, decay), extremes in zip(items, _extremes(items), strict=True):
        if extremes is None:  # empty: nothing to check
            continue
        low, high = extremes
        expected = "finite values"
        if decay is not None:
            expected += (
                f" with hess + weight_decay > 0, weight_decay = {decay!r} in the param group: "
                "the update keeps it positive from hess_init > 0"
            )
        if math.isnan(low) or math.isnan(high):
            _refuse(where, f"{key!r} holds NaN", expected)
        if math.isinf(low) or math.isinf(high):
            _refuse(where, f"{key!r} holds {'inf' if high == math.inf else '-inf'}", expected)
        if decay is not None and not low + decay > 0:
            _refuse(where, f"{key!r} reaches {low:.6g}", expected)


@torch.no_grad()
def _extremes(items: list[_Item]) -> list[tuple[float, float] | None]:
    """Each tensor's (minimum, maximum), NaN where it holds one; None where it is empty.

    One read per device and dtype: the tensors' extremes are stacked where they lie.
    """
    found: list[tuple[float, float] | None] = [None] * len(items)
    kinds: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, (_, _, tensor, _) in enumerate(items):
        if tensor.numel():
            kinds.setdefault((tensor.device, tensor.dtype), []).append(i)
    for members in kinds.values():
        tensors = [items[i][2] for i in members]
        values = torch.stack([torch.stack([t.amin(), t.amax()]) for t in tensors]).tolist()
        for i, (low, high) in zip(members, values, strict=True):
            found[i] = (low, high)
    return found


def _refuse(where: str, what: str, expected: str) -> NoReturn:
    raise ValueError(f"Invalid state_dict: {where}: {what} (expected {expected})")
