r"""Stochastic gradient Hamiltonian Monte Carlo (Chen et al., 2014) in SGD units.

Derivation. Target :math:`p_T(\theta) \propto \exp(-U(\theta)/T)` with :math:`U = N L`
(docs/design.md), extended by a momentum :math:`r \sim \mathcal N(0, T I)`. The SGHMC SDE with
friction :math:`C` (unit mass, the gradient-noise estimate :math:`\hat B` set to 0) is

.. math::

    d\theta = r\,dt, \qquad
    dr = -\nabla U(\theta)\,dt - C r\,dt + \sqrt{2 C T}\,dW,

whose stationary law is :math:`\exp(-(U(\theta) + |r|^2/2)/T)`. One Euler step of size
:math:`\epsilon` (momentum first, then position with the new momentum) reads
:math:`r' = (1 - \epsilon C) r - \epsilon N g + \sqrt{2 C T \epsilon}\,\xi`,
:math:`\theta' = \theta + \epsilon r'`. Substitute :math:`r = -(lr/\epsilon)\, b` with
SGD's buffer :math:`b`:

.. math::

    b' = (1 - \epsilon C)\, b + \frac{\epsilon^2 N}{lr}\, g
         - \frac{\epsilon}{lr}\sqrt{2 C T \epsilon}\;\xi, \qquad \theta' = \theta - lr\, b'.

Choosing :math:`\epsilon = \sqrt{lr/N}` makes the gradient coefficient 1, and
:math:`\mu = 1 - \epsilon C` (friction :math:`C = (1-\mu)/\epsilon`) makes the first
term torch's momentum. The noise becomes :math:`\sqrt{2(1-\mu) T / (N\, lr)}`
(the sign of :math:`\xi` is immaterial), so

.. math::

    b \leftarrow \mu\, b + g' + \sqrt{2 (1-\mu) T / (N\, lr)}\;\xi, \qquad
    \theta \leftarrow \theta - lr\, b.

At :math:`T = 0` this is ``torch.optim.SGD(lr, momentum=mu)``: the kernel runs SGD's
operations in SGD's order (the buffer starts as a copy of the first gradient) and adds
the noise only when :math:`T > 0`. Chen et al. (2014), Eq. (15), write
:math:`\Delta\theta = v`, :math:`\Delta v = -\eta\nabla\tilde U - \alpha v +
\mathcal N(0, 2(\alpha - \hat\beta)\eta)`: the same update with :math:`v = -lr\, b`,
:math:`\eta = lr / N`, :math:`\alpha = 1 - \mu`, :math:`\hat\beta = 0` and the noise
variance multiplied by :math:`T`.

With ``momentum=0`` (friction :math:`1/\epsilon`, the momentum refreshed every step)
SGHMC is SGLD, and the kernel calls SGLD's: for one seed the two optimizers coincide.

Changing the learning rate. The chain's state is :math:`(\theta, r)`, whose stationary
law :math:`\exp(-(U(\theta) + |r|^2/2)/T)` does not depend on the step size; the buffer
is :math:`b = -r/\sqrt{N\, lr}`, so it does. When ``lr`` moves from :math:`lr_0` (the
rate at which :math:`b` was last written) to :math:`lr_1` at :math:`T > 0` (a scheduler,
a warm restart), the step first re-expresses the buffer in the new units, keeping
:math:`r`:

.. math::

    b \leftarrow \sqrt{lr_0 / lr_1}\; b.

Without it :math:`r` jumps by :math:`\sqrt{lr_1/lr_0}` and the chain heats (or cools)
until the friction has relaxed it. The discrete chain agrees: for a free coordinate the
stationary buffer variance is :math:`\sigma^2/(1-\mu^2) = 2T/(N\, lr\,(1+\mu))
\propto 1/lr`, so the map sends the stationary law at :math:`lr_0` to the one at
:math:`lr_1`; with a gradient it does so up to the step-size bias
(``tests/test_lr_change.py`` propagates the exact law through jumps). At :math:`T = 0`
the buffer is ``torch.optim.SGD``'s and is never rescaled. The rate is recorded with
each buffer (``"momentum_lr"`` in an Optimizer's per-parameter state, a 0-d float64
tensor on the CPU as ``torch.optim`` keeps every state entry a tensor; the field
``momentum_lr`` of a transform's state), once the chain has taken a step at
:math:`T > 0`; a buffer without a record (one that has only been SGD's, or loaded from
a ``torch.optim.SGD`` checkpoint) is taken to be in the current units. A step of
``lr`` 0 at :math:`T > 0` is skipped (no time passes) and leaves the record as it is.

Fused. ``sghmc/triton_kernel`` holds the same update as one Triton kernel per tensor (its
definition's ``fused_kernel``), which the Optimizer takes on CUDA (``fused``): it reads
:math:`\theta`, :math:`g` and :math:`b` once and writes :math:`\theta` and :math:`b` once.
The same chain in law, but its :math:`\xi` comes from the fused noise stream (Triton's
Philox keyed by seed, step, parameter and element; ``sgmcmc/fused``), not from the keyed
blocks of ``torch.randn`` the unfused update is given, and it rounds as
``torch.optim.SGD(fused=True)`` does, which it is at :math:`T = 0`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from ...core.validation import check_momentum
from ..definition import Hyperparameter, SamplerDefinition, StateField, UpdateInput, UpdateOutput
from ..definition.arguments import pick, sampling_meaningless, sgd_signature
from ..definition.noise_scales import sghmc_noise_scale
from ..optimizer import SamplerOptimizer
from ..sgld import sgld_direction
from ..temperature.rule import TemperatureRule, UnitMass, midpoint_factor
from ..tensor_lists import bucketed_grads, effective_grad, known_buffer, scalar_operand

__all__ = ["DEFINITION", "SGHMC", "sghmc_direction", "sghmc_noise_scale"]


def sghmc_direction(
    params: list[Tensor],
    grads: list[Tensor],
    momentum_buffers: list[Tensor | None],
    noise: list[Tensor] | None,
    *,
    lr: float,
    momentum: float,
    temperature: float,
    num_data: int,
    weight_decay: float,
    dampening: float,
    nesterov: bool,
    maximize: bool,
    foreach: bool,
    inplace: bool = True,
) -> tuple[list[Tensor], list[Tensor | None]]:
    r"""SGHMC's pure kernel: new momentum buffers and the directions :math:`d`.

    .. math::

        b \leftarrow \mu\, b + (1 - \text{dampening})\, g' + \sqrt{2(1-\mu)T/(N\,lr)}\;\xi,
        \qquad d = b \;(\text{or } g' + \mu b \text{ if nesterov}),

    with :math:`b = g'` (plus noise) on the first step (``momentum_buffers[i] is None``),
    as in ``torch.optim.SGD``. The step is :math:`\theta \leftarrow \theta - lr\, d`.
    With ``momentum=0`` this is :func:`sgld_direction` and no buffer is kept.

    Args:
        params: the parameters (read only, for weight decay).
        grads: their gradients (never modified).
        momentum_buffers: one buffer or None per parameter.
        noise: standard-normal :math:`\xi` per parameter; None exactly when T is 0.
        lr: learning rate, > 0 when ``temperature`` > 0.
        momentum: :math:`\mu \in [0, 1)`.
        temperature: T >= 0.
        num_data: N.
        weight_decay: as in ``torch.optim.SGD``.
        dampening: as in ``torch.optim.SGD``; 0 when T > 0.
        nesterov: as in ``torch.optim.SGD``; False when T > 0.
        maximize: as in ``torch.optim.SGD``.
        foreach: multi-tensor path; the single-tensor loop is the reference.
        inplace: update the given buffers in place (Optimizer) or return new ones
            (functional transforms).

    Returns:
        ``(directions, momentum_buffers)``; a direction may alias its buffer.
    """
    if momentum == 0:
        directions = sgld_direction(
            params,
            grads,
            noise,
            lr=lr,
            temperature=temperature,
            num_data=num_data,
            weight_decay=weight_decay,
            maximize=maximize,
            foreach=foreach,
        )
        return directions, list(momentum_buffers)
    if (noise is None) != (temperature == 0):
        raise ValueError("noise must be given exactly when temperature > 0")
    return _sghmc_buffers(
        params,
        grads,
        momentum_buffers,
        noise,
        scale=sghmc_noise_scale(lr, momentum, temperature, num_data),
        momentum=momentum,
        dampening=dampening,
        nesterov=nesterov,
        weight_decay=weight_decay,
        maximize=maximize,
        foreach=foreach,
        inplace=inplace,
    )


def _next_buffer(
    buffer: Tensor | None, grad: Tensor, momentum: float, dampening: float, inplace: bool
) -> Tensor:
    """``torch.optim.SGD``'s buffer: ``g'`` at the first step, then ``mu b + (1-dampening) g'``."""
    if buffer is None:
        return grad.detach().clone()
    buffer = buffer.mul_(momentum) if inplace else buffer.mul(momentum)
    return buffer.add_(grad, alpha=1 - dampening)


def _sghmc_buffers(
    params: list[Tensor],
    grads: list[Tensor],
    momentum_buffers: list[Tensor | None],
    noise: list[Tensor] | None,
    *,
    scale: float,
    momentum: float,
    dampening: float,
    nesterov: bool,
    weight_decay: float,
    maximize: bool,
    foreach: bool,
    inplace: bool,
) -> tuple[list[Tensor], list[Tensor | None]]:
    """:func:`sghmc_direction`'s buffers and directions, ``scale`` its noise scale.

    The single-tensor loop is the reference; with ``foreach``, the same numbers by foreach
    operations, per (device, dtype) bucket.
    """
    if not foreach:
        directions: list[Tensor] = []
        buffers: list[Tensor | None] = []
        for i, (param, grad) in enumerate(zip(params, grads, strict=True)):
            grad = effective_grad(grad, param, weight_decay=weight_decay, maximize=maximize)
            buffer = _next_buffer(momentum_buffers[i], grad, momentum, dampening, inplace)
            if noise is not None:
                buffer.add_(noise[i], alpha=scale)
            buffers.append(buffer)
            directions.append(grad.add(buffer, alpha=momentum) if nesterov else buffer)
        return directions, buffers
    directions = [grads[0]] * len(grads)
    buffers = list(momentum_buffers)
    for index, bucket_grads, _ in bucketed_grads(
        params, grads, weight_decay=weight_decay, maximize=maximize
    ):
        old = [momentum_buffers[i] for i in index]
        if all(buffer is not None for buffer in old):
            # in place, as torch.optim.SGD (on the CPU that rounds the momentum to a
            # bfloat16/float16 buffer's dtype first): new buffers are copies, then scaled
            present = [known_buffer(buffer) for buffer in old]
            new = present if inplace else [buffer.clone() for buffer in present]
            torch._foreach_mul_(new, scalar_operand(momentum, new[0]))
            torch._foreach_add_(new, bucket_grads, alpha=1 - dampening)
        else:
            new = [
                _next_buffer(buffer, grad, momentum, dampening, inplace)
                for buffer, grad in zip(old, bucket_grads, strict=True)
            ]
        if noise is not None:
            torch._foreach_add_(new, [noise[i] for i in index], alpha=scale)
        bucket_directions: Sequence[Tensor] = (
            torch._foreach_add(bucket_grads, new, alpha=momentum) if nesterov else new
        )
        for position, i in enumerate(index):
            buffers[i] = new[position]
            directions[i] = bucket_directions[position]
    return directions, buffers


def _check(group: Mapping[str, Any], temperature: float, where: str) -> None:
    if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
        raise ValueError(
            f"nesterov=True{where} requires momentum > 0 and dampening=0 (as in torch.optim.SGD)"
        )
    sampling_meaningless("nesterov", group["nesterov"], False, temperature, where)
    sampling_meaningless("dampening", group["dampening"], 0, temperature, where)


def _update(
    group: Mapping[str, Any], inputs: UpdateInput, *, foreach: bool, inplace: bool
) -> UpdateOutput:
    momentum_buffers = inputs.buffers.get("momentum_buffer")
    if momentum_buffers is None or (group["initial_state"] and group["dampening"] != 0):
        # torch.optim.SGD's first step sets b = g', whatever the dampening; a
        # transformation's initial zeros give the same numbers with dampening 0 (and keep
        # the graph, for torchopt's MetaOptimizer)
        momentum_buffers = [None] * len(inputs.params)
    directions, momentum_buffers = sghmc_direction(
        inputs.params,
        inputs.grads,
        momentum_buffers,
        inputs.noise,
        **pick(group, "lr", "momentum", "temperature", "num_data", "weight_decay", "dampening"),
        **pick(group, "nesterov", "maximize"),
        foreach=foreach,
        inplace=inplace,
    )
    return directions, {"momentum_buffer": momentum_buffers}


MOMENTUM = Hyperparameter(
    "momentum",
    default=0.9,
    doc=r"""momentum: :math:`\mu`, as in ``torch.optim.SGD`` (default:
            0.9; in [0, 1)). The friction is :math:`(1-\mu)/\epsilon`: closer to 1 means
            less friction and longer, less random trajectories.""",
    transform_doc=r"""momentum: :math:`\mu`, as in ``torchopt.sgd`` (default: 0.9;
            in [0, 1)). The friction is :math:`(1-\mu)/\epsilon` with :math:`\epsilon =
            \sqrt{lr/N}`; 0 gives :func:`sgld`.""",
    check=lambda value, where: check_momentum(value, where=where),
    positional=True,
)

_OPTIMIZER_DOC = r"""Stochastic gradient Hamiltonian Monte Carlo, a drop-in for ``torch.optim.SGD``.

    Each step is one transition of the Markov chain

    .. math::

        g' = \pm g + \lambda\,\theta, \qquad
        b \leftarrow \mu\, b + g' + \sqrt{{2 (1-\mu)\, T / (N\, lr)}}\;\xi, \qquad
        \theta \leftarrow \theta - lr\, b, \qquad \xi \sim \mathcal N(0, I),

    with :math:`g` = ``p.grad`` (the gradient of the mean minibatch loss), :math:`\mu` =
    ``momentum``, :math:`\lambda` = ``weight_decay``, :math:`T` = ``temperature``,
    :math:`N` = ``num_data``, the sign negative when ``maximize``; the buffer starts as
    the first :math:`g'` (plus noise), as in SGD. This is the SGHMC SDE discretised with
    step :math:`\epsilon = \sqrt{{lr / N}}` and friction :math:`(1-\mu)/\epsilon`; its
    stationary law is :math:`\propto \exp(-N L(\theta)/T)` up to step-size bias. When
    ``lr`` changes at :math:`T > 0` (a scheduler, a warm restart), the step first
    rescales the buffer by :math:`\sqrt{{lr_{{\text{{old}}}}/lr}}`, which keeps the
    physical momentum :math:`-\sqrt{{N\,lr}}\,b`, so that the schedule neither heats nor
    cools the chain (the rate is kept as ``state["momentum_lr"]``). At
    ``temperature=0`` it is ``torch.optim.SGD(lr, momentum, ...)`` bit for bit; with
    ``momentum=0`` it is :class:`SGLD`.

    {arguments}

    {example}

    Note:
        Chen et al. (2014) parametrise by :math:`\eta = \epsilon^2` and
        :math:`\alpha = \epsilon C`; here :math:`\eta = lr/N`, :math:`\alpha = 1 - \mu`,
        the momentum is :math:`v = -lr\, b`, the gradient-noise estimate
        :math:`\hat\beta` is 0, and the injected noise variance is multiplied by
        ``temperature``.

    References:
        Chen, T., Fox, E. & Guestrin, C. (2014). Stochastic gradient Hamiltonian Monte
        Carlo. ICML. Eq. (15).
    """


DEFINITION = SamplerDefinition(
    name="SGHMC",
    transform_name="sghmc",
    hyperparameters=sgd_signature(MOMENTUM),
    state=(
        StateField(
            "momentum_buffer",
            "one buffer :math:`b` per leaf of the params tree, in the order of its "
            "leaves, starting at zero (empty when ``momentum`` is 0).",
            # as in torch.optim.SGD, no state is kept without momentum
            used=lambda group: group["momentum"] != 0,
        ),
    ),
    update=_update,
    temperature_rule=TemperatureRule("sghmc", kinetic=UnitMass(midpoint_factor)),
    example="lr=1e-3, momentum=0.9",
    check=_check,
    momentum_in_lr_units=True,
    optimizer_doc=_OPTIMIZER_DOC,
    transform_doc=r"""Stochastic gradient Hamiltonian Monte Carlo as a torchopt transformation.

    The same chain as :class:`SGHMC`, computed by the same kernel: each update is

    .. math::

        g' = \pm g + \lambda\,\theta, \qquad
        b \leftarrow \mu\, b + g' + \sqrt{{2 (1-\mu)\, T / (N\, lr)}}\;\xi, \qquad
        u = -lr\, b, \qquad \xi \sim \mathcal N(0, I),

    to be added to the parameters (``torchopt.apply_updates``), with :math:`g` the
    incoming updates (the gradient of the mean minibatch loss), :math:`\theta` =
    ``params``, :math:`\mu` = ``momentum``, :math:`\lambda` = ``weight_decay``,
    :math:`T` = ``temperature``, :math:`N` = ``num_data``, the sign negative when
    ``maximize``. The buffer :math:`b` starts at zero, which gives
    ``torch.optim.SGD``'s first step :math:`b = g'`; with ``dampening`` (temperature 0
    only) update 0 sets :math:`b = g'` as SGD does. When a schedule changes ``lr`` at
    temperature > 0, the update first rescales the buffer by
    :math:`\sqrt{{lr_{{\text{{old}}}}/lr}}` (:func:`rescale_momentum`; the rate is kept in
    the state), as :class:`SGHMC` does. The noise of update :math:`k` is drawn from
    ``seed`` and :math:`k` alone (both in the state).

    {arguments}

    Example:
        >>> import torch, torchopt
        >>> from samplers_as_optim import transforms
        >>> params = {{"w": torch.zeros(2)}}
        >>> tx = torchopt.chain(
        ...     torchopt.clip.clip_grad_norm(1.0),
        ...     transforms.sghmc(0.1, momentum=0.9, num_data=100, temperature=0.0),
        ... )
        >>> state = tx.init(params)
        >>> for _ in range(2):
        ...     grads = {{"w": torch.tensor([0.6, 0.8])}}
        ...     updates, state = tx.update(grads, state, params=params)
        ...     params = torchopt.apply_updates(params, updates)
        >>> params["w"]  # SGD with momentum: -0.1 * (g + (0.9 g + g))
        tensor([-0.1740, -0.2320])

    Note:
        With one seed, the chain is :class:`SGHMC`'s bit for bit, leaf by parameter:
        a list of tensors matches an optimizer given the same tensors in order, a dict
        (``dict(model.named_parameters())``) one given ``model.named_parameters()``
        (the noise is keyed by index, or by name). At
        ``temperature=0`` the update is ``torchopt.sgd(lr, momentum, ...)``'s bit for bit;
        it equals ``torch.optim.SGD``'s step up to one rounding, because
        ``torch.optim.SGD`` adds :math:`-lr\, b` in one fused multiply-add.

    References:
        Chen, T., Fox, E. & Guestrin, C. (2014). Stochastic gradient Hamiltonian Monte
        Carlo. ICML. Eq. (15).
    """,
)


class SGHMC(SamplerOptimizer, definition=DEFINITION):
    """SGHMC, a drop-in for ``torch.optim.SGD`` (full docstring: ``DEFINITION``)."""
