r"""A temperature monitor's window: its steps summed on the device, those that happened only.

A step's sums (:func:`~.chain_temperature.group_sums`, read before the step) are held as
they are, with what says whether the step happened: whether the group's
``skipped_steps`` counter stayed put over the step (``nonfinite="skip"`` and
``GradScaler`` count the steps they skip there) and the scaler's ``found_inf``. Holding
them costs an append. Every :data:`FOLD` steps, and before the read, they are stacked and
reduced at once, on the device: a step is *kept* when it happened and its sums are
finite, and ``torch.where`` sums the kept steps only (a skipped step adds zeros, even
where its sums are NaN). The flags stay on the device until :meth:`StepWindow.report`,
the one host read, counts them.

The terms' spread (the configurational band's) is the last kept measurement: a window
starts from the one its predecessor left (``spread``), so a skipped first step, which
is the one that measures it, leaves it unchanged.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import torch
from torch import Tensor

from .estimates import ChainTemperatureReport, TemperatureEstimate, TemperatureSums

__all__ = ["ALL_SKIPPED", "FOLD", "NO_SPREAD", "StepSums", "StepWindow"]

#: the steps held before they are reduced (a bound on the memory of a long window)
FOLD = 64
#: the notes of a window whose steps were skipped: every one, or every one with a spread
ALL_SKIPPED = "every step of the window was skipped (a non-finite gradient or an overflow)"
NO_SPREAD = "no band: every step that measured the terms' spread was skipped"


class StepSums(NamedTuple):
    """One param group's step, as the monitor read it, and whether it happened.

    Attributes:
        sums: the step's sums, read before it.
        same: the group's ``skipped_steps`` counter did not move over the step (a 0-d
            boolean on the device), or None where the group keeps no counter.
        found_inf: the ``found_inf`` a ``GradScaler`` handed the step (kept where 0), or
            None.
    """

    sums: TemperatureSums
    same: Tensor | None
    found_inf: Tensor | None


class StepWindow:
    """One param group's window in progress.

    Args:
        group: the param group's index.
        temperature: the T its steps were taken at.
        members: the number of stacked members (1 unstacked).
        spread: the last kept spread at this temperature (``[members]``), or None.

    Attributes:
        read_kinetic: the steps read with a momentum (kept or not), on the host.
        read_conf: the steps read with a gradient.
        read_spread: the steps that measured the terms' spread.
        spread: the terms' variance of the last kept step that measured it (NaN where
            none did), None before any measured it.
    """

    def __init__(self, group: int, temperature: float, members: int, spread: Tensor | None):
        self.group = group
        self.temperature = temperature
        self.members = members
        self.spread = spread
        self.read_kinetic = self.read_conf = self.read_spread = 0
        self.steps: list[StepSums] = []
        self._kinetic: Tensor | None = None
        self._kinetic_dof: Tensor | int = 0
        self._conf: Tensor | None = None
        self._conf_dof = 0
        self._kept: list[Tensor] = []  # per fold, one flag per step
        self._present: list[tuple[bool, bool]] = []  # per step, (momentum, gradient) read

    def add(self, step: StepSums) -> None:
        """Hold one step (no operation on the device; a fold every :data:`FOLD` steps)."""
        sums = step.sums
        if sums.kinetic is None and sums.conf is None:
            return  # nothing read (no momentum, no gradient): not a step of the window
        self.steps.append(step)
        self._present.append((sums.kinetic is not None, sums.conf is not None))
        self.read_kinetic += sums.kinetic is not None
        self.read_conf += sums.conf is not None
        self.read_spread += sums.conf_variance is not None
        if len(self.steps) >= FOLD:
            self._fold()

    def _fold(self) -> None:
        """Reduce the steps held into the window's sums, on the device."""
        steps, self.steps = self.steps, []
        if not steps:
            return
        some = next(t for s in steps for t in (s.sums.kinetic, s.sums.conf) if t is not None)
        zeros = torch.zeros(self.members, dtype=torch.float64, device=some.device)
        kinetic = _rows([s.sums.kinetic for s in steps], zeros)
        conf = _rows([s.sums.conf for s in steps], zeros)
        variance = _rows([s.sums.conf_variance for s in steps], zeros)
        read = [m for m in (kinetic, conf, variance) if m is not None]
        total = read[0] if len(read) == 1 else sum(read[1:], read[0])
        kept = total.isfinite().all(-1)  # inf - inf is NaN: one test for all
        kept = _and_happened(kept, steps)
        self._kept.append(kept)
        weight = kept.unsqueeze(-1)
        if kinetic is not None:
            values = _per_dof(steps, kinetic, zeros)
            latest = next(s.sums for s in reversed(steps) if s.sums.kinetic is not None)
            self._kinetic_dof = latest.kinetic_dof
            self._kinetic = _accumulate(self._kinetic, torch.where(weight, values, 0.0).sum(0))
        if conf is not None:
            self._conf_dof = next(
                s.sums.conf_dof for s in reversed(steps) if s.sums.conf is not None
            )
            self._conf = _accumulate(self._conf, torch.where(weight, conf, 0.0).sum(0))
        for index, step in enumerate(steps):
            measured = step.sums.conf_variance
            if measured is not None:
                last = math.nan if self.spread is None else self.spread
                self.spread = torch.where(kept[index], measured, last)

    def state(self) -> dict[str, Any]:
        """The window as plain values and tensors, which ``torch.load(weights_only=True)`` reads.

        Its steps are reduced first, on the device, with nothing read to the host.
        """
        self._fold()
        return {
            "group": self.group,
            "temperature": self.temperature,
            "members": self.members,
            "spread": self.spread,
            "read": (self.read_kinetic, self.read_conf, self.read_spread),
            "kinetic": self._kinetic,
            "kinetic_dof": self._kinetic_dof,
            "conf": self._conf,
            "conf_dof": self._conf_dof,
            "kept": list(self._kept),
            "present": [tuple(p) for p in self._present],
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> StepWindow:
        """The window :meth:`state` described."""
        window = cls(state["group"], state["temperature"], state["members"], state["spread"])
        window.read_kinetic, window.read_conf, window.read_spread = state["read"]
        window._kinetic = state["kinetic"]
        window._kinetic_dof = state["kinetic_dof"]
        window._conf = state["conf"]
        window._conf_dof = state["conf_dof"]
        window._kept = list(state["kept"])
        window._present = [(bool(k), bool(c)) for k, c in state["present"]]
        return window

    def report(self, level: float) -> list[ChainTemperatureReport]:
        """The window's reports, one per member: the kept steps' averages (a host read)."""
        self._fold()
        flags = torch.cat(self._kept).tolist() if self._kept else []
        kinetic_kept = sum(f and k for f, (k, _) in zip(flags, self._present, strict=True))
        conf_kept = sum(f and c for f, (_, c) in zip(flags, self._present, strict=True))
        sums = TemperatureSums(
            self.group,
            self.temperature,
            self.members,
            kinetic=self._kinetic,
            kinetic_dof=self._kinetic_dof,
            conf=self._conf,
            conf_variance=self.spread,
            conf_dof=self._conf_dof,
            kinetic_steps=kinetic_kept,
            conf_steps=conf_kept,
            variance_steps=0 if self.spread is None else 1,
        )
        reports = sums.report(level)
        if flags and not any(flags):
            return [dataclasses.replace(report, note=ALL_SKIPPED) for report in reports]
        return [_unmeasured_spread(report) for report in reports]


def _rows(values: list[Tensor | None], zeros: Tensor) -> Tensor | None:
    """``[steps, members]``: each step's value, zeros where it has none; None if none has."""
    if all(value is None for value in values):
        return None
    return torch.stack([zeros if value is None else value for value in values])


def _per_dof(steps: list[StepSums], kinetic: Tensor, zeros: Tensor) -> Tensor:
    """Each step's kinetic sum over its elements (one division when they share a count)."""
    dofs = [s.sums.kinetic_dof for s in steps if s.sums.kinetic is not None]
    first = dofs[0]
    if isinstance(first, int) and all(isinstance(d, int) and d == first for d in dofs):
        return kinetic / first
    return torch.stack(
        [zeros if s.sums.kinetic is None else s.sums.kinetic / s.sums.kinetic_dof for s in steps]
    )


def _and_happened(kept: Tensor, steps: list[StepSums]) -> Tensor:
    """``kept`` and, per step, its counter unmoved and the scaler's ``found_inf`` 0."""
    same = [s.same for s in steps]
    if any(flag is not None for flag in same):
        true = torch.ones((), dtype=torch.bool, device=kept.device)
        kept = kept.logical_and(torch.stack([true if f is None else f for f in same]))
    found = [s.found_inf for s in steps]
    present = [f.reshape(()) for f in found if f is not None]
    if present:
        zero = torch.zeros_like(present[0])
        stacked = torch.stack([zero if f is None else f.reshape(()) for f in found])
        wait = kept.device.type == "cpu"
        kept = kept.logical_and(stacked.to(kept.device, non_blocking=not wait).eq(0))
    return kept


def _accumulate(total: Tensor | None, part: Tensor) -> Tensor:
    return part if total is None else total.add_(part)


def _unmeasured_spread(report: ChainTemperatureReport) -> ChainTemperatureReport:
    """A configurational estimate whose spread no kept step measured: no band, a note."""
    estimate = report.configurational
    if estimate is None or not math.isnan(estimate.low):
        return report
    unbounded = TemperatureEstimate(estimate.value, -math.inf, math.inf, estimate.dof)
    note = f"{report.note}; {NO_SPREAD}" if report.note else NO_SPREAD
    return dataclasses.replace(report, configurational=unbounded, note=note)
