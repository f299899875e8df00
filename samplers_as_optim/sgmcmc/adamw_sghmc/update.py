r"""AdamWSGHMC's pure kernel, on lists of tensors: the body of ``adamw_sghmc_direction``.

:func:`.adamw_sghmc.adamw_sghmc_direction` documents the kernel (its derivation is the
module docstring of :mod:`.adamw_sghmc`) and hands its hyperparameters here as one
:class:`Settings`. Per parameter, :func:`directions` updates AdamW's :math:`V`, takes the
denominator :math:`a` (AdamW's own at temperature 0, :func:`_adamw_denominator`; the
pooled, frozen sampling preconditioner above it, :func:`_sampling_denominator`, one
tensor at a time), moves the momentum and returns the direction, with AdamW's operations,
each a foreach call where that gives the same numbers (``_Lists``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import Tensor

from ...names import member_dims
from ..sampling_preconditioner import (
    advanced_each,
    freeze_mark,
    freezes_now,
    prior_floor,
    released,
    sampling_preconditioner,
)
from ..tensor_lists import mul_scalar_

__all__ = ["Settings", "directions"]


@dataclasses.dataclass(frozen=True)
class Settings:
    """The hyperparameters and options of one ``adamw_sghmc_direction`` call (its Args)."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    temperature: float
    num_data: int
    maximize: bool
    amsgrad: bool
    preconditioner: str
    preconditioner_warmup: int | None
    inplace: bool
    prior_weight_decay: float = 0.0


def directions(
    params: list[Tensor],
    grads: list[Tensor],
    steps: list[Any],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    noise: list[Tensor] | None,
    settings: Settings,
    sigma: float,
    max_exp_avg_sqs: list[Tensor] | None,
    preconditioners: list[Tensor | None] | None,
    roots: list[Tensor | None] | None,
    frozen_at: list[Any] | None,
) -> tuple[list[Tensor], dict[str, list[Any]]]:
    r"""``adamw_sghmc_direction``, its hyperparameters in ``settings``; :math:`\sigma` given.

    Per parameter: :math:`V \leftarrow \beta_2 V + (1-\beta_2)\, g'^2`, then :math:`a`,
    then :math:`m \leftarrow \beta_1 m + (1-\beta_1)\big(g' + \sigma\sqrt{a}\,\xi\big)`
    (``lerp``), and :math:`d = \lambda\theta + m/a`, :math:`m/a` over :math:`1-\beta_1^t`
    at temperature 0 only.
    """
    s, count = settings, len(params)
    if s.maximize:
        grads = [-grad for grad in grads]
    state: dict[str, list[Any]] = {
        "step": advanced_each(steps, s.inplace),
        "exp_avg": [m if s.inplace else m.clone() for m in exp_avgs],
        "exp_avg_sq": [v if s.inplace else v.clone() for v in exp_avg_sqs],
        "max_exp_avg_sq": list(max_exp_avg_sqs) if s.amsgrad and max_exp_avg_sqs else [],
        "preconditioner": list(preconditioners) if preconditioners is not None else [None] * count,
        "preconditioner_root": list(roots) if roots is not None else [None] * count,
        "preconditioner_step": list(frozen_at) if frozen_at is not None else [0.0] * count,
    }
    times = [float(step) for step in state["step"]]
    ms, vs, each = state["exp_avg"], state["exp_avg_sq"], _Lists(params)
    each.mul_(vs, s.beta2)
    each.addcmul_(vs, grads, grads, 1 - s.beta2)
    if noise is None:
        each.lerp_(ms, grads, 1 - s.beta1)
        denominators = [
            _adamw_denominator(i, vs[i], 1 - s.beta2 ** times[i], state, s) for i in range(count)
        ]
    else:
        pairs = [
            _sampling_denominator(i, params[i], vs[i], times[i], 1 - s.beta2 ** times[i], state, s)
            for i in range(count)
        ]
        denominators = [denominator for denominator, _ in pairs]
        each.lerp_(ms, each.addcmul(grads, noise, [root for _, root in pairs], sigma), 1 - s.beta1)
    out = each.div(ms, denominators)
    if noise is None:  # (at T > 0 the momentum starts at 0: module docstring)
        for direction, t in zip(out, times, strict=True):
            correction1 = 1 - s.beta1**t
            if correction1 != 1:
                direction.div_(correction1)
    if s.weight_decay != 0:
        each.add_(out, params, s.weight_decay)
    return out, state


class _Lists:
    """Per-tensor operations on lists, as foreach calls where they give the same numbers.

    One call per list for float32/float64 tensors on one device (torch's foreach
    operations apply the single-tensor operation to each); tensor by tensor otherwise
    (on the CPU a foreach multiply rounds a Python scalar to a half tensor's dtype first).
    """

    def __init__(self, like: list[Tensor]) -> None:
        self.foreach = bool(like) and all(
            t.dtype in (torch.float32, torch.float64) and t.device == like[0].device for t in like
        )

    def mul_(self, xs: list[Tensor], value: float) -> None:
        if self.foreach:
            mul_scalar_(xs, value)
        else:
            for x in xs:
                x.mul_(value)

    def addcmul_(self, xs: list[Tensor], ys: list[Tensor], zs: list[Tensor], value: float) -> None:
        if self.foreach:
            torch._foreach_addcmul_(xs, ys, zs, value=value)
        else:
            for x, y, z in zip(xs, ys, zs, strict=True):
                x.addcmul_(y, z, value=value)

    def addcmul(
        self, xs: list[Tensor], ys: list[Tensor], zs: list[Tensor], value: float
    ) -> list[Tensor]:
        if self.foreach:
            return list(torch._foreach_addcmul(xs, ys, zs, value=value))
        return [torch.addcmul(x, y, z, value=value) for x, y, z in zip(xs, ys, zs, strict=True)]

    def lerp_(self, xs: list[Tensor], ends: list[Tensor], weight: float) -> None:
        if self.foreach:
            torch._foreach_lerp_(xs, ends, weight)
        else:
            for x, end in zip(xs, ends, strict=True):
                x.lerp_(end, weight)

    def div(self, xs: list[Tensor], ys: list[Tensor]) -> list[Tensor]:
        if self.foreach:
            return list(torch._foreach_div(xs, ys))
        return [x.div(y) for x, y in zip(xs, ys, strict=True)]

    def add_(self, xs: list[Tensor], ys: list[Tensor], alpha: float) -> None:
        if self.foreach:
            torch._foreach_add_(xs, ys, alpha=alpha)
        else:
            for x, y in zip(xs, ys, strict=True):
                x.add_(y, alpha=alpha)


def _adamw_denominator(
    i: int, v: Tensor, correction2: float, state: dict[str, list[Any]], s: Settings
) -> Tensor:
    r"""AdamW's :math:`a = \sqrt{V/(1-\beta_2^t)} + \epsilon` at temperature 0.

    With ``amsgrad`` :math:`V` is its running maximum (kept in ``state``); a frozen
    sampling preconditioner is released.
    """
    second = v
    if s.amsgrad:
        peak = state["max_exp_avg_sq"][i]
        assert peak is not None
        peak = peak if s.inplace else peak.clone()
        torch.maximum(peak, v, out=peak)
        state["max_exp_avg_sq"][i] = second = peak
    denominator = second.sqrt().div(math.sqrt(correction2)).add(s.eps)
    state["preconditioner_step"][i] = released(state["preconditioner_step"][i], s.inplace)
    return denominator


def _sampling_denominator(
    i: int,
    param: Tensor,
    v: Tensor,
    t: float,
    correction2: float,
    state: dict[str, list[Any]],
    s: Settings,
) -> tuple[Tensor, Tensor]:
    r"""The sampling preconditioner :math:`a` at temperature > 0 and its masked :math:`\sqrt{a}`.

    The frozen pair where there is one; otherwise :math:`a` from :math:`V` pooled
    (``sampling_preconditioner``), with no noise where it has no scale (:math:`a =
    \epsilon`), frozen in ``state`` once the warm-up of ``t`` steps is over.
    """
    flag = state["preconditioner_step"][i]
    frozen, root = state["preconditioner"][i], state["preconditioner_root"][i]
    if float(flag) > 0 and frozen is not None and root is not None:
        return frozen, root
    denominator = sampling_preconditioner(
        v,
        correction=correction2,
        eps=s.eps,
        how=s.preconditioner,
        inplace=s.inplace,
        members=member_dims(param),
        floor=prior_floor(s.temperature, s.prior_weight_decay, s.num_data),
    )
    # no noise where the preconditioner has no scale (sampling_preconditioner)
    root = denominator.sqrt().masked_fill(denominator == s.eps, 0.0)
    if freezes_now(float(flag), t, s.preconditioner_warmup):
        state["preconditioner"][i], state["preconditioner_root"][i] = denominator, root
        state["preconditioner_step"][i] = freeze_mark(flag, t)
    return denominator, root
