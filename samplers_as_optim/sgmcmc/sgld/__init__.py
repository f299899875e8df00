r"""Stochastic gradient Langevin dynamics (Welling & Teh, 2011) in SGD units.

Derivation. With the mean minibatch loss :math:`L` (its prior term divided by N, as in
docs/design.md) the tempered target is :math:`p_T(\theta) \propto \exp(-N L(\theta) / T)`.
The overdamped Langevin SDE with that stationary law is

.. math::

    d\theta = -N \nabla L(\theta)\, dt + \sqrt{2 T}\, dW.

Euler--Maruyama with step :math:`h` gives
:math:`\theta \leftarrow \theta - h N g + \sqrt{2 T h}\,\xi`. Choosing :math:`h = lr / N`
makes the drift exactly SGD's step:

.. math::

    \theta \leftarrow \theta - lr\, g + \sqrt{2\, lr\, T / N}\;\xi,
    \qquad \xi \sim \mathcal N(0, I).

At :math:`T = 0` this is ``torch.optim.SGD(lr)``. Welling & Teh (2011), Eq. (4), write
:math:`\Delta\theta = \tfrac{\epsilon}{2}\nabla \log p + \eta`, :math:`\eta \sim
\mathcal N(0, \epsilon)`: the same update with :math:`\epsilon = 2\, lr / N` and their
noise variance multiplied by :math:`T`.

Implementation. The kernel returns the direction :math:`d = g' - c\,\xi`, with
:math:`c = \sqrt{2 T / (N\, lr)}`, and the caller steps :math:`\theta \leftarrow \theta -
lr\, d`, which is the update above (see ``tensor_lists.apply_step_`` for how the two front
ends round it: SGD's fused ``add_(d, alpha=-lr)`` at T = 0, torchopt's ``p + (-lr d)`` at
T > 0). For a Gaussian target the stationary covariance of the discrete chain is
:math:`T\,(H (I - h H / 2))^{-1}` with :math:`H` the Hessian of :math:`N L` and
:math:`h = lr / N`: the step-size bias the statistical tests account for.

Fused. ``sgld/triton_kernel`` holds the same update as one Triton kernel per tensor (its
definition's ``fused_kernel``), which the Optimizer takes on CUDA (``fused``): the same
chain in law, but its :math:`\xi` comes from the fused noise stream (Triton's Philox keyed
by seed, step, parameter and element; ``sgmcmc/fused``), not from the keyed blocks of
``torch.randn`` the unfused update is given, and it rounds as
``torch.optim.SGD(fused=True)`` does, which it is at :math:`T = 0`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from ..definition import Hyperparameter, SamplerDefinition, UpdateInput, UpdateOutput
from ..definition.arguments import NESTEROV, pick, sampling_meaningless, sgd_signature
from ..optimizer import SamplerOptimizer
from ..temperature.rule import LANGEVIN
from ..tensor_lists import bucketed_grads, effective_grad

__all__ = ["DEFINITION", "SGLD", "sgld_direction", "sgld_noise_scale"]


def sgld_noise_scale(lr: float, temperature: float, num_data: int) -> float:
    r"""Standard deviation of SGLD's noise per step in parameter units, :math:`\sqrt{2\,lr\,T/N}`.

    The kernel adds it as :math:`lr \cdot c\,\xi` with :math:`c = \sqrt{2T/(N\,lr)}`.
    """
    return math.sqrt(2.0 * lr * temperature / num_data)


def sgld_direction(
    params: list[Tensor],
    grads: list[Tensor],
    noise: list[Tensor] | None,
    *,
    lr: float,
    temperature: float,
    num_data: int,
    weight_decay: float,
    maximize: bool,
    foreach: bool,
) -> list[Tensor]:
    r"""SGLD's pure kernel: the directions :math:`d = g' - \sqrt{2T/(N\,lr)}\,\xi`.

    The step is :math:`\theta \leftarrow \theta - lr\, d`. Nothing passed in is modified.

    Args:
        params: the parameters (read only, for weight decay).
        grads: their gradients :math:`\nabla L`.
        noise: standard-normal :math:`\xi`, one tensor per parameter; None exactly when
            ``temperature`` is 0.
        lr: learning rate, > 0 when ``temperature`` > 0.
        temperature: T >= 0.
        num_data: N.
        weight_decay: as in ``torch.optim.SGD``.
        maximize: as in ``torch.optim.SGD``.
        foreach: multi-tensor path; the single-tensor loop is the reference.

    Returns:
        One direction tensor per parameter.
    """
    if (noise is None) != (temperature == 0):
        raise ValueError("noise must be given exactly when temperature > 0")
    scale = math.sqrt(2.0 * temperature / (num_data * lr)) if noise is not None else 0.0
    if not foreach:
        single: list[Tensor] = []
        for i, (param, grad) in enumerate(zip(params, grads, strict=True)):
            direction = effective_grad(grad, param, weight_decay=weight_decay, maximize=maximize)
            if noise is not None:
                direction = direction.add(noise[i], alpha=-scale)
            single.append(direction)
        return single

    directions: list[Tensor] = [grads[0]] * len(grads)
    for index, bucket, owned in bucketed_grads(
        params, grads, weight_decay=weight_decay, maximize=maximize
    ):
        if noise is not None:
            bucket_noise = [noise[i] for i in index]
            if owned:
                torch._foreach_add_(bucket, bucket_noise, alpha=-scale)
            else:
                bucket = list(torch._foreach_add(bucket, bucket_noise, alpha=-scale))
        for i, direction in zip(index, bucket, strict=True):
            directions[i] = direction
    return directions


def _refuse_momentum(value: Any, where: str) -> None:
    # momentum is accepted (SGD's signature) but kept out of the param groups, so that
    # OneCycleLR/CyclicLR(cycle_momentum=True) fail when built, not at the first step
    if value != 0:
        raise ValueError(
            f"Invalid momentum{where}: {value!r} (expected 0: SGLD has no momentum; use "
            "SGHMC for momentum > 0)"
        )


def _check(group: Mapping[str, Any], temperature: float, where: str) -> None:
    if group["nesterov"]:
        raise ValueError(
            f"nesterov=True{where} requires momentum > 0 (as in torch.optim.SGD); use SGHMC "
            "for momentum"
        )
    sampling_meaningless("dampening", group["dampening"], 0, temperature, where)


def _update(
    group: Mapping[str, Any], inputs: UpdateInput, *, foreach: bool, inplace: bool
) -> UpdateOutput:
    keys = ("lr", "temperature", "num_data", "weight_decay", "maximize")
    return sgld_direction(
        inputs.params, inputs.grads, inputs.noise, **pick(group, *keys), foreach=foreach
    ), {}


MOMENTUM = Hyperparameter(
    "momentum",
    default=0.0,
    doc=r"""momentum: must be 0 (SGLD has no momentum; use
            :class:`SGHMC`). Accepted so that the signature is ``torch.optim.SGD``'s.""",
    transform_doc=r"""momentum: must be 0 (SGLD has no momentum; use
            :func:`sghmc`). Accepted so that the signature is ``torchopt.sgd``'s.""",
    check=_refuse_momentum,
    positional=True,
    kept=False,
)


DEFINITION = SamplerDefinition(
    name="SGLD",
    transform_name="sgld",
    hyperparameters=sgd_signature(
        MOMENTUM,
        nesterov=NESTEROV.replace(
            doc=r"""nesterov: must be False (it needs momentum).""", transform_doc=None
        ),
    ),
    state=(),
    update=_update,
    temperature_rule=LANGEVIN,
    example="lr=1e-3",
    check=_check,
    optimizer_doc=r"""Stochastic gradient Langevin dynamics, a drop-in for ``torch.optim.SGD``.

    Each step is one transition of the Markov chain

    .. math::

        g' = \pm g + \lambda\,\theta, \qquad
        \theta \leftarrow \theta - lr\, g' + \sqrt{{2\, lr\, T / N}}\;\xi,
        \qquad \xi \sim \mathcal N(0, I),

    with :math:`g` = ``p.grad`` (the gradient of the mean minibatch loss),
    :math:`\lambda` = ``weight_decay``, :math:`T` = ``temperature``, :math:`N` =
    ``num_data``, the sign negative when ``maximize``. Its stationary law is
    :math:`\propto \exp(-N L(\theta)/T)` up to step-size bias; at ``temperature=0`` it is
    ``torch.optim.SGD(lr, weight_decay=..., maximize=...)`` bit for bit.

    {arguments}

    {example}

    Note:
        Welling & Teh (2011) use the step :math:`\epsilon = 2\,lr/N` on the summed log
        posterior; here ``lr`` is SGD's learning rate on the mean loss, and the noise
        variance is multiplied by ``temperature``.

    References:
        Welling, M. & Teh, Y. W. (2011). Bayesian learning via stochastic gradient
        Langevin dynamics. ICML. Eq. (4).
    """,
    transform_doc=r"""Stochastic gradient Langevin dynamics as a torchopt gradient transformation.

    The same chain as :class:`SGLD`, computed by the same kernel: each update is

    .. math::

        g' = \pm g + \lambda\,\theta, \qquad
        u = -lr\, g' + \sqrt{{2\, lr\, T / N}}\;\xi, \qquad \xi \sim \mathcal N(0, I),

    to be added to the parameters (``torchopt.apply_updates``), with :math:`g` the
    incoming updates (the gradient of the mean minibatch loss), :math:`\theta` =
    ``params``, :math:`\lambda` = ``weight_decay``, :math:`T` = ``temperature``,
    :math:`N` = ``num_data``, the sign negative when ``maximize``. The noise of update
    :math:`k` is drawn from ``seed`` and :math:`k` alone (both in the state).

    {arguments}

    Example:
        >>> import torch, torchopt
        >>> from samplers_as_optim import transforms
        >>> params = {{"w": torch.zeros(3)}}
        >>> tx = transforms.sgld(0.1, num_data=100, seed=0)
        >>> state = tx.init(params)
        >>> grads = {{"w": torch.ones(3)}}
        >>> updates, state = tx.update(grads, state, params=params, inplace=False)
        >>> params = torchopt.apply_updates(params, updates, inplace=False)
        >>> state.count
        1
        >>> again, _ = tx.update(grads, tx.init(params), inplace=False)
        >>> torch.equal(updates["w"], again["w"])  # the noise is a function of (seed, count)
        True

    Note:
        With one seed, the chain is :class:`SGLD`'s bit for bit, leaf by parameter:
        a list of tensors matches an optimizer given the same tensors in order, a dict
        (``dict(model.named_parameters())``) one given ``model.named_parameters()``
        (the noise is keyed by index, or by name). At
        ``temperature=0`` the update is ``torchopt.sgd``'s bit for bit; it equals
        ``torch.optim.SGD``'s step up to one rounding, because ``torch.optim.SGD`` adds
        :math:`-lr\, g'` in one fused multiply-add.

    References:
        Welling, M. & Teh, Y. W. (2011). Bayesian learning via stochastic gradient
        Langevin dynamics. ICML. Eq. (4).
    """,
)


class SGLD(SamplerOptimizer, definition=DEFINITION):
    """SGLD, a drop-in for ``torch.optim.SGD`` (full docstring: ``DEFINITION``)."""
