r"""PSGLD's fused Triton kernel: ``psgld.psgld_direction`` and the step in one pass.

Per element (:math:`g'`, :math:`\xi` and what every kernel does alike: ``fused/io``'s
module docstring), in float64 and rounded where the state is stored:

.. math::

    V \leftarrow \alpha V + (1-\alpha)\, g'^2, \qquad
    d = g'/a + \sigma\,\xi/\sqrt{a} \;\big[{} - (T/N)\,\Gamma\big], \qquad
    \theta \leftarrow \theta - lr\, d,

with :math:`\sigma = \sqrt{2T/(N\,lr)}`, no noise where :math:`a = \epsilon` (a
preconditioner without scale, :func:`~.sampling_preconditioner.sampling_preconditioner`),
and :math:`a` the sampling preconditioner of :mod:`.sampling_preconditioner` (Li et al.
2016, Algorithm 1, with the pooled and frozen :math:`a` of this package's default):

* frozen: the kept compact :math:`a`, read broadcast (``fused/pooled``);
* ``"factored"`` before its freeze: :math:`a = \sqrt{\bar V'} + \epsilon` of this step's
  :math:`V'` pooled, computed before the kernel by torch operations on the device (a
  reduction over the tensor: no elementwise kernel can do it), as the reference
  computes it; frozen at the step the warm-up ends;
* ``"elementwise"`` (Li et al.'s own): :math:`a = \sqrt{V'} + \epsilon` in registers;
  with ``correction=True`` Li et al.'s :math:`\Gamma` from the secant of the last step
  (``psgld/li_correction``), reading and writing the previous parameter and gradient.

At temperature 0 it is RMSprop's step, ``momentum`` (:math:`b \leftarrow \mu b + g'/a`,
:math:`\theta \leftarrow \theta - lr\,b`) and ``centered`` (:math:`a = \sqrt{V - \bar
g^2} + \epsilon`, :math:`\bar g \leftarrow \bar g + (1-\alpha)(g' - \bar g)`) included,
computed in float64 and rounded once, so equal to ``torch.optim.RMSprop`` up to its
roundings (which round each operation in the parameter's dtype). One launch per
tensor. The step counts and the freeze marks are host numbers, advanced in Python as the
reference advances them.

``launch`` takes the Optimizer's step (the parameter written in place); ``launch`` with
``updates`` (the transforms' fused path) writes the update :math:`-lr\,d` there instead
and leaves the parameter unchanged. Checked through Triton's interpreter on the CPU only
(``tests/test_fused_adaptive.py``): compiled for an sm_90 GPU by Triton's compiler
(``tests/test_fused_transforms.py``), no GPU has run it yet.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from ..fused import io as fio
from ..fused.io import tl
from ..fused.launch import FusedInput, KernelArg, Part, constexpr, parts
from ..fused.pooled import Moment, kernel_preconditioner, launch_alone, pooled, second_moment
from ..sampling_preconditioner import advanced, prior_floor
from .dtypes import psgld_noise_scale

__all__ = ["launch", "unsupported"]


def _psgld(
    param: KernelArg, grad: KernelArg, square: KernelArg, pre: KernelArg,
    momentum_buffer: KernelArg, grad_avg: KernelArg,
    previous_param: KernelArg, previous_grad: KernelArg, out: KernelArg,
    largest: KernelArg, master: KernelArg, grad_scale: KernelArg,
    numel: KernelArg, offset: KernelArg, seed: KernelArg,
    lr_bits: KernelArg, alpha_bits: KernelArg, eps_bits: KernelArg, decay_bits: KernelArg,
    scale_bits: KernelArg, momentum_bits: KernelArg, gamma_bits: KernelArg,
    inner: KernelArg, row_stride: KernelArg, rows: KernelArg,  # (fused/pooled.Layout)
    column_stride: KernelArg, columns: KernelArg,
    BLOCK: constexpr, MAXIMIZE: constexpr, DECAY: constexpr, NOISE: constexpr,  # noqa: N803
    POOLED: constexpr, MOMENTUM: constexpr, CENTERED: constexpr,  # noqa: N803
    CORRECTION: constexpr, UPDATE: constexpr,  # noqa: N803
    UNSCALE: constexpr, MASTER: constexpr, NARROW: constexpr, BF16: constexpr,  # noqa: N803
) -> None:  # fmt: skip
    """The step of this program's block: :math:`V`, :math:`a`, then :math:`d` (and its state)."""
    index, mask = fio.elements(tl.program_id(0).to(tl.int64), numel, largest, BLOCK)
    lr, alpha, eps = fio.float64(lr_bits), fio.float64(alpha_bits), fio.float64(eps_bits)
    position, p, g = fio.position_and_gradient(
        param, master, grad, grad_scale, index, mask, UNSCALE, MASTER, NARROW
    )
    g = fio.effective_gradient(g, p, decay_bits, MAXIMIZE, DECAY)
    g64 = g.to(tl.float64)
    v = second_moment(square, g64, alpha, p, index, mask)
    fio.store_state(square, v, index, mask, NARROW, BF16)
    v64 = v.to(tl.float64)
    if POOLED:
        a = pooled(pre, index, mask, inner, row_stride, rows, column_stride, columns)
        a = a.to(tl.float64)
    elif CENTERED:
        a = _centered(grad_avg, g64, v64, p, alpha, eps, index, mask, NARROW, BF16)
    else:
        a = (tl.sqrt(v64) + eps).to(p.dtype).to(tl.float64)
    d = g64 / a
    if MOMENTUM:
        b = tl.load(momentum_buffer + index, mask=mask).to(tl.float64)
        b = (fio.float64(momentum_bits) * b + d).to(p.dtype)
        fio.store_state(momentum_buffer, b, index, mask, NARROW, BF16)
        d = b.to(tl.float64)
    if NOISE:
        xi = fio.normal(seed, offset, index).to(tl.float64)
        eps_here = eps.to(p.dtype).to(tl.float64)  # (a = eps: no scale, no noise)
        d = d + tl.where(a == eps_here, 0.0, fio.float64(scale_bits) * xi / tl.sqrt(a))
    if CORRECTION:
        gamma = _li_gamma(previous_param, previous_grad, p, g, g64, v64, a, alpha, index, mask)
        d = d - fio.float64(gamma_bits) * gamma
    fio.store_step(out, param, position, p, lr, d, index, mask, UPDATE, MASTER, NARROW, BF16)


@fio.jit
def _centered(
    grad_avg: KernelArg, g64: KernelArg, v64: KernelArg, p: KernelArg, alpha: KernelArg,
    eps: KernelArg, index: KernelArg, mask: KernelArg,
    NARROW: constexpr, BF16: constexpr,  # noqa: N803
) -> KernelArg:  # fmt: skip
    r"""``centered``'s :math:`a = \sqrt{V - \bar g^2} + \epsilon`, :math:`\bar g` moved and stored.

    :math:`\bar g \leftarrow \bar g + (1-\alpha)(g' - \bar g)`, as ``torch.optim.RMSprop``.
    """
    mean = tl.load(grad_avg + index, mask=mask).to(tl.float64)
    mean = (mean + (1.0 - alpha) * (g64 - mean)).to(p.dtype)
    fio.store_state(grad_avg, mean, index, mask, NARROW, BF16)
    mean64 = mean.to(tl.float64)
    return (tl.sqrt(v64 - mean64 * mean64) + eps).to(p.dtype).to(tl.float64)


@fio.jit
def _li_gamma(
    previous_param: KernelArg, previous_grad: KernelArg, p: KernelArg, g: KernelArg, g64: KernelArg,
    v64: KernelArg, a: KernelArg, alpha: KernelArg, index: KernelArg, mask: KernelArg,
) -> KernelArg:  # fmt: skip
    r"""Li et al.'s :math:`\Gamma` from the secant of the last step (``psgld/li_correction``).

    The curvature :math:`(g' - g'_{-1}) / (\theta - \theta_{-1})` (0 where the parameter
    did not move), :math:`\Gamma = -(1-\alpha)\, g' \cdot \text{curvature} / (a^2
    \sqrt{V})` (0 where :math:`V = 0`); this step's parameter and gradient are stored
    for the next.
    """
    moved = p.to(tl.float64) - tl.load(previous_param + index, mask=mask).to(tl.float64)
    last = tl.load(previous_grad + index, mask=mask).to(tl.float64)
    curvature = tl.where(moved != 0.0, (g64 - last) / tl.where(moved != 0.0, moved, 1.0), 0.0)
    root = tl.sqrt(v64)
    safe = tl.where(root > 0.0, root, 1.0)
    gamma = tl.where(root > 0.0, -(1.0 - alpha) * g64 * curvature / (a * a * safe), 0.0)
    tl.store(previous_param + index, p.to(previous_param.dtype.element_ty), mask=mask)
    tl.store(previous_grad + index, g.to(previous_grad.dtype.element_ty), mask=mask)
    return gamma


def unsupported(group: Mapping[str, Any], temperature: float) -> str | None:
    """Every PSGLD option is supported (``capturable`` is refused by the sampler itself)."""
    return None


def launch(
    group: Mapping[str, Any], inputs: FusedInput, updates: list[Tensor] | None = None
) -> Mapping[str, list[Any]]:
    r"""Take PSGLD's step on every tensor of ``inputs`` in place (one launch per tensor).

    Returns every state field of ``inputs.buffers`` (the step counts advanced, a
    preconditioner frozen or released). With ``updates`` (one contiguous tensor per
    parameter), write :math:`-lr\,d` there and leave the parameters unchanged.
    """
    lr, temperature, num_data = float(group["lr"]), float(group["temperature"]), group["num_data"]
    alpha, decay = float(group["alpha"]), float(group["weight_decay"])
    floor = prior_floor(temperature, decay, num_data)
    moment = Moment("square_avg", alpha, weight_decay=decay, floor=floor)
    noise = psgld_noise_scale(lr, temperature, num_data)
    scalars = (lr, alpha, group["eps"], decay, noise, group["momentum"], temperature / num_data)
    buffers: dict[str, list[Any]] = {name: list(v) for name, v in inputs.buffers.items()}
    for part in parts(inputs):
        for i in part.members:
            alone = part.alone(i)
            buffers["step"][i] = advanced(buffers["step"][i], True)
            pre, where = kernel_preconditioner(group, inputs, alone, buffers, moment)
            tensors, flags = _options(group, alone, buffers, pre, updates)
            launch_alone(_psgld, group, inputs, alone, tensors, scalars, where, **flags)
    return buffers


def _options(
    group: Mapping[str, Any],
    part: Part,
    buffers: dict[str, list[Any]],
    pre: Tensor | None,
    updates: list[Tensor] | None,
) -> tuple[list[Tensor | None], dict[str, bool]]:
    """The kernel's tensors after the gradient (None: not kept) and the flags they set.

    Of ``part``'s one parameter :math:`i`.
    """
    (i,) = part.members
    temperature = float(group["temperature"])
    momentum = float(group["momentum"])
    momentum_buffer = buffers["momentum_buffer"][i] if temperature == 0 and momentum else None
    grad_avg = buffers["grad_avg"][i] if temperature == 0 and group["centered"] else None
    correction = bool(group["correction"]) and temperature > 0
    previous = (buffers["previous_param"][i], buffers["previous_grad"][i]) if correction else None
    out = None if updates is None else updates[i]
    tensors = [buffers["square_avg"][i], pre, momentum_buffer, grad_avg, *(previous or [None] * 2)]
    flags = {
        "NOISE": temperature > 0,
        "POOLED": pre is not None,
        "MOMENTUM": momentum_buffer is not None,
        "CENTERED": grad_avg is not None,
        "CORRECTION": previous is not None,
        "UPDATE": out is not None,
        "NARROW": part.narrow,
    }
    return [*tensors, out], flags
