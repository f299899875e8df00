r"""Preconditioned SGLD (Li et al., 2016): SGLD with RMSprop's diagonal preconditioner.

Derivation. Target :math:`p_T(\theta) \propto \exp(-U(\theta)/T)` with :math:`U = N L`
(docs/design.md). Langevin dynamics with a constant positive diagonal preconditioner
:math:`G`, :math:`d\theta = -G\nabla U\,dt + \sqrt{2TG}\,dW`, leave :math:`p_T` invariant;
Euler with step :math:`h = lr/N` gives

.. math::

    \theta \leftarrow \theta - lr\, G\, g' + \sqrt{2\, lr\, T\, G / N}\;\xi,

SGLD's step (:mod:`.sgld`) with the drift and the noise variance both multiplied by
:math:`G`. Li et al. take :math:`G = \mathrm{diag}(1 / (\epsilon + \sqrt{V}))` with
RMSprop's running average :math:`V \leftarrow \alpha V + (1-\alpha)\, g' \odot g'`, which
is ``torch.optim.RMSprop``'s step at :math:`T = 0`:

.. math::

    V &\leftarrow \alpha V + (1-\alpha)\, g'^2, \qquad a = \sqrt{V} + \epsilon, \\
    \theta &\leftarrow \theta - lr\, \Big(g' / a
        + \sqrt{2T/(N\, lr)}\;\xi / \sqrt{a}\Big)
        \;\big[{}+ lr\,(T/N)\,\Gamma \text{ with the correction}\big].

At ``temperature=0`` the step is ``torch.optim.RMSprop(lr, alpha, eps, weight_decay,
momentum, centered, maximize)``, bit for bit: the same operations in the same order (the
last one ``param.addcdiv_(g', a, value=-lr)``, or RMSprop's momentum buffer). ``momentum``
and ``centered`` have no sampling meaning (RMSprop's momentum is not a Hamiltonian
momentum, and the centred second moment can vanish and blow the noise up) and require
``temperature=0``.

The correction. :math:`G` depends on :math:`\theta` through the newest :math:`g'`, so
the exact drift of a position-dependent diffusion has the extra term :math:`T\,\Gamma`,
:math:`\Gamma_i = \partial G_{ii} / \partial\theta_i` (Li et al., Eq. 4 and Algorithm 1):

.. math::

    \Gamma_i = -(1-\alpha)\, G_{ii}^2\; g'_i\, H_{ii} / \sqrt{V_i},

with :math:`H_{ii}` the diagonal of the Hessian of :math:`L`, which an optimizer fed
gradients does not have. With ``correction=True`` it is estimated by the secant of the
last step, :math:`H_{ii} \approx (g'_i - g'^{\,\text{prev}}_i) / (\theta_i -
\theta^{\text{prev}}_i)` (0 where the coordinate did not move), which is exact on a
separable quadratic with full-batch gradients and noisy otherwise. Li et al. drop
:math:`\Gamma` (its effect is :math:`O(1-\alpha)`), as most implementations do, and so
does the default ``correction=False``.

The law it samples. Li et al.'s preconditioner follows each coordinate's own recent
gradients, so it depends on the position, and that chain does **not** sample its stated
law: a coordinate whose :math:`V` is small gets a large preconditioner, is thrown far
out, and stays there once :math:`V` has grown. The bulk looks right and the tails are
heavy, so what follows reports full variances. By default PSGLD therefore samples with
the preconditioner of :mod:`.sampling_preconditioner`: RMSprop's :math:`V` pooled
(``preconditioner="factored"``, Adafactor's rank-one estimate over the two largest
dimensions, the mean for a vector), following it during ``preconditioner_warmup=1000``
steps of the parameter's step count and then frozen, which leaves :math:`p_T` invariant
exactly, whatever the frozen value (its :math:`\Gamma` is 0); a step at temperature 0
(RMSprop) releases it. ``preconditioner="elementwise", preconditioner_warmup=None`` is
Li et al.'s chain, the default before version 0.2.

Measured (``benchmarks/bench_psgld_law.py``). On :math:`\mathcal N(0, 1)` with full-batch
gradients, ``lr=0.01``, 10,000 chains started at the target, two seeds, the variance of
the final states against the target's 1 (Monte Carlo sd 0.014): with the defaults
1.021/1.001 at ``alpha=0.5`` and ``alpha=0.99`` (1,500 steps) and 0.995/0.992 at
``alpha=0.999`` (6,000 steps), 0.19-0.37% of the chains beyond 3 sd (the target's
0.27%). Li et al.'s: 2.14/1.96 at ``alpha=0.5``, where the interquartile range gives an
sd of 1.73; 3.29/1.35 at ``alpha=0.99`` (interquartile sd 1.20); 4.47/1.04 at
``alpha=0.999`` (interquartile sd 1.02-1.03). Their :math:`\Gamma` narrows the bulk of a
fast-adapting preconditioner (interquartile sd 1.39 at ``alpha=0.5``) and fattens the
tails (full variances 1.5 to 75), so it is off by default, and it applies to their
moving elementwise preconditioner only. On :math:`\mathcal N(0, \mathrm{diag}(0.1^2, 1,
10^2))` (``lr=1e-3``, :math:`N = 1000`, 4,000 elements per coordinate started at the
target, 6,000 steps; Monte Carlo sd 0.022) the variances are 1.00, 1.05 and 1.02 times
the target's with the defaults (1.00, 1.05, 1.02 at ``alpha=0.999``), against 1.31, 1.80
and 1.60 with Li et al.'s (1.04, 1.38, 1.52 at ``alpha=0.999``). Freezing alone does not
cure it: frozen after 30-1000 steps, the elementwise preconditioner remembers where each
element was and the slow coordinate's variance stays 1.16-1.29 times the target's; pooled
and frozen, 1.02-1.03. Pooled but never frozen, the fast coordinate (whose row of three
elements it dominates) is 1.30. With minibatch gradients :math:`V` is dominated by the
gradient noise and depends less on the position.

The floor. At temperature > 0, :math:`\bar V \ge T\lambda/N` with :math:`\lambda` the
coupled ``weight_decay`` (the prior's curvature; ``sampling_preconditioner.prior_floor``:
the stationary second moment of the gradient is at least the prior's share). Without it,
a chain started at a mode (the MAP: no full-batch gradient) built :math:`a` from
gradients near 0, and the noise :math:`\sigma/\sqrt a` threw it out (a 50-unit MLP on
diabetes from its MAP: test RMSE 1.8e5 after 3,000 steps, the MAP's 52.7; floored 52-57).
The floor sets the warm-up's speed, not the frozen chain's law; ``weight_decay=0`` has none.

Changing the learning rate needs no re-expression: :math:`V` is in the units of the
squared gradient, not of ``lr``.

float16. Its range is too narrow for the preconditioner: ``eps=1e-8`` rounds to 0 in
float16 (so :math:`a = 0` where the gradient and :math:`V` are 0, a dead unit, and the
step is :math:`0/0`), :math:`(1-\alpha)\,g'^2` underflows for :math:`|g'| \lesssim
10^{-3}`, and :math:`1/\sqrt{a}` reaches :math:`10^4`. At temperature > 0 a float16
parameter's step is therefore computed in float32 (the gradient, :math:`V`, :math:`a`,
the noise and the correction), :math:`V` is stored rounded to float16, and the direction
is rounded to float16 once, at the end; the rest of the chain (the noise draw, the step
``p.add_(d * -lr)``) is unchanged, and the Optimizer and the transform still agree bit
for bit. At temperature 0 the step stays ``torch.optim.RMSprop``'s, computed in float16;
there an ``eps`` that rounds to 0 in float16 (below about :math:`3 \cdot 10^{-8}`, the
default included) is refused, before anything changes, rather than making a NaN of every
element whose gradient is 0, which RMSprop does. Also refused, at temperature > 0: a
noise scale whose largest value :math:`\sqrt{2T/(N\,lr)}/\sqrt{\epsilon}` (that of an
element whose gradient and :math:`V` vanish) does not fit the parameters' dtype ten
times over (ten standard deviations of the noise): the direction would overflow to
infinity. bfloat16 has float32's range and needs none of this.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from ...core.validation import check_bool, check_nonnegative, refuse
from ..definition import (
    Hyperparameter,
    SamplerDefinition,
    StateField,
    UpdateInput,
    UpdateOutput,
    zeros_like_param,
)
from ..definition.arguments import (
    DIFFERENTIABLE,
    FOREACH,
    FUSED,
    MAXIMIZE,
    NONFINITE,
    NUM_DATA,
    OVERLAP_NOISE,
    SEED,
    TEMPERATURE,
    WEIGHT_DECAY,
    pick,
    sampling_meaningless,
)
from ..optimizer import SamplerOptimizer
from ..sampling_preconditioner import (
    FROZEN_AT,
    FROZEN_PRECONDITIONER,
    PRECONDITIONER,
    PRECONDITIONER_WARMUP,
    STEP,
    check_eps,
    lr_in_units_of,
    zero_temperature_only,
)
from ..temperature.rule import LANGEVIN
from .dtypes import check_dtypes, psgld_noise_scale
from .update import Settings, directions, rmsprop_step_

__all__ = ["DEFINITION", "PSGLD", "psgld_direction", "psgld_noise_scale"]


def _check_alpha(value: Any, where: str) -> float:
    number = check_nonnegative("alpha", value, where=where)
    if not number < 1.0:
        refuse("alpha", value, "a number in [0, 1)", where)
    return number


def psgld_direction(
    params: list[Tensor],
    grads: list[Tensor],
    square_avgs: list[Tensor],
    noise: list[Tensor] | None,
    *,
    lr: float,
    alpha: float,
    eps: float,
    temperature: float,
    num_data: int,
    weight_decay: float,
    maximize: bool,
    foreach: bool,
    momentum: float = 0.0,
    centered: bool = False,
    momentum_buffers: list[Tensor] | None = None,
    grad_avgs: list[Tensor | None] | None = None,
    previous: tuple[list[Tensor], list[Tensor]] | None = None,
    inplace: bool = True,
    split: bool = False,
    steps: list[Any] | None = None,
    preconditioners: list[Tensor | None] | None = None,
    frozen_at: list[Any] | None = None,
    preconditioner: str = "elementwise",
    preconditioner_warmup: int | None = None,
) -> tuple[list[Tensor], dict[str, list[Any]]]:
    r"""The pure kernel of PSGLD: the directions :math:`d` and the new state.

    .. math::

        V \leftarrow \alpha V + (1-\alpha)\, g'^2, \quad a = \sqrt{V} + \epsilon, \quad
        d = g'/a + \sqrt{2T/(N\,lr)}\;\xi/\sqrt{a} - (T/N)\,\Gamma,

    the step being :math:`\theta \leftarrow \theta - lr\, d` (:math:`\Gamma`: module
    docstring). At :math:`T = 0` it is RMSprop's, with its momentum and centred variant.
    Computed one (device, dtype) bucket at a time in ``psgld/update``.

    Args:
        params: the parameters (read only, for weight decay and the correction).
        grads: their gradients (never modified).
        square_avgs: :math:`V`, one per parameter.
        noise: standard-normal :math:`\xi` per parameter; None exactly when T is 0.
        lr: learning rate, > 0 when ``temperature`` > 0.
        alpha: :math:`\alpha \in [0, 1)`.
        eps: :math:`\epsilon > 0` (float16 at T > 0 is computed in float32).
        temperature: T >= 0.
        num_data: N.
        weight_decay: as in ``torch.optim.RMSprop``.
        maximize: as in ``torch.optim.RMSprop``.
        foreach: multi-tensor path; the single-tensor loop is the reference.
        momentum: RMSprop's momentum (T = 0 only).
        centered: RMSprop's centred variant (T = 0 only).
        momentum_buffers: one per parameter when ``momentum`` > 0.
        grad_avgs: one per parameter when ``centered``.
        previous: ``(previous_params, previous_grads)`` for :math:`\Gamma` (T > 0) or None.
        inplace: update the given state in place (Optimizer) or return new tensors.
        split: at T = 0 without momentum, return ``g'`` and :math:`a` (state entries
            ``"numerator"``, ``"denominator"``) for RMSprop's own ``addcdiv_`` step.
        steps: each step count before this step (a 0-d CPU tensor, as RMSprop keeps it,
            or a float); None: no counts are kept, the preconditioner never freezes.
        preconditioners: the frozen sampling preconditioners (None before a freeze).
        frozen_at: the step at which each froze, 0 when not yet (as ``steps``).
        preconditioner: ``"factored"`` or ``"elementwise"`` (Li et al.'s, the default
            here; the Optimizer's is ``"factored"``) pooling of :math:`V` at T > 0.
        preconditioner_warmup: the step count after which it freezes (None: never).

    Returns:
        ``(directions, state)``, the state's entries named as the Optimizer's state
        (``"square_avg"``, ``"preconditioner_step"``, ...): lists, or None where unused.

    Raises:
        ValueError: before anything changes: ``noise`` given at T = 0 or missing above;
            ``eps`` rounds to 0 or the noise scale overflows the dtype computed in.
    """
    rates = (lr, alpha, eps, temperature, num_data, weight_decay, maximize, foreach)
    options = (momentum, centered, inplace, split, preconditioner, preconditioner_warmup)
    state = (momentum_buffers, grad_avgs, previous, steps, preconditioners, frozen_at)
    return directions(params, grads, square_avgs, noise, Settings(*rates, *options), *state)


def _check(group: Mapping[str, Any], temperature: float, where: str) -> None:
    sampling_meaningless("momentum", group["momentum"], 0, temperature, where)
    sampling_meaningless("centered", group["centered"], False, temperature, where)
    moving = group["preconditioner"] == "elementwise" and group["preconditioner_warmup"] is None
    if group["correction"] and not moving:
        raise ValueError(
            f"Invalid correction{where}: True (expected False with preconditioner="
            f"{group['preconditioner']!r} and preconditioner_warmup="
            f"{group['preconditioner_warmup']!r}: Li et al.'s correction is for a moving "
            "elementwise preconditioner, preconditioner='elementwise' and "
            "preconditioner_warmup=None; a frozen one needs none)"
        )


def _update(
    group: Mapping[str, Any],
    inputs: UpdateInput,
    *,
    foreach: bool,
    inplace: bool,
    split: bool = False,
) -> UpdateOutput:
    previous = None
    if group["correction"]:
        previous = (inputs.buffers["previous_param"], inputs.buffers["previous_grad"])
    return psgld_direction(
        inputs.params,
        inputs.grads,
        inputs.buffers["square_avg"],
        inputs.noise,
        **pick(group, "lr", "alpha", "eps", "temperature", "num_data", "weight_decay"),
        **pick(group, "maximize", "momentum", "centered"),
        foreach=foreach,
        momentum_buffers=inputs.buffers.get("momentum_buffer"),
        grad_avgs=inputs.buffers.get("grad_avg"),
        previous=previous,
        inplace=inplace,
        split=split,
        steps=inputs.buffers["step"],
        preconditioners=inputs.buffers["preconditioner"],
        frozen_at=inputs.buffers["preconditioner_step"],
        **pick(group, "preconditioner", "preconditioner_warmup"),
    )


def _check_parameters(group: Mapping[str, Any], params: list[Tensor], where: str) -> None:
    check_dtypes(
        {param.dtype for param in params},
        eps=float(group["eps"]),
        lr=float(group["lr"]),
        temperature=float(group["temperature"]),
        num_data=group["num_data"],
        where=where,
    )


def _rmsprop_step(group: Mapping[str, Any], inputs: UpdateInput, *, foreach: bool) -> bool:
    """At temperature 0 without momentum: RMSprop's last operation, ``addcdiv_``, bit for bit."""
    if group["momentum"] > 0:
        return False
    _, new = _update(group, inputs, foreach=foreach, inplace=True, split=True)
    params, numerators, denominators = inputs.params, new["numerator"], new["denominator"]
    rmsprop_step_(params, numerators, denominators, lr=group["lr"], foreach=foreach)
    return True


def _per_leaf(old: Mapping[str, Any], value: Any) -> tuple[Any, ...]:
    """A field of a state saved before it existed: ``value(leaf)`` per leaf of ``square_avg``."""
    return tuple(None if leaf is None else value(leaf) for leaf in old["square_avg"])


DEFINITION = SamplerDefinition(
    name="PSGLD",
    transform_name="psgld",
    # torch.optim.RMSprop's signature, then the sampler's own arguments
    hyperparameters=(
        lr_in_units_of("torch.optim.RMSprop", 1e-2),
        Hyperparameter(
            "alpha",
            default=0.99,
            doc=r"""alpha: :math:`\alpha`, the decay of the running average of
            squared gradients (default: 0.99; in [0, 1)). Closer to 1: a preconditioner
            that adapts more slowly and a smaller bias from its adaptation.""",
            transform_doc=r"""alpha: :math:`\alpha` (default: 0.99; in [0, 1)).""",
            check=lambda value, where: _check_alpha(value, where),
            positional=True,
        ),
        Hyperparameter(
            "eps",
            default=1e-8,
            doc=r"""eps: :math:`\epsilon`, added to :math:`\sqrt{V}` (default:
            1e-8; a finite number > 0). It bounds the preconditioner by
            :math:`1/\epsilon`. float16 parameters at temperature 0 (RMSprop, computed
            in float16) need one that float16 does not round to 0, above 2.98e-8: the
            default is refused there, before anything changes (at temperature > 0 their
            step is computed in float32; see the module docstring, which also gives the
            noise scale a dtype must hold).""",
            transform_doc=r"""eps: :math:`\epsilon` (default: 1e-8; a finite number > 0;
            for float16 at temperature 0, above 2.98e-8: see :class:`PSGLD`).""",
            check=lambda value, where: check_eps(value, where),
            positional=True,
        ),
        WEIGHT_DECAY.replace(positional=True),
        zero_temperature_only(
            "momentum",
            0.0,
            "RMSprop's momentum",
            lambda value, where: check_nonnegative("momentum", value, where=where),
        ),
        zero_temperature_only(
            "centered",
            False,
            "RMSprop's centred variant",
            lambda value, where: check_bool("centered", value, where=where),
        ),
        Hyperparameter(
            "capturable",
            default=False,
            annotation="bool",
            doc=r"""capturable: accepted for compatibility with
            ``torch.optim.RMSprop``; only False is supported (an option of the
            optimizer, not kept in the param groups).""",
            positional=True,
            transform=False,
            kept=False,
        ),
        FOREACH.replace(positional=True, transform_positional=False),
        MAXIMIZE.replace(positional=True, transform_positional=False),
        DIFFERENTIABLE.replace(positional=True),
        NUM_DATA,
        TEMPERATURE,
        PRECONDITIONER,
        PRECONDITIONER_WARMUP,
        Hyperparameter(
            "correction",
            default=False,
            annotation="bool",
            doc=r"""correction: add Li et al.'s correction term :math:`\Gamma`,
            with the Hessian's diagonal estimated by the secant of the last step
            (default: False, as Li et al. and most implementations; it keeps two more
            buffers per parameter). It is the correction of their moving elementwise
            preconditioner: True requires ``preconditioner="elementwise"`` and
            ``preconditioner_warmup=None`` (a frozen preconditioner needs none).""",
            transform_doc=r"""correction: add Li et al.'s :math:`\Gamma` (default: False;
            see :class:`PSGLD`).""",
            check=lambda value, where: check_bool("correction", value, where=where),
        ),
        SEED,
        OVERLAP_NOISE,
        NONFINITE,
        FUSED.replace(
            doc=r"""fused: take each step in one Triton kernel per tensor
            (``psgld/triton_kernel``; default: None, unfused until the kernels have run on a GPU;
            True: fused, or a ``ValueError`` saying why not; False: never). The
            preconditioner's pooling, a reduction, runs before the kernel on the device
            while it is not frozen. The fused step draws its noise from another stream
            than the unfused one (Triton's Philox) and checks the gradients on the
            device: with ``nonfinite="raise"`` a non-finite gradient is reported at the
            next ``step()`` or ``state_dict()`` call, the refused step having changed
            nothing. At temperature 0 it is ``torch.optim.RMSprop``'s step up to
            rounding (computed in float64, rounded once). ``torch.optim.RMSprop`` has no
            such argument."""
        ),
    ),
    state=(
        StateField(
            "square_avg",
            ":math:`V` per leaf of the params tree, starting at zero.",
            init=zeros_like_param,
        ),
        StateField(
            "momentum_buffer",
            "RMSprop's momentum buffer per leaf (empty unless ``momentum``).",
            used=lambda group: group["momentum"] > 0,
            init=zeros_like_param,
        ),
        StateField(
            "grad_avg",
            "the running mean of the gradients per leaf (empty unless ``centered``).",
            used=lambda group: bool(group["centered"]),
            init=zeros_like_param,
        ),
        StateField(
            "previous_param",
            "the parameters at the last update (empty unless ``correction``).",
            used=lambda group: bool(group["correction"]),
            init=lambda param, group: param.detach().clone(memory_format=torch.preserve_format),
        ),
        StateField(
            "previous_grad",
            "the gradients at the last update (empty unless ``correction``).",
            used=lambda group: bool(group["correction"]),
            init=zeros_like_param,
        ),
        # added in 0.2: a PSGLDState saved before them loads with these values
        dataclasses.replace(STEP, legacy=lambda old: _per_leaf(old, lambda _: float(old["count"]))),
        dataclasses.replace(
            FROZEN_PRECONDITIONER, legacy=lambda old: _per_leaf(old, torch.zeros_like)
        ),
        dataclasses.replace(FROZEN_AT, legacy=lambda old: _per_leaf(old, lambda _: 0.0)),
    ),
    update=_update,
    temperature_rule=LANGEVIN,
    example="lr=1e-3",
    check=_check,
    check_parameters=_check_parameters,
    zero_temperature_step=_rmsprop_step,
    chunked_kernel=False,
    supports_dtensor=False,
    dtensor_unsupported_reason="its pooled preconditioner takes means over whole tensors",
    optimizer_doc=r"""Preconditioned SGLD (Li et al., 2016), a drop-in for ``torch.optim.RMSprop``.

    Each step is one transition of the Markov chain

    .. math::

        g' &= \pm g + \lambda\,\theta, \qquad
        V \leftarrow \alpha V + (1-\alpha)\, g'^2, \qquad a = \sqrt{{V}} + \epsilon, \\
        \theta &\leftarrow \theta - lr\, g' / a + \sqrt{{2\, lr\, T / N}}\; \xi / \sqrt{{a}},
        \qquad \xi \sim \mathcal N(0, I),

    SGLD with the diagonal preconditioner :math:`G = 1/a` applied to the drift and to the
    noise variance, with :math:`g` = ``p.grad`` (the gradient of the mean minibatch loss),
    :math:`\alpha` = ``alpha``, :math:`\epsilon` = ``eps``, :math:`\lambda` =
    ``weight_decay``, :math:`T` = ``temperature``, :math:`N` = ``num_data``, the sign
    negative when ``maximize``; :math:`V` starts at 0 (``state["square_avg"]``). At
    ``temperature=0`` it is ``torch.optim.RMSprop`` with the same arguments, bit for bit
    (``momentum`` and ``centered`` included). With ``correction=True`` the step gains Li
    et al.'s :math:`+lr\,(T/N)\,\Gamma` (module docstring of
    :mod:`samplers_as_optim.sgmcmc.psgld`, with its measured effect).

    At temperature > 0 the preconditioner is not RMSprop's own :math:`a`, which depends on
    the position and gives the chain heavy tails (full variances 1.3-1.8 times the
    target's on a Gaussian), but :math:`V` pooled over each tensor and frozen after
    ``preconditioner_warmup`` steps, with which PSGLD samples its law (within 5% on the
    same Gaussian); Li et al.'s chain is ``preconditioner="elementwise",
    preconditioner_warmup=None``. The measurements are in the module docstring of
    :mod:`samplers_as_optim.sgmcmc.psgld`.

    {arguments}

    {example}

    Note:
        Li et al. write the step on the summed log posterior with step :math:`\epsilon_t`
        and :math:`\lambda` for ``eps``; here :math:`\epsilon_t = lr/N`, the gradient is
        that of the mean loss (so :math:`V` is RMSprop's), and the noise variance is
        multiplied by ``temperature``.

    References:
        Li, C., Chen, C., Carlson, D. & Carin, L. (2016). Preconditioned stochastic
        gradient Langevin dynamics for deep neural networks. AAAI. Algorithm 1, Eq. (4).
    """,
    transform_doc=r"""Preconditioned SGLD (Li et al., 2016) as a torchopt transformation.

    The same chain as :class:`PSGLD`, computed by the same kernel: each update is

    .. math::

        V \leftarrow \alpha V + (1-\alpha)\, g'^2, \qquad a = \sqrt{{V}} + \epsilon, \qquad
        u = -lr\,\big(g'/a + \sqrt{{2T/(N\,lr)}}\;\xi/\sqrt{{a}}\big),

    to be added to the parameters (``torchopt.apply_updates``), with :math:`g'` the
    incoming updates (plus weight decay, negated when ``maximize``). At temperature 0 it
    is RMSprop's update up to the rounding of ``-lr * (g'/a)`` (``torch.optim.RMSprop``
    fuses it into ``addcdiv_``).

    {arguments}

    {example}

    References:
        Li, C., Chen, C., Carlson, D. & Carin, L. (2016). Preconditioned stochastic
        gradient Langevin dynamics for deep neural networks. AAAI. Algorithm 1.
    """,
)


class PSGLD(SamplerOptimizer, definition=DEFINITION):
    """Preconditioned SGLD, a drop-in for ``torch.optim.RMSprop`` (docs: ``DEFINITION``)."""
