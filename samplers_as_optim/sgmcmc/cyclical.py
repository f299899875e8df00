r"""Schedules that drive a sampler: cyclical SG-MCMC (Zhang et al., 2020).

:class:`CyclicalSGMCMC` is a ``torch.optim.lr_scheduler`` scheduler. Over cycles of
``cycle_length`` steps it sets each param group's ``lr`` to the cosine of Zhang et al.'s
Eq. (1) and its ``temperature`` to 0 in the first ``exploration`` fraction of each cycle
(the chain optimises towards a new mode with the large steps) and to the group's target
temperature in the rest (the chain samples around that mode with the small steps). Its
:attr:`~CyclicalSGMCMC.is_sampling` says whether the coming step samples, for a
:class:`~samplers_as_optim.SampleCollector` (``collector.step(sampling=...)``).

Restarts. A cycle ends with a tiny ``lr`` at the target temperature and the next begins
with the largest ``lr`` at temperature 0. A momentum buffer in SGD units is
:math:`b = -r/\sqrt{N\,lr}`: written at the end of a cycle it is enormous in the units of
the restart, where the samplers, at temperature 0, treat it as SGD's and do not rescale
it (docs/design.md): the first exploration step would then kick the chain by
:math:`\sqrt{lr_{\text{restart}}/lr_{\text{end}}}` times its thermal momentum (a factor
of ~640 for cycles of 1000 steps). So at each step that leaves the sampling part for
exploration the scheduler re-expresses every recorded momentum buffer at the new ``lr``,
keeping the physical momentum :math:`r` (:meth:`~samplers_as_optim.sgmcmc.sghmc.SGHMC.
reexpress_state`, the map the samplers apply themselves at temperature > 0):
``tests/test_cyclical.py`` checks that a restart does not heat the chain. Within a cycle
``lr`` changes smoothly and the samplers rescale at temperature > 0 themselves.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, cast

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from ..core.validation import (
    check_nonnegative,
    check_nonnegative_integer,
    check_positive,
    check_positive_int,
    check_state_fields,
    refuse,
)

__all__ = ["CyclicalSGMCMC"]

#: the scheduler's own entries of ``state_dict()``, validated by ``load_state_dict``
_SCHEDULE_FIELDS = (
    "cycle_length",
    "num_cycles",
    "exploration",
    "exploration_temperature",
    "base_temperatures",
    "base_lrs",
    "last_epoch",
)


# One validator per constructor argument, used by __init__ and load_state_dict alike.
def _check_optimizer(optimizer: Any) -> Optimizer:
    """A ``torch.optim.Optimizer`` every param group of which has a ``temperature``."""
    if not isinstance(optimizer, Optimizer):
        raise TypeError(
            f"Invalid optimizer: {type(optimizer).__name__} (expected a sampler: a "
            "torch.optim.Optimizer whose param groups have a temperature, e.g. SGHMC)"
        )
    for index, group in enumerate(optimizer.param_groups):
        if "temperature" not in group:
            raise TypeError(
                f"Invalid optimizer: {type(optimizer).__name__} (expected a sampler: param "
                f"group {index} has no temperature)"
            )
    return optimizer


def _check_cycle_length(value: Any) -> int:
    return check_positive_int("cycle_length", value)


def _check_num_cycles(value: Any) -> int:
    return check_positive_int("num_cycles", value)


def _check_exploration(value: Any) -> float:
    beta = check_nonnegative("exploration", value)
    if not beta < 1.0:
        refuse("exploration", value, "a number in [0, 1)", "")
    return beta


def _check_exploration_temperature(value: Any) -> float:
    """None (0: an optimiser while exploring) or a finite number >= 0."""
    return check_nonnegative("exploration_temperature", 0.0 if value is None else value)


def _positive_temperature_reason(optimizer: Optimizer) -> str:
    """Why ``optimizer`` cannot run at temperature 0 ("" when it can)."""
    if not getattr(optimizer, "requires_positive_temperature", False):
        return ""
    return str(getattr(optimizer, "zero_temperature_fault", "it samples only at T > 0"))


def _check_exploration_runs(
    optimizer: Optimizer, exploration: float, exploration_temperature: float, given: Any
) -> None:
    """Refuse an exploration stage at temperature 0 for a sampler that needs T > 0."""
    reason = _positive_temperature_reason(optimizer)
    if reason and exploration > 0 and exploration_temperature == 0:
        name = type(optimizer).__name__
        raise ValueError(
            f"Invalid exploration_temperature: {given!r} (expected a finite number > 0 for "
            f"{name}: {name} needs temperature > 0 ({reason}) and the cyclical schedule's "
            "exploration stage runs at exploration_temperature, by default 0; or "
            "exploration=0)"
        )


def _check_per_group(name: str, values: Any, optimizer: Optimizer, *, positive: bool) -> list[Any]:
    """One finite number >= 0 (> 0 when ``positive``) per param group of ``optimizer``."""
    count = len(optimizer.param_groups)
    if not isinstance(values, Sequence) or isinstance(values, str) or len(values) != count:
        refuse(name, values, f"a list of {count} number(s), one per param group", "")
    check = check_positive if positive else check_nonnegative
    for index, value in enumerate(values):
        check(f"{name}[{index}]", value)
    return list(values)


def _samples_at(step: int, cycle_length: int, exploration: float) -> bool:
    """Whether step ``step`` (from 0) lies in the sampling stage of its cycle."""
    return (step % cycle_length) / cycle_length >= exploration


@contextmanager
def _in_state_dict() -> Iterator[None]:
    """Re-word a validator's ``Invalid name: value (expected ...)`` for a state_dict field.

    It becomes ``Invalid state_dict: name=value (expected ...)``, of the same type.
    """
    try:
        yield
    except (TypeError, ValueError) as error:
        message = str(error)
        if not message.startswith("Invalid "):
            raise
        field, _, rest = message[len("Invalid ") :].partition(": ")
        raise type(error)(f"Invalid state_dict: {field}={rest}") from None


class CyclicalSGMCMC(LRScheduler):
    r"""Cyclical SG-MCMC: cosine cyclical ``lr``, exploration at temperature 0, then sampling.

    At step :math:`k` (from 0), with :math:`L` = ``cycle_length``, the position in the
    cycle :math:`\rho = (k \bmod L)/L` sets

    .. math::

        lr_k = \frac{lr_0}{2}\left(\cos(\pi \rho) + 1\right), \qquad
        T_k = \begin{cases} T_{\text{explore}} & \rho < \beta \\ T & \rho \ge \beta
        \end{cases}

    per param group, with :math:`lr_0` the group's ``lr`` and :math:`T` its
    ``temperature`` when the scheduler is built, :math:`\beta` = ``exploration`` and
    :math:`T_{\text{explore}}` = ``exploration_temperature``. This is Zhang et al.'s Eq.
    (1) with :math:`\lceil K/M \rceil = L` and their exploration stage
    :math:`r(k) < \beta`, where the chain runs as an optimiser. Works with any sampler of
    this package (:class:`~samplers_as_optim.SGLD`, :class:`~samplers_as_optim.SGHMC`,
    :class:`~samplers_as_optim.SGNHT`, :class:`~samplers_as_optim.PSGLD`,
    :class:`~samplers_as_optim.BAOA`, :class:`~samplers_as_optim.HMC`); SGNHT and HMC need
    temperature > 0, so give them ``exploration_temperature`` > 0 or ``exploration=0``
    (refused otherwise). At the step that leaves a
    sampling stage for exploration the momentum buffers are re-expressed at the new ``lr``
    (module docstring), so that a restart does not heat the chain.

    Call ``step()`` after ``optimizer.step()``, as for any scheduler:

    .. code-block:: python

        scheduler = CyclicalSGMCMC(optimizer, cycle_length=1000, num_cycles=4)
        for _ in range(scheduler.total_steps):
            ...                                  # forward, backward
            optimizer.step()
            collector.step(sampling=scheduler.is_sampling)  # the step just taken
            scheduler.step()

    Args:
        optimizer: a sampler: a ``torch.optim.Optimizer`` every param group of which has
            a ``temperature``.
        cycle_length: :math:`L`, steps per cycle (a positive integer).
        num_cycles: :math:`M`, the number of cycles (a positive integer): the schedule
            has ``total_steps = cycle_length * num_cycles`` steps; stepping past them
            raises ``ValueError``.
        exploration: :math:`\beta`, the fraction of each cycle spent exploring (default:
            0.8; in [0, 1)). 0 samples all along, with the cyclical ``lr`` only.
        exploration_temperature: the temperature while exploring (default: None: 0, an
            optimiser, as Zhang et al.; a finite number >= 0).
        last_epoch: as for any ``torch.optim.lr_scheduler`` scheduler (default: -1).

    Example:
        >>> import torch
        >>> from samplers_as_optim import SGHMC, CyclicalSGMCMC
        >>> model = torch.nn.Linear(3, 1)
        >>> opt = SGHMC(model.parameters(), lr=0.1, num_data=100, seed=0)
        >>> scheduler = CyclicalSGMCMC(opt, cycle_length=10, num_cycles=2, exploration=0.5)
        >>> opt.param_groups[0]["lr"], opt.param_groups[0]["temperature"]
        (0.1, 0.0)
        >>> for _ in range(5):
        ...     opt.step()
        ...     scheduler.step()
        >>> round(opt.param_groups[0]["lr"], 4), scheduler.is_sampling
        (0.05, True)

    References:
        Zhang, R., Li, C., Zhang, J., Chen, C. & Wilson, A. G. (2020). Cyclical stochastic
        gradient MCMC for Bayesian deep learning. ICLR. Eq. (1) and Algorithm 1.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        cycle_length: int,
        num_cycles: int,
        exploration: float = 0.8,
        *,
        exploration_temperature: float | None = None,
        last_epoch: int = -1,
    ) -> None:
        optimizer = _check_optimizer(optimizer)
        self.cycle_length = _check_cycle_length(cycle_length)
        self.num_cycles = _check_num_cycles(num_cycles)
        self.exploration = _check_exploration(exploration)
        self.exploration_temperature = _check_exploration_temperature(exploration_temperature)
        _check_exploration_runs(
            optimizer, self.exploration, self.exploration_temperature, exploration_temperature
        )
        if last_epoch == -1:
            for group in optimizer.param_groups:
                group.setdefault("initial_temperature", float(group["temperature"]))
        self.base_temperatures = [
            float(group["initial_temperature"]) for group in optimizer.param_groups
        ]
        self._sampling = False
        super().__init__(optimizer, last_epoch)

    @property
    def total_steps(self) -> int:
        """``cycle_length * num_cycles``: the steps of the whole schedule."""
        return self.cycle_length * self.num_cycles

    def _position(self, step: int) -> float:
        return (step % self.cycle_length) / self.cycle_length

    def sampling_at(self, step: int) -> bool:
        """Whether step ``step`` (from 0) of the schedule is a sampling step."""
        return _samples_at(step, self.cycle_length, self.exploration)

    @property
    def is_sampling(self) -> bool:
        """Whether the optimizer's coming step (at the current settings) samples."""
        return self._sampling

    @property
    def cycle(self) -> int:
        """The cycle (from 0) of the coming step."""
        return self.last_epoch // self.cycle_length

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict`, validated as the constructor validates its arguments.

        Every field is checked before any is assigned: a refused state leaves the scheduler
        unchanged.

        Raises:
            TypeError: ``state_dict`` is not a mapping, or a field has the wrong type.
            ValueError: a field is missing or out of range (a ``cycle_length``,
                ``num_cycles``, ``exploration`` or ``exploration_temperature`` the
                constructor refuses, one for this optimizer, base values not one finite
                number per param group, ``last_epoch`` outside the schedule).
        """
        check_state_fields(state_dict, _SCHEDULE_FIELDS, source="CyclicalSGMCMC.state_dict")
        if "optimizer" in state_dict:
            raise ValueError(
                "Invalid state_dict: field 'optimizer' (expected the schedule only, as "
                "CyclicalSGMCMC.state_dict: the scheduler keeps the optimizer it was built with)"
            )
        optimizer = self.optimizer
        with _in_state_dict():
            cycle_length = _check_cycle_length(state_dict["cycle_length"])
            num_cycles = _check_num_cycles(state_dict["num_cycles"])
            exploration = _check_exploration(state_dict["exploration"])
            given = state_dict["exploration_temperature"]
            exploration_temperature = _check_exploration_temperature(given)
            _check_exploration_runs(optimizer, exploration, exploration_temperature, given)
            temperatures = _check_per_group(
                "base_temperatures",
                state_dict["base_temperatures"],
                optimizer,
                positive=bool(_positive_temperature_reason(optimizer)),
            )
            base_temperatures = [float(t) for t in temperatures]
            base_lrs = _check_per_group(
                "base_lrs", state_dict["base_lrs"], optimizer, positive=False
            )
            total = cycle_length * num_cycles
            last_epoch = check_nonnegative_integer("last_epoch", state_dict["last_epoch"])
            if last_epoch > total:
                refuse(
                    "last_epoch",
                    state_dict["last_epoch"],
                    f"an integer in [0, {total}], the steps of cycle_length={cycle_length} x "
                    f"num_cycles={num_cycles}",
                    "",
                )
        sampling = _samples_at(last_epoch, cycle_length, exploration)
        if "_sampling" in state_dict and state_dict["_sampling"] is not sampling:
            raise ValueError(
                f"Invalid state_dict: _sampling={state_dict['_sampling']!r} (expected "
                f"{sampling}: step {last_epoch} of this schedule "
                f"{'samples' if sampling else 'explores'})"
            )
        state = dict(state_dict)
        state.update(
            cycle_length=cycle_length,
            num_cycles=num_cycles,
            exploration=exploration,
            exploration_temperature=exploration_temperature,
            base_temperatures=base_temperatures,
            base_lrs=base_lrs,
            last_epoch=last_epoch,
            _sampling=sampling,
        )
        super().load_state_dict(state)

    def get_lr(self) -> list[float]:  # type: ignore[override]
        """The cosine cyclical learning rates of the coming step (Zhang et al., Eq. 1)."""
        factor = 0.5 * (math.cos(math.pi * self._position(self.last_epoch)) + 1.0)
        return [base * factor for base in cast(list[float], self.base_lrs)]

    def step(self, epoch: int | None = None) -> None:
        """Advance one step: set every group's ``lr`` and ``temperature`` for the next one.

        Raises:
            ValueError: the schedule's ``total_steps`` are exhausted.
        """
        if epoch is not None:
            raise TypeError("CyclicalSGMCMC.step() takes no epoch (it counts steps itself)")
        if self.last_epoch + 1 > self.total_steps:
            raise ValueError(
                f"CyclicalSGMCMC stepped {self.last_epoch + 1} times, past its total_steps="
                f"{self.total_steps} (cycle_length={self.cycle_length} x num_cycles="
                f"{self.num_cycles}); build it with more cycles"
            )
        super().step()
        self._sampling = self.sampling_at(self.last_epoch)
        for group, target in zip(self.optimizer.param_groups, self.base_temperatures, strict=True):
            new = target if self._sampling else self.exploration_temperature
            if float(group["temperature"]) > 0 and new == 0 and float(group["lr"]) > 0:
                # leaving a sampling stage for exploration (a restart): keep the physical
                # momentum across the jump of lr, which the sampler at T = 0 would not do
                reexpress = getattr(self.optimizer, "reexpress_state", None)
                if reexpress is not None:  # the samplers' interface (HMC keeps no buffer)
                    reexpress(group, lr=float(group["lr"]))
            group["temperature"] = new
