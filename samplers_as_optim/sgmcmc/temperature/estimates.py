r"""Kinetic and configurational temperature of an SG-MCMC chain, with their bands.

At stationarity a chain that samples :math:`p_T(\theta) \propto \exp(-U(\theta)/T)`,
:math:`U = N L` (``docs/design.md``), satisfies two identities that need no knowledge of
the posterior (Fortuin et al. 2021, "Bayesian neural network priors revisited", §4 and
App. C, the diagnostics of ``bnn_priors``; Leimkuhler & Matthews 2015, "Molecular
dynamics", §6.1.4 for the configurational one):

.. math::

    T_{\text{kin}} = \frac1d \sum_i \frac{r_i^2}{M_i}, \qquad
    T_{\text{conf}} = \frac1d \sum_i \theta_i\, \partial_i U(\theta),

both with expectation :math:`T` (the momentum :math:`r \sim \mathcal N(0, T M)`, and
:math:`E[\theta_i \partial_i U] = T` by integration by parts). A chain heated by the
minibatch gradient noise (or by too large a step) has both above :math:`T`.

**Kinetic.** The momentum in continuous-time units, read from the sampler's buffer in
SGD units as its :class:`~.temperature_rule.TemperatureRule` says (its definition's
``temperature/rule``): which buffer, its units, its mass, and the discrete factor by
which the discretised chain's buffer reads its momentum (:mod:`.temperature_rule`:
SGHMC's :math:`T_{\text{kin}} = \tfrac{1+\mu}{2}\,\tfrac1d\sum_i N\,lr\,b_i^2`, BAOA's,
SGNHT's; the AdamW twin's mass :math:`a`, ``adamw_sghmc/temperature``). SGLD, PSGLD
and SGHMC without momentum have no momentum, and no kinetic estimate.

**Configurational.** :math:`\partial U/N` is the gradient the step uses with the prior
the sampler adds (its rule's): :math:`g' = \pm g + \lambda\theta` (coupled weight decay:
SGLD, SGHMC, SGNHT, BAOA, PSGLD), and :math:`\pm g + \lambda\, a\,\theta` for the twin,
whose decoupled decay is the prior :math:`\mathcal N(0, 1/(N\lambda a_i))`
(``adamw_sghmc``). The position is :math:`\theta` *before* the update, the point at which
the gradient was computed: read in a step pre-hook, or by
:meth:`SamplerOptimizer.temperature_estimates` called between ``backward()`` and
``step()``. With a minibatch gradient :math:`g = \nabla L + \eta`,
:math:`E[\theta\cdot\eta] = 0` (the minibatch is drawn independently of :math:`\theta`),
so the estimate stays unbiased and the noise only widens its spread, which the band
below measures. It holds for any preconditioner (the identity does not involve the
dynamics). Its discrete-chain value on a Gaussian mode is :math:`T/(1 - h/2)` for SGLD
and PSGLD's frozen preconditioner (:math:`h` the preconditioned step),
:math:`T/(1 - h/(2(1+\mu)))` for SGHMC and the twin, exactly :math:`T` for BAOA.

**Bands** (two-sided, at ``level``). Kinetic: with :math:`r \sim \mathcal N(0, T M)`
element by element, :math:`d\,T_{\text{kin}}/T \sim \chi^2_d` exactly at one step; the
band is :math:`[T q_{(1-\ell)/2}, T q_{(1+\ell)/2}]/d` with :math:`q` the
:math:`\chi^2_d` quantiles (:func:`chi2_quantile`). A time average of such draws has a
smaller variance (whatever their correlation), so the single-step band is conservative
for a window's average: a reading outside it is a finding. Configurational: the terms
:math:`t_i = N\theta_i\, g'_i` are treated as independent across coordinates; the band
is :math:`T \pm z_{(1+\ell)/2}\, s/\sqrt d`, :math:`s^2` the terms' empirical variance
(at each step for :meth:`~.optimizer.SamplerOptimizer.temperature_estimates`, at the
first step of each window for the monitor, which reduces only the means at the others:
one dot product per tensor; conservative for the average likewise). On a
Gaussian target centred at 0 the exact law is :math:`T\chi^2_d/d` (the sum is
:math:`\theta^\top P\theta`), whose variance :math:`2T^2/d` the empirical one bounds
from above (:math:`\mathrm{var}\,t_i = T^2(1 + P_{ii}P^{-1}_{ii}) \ge 2T^2`), so the
band is again conservative for correlated coordinates. Neither band holds before the
chain has mixed, nor models the discretisation bias above: a chain hot by its step size
is reported hot, which it is.

The monitor reads a fixed subset of the coordinates (``group_sums(coordinates=...)``,
:mod:`.temperature_coordinates`): both identities hold coordinate by coordinate, so the
estimates over it stay unbiased, and the bands above hold with :math:`d` the subset's
size (its own terms' variance for the configurational one).

Every reduction stays on the parameters' device (:class:`TemperatureSums`); only
:meth:`TemperatureSums.report` reads to the host. A ``ParallelEnsemble``'s stacked
parameters (:func:`~samplers_as_optim.names.member_dims`) are reduced per member: one
report per member, never mixed; a param group that mixes stacked and unstacked
parameters, or different member counts, is refused.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ...core.validation import check_open_unit_interval, refuse
from ...names import member_dims
from .chi2 import chi2_quantile
from .coordinates import CoordinateSubset, coordinate_subsets
from .rule import SubsetRead, TemperatureRule, configurational_terms, member_dot

__all__ = [
    "ChainTemperatureReport",
    "TemperatureEstimate",
    "TemperatureSums",
    "chi2_quantile",
    "group_sums",
    "temperature_reports",
]


@dataclass(frozen=True)
class TemperatureEstimate:
    """One estimate of a chain's temperature and its band under the target.

    Attributes:
        value: the estimate (a window's average).
        low: the lower end of the band at the report's ``level``.
        high: the upper end.
        hot: ``value > high``: the chain runs hotter than its target.
        cold: ``value < low``.
        dof: the number of elements :math:`d` it is an average over (per step).
    """

    value: float
    low: float
    high: float
    dof: int

    @property
    def hot(self) -> bool:
        """Whether the estimate is above its band."""
        return self.value > self.high

    @property
    def cold(self) -> bool:
        """Whether the estimate is below its band."""
        return self.value < self.low

    def __str__(self) -> str:
        flag = " HOT" if self.hot else " COLD" if self.cold else ""
        return f"{self.value:.4g} (band {self.low:.4g}..{self.high:.4g}, d={self.dof}){flag}"


@dataclass(frozen=True)
class ChainTemperatureReport:
    r"""The temperature estimates of one param group (one member of a stacked group).

    Attributes:
        group: the param group's index.
        member: the member's index in a ``ParallelEnsemble``'s stack, None unstacked.
        temperature: the target's T.
        level: the bands' two-sided probability under the target.
        steps: the number of steps averaged.
        kinetic: :math:`T_{\text{kin}}`, None without a momentum (SGLD, PSGLD, SGHMC
            without momentum), before the first step (no buffer, or no element of the
            twin with a preconditioner scale), or at T = 0.
        configurational: :math:`T_{\text{conf}}`, None at T = 0 or without a gradient.
        note: why an estimate is None, else "".
    """

    group: int
    member: int | None
    temperature: float
    level: float
    steps: int
    kinetic: TemperatureEstimate | None
    configurational: TemperatureEstimate | None
    note: str = ""

    @property
    def hot(self) -> bool:
        """Whether either estimate is above its band."""
        return any(e is not None and e.hot for e in (self.kinetic, self.configurational))

    @property
    def cold(self) -> bool:
        """Whether either estimate is below its band."""
        return any(e is not None and e.cold for e in (self.kinetic, self.configurational))

    def __str__(self) -> str:
        where = f"group {self.group}" + ("" if self.member is None else f" member {self.member}")
        return (
            f"{where} at T={self.temperature:g} over {self.steps} step(s), {self.level:g} bands: "
            f"kinetic {self.kinetic}, configurational {self.configurational}"
            + (f" ({self.note})" if self.note else "")
        )


def _member_count(params: Sequence[Tensor], index: int) -> int:
    """The number of stacked members shared by a group's parameters (1 unstacked)."""
    counts = set()
    for param in params:
        dims = member_dims(param)
        counts.add(math.prod(param.shape[:dims]) if dims else 0)
    if len(counts) > 1:
        refuse(
            "optimizer",
            f"param group {index} holding stacked members {sorted(counts)}",
            "every parameter of a param group stacked with the same number of members "
            "(0: unstacked), so that members are never mixed",
            "",
        )
    count = counts.pop() if counts else 0
    return max(count, 1)


def _total(parts: list[Tensor], members: int) -> Tensor:
    """The sum of per-tensor parts (per member) as ``[members]`` in float64.

    A few operations however many parts.
    """
    if len(parts) == 1:
        return parts[0].to(torch.float64).reshape(members)
    if len({part.dtype for part in parts}) > 1:
        parts = [part.to(torch.float64) for part in parts]
    return torch.stack(parts).to(torch.float64).sum(0).reshape(members)


@dataclass
class TemperatureSums:
    r"""A param group's running sums, on the device: what a window's report is made of.

    Attributes:
        group: the param group's index.
        temperature: the T the sums were taken at.
        members: the number of stacked members (1 unstacked).
        kinetic: :math:`\sum r^2/M` summed over the steps (one per member), or None.
        kinetic_dof: the elements per step behind it.
        conf: :math:`\sum_i N\theta_i g'_i / d` summed over the steps.
        conf_variance: the terms' empirical variance summed over the steps that
            measured it (one per window suffices for the single-step band).
        conf_dof: the elements per step behind them.
        kinetic_steps: the steps summed into ``kinetic``.
        conf_steps: the steps summed into ``conf``.
        variance_steps: the steps summed into ``conf_variance``.
    """

    group: int
    temperature: float
    members: int
    kinetic: Tensor | None = None
    kinetic_dof: Tensor | int = 0
    conf: Tensor | None = None
    conf_variance: Tensor | None = None
    conf_dof: int = 0
    kinetic_steps: int = 0
    conf_steps: int = 0
    variance_steps: int = 0

    def add(self, other: TemperatureSums) -> None:
        """Add one step's sums (from :func:`group_sums`) to these, on the device."""
        if other.kinetic is not None:
            value = other.kinetic / other.kinetic_dof
            self.kinetic = value if self.kinetic is None else self.kinetic.add_(value)
            self.kinetic_dof = other.kinetic_dof
            self.kinetic_steps += 1
        if other.conf is not None:
            self.conf = other.conf if self.conf is None else self.conf.add_(other.conf)
            self.conf_dof = other.conf_dof
            self.conf_steps += 1
        if other.conf_variance is not None:
            variance = other.conf_variance
            self.conf_variance = (
                variance if self.conf_variance is None else self.conf_variance.add_(variance)
            )
            self.variance_steps += 1

    def report(self, level: float) -> list[ChainTemperatureReport]:
        """The window's reports, one per member: the one place that reads to the host."""
        check_open_unit_interval("level", level)
        target = self.temperature
        if target == 0:
            note = "temperature 0: no target to test against"
            return [
                ChainTemperatureReport(
                    self.group, self._member(m), target, level, 0, None, None, note
                )
                for m in range(self.members)
            ]
        kinetic = self._kinetic_estimates(level)
        conf = self._conf_estimates(level)
        notes = []
        if kinetic is None:
            notes.append("no momentum to read")
        if conf is None:
            notes.append("no gradient read")
        steps = max(self.kinetic_steps, self.conf_steps)
        return [
            ChainTemperatureReport(
                self.group,
                self._member(m),
                target,
                level,
                steps,
                None if kinetic is None else kinetic[m],
                None if conf is None else conf[m],
                "; ".join(notes),
            )
            for m in range(self.members)
        ]

    def _member(self, index: int) -> int | None:
        return None if self.members == 1 else index

    def _kinetic_estimates(self, level: float) -> list[TemperatureEstimate | None] | None:
        if self.kinetic is None or self.kinetic_steps == 0:
            return None
        values = (self.kinetic / self.kinetic_steps).tolist()
        dofs = _as_list(self.kinetic_dof, self.members)
        target = self.temperature
        estimates: list[TemperatureEstimate | None] = []
        for value, dof in zip(values, dofs, strict=True):
            if dof < 1:  # no element with a scale yet (the twin's first steps)
                estimates.append(None)
                continue
            low = target * chi2_quantile((1.0 - level) / 2.0, dof) / dof
            high = target * chi2_quantile((1.0 + level) / 2.0, dof) / dof
            estimates.append(TemperatureEstimate(value, low, high, dof))
        return estimates

    def _conf_estimates(self, level: float) -> list[TemperatureEstimate] | None:
        if self.conf is None or self.conf_variance is None or self.conf_steps == 0:
            return None
        values = (self.conf / self.conf_steps).tolist()
        variances = (self.conf_variance / self.variance_steps).tolist()
        z = statistics.NormalDist().inv_cdf((1.0 + level) / 2.0)
        target, dof = self.temperature, self.conf_dof
        if dof < 2:  # one term has no spread to measure: no band, never flagged
            return [TemperatureEstimate(value, -math.inf, math.inf, dof) for value in values]
        # the empirical variance is >= 0 but its rounding may not be (a constant term)
        widths = [z * math.sqrt(max(var, 0.0) / dof) for var in variances]
        return [
            TemperatureEstimate(value, target - width, target + width, dof)
            for value, width in zip(values, widths, strict=True)
        ]


def _as_list(value: Tensor | int, members: int) -> list[int]:
    if isinstance(value, Tensor):
        return [int(v) for v in value.tolist()]
    return [int(value)] * members


def group_sums(
    rule: TemperatureRule,
    group: Mapping[str, Any],
    index: int,
    states: Mapping[Tensor, Any],
    *,
    kinetic: bool = True,
    configurational: bool = True,
    spread: bool = True,
    coordinates: int | None = None,
    grad_scale: Tensor | None = None,
) -> TemperatureSums:
    r"""One step's sums of a param group, on its device (no host synchronisation).

    Reads :math:`\theta` and ``p.grad`` as they are now (:math:`\theta` must be the
    point the gradient was taken at: call it before the step) and the momentum buffers
    in ``states`` (an Optimizer's ``state``), as the sampler's ``rule`` says. The kinetic
    sum is :math:`\sum r^2/M` per member, and the configurational ones are
    :math:`\sum_i N t_i/d` and the terms' empirical variance
    :math:`N^2(\sum t_i^2/d - (\sum t_i/d)^2)` (with ``spread``; without, the step costs
    one dot product per tensor and buffer).

    ``coordinates``: read at most about that many coordinates per member, the fixed
    subset of :func:`~.temperature_coordinates.coordinate_subsets` (every tensor
    represented; :math:`d` is then the subset's size); None: every coordinate.
    ``grad_scale``: the scale ``p.grad`` carries (``torch.amp.GradScaler``'s, 0-d on the
    group's device), read as :math:`g/s` (exact for its powers of two); None: unscaled.
    """
    params: Iterable[Tensor] = group["params"]
    params = list(params)
    members = _member_count(params, index)
    subsets = coordinate_subsets([p.shape[member_dims(p) :] for p in params], coordinates)
    sums = TemperatureSums(index, float(group["temperature"]), members)
    if sums.temperature == 0:
        return sums  # nothing to test (the report says so)
    read = _GroupRead(rule, group, params, subsets, states)
    with torch.no_grad():
        if members == 1 and rule.plain:  # most steps
            if kinetic:
                _plain_kinetic(read, sums)
            if configurational:
                _plain_configurational(read, sums, spread, grad_scale)
            return sums
        if kinetic:
            _kinetic_sums(read, sums)
        if configurational:
            _configurational_sums(read, sums, spread, grad_scale)
    return sums


class _GroupRead(NamedTuple):
    """A param group's tensors as :func:`group_sums` reads them."""

    rule: TemperatureRule
    group: Mapping[str, Any]
    params: list[Tensor]
    subsets: Sequence[CoordinateSubset]
    states: Mapping[Tensor, Any]

    def with_grads(self) -> Iterator[tuple[Tensor, Tensor, CoordinateSubset]]:
        """Each tensor that has a gradient, with its gradient and its subset."""
        for param, subset in zip(self.params, self.subsets, strict=True):
            if param.grad is not None:
                yield param, param.grad, subset


def _kinetic_sums(read: _GroupRead, sums: TemperatureSums) -> None:
    """:func:`group_sums`' kinetic sum, into ``sums``.

    Per tensor, one dot product (in the parameters' dtype) per buffer, or the rule's
    float64 sum; the parts summed at the end in float64, a few operations whatever the
    number of tensors.
    """
    rule, group, params, subsets, states = read
    members = sums.members
    by_weight: dict[float, list[Tensor]] = {}  # unit masses: b.b by weight
    totals: list[Tensor] = []  # float64: the rules' own sums, and the weighted ones
    dof: Tensor | int = 0
    for param, subset in zip(params, subsets, strict=True):
        got = rule.kinetic_read(SubsetRead(group, param, states.get(param, {}), subset, members))
        if got is None:
            continue
        value, count, weight = got
        dof = dof + count
        if weight is None:
            totals.append(value)
        else:
            by_weight.setdefault(weight, []).append(member_dot(value, value, members))
    for weight, parts in by_weight.items():
        totals.append(_total(parts, members).mul_(weight))
    if totals:
        sums.kinetic = _total(totals, members)
        sums.kinetic_dof = dof


def _configurational_sums(
    read: _GroupRead, sums: TemperatureSums, spread: bool, grad_scale: Tensor | None
) -> None:
    r""":func:`group_sums`' configurational sums, into ``sums``.

    Per tensor, the dot products :math:`\theta\cdot g` and :math:`\theta\cdot\theta`
    (most steps), or with the spread (or a decoupled decay) the terms themselves; summed
    at the end in float64.
    """
    group, members = read.group, sums.members
    decay = float(group.get("weight_decay", 0.0))
    theta_grad: list[Tensor] = []  # the cheap path: theta.g and theta.theta
    theta_theta: list[Tensor] = []
    term_sums: list[Tensor] = []  # with the spread, or a decoupled decay: sum t, sum t^2
    term_squares: list[Tensor] = []
    dof = 0
    for param, grad, subset in read.with_grads():
        at = SubsetRead(group, param, read.states.get(param, {}), subset, members)
        got = read.rule.configurational_read(at, grad)
        if got is None:
            continue
        dof += subset.count
        theta, gradient, a = got
        if a is None and not spread:  # the cheap path of most steps
            theta_grad.append(member_dot(theta, gradient, members))
            if decay != 0:
                theta_theta.append(member_dot(theta, theta, members))
        else:
            scaled = gradient if grad_scale is None else gradient / grad_scale
            terms = configurational_terms(group, theta, scaled, a)
            term_sums.append(terms.sum(-1))
            if spread:
                term_squares.append(member_dot(terms, terms, members))
    first: Tensor | None = None
    if theta_grad:
        sign = -1.0 if group.get("maximize", False) else 1.0
        first = _total(theta_grad, members).mul_(sign)
        first = first if grad_scale is None else first.div_(grad_scale)
        if theta_theta:
            first = first.add_(_total(theta_theta, members), alpha=decay)
    if term_sums:
        summed = _total(term_sums, members)
        first = summed if first is None else first.add_(summed)
    if first is not None and dof > 0:
        second = _total(term_squares, members) if term_squares else None
        _set_conf(sums, first.div_(dof), second, dof, float(group["num_data"]))


def _set_conf(
    sums: TemperatureSums, mean: Tensor, second: Tensor | None, dof: int, num_data: float
) -> None:
    r"""Set ``sums``' configurational mean :math:`N\,\bar t` and the terms' variance.

    ``second`` is :math:`\sum_i t_i^2` (divided here by ``dof``), None: no variance.
    """
    sums.conf = mean.mul(num_data)
    sums.conf_dof = dof
    if second is not None:
        sums.conf_variance = second.div_(dof).sub_(mean.square()).mul_(num_data**2)


def _plain_kinetic(read: _GroupRead, sums: TemperatureSums) -> None:
    """:func:`group_sums`' most common case, its kinetic sum, in fewer operations.

    An unstacked group of a :attr:`~.temperature_rule.TemperatureRule.plain` rule
    (SGHMC, BAOA): the same sums as the general path (the dot products per tensor, and
    with ``spread`` the terms, summed in float64), with its per-tensor bookkeeping
    inlined. At a few thousand coordinates the reduction's cost is per operation (issue
    26's budget: 2% of a step). :func:`_plain_configurational` takes the others.
    """
    rule, group, params, subsets, states = read
    by_weight: dict[float, list[Tensor]] = {}
    dof = 0
    for param, subset in zip(params, subsets, strict=True):
        got = rule.kinetic_read(SubsetRead(group, param, states.get(param, {}), subset, 1))
        if got is not None:
            momentum, _, weight = got
            assert weight is not None  # a unit mass's (TemperatureRule.plain)
            by_weight.setdefault(weight, []).append(member_dot(momentum, momentum, 1))
            dof += subset.count
    if by_weight:
        total: Tensor | None = None
        for weight, parts in by_weight.items():
            part = torch.stack(parts).sum(dtype=torch.float64).mul_(weight)
            total = part if total is None else total.add_(part)
        assert total is not None
        sums.kinetic = total.reshape(1)
        sums.kinetic_dof = dof


def _plain_configurational(
    read: _GroupRead, sums: TemperatureSums, spread: bool, grad_scale: Tensor | None
) -> None:
    """:func:`_plain_kinetic`'s configurational sums (a coupled decay)."""
    group = read.group
    decay = float(group.get("weight_decay", 0.0))
    products: list[Tensor] = []
    squares: list[Tensor] = []
    term_sums: list[Tensor] = []
    term_squares: list[Tensor] = []
    dof = 0
    for param, grad, subset in read.with_grads():
        theta, gradient = subset.read(param, 1), subset.read(grad, 1)
        if spread:  # the terms themselves: their sum and their squares'
            scaled = gradient if grad_scale is None else gradient / grad_scale
            terms = configurational_terms(group, theta, scaled, None)
            term_sums.append(terms.sum(-1))
            term_squares.append(member_dot(terms, terms, 1))
        else:
            products.append(member_dot(theta, gradient, 1))
            if decay != 0:
                squares.append(member_dot(theta, theta, 1))
        dof += subset.count
    if dof == 0:
        return
    num_data = float(group["num_data"])
    if term_sums:
        mean = torch.stack(term_sums).sum(dtype=torch.float64).div_(dof)
        second = torch.stack(term_squares).sum(dtype=torch.float64).div_(dof)
        sums.conf_variance = second.sub_(mean.square()).mul_(num_data**2).reshape(1)
    else:
        sign = -1.0 if group.get("maximize", False) else 1.0
        mean = torch.stack(products).sum(dtype=torch.float64).mul_(sign)
        mean = mean if grad_scale is None else mean.div_(grad_scale)
        if squares:
            mean = mean.add_(torch.stack(squares).sum(dtype=torch.float64), alpha=decay)
        mean = mean.div_(dof)
    sums.conf = mean.mul(num_data).reshape(1)
    sums.conf_dof = dof


def temperature_reports(
    rule: TemperatureRule,
    groups: Sequence[Mapping[str, Any]],
    states: Mapping[Tensor, Any],
    level: float,
) -> list[ChainTemperatureReport]:
    """One step's reports for every param group (and member), read to the host now."""
    reports = []
    for index, group in enumerate(groups):
        step = group_sums(rule, group, index, states)
        window = TemperatureSums(index, step.temperature, step.members)
        window.add(step)
        reports.extend(window.report(level))
    return reports
