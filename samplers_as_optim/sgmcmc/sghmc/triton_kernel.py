r"""SGHMC's fused Triton kernel: ``sghmc.sghmc_direction`` and the step in one pass.

Per element, with :math:`g' = \pm g + \lambda\theta` rounded to the parameter's dtype and
:math:`\sigma = \sqrt{2(1-\mu)T/(N\,lr)}`, in float64 as ``torch.optim.SGD(fused=True)``
computes its buffer:

.. math::

    b \leftarrow \mu\, b + (1 - \text{dampening})\, g' + \sigma\,\xi
    \quad (b \leftarrow g' + \sigma\,\xi \text{ at the first step}), \qquad
    \theta \leftarrow \theta - lr\, d,

with :math:`d = b` rounded to the parameter's dtype (:math:`g' + \mu b` with
``nesterov``), :math:`\xi = \texttt{tl.randn}(seed, \text{global index})`, the buffer
stored in its dtype and :math:`\theta` rounded once. The kernel runs at :math:`T > 0`;
at :math:`T = 0` the launch hands the step to torch's own fused SGD op
(``fused/launch.torch_fused_sgd``), dampening and Nesterov included. It reads
:math:`\theta`, :math:`g` and :math:`b` once and writes :math:`\theta` and :math:`b`
once; nothing is written when the step's flag (the largest absolute gradient) is not
finite. With ``momentum=0`` it is SGLD's kernel, as the reference update is SGLD's. Small
tensors share launches (``fused/launch.launch_tensors``), each with its own noise key:
the numbers of one launch per tensor.

Mixed precision (``fused/launch``'s module docstring): with a GradScaler scale
:math:`s` the gradient is read as :math:`g/s` (float64 division, rounded once to the
position's dtype); a float16/bfloat16 parameter with a float32 master steps on the
master, as a float32 parameter would, and receives its rounding to nearest. (One
without a master exists at temperature 0 only, where torch's op steps it: the kernel
has no ``NARROW`` variant.)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from ..fused import io as fio
from ..fused.launch import (
    FusedInput,
    KernelArg,
    as_float64_bits,
    constexpr,
    launch_tensors,
    parts,
    torch_fused_sgd,
)
from ..fused.launch import optional_module as _optional_module
from ..noise_scales import sghmc_noise_scale
from ..sgld import triton_kernel as _sgld_fused

__all__ = ["launch", "unsupported"]

tl: Any = _optional_module("triton.language")

#: arguments whose values change between steps: not specialised on (one compiled kernel)
_VARYING = (
    "count",
    "programs",
    "offset",
    "seed",
    "lr_bits",
    "momentum_bits",
    "gain_bits",
    "decay_bits",
    "scale_bits",
)


def _sghmc(
    table: KernelArg,
    count: KernelArg,
    programs: KernelArg,
    numel: KernelArg,
    offset: KernelArg,
    seed: KernelArg,
    param: KernelArg,
    grad: KernelArg,
    buffer: KernelArg,
    largest: KernelArg,
    master: KernelArg,
    grad_scale: KernelArg,
    lr_bits: KernelArg,
    momentum_bits: KernelArg,
    gain_bits: KernelArg,
    decay_bits: KernelArg,
    scale_bits: KernelArg,
    BLOCK: constexpr,  # noqa: N803
    MULTI: constexpr,  # noqa: N803
    MAXIMIZE: constexpr,  # noqa: N803
    DECAY: constexpr,  # noqa: N803
    FIRST: constexpr,  # noqa: N803
    NESTEROV: constexpr,  # noqa: N803
    UNSCALE: constexpr,  # noqa: N803
    MASTER: constexpr,  # noqa: N803
    BF16: constexpr,  # noqa: N803
) -> None:
    _, rows, index, mask, offset, seed = fio.this_block(
        table, count, programs, numel, offset, seed, largest, 6, BLOCK, MULTI
    )
    param, position, p, g = fio.read_inputs(
        rows, count, param, grad, master, 7, grad_scale, index, mask, MULTI, UNSCALE, MASTER, False
    )
    g = fio.effective_gradient(g, p, decay_bits, MAXIMIZE, DECAY)
    momentum = fio.float64(momentum_bits)
    buffer = fio.column(rows, count, 5, buffer, MULTI)
    if FIRST:
        b = g.to(tl.float64)
    else:
        old = tl.load(buffer + index, mask=mask)
        b = momentum * old.to(tl.float64) + fio.float64(gain_bits) * g.to(tl.float64)
    xi = fio.normal(seed, offset, index)  # (T > 0 only: at T = 0 torch's fused SGD steps)
    b = b + fio.float64(scale_bits) * xi.to(tl.float64)
    tl.store(buffer + index, b.to(buffer.dtype.element_ty), mask=mask)
    d = (g.to(tl.float64) + momentum * b).to(p.dtype) if NESTEROV else b.to(p.dtype)
    new = (p.to(tl.float64) - fio.float64(lr_bits) * d.to(tl.float64)).to(p.dtype)
    fio.store_position(param, position, new, index, mask, MASTER, False, BF16)


def unsupported(group: Mapping[str, Any], temperature: float) -> str | None:
    """Every SGHMC option is supported."""
    return None


def launch(group: Mapping[str, Any], inputs: FusedInput) -> Mapping[str, list[Tensor]]:
    """Take SGHMC's step on every tensor of ``inputs`` in place (small ones share launches).

    A buffer the step creates (the first step, as SGD's) starts as zeros, which a step
    skipped for a non-finite gradient leaves, as the unfused step does.
    """
    momentum = float(group["momentum"])
    if momentum == 0:  # SGLD, keeping no buffer (as torch.optim.SGD)
        return _sgld_fused.launch(group, inputs)
    lr, temperature = float(group["lr"]), float(group["temperature"])
    weight_decay = float(group["weight_decay"])
    buffers: list[Tensor] = []
    created: list[bool] = []
    for buffer, position in zip(inputs.buffers["momentum_buffer"], _positions(inputs), strict=True):
        created.append(buffer is None)
        if buffer is None:  # (float32 beside a master)
            buffer = torch.zeros_like(position, memory_format=torch.contiguous_format)
        buffers.append(buffer)
    if temperature == 0:  # torch.optim.SGD(fused=True)'s own step
        torch_fused_sgd(group, inputs, buffers, created)
        return {"momentum_buffer": buffers}
    scale = sghmc_noise_scale(lr, momentum, temperature, group["num_data"])
    for part in parts(inputs):
        for first in (True, False):  # FIRST is a compile-time argument: one call for each
            chosen = [i for i in part.members if created[i] is first]
            if not chosen:
                continue
            here = part._replace(members=chosen)
            assert not here.narrow  # (a half parameter keeps a master at T > 0)
            launch_tensors(
                _sghmc,
                [here.take(column) for column in (inputs.params, inputs.grads, buffers)]
                + [here.take(inputs.largest), here.positions(inputs)],
                here.scale_argument(inputs),
                as_float64_bits(lr),
                as_float64_bits(momentum),
                as_float64_bits(1.0 - float(group["dampening"])),
                as_float64_bits(weight_decay),
                as_float64_bits(scale),
                offsets=here.take(inputs.offsets),
                seeds=here.take(inputs.seeds),
                do_not_specialize=_VARYING,
                MAXIMIZE=bool(group["maximize"]),
                DECAY=weight_decay != 0,
                FIRST=first,
                NESTEROV=bool(group["nesterov"]),
                **here.flags(),
            )
    return {"momentum_buffer": buffers}


def _positions(inputs: FusedInput) -> list[Tensor]:
    """Each parameter's position: its master, or itself."""
    masters = inputs.masters or [None] * len(inputs.params)
    return [param if m is None else m for param, m in zip(inputs.params, masters, strict=True)]
