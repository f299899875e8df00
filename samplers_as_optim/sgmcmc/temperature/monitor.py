r"""Following a running chain's temperatures: :class:`TemperatureMonitor`, on step hooks.

Public as ``diagnostics.TemperatureMonitor`` and ``diagnostics.ChainTemperatureWarning``
(re-exported there). The estimates, their units and bands are :mod:`.chain_temperature`'s;
this module follows a running chain with them: each step read before it, added to a
window once it happened (``temperature/window``), the window read to the host every
``every`` steps.

**Scaled steps.** Under ``torch.amp.GradScaler``, ``scaler.step(opt)`` hands the sampler
``grad_scale`` :math:`s` and ``found_inf`` (``step/grad_scaler``): ``p.grad`` holds
:math:`s\,g` and the step reads :math:`g`. The monitor reads :math:`g` too
(``group_sums(grad_scale=s)``: the dot products of :math:`\theta` and :math:`s\,g`
divided by :math:`s`, exactly for the scaler's powers of two), and, after
``scaler.unscale_(opt)`` (no scale handed over), the gradient as it is.

**Steps that never happen.** A step's sums are read in its pre-hook, before the update
(the gradient is the one at that :math:`\theta`), and held until its post-hook: a step
that raises (``nonfinite="raise"``) has no post-hook, and what was read of it is dropped.
The post-hook hands the window the step with what says whether it happened, both on the
device: whether the group's ``param_group["skipped_steps"]`` counter moved
(``nonfinite="skip"`` with a non-finite gradient, or the scaler's overflow) and the
scaler's ``found_inf``. The window keeps the steps that happened and read finite sums,
without a host synchronisation.
"""

from __future__ import annotations

import dataclasses
import operator
import warnings
from collections.abc import Sequence
from typing import Any

from torch import Tensor

from ...core.validation import (
    check_bool,
    check_open_unit_interval,
    check_positive_int,
    check_state_fields,
    refuse,
)
from ..optimizer import SamplerOptimizer
from ..step.grad_scaler import scaler_input
from .estimates import (
    ChainTemperatureReport,
    TemperatureEstimate,
    TemperatureSums,
    group_sums,
)
from .rule import TemperatureRule
from .window import StepSums, StepWindow

__all__ = ["ChainTemperatureWarning", "TemperatureMonitor"]

#: a param group's step read by the pre-hook: its sums, a copy of the group's
#: ``skipped_steps`` then, and of the scaler's ``found_inf``
_Read = tuple[TemperatureSums, Tensor | None, Tensor | None]


class ChainTemperatureWarning(UserWarning):
    """A chain runs hotter than its target temperature (:class:`TemperatureMonitor`)."""


class TemperatureMonitor:
    r"""Follows an SG-MCMC chain's kinetic and configurational temperatures as it runs.

    Hooks into ``optimizer``'s steps (``register_step_pre_hook`` and
    ``register_step_post_hook``): before each step (one in ``stride``) it reduces
    :math:`\theta`, ``p.grad`` (the gradient at that :math:`\theta`, the one the step
    uses) and the momentum buffers to a few numbers per param group, which stay on the
    device; after the step it adds them to the window, if the step happened; every
    ``every`` steps it reads the window's averages to the host, appends
    one :class:`ChainTemperatureReport` per param group (per member of a
    ``ParallelEnsemble``'s stacked group) to :attr:`history` and starts a new window.
    The estimates, their units for each sampler and their bands are
    ``sgmcmc/temperature/estimates``'s: :math:`T_{\text{kin}} = \tfrac1d\sum_i r_i^2/M_i`
    (samplers with a momentum) and :math:`T_{\text{conf}} = \tfrac1d\sum_i\theta_i\,
    \partial_i U` (every sampler), each with a band at ``level`` under the target (a
    single step's, conservative for a window's average), over a fixed subset of at most
    about ``coordinates`` coordinates per param group (per member), spread over every
    tensor in proportion to its size (``sgmcmc/temperature/coordinates``): the
    estimates stay unbiased and their bands exact for :math:`d` the subset's size, and
    a reduced step costs the same whatever the model's size. With ``warn`` it warns once,
    with a :class:`ChainTemperatureWarning`, the first time a chain reads hot beyond
    its band. A group at temperature 0 has nothing to test and is skipped (its report
    says so); a step of ``lr`` 0 (skipped by the sampler) is not counted; a change of a
    group's temperature starts a new window.

    Scaled and skipped steps (``sgmcmc/temperature/monitor``). Under
    ``torch.amp.GradScaler`` the scaled ``p.grad`` is read divided by the scale the
    scaler hands the step, as the sampler reads it (after ``scaler.unscale_``, as it
    is). A step the sampler skips (the scaler's ``found_inf``, or a non-finite gradient
    under ``nonfinite="skip"``), or whose reduced sums are not finite, adds nothing to
    the window and is not counted in the report's ``steps``: decided on the device, it
    costs no host synchronisation. A step refused by ``nonfinite="raise"`` never
    happened, and leaves the window as it was. The terms' spread (the configurational
    band's) is measured at a window's first step; when that step is skipped the last
    one measured at that temperature serves, and with none yet the estimate has no band
    (its note says so). A window whose every step was skipped has no estimate.

    The monitor never changes the chain: it writes nothing into the optimizer, its
    state or its ``state_dict``. Between reads it adds no host synchronisation.

    Args:
        optimizer: an SG-MCMC sampler (``SamplerOptimizer``; every sampler of the
            package declares its ``temperature/rule``).
        every: steps per window: the estimates are read to the host every ``every``
            steps (an integer >= 1).
        level: the bands' two-sided probability under the target (in (0, 1)).
        warn: warn once when a chain is hot.
        stride: reduce one step in ``stride`` (an integer >= 1): the per-step cost
            divided by ``stride``, for the same reads. A reduced step reads the subset
            of :math:`\theta`, ``p.grad`` and the momentum (one dot product per tensor
            on strided views; the first of a window also the terms' variance): with the
            default ``coordinates``, a cost per tensor that does not grow with its size,
            1.6-2.0% of an ``SGHMC.step()`` on one CPU thread for a 1.9M-parameter MLP
            and 0.7-0.8% at 5.8M, against 9-11% reading every coordinate
            (``benchmarks/bench_chain_temperature.py``). A small model's step is cheap
            enough that this fixed cost shows: ``stride`` divides it.
        coordinates: the coordinates read per param group (per member), at most about
            this many (an integer >= 1; a group no larger is read whole), or None for
            every coordinate. Each tensor gets a share proportional to its size (at
            least one), every ``s``-th element with ``s`` coprime with its rows' length.
            The band's half-width grows as :math:`1/\sqrt d`: at the default 4096 and
            ``level=0.999`` the kinetic band flags a chain about 7.5% hotter than
            :math:`T`, against 0.34% for all of a 1.9M-parameter model; minibatch
            heating that matters (twice the variance) is far beyond either.

    Attributes:
        history: ``(step, reports)`` for each window read, ``step`` the optimizer steps
            the monitor had seen (skipped ones included, refused ones not).

    Raises:
        TypeError: ``optimizer`` is not a ``SamplerOptimizer``.
        ValueError: a bad ``every``, ``level``, ``stride``, ``warn`` or
            ``coordinates``, or a sampler without a ``temperature/rule``.

    Example:
        >>> import torch
        >>> from samplers_as_optim import SGHMC, diagnostics
        >>> model = torch.nn.Linear(20, 1)
        >>> opt = SGHMC(model.parameters(), lr=1e-3, momentum=0.9, num_data=100, seed=0)
        >>> monitor = diagnostics.TemperatureMonitor(opt, every=5, warn=False)
        >>> for _ in range(10):
        ...     opt.zero_grad()
        ...     model(torch.randn(8, 20)).pow(2).mean().backward()
        ...     opt.step()
        >>> len(monitor.history), len(monitor.report())
        (2, 1)
    """

    def __init__(
        self,
        optimizer: SamplerOptimizer,
        *,
        every: int = 10,
        level: float = 0.999,
        warn: bool = True,
        stride: int = 1,
        coordinates: int | None = 4096,
    ) -> None:
        if not isinstance(optimizer, SamplerOptimizer):
            raise TypeError(
                f"Invalid optimizer: {type(optimizer).__name__} (expected an SG-MCMC sampler, "
                "a SamplerOptimizer)"
            )
        self.every = check_positive_int("every", every)
        self.level = check_open_unit_interval("level", level)
        self.warn = check_bool("warn", warn)
        self.stride = check_positive_int("stride", stride)
        self.coordinates = _check_coordinates(coordinates)
        rule = optimizer.definition.temperature_rule
        if rule is None:
            raise ValueError(
                f"Invalid optimizer: {type(optimizer).__name__} (expected a sampler whose "
                "definition declares a temperature_rule)"
            )
        self.optimizer = optimizer
        self.rule: TemperatureRule = rule
        self.history: list[tuple[int, list[ChainTemperatureReport]]] = []
        self.warned = False
        self._steps = 0
        self._window: dict[int, StepWindow] = {}
        self._pending: dict[int, _Read] = {}
        #: per param group, (temperature, the last kept spread) across windows
        self._spread: dict[int, tuple[float, Tensor]] = {}
        self._handles = (
            optimizer.register_step_pre_hook(self._before_step),
            optimizer.register_step_post_hook(self._after_step),
        )

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._pending = {}  # a step that raised left its reads here: it never happened
        if self._steps % self.stride:
            return
        scaler = scaler_input(self.optimizer)  # what GradScaler.step handed the step
        found_inf = None if scaler.found_inf is None else scaler.found_inf.clone()
        for index, group in enumerate(self.optimizer.param_groups):
            temperature = float(group["temperature"])
            if temperature == 0 or float(group["lr"]) == 0 or not group["params"]:
                continue
            window = self._window.get(index)
            if window is not None and window.temperature != temperature:
                del self._window[index]  # a new temperature starts a new window
                window = None
            scale = scaler.grad_scale
            if scale is not None:
                device = group["params"][0].device
                scale = scale.reshape(()).to(device, non_blocking=device.type != "cpu")
            # the terms' spread (for the band) once per window, the means every step
            step = group_sums(
                self.rule,
                group,
                index,
                self.optimizer.state,
                spread=window is None or window.read_spread == 0,
                coordinates=self.coordinates,
                grad_scale=scale,
            )
            skipped = group.get("skipped_steps")
            before = skipped.clone() if isinstance(skipped, Tensor) else None
            self._pending[index] = (step, before, found_inf)

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        pending, self._pending = self._pending, {}
        for index, (step, before, found_inf) in pending.items():
            skipped = self.optimizer.param_groups[index].get("skipped_steps")
            same = None
            if isinstance(skipped, Tensor):  # created by the group's first skip
                same = skipped.eq(0) if before is None else skipped.eq(before)
            window = self._window.get(index)
            if window is None:
                carried = self._spread.get(index)
                spread = carried[1] if carried and carried[0] == step.temperature else None
                window = StepWindow(index, step.temperature, step.members, spread)
                self._window[index] = window
            window.add(StepSums(step, same, found_inf))
        self._steps += 1
        if self._steps % self.every == 0:
            self._read()

    def _read(self) -> list[ChainTemperatureReport]:
        reports: list[ChainTemperatureReport] = []
        for index, group in enumerate(self.optimizer.param_groups):
            window = self._window.get(index)
            if window is None:  # temperature 0 (or no step counted): the report says why
                empty = TemperatureSums(index, float(group["temperature"]), 1)
                reports.extend(empty.report(self.level))
                continue
            reports.extend(window.report(self.level))
            if window.spread is not None:
                self._spread[index] = (window.temperature, window.spread)
        self._window = {}
        self.history.append((self._steps, reports))
        hot = [report for report in reports if report.hot]
        if self.warn and hot and not self.warned:
            self.warned = True
            warnings.warn(_hot_message(hot), ChainTemperatureWarning, stacklevel=4)
        return reports

    def report(self) -> list[ChainTemperatureReport]:
        """The latest reports, one per param group (and member).

        The window in progress, read now (a host read), if it has steps; else the last
        window's; empty before any step.
        """
        if any(w.read_kinetic or w.read_conf for w in self._window.values()):
            return self._read()
        return self.history[-1][1] if self.history else []

    def state_dict(self) -> dict[str, Any]:
        """What resumes the monitor exactly: its step count, window in progress and history.

        Plain values and tensors (``torch.load(weights_only=True)`` reads them back); the
        window in progress is reduced on the device, with no host read. Save it beside the
        optimizer's ``state_dict()``, between steps.
        """
        return {
            "steps": self._steps,
            "warned": self.warned,
            "windows": {index: window.state() for index, window in self._window.items()},
            "spread": {index: (t, spread) for index, (t, spread) in self._spread.items()},
            "history": [
                (step, [dataclasses.asdict(r) for r in reports]) for step, reports in self.history
            ],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`: the next step continues the saved window.

        Raises:
            TypeError: ``state_dict`` is not a mapping.
            ValueError: a missing entry.
        """
        fields = ("steps", "warned", "windows", "spread", "history")
        check_state_fields(state_dict, fields, source="TemperatureMonitor.state_dict()")
        self._steps = int(state_dict["steps"])
        self.warned = bool(state_dict["warned"])
        self._window = {
            int(index): StepWindow.from_state(window)
            for index, window in state_dict["windows"].items()
        }
        self._spread = {int(i): (float(t), v) for i, (t, v) in state_dict["spread"].items()}
        self.history = [
            (int(step), [_report_from_dict(r) for r in reports])
            for step, reports in state_dict["history"]
        ]
        self._pending = {}

    def remove(self) -> None:
        """Detach the monitor from the optimizer (its history is kept)."""
        for handle in self._handles:
            handle.remove()


def _report_from_dict(values: dict[str, Any]) -> ChainTemperatureReport:
    """The report ``dataclasses.asdict`` gave (for :meth:`TemperatureMonitor.load_state_dict`)."""
    estimates = {
        name: None if values[name] is None else TemperatureEstimate(**values[name])
        for name in ("kinetic", "configurational")
    }
    return ChainTemperatureReport(**{**values, **estimates})


def _check_coordinates(value: Any) -> int | None:
    """``coordinates``: None (every coordinate) or an integer >= 1 (bools refused)."""
    expected = "None (every coordinate) or an integer >= 1"
    if value is None:
        return None
    if isinstance(value, bool):
        refuse("coordinates", value, expected, "", TypeError)
    try:
        number = operator.index(value)
    except TypeError:
        refuse("coordinates", value, expected, "", TypeError)
    if number < 1:
        refuse("coordinates", value, expected, "")
    return number


def _hot_message(hot: Sequence[ChainTemperatureReport]) -> str:
    """The warning for the hot reports: where, the estimate against its band, what to do."""
    lines = []
    for report in hot:
        where = f"param group {report.group}" + (
            "" if report.member is None else f" (member {report.member})"
        )
        for name, estimate in (
            ("kinetic", report.kinetic),
            ("configurational", report.configurational),
        ):
            if estimate is not None and estimate.hot:
                lines.append(
                    f"{where}: {name} temperature {estimate.value:.4g} above its "
                    f"{report.level:g} band [{estimate.low:.4g}, {estimate.high:.4g}] "
                    f"at T={report.temperature:g} over {report.steps} step(s)"
                )
    return (
        "The chain runs hot: "
        + "; ".join(lines)
        + ". Its samples are over-dispersed (minibatch gradient noise or too large a step): "
        "lower lr, raise the batch size, or raise the momentum; a chain that has not "
        "reached stationarity yet reads hot too (warned once)."
    )
