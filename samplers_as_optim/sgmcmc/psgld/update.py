r"""PSGLD's pure kernel, one (device, dtype) bucket at a time: the body of ``psgld_direction``.

:func:`.psgld.psgld_direction` documents the kernel and hands its hyperparameters here as
one :class:`Settings`. :func:`directions` checks them and runs each bucket (every tensor
on its own for the single-tensor reference, a bucket per device and dtype for foreach)
through the steps of the update, each written with RMSprop's operations in RMSprop's
order:

1. ``g'``, from float32 copies where a float16 step is computed in float32
   (``psgld/dtypes``);
2. :func:`rmsprop_denominators`: RMSprop's :math:`V` and :math:`a = \sqrt{V} + \epsilon`;
3. :func:`_sampling_denominators`: :math:`V` stored, and at :math:`T > 0` :math:`a`
   replaced by the sampling preconditioner (``sampling_preconditioner``);
4. the direction: RMSprop's momentum buffer (:func:`_momentum_directions`), ``g'`` and
   :math:`a` apart for RMSprop's own last operation (``split``), or :math:`g'/a` and the
   noise (:func:`_noisy_directions`) with Li et al.'s :math:`\Gamma`
   (:func:`_corrected_directions`).

At temperature 0 without momentum the Optimizer takes RMSprop's last operation itself,
:func:`rmsprop_step_`, on the ``g'`` and :math:`a` a ``split`` call returns.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor

from ...names import member_dims
from ..sampling_preconditioner import advanced_each, prior_floor, released, sampling_scale
from ..tensor_lists import (
    add_scalar_,
    buckets,
    effective_grad,
    effective_grads,
    plus_scalar,
    scalar_operand,
)
from .dtypes import check_dtypes, lift, psgld_noise_scale
from .li_correction import corrected

__all__ = ["Settings", "directions", "rmsprop_denominators", "rmsprop_step_"]


@dataclasses.dataclass(frozen=True)
class Settings:
    """The hyperparameters and options of one ``psgld_direction`` call (its Args)."""

    lr: float
    alpha: float
    eps: float
    temperature: float
    num_data: int
    weight_decay: float
    maximize: bool
    foreach: bool
    momentum: float
    centered: bool
    inplace: bool
    split: bool
    preconditioner: str
    preconditioner_warmup: int | None


def directions(
    params: list[Tensor],
    grads: list[Tensor],
    square_avgs: list[Tensor],
    noise: list[Tensor] | None,
    settings: Settings,
    momentum_buffers: list[Tensor] | None,
    grad_avgs: list[Tensor | None] | None,
    previous: tuple[list[Tensor], list[Tensor]] | None,
    steps: list[Any] | None,
    preconditioners: list[Tensor | None] | None,
    frozen_at: list[Any] | None,
) -> tuple[list[Tensor], dict[str, list[Any]]]:
    """``psgld_direction``, its hyperparameters in ``settings``: its checks, then each bucket."""
    s = settings
    if (noise is None) != (s.temperature == 0):
        raise ValueError("noise must be given exactly when temperature > 0")
    check_dtypes(
        {tensor.dtype for tensor in (*params, *grads)},
        eps=s.eps,
        lr=s.lr,
        temperature=s.temperature,
        num_data=s.num_data,
    )
    scale = psgld_noise_scale(s.lr, s.temperature, s.num_data)
    count = len(grads)
    state: dict[str, list[Any]] = {
        "square_avg": list(square_avgs),
        "grad_avg": list([None] * count if grad_avgs is None else grad_avgs),
        "momentum_buffer": list(momentum_buffers) if momentum_buffers is not None else [],
        "previous_param": [],
        "previous_grad": [],
        "numerator": [None] * count,
        "denominator": [None] * count,
        "step": [],
        "preconditioner": list(preconditioners or [None] * count),
        "preconditioner_step": list(frozen_at or [0.0] * count),
    }
    if steps is not None:
        state["step"] = advanced_each(steps, s.inplace)
    if previous is not None:
        state["previous_param"], state["previous_grad"] = list(previous[0]), list(previous[1])
    out: list[Tensor] = list(grads)
    counted = steps is not None
    for index in buckets(params) if s.foreach else [[i] for i in range(len(params))]:
        _bucket(index, params, grads, noise, out, state, s, previous, scale=scale, counted=counted)
    return out, state


def _bucket(
    index: list[int],
    params: list[Tensor],
    grads: list[Tensor],
    noise: list[Tensor] | None,
    out: list[Tensor],
    state: dict[str, list[Any]],
    s: Settings,
    previous: tuple[list[Tensor], list[Tensor]] | None,
    *,
    scale: float,
    counted: bool,
) -> None:
    r"""One bucket's directions into ``out`` and its new state into ``state``.

    ``scale`` is the noise scale :math:`\sqrt{2T/(N\,lr)}`; ``counted``: whether the
    parameters' step counts are kept (``steps``), without which nothing is frozen.
    """
    # float16 at temperature > 0: computed in float32, rounded once at the end (psgld's doc)
    upcast = s.temperature > 0 and any(
        tensor.dtype == torch.float16 for i in index for tensor in (params[i], grads[i])
    )
    lifted = [lift(params[i], upcast and s.weight_decay != 0) for i in index]
    if s.foreach:
        gs, _ = effective_grads(
            [lift(grads[i], upcast) for i in index],
            lifted,
            weight_decay=s.weight_decay,
            maximize=s.maximize,
        )
        gs = list(gs)
    else:
        gs = [
            effective_grad(
                lift(grads[i], upcast), param, weight_decay=s.weight_decay, maximize=s.maximize
            )
            for i, param in zip(index, lifted, strict=True)
        ]
    avgs = _sampling_denominators(index, params, gs, upcast, state, s, counted=counted)
    if s.temperature == 0 and s.momentum > 0:
        for i, buffer in zip(index, _momentum_directions(index, gs, avgs, state, s), strict=True):
            out[i] = buffer
        return
    if s.temperature == 0 and s.split:
        for position, i in enumerate(index):
            state["numerator"][i] = gs[position]
            state["denominator"][i] = avgs[position]
        return
    ds = _noisy_directions(index, gs, avgs, noise, upcast, s, scale)
    if previous is not None and s.temperature > 0:
        ds = _corrected_directions(index, params, ds, gs, avgs, previous, state, s)
    for position, i in enumerate(index):
        direction = ds[position]
        out[i] = direction.to(grads[i].dtype) if upcast else direction


def rmsprop_denominators(
    grads: list[Tensor],
    square_avgs: list[Tensor],
    grad_avgs: list[Tensor | None],
    *,
    alpha: float,
    eps: float,
    centered: bool,
    foreach: bool,
    inplace: bool,
) -> tuple[list[Tensor], list[Tensor], list[Tensor | None]]:
    r"""RMSprop's ``avg`` (new tensors) and new second moments, in RMSprop's operations.

    .. math::

        V \leftarrow \alpha V + (1-\alpha)\, g'^2, \qquad a = \sqrt{V} + \epsilon,

    and with ``centered`` :math:`\bar g \leftarrow \alpha \bar g + (1-\alpha)\, g'` (a
    ``lerp``) and :math:`a = \sqrt{V - \bar g^2} + \epsilon`. Returns ``(a, V, \bar g)``.
    """
    new_grad_avgs: list[Tensor | None]
    if not foreach:
        avgs, new_squares, new_grad_avgs = [], [], []
        for i, grad in enumerate(grads):
            square = square_avgs[i] if inplace else square_avgs[i].clone()
            square.mul_(alpha).addcmul_(grad, grad, value=1 - alpha)
            grad_avg = grad_avgs[i]
            if centered:
                assert grad_avg is not None
                grad_avg = grad_avg if inplace else grad_avg.clone()
                grad_avg.lerp_(grad, 1 - alpha)
                avg = square.addcmul(grad_avg, grad_avg, value=-1)
                avg = avg.sqrt_() if inplace else avg.sqrt()
            else:
                avg = square.sqrt()
            # in place where no graph is kept (the sqrt's backward needs its output)
            avgs.append(avg.add_(eps) if inplace else avg.add(eps))
            new_squares.append(square)
            new_grad_avgs.append(grad_avg)
        return avgs, new_squares, new_grad_avgs
    squares = square_avgs if inplace else [square.clone() for square in square_avgs]
    torch._foreach_mul_(squares, scalar_operand(alpha, squares[0]))
    torch._foreach_addcmul_(squares, grads, grads, value=1 - alpha)
    if centered:
        means = [avg for avg in grad_avgs if avg is not None]
        means = means if inplace else [avg.clone() for avg in means]
        torch._foreach_lerp_(means, grads, 1 - alpha)
        avgs = list(torch._foreach_addcmul(squares, means, means, value=-1))
        if inplace:
            torch._foreach_sqrt_(avgs)
        else:
            avgs = list(torch._foreach_sqrt(avgs))
        new_grad_avgs = list(means)
    else:
        avgs = list(torch._foreach_sqrt(squares))
        new_grad_avgs = list(grad_avgs)
    # in place where no graph is kept (the sqrt's backward needs its output)
    if inplace:
        add_scalar_(avgs, eps)
    else:
        avgs = plus_scalar(avgs, eps)
    return avgs, list(squares), new_grad_avgs


def rmsprop_step_(
    params: list[Tensor],
    numerators: list[Tensor],
    denominators: list[Tensor],
    *,
    lr: float,
    foreach: bool,
) -> None:
    """RMSprop's last operation at temperature 0, ``param.addcdiv_(g', a, value=-lr)``.

    ``g'`` and :math:`a` are the ``"numerator"`` and ``"denominator"`` a ``split`` call
    returns; per tensor, or per (device, dtype) bucket with ``foreach``, as RMSprop.
    """
    if not foreach:
        for param, numerator, denominator in zip(params, numerators, denominators, strict=True):
            param.addcdiv_(numerator, denominator, value=-lr)
        return
    for index in buckets(params):
        torch._foreach_addcdiv_(
            [params[i] for i in index],
            [numerators[i] for i in index],
            [denominators[i] for i in index],
            value=-lr,
        )


def _sampling_denominators(
    index: list[int],
    params: list[Tensor],
    gs: list[Tensor],
    upcast: bool,
    state: dict[str, list[Any]],
    s: Settings,
    *,
    counted: bool,
) -> list[Tensor]:
    """The bucket's :math:`a` and new :math:`V`: RMSprop's, or the sampling one at T > 0.

    :math:`V` (:func:`rmsprop_denominators`) is stored, rounded to the parameter's dtype
    where it was computed in float32. At temperature > 0 :math:`a` is the sampling
    preconditioner (``sampling_preconditioner.sampling_scale``: :math:`V` pooled,
    frozen after the warm-up of the step counts, none without ``steps``); at temperature
    0 it is RMSprop's own and any freeze is released.
    """
    avgs, squares, means = rmsprop_denominators(
        gs,
        [lift(state["square_avg"][i], upcast) for i in index],
        [state["grad_avg"][i] for i in index],
        alpha=s.alpha,
        eps=s.eps,
        centered=s.centered,
        foreach=s.foreach,
        inplace=s.inplace,
    )
    for position, i in enumerate(index):
        square, kept = squares[position], state["square_avg"][i]
        if square.dtype != kept.dtype:  # computed in float32, kept rounded
            square = kept.copy_(square) if s.inplace else square.to(kept.dtype)
        state["square_avg"][i] = square
        state["grad_avg"][i] = means[position]
        if s.temperature == 0:
            state["preconditioner_step"][i] = released(state["preconditioner_step"][i], s.inplace)
            continue
        # the sampling preconditioner: pooled, frozen after the warm-up
        step = float(state["step"][i]) if counted else 0.0
        sampled, state["preconditioner"][i], state["preconditioner_step"][i] = sampling_scale(
            squares[position],
            state["preconditioner"][i],
            state["preconditioner_step"][i],
            step,
            correction=1.0,
            eps=s.eps,
            how=s.preconditioner,
            warmup=s.preconditioner_warmup if counted else None,
            inplace=s.inplace,
            members=member_dims(params[i]),
            floor=prior_floor(s.temperature, s.weight_decay, s.num_data),
        )
        if sampled.shape != gs[position].shape:
            sampled = sampled.expand_as(gs[position])
        avgs[position] = sampled
    return avgs


def _momentum_directions(
    index: list[int], gs: list[Tensor], avgs: list[Tensor], state: dict[str, list[Any]], s: Settings
) -> list[Tensor]:
    r"""RMSprop's momentum at temperature 0: :math:`b \leftarrow \mu b + g'/a`, the directions."""
    assert state["momentum_buffer"]  # given when momentum > 0
    bufs = [state["momentum_buffer"][i] for i in index]
    bufs = bufs if s.inplace else [buf.clone() for buf in bufs]
    if s.foreach:
        torch._foreach_mul_(bufs, scalar_operand(s.momentum, bufs[0]))
        torch._foreach_addcdiv_(bufs, gs, avgs)
    else:
        for buf, grad, avg in zip(bufs, gs, avgs, strict=True):
            buf.mul_(s.momentum).addcdiv_(grad, avg)
    for position, i in enumerate(index):
        state["momentum_buffer"][i] = bufs[position]
    return bufs


def _noisy_directions(
    index: list[int],
    gs: list[Tensor],
    avgs: list[Tensor],
    noise: list[Tensor] | None,
    upcast: bool,
    s: Settings,
    scale: float,
) -> list[Tensor]:
    r""":math:`d = g'/a + \sqrt{2T/(N\,lr)}\;\xi/\sqrt{a}` (no noise at temperature 0).

    The noise variance follows the preconditioner; there is none where :math:`a` has no
    scale (:math:`a = \epsilon`, ``sampling_preconditioner``).
    """
    if s.foreach:
        ds = list(torch._foreach_div(gs, avgs))
    else:
        ds = [grad.div(avg) for grad, avg in zip(gs, avgs, strict=True)]
    if noise is not None and s.foreach:  # the same operations, on lists
        kicks = torch._foreach_div(
            [lift(noise[i], upcast) for i in index], torch._foreach_sqrt(avgs)
        )
        for kick, avg in zip(kicks, avgs, strict=True):
            kick.masked_fill_(avg == s.eps, 0.0)
        torch._foreach_add_(ds, kicks, alpha=scale)
    elif noise is not None:
        for d, avg, i in zip(ds, avgs, index, strict=True):
            kick = lift(noise[i], upcast).div(avg.sqrt()).masked_fill(avg == s.eps, 0.0)
            d.add_(kick, alpha=scale)
    return ds


def _corrected_directions(
    index: list[int],
    params: list[Tensor],
    ds: list[Tensor],
    gs: list[Tensor],
    avgs: list[Tensor],
    previous: tuple[list[Tensor], list[Tensor]],
    state: dict[str, list[Any]],
    s: Settings,
) -> list[Tensor]:
    r""":math:`d - (T/N)\,\Gamma` (Li et al., Eq. 4), and the secant's next end.

    :math:`\Gamma` is ``psgld/li_correction``'s.

    :math:`\Gamma` is estimated by the secant from ``previous`` (the parameters and ``g'``
    of the last step) to now; this step's are kept in ``state`` for the next.
    """
    squares_now = [state["square_avg"][i] for i in index]
    ds = corrected(
        ds,
        gs,
        avgs,
        squares_now,
        params,
        previous,
        index,
        alpha=s.alpha,
        temperature=s.temperature,
        num_data=s.num_data,
    )
    for position, i in enumerate(index):
        if s.inplace:
            state["previous_param"][i].copy_(params[i])
            state["previous_grad"][i].copy_(gs[position])
        else:
            state["previous_param"][i] = params[i].detach().clone()
            kept = gs[position].detach()
            dtype = previous[1][i].dtype
            kept = kept.to(dtype) if kept.dtype != dtype else kept.clone()
            state["previous_grad"][i] = kept
    return ds
