r"""Stochastic gradient Nosé--Hoover thermostat (Ding et al., 2014) in SGD units.

Derivation. SGNHT is SGHMC (see :mod:`.sghmc`) whose friction is a dynamic variable
:math:`\zeta`, the thermostat, that drives the kinetic energy per dimension to the
temperature. With :math:`U = N L`, :math:`n` dimensions and injected-noise constant
:math:`A`, the tempered dynamics are

.. math::

    d\theta = r\,dt, \qquad
    dr = -\nabla U\,dt - \zeta r\,dt + \sqrt{2 A T}\,dW, \qquad
    d\zeta = \left(|r|^2 / n - T\right) dt,

which leave :math:`\exp(-U(\theta)/T)\,\mathcal N(r; 0, T I)` invariant in
:math:`(\theta, r)`. Ding et al.'s Algorithm 1 (the momentum, then the position and the
thermostat with the new momentum) with step :math:`\epsilon` and, as for SGHMC,
:math:`\epsilon = \sqrt{lr/N}`, :math:`r = -(lr/\epsilon)\, b`, gives

.. math::

    b &\leftarrow (1 - \alpha)\, b + g' + \sqrt{2 (1-\mu) T / (N\, lr)}\;\xi, \\
    \theta &\leftarrow \theta - lr\, b, \\
    \alpha &\leftarrow \alpha + lr^2\, |b|^2 / n - lr\, T / N,

where :math:`\alpha = \epsilon\zeta` is the thermostat in SGD units (the friction
:math:`1 - \mu` of SGHMC becomes dynamic) and :math:`1 - \mu = \epsilon A` sets the
injected noise; :math:`\alpha` starts at :math:`1 - \mu` and :math:`b` at 0. (The last
line: :math:`\zeta' = \zeta + \epsilon(|r|^2/n - T)` with :math:`|r|^2 = lr\,N |b|^2`.)

Step-size bias, and the symmetric estimate. Ding et al.'s scheme drives the *discrete*
kinetic energy of the new buffer, :math:`lr\,N |b|^2/n`, to :math:`T`. For a free
coordinate the discrete buffer has variance :math:`\sigma^2 / (\alpha (2 - \alpha))`
with :math:`\sigma^2 = 2(1-\mu)T/(N\,lr)`, so that thermostat settles where
:math:`\alpha(2-\alpha) = 2(1-\mu)` (not at :math:`1-\mu`), and the positions are sampled
at temperature :math:`T (2-\alpha)/2`: cold by about :math:`(1-\mu)/2`. The buffer
:math:`b` is the momentum half a step off the positions; the momentum *at* the positions'
step is the midpoint :math:`(b_{\text{old}} + b)/2` (as in velocity Verlet), whose
stationary second moment is :math:`\sigma^2/(2\alpha)` per free coordinate: driving
:math:`lr\,N |(b_{\text{old}} + b)/2|^2/n` to :math:`T` settles the thermostat exactly at
:math:`\alpha = 1 - \mu`, where SGNHT is SGHMC with momentum :math:`\mu`, step-size
bias included and nothing more. That is ``kinetic_energy="symmetric"``, the default:

.. math::

    \alpha \leftarrow \alpha + lr^2\, |(b_{\text{old}} + b)/2|^2 / n - lr\, T / N;

``kinetic_energy="ding"`` keeps the paper's :math:`|b|^2`. Measured on a 10-D
Gaussian of condition number 10 (``lr=1``, :math:`N = 100`, 20,000 chains,
``tests/test_sgnht_bias.py``; the exact law of the chain at the thermostat's value): at
``momentum=0.9`` the paper's thermostat settles at 0.106 and the covariance is 5.7% too
small (largest entry error relative to the largest entry; trace 0.944 of the target's),
the symmetric one settles at 0.100 with a 0.1% error (trace 1.001); at ``momentum=0.5``
the paper's is 46% off (trace 0.54), the symmetric one 0.1%. With the symmetric estimate
the equilibrium :math:`\alpha = 1 - \mu` does not depend on ``lr`` either, so what
follows on changes of ``lr`` holds for both.

Changing the learning rate. As for SGHMC, the momentum :math:`r = -\sqrt{N\, lr}\, b`
is kept: :math:`b \leftarrow \sqrt{lr_0/lr_1}\, b` when ``lr`` moves from :math:`lr_0`
to :math:`lr_1` at :math:`T > 0` (:func:`.sghmc.rescale_momentum`). The thermostat is
left as it is. The reason: the tempered dynamics above leave

.. math::

    \exp\!\left(-\frac{U(\theta) + |r|^2/2}{T}\right)
    \exp\!\left(-\frac{n (\zeta - A)^2}{2T}\right)

invariant (in the Fokker--Planck equation the friction and noise terms in :math:`r`
give :math:`(\zeta - A)(n - |r|^2/T)\,p` and the thermostat's drift the opposite), so
:math:`\zeta` settles around :math:`A` with spread :math:`\sqrt{T/n}`. But
:math:`A = (1-\mu)/\epsilon` itself moves with ``lr`` at fixed ``momentum``: in SGD units
the equilibrium :math:`\alpha = \epsilon\zeta \approx \epsilon A = 1 - \mu` (discretely
:math:`\alpha(2-\alpha) = 2(1-\mu)` for the paper's estimate, above) does not depend on
``lr``. There the
discrete buffer of a free coordinate has variance :math:`T/(N\, lr) \propto 1/lr`, so
rescaling :math:`b` and keeping :math:`\alpha` maps the stationary law at :math:`lr_0` to
the one at :math:`lr_1`, as for SGHMC. Carrying the
continuous-time :math:`\zeta` across the change, :math:`\alpha \leftarrow
\alpha\sqrt{lr_1/lr_0}`, would put the friction off its equilibrium by that factor: a
rise of ``lr`` would cool the chain and a fall heat it, until the thermostat, whose
increments are of order :math:`lr\, T/N`, re-adapted. (On :math:`\mathcal N(0, 0.1^2)`
with :math:`N = 1000`, ``momentum=0.9``, 20,000 chains: ``lr`` 0.1 to 1 with
:math:`\zeta` carried takes the position sd to 0.57 of the target's and the kinetic
temperature to 0.38 T within 20 steps, 1 to 0.1 takes them to 1.58 and 2.5 T within 60;
with :math:`\alpha` left as it is the sd stays within 6% of the target's and the kinetic
temperature within 10% of T, the step-size effects at ``lr`` 1, where
:math:`\epsilon\sqrt{\lambda} = 0.32`.) What is not carried is the spread of
:math:`\alpha`, :math:`\sqrt{lr\, T/(N n)}`, tiny beside :math:`1 - \mu` for a tensor of
:math:`n` elements; and as long as :math:`\zeta` is independent of :math:`r`,
:math:`E[d|r|^2]` depends on it only through its mean. ``tests/test_lr_change.py``
checks the position sd and the kinetic temperature right after jumps of ``lr``.

At :math:`T = 0` the thermostat only grows (:math:`lr^2 |b|^2/n \ge 0`) and the dynamics
diverge rather than reduce to SGD (posteriors paper, Appendix C), so SGNHT requires
:math:`T > 0`.

One thermostat per parameter tensor (:math:`n` its number of elements). Ding et al. use
one for the whole vector; a thermostat per subset of coordinates leaves the same law
invariant and needs no global reduction across tensors or param groups.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch
from torch import Tensor

from ...core.validation import check_choice, check_momentum
from ..definition import Hyperparameter, SamplerDefinition, StateField, UpdateInput, UpdateOutput
from ..definition.arguments import (
    DAMPENING,
    NESTEROV,
    TEMPERATURE,
    pick,
    sampling_meaningless,
    sgd_signature,
)
from ..definition.noise_scales import sghmc_noise_scale
from ..optimizer import SamplerOptimizer
from ..temperature.rule import TemperatureRule, thermostat_kinetic
from ..tensor_lists import add_scalar_, bucketed_grads, effective_grad, mul_each_, plus_scalar

__all__ = [
    "DEFINITION",
    "KINETIC_ENERGY",
    "SGNHT",
    "sgnht_direction",
    "sgnht_initial_state",
]


#: the thermostat's estimates of the kinetic energy (see the module docstring)
KINETIC_ENERGY = ("symmetric", "ding")


def sgnht_initial_state(param: Tensor, momentum: float) -> tuple[Tensor, Tensor]:
    r"""The buffer :math:`b = 0` and thermostat :math:`\alpha = 1 - \mu` for one parameter.

    The thermostat is a 0-dim tensor on the parameter's device, kept in at least float32
    so that its small increments are not rounded away for half-precision parameters.
    """
    buffer = torch.zeros_like(param, memory_format=torch.preserve_format)
    dtype = torch.promote_types(param.dtype, torch.float32)
    thermostat = torch.full((), 1.0 - momentum, dtype=dtype, device=param.device)
    return buffer, thermostat


def sgnht_direction(
    params: list[Tensor],
    grads: list[Tensor],
    momentum_buffers: list[Tensor],
    thermostats: list[Tensor],
    noise: list[Tensor],
    *,
    lr: float,
    momentum: float,
    temperature: float,
    num_data: int,
    weight_decay: float,
    maximize: bool,
    foreach: bool,
    inplace: bool = True,
    kinetic_energy: str = "symmetric",
) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    r"""SGNHT's pure kernel: new buffers, new thermostats and the directions :math:`d = b`.

    .. math::

        b \leftarrow (1 - \alpha)\, b + g' + \sqrt{2(1-\mu)T/(N\,lr)}\;\xi, \qquad
        \alpha \leftarrow \alpha + lr^2 |b|^2 / n - lr\,T/N.

    The step is :math:`\theta \leftarrow \theta - lr\, d`. An empty tensor (:math:`n = 0`)
    has nothing to thermostat: its :math:`\alpha` stays as it is.

    Args:
        params: the parameters (read only, for weight decay).
        grads: their gradients (never modified).
        momentum_buffers: one buffer per parameter (see :func:`sgnht_initial_state`).
        thermostats: one 0-dim thermostat :math:`\alpha` per parameter.
        noise: standard-normal :math:`\xi` per parameter.
        lr: learning rate > 0.
        momentum: :math:`\mu \in [0, 1)`: sets the injected noise and the initial friction.
        temperature: T > 0.
        num_data: N.
        weight_decay: as in ``torch.optim.SGD``.
        maximize: as in ``torch.optim.SGD``.
        foreach: multi-tensor path; the single-tensor loop is the reference.
        inplace: update buffers and thermostats in place, or return new ones.
        kinetic_energy: ``"symmetric"`` (:math:`|b|^2` replaced by
            :math:`|(b_{\text{old}} + b)/2|^2`) or ``"ding"`` (Ding et al.'s :math:`|b|^2`
            of the new buffer); see the module docstring.

    Returns:
        ``(directions, momentum_buffers, thermostats)``; a direction aliases its buffer.
    """
    if not temperature > 0:
        raise ValueError("SGNHT needs temperature > 0")
    if kinetic_energy not in KINETIC_ENERGY:
        raise ValueError(f"kinetic_energy must be one of {KINETIC_ENERGY}")
    symmetric = kinetic_energy == "symmetric"
    buffers, new_thermostats = _sgnht_buffers(
        params,
        grads,
        momentum_buffers,
        thermostats,
        noise,
        scale=sghmc_noise_scale(lr, momentum, temperature, num_data),
        cooling=lr * temperature / num_data,
        # |b|^2 lr^2 / n, or |(b_old + b_new) / 2|^2 lr^2 / n
        factor=lr * lr / 4 if symmetric else lr * lr,
        symmetric=symmetric,
        weight_decay=weight_decay,
        maximize=maximize,
        foreach=foreach,
        inplace=inplace,
    )
    return list(buffers), buffers, new_thermostats


def _sgnht_buffers(
    params: list[Tensor],
    grads: list[Tensor],
    momentum_buffers: list[Tensor],
    thermostats: list[Tensor],
    noise: list[Tensor],
    *,
    scale: float,
    cooling: float,
    factor: float,
    symmetric: bool,
    weight_decay: float,
    maximize: bool,
    foreach: bool,
    inplace: bool,
) -> tuple[list[Tensor], list[Tensor]]:
    r""":func:`sgnht_direction`'s ``(momentum_buffers, thermostats)``.

    ``scale`` is the noise's :math:`\sqrt{2(1-\mu)T/(N\,lr)}`, ``cooling``
    :math:`lr\,T/N`, ``factor`` the kinetic energy's :math:`lr^2` (:math:`lr^2/4` with
    ``symmetric``, whose energy is that of :math:`b_{\text{old}} + b`). The single-tensor
    loop is the reference; with ``foreach``, the same by foreach operations, per (device,
    dtype) bucket.
    """
    if not foreach:
        buffers, new_thermostats = [], []
        for i, (param, grad) in enumerate(zip(params, grads, strict=True)):
            grad = effective_grad(grad, param, weight_decay=weight_decay, maximize=maximize)
            thermostat = thermostats[i]
            friction = torch.sub(1.0, thermostat)
            buffer = momentum_buffers[i]
            midpoint = None
            if symmetric:  # b_old + b_new = (2 - alpha) b_old + (g' + s xi)
                kick = grad.add(noise[i], alpha=scale)
                midpoint = buffer.mul(torch.add(friction, 1.0)).add_(kick)
            # out of place: the in-place product's dtype (a 0-dim buffer would be promoted)
            buffer = buffer.mul_(friction) if inplace else buffer.mul(friction).to(buffer.dtype)
            if symmetric:
                buffer.add_(kick)
            else:
                buffer.add_(grad).add_(noise[i], alpha=scale)
            if buffer.numel() > 0:  # an empty tensor has nothing to thermostat
                energy = buffer if midpoint is None else midpoint
                kinetic = torch.linalg.vector_norm(energy, dtype=thermostat.dtype).square()
                increment = kinetic.mul_(factor / buffer.numel()).sub_(cooling)
                thermostat = thermostat.add_(increment) if inplace else thermostat.add(increment)
            buffers.append(buffer)
            new_thermostats.append(thermostat)
        return buffers, new_thermostats
    buffers = list(momentum_buffers)
    new_thermostats = list(thermostats)
    for index, bucket_grads, _ in bucketed_grads(
        params, grads, weight_decay=weight_decay, maximize=maximize
    ):
        alphas = [thermostats[i] for i in index]
        frictions = list(torch._foreach_neg(alphas))
        add_scalar_(frictions, 1.0)
        old = [momentum_buffers[i] for i in index]
        midpoints = None
        if symmetric:  # b_old + b_new = (2 - alpha) b_old + (g' + s xi)
            kicks = torch._foreach_add(bucket_grads, [noise[i] for i in index], alpha=scale)
            midpoints = torch._foreach_mul(old, plus_scalar(frictions, 1.0))
            torch._foreach_add_(midpoints, kicks)
        if inplace:
            torch._foreach_mul_(old, frictions)
            new = old
        else:  # the in-place products' dtypes (a 0-dim buffer would be promoted)
            new = list(torch._foreach_mul(old, frictions))
            new = [value.to(buffer.dtype) for value, buffer in zip(new, old, strict=True)]
        if symmetric:
            torch._foreach_add_(new, kicks)
        else:
            torch._foreach_add_(new, bucket_grads)
            torch._foreach_add_(new, [noise[i] for i in index], alpha=scale)
        for position, i in enumerate(index):
            buffers[i] = new[position]
        energies = new if midpoints is None else midpoints
        for i, alpha in _foreach_thermostats(energies, alphas, index, factor, cooling, inplace):
            new_thermostats[i] = alpha
    return buffers, new_thermostats


def _foreach_thermostats(
    energies: Sequence[Tensor],
    alphas: list[Tensor],
    index: list[int],
    factor: float,
    cooling: float,
    inplace: bool,
) -> list[tuple[int, Tensor]]:
    r"""A bucket's new thermostats :math:`\alpha + factor\,|e|^2/n - cooling`, by index.

    An empty tensor has nothing to thermostat: its thermostat stays as it is (left out).
    """
    full = [position for position, energy in enumerate(energies) if energy.numel() > 0]
    if not full:
        return []
    energies = [energies[position] for position in full]
    alphas = [alphas[position] for position in full]
    norms = torch._foreach_norm(energies, 2, dtype=alphas[0].dtype)
    kinetics = list(torch._foreach_mul(norms, norms))
    mul_each_(kinetics, [factor / energy.numel() for energy in energies])
    add_scalar_(kinetics, -cooling)  # (x - c is x + (-c), rounded alike)
    if inplace:
        torch._foreach_add_(alphas, kinetics)
    else:
        alphas = list(torch._foreach_add(alphas, kinetics))
    return [(index[position], alpha) for position, alpha in zip(full, alphas, strict=True)]


def _check(group: Mapping[str, Any], temperature: float, where: str) -> None:
    sampling_meaningless("nesterov", group["nesterov"], False, temperature, where)
    sampling_meaningless("dampening", group["dampening"], 0, temperature, where)


def _update(
    group: Mapping[str, Any], inputs: UpdateInput, *, foreach: bool, inplace: bool
) -> UpdateOutput:
    keys = ("lr", "momentum", "temperature", "num_data", "weight_decay", "maximize")
    directions, momentum_buffers, thermostats = sgnht_direction(
        inputs.params,
        inputs.grads,
        cast(list[Tensor], inputs.buffers["momentum_buffer"]),  # set for every parameter (init)
        cast(list[Tensor], inputs.buffers["thermostat"]),
        cast(list[Tensor], inputs.noise),  # sgnht_direction raises when temperature is 0
        **pick(group, *keys, "kinetic_energy"),
        foreach=foreach,
        inplace=inplace,
    )
    return directions, {"momentum_buffer": momentum_buffers, "thermostat": thermostats}


MOMENTUM = Hyperparameter(
    "momentum",
    default=0.9,
    doc=r"""momentum: :math:`\mu` (default: 0.9; in [0, 1)): the initial
            friction is :math:`1 - \mu` and the injected noise is SGHMC's for that
            momentum.""",
    transform_doc=r"""momentum: :math:`\mu` (default: 0.9; in [0, 1)): the initial
            friction is :math:`1 - \mu` and the injected noise is :func:`sghmc`'s for
            that momentum.""",
    check=lambda value, where: check_momentum(value, where=where),
    positional=True,
)
KINETIC_ENERGY_ARGUMENT = Hyperparameter(
    "kinetic_energy",
    default="symmetric",
    annotation="str",
    doc=r"""kinetic_energy: the thermostat's estimate of the kinetic
            energy (default: ``"symmetric"``, that of the midpoint of the old and new
            buffers: no bias beyond SGHMC's; ``"ding"``: Ding et al.'s, of the new
            buffer, which samples cold by about :math:`(1-\mu)/2`).""",
    transform_doc=r"""kinetic_energy: ``"symmetric"`` (default) or ``"ding"``, as
            for :class:`SGNHT`.""",
    check=lambda value, where: check_choice("kinetic_energy", value, KINETIC_ENERGY, where=where),
)

_OPTIMIZER_DOC = r"""Stochastic gradient Nosé--Hoover thermostat, a drop-in for ``torch.optim.SGD``.

    Each step is one transition of the Markov chain

    .. math::

        g' &= \pm g + \lambda\,\theta, \\
        b &\leftarrow (1 - \alpha)\, b + g' + \sqrt{{2 (1-\mu)\, T / (N\, lr)}}\;\xi, \\
        \theta &\leftarrow \theta - lr\, b, \\
        \alpha &\leftarrow \alpha + lr^2\, |b|^2 / n - lr\, T / N,

    with :math:`g` = ``p.grad`` (the gradient of the mean minibatch loss), :math:`\mu` =
    ``momentum``, :math:`\lambda` = ``weight_decay``, :math:`T` = ``temperature``,
    :math:`N` = ``num_data``, :math:`\xi \sim \mathcal N(0, I)`, one thermostat
    :math:`\alpha` per parameter tensor of :math:`n` elements (starting at
    :math:`1 - \mu`, the buffer :math:`b` at 0). The thermostat adapts the friction so
    that the kinetic energy matches the temperature, which corrects for unknown
    gradient noise; with the default ``kinetic_energy="symmetric"`` that is the kinetic
    energy of the midpoint :math:`(b_{{\text{{old}}}} + b)/2` (:math:`|b|^2` above becomes
    :math:`|(b_{{\text{{old}}}} + b)/2|^2`), which removes the paper's cold bias of about
    :math:`(1-\mu)/2` (module docstring, with measurements). When ``lr`` changes (a
    scheduler, a warm restart), the step first rescales the buffer by
    :math:`\sqrt{{lr_{{\text{{old}}}}/lr}}`, keeping the physical momentum, and leaves
    :math:`\alpha`, whose equilibrium does not depend on ``lr``, as it is: the schedule
    neither heats nor cools the chain (module docstring of
    :mod:`samplers_as_optim.sgmcmc.sgnht`). ``temperature`` must be > 0: at 0 the
    thermostat diverges.

    {arguments}

    {example}

    Note:
        Ding et al. (2014) use one thermostat for all coordinates and step :math:`h` on
        the summed log posterior; here there is one per parameter tensor, :math:`h =
        \sqrt{{lr/N}}`, :math:`\alpha = h\,\xi_{{\text{{Ding}}}}`, and the noise variance is
        multiplied by ``temperature``.

    References:
        Ding, N., Fang, Y., Babbush, R., Chen, C., Skeel, R. D. & Neven, H. (2014).
        Bayesian sampling using stochastic gradient thermostats. NeurIPS. Algorithm 1.
    """


DEFINITION = SamplerDefinition(
    name="SGNHT",
    transform_name="sgnht",
    hyperparameters=sgd_signature(
        MOMENTUM,
        KINETIC_ENERGY_ARGUMENT,
        temperature=TEMPERATURE.replace(
            doc=r"""temperature: T (default: 1.0; a finite number > 0).""",
            transform_doc=r"""temperature: T (default: 1.0; a finite number > 0), or a
            schedule of the step count like ``lr``.""",
        ),
        dampening=DAMPENING.replace(
            doc=r"""dampening: must be 0 (no sampling meaning; accepted for
            SGD's signature).""",
            transform_doc=r"""dampening: must be 0 (no sampling meaning; accepted for
            ``torchopt.sgd``'s signature).""",
        ),
        nesterov=NESTEROV.replace(
            doc=r"""nesterov: must be False (no sampling meaning; accepted for
            SGD's signature).""",
            transform_doc=r"""nesterov: must be False (no sampling meaning; accepted for
            ``torchopt.sgd``'s signature).""",
        ),
    ),
    state=(
        StateField(
            "momentum_buffer",
            "one buffer :math:`b` per leaf of the params tree, in the order of its leaves, "
            "starting at zero.",
            init=lambda param, group: sgnht_initial_state(param, group["momentum"])[0],
        ),
        StateField(
            "thermostat",
            "one 0-dim thermostat :math:`\\alpha` per leaf, starting at :math:`1 - \\mu` "
            "(see :func:`sgnht_initial_state`).",
            init=lambda param, group: sgnht_initial_state(param, group["momentum"])[1],
            own_dtype=True,
        ),
    ),
    update=_update,
    temperature_rule=TemperatureRule("sgnht", kinetic=thermostat_kinetic),
    example="lr=1e-3",
    check=_check,
    momentum_in_lr_units=True,  # the buffer; the thermostat's equilibrium is lr-free
    requires_positive_temperature=True,
    positive_temperature_reason=(
        "at temperature 0 SGNHT's thermostat only grows and the dynamics diverge instead "
        "of becoming SGD (posteriors paper, Appendix C); use SGHMC for temperature=0"
    ),
    zero_temperature_fault="its dynamics diverge at temperature 0",
    # the thermostat reduces over a whole tensor, so tensors are never chunked
    chunked_kernel=False,
    supports_dtensor=False,
    dtensor_unsupported_reason=(
        "its thermostat reduces each parameter's kinetic energy over the whole tensor"
    ),
    optimizer_doc=_OPTIMIZER_DOC,
    transform_doc=r"""Stochastic gradient Nosé--Hoover thermostat as a torchopt transformation.

    The same chain as :class:`SGNHT`, computed by the same kernel: each update is

    .. math::

        g' &= \pm g + \lambda\,\theta, \\
        b &\leftarrow (1 - \alpha)\, b + g' + \sqrt{{2 (1-\mu)\, T / (N\, lr)}}\;\xi, \\
        u &= -lr\, b, \\
        \alpha &\leftarrow \alpha + lr^2\, |b|^2 / n - lr\, T / N,

    to be added to the parameters (``torchopt.apply_updates``), with :math:`g` the
    incoming updates (the gradient of the mean minibatch loss), :math:`\theta` =
    ``params``, :math:`\mu` = ``momentum``, :math:`\lambda` = ``weight_decay``,
    :math:`T` = ``temperature``, :math:`N` = ``num_data``, :math:`\xi \sim \mathcal N(0,
    I)`, the sign negative when ``maximize``, and one thermostat :math:`\alpha` per leaf
    of :math:`n` elements (starting at :math:`1 - \mu`, the buffer :math:`b` at 0). When a
    schedule changes ``lr``, the update first rescales the buffer as :class:`SGNHT` does
    (the rate is kept in the state). The noise of update :math:`k` is drawn from ``seed``
    and :math:`k` alone (both in the state). ``temperature`` must be > 0 at every step:
    at 0 the thermostat diverges.

    {arguments}

    Example:
        >>> import torch, torchopt
        >>> from samplers_as_optim import transforms
        >>> params = {{"w": torch.zeros(3)}}
        >>> tx = transforms.sgnht(1e-3, num_data=1000, seed=0)
        >>> state = tx.init(params)
        >>> state.thermostat  # one per leaf, starting at 1 - momentum
        (tensor(0.1000),)
        >>> updates, state = tx.update({{"w": torch.ones(3)}}, state, params=params)
        >>> params = torchopt.apply_updates(params, updates)
        >>> state.count
        1

    Note:
        With one seed, the chain is :class:`SGNHT`'s bit for bit, leaf by parameter:
        a list of tensors matches an optimizer given the same tensors in order, a dict
        (``dict(model.named_parameters())``) one given ``model.named_parameters()``
        (the noise is keyed by index, or by name).

    References:
        Ding, N., Fang, Y., Babbush, R., Chen, C., Skeel, R. D. & Neven, H. (2014).
        Bayesian sampling using stochastic gradient thermostats. NeurIPS. Algorithm 1.
    """,
)


class SGNHT(SamplerOptimizer, definition=DEFINITION):
    """SGNHT, a drop-in for ``torch.optim.SGD`` (full docstring: ``DEFINITION``)."""
