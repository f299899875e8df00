r"""What a sampler means by its temperature: :class:`TemperatureRule` and its pieces.

Each sampler's :class:`~.definition.SamplerDefinition` holds its rule
(``temperature/rule``), built in the sampler's module from the pieces here;
:mod:`.chain_temperature` reads a param group's estimates through it (the identities and
the bands are its module docstring). A rule says two things:

* **kinetic**: which state buffer holds the momentum :math:`b` in SGD units (written at
  the rate ``momentum_lr`` recorded beside it, else the group's ``lr``) and how
  :math:`r^2/M` is read from it: the buffer's units, the mass :math:`M` and the discrete
  factor that makes the estimate exact for the discretised chain (``kinetic``; None: no
  momentum, no kinetic estimate: SGLD, PSGLD, :data:`LANGEVIN`);
* **configurational**: the prior the sampler adds to the gradient,
  :math:`g' = \pm g + \lambda\theta` (coupled weight decay, the default) or
  :math:`\pm g + \lambda\, a\,\theta` for a decoupled decay whose scale :math:`a` the rule
  reads (``decay_scale``: the AdamW twin, ``adamw_sghmc/temperature``).

The kinetic pieces, with :math:`r = -\sqrt{N\,lr}\,b` (each sampler's module docstring):

* :class:`UnitMass` (:math:`M = 1`): :math:`r^2 = N\,lr\,b^2` times a discrete factor.
  SGHMC's (``momentum`` :math:`\mu > 0`) is :func:`midpoint_factor`,
  :math:`\tfrac{1+\mu}{2}`: the Euler step leaves the buffer of a free coordinate with
  variance :math:`2T/(N\,lr\,(1+\mu))` at every ``lr``, not :math:`T/(N\,lr)`, the buffer
  being the momentum half a step off the positions; :math:`\tfrac{1+\mu}{2}\,N\,lr\,b^2`
  is the stationary second moment of the midpoint momentum
  :math:`(b_{\text{old}} + b)/2` (as SGNHT's symmetric thermostat reads it). On a
  Gaussian target it equals the discrete chain's configurational temperature exactly,
  both :math:`T/(1 - h/(2(1+\mu)))` on a mode of :math:`h = lr\,\lambda/N`
  (``tests/test_chain_temperature.py`` solves the exact law). BAOA's factor is 1: its
  :math:`b` is the momentum after the O step, which BAOAB keeps exact on a Gaussian at
  any stable step. SGHMC without momentum keeps no buffer: no kinetic estimate.
* :func:`thermostat_kinetic` (SGNHT): as SGHMC with the friction :math:`1-\mu` replaced
  by each tensor's thermostat :math:`\alpha`, :math:`\tfrac{2-\alpha}{2}\,N\,lr\,b^2`.
  With the noise of :math:`1-\mu`, a free coordinate then reads :math:`T(1-\mu)/\alpha`:
  the temperature the positions are sampled at (``sgnht``'s docstring:
  :math:`T(2-\alpha)/2` for the paper's thermostat, :math:`T` for the symmetric one).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..definition.momentum_units import MOMENTUM_RATE
from .coordinates import CoordinateSubset

__all__ = [
    "LANGEVIN",
    "Kinetic",
    "KineticRead",
    "Mass",
    "SubsetRead",
    "TemperatureRule",
    "UnitMass",
    "configurational_terms",
    "member_dot",
    "midpoint_factor",
    "thermostat_kinetic",
]

#: a kinetic read ``(value, count, weight)`` (:meth:`TemperatureRule.kinetic_read`)
KineticRead = tuple[Tensor, Tensor | int, float | None]


class SubsetRead(NamedTuple):
    """One tensor of a param group as a read sees it: its group, state and subset.

    Attributes:
        group: the param group.
        param: the tensor.
        state: its optimizer state (empty before its first step).
        subset: the coordinates read (:class:`~.coordinates.CoordinateSubset`).
        members: the chains stacked in it (1: none).
    """

    group: Mapping[str, Any]
    param: Tensor
    state: Mapping[str, Any]
    subset: CoordinateSubset
    members: int


#: :math:`r^2/M` of one tensor, ``(at, momentum, scale)``: ``momentum`` the buffer read
#: at ``at.subset``, ``scale`` :math:`N\,lr`
Kinetic = Callable[[SubsetRead, Tensor, float], KineticRead | None]
#: a diagonal scale of one tensor read at its subset, as the reads give it (or
#: broadcastable to them); None before it exists
Mass = Callable[[SubsetRead], Tensor | None]

_HALF = (torch.float16, torch.bfloat16)


def member_dot(x: Tensor, y: Tensor, members: int) -> Tensor:
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


def midpoint_factor(group: Mapping[str, Any]) -> float:
    r"""SGHMC's discrete factor :math:`\tfrac{1+\mu}{2}`, :math:`\mu` = ``momentum``."""
    return (1.0 + float(group["momentum"])) / 2.0


@dataclass(frozen=True)
class UnitMass:
    r"""The kinetic piece of a unit mass: :math:`r^2/M = w\,b^2`, :math:`w = N\,lr\,f`.

    Attributes:
        factor: the discrete factor :math:`f` of a param group (:func:`midpoint_factor`
            for SGHMC); None: 1 (BAOA).
    """

    factor: Callable[[Mapping[str, Any]], float] | None = None

    def __call__(self, at: SubsetRead, momentum: Tensor, scale: float) -> KineticRead:
        """The read momentum, its count and the float weight :math:`w`."""
        weight = scale if self.factor is None else scale * self.factor(at.group)
        return momentum, at.subset.count, weight


def thermostat_kinetic(at: SubsetRead, momentum: Tensor, scale: float) -> KineticRead:
    r"""SGNHT's :math:`\sum\tfrac{2-\alpha}{2}\,N\,lr\,b^2` per member (float64).

    :math:`\alpha` is the tensor's thermostat (``state["thermostat"]``, per member).
    """
    total = member_dot(momentum, momentum, at.members).to(torch.float64)
    thermostat = at.state["thermostat"].to(device=total.device, dtype=torch.float64)
    return total.mul_(thermostat.mul(-0.5).add_(1.0)).mul_(scale), at.subset.count, None


def configurational_terms(
    group: Mapping[str, Any], theta: Tensor, gradient: Tensor, scale: Tensor | None
) -> Tensor:
    r"""The terms :math:`t_i = \theta_i g'_i` (units of :math:`U/N`), shaped as the reads.

    :math:`g' = \pm g + \lambda\theta`, or :math:`\pm g + \lambda a\theta` with the
    decoupled decay's scale :math:`a` = ``scale`` (as the reads, or broadcast to them).
    """
    decay = float(group.get("weight_decay", 0.0))
    sign = -1.0 if group.get("maximize", False) else 1.0
    if scale is not None:
        return theta.mul(scale).mul_(decay).add_(gradient, alpha=sign).mul_(theta)
    terms = gradient.mul(theta) if sign > 0 else gradient.neg().mul_(theta)
    if decay != 0:
        terms.addcmul_(theta, theta, value=decay)
    return terms


@dataclass(frozen=True)
class TemperatureRule:
    r"""How a sampler's kinetic and configurational temperatures are read (module docstring).

    Attributes:
        name: the rule's name, for messages (``"sghmc"``).
        momentum_buffer: the state buffer that holds the momentum :math:`b` in SGD units.
        kinetic: :math:`r^2/M` from the buffer (:data:`Kinetic`: :class:`UnitMass`,
            :func:`thermostat_kinetic`); None: no momentum, no kinetic estimate.
        decay_scale: the scale :math:`a` of a decoupled weight decay, whose prior term is
            :math:`\lambda\,a\,\theta` (:data:`Mass`); None: coupled decay,
            :math:`\lambda\theta`.
    """

    name: str
    momentum_buffer: str = "momentum_buffer"
    kinetic: Kinetic | None = None
    decay_scale: Mass | None = None

    @property
    def plain(self) -> bool:
        """A unit mass with float weights and a coupled decay (SGHMC, BAOA).

        ``temperature/estimates.group_sums`` reads an unstacked group of such a rule in fewer
        operations.
        """
        return isinstance(self.kinetic, UnitMass) and self.decay_scale is None

    def kinetic_read(self, at: SubsetRead) -> KineticRead | None:
        r"""The momentum of ``at.param`` over ``at.subset``, in units of T, or None.

        ``(value, count, weight)``. For a :class:`UnitMass` the read ``[members, count]``
        and the float :math:`w` with :math:`r^2/M = w\,b^2` (the dot product is left to
        the caller, which sums the tensors of one weight together); for the others,
        whose weights are tensors, :math:`\sum r^2/M` per member, the element count and
        None. None without a momentum, or before the buffer (or the mass) exists.
        """
        kinetic = self.kinetic
        if kinetic is None:
            return None
        buffer = at.state.get(self.momentum_buffer)
        if buffer is None:
            return None
        rate = at.state.get(MOMENTUM_RATE)
        lr = float(at.group["lr"]) if rate is None else float(rate)
        scale = float(at.group["num_data"]) * lr
        return kinetic(at, at.subset.read(buffer, at.members), scale)

    def configurational_read(
        self, at: SubsetRead, grad: Tensor
    ) -> tuple[Tensor, Tensor, Tensor | None] | None:
        r""":math:`\theta`, :math:`g` (``grad``) and the decoupled decay's :math:`a` at ``at``.

        As the reads give them; :math:`a` only where a decoupled decay is the prior (else
        None). None where that prior is unknown (before the first step).
        """
        theta, gradient = at.subset.read(at.param, at.members), at.subset.read(grad, at.members)
        if self.decay_scale is not None and float(at.group.get("weight_decay", 0.0)) != 0:
            scale = self.decay_scale(at)
            if scale is None:
                return None  # the decoupled prior needs a, which the first step creates
            return theta, gradient, scale.expand_as(theta)
        return theta, gradient, None


#: SGLD's and PSGLD's: no momentum (no kinetic estimate), the coupled decay's prior
LANGEVIN = TemperatureRule("langevin")
