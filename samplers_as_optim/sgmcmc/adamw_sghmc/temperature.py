r"""The AdamW twin's temperature rule: its sampling preconditioner as mass and prior scale.

The twin is SGHMC with mass :math:`M = \mathrm{diag}(a)`, step
:math:`\varepsilon = \sqrt{lr(1-\beta_1)/N}` and momentum :math:`r = M v/\varepsilon =
-lr\, m/\varepsilon` (``adamw_sghmc``), so :math:`r_i^2/M_i = N\,lr\,m_i^2/((1-\beta_1)
a_i)`; with SGHMC's discrete factor (its momentum is :math:`\beta_1`,
:mod:`.temperature_rule`),

.. math::

    T_{\text{kin}} = \frac{1+\beta_1}{2}\,\frac1d\sum_i \frac{N\,lr\,m_i^2}{(1-\beta_1)\,a_i},

:math:`a` the sampling preconditioner (the frozen one, or the one the warm-up follows;
``sampling_preconditioner``). Elements where :math:`a` has no scale (no gradient has
reached them; no noise is injected there) are left out of :math:`d`. Its decoupled decay
is the prior :math:`\mathcal N(0, 1/(N\lambda a_i))`: the configurational estimate reads
:math:`g' = \pm g + \lambda\,a\,\theta`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...names import member_dims
from ..sampling_preconditioner import pooled_second_moment, prior_floor
from ..temperature.coordinates import CoordinateSubset
from ..temperature.rule import KineticRead, SubsetRead, TemperatureRule

__all__ = ["ADAMW_SGHMC_RULE", "preconditioned_kinetic", "preconditioner_mass"]


def preconditioner_mass(at: SubsetRead) -> Tensor | None:
    """The twin's sampling preconditioner :math:`a` at ``at.subset`` (None before a step).

    As :meth:`~.temperature_coordinates.CoordinateSubset.read` gives it, or with a last
    dimension of 1 where :math:`a` is one number per member.
    """
    group, param, state, subset, members = at
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
    floor = prior_floor(
        float(group["temperature"]), float(group["prior_weight_decay"]), group["num_data"]
    )
    moment = pooled.div(correction)
    return (moment.clamp_min(floor) if floor > 0 else moment).sqrt().add(group["eps"])


def _read_like(value: Tensor, param: Tensor, subset: CoordinateSubset, members: int) -> Tensor:
    """``value`` (``param``'s shape, or broadcast to it) at ``subset``."""
    if value.numel() == param.numel():
        return subset.read(value.reshape(param.shape), members)
    if value.numel() == members:  # one number per member (pooled over a vector)
        return value.reshape((1,) if members == 1 else (members, 1))
    return subset.read(value.expand_as(param), members)


def preconditioned_kinetic(at: SubsetRead, momentum: Tensor, scale: float) -> KineticRead | None:
    r""":math:`\sum r^2/M` per member (float64), the elements with a scale, None.

    None before the first step (no :math:`a` yet).
    """
    a = preconditioner_mass(at)
    group, members = at.group, at.members
    if a is None:
        return None
    beta1 = float(group["betas"][0])
    weighted = momentum.square().div_(a)
    has_scale = (a != group["eps"]).expand_as(weighted)
    total = weighted.masked_fill_(~has_scale, 0.0).sum(-1).to(torch.float64)
    count = has_scale.sum(-1).reshape(members)
    return total.mul_(scale * (1.0 + beta1) / (2.0 * (1.0 - beta1))), count, None


#: the twin's: the momentum ``exp_avg`` with mass :math:`a`, the decay's prior scaled by it
ADAMW_SGHMC_RULE = TemperatureRule(
    "adamw_sghmc", "exp_avg", kinetic=preconditioned_kinetic, decay_scale=preconditioner_mass
)
