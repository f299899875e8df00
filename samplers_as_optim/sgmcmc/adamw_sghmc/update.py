r"""AdamWSGHMC's pure kernel, one parameter at a time: the body of ``adamw_sghmc_direction``.

:func:`.adamw_sghmc.adamw_sghmc_direction` documents the kernel (its derivation is the
module docstring of :mod:`.adamw_sghmc`) and hands its hyperparameters here as one
:class:`Settings`. Per parameter, :func:`directions` updates AdamW's :math:`V`, takes the
denominator :math:`a` (AdamW's own at temperature 0, :func:`_adamw_denominator`; the
pooled, frozen sampling preconditioner above it, :func:`_sampling_denominator`), moves the
momentum and returns the direction, with AdamW's operations in AdamW's order.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import Tensor

from ...names import member_dims
from ..sampling_preconditioner import (
    advanced,
    freeze_mark,
    freezes_now,
    prior_floor,
    released,
    sampling_preconditioner,
)

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
    state: dict[str, list[Any]] = {
        "step": [],
        "exp_avg": [],
        "exp_avg_sq": [],
        "max_exp_avg_sq": list(max_exp_avg_sqs) if s.amsgrad and max_exp_avg_sqs else [],
        "preconditioner": list(preconditioners) if preconditioners is not None else [None] * count,
        "preconditioner_root": list(roots) if roots is not None else [None] * count,
        "preconditioner_step": list(frozen_at) if frozen_at is not None else [0.0] * count,
    }
    out: list[Tensor] = []
    for i, (param, grad) in enumerate(zip(params, grads, strict=True)):
        grad = -grad if s.maximize else grad
        step = advanced(steps[i], s.inplace)
        t = float(step)
        m = exp_avgs[i] if s.inplace else exp_avgs[i].clone()
        v = exp_avg_sqs[i] if s.inplace else exp_avg_sqs[i].clone()
        v.mul_(s.beta2).addcmul_(grad, grad, value=1 - s.beta2)
        correction1, correction2 = 1 - s.beta1**t, 1 - s.beta2**t
        if noise is None:
            m.lerp_(grad, 1 - s.beta1)
            denominator = _adamw_denominator(i, v, correction2, state, s)
        else:
            denominator, root = _sampling_denominator(i, param, v, t, correction2, state, s)
            kick = torch.addcmul(grad, noise[i], root, value=sigma)
            m.lerp_(kick, 1 - s.beta1)
        direction = m.div(denominator)
        if noise is None and correction1 != 1:  # (at T > 0 the momentum starts at 0: doc)
            direction = direction.div_(correction1) if s.inplace else direction.div(correction1)
        if s.weight_decay != 0:
            direction = (
                direction.add_(param, alpha=s.weight_decay)
                if s.inplace
                else direction.add(param, alpha=s.weight_decay)
            )
        out.append(direction)
        state["step"].append(step)
        state["exp_avg"].append(m)
        state["exp_avg_sq"].append(v)
    return out, state


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
