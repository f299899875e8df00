r"""Step sizes that adapt in warm-up: each param group's lr set so that its chain runs at T.

Why lr makes a chain hot. At a fixed lr an SG-MCMC chain samples its target only up to
two biases, both of which heat it and both of which vanish as lr does: the discretisation
(SGLD's stationary covariance on a Gaussian is :math:`T\,(H(I - hH/2))^{-1}`, with
:math:`h = lr/N`, wider than :math:`T H^{-1}`) and, with minibatches, the gradient noise,
whose variance the step adds on top of the injected noise (Chen et al. 2014, Sec. 3.2).
A chain at stationarity is therefore never colder than T because of its lr: it is at T
plus an excess that grows with lr. The kinetic and configurational estimates
(``temperature/estimates``) measure that excess, and the largest lr whose excess stays
small is the efficient one: smaller mixes slower for no gain, larger samples a hotter law.

The adaptation. :class:`StepSizeWarmup` follows the chain with a
:class:`~.monitor.TemperatureMonitor` (windows of ``every`` steps). After each window it
reads, for every param group at T > 0, the excess :math:`x` of its chain over T (the
estimates :math:`e/T - 1`, kinetic and configurational, of every member of a stacked
group, that are not *cold*, below their band), and moves the log lr by a Robbins-Monro step
(Robbins & Monro 1951) towards the excess ``target`` :math:`x^*`:

.. math::

    \log lr_{k+1} = \log lr_k - a\,k^{-0.6}\,\mathrm{clip}(z_k, -1, 1),
    \qquad z_k = \frac{x_k - x^*}{\max(x^*, \sigma_k)},
    \qquad a = 0.5,

with :math:`k` the windows adapted so far and :math:`\sigma_k` the standard error of
:math:`x_k` (each estimate's, one step's, from its band; :math:`x_k` is their
precision-weighted mean). The step is symmetric, so the estimates' noise moves lr both
ways alike and does not bias it; lr changes by at most :math:`e^{\pm 0.5}` per window at
first, and never exceeds ``max_increase`` times the lr it started from.

The groups of one network are coupled, and each group's estimates average over its
coordinates: a layer whose own readings stay cool at any lr (most of its directions
flat) would rise to its cap while the layer its output feeds, stiffer, is lowered, and the
few stiff directions of the cool layer then throw the chain into bursts its averages did
not foresee (seen on the regression benchmark: an input layer at 9x its starting lr
beside an output layer and a noise scale at 0.3x, hot bursts after the warm-up). So no
group's lr exceeds ``max_spread`` times the smallest adapted lr of the optimizer.

A chain started at a mode (the MAP, momentum zero) reads below T until it has
thermalised, and a reading below T then says nothing about lr (at stationarity the chain
is never colder than T): until a group's chain has once read at T or above (within its
error), readings below the target adapt nothing; a hot one lowers lr at once. At the end
of the warm-up the lr is frozen at the geometric mean of the lrs of the windows of its
second half (Polyak-Ruppert averaging), the hooks are removed, and what follows is the
stated chain at that fixed lr.

The margin. The estimates average over a group's coordinates, and the stability of the
chain is its stiffest direction's: at the adapted lr that direction runs near its limit,
and where the chain wanders into more curvature it passes it for a few steps, a burst the
averages did not foresee (seen on the regression benchmark: the output layer's gradient
norm growing 1.3-1.9-fold a step for seven steps, then falling back). So the frozen lr is
``margin`` (0.7) times the adapted one: on Boston housing that took the windows read hot
after the warm-up from 2, 4 and 13 of 240 (SGHMC from the guide's lr and from ten times
it, the twin from 1e-2) to none, and on diabetes from 2 of 400 to none, at the cost of
a chain that moves :math:`\sqrt{0.7}` as far per step.

Divergence. An lr past the stability limit of the chain's stiffest direction does not
heat the chain by a few percent: it throws it away within a few steps, before a window
ends. Such a chain is started again from where the warm-up began, at a tenth of its lr,
and no group's lr is raised afterwards to within a factor 2 of the lr it diverged at
(``temperature/restart``: what is watched, what is put back; at most ``max_restarts``
times).

Schedulers. During the warm-up the warm-up alone sets lr: a change by anyone else (a
scheduler's ``step()``) is refused at the next ``step()``, which then changes nothing.
Build a scheduler after the warm-up, when each group's ``lr`` is the adapted one.

Checkpoints. :meth:`StepSizeWarmup.state_dict` (with the monitor's window in progress)
saved beside the optimizer's resumes the adaptation exactly: the resumed chain takes the
same lrs, bit for bit.
"""

from __future__ import annotations

import math
import statistics
import weakref
from typing import Any

from ...core.validation import (
    check_finite,
    check_nonnegative_integer,
    check_open_unit_interval,
    check_positive_int,
    check_state_fields,
    refuse,
)
from ..optimizer import SamplerOptimizer
from .estimates import ChainTemperatureReport
from .monitor import TemperatureMonitor
from .restart import DivergenceWatch, Snapshot, sampling_gradient_norm

__all__ = ["StepSizeWarmup", "adapting_warmup"]

#: each optimizer's warm-up while it adapts (what ``SampleCollector`` asks)
_ADAPTING: weakref.WeakKeyDictionary[Any, StepSizeWarmup] = weakref.WeakKeyDictionary()


def adapting_warmup(optimizer: Any) -> StepSizeWarmup | None:
    """The :class:`StepSizeWarmup` still adapting ``optimizer``'s lr, or None."""
    try:
        return _ADAPTING.get(optimizer)
    except TypeError:  # (not weakly referenceable: no warm-up can hold it)
        return None


def _factor(name: str, value: Any) -> float:
    """``value`` as a float if it is a finite number >= 1 (a cap, a ratio), else refused."""
    if not check_finite(name, value) >= 1:
        refuse(name, value, "a finite number >= 1", "")
    return float(value)


#: the Robbins-Monro gain a and its decay exponent
GAIN = 0.5
DECAY = 0.6


class StepSizeWarmup:
    r"""Adapts each param group's lr in a warm-up so that its chain runs at T, then freezes it.

    Attach it to a sampler and train as before: it follows the chain on the optimizer's
    step hooks (a :class:`~samplers_as_optim.diagnostics.TemperatureMonitor` inside),
    after every ``every`` steps moves each group's ``lr`` towards the largest one whose
    chain reads at most ``target`` hotter than T, and after ``steps`` steps freezes it
    (module ``sgmcmc/temperature/warmup``: the rule, the cold start, why).
    Groups at T = 0 are left alone. Discard the warm-up's samples, as for any burn-in.

    Args:
        optimizer: an SG-MCMC sampler (a ``SamplerOptimizer`` with a temperature rule).
        steps: the warm-up's length in optimizer steps (an integer >= ``2 * every``).
        every: steps per window (per adaptation).
        target: the excess temperature aimed at, :math:`T_{\text{est}}/T - 1` (in (0, 1)):
            about the relative error of the posterior's variances the chain accepts.
        max_increase: no group's lr exceeds this multiple of the lr it started from
            (a number >= 1).
        max_spread: no group's lr exceeds this multiple of the smallest group's (a number
            >= 1; the groups of one network are coupled: see the module docstring).
        max_restarts: how many times a diverging chain is started again from the
            warm-up's start at a tenth of its lr (module docstring; an integer >= 0).
            Each restart's state is kept for it: a copy of the parameters and the
            optimizer's state for the warm-up's length (0: none is kept, no restart).
        margin: the frozen lr is this fraction of the adapted one (in (0, 1]): room for
            the stiffest direction of a group, which its estimates' averages hardly see
            (module docstring).
        level, coordinates, stride: the monitor's (``TemperatureMonitor``).

    Attributes:
        done: whether the warm-up has ended (the lrs frozen).
        seen: the optimizer steps taken under the warm-up.
        history: ``(step, [lr per group])`` after each window.
        restarts: ``(step, [lr per group])`` at each restart (the lrs it restarted with).

    Raises:
        TypeError, ValueError: a bad argument, or a group at T > 0 with lr 0.

    Example:
        >>> import torch
        >>> from samplers_as_optim import SGHMC, StepSizeWarmup
        >>> model = torch.nn.Linear(4, 1)
        >>> opt = SGHMC(model.parameters(), lr=1e-2, momentum=0.9, num_data=64, seed=0)
        >>> warmup = StepSizeWarmup(opt, steps=40, every=10)
        >>> x, y = torch.randn(64, 4), torch.randn(64, 1)
        >>> for _ in range(50):
        ...     opt.zero_grad()
        ...     torch.nn.functional.mse_loss(model(x), y).backward()
        ...     opt.step()
        >>> warmup.done, len(warmup.history)
        (True, 4)
    """

    def __init__(
        self,
        optimizer: SamplerOptimizer,
        *,
        steps: int,
        every: int = 10,
        target: float = 0.02,
        max_increase: float = 10.0,
        max_spread: float = 4.0,
        max_restarts: int = 4,
        margin: float = 0.7,
        level: float = 0.999,
        coordinates: int | None = 4096,
        stride: int = 1,
    ) -> None:
        self.every = check_positive_int("every", every)
        self.steps = check_positive_int("steps", steps)
        if self.steps < 2 * self.every:
            refuse("steps", steps, f"an integer >= 2 * every = {2 * self.every}", "")
        self.target = check_open_unit_interval("target", target)
        self.max_increase = _factor("max_increase", max_increase)
        self.max_spread = _factor("max_spread", max_spread)
        self.max_restarts = check_nonnegative_integer("max_restarts", max_restarts)
        self.margin = check_finite("margin", margin)
        if not 0 < self.margin <= 1:
            refuse("margin", margin, "a number in (0, 1]", "")
        if not isinstance(optimizer, SamplerOptimizer):
            raise TypeError(
                f"Invalid optimizer: {type(optimizer).__name__} (expected an SG-MCMC sampler, "
                "a SamplerOptimizer)"
            )
        self.start = [float(group["lr"]) for group in optimizer.param_groups]
        for index, (group, lr) in enumerate(zip(optimizer.param_groups, self.start, strict=True)):
            if float(group["temperature"]) > 0 and not lr > 0:
                refuse("lr", lr, "> 0 in every group at T > 0", f" (param group {index})")
        # the warm-up's check before the monitor's read: a restart comes before the read
        before = optimizer.register_step_pre_hook(self._before_step)
        try:
            self.monitor = TemperatureMonitor(  # (attaches its hooks: after every check)
                optimizer,
                every=every,
                level=level,
                warn=False,
                stride=stride,
                coordinates=coordinates,
            )
        except Exception:
            before.remove()
            raise
        self.optimizer = optimizer
        self._fresh_monitor = self.monitor.state_dict()
        self._snapshot = Snapshot.take(optimizer) if self.max_restarts else None
        self.restarts: list[tuple[int, list[float]]] = []
        self._cap = [lr * self.max_increase for lr in self.start]
        self._z = statistics.NormalDist().inv_cdf((1 + level) / 2)
        self.lrs = list(self.start)
        self.done = False
        self.history: list[tuple[int, list[float]]] = []
        self.seen = 0  # optimizer steps taken under the warm-up
        self._begin_adaptation()
        self._handles = (before, optimizer.register_step_post_hook(self._after_step))
        _ADAPTING[optimizer] = self

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        groups = self.optimizer.param_groups
        if len(groups) != len(self.lrs):
            refuse(
                "optimizer",
                f"{len(groups)} param groups",
                f"the {len(self.lrs)} the warm-up started with (add groups after it ends)",
                "",
            )
        for index, (group, lr) in enumerate(zip(groups, self.lrs, strict=True)):
            if float(group["lr"]) != lr:
                refuse(
                    "lr",
                    group["lr"],
                    f"{lr!r}, the warm-up's, until its step {self.steps}: during the warm-up "
                    "only it sets lr (build a scheduler after it ends, from the adapted lr)",
                    f" (param group {index})",
                )
        if self._snapshot is not None:
            value = sampling_gradient_norm(self.optimizer)
            if value is not None and self._watch.observe(value):
                self._restart()

    def _begin_adaptation(self) -> None:
        """The adaptation's counters at its start, and at a restart."""
        count = len(self.lrs)
        self._windows = 0  # the monitor's windows read since the (re)start
        self._watch = DivergenceWatch()
        self._adapted = [0] * count  # windows adapted, per group
        self._arrived = [False] * count  # read at T once (thermalised)
        self._late = [(0.0, 0)] * count  # second half: (sum of log lr, windows)

    def _restart(self) -> None:
        """Start the chain again from the warm-up's start at a tenth of its lrs (at T > 0)."""
        assert self._snapshot is not None
        self._snapshot.restore(self.optimizer)
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    param.grad.zero_()  # (the step runs from the restored state, without them)
        for index, group in enumerate(self.optimizer.param_groups):
            if float(group["temperature"]) > 0:
                self._cap[index] = min(self._cap[index], self.lrs[index] / 2)
                self.lrs[index] /= 10
            group["lr"] = self.lrs[index]
        self.restarts.append((self.seen, list(self.lrs)))
        self.monitor.load_state_dict(self._fresh_monitor)
        self._begin_adaptation()
        if len(self.restarts) >= self.max_restarts:
            self._snapshot = None

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.seen += 1
        if len(self.monitor.history) > self._windows:
            self._windows = len(self.monitor.history)
            _, reports = self.monitor.history[-1]
            sampling = [float(group["temperature"]) > 0 for group in self.optimizer.param_groups]
            logs = [
                self._adapt(index, [r for r in reports if r.group == index]) if at_t else None
                for index, at_t in enumerate(sampling)
            ]
            self._apply(logs)
            self.history.append((self.seen, list(self.lrs)))
        if self.seen >= self.steps:
            self._freeze()

    def _adapt(self, index: int, reports: list[ChainTemperatureReport]) -> float:
        """One Robbins-Monro step of group ``index``'s log lr from its window's reports."""
        reading = self._excess(reports)
        log_lr = math.log(self.lrs[index])
        if reading is not None:
            excess, error = reading
            z = (excess - self.target) / max(self.target, error)
            self._arrived[index] = self._arrived[index] or excess >= -error
            if z > 0 or self._arrived[index]:  # (below T before arriving: thermalising)
                self._adapted[index] += 1
                gain = GAIN * self._adapted[index] ** -DECAY
                log_lr -= gain * min(max(z, -1.0), 1.0)
                log_lr = min(log_lr, math.log(self._cap[index]))
        return log_lr

    def _apply(self, logs: list[float | None]) -> None:
        """Set the adapted lrs, none above ``max_spread`` times the smallest; average late."""
        adapted = [log for log in logs if log is not None]
        ceiling = min(adapted) + math.log(self.max_spread) if adapted else math.inf
        late = 2 * self.seen > self.steps
        for index, log_lr in enumerate(logs):
            if log_lr is None:
                continue
            log_lr = min(log_lr, ceiling)
            self.lrs[index] = math.exp(log_lr)
            self.optimizer.param_groups[index]["lr"] = self.lrs[index]
            if late:
                total, count = self._late[index]
                self._late[index] = (total + log_lr, count + 1)

    def _excess(self, reports: list[ChainTemperatureReport]) -> tuple[float, float] | None:
        """The excess over the estimates not cold, weighted by precision, and its error.

        Each estimate's standard error is one step's (from its band: a window's steps are
        correlated, and a slow chain's average is hardly better than one step). The
        precision-weighted mean, not the largest: at stationarity every estimate (and
        every member of a stacked group) measures the same temperature, and the largest
        of noisy readings is biased up by their noise, which would drive lr down however
        small it is; the weights let the precise kinetic estimate speak where the
        configurational one, read from a minibatch gradient, is noise.
        """
        total = weight = 0.0
        for report in reports:
            for estimate in (report.kinetic, report.configurational):
                if estimate is None or estimate.cold or not math.isfinite(estimate.value):
                    continue
                t = report.temperature
                error = (estimate.high - estimate.low) / (2 * self._z * t)
                if not (math.isfinite(error) and error > 0):
                    continue  # no band (no spread measured): no weight
                total += (estimate.value / t - 1) / error**2
                weight += 1 / error**2
        if not weight:
            return None
        return total / weight, 1 / math.sqrt(weight)

    def _freeze(self) -> None:
        """Fix each group's lr at ``margin`` times its second half's geometric mean; detach."""
        for index, group in enumerate(self.optimizer.param_groups):
            total, count = self._late[index]
            if count:
                self.lrs[index] = self.margin * math.exp(total / count)
                group["lr"] = self.lrs[index]
        self.done = True
        self.remove()

    def step(self) -> None:
        """Nothing: the scheduler protocol's step (the warm-up acts on the optimizer's).

        A training framework that owns the lr scheduler (the Hugging Face ``Trainer``,
        accelerate) calls its ``step()`` after each optimizer step and saves its
        ``state_dict()`` with a checkpoint; given the warm-up as that scheduler
        (``Trainer(..., optimizers=(sampler, warmup))``) it keeps the lr the warm-up
        sets, adapted and then frozen, and its checkpoints resume the warm-up exactly.
        Any other scheduler would move lr under the warm-up, which it refuses.
        """

    def get_last_lr(self) -> list[float]:
        """Each param group's current lr (the scheduler protocol's, for a framework's logs)."""
        return [float(group["lr"]) for group in self.optimizer.param_groups]

    def remove(self) -> None:
        """Detach from the optimizer now (the lrs stay as they are)."""
        for handle in self._handles:
            handle.remove()
        self.monitor.remove()
        self._snapshot = None
        if _ADAPTING.get(self.optimizer) is self:
            del _ADAPTING[self.optimizer]

    def state_dict(self) -> dict[str, Any]:
        """What resumes the warm-up exactly (its monitor's window included), between steps."""
        return {
            "seen": self.seen,
            "lrs": list(self.lrs),
            "start": list(self.start),
            "adapted": list(self._adapted),
            "arrived": list(self._arrived),
            "late": [tuple(late) for late in self._late],
            "history": [(step, list(lrs)) for step, lrs in self.history],
            "done": self.done,
            "monitor": self.monitor.state_dict(),
            "restarts": [(step, list(lrs)) for step, lrs in self.restarts],
            "windows": self._windows,
            "watch": self._watch.state(),
            "cap": list(self._cap),
            "snapshot": None if self._snapshot is None else self._snapshot.state(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict` (built for the same optimizer and arguments).

        A state saved before restarts existed resumes with the restart's state taken
        when this warm-up was built.

        Raises:
            TypeError: ``state_dict`` is not a mapping.
            ValueError: a missing entry, or a state of another number of param groups.
        """
        fields = ["seen", "lrs", "start", "adapted", "arrived", "late", "history", "done"]
        fields.append("monitor")
        check_state_fields(state_dict, fields, source="StepSizeWarmup.state_dict()")
        if len(state_dict["lrs"]) != len(self.lrs):
            raise ValueError(
                f"Invalid state_dict: {len(state_dict['lrs'])} param groups (expected the "
                f"optimizer's {len(self.lrs)})"
            )
        self.seen = int(state_dict["seen"])
        self.lrs = [float(lr) for lr in state_dict["lrs"]]
        self.start = [float(lr) for lr in state_dict["start"]]
        self._adapted = [int(k) for k in state_dict["adapted"]]
        self._arrived = [bool(a) for a in state_dict["arrived"]]
        self._late = [(float(t), int(c)) for t, c in state_dict["late"]]
        self.history = [(int(s), [float(v) for v in lrs]) for s, lrs in state_dict["history"]]
        self.monitor.load_state_dict(state_dict["monitor"])
        self.done = bool(state_dict["done"])
        self._load_restarts(state_dict)
        if self.done:
            self.remove()

    def _load_restarts(self, state_dict: dict[str, Any]) -> None:
        """The restart's part of :meth:`load_state_dict` (absent from older states)."""
        if "restarts" not in state_dict:
            self._windows = len(self.history)
            self._cap = [lr * self.max_increase for lr in self.start]
            return
        self.restarts = [(int(s), [float(v) for v in lrs]) for s, lrs in state_dict["restarts"]]
        self._windows = int(state_dict["windows"])
        self._watch = DivergenceWatch.from_state(state_dict["watch"])
        self._cap = [float(cap) for cap in state_dict["cap"]]
        saved = state_dict["snapshot"]
        self._snapshot = None if saved is None else Snapshot.from_state(saved)
