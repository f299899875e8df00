"""The non-finite policy of a sampler's step: refuse it, or skip it without a sync.

``nonfinite="raise"`` (the default) refuses a step whose gradients hold NaN or infinity,
naming the parameter, before anything changes; ``"skip"`` makes that step a no-op
selected on the device (``torch.where`` against the old values), counted in
``group["skipped_steps"]``, with no host synchronisation (``docs/design.md``,
"Refusals"). Under ``torch.amp.GradScaler`` its ``found_inf`` decides instead, whatever
the policy (``step/grad_scaler``): such a step is skipped and counted the same way. The
chain's step counter (the noise index) advances; what the step advanced on the host (the
step counts of PSGLD and AdamWSGHMC) is put back once the verdict reaches the host
(``step/skipped_host``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ..tensor_lists import all_finite, gradients_may_be_non_finite, select_

__all__ = [
    "count_skipped_where",
    "describe_parameter",
    "finite_flags",
    "kept",
    "refuse_non_finite_gradients",
]

#: one param group's gathered step: (its index, the group, params and their gradients)
Gathered = Sequence[tuple[int, dict[str, Any], list[Tensor], list[Tensor]]]


def describe_parameter(group: dict[str, Any], index: int, position: int) -> str:
    """Name a parameter in a message: its group, position, name and shape."""
    names = group.get("param_names")
    param = group["params"][position]
    name = f" {names[position]!r}" if names else ""
    return f"param group {index}, parameter {position}{name} of shape {tuple(param.shape)}"


def _gradients(gathered: Gathered) -> list[Tensor]:
    """Every group's gradients in one list (a single group's own list, not a copy)."""
    return gathered[0][3] if len(gathered) == 1 else [g for *_, gs in gathered for g in gs]


def refuse_non_finite_gradients(
    name: str, gathered: Gathered, kinds: list[list[int]] | None = None
) -> None:
    """Raise, before anything changes, if any gradient holds NaN or infinity.

    Fast path :func:`~._common.gradients_may_be_non_finite` (``kinds``: the gradients'
    buckets, where known); only on suspicion are the tensors checked one by one, to
    name the culprit.
    """
    if not gradients_may_be_non_finite(_gradients(gathered), kinds):
        return
    for index, group, _, _ in gathered:
        for position, param in enumerate(group["params"]):
            grad = param.grad
            if grad is not None and not bool(torch.isfinite(grad).all()):
                raise FloatingPointError(
                    f"{name} refused step {group['step'] + 1}: non-finite "
                    f"gradient in {describe_parameter(group, index, position)}; no parameter "
                    "or buffer was changed"
                )


def finite_flags(
    gathered: Gathered, kinds: list[list[int]] | None = None, *, one_pass: bool = False
) -> dict[torch.device, Tensor]:
    """``nonfinite="skip"``: whether every gradient is finite, one flag per device.

    Computed without reading anything back to Python (no host synchronisation, no
    graph break under ``torch.compile``); every param group counts the steps it
    skipped in ``group["skipped_steps"]``, a 0-d integer tensor on its device.
    ``one_pass`` and ``kinds`` (the gradients' buckets, where known): as for
    ``tensor_lists.all_finite``.
    """
    flags = all_finite(_gradients(gathered), kinds, one_pass=one_pass)
    count_skipped_where(gathered, {device: flag.logical_not() for device, flag in flags.items()})
    return flags


def count_skipped_where(gathered: Gathered, skipped_on: dict[torch.device, Tensor]) -> None:
    """Add 1 to each group's ``skipped_steps`` where ``skipped_on`` (per device) is True.

    ``group["skipped_steps"]`` is a 0-d integer tensor on the group's device, created at
    its first count; nothing is read back to Python.
    """
    for _, group, params, _ in gathered:
        if params:
            device = params[0].device
            skipped = group.get("skipped_steps")
            if not isinstance(skipped, Tensor):
                skipped = group["skipped_steps"] = torch.zeros((), dtype=torch.int64, device=device)
            flag = (
                skipped_on[skipped.device] if skipped.device in skipped_on else skipped_on[device]
            )
            skipped.add_(flag.to(device=skipped.device, dtype=torch.int64))


def kept(new: Tensor, old: Tensor | None, keep: dict[torch.device, Tensor]) -> Tensor:
    """``new`` where the step is kept, else ``old`` (zeros for a buffer the step created)."""
    before = torch.zeros_like(new) if old is None else old
    return select_(new, keep[new.device], new, before)  # the kernel's own buffer
