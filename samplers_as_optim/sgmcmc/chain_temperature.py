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

**Kinetic.** The momentum of each sampler in continuous-time units, read from its
buffer in SGD units (each sampler's module docstring; rule ``temperature_rule`` of its
:class:`~.definition.SamplerDefinition`):

* ``"sghmc"`` (SGHMC with ``momentum`` :math:`\mu > 0`): :math:`r = -\sqrt{N\,lr}\,b`,
  :math:`M = 1`, so :math:`r^2 = N\,lr\,b^2`. The Euler step leaves the buffer of a free
  coordinate with variance :math:`2T/(N\,lr\,(1+\mu))` at every ``lr``, not
  :math:`T/(N\,lr)`: the buffer is the momentum half a step off the positions. The
  estimate is therefore :math:`T_{\text{kin}} = \tfrac{1+\mu}{2}\,\tfrac1d\sum_i N\,lr\,
  b_i^2`, the stationary second moment of the midpoint momentum
  :math:`(b_{\text{old}} + b)/2` (as SGNHT's symmetric thermostat reads it). On a Gaussian
  target it equals the discrete chain's configurational temperature exactly, both
  :math:`T/(1 - h/(2(1+\mu)))` on a mode of :math:`h = lr\,\lambda/N`
  (``tests/test_chain_temperature.py`` solves the exact law).
* ``"sgnht"``: as SGHMC with the friction :math:`1-\mu` replaced by each tensor's
  thermostat :math:`\alpha`: :math:`\tfrac{2-\alpha}{2}\,N\,lr\,b^2`. With the noise of
  :math:`1-\mu`, a free coordinate then reads :math:`T(1-\mu)/\alpha`: the temperature
  the positions are sampled at (``sgnht``'s docstring: :math:`T(2-\alpha)/2` for the
  paper's thermostat, :math:`T` for the symmetric one).
* ``"baoa"``: :math:`r = -\sqrt{N\,lr}\,b` with :math:`b` the momentum after the O step;
  BAOAB's momentum there is exact on a Gaussian at any stable step, so
  :math:`T_{\text{kin}} = \tfrac1d\sum_i N\,lr\,b_i^2` with no factor.
* ``"adamw_sghmc"``: the twin is SGHMC with mass :math:`M = \mathrm{diag}(a)`, step
  :math:`\varepsilon = \sqrt{lr(1-\beta_1)/N}` and momentum :math:`r = M v/\varepsilon
  = -lr\, m/\varepsilon` (``adamw_sghmc``), so :math:`r_i^2/M_i = N\,lr\,m_i^2/((1-\beta_1)
  a_i)`; with SGHMC's discrete factor (its momentum is :math:`\beta_1`),
  :math:`T_{\text{kin}} = \tfrac{1+\beta_1}{2}\,\tfrac1d\sum_i N\,lr\,m_i^2/((1-\beta_1)
  a_i)`, :math:`a` the sampling preconditioner (the frozen one, or the one the warm-up
  follows). Elements where :math:`a` has no scale (no gradient has reached them; no
  noise is injected there) are left out of :math:`d`.
* ``"langevin"`` (SGLD, PSGLD) and SGHMC without momentum: no momentum, no kinetic
  estimate.

The buffer read is the one in the state, last written at the rate recorded beside it
(``momentum_lr``; the group's ``lr`` when none is recorded).

**Configurational.** :math:`\partial U/N` is the gradient the step uses with the prior
the sampler adds: :math:`g' = \pm g + \lambda\theta` (coupled weight decay: SGLD, SGHMC,
SGNHT, BAOA, PSGLD), and :math:`\pm g + \lambda\, a\,\theta` for the twin, whose decoupled
decay is the prior :math:`\mathcal N(0, 1/(N\lambda a_i))` (``adamw_sghmc``). The
position is :math:`\theta` *before* the update, the point at which the gradient was
computed: read in a step pre-hook, or by :meth:`SamplerOptimizer.temperature_estimates`
called between ``backward()`` and ``step()``. With a minibatch gradient
:math:`g = \nabla L + \eta`, :math:`E[\theta\cdot\eta] = 0` (the minibatch is drawn
independently of :math:`\theta`), so the estimate stays unbiased and the noise only
widens its spread, which the band below measures. It holds for any preconditioner (the
identity does not involve the dynamics). Its discrete-chain value on a Gaussian mode is
:math:`T/(1 - h/2)` for SGLD and PSGLD's frozen preconditioner (:math:`h` the
preconditioned step), :math:`T/(1 - h/(2(1+\mu)))` for SGHMC and the twin, exactly
:math:`T` for BAOA.

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
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..core.validation import check_open_unit_interval, refuse
from ..names import member_dims
from ._chi2 import chi2_quantile
from .momentum_units import MOMENTUM_RATE
from .sampling_preconditioner import pooled_second_moment
from .temperature_coordinates import CoordinateSubset, coordinate_subsets

__all__ = [
    "TEMPERATURE_RULES",
    "ChainTemperatureReport",
    "TemperatureEstimate",
    "TemperatureSums",
    "chi2_quantile",
    "group_sums",
    "temperature_reports",
]

#: the rules by which a sampler's kinetic temperature and prior are read (module docstring)
TEMPERATURE_RULES = ("sghmc", "sgnht", "baoa", "adamw_sghmc", "langevin")


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


def _adamw_scale(
    group: Mapping[str, Any],
    param: Tensor,
    state: Mapping[str, Any],
    subset: CoordinateSubset,
    members: int,
) -> Tensor | None:
    """The twin's sampling preconditioner :math:`a` at ``subset`` (None before a step).

    As :meth:`~.temperature_coordinates.CoordinateSubset.read` gives it, or with a last
    dimension of 1 where :math:`a` is one number per member.
    """
    frozen = state.get("preconditioner")
    flag = state.get("preconditioner_step")
    if isinstance(frozen, Tensor) and flag is not None and float(flag) > 0:
        return _read_like(frozen, param, subset, members)
    square = state.get("exp_avg_sq")
    step = state.get("step")
    if square is None or step is None or float(step) == 0:
        return None
    beta2 = float(group["betas"][1])
    correction = 1.0 - beta2 ** float(step)
    if group["preconditioner"] == "elementwise":  # the pooling is the identity: read first
        pooled = subset.read(square, members)
    else:
        full = pooled_second_moment(square, group["preconditioner"], member_dims(param))
        pooled = _read_like(full, param, subset, members)
    return pooled.div(correction).sqrt().add(group["eps"])


def _read_like(value: Tensor, param: Tensor, subset: CoordinateSubset, members: int) -> Tensor:
    """``value`` (``param``'s shape, or broadcast to it) at ``subset``."""
    if value.numel() == param.numel():
        return subset.read(value.reshape(param.shape), members)
    if value.numel() == members:  # one number per member (pooled over a vector)
        return value.reshape((1,) if members == 1 else (members, 1))
    return subset.read(value.expand_as(param), members)


def _kinetic(
    rule: str,
    group: Mapping[str, Any],
    param: Tensor,
    state: Mapping[str, Any],
    members: int,
    subset: CoordinateSubset,
) -> tuple[Tensor, Tensor | int, float | None] | None:
    r"""The momentum of ``param`` over ``subset``, in units of T, or None.

    ``(value, count, weight)``. For SGHMC and BAOA the read ``[members, count]`` and the
    float :math:`w` with :math:`r^2/M = w\,b^2` (the dot product is left to the
    caller, which sums the tensors of one weight together); for SGNHT and the twin,
    whose weights are tensors,
    :math:`\sum r^2/M` per member, the element count and None.
    """
    name = "exp_avg" if rule == "adamw_sghmc" else "momentum_buffer"
    buffer = state.get(name)
    if rule == "langevin" or buffer is None:
        return None
    rate = state.get(MOMENTUM_RATE)
    lr = float(group["lr"]) if rate is None else float(rate)
    scale = float(group["num_data"]) * lr
    momentum = subset.read(buffer, members)
    if rule == "sghmc":
        return momentum, subset.count, scale * (1.0 + float(group["momentum"])) / 2.0
    if rule == "baoa":
        return momentum, subset.count, scale
    if rule == "adamw_sghmc":
        a = _adamw_scale(group, param, state, subset, members)
        if a is None:
            return None
        beta1 = float(group["betas"][0])
        weighted = momentum.square().div_(a)
        has_scale = (a != group["eps"]).expand_as(weighted)
        total = weighted.masked_fill_(~has_scale, 0.0).sum(-1).to(torch.float64)
        count = has_scale.sum(-1).reshape(members)
        return total.mul_(scale * (1.0 + beta1) / (2.0 * (1.0 - beta1))), count, None
    # sgnht
    total = _dot(momentum, momentum, members).to(torch.float64)
    thermostat = state["thermostat"].to(device=total.device, dtype=torch.float64)
    return total.mul_(thermostat.mul(-0.5).add_(1.0)).mul_(scale), subset.count, None


_HALF = (torch.float16, torch.bfloat16)


def _dot(x: Tensor, y: Tensor, members: int) -> Tensor:
    r""":math:`\sum_i x_i y_i` per member, in their dtype (float32 for half precision).

    Nothing is allocated, except where one is float16 or bfloat16 (a half-precision
    parameter or gradient): a sum over thousands of terms in half precision would lose
    the estimate, so both are widened to float32.

    ``x`` and ``y`` are subsets as read (``[count]``, or ``[members, count]``; views,
    possibly strided: BLAS reads them with their stride, which costs far less than
    gathering them first); 0-d for one member.
    """
    if x.dtype in _HALF or y.dtype in _HALF:
        x, y = x.float(), y.float()
    if members == 1:
        return torch.dot(x, y)
    product: Tensor = torch.linalg.vecdot(x, y)
    return product


def _total(parts: list[Tensor], members: int) -> Tensor:
    """The sum of per-tensor parts (per member) as ``[members]`` in float64.

    A few operations however many parts.
    """
    if len(parts) == 1:
        return parts[0].to(torch.float64).reshape(members)
    if len({part.dtype for part in parts}) > 1:
        parts = [part.to(torch.float64) for part in parts]
    return torch.stack(parts).to(torch.float64).sum(0).reshape(members)


def _configurational(
    rule: str,
    group: Mapping[str, Any],
    param: Tensor,
    grad: Tensor,
    state: Mapping[str, Any],
    members: int,
    subset: CoordinateSubset,
) -> tuple[Tensor, Tensor, Tensor | None] | None:
    r""":math:`\theta`, :math:`g` and the twin's :math:`a` over ``subset``.

    As the reads give them; :math:`a` only where the twin's decoupled decay is the
    prior (else None). None where that prior is unknown (before the first step).
    """
    theta, gradient = subset.read(param, members), subset.read(grad, members)
    if rule == "adamw_sghmc" and float(group.get("weight_decay", 0.0)) != 0:
        a = _adamw_scale(group, param, state, subset, members)
        if a is None:
            return None  # the decoupled prior needs a, which the first step creates
        return theta, gradient, a.expand_as(theta)
    return theta, gradient, None


def _conf_terms(
    group: Mapping[str, Any], theta: Tensor, gradient: Tensor, a: Tensor | None
) -> Tensor:
    r"""The terms :math:`t_i = \theta_i g'_i` (units of :math:`U/N`), shaped as the reads.

    :math:`g' = \pm g + \lambda\theta`, or :math:`\pm g + \lambda a\theta` for the twin.
    """
    decay = float(group.get("weight_decay", 0.0))
    sign = -1.0 if group.get("maximize", False) else 1.0
    if a is not None:
        return theta.mul(a).mul_(decay).add_(gradient, alpha=sign).mul_(theta)
    terms = gradient.mul(theta) if sign > 0 else gradient.neg().mul_(theta)
    if decay != 0:
        terms.addcmul_(theta, theta, value=decay)
    return terms


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
    rule: str,
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
    in ``states`` (an Optimizer's ``state``). The kinetic sum is :math:`\sum r^2/M`
    per member, and the configurational ones are :math:`\sum_i N t_i/d` and the
    terms' empirical variance :math:`N^2(\sum t_i^2/d - (\sum t_i/d)^2)` (with
    ``spread``; without, the step costs one dot product per tensor and buffer).

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
    num_data = float(group["num_data"])
    decay = float(group.get("weight_decay", 0.0))
    sign = -1.0 if group.get("maximize", False) else 1.0
    # per tensor, one dot product (in the parameters' dtype) per quantity; the parts are
    # summed at the end in float64, a few operations whatever the number of tensors
    kin_parts: dict[float, list[Tensor]] = {}  # SGHMC and BAOA: b.b by weight
    kin_totals: list[Tensor] = []  # float64: SGNHT, the twin, and the weighted sums
    kin_dof: Tensor | int = 0
    theta_grad: list[Tensor] = []  # the cheap path: theta.g and theta.theta
    theta_theta: list[Tensor] = []
    term_sums: list[Tensor] = []  # with the spread, or the twin's decay: sum t, sum t^2
    term_squares: list[Tensor] = []
    conf_dof = 0
    if members == 1 and rule in _LEAN_RULES:  # most steps
        with torch.no_grad():
            _plain_sums(
                rule,
                group,
                params,
                subsets,
                states,
                sums,
                kinetic=kinetic,
                configurational=configurational,
                spread=spread,
                grad_scale=grad_scale,
            )
        return sums
    with torch.no_grad():
        for param, subset in zip(params, subsets, strict=True):
            state = states.get(param, {})
            if kinetic:
                read = _kinetic(rule, group, param, state, members, subset)
                if read is not None:
                    value, count, weight = read
                    kin_dof = kin_dof + count
                    if weight is None:
                        kin_totals.append(value)
                    else:
                        kin_parts.setdefault(weight, []).append(_dot(value, value, members))
            if configurational and param.grad is not None:
                conf = _configurational(rule, group, param, param.grad, state, members, subset)
                if conf is None:
                    continue
                conf_dof += subset.count
                theta, gradient, a = conf
                if a is None and not spread:  # the cheap path of most steps
                    theta_grad.append(_dot(theta, gradient, members))
                    if decay != 0:
                        theta_theta.append(_dot(theta, theta, members))
                else:
                    scaled = gradient if grad_scale is None else gradient / grad_scale
                    terms = _conf_terms(group, theta, scaled, a)
                    term_sums.append(terms.sum(-1))
                    if spread:
                        term_squares.append(_dot(terms, terms, members))
        for weight, parts in kin_parts.items():
            kin_totals.append(_total(parts, members).mul_(weight))
        kin_total = _total(kin_totals, members) if kin_totals else None
        first: Tensor | None = None
        if theta_grad:
            first = _total(theta_grad, members).mul_(sign)
            first = first if grad_scale is None else first.div_(grad_scale)
            if theta_theta:
                first = first.add_(_total(theta_theta, members), alpha=decay)
        if term_sums:
            summed = _total(term_sums, members)
            first = summed if first is None else first.add_(summed)
        second = _total(term_squares, members) if term_squares else None
    if kin_total is not None:
        sums.kinetic = kin_total
        sums.kinetic_dof = kin_dof
    if first is not None and conf_dof > 0:
        mean = first.div_(conf_dof)
        sums.conf = mean.mul(num_data)
        sums.conf_dof = conf_dof
        if second is not None:
            sums.conf_variance = second.div_(conf_dof).sub_(mean.square()).mul_(num_data**2)
    return sums


#: the samplers whose unstacked groups take :func:`_plain_sums` (the tests empty it)
_LEAN_RULES = ("sghmc", "baoa")


def _plain_sums(
    rule: str,
    group: Mapping[str, Any],
    params: list[Tensor],
    subsets: Sequence[CoordinateSubset],
    states: Mapping[Tensor, Any],
    sums: TemperatureSums,
    *,
    kinetic: bool,
    configurational: bool,
    spread: bool,
    grad_scale: Tensor | None,
) -> None:
    """:func:`group_sums`' most common case, into ``sums``, in fewer operations.

    An unstacked group of SGHMC or BAOA: the same sums as the general loop (the dot
    products per tensor, and with ``spread`` the terms, summed in float64), with its
    per-tensor bookkeeping inlined. At a few thousand coordinates the reduction's cost
    is per operation (issue 26's budget: 2% of a step).
    """
    num_data = float(group["num_data"])
    lr = float(group["lr"])
    decay = float(group.get("weight_decay", 0.0))
    factor = (1.0 + float(group["momentum"])) / 2.0 if rule == "sghmc" else 1.0
    by_weight: dict[float, list[Tensor]] = {}
    kin_dof = 0
    products: list[Tensor] = []
    squares: list[Tensor] = []
    term_sums: list[Tensor] = []
    term_squares: list[Tensor] = []
    conf_dof = 0
    for param, subset in zip(params, subsets, strict=True):
        state = states.get(param, {})
        buffer = state.get("momentum_buffer") if kinetic else None
        if buffer is not None:
            rate = state.get(MOMENTUM_RATE)
            weight = num_data * (lr if rate is None else float(rate)) * factor
            momentum = subset.read(buffer, 1)
            by_weight.setdefault(weight, []).append(_dot(momentum, momentum, 1))
            kin_dof += subset.count
        grad = param.grad
        if configurational and grad is not None:
            theta, gradient = subset.read(param, 1), subset.read(grad, 1)
            if spread:  # the terms themselves: their sum and their squares'
                scaled = gradient if grad_scale is None else gradient / grad_scale
                terms = _conf_terms(group, theta, scaled, None)
                term_sums.append(terms.sum(-1))
                term_squares.append(_dot(terms, terms, 1))
            else:
                products.append(_dot(theta, gradient, 1))
                if decay != 0:
                    squares.append(_dot(theta, theta, 1))
            conf_dof += subset.count
    if by_weight:
        total: Tensor | None = None
        for weight, parts in by_weight.items():
            part = torch.stack(parts).sum(dtype=torch.float64).mul_(weight)
            total = part if total is None else total.add_(part)
        assert total is not None
        sums.kinetic = total.reshape(1)
        sums.kinetic_dof = kin_dof
    if conf_dof == 0:
        return
    if term_sums:
        mean = torch.stack(term_sums).sum(dtype=torch.float64).div_(conf_dof)
        second = torch.stack(term_squares).sum(dtype=torch.float64).div_(conf_dof)
        sums.conf_variance = second.sub_(mean.square()).mul_(num_data**2).reshape(1)
    else:
        sign = -1.0 if group.get("maximize", False) else 1.0
        mean = torch.stack(products).sum(dtype=torch.float64).mul_(sign)
        mean = mean if grad_scale is None else mean.div_(grad_scale)
        if squares:
            mean = mean.add_(torch.stack(squares).sum(dtype=torch.float64), alpha=decay)
        mean = mean.div_(conf_dof)
    sums.conf = mean.mul(num_data).reshape(1)
    sums.conf_dof = conf_dof


def temperature_reports(
    rule: str, groups: Sequence[Mapping[str, Any]], states: Mapping[Tensor, Any], level: float
) -> list[ChainTemperatureReport]:
    """One step's reports for every param group (and member), read to the host now."""
    reports = []
    for index, group in enumerate(groups):
        step = group_sums(rule, group, index, states)
        window = TemperatureSums(index, step.temperature, step.members)
        window.add(step)
        reports.extend(window.report(level))
    return reports
