"""HMC's arguments and their refusals (``docs/design.md``, "Refusals").

What each hyperparameter of a param group must be, which of them the groups must share
(one Metropolis test covers every parameter), that the scalars a step hands torch fit
the parameters' dtypes, that each parameter is whole (not a shard), the ``mass``
argument, the choice between a ``closure`` and a ``loss_fn``, and that ``HMC.run``'s
``loss_fn`` is a function of the parameters. Each check raises before anything changes,
with a message that names the argument, its value and what is allowed.
"""

from __future__ import annotations

import inspect
import reprlib
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ..core.chain import at_group, check_representable
from ..core.dtensor import is_dtensor
from ..core.validation import (
    check_nonnegative,
    check_num_data,
    check_open_unit_interval,
    check_positive,
    check_positive_int,
    check_temperature,
)
from ..names import parameter_layout

__all__ = [
    "SHARED",
    "check_fits",
    "check_group",
    "check_groups",
    "check_loss_fn",
    "check_mass",
    "check_one_of",
    "check_whole",
]

#: hyperparameters that one Metropolis test needs to be the same in every group
SHARED = ("num_data", "temperature", "num_steps", "jitter", "target_accept")


def check_group(group: dict[str, Any], *, where: str = "") -> None:
    """Validate one param group's hyperparameters; ``where`` locates it in messages."""
    check_positive("lr", group["lr"], where=where)
    check_positive_int("num_steps", group["num_steps"], where=where)
    check_num_data(group["num_data"], where=where)
    check_temperature(
        group["temperature"],
        where=where,
        positive=True,
        reason="the Metropolis test divides by T",
    )
    check_nonnegative("weight_decay", group["weight_decay"], where=where)
    jitter = group["jitter"]
    if isinstance(jitter, bool) or not isinstance(jitter, (int, float)):
        raise TypeError(f"Invalid jitter{where}: {jitter!r} (expected a number in [0, 1))")
    if not 0.0 <= jitter < 1.0:
        raise ValueError(f"Invalid jitter{where}: {jitter!r} (expected a number in [0, 1))")
    if group["target_accept"] is not None:
        check_open_unit_interval("target_accept", group["target_accept"], where=where)


def check_fits(group: dict[str, Any], *, where: str) -> None:
    r"""Raise unless ``lr``, ``weight_decay`` and ``num_data`` fit the group's dtypes.

    The samplers' check (:func:`~samplers_as_optim.core.chain.check_representable`)
    without its noise scale (HMC has none: its momentum is drawn at scale
    :math:`\sqrt{T M}`). The leapfrog step :math:`\sqrt{lr/N}\,(1 + j) < 2\sqrt{lr}` then
    fits too, and a step passes it (as ``alpha``) and N to torch as scalars of the
    parameters' dtype.
    """
    params = [p for p in group["params"] if p.is_floating_point()]
    check_representable({**group, "temperature": 0.0}, params, where=where)
    for dtype in {p.dtype for p in params}:
        largest = torch.finfo(dtype).max
        if not group["num_data"] <= largest:
            raise ValueError(
                f"Invalid num_data{where}: {group['num_data']!r} (expected a value that "
                f"fits {dtype}, at most {largest:.3g})"
            )


def check_groups(
    param_groups: Sequence[dict[str, Any]], checked: tuple[Any, ...] | None
) -> tuple[Any, ...] | None:
    """Validate every group, and that they share :data:`SHARED`; what was validated.

    Validated once per distinct setting: ``checked`` is what the last call returned, and
    a call with the same hyperparameters (plain numbers only) and dtypes returns at once.
    """
    names = ("lr", "num_steps", "num_data", "temperature", "weight_decay", *SHARED)
    values = tuple((type(g[n]), g[n]) for g in param_groups for n in names)
    plain = all(kind in (int, float, type(None)) for kind, _ in values)
    dtypes = tuple(p.dtype for g in param_groups for p in g["params"])
    if plain and (values, dtypes) == checked:
        return checked
    first = param_groups[0]
    for index, group in enumerate(param_groups):
        where = at_group(index)
        check_group(group, where=where)
        for name in SHARED:
            if group[name] != first[name]:
                raise ValueError(
                    f"Invalid {name}{where}: {group[name]!r} (expected the value of param "
                    f"group 0, {first[name]!r}: one Metropolis test covers every group)"
                )
        check_fits(group, where=where)
    return (values, dtypes) if plain else None


def check_mass(mass: Any) -> None:
    """Raise unless ``mass`` is None, ``"adapt"`` or a sequence (of tensors, checked later)."""
    if not (mass is None or isinstance(mass, (str, Sequence))):
        raise TypeError(
            f"Invalid mass: {mass!r} (expected None, 'adapt' or a sequence of tensors, "
            "one per parameter)"
        )
    if isinstance(mass, str) and mass != "adapt":
        raise ValueError(
            f"Invalid mass: {mass!r} (expected None, 'adapt' or a sequence of tensors, "
            "one per parameter)"
        )


def check_whole(params: Sequence[Tensor]) -> None:
    """Refuse parameters split over processes (DTensor shards, ensemble shares of a group)."""
    for p in params:
        if is_dtensor(p) or parameter_layout(p) not in (None, (0, p.numel())):
            raise NotImplementedError(
                f"HMC does not support parameters split over processes yet (a parameter "
                f"of shape {tuple(p.shape)} is a DTensor shard or a ParallelEnsemble "
                "share of a process group): its energy and accept test need the whole "
                "chain; run HMC in one process per chain"
            )


def check_one_of(closure: Any, loss_fn: Any, *, where: str, expected: str) -> None:
    """Exactly one of ``closure`` and ``loss_fn`` (the two ways to evaluate the loss), callable."""
    if (closure is None) == (loss_fn is None):
        raise ValueError(
            f"{where} needs a closure or a loss_fn, not "
            + ("neither" if closure is None else "both")
            + f" (expected {expected})"
        )
    if closure is not None and not callable(closure):
        raise TypeError(
            f"Invalid closure: {reprlib.repr(closure)} (expected a callable that zeroes the "
            "gradients, computes the full-batch mean loss, calls backward() and returns the loss)"
        )
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(
            f"Invalid loss_fn: {reprlib.repr(loss_fn)} (expected a callable: the full-batch "
            "mean loss as a function of the parameters)"
        )


def check_loss_fn(loss_fn: Any) -> None:
    """Refuse what is not a loss function of the parameters (a closure, say)."""
    if not callable(loss_fn):
        raise TypeError(
            f"Invalid loss_fn: {reprlib.repr(loss_fn)} (expected a callable: the full-batch "
            "mean loss as a function of the parameters)"
        )
    try:
        signature = inspect.signature(loss_fn)
    except (TypeError, ValueError):  # no signature to read (some builtins): let it be
        return
    try:
        signature.bind(None)
    except TypeError:
        raise TypeError(
            f"Invalid loss_fn: {reprlib.repr(loss_fn)} does not take one argument, the "
            "parameters (expected the full-batch mean loss as a function of the parameters; "
            "HMC.run takes no closure, whose backward() runs between the leapfrog steps: "
            "call step(closure) in a loop for that)"
        ) from None
