"""The non-finite policy of a fused step: a device flag the kernels read, no host sync.

Before the kernels, one multi-tensor reduction per device and dtype computes each
gradient's largest absolute value (``torch._foreach_norm`` with ``ord=inf``, which
propagates NaN and cannot overflow) and their maximum, a 1-element float64 tensor per
device: the flag. It is finite exactly when every gradient is; each kernel reads it
and, when it is not, reads and writes nothing, as torch's fused optimizers do with
``found_inf``. Nothing is read back to Python:

- ``nonfinite="skip"``: the step is a no-op, counted in ``group["skipped_steps"]`` (a
  0-d integer tensor on the group's device), as the unfused step counts it, and what it
  advanced on the host (the step counts of PSGLD and AdamWSGHMC) is put back as the
  unfused step's is (``step/skipped_host``);
- ``nonfinite="raise"``: the error needs the flag on the host, so it comes later: the
  per-tensor maxima are copied to the host without waiting (:class:`DeferredRefusal`),
  and the next ``step()`` or ``state_dict()`` reads them (the copy finished long
  before, while the next forward and backward ran) and, when the step was refused,
  raises ``FloatingPointError`` naming the step and the parameter, after putting back
  what the refused step recorded on the host (its step counter, the state entries it
  created or replaced), so that the optimizer is as it was before it.

Under ``torch.amp.GradScaler`` none of this runs: the scaler's ``found_inf`` is the
verdict and becomes the flag (``step/grad_scaler.found_inf_flags``), a skipped step is
counted as with ``"skip"``, and nothing is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..step.nonfinite import count_skipped_where, describe_parameter
from ..tensor_lists import buckets

__all__ = ["DeferredRefusal", "NonfiniteCheck", "check_gradients", "count_skipped"]

#: one param group's gathered step: (its index, the group, params and their gradients)
Gathered = Sequence[tuple[int, dict[str, Any], list[Tensor], list[Tensor]]]
#: where a gradient comes from: its group's index, the group and the parameter
Where = tuple[int, dict[str, Any], Tensor]


class NonfiniteCheck(NamedTuple):
    """The device flags of a fused step and the per-tensor maxima behind them.

    Attributes:
        largest: per device, a 1-element float64 tensor: the largest absolute gradient
            over every gradient of the step (NaN or infinity when one is not finite).
        maxima: per (device, dtype) bucket, the gradients' largest absolute values
            stacked, and where each gradient comes from.
    """

    largest: dict[torch.device, Tensor]
    maxima: list[tuple[Tensor, list[Where]]]


def check_gradients(gathered: Gathered) -> NonfiniteCheck:
    """The flags of a fused step over every gradient of ``gathered``, on their devices."""
    grads, where = [], []
    for index, group, params, group_grads in gathered:
        for param, grad in zip(params, group_grads, strict=True):
            if grad.numel():
                grads.append(grad)
                where.append((index, group, param))
    maxima = []
    worst: dict[torch.device, list[Tensor]] = {}
    for bucket in buckets(grads):
        stacked = torch.stack(torch._foreach_norm([grads[i] for i in bucket], float("inf")))
        maxima.append((stacked, [where[i] for i in bucket]))
        worst.setdefault(stacked.device, []).append(stacked.amax().to(torch.float64))
    devices = {param.device for _, _, params, _ in gathered for param in params}
    largest = {}
    for device in devices:
        # to an accelerator without waiting; to the CPU (the interpreter) a copy waits
        here = [
            w.to(device, non_blocking=device.type != "cpu") for ws in worst.values() for w in ws
        ]
        if not here:
            largest[device] = torch.zeros(1, dtype=torch.float64, device=device)
        else:
            largest[device] = (here[0] if len(here) == 1 else torch.stack(here).amax()).reshape(1)
    return NonfiniteCheck(largest, maxima)


def count_skipped(gathered: Gathered, largest: dict[torch.device, Tensor]) -> None:
    """``nonfinite="skip"``: count the step in each group's ``skipped_steps`` if skipped.

    Skipped where the device's flag is not finite (``step/nonfinite.count_skipped_where``).
    """
    refused = {
        device: flag.isfinite().logical_not().reshape(()) for device, flag in largest.items()
    }
    count_skipped_where(gathered, refused)


class DeferredRefusal:
    """A fused step's verdict (``nonfinite="raise"``), read by the next call.

    Args:
        check: the step's :class:`NonfiniteCheck`; its per-tensor maxima are copied to
            the host now, without waiting for the device.
        steps: each group's step counter before the step, by ``id(group)``.
        rollback: puts back what the step recorded on the host (its counters, the state
            entries it created).
    """

    def __init__(
        self, check: NonfiniteCheck, *, steps: dict[int, int], rollback: Callable[[], None]
    ) -> None:
        self.steps = steps
        self.rollback = rollback
        self._maxima: list[tuple[Tensor, Any, list[Where]]] = []
        for stacked, where in check.maxima:
            event = None
            host = stacked
            if stacked.device.type == "cuda":
                host = stacked.to("cpu", non_blocking=True)  # into pinned memory
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(torch.cuda.current_stream(stacked.device))
            self._maxima.append((host, event, where))

    def culprit(self) -> tuple[str, int] | None:
        """The first parameter whose gradient was not finite, and the step's number.

        The number counts as the unfused refusal counts (from 1); None when every
        gradient was finite.
        """
        for host, event, where in self._maxima:
            if event is not None:
                event.synchronize()  # the copy, queued at the end of that step
            if bool(host.isfinite().all()):  # the common case, without a nonzero
                continue
            bad = torch.isfinite(host).logical_not().nonzero()
            if bad.numel():
                index, group, param = where[int(bad[0, 0])]
                position = next(i for i, p in enumerate(group["params"]) if p is param)
                return describe_parameter(group, index, position), self.steps[id(group)] + 1
        return None
