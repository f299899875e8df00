r"""What a step records on the host, put back when the device skips or refuses the step.

A step that must change nothing (``nonfinite="skip"``, a ``GradScaler``'s ``found_inf``,
the fused step's refusal with ``nonfinite="raise"``) writes nothing on the device:
``torch.where`` against the old values, or the fused kernels' flag. What it records on
the host is not decided there: each parameter's state entries it creates or replaces (a
first step's state, a frozen preconditioner, a float32 master, the rate a momentum buffer
was written at) and the host numbers (``StateField.host``: RMSprop's and AdamW's step
counts, the step of a freeze), which the update advances in Python as ``torch.optim``
advances its step counts (:func:`host_record`). They are put back:

- for a refused fused step, with the chain's step counter
  (``fused/nonfinite.DeferredRefusal``): it was never taken;
- for a skipped step (:func:`put_back_if_skipped`), without it: the chain's counter, the
  noise index, moves on as for every sampler (``docs/guide/samplers.md``), and the rest
  is the run without that step, as torch's fused Adam takes its count back
  (``state_steps -= found_inf``). Its lr re-expression is gated on the device too
  (:func:`rescale_gate`): the buffer keeps its bits where its rate is put back. Only a
  sampler that keeps host numbers records anything (PSGLD, AdamWSGHMC): the others'
  skipped step reads nothing back, and ``torch.compile(opt.step)`` stays one graph.

The verdict is on the device. On the CPU reading it costs no synchronisation, and the
record is put back at the end of the step. Elsewhere it is copied to the host without
waiting (into pinned memory, behind an event) and read at the start of the next
``step()``, ``state_dict()``, ``temperature_estimates()`` or copy of the optimizer
(:func:`settle_skipped`), before anything reads the counts, as the fused step's deferred
refusal is read: until then a skipped step's counts read one ahead.

At temperature 0 such a sampler takes torch's own optimizer's step (``RMSprop``,
``AdamW``), in place: :func:`exact_step_unless_skipped` takes it against copies, so that a
skipped step keeps every bit, and a kept one is torch's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any

import torch
from torch import Tensor

from ..definition import UpdateInput

__all__ = [
    "exact_step_unless_skipped",
    "host_record",
    "known_on_host",
    "put_back_if_skipped",
    "rescale_gate",
    "settle_skipped",
]

#: one param group's gathered step: (its index, the group, params and their gradients)
Gathered = Sequence[tuple[int, dict[str, Any], list[Tensor], list[Tensor]]]
#: the runtime entry of a skipped step's record waiting for its verdict
_PENDING = "skipped_record"


def host_record(
    state: MutableMapping[Tensor, dict[str, Any]],
    param_groups: Sequence[dict[str, Any]],
    gathered: Gathered,
    host_names: Sequence[str],
    *,
    counters: bool,
) -> Callable[[], None]:
    """A function that puts back what a step records on the host, as it is now.

    Entries added later are removed, entries replaced (a buffer widened to float32 with
    a new master, a rate) take back their tensors, and the host numbers (``host_names``)
    their values; with ``counters``, each group's step counter too. Tensors written in
    place on the device are not its business (a skipped or refused step writes none).
    """
    steps = [(group, group["step"]) for group in param_groups] if counters else []
    params = [param for _, _, group_params, _ in gathered for param in group_params]
    entries = [(param, dict(state[param]) if param in state else None) for param in params]
    # each as (value, dtype): a 0-d CPU tensor read (no sync; 3x cheaper than a clone)
    numbers = [
        (param, name, float(value), value.dtype if isinstance(value, Tensor) else None)
        for param, keys in entries
        if keys is not None
        for name, value in keys.items()
        if name in host_names
    ]

    def rollback() -> None:
        for group, step in steps:
            group["step"] = step
        for param, keys in entries:
            if keys is None:
                state.pop(param, None)
                continue
            now = state[param]
            now.clear()
            now.update(keys)
        for param, name, value, dtype in numbers:
            state[param][name] = value if dtype is None else torch.tensor(value, dtype=dtype)

    return rollback


def known_on_host(device: torch.device) -> bool:
    """Whether a verdict on ``device`` is read without a synchronisation: the CPU's."""
    return device.type == "cpu"


class _Pending:
    """A skipped step's record, with its verdict on its way to the host."""

    def __init__(self, rollback: Callable[[], None], skipped: Tensor) -> None:
        self.rollback = rollback
        self._event = None
        if skipped.device.type == "cuda":
            self._host = skipped.to("cpu", non_blocking=True)  # into pinned memory
            self._event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._event.record(torch.cuda.current_stream(skipped.device))
        else:
            self._host = skipped.to("cpu", copy=True)

    def settle(self) -> None:
        if self._event is not None:
            self._event.synchronize()  # the copy, queued at the end of that step
        if bool(self._host):
            self.rollback()


def put_back_if_skipped(
    runtime: dict[str, Any],
    rollback: Callable[[], None] | None,
    kept: Mapping[torch.device, Tensor] | None,
) -> None:
    """Put back a step's host record (``rollback``) if the device skipped the step.

    ``kept``: per device, a boolean, True where the step was kept (each holds the
    verdict over every device). Read now from the CPU; otherwise left in ``runtime`` for
    :func:`settle_skipped`, its copy to the host queued without waiting. Nothing to do
    without a record or a verdict (None).
    """
    if rollback is None or not kept:
        return
    device = next((d for d in kept if known_on_host(d)), next(iter(kept)))
    skipped = kept[device].reshape(()).logical_not()
    if known_on_host(device):
        if bool(skipped):
            rollback()
        return
    runtime[_PENDING] = _Pending(rollback, skipped)


def settle_skipped(runtime: dict[str, Any]) -> None:
    """Read the verdict of the last step's record left in ``runtime``; put it back if skipped."""
    pending = runtime.pop(_PENDING, None)
    if pending is not None:
        pending.settle()


def rescale_gate(
    keep: Mapping[torch.device, Tensor] | None, host_names: Sequence[str]
) -> dict[torch.device, Tensor] | None:
    """The lr re-expression's ``unless_nonfinite`` for a step whose record a skip puts back.

    Per device, 0 where ``keep`` is True, infinity where the step is skipped (so that the
    buffer keeps every bit while its rate is put back); None where nothing is put back
    (no ``keep``, or a sampler without host numbers).
    """
    if keep is None or not host_names:
        return None
    return {device: torch.where(flag, 0.0, math.inf) for device, flag in keep.items()}


def exact_step_unless_skipped(
    exact: Callable[..., bool],
    group: Mapping[str, Any],
    inputs: UpdateInput,
    foreach: bool,
    keep: Mapping[torch.device, Tensor] | None,
    host_names: Sequence[str],
) -> bool:
    """A sampler's ``zero_temperature_step`` (torch's own step), a no-op where skipped.

    With ``keep`` (per device, False where the step must change nothing) the parameters
    and device buffers are selected against copies taken before (``torch.where``, no
    synchronisation); the host numbers (``host_names``) are the step's record's business.
    Returns what ``exact`` returns (False: it took no step).
    """
    if keep is None:
        return exact(group, inputs, foreach=foreach)
    watched = list(inputs.params)
    for name, field in inputs.buffers.items():
        if name not in host_names:
            watched += [buffer for buffer in field if isinstance(buffer, Tensor)]
    before = [tensor.clone() for tensor in watched]
    if not exact(group, inputs, foreach=foreach):
        return False
    for tensor, old in zip(watched, before, strict=True):
        tensor.copy_(torch.where(keep[tensor.device], tensor, old))
    return True
