r"""The pooled sampling preconditioner on the fused path: computed before the kernel, indexed in it.

PSGLD's and AdamWSGHMC's fused kernels (``psgld/triton_kernel``, ``adamw_sghmc/triton_kernel``) read
the sampling preconditioner :math:`a` of :mod:`.sampling_preconditioner` in its compact
pooled shape (1 in every dimension it is pooled over), broadcast against the tensor.
Pooling is a reduction over the whole tensor, so it cannot happen inside an elementwise
kernel: while the preconditioner follows the second moment (before its freeze), it is
computed **before** the kernel by torch operations on the device (no host
synchronisation), from this step's second moment :math:`V' = \beta V + (1-\beta)\,g'^2`,
by the very functions the reference update calls
(:func:`~.sampling_preconditioner.sampling_preconditioner`), so that it is the
reference's :math:`a` bit for bit; the kernel then recomputes :math:`V'` in registers and
writes it once. Frozen, :math:`a` is read as kept and no reduction runs.

In the kernel, element :math:`i` of a contiguous tensor (its index in the tensor, not
the global one) reads entry

.. math::

    \lfloor i / n \rfloor\, R C + (\lfloor i / s_r \rfloor \bmod R)\, C
    + \lfloor i / s_c \rfloor \bmod C

of the contiguous compact :math:`a`, with :math:`n` the elements per member
(``ParallelEnsemble``'s leading member dimensions are pooled each on its own), :math:`R,
C` the sizes of the two pooled-over dimensions kept (the rows and columns of
Adafactor's estimate) and :math:`s_r, s_c` their strides in the tensor (:class:`Layout`).
A vector (one value per member) has :math:`R = C = 1`; an unpooled (elementwise)
:math:`a` has :math:`n = 1`, :math:`R = C = 1`, so entry :math:`i` (:func:`pooled`, a
Triton function: this module, imported by the kernel modules only, imports Triton).

The two kernels launch alike, one launch per tensor: the step count advanced, :math:`a`
of this step (:func:`kernel_preconditioner`, of the sampler's :class:`Moment`), then the
kernel with its layout (:func:`launch_alone`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ...names import member_dims
from ..sampling_preconditioner import (
    freeze_mark,
    freezes_now,
    released,
    sampling_preconditioner,
)
from .io import jit, tl
from .launch import (
    FusedInput,
    KernelArg,
    Part,
    as_float64_bits,
    group_flags,
    launch_elementwise,
    torch_gradient,
)

__all__ = [
    "Layout",
    "Moment",
    "compact_layout",
    "kernel_preconditioner",
    "launch_alone",
    "layout",
    "pooled",
    "preconditioner_before_kernel",
    "refused_step_fallback",
    "second_moment",
]


class Layout(NamedTuple):
    """Where element ``i`` of a tensor finds its entry of the compact pooled ``a``."""

    inner: int
    row_stride: int
    rows: int
    column_stride: int
    columns: int


#: the layout of a full-size ``a`` (entry ``i``), passed too where the kernel reads none
_UNPOOLED = Layout(1, 1, 1, 1, 1)


def layout(param: Tensor, how: str) -> Layout:
    """The :class:`Layout` of the compact ``a`` that ``pooled_second_moment`` gives ``param``.

    Mirrors :func:`~.sampling_preconditioner.pooled_second_moment`: ``"elementwise"`` or
    no pooled dimension: entry ``i``; one pooled dimension: one value per member;
    otherwise the two largest dimensions (the later one on a tie), kept.
    """
    members = member_dims(param)
    shape = tuple(param.shape)
    every = list(range(members, len(shape)))
    if how == "elementwise" or not every:
        return _UNPOOLED
    inner = math.prod(shape[members:])
    if len(every) < 2:
        return Layout(inner, 1, 1, 1, 1)
    order = sorted(every, key=lambda d: (shape[d], d))
    row, column = sorted(order[-2:])
    rows, columns = shape[row], shape[column]
    return Layout(inner, math.prod(shape[row + 1 :]), rows, math.prod(shape[column + 1 :]), columns)


@jit
def pooled(
    pre: KernelArg, index: KernelArg, mask: KernelArg, inner: KernelArg, row_stride: KernelArg,
    rows: KernelArg, column_stride: KernelArg, columns: KernelArg,
) -> KernelArg:  # fmt: skip
    """In a kernel: each element's entry of the compact ``a`` at ``pre`` (the module docstring).

    ``inner`` to ``columns``: the tensor's :class:`Layout`; 1 where ``mask`` is off.
    """
    member = index // inner
    entry = member * (rows * columns) + ((index // row_stride) % rows) * columns
    entry = entry + (index // column_stride) % columns
    return tl.load(pre + entry, mask=mask, other=1.0)


@jit
def second_moment(
    square: KernelArg, g64: KernelArg, beta: KernelArg, p: KernelArg, index: KernelArg,
    mask: KernelArg,
) -> KernelArg:  # fmt: skip
    r"""In a kernel: this step's :math:`V' = \beta V + (1-\beta)\,g'^2` (``_second_moment``).

    In float64 from the kept :math:`V`, rounded to the position ``p``'s dtype, as RMSprop
    and AdamW keep it.
    """
    v = tl.load(square + index, mask=mask).to(tl.float64)
    return (beta * v + (1.0 - beta) * g64 * g64).to(p.dtype)


def compact_layout(param: Tensor, pre: Tensor) -> Layout:
    """The layout of a kept or computed compact ``a`` (entry ``i`` when it is full-size).

    Raises:
        ValueError: ``pre`` has neither ``param``'s size nor its pooled size (a state
            loaded from another parameter).
    """
    if pre.numel() == param.numel():
        return _UNPOOLED
    found = layout(param, "factored")
    if pre.numel() * found.inner != param.numel() * found.rows * found.columns:
        raise ValueError(
            f"Invalid preconditioner: a tensor of shape {tuple(pre.shape)} (expected the "
            f"pooled shape of a parameter of shape {tuple(param.shape)}, or that shape)"
        )
    return found


def _second_moment(
    square: Tensor,
    grad: Tensor,
    param: Tensor,
    *,
    beta: float,
    weight_decay: float,
    maximize: bool,
) -> Tensor:
    """This step's :math:`V'` as the reference computes it (a new tensor; nothing changes)."""
    g = -grad if maximize else grad
    if weight_decay != 0:
        g = g.add(param, alpha=weight_decay)
    return square.mul(beta).addcmul_(g, g, value=1 - beta)


def preconditioner_before_kernel(
    square: Tensor,
    grad: Tensor,
    param: Tensor,
    *,
    beta: float,
    correction: float,
    eps: float,
    how: str,
    weight_decay: float,
    maximize: bool,
    floor: float = 0.0,
) -> Tensor:
    r"""This step's compact sampling preconditioner :math:`a`, on the device, no sync.

    :math:`a = \sqrt{\bar V'/c} + \epsilon` with :math:`V' = \beta V + (1-\beta)\,g'^2`,
    :math:`g' = \pm g + \lambda\theta` (``weight_decay`` :math:`\lambda`: PSGLD's coupled
    decay; 0 for AdamW's decoupled one) and :math:`c` = ``correction`` (AdamW's
    :math:`1-\beta_2^t`, 1 for RMSprop's), pooled as ``how`` says, floored by ``floor``
    (``sampling_preconditioner``). Contiguous.
    """
    moment = _second_moment(
        square, grad, param, beta=beta, weight_decay=weight_decay, maximize=maximize
    )
    members = member_dims(param)
    scale = sampling_preconditioner(
        moment, correction=correction, eps=eps, how=how, members=members, floor=floor
    )
    return scale.contiguous()


def refused_step_fallback(
    fresh: Tensor,
    square: Tensor,
    param: Tensor,
    largest: Tensor,
    *,
    correction: float,
    eps: float,
    how: str,
    floor: float = 0.0,
) -> Tensor:
    r"""The preconditioner to freeze now: ``fresh``, or the old moment's if the step is refused.

    A step whose gradients are not finite writes nothing (the device flag ``largest``);
    if it was to freeze the preconditioner, what is frozen must not come from those
    gradients. Where the flag is not finite this gives :math:`\sqrt{\bar V/c} +
    \epsilon` of the second moment ``square`` the refused step leaves, so that the state
    stays finite until the verdict reaches the host, which then undoes the freeze with
    the step's host record (skipped or refused alike: ``step/skipped_host``). Selected on
    the device (``torch.where``), without a host synchronisation.
    """
    members = member_dims(param)
    old = sampling_preconditioner(
        square, correction=correction, eps=eps, how=how, inplace=False, members=members, floor=floor
    )
    finite = largest.isfinite().reshape(())
    return torch.where(finite, fresh, old.to(fresh.dtype)).contiguous()


class Moment(NamedTuple):
    r"""The second moment a kernel's preconditioner follows (:func:`kernel_preconditioner`).

    The defaults are RMSprop's (PSGLD's): no bias correction, no root kept.

    Attributes:
        square: the state field holding it, :math:`V`.
        beta: its decay, :math:`V' = \beta V + (1-\beta)\,g'^2`.
        correction: its bias correction :math:`c` at this step (AdamW's :math:`1-\beta_2^t`).
        before: the correction of the moment a refused step leaves.
        weight_decay: the decay in :math:`g'` (PSGLD's coupled one; 0 where it is decoupled).
        root: whether the frozen :math:`\sqrt{a}` is kept too (AdamWSGHMC's).
        floor: ``sampling_preconditioner``'s (the prior's share of the second moment).
    """

    square: str
    beta: float
    correction: float = 1.0
    before: float = 1.0
    weight_decay: float = 0.0
    root: bool = False
    floor: float = 0.0


def kernel_preconditioner(
    group: Mapping[str, Any],
    inputs: FusedInput,
    part: Part,
    buffers: dict[str, list[Any]],
    moment: Moment,
) -> tuple[Tensor | None, Layout]:
    r"""The compact :math:`a` the kernel of ``part``'s one parameter :math:`i` reads; its layout.

    For PSGLD's and AdamWSGHMC's launches, after the step count ``buffers["step"][i]``
    was advanced; the state fields are advanced in ``buffers``. None (the kernel then
    computes :math:`a` in registers, or AdamW's denominator): at temperature 0, where
    the preconditioner is released, and for ``"elementwise"`` before its freeze.
    Frozen (its mark set, and with ``moment.root`` its root kept), :math:`a` as kept;
    else this step's (:func:`preconditioner_before_kernel` of the second ``moment``),
    which, at the step the warm-up ends, freezes: the preconditioner kept is
    :func:`refused_step_fallback`'s (of the moment a refused step leaves), and with
    ``root`` its :math:`\sqrt{a}` (0 where :math:`a` has no scale, as AdamWSGHMC's
    reference keeps it). Where ``moment.floor`` is set, an ``"elementwise"`` :math:`a`
    is computed here too.
    """
    (i,) = part.members
    (position,) = part.positions(inputs)
    square, beta, correction, before, weight_decay, root, floor = moment
    flag, frozen = buffers["preconditioner_step"][i], buffers["preconditioner"][i]
    eps, how, maximize = float(group["eps"]), group["preconditioner"], bool(group["maximize"])
    param, second = inputs.params[i], buffers[square][i]
    if float(group["temperature"]) == 0:
        buffers["preconditioner_step"][i] = released(flag, True)
        return None, _UNPOOLED
    kept = frozen is not None and (not root or buffers["preconditioner_root"][i] is not None)
    if float(flag) > 0 and kept:
        return frozen, compact_layout(param, frozen)
    step = float(buffers["step"][i])
    freeze = freezes_now(float(flag), step, group["preconditioner_warmup"])
    if how == "elementwise" and not freeze and floor == 0:
        return None, _UNPOOLED
    pre = preconditioner_before_kernel(
        second,
        torch_gradient(inputs, i),
        position,
        beta=beta,
        correction=correction,
        eps=eps,
        how=how,
        weight_decay=weight_decay,
        maximize=maximize,
        floor=floor,
    )
    if freeze:
        fallback = refused_step_fallback(
            pre, second, param, inputs.largest[i], correction=before, eps=eps, how=how, floor=floor
        )
        buffers["preconditioner"][i] = fallback
        if root:
            buffers["preconditioner_root"][i] = fallback.sqrt().masked_fill(fallback == eps, 0.0)
        buffers["preconditioner_step"][i] = freeze_mark(flag, step)
    return pre, compact_layout(param, pre)


def launch_alone(
    kernel: Callable[..., Any],
    group: Mapping[str, Any],
    inputs: FusedInput,
    part: Part,
    tensors: Sequence[Tensor | None],
    scalars: Sequence[float],
    where: Layout,
    **constants: Any,
) -> None:
    """Launch PSGLD's or AdamWSGHMC's ``kernel`` on ``part``'s one parameter.

    Called as ``kernel(param, grad, *tensors, largest, position, grad_scale, numel,
    offset, seed, *scalars, *where, ...)``: a tensor None (a buffer an option does not
    keep) is given as the parameter, never read; the scalars as float64
    (``fused/launch.as_float64_bits``); ``where`` the compact :math:`a`'s layout. The
    compile-time arguments ``MAXIMIZE``, ``DECAY`` (``fused/launch.group_flags``),
    ``constants`` and ``part.flags()``; not specialised on the numel, the noise's
    offset and key and the layout.
    """
    (i,) = part.members
    param = inputs.params[i]
    launch_elementwise(
        kernel,
        param,
        inputs.grads[i],
        *(param if tensor is None else tensor for tensor in tensors),
        inputs.largest[i],
        *part.positions(inputs),
        part.scale_argument(inputs),
        param.numel(),
        inputs.offsets[i],
        inputs.seeds[i],
        *(as_float64_bits(value) for value in scalars),
        *where,
        do_not_specialize=("numel", "offset", "seed", *Layout._fields),
        **group_flags(group),
        **constants,
        **part.flags(),
    )
