r"""BAOA, the splitting integrator of underdamped Langevin dynamics (Leimkuhler & Matthews).

Derivation. Target :math:`p_T(\theta) \propto \exp(-U(\theta)/T)` with :math:`U = N L`
(docs/design.md), extended by a momentum :math:`r \sim \mathcal N(0, T I)` (unit mass). The
Langevin dynamics :math:`d\theta = r\,dt`, :math:`dr = -\nabla U\,dt - \gamma r\,dt +
\sqrt{2\gamma T}\,dW` split into a kick B (:math:`r \leftarrow r - \epsilon \nabla U`), a
drift A (:math:`\theta \leftarrow \theta + \epsilon r`) and the exact Ornstein--Uhlenbeck
step O (:math:`r \leftarrow c\, r + \sqrt{(1-c^2)T}\,\xi`, :math:`c = e^{-\gamma\epsilon}`).
One BAOA step is a full kick, half a drift, O, half a drift:

.. math::

    r \leftarrow r - \epsilon N g', \quad
    \theta \leftarrow \theta + \tfrac{\epsilon}{2} r, \quad
    r \leftarrow c\, r + \sqrt{(1-c^2)\,T}\;\xi, \quad
    \theta \leftarrow \theta + \tfrac{\epsilon}{2} r.

It is BAOAB (Leimkuhler & Matthews 2013; 2015, §7.3) with the closing half kick of one
step merged with the opening half kick of the next: the positions are BAOAB's, one
gradient per step. In the units of the other samplers (:mod:`.sghmc`): :math:`\epsilon =
\sqrt{lr/N}`, :math:`r = -\sqrt{N\,lr}\; b` and :math:`\mu = c` (``momentum``, the
fraction of the momentum the O step keeps), so

.. math::

    v &= b + g', \\
    b &\leftarrow \mu\, v + \sqrt{(1-\mu^2)\, T / (N\, lr)}\;\xi, \\
    \theta &\leftarrow \theta - lr\, (v + b)/2,

with :math:`b` starting at 0. The friction is :math:`\gamma = -\ln\mu/\epsilon`.

The exact law on a Gaussian. With :math:`U` quadratic of Hessian :math:`P`, each
eigen-mode :math:`\lambda` of :math:`P` is a linear chain in :math:`(x, b)`; its
stationary position variance is exactly :math:`T/\lambda` for every stable step
(the transition has determinant :math:`\mu` and trace :math:`1 + \mu - h(1+\mu)/2`
with :math:`h = lr\,\lambda/N`, stable exactly when :math:`h < 4`): BAOAB samples the
positions of a Gaussian without step-size bias (Leimkuhler & Matthews 2013), and the
bias lands on the momentum instead. ``tests/test_baoa.py`` computes the exact law of the
chain (a Lyapunov equation) and checks the samples against it.

The temperature-0 limit. At :math:`T = 0`, :math:`v_t = \mu v_{t-1} + g'_t` is
``torch.optim.SGD``'s momentum buffer (the first :math:`v` is :math:`g'`, as SGD's) and the
step is :math:`\theta \leftarrow \theta - lr\,\tfrac{1+\mu}{2}\, v`: BAOA at temperature 0
is ``torch.optim.SGD(lr * (1 + momentum) / 2, momentum)``, the same iterates up to
rounding (not bit for bit: the half drifts are two roundings).

Changing the learning rate. As for SGHMC, the physical momentum
:math:`r = -\sqrt{N\,lr}\; b` is kept: :math:`b \leftarrow \sqrt{lr_0/lr_1}\, b` when ``lr``
moves from :math:`lr_0` to :math:`lr_1` at :math:`T > 0`
(:func:`.sghmc.rescale_momentum`); at :math:`T = 0` nothing is rescaled.

posteriors' ``sgmcmc.baoa`` parametrises the same integrator by the step
:math:`\epsilon_p` on the log posterior, a friction :math:`\alpha_p` and a momentum
scale :math:`\sigma`; with :math:`\sigma = 1` and its log posterior the sum over the data,
:math:`\epsilon_p = \sqrt{lr/N}` and :math:`\mu = e^{-\alpha_p\epsilon_p}`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from ...core.validation import check_momentum
from ..definition import (
    Hyperparameter,
    SamplerDefinition,
    StateField,
    UpdateInput,
    UpdateOutput,
    zeros_like_param,
)
from ..definition.arguments import DAMPENING, NESTEROV, pick, sampling_meaningless, sgd_signature
from ..definition.noise_scales import baoa_noise_scale
from ..optimizer import SamplerOptimizer
from ..temperature.rule import TemperatureRule, UnitMass
from ..tensor_lists import bucketed_grads, effective_grad, scalar_operand

__all__ = ["BAOA", "DEFINITION", "baoa_direction", "baoa_noise_scale"]


def baoa_direction(
    params: list[Tensor],
    grads: list[Tensor],
    momentum_buffers: list[Tensor],
    noise: list[Tensor] | None,
    *,
    lr: float,
    momentum: float,
    temperature: float,
    num_data: int,
    weight_decay: float,
    maximize: bool,
    foreach: bool,
    inplace: bool = True,
) -> tuple[list[Tensor], list[Tensor]]:
    r"""BAOA's pure kernel: the new buffers and the directions :math:`d = (v + b)/2`.

    .. math::

        v = b + g', \qquad b \leftarrow \mu\, v + \sqrt{(1-\mu^2)T/(N\,lr)}\;\xi, \qquad
        d = (v + b) / 2,

    the step being :math:`\theta \leftarrow \theta - lr\, d`.

    Args:
        params: the parameters (read only, for weight decay).
        grads: their gradients (never modified).
        momentum_buffers: one buffer :math:`b` per parameter (zeros at the start).
        noise: standard-normal :math:`\xi` per parameter; None exactly when T is 0.
        lr: learning rate, > 0 when ``temperature`` > 0.
        momentum: :math:`\mu \in [0, 1)`, the O step's :math:`e^{-\gamma\epsilon}`.
        temperature: T >= 0.
        num_data: N.
        weight_decay: as in ``torch.optim.SGD``.
        maximize: as in ``torch.optim.SGD``.
        foreach: multi-tensor path; the single-tensor loop is the reference.
        inplace: update the given buffers in place (Optimizer) or return new ones.

    Returns:
        ``(directions, momentum_buffers)``.
    """
    if (noise is None) != (temperature == 0):
        raise ValueError("noise must be given exactly when temperature > 0")
    scale = baoa_noise_scale(lr, momentum, temperature, num_data)
    directions: list[Tensor]
    buffers: list[Tensor]
    if not foreach:
        directions, buffers = [], []
        for i, (param, grad) in enumerate(zip(params, grads, strict=True)):
            grad = effective_grad(grad, param, weight_decay=weight_decay, maximize=maximize)
            velocity = momentum_buffers[i].add(grad)  # v = b + g' (kick)
            buffer = velocity.mul(momentum)  # O: b = mu v + s xi
            if noise is not None:
                buffer.add_(noise[i], alpha=scale)
            if inplace:
                buffer = momentum_buffers[i].copy_(buffer)
            directions.append(velocity.add_(buffer).mul_(0.5))  # two half drifts
            buffers.append(buffer)
        return directions, buffers
    directions = list(grads)
    buffers = list(momentum_buffers)
    for index, bucket_grads, _ in bucketed_grads(
        params, grads, weight_decay=weight_decay, maximize=maximize
    ):
        old = [momentum_buffers[i] for i in index]
        velocities = list(torch._foreach_add(old, bucket_grads))
        new = list(torch._foreach_mul(velocities, scalar_operand(momentum, old[0])))
        if noise is not None:
            torch._foreach_add_(new, [noise[i] for i in index], alpha=scale)
        if inplace:
            torch._foreach_copy_(old, new)
            new = old
        torch._foreach_add_(velocities, new)
        torch._foreach_mul_(velocities, scalar_operand(0.5, old[0]))
        for position, i in enumerate(index):
            buffers[i] = new[position]
            directions[i] = velocities[position]
    return directions, buffers


def _check(group: Mapping[str, Any], temperature: float, where: str) -> None:
    sampling_meaningless("nesterov", group["nesterov"], False, temperature, where)
    sampling_meaningless("dampening", group["dampening"], 0, temperature, where)
    for name, neutral in (("dampening", 0), ("nesterov", False)):
        if group[name] != neutral:
            raise ValueError(
                f"{name}={group[name]!r}{where} is not supported by BAOA (accepted for "
                "torch.optim.SGD's signature; at temperature 0 BAOA is SGD with lr * (1 + "
                "momentum) / 2: use torch.optim.SGD for this setting)"
            )


def _update(
    group: Mapping[str, Any], inputs: UpdateInput, *, foreach: bool, inplace: bool
) -> UpdateOutput:
    # every parameter has a buffer: the state field's init
    momentum_buffers = [
        buffer for buffer in inputs.buffers["momentum_buffer"] if buffer is not None
    ]
    keys = ("lr", "momentum", "temperature", "num_data", "weight_decay", "maximize")
    directions, new = baoa_direction(
        inputs.params,
        inputs.grads,
        momentum_buffers,
        inputs.noise,
        **pick(group, *keys),
        foreach=foreach,
        inplace=inplace,
    )
    return directions, {"momentum_buffer": list(new)}


MOMENTUM = Hyperparameter(
    "momentum",
    default=0.9,
    doc=r"""momentum: :math:`\mu = e^{-\gamma\epsilon}`, the fraction of
            the momentum the O step keeps (default: 0.9; in [0, 1)). 0 refreshes the
            momentum every step.""",
    transform_doc=r"""momentum: :math:`\mu` (default: 0.9; in [0, 1)).""",
    check=lambda value, where: check_momentum(value, where=where),
    positional=True,
)


DEFINITION = SamplerDefinition(
    name="BAOA",
    transform_name="baoa",
    hyperparameters=sgd_signature(
        MOMENTUM,
        dampening=DAMPENING.replace(
            doc=r"""dampening: must be 0 (accepted for ``torch.optim.SGD``'s
            signature).""",
            transform_doc=r"""dampening: must be 0 (accepted for ``torchopt.sgd``'s
            signature).""",
        ),
        nesterov=NESTEROV.replace(
            doc=r"""nesterov: must be False (accepted for ``torch.optim.SGD``'s
            signature).""",
            transform_doc=r"""nesterov: must be False (accepted for ``torchopt.sgd``'s
            signature).""",
        ),
    ),
    state=(
        StateField(
            "momentum_buffer",
            "one buffer :math:`b` per leaf of the params tree, starting at 0.",
            init=zeros_like_param,
        ),
    ),
    update=_update,
    temperature_rule=TemperatureRule("baoa", kinetic=UnitMass()),
    example="lr=1e-3, momentum=0.9",
    check=_check,
    momentum_in_lr_units=True,
    optimizer_doc=r"""The BAOA splitting integrator of Langevin dynamics (Leimkuhler & Matthews).

    Each step is one transition of the Markov chain

    .. math::

        g' = \pm g + \lambda\,\theta, \qquad v = b + g', \qquad
        b \leftarrow \mu\, v + \sqrt{{(1-\mu^2)\, T / (N\, lr)}}\;\xi, \qquad
        \theta \leftarrow \theta - lr\, (v + b) / 2,

    with :math:`g` = ``p.grad`` (the gradient of the mean minibatch loss), :math:`\mu` =
    ``momentum``, :math:`\lambda` = ``weight_decay``, :math:`T` = ``temperature``,
    :math:`N` = ``num_data``, :math:`\xi \sim \mathcal N(0, I)`, the sign negative when
    ``maximize``; the buffer :math:`b` starts at 0. This is a full kick (B), half a drift
    (A), an exact Ornstein--Uhlenbeck step keeping the fraction :math:`\mu` of the
    momentum (O) and half a drift (A), with step :math:`\epsilon = \sqrt{{lr/N}}` and
    momentum :math:`r = -\sqrt{{N\,lr}}\, b`. On a Gaussian target its positions have
    the exact stationary law at any stable step (no step-size bias). When ``lr`` changes at
    :math:`T > 0` the buffer is rescaled by :math:`\sqrt{{lr_{{\text{{old}}}}/lr}}`,
    keeping :math:`r`, as :class:`SGHMC` does. At ``temperature=0`` it is
    ``torch.optim.SGD(lr * (1 + momentum) / 2, momentum)`` up to rounding (module
    docstring of :mod:`samplers_as_optim.sgmcmc.baoa`).

    {arguments}

    {example}

    Note:
        posteriors' ``baoa`` has step :math:`\epsilon_p`, friction :math:`\alpha_p` and
        momentum scale :math:`\sigma`; with :math:`\sigma = 1` and a summed log
        posterior, :math:`\epsilon_p = \sqrt{{lr/N}}` and :math:`\mu = e^{{-\alpha_p
        \epsilon_p}}`. The noise variance is multiplied by ``temperature``.

    References:
        Leimkuhler, B. & Matthews, C. (2013). Rational construction of stochastic
        numerical methods for molecular sampling. AMRX, Eq. (17) (BAOAB). Leimkuhler, B.
        & Matthews, C. (2015). Molecular Dynamics, §7.3, p. 271.
    """,
    transform_doc=r"""The BAOA Langevin integrator as a torchopt transformation.

    The same chain as :class:`BAOA`, computed by the same kernel: each update is

    .. math::

        v = b + g', \qquad b \leftarrow \mu\, v + \sqrt{{(1-\mu^2)\, T / (N\, lr)}}\;\xi,
        \qquad u = -lr\, (v + b) / 2,

    to be added to the parameters (``torchopt.apply_updates``), with :math:`g'` the
    incoming updates (plus weight decay, negated when ``maximize``). When a schedule
    changes ``lr`` at temperature > 0 the buffer is first rescaled as :class:`BAOA` does.

    {arguments}

    Example:
        >>> import torch, torchopt
        >>> from samplers_as_optim import transforms
        >>> params = {{"w": torch.zeros(2)}}
        >>> tx = transforms.baoa(0.1, momentum=0.5, num_data=100, temperature=0.0)
        >>> state = tx.init(params)
        >>> updates, state = tx.update({{"w": torch.ones(2)}}, state, params=params)
        >>> updates["w"]  # SGD's first step with lr 0.1 * (1 + 0.5) / 2
        tensor([-0.0750, -0.0750])

    References:
        Leimkuhler, B. & Matthews, C. (2015). Molecular Dynamics, §7.3, p. 271.
    """,
)


class BAOA(SamplerOptimizer, definition=DEFINITION):
    """The BAOA Langevin integrator as an optimizer (full docstring: ``DEFINITION``)."""
