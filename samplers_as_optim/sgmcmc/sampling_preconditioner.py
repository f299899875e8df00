r"""The diagonal preconditioner an adaptive sampler samples with: pooled, then frozen.

An adaptive optimizer (RMSprop, AdamW) divides each element's step by
:math:`a = \sqrt{\hat V} + \epsilon`, :math:`\hat V` a running average of that element's
own squared gradients. Used as a sampler's preconditioner :math:`G = 1/a` at
temperature > 0 this is wrong twice over (``docs/design.md``: "a preconditioner that
follows the position must not quietly change the law"):

* :math:`G` depends on the position, through the gradients just seen, so the exact
  drift needs the extra term :math:`T\,\Gamma`, :math:`\Gamma_i = \partial G_{ii} /
  \partial\theta_i` (Ma et al. 2015, Eq. 3; Li et al. 2016, Eq. 4), which an optimizer
  fed gradients cannot compute;
* frozen after a warm-up, each :math:`G_{ii}` remembers where its element was: an
  element that happened to be far out has a large :math:`V_{ii}`, a small
  :math:`G_{ii}`, and stays out. ``benchmarks/bench_psgld_law.py`` measures both: full
  variances up to 1.8 and 1.15-1.28 times the target's on a Gaussian.

The cure, written once here for PSGLD and the AdamW twin:

1. **Pooled.** The sampling preconditioner is built from the second moment averaged
   over many elements, so that one element weighs little in its own :math:`G_{ii}`.
   ``"factored"`` (the default) is Adafactor's rank-one estimate (Shazeer & Stern 2018,
   Eq. 4-5) over the tensor's two largest dimensions :math:`r, c`:

   .. math::

       \bar V = R\,C / \mathrm{mean}(V), \qquad R = \mathrm{mean}_{\neg r}\, V, \quad
       C = \mathrm{mean}_{\neg c}\, V,

   (means over every dimension but :math:`r`, resp. :math:`c`), kept in its compact
   shape, broadcast against the tensor; a vector or a scalar takes the mean over the
   whole tensor. ``"elementwise"`` keeps the optimizer's own :math:`V` (for measuring
   what pooling buys; its law has the faults above). Where :math:`\bar V = 0` (no
   gradient has reached the pooled elements yet) there is no scale, and no noise is
   injected (:func:`sampling_preconditioner`).
2. **Frozen.** It follows :math:`\bar V` during a warm-up of ``preconditioner_warmup``
   steps of the parameter's step count, then is frozen at the first step at temperature
   > 0 past the warm-up. A constant positive diagonal :math:`G` leaves :math:`p_T`
   invariant exactly (Ma et al.'s recipe with constant :math:`D`; :math:`\Gamma = 0`),
   whatever its value: the frozen preconditioner sets the speed, never the law. A step
   at temperature 0 (the optimizer itself) releases it, so a chain that alternates
   optimisation and sampling (a cyclical schedule, or training then sampling) freezes
   the optimizer's latest second moment. ``None`` never freezes (the law then carries
   the position-dependence that pooling leaves; measured in the benchmark).

Measured on :math:`\mathcal N(0, \mathrm{diag}(0.1^2, 1, 10^2))` with 4,000 elements
per coordinate (``benchmarks/bench_adamw_sghmc.py`` and ``bench_psgld_law.py``, whose
figures the samplers' docstrings report).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from ..core.validation import check_choice, refuse
from .definition import Hyperparameter, StateField
from .definition.arguments import LR
from .tensor_lists import add_scalar_

__all__ = [
    "FROZEN_AT",
    "FROZEN_PRECONDITIONER",
    "PRECONDITIONER",
    "PRECONDITIONERS",
    "PRECONDITIONER_WARMUP",
    "STEP",
    "advanced",
    "advanced_each",
    "check_eps",
    "check_preconditioner",
    "check_preconditioner_warmup",
    "freeze_mark",
    "freezes_now",
    "informed_noise",
    "lr_in_units_of",
    "pooled_second_moment",
    "prior_floor",
    "released",
    "sampling_preconditioner",
    "sampling_scale",
    "step_count",
    "zero_temperature_only",
]

#: how the sampling preconditioner pools the second moment
PRECONDITIONERS = ("factored", "elementwise")


def check_preconditioner(value: Any, where: str = "") -> str:
    """``"factored"`` or ``"elementwise"``; else a ``ValueError`` naming the argument."""
    return check_choice("preconditioner", value, PRECONDITIONERS, where=where)


def check_preconditioner_warmup(value: Any, where: str = "") -> int | None:
    """An integer >= 0, or None (never frozen); else an error naming the argument."""
    expected = "an integer >= 0, or None to never freeze the preconditioner"
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        refuse("preconditioner_warmup", value, expected, where, TypeError)
    if value < 0:
        refuse("preconditioner_warmup", value, expected, where)
    return int(value)


def pooled_second_moment(square: Tensor, how: str, members: int = 0) -> Tensor:
    r"""The pooled second moment :math:`\bar V` of ``square`` (module docstring).

    ``"factored"``: Adafactor's :math:`R\,C/\mathrm{mean}(V)` over the two largest
    dimensions, in its compact shape (1 in every other dimension; the mean over the
    whole tensor for fewer than two dimensions); ``"elementwise"``: ``square`` itself.
    The first ``members`` dimensions are independent members (a ``ParallelEnsemble``'s
    stack, :func:`~samplers_as_optim.names.member_dims`): each is pooled on its own. A new
    tensor (or ``square`` itself for ``"elementwise"``).
    """
    if how == "elementwise":
        return square
    every = list(range(members, square.dim()))
    if not every:
        return square.clone()
    if len(every) < 2:
        return square.mean(dim=every, keepdim=True)
    order = sorted(every, key=lambda d: (square.shape[d], d))
    row, column = sorted(order[-2:])
    rows = square.mean(dim=[d for d in every if d != row], keepdim=True)
    columns = square.mean(dim=[d for d in every if d != column], keepdim=True)
    total = rows.mean(dim=[row], keepdim=True).clamp_min(torch.finfo(square.dtype).tiny)
    return rows.mul(columns).div_(total)


def check_eps(value: Any, where: str = "") -> float:
    """The ``eps`` added to the preconditioner's root: a finite number > 0."""
    expected = "a finite number > 0"
    if isinstance(value, bool) or not isinstance(value, int | float):
        refuse("eps", value, expected, where, TypeError)
    if not (math.isfinite(value) and value > 0):
        refuse("eps", value, expected, where)
    return float(value)


def freeze_mark(flag: Any, step: float) -> Any:
    """The step of a freeze, as the same kind as ``flag`` (a 0-d CPU tensor, or a float)."""
    return torch.tensor(step, dtype=flag.dtype) if isinstance(flag, Tensor) else step


def freezes_now(frozen_at: float, step: float, warmup: int | None) -> bool:
    """Whether a parameter at ``step`` (its count after this step) freezes now.

    ``frozen_at`` is the step at which its preconditioner was frozen, 0 when it is not.
    """
    return frozen_at == 0 and warmup is not None and step >= warmup


def sampling_preconditioner(
    square: Tensor,
    *,
    correction: float,
    eps: float,
    how: str,
    inplace: bool = True,
    members: int = 0,
    floor: float = 0.0,
) -> Tensor:
    r""":math:`a = \sqrt{\max(\bar V / c, f)} + \epsilon` from the second moment ``square``.

    ``correction`` :math:`c` is the bias correction of an average started at zero
    (AdamW's :math:`1 - \beta_2^t`; 1 for RMSprop's). A new tensor in ``square``'s
    compact pooled shape (broadcastable to it). It is exactly :math:`\epsilon` where
    :math:`\bar V = 0`, where every gradient pooled so far was exactly zero
    (a LoRA factor whose partner is still zero, a dead unit, a chain started at the mode
    of a noiseless loss). There the preconditioner has no scale, :math:`a = \epsilon`
    would make the noise :math:`\sigma/\sqrt{\epsilon}` explode the chain, and the
    samplers inject no noise: such an element does not move until a gradient reaches it,
    as it would not under the optimizer. Without ``inplace`` no operation is in place
    (a graph may flow through ``square``).

    ``floor`` :math:`f` (:func:`prior_floor`: :math:`T\lambda/N` for a prior of
    curvature :math:`\lambda` per datum; 0: none) keeps :math:`a` from vanishing at a
    mode: there it also gives the elements no gradient has reached a scale, and noise.
    """
    pooled = pooled_second_moment(square, how, members)
    if not inplace or pooled is square:
        scaled = pooled / correction if correction != 1 else pooled
        scaled = scaled.clamp_min(floor) if floor > 0 else scaled
        return scaled.sqrt().add(eps)
    if correction != 1:
        pooled.div_(correction)
    if floor > 0:
        pooled.clamp_min_(floor)
    return pooled.sqrt_().add_(eps)


def prior_floor(temperature: float, prior_decay: float, num_data: int) -> float:
    r"""The floor :math:`f = T\lambda/N` of :math:`\bar V/c` a prior of curvature :math:`\lambda`.

    At stationarity each element's gradient (of the mean loss :math:`L`, :math:`U = N
    L`) has the second moment :math:`E[g_i^2] = T\,E[\partial_{ii} L]/N` (integration by
    parts: :math:`E[(\partial_i U)^2] = T\,E[\partial_{ii} U]`), and a Gaussian prior
    whose weight decay (in SGD units) is :math:`\lambda` contributes :math:`\lambda` to
    :math:`\partial_{ii} L`; a likelihood's curvature is non-negative on average for
    the models in use (its Gauss-Newton part). So :math:`T\lambda/N` bounds the
    stationary second moment from below, where a chain started at a mode (the MAP, whose
    full-batch gradient vanishes) would otherwise build its preconditioner from
    gradients near 0, and throw its elements far out with the noise :math:`\sigma/\sqrt
    a`. Any constant positive preconditioner leaves the law invariant: the floor changes
    the speed during the warm-up, never the law sampled once it is frozen.
    """
    return temperature * prior_decay / num_data if prior_decay > 0 else 0.0


def step_count(param: Tensor, group: Mapping[str, Any]) -> Tensor:
    """A step count as ``torch.optim``'s AdamW and RMSprop keep it: 0-d, CPU, float32.

    (float64 when that is torch's default dtype, as torch does.)
    """
    dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    return torch.tensor(0.0, dtype=dtype)


def advanced(count: Any, inplace: bool) -> Any:
    """``count + 1`` as the same kind: a 0-d CPU tensor (in place when ``inplace``), a float."""
    if isinstance(count, Tensor):
        return count.add_(1) if inplace else count.add(1)
    return float(count) + 1.0


def advanced_each(counts: list[Any], inplace: bool) -> list[Any]:
    """:func:`advanced` of each count; float tensors in place in one foreach call.

    (``tensor_lists.add_scalar_``: the same counts, added as torch's AdamW and RMSprop
    add theirs, without wrapping the 1 again for each tensor.)
    """
    if inplace and counts and all(type(c) is Tensor and c.is_floating_point() for c in counts):
        add_scalar_(counts, 1.0)
        return list(counts)
    return [advanced(count, inplace) for count in counts]


def released(flag: Any, inplace: bool) -> Any:
    """A frozen-at step set to 0 (the preconditioner released), as the same kind."""
    if isinstance(flag, Tensor):
        return flag.zero_() if inplace else torch.zeros_like(flag)
    return 0.0


def sampling_scale(
    square: Tensor,
    frozen: Tensor | None,
    flag: Any,
    step: float,
    *,
    correction: float,
    eps: float,
    how: str,
    warmup: int | None,
    inplace: bool,
    members: int = 0,
    floor: float = 0.0,
) -> tuple[Tensor, Tensor | None, Any]:
    """This step's sampling preconditioner :math:`a`, and the new ``(frozen, flag)``.

    ``frozen`` is the parameter's frozen :math:`a` (None before a freeze), ``flag`` the
    step at which it was frozen (0: not frozen; a 0-d CPU tensor or a float), ``step``
    its step count after this step. The frozen :math:`a` is used as it is; otherwise
    :math:`a` is :func:`sampling_preconditioner` of ``square`` and is frozen now if the
    warm-up is over (:func:`freezes_now`). ``members``: as for
    :func:`pooled_second_moment`; ``floor``: as for :func:`sampling_preconditioner`.
    """
    if float(flag) > 0 and frozen is not None:
        return frozen, frozen, flag
    scale = sampling_preconditioner(
        square,
        correction=correction,
        eps=eps,
        how=how,
        inplace=inplace,
        members=members,
        floor=floor,
    )
    if freezes_now(float(flag), step, warmup):
        return scale, scale, freeze_mark(flag, step)
    return scale, frozen, flag


def informed_noise(noise: Tensor, scale: Tensor, *, sigma: float, eps: float, root: int) -> Tensor:
    r"""``noise`` times :math:`\sigma\, a^{\pm 1/2}` (``root`` +1 or -1), :math:`a` = ``scale``.

    Zero where :math:`a` has no scale (:math:`a = \epsilon` exactly: see
    :func:`sampling_preconditioner`).
    """
    factor = scale.sqrt() if root > 0 else scale.sqrt().reciprocal()
    return noise.mul(factor.mul(sigma).masked_fill(scale == eps, 0.0))


#: the state fields of a sampler with a sampling preconditioner (PSGLD, AdamWSGHMC)
STEP = StateField(
    "step",
    "the parameter's step count t, as torch.optim's AdamW and RMSprop keep it, per leaf.",
    init=step_count,
    host=True,
)
FROZEN_PRECONDITIONER = StateField(
    "preconditioner",
    "the frozen sampling preconditioner :math:`a` per leaf (in its pooled shape; absent "
    "before the first freeze).",
)
FROZEN_AT = StateField(
    "preconditioner_step",
    "the step at which each leaf's preconditioner was frozen, 0 when it is not.",
    init=step_count,
    host=True,
)

#: the hyperparameters of the sampling preconditioner, shared by PSGLD and AdamWSGHMC
PRECONDITIONER = Hyperparameter(
    "preconditioner",
    default="factored",
    annotation="str",
    doc=r"""preconditioner: how the sampling preconditioner pools the optimizer's
            second moment at temperature > 0 (default: ``"factored"``, Adafactor's
            rank-one estimate over the two largest dimensions, so that an element weighs
            little in its own scale; ``"elementwise"``: the optimizer's own, whose law is
            biased, for comparison).""",
    transform_doc=r"""preconditioner: ``"factored"`` (default) or ``"elementwise"`` pooling
            of the sampling preconditioner.""",
    check=lambda value, where: check_preconditioner(value, where),
)
PRECONDITIONER_WARMUP = Hyperparameter(
    "preconditioner_warmup",
    default=1000,
    annotation="int | None",
    doc=r"""preconditioner_warmup: the parameter's step count after which the
            sampling preconditioner is frozen, at its first step at temperature > 0 past
            it (default: 1000; an integer >= 0; None: never frozen, which biases the
            law). A step at temperature 0 releases it.""",
    transform_doc=r"""preconditioner_warmup: the step count after which the sampling
            preconditioner is frozen (default: 1000; an integer >= 0, or None: never).""",
    check=lambda value, where: check_preconditioner_warmup(value, where),
)


def lr_in_units_of(optimizer: str, default: float) -> Hyperparameter:
    """``lr`` for a sampler whose signature is ``optimizer``'s (``"torch.optim.AdamW"``)."""
    return LR.replace(
        default=default,
        doc=rf"""lr: learning rate, in the units of ``{optimizer}`` (default: {default:g};
            a finite number >= 0, or a one-element tensor). At temperature > 0 it is also
            the sampler's step size; a group whose ``lr`` is 0 at temperature > 0 is left
            unchanged by a step (no time passes).""",
    )


def zero_temperature_only(
    name: str, default: Any, what: str, check: Callable[[Any, str], Any]
) -> Hyperparameter:
    """An option of the torch optimizer a sampler mirrors that has no sampling meaning.

    Positional as in torch, kept in the param groups and checked by ``check``; the
    sampler's own ``check`` refuses any other value than ``default`` at temperature > 0
    (``definition.arguments.sampling_meaningless``).
    """
    other = "True" if default is False else "a value other than 0"
    return Hyperparameter(
        name,
        default=default,
        annotation="bool" if isinstance(default, bool) else "float",
        doc=rf"""{name}: {what} (default: {default!r}). Has no sampling meaning:
            {other} requires temperature 0.""",
        transform_doc=rf"""{name}: {what} (default: {default!r}; temperature 0 only).""",
        check=check,
        positional=True,
    )
