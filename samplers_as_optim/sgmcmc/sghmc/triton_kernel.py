r"""SGHMC's fused Triton kernel: ``sghmc.sghmc_direction`` and the step in one pass.

Per element, with :math:`\sigma = \sqrt{2(1-\mu)T/(N\,lr)}`, in float64 as
``torch.optim.SGD(fused=True)`` computes its buffer (:math:`g'`, :math:`\xi` and what
every kernel does alike: ``fused/io``'s module docstring):

.. math::

    b \leftarrow \mu\, b + (1 - \text{dampening})\, g' + \sigma\,\xi
    \quad (b \leftarrow g' + \sigma\,\xi \text{ at the first step}), \qquad
    \theta \leftarrow \theta - lr\, d,

with :math:`d = b` rounded to the parameter's dtype (:math:`g' + \mu b` with
``nesterov``). The kernel runs at :math:`T > 0`; at :math:`T = 0` the launch hands the
step to torch's own fused SGD op (``fused/launch.torch_fused_sgd``), dampening, Nesterov
and a half parameter without master included (the kernel has no ``NARROW`` variant).
With ``momentum=0`` it is SGLD's kernel, as the reference update is SGLD's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from ..definition.noise_scales import sghmc_noise_scale
from ..fused import io as fio
from ..fused.io import tl
from ..fused.launch import FusedInput, KernelArg, constexpr, parts, positions, torch_fused_sgd
from ..sgld import triton_kernel as _sgld_fused

__all__ = ["launch", "unsupported"]


def _sghmc(
    table: KernelArg, count: KernelArg, programs: KernelArg,  # (fused/launch.launch_tensors)
    numel: KernelArg, offset: KernelArg, seed: KernelArg,
    param: KernelArg, grad: KernelArg, buffer: KernelArg, largest: KernelArg, master: KernelArg,
    grad_scale: KernelArg, lr_bits: KernelArg, momentum_bits: KernelArg, gain_bits: KernelArg,
    decay_bits: KernelArg, scale_bits: KernelArg,
    BLOCK: constexpr, MULTI: constexpr, MAXIMIZE: constexpr, DECAY: constexpr,  # noqa: N803
    FIRST: constexpr, NESTEROV: constexpr,  # noqa: N803
    UNSCALE: constexpr, MASTER: constexpr, BF16: constexpr,  # noqa: N803
) -> None:  # fmt: skip
    r"""The step of this program's block: the buffer :math:`b`, then :math:`\theta - lr\,d`.

    Columns (``fused/io.this_block``): 3 param, 4 grad, 5 buffer, 6 largest, 7 master.
    """
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
    fio.store_state(buffer, b, index, mask, False, BF16)
    d = (g.to(tl.float64) + momentum * b).to(p.dtype) if NESTEROV else b.to(p.dtype)
    fio.store_moved(param, position, p, fio.float64(lr_bits), d, index, mask, MASTER, False, BF16)


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
    buffers: list[Tensor] = []
    created: list[bool] = []
    for buffer, position in zip(inputs.buffers["momentum_buffer"], positions(inputs), strict=True):
        created.append(buffer is None)
        if buffer is None:  # (float32 beside a master)
            buffer = torch.zeros_like(position, memory_format=torch.contiguous_format)
        buffers.append(buffer)
    if temperature == 0:  # torch.optim.SGD(fused=True)'s own step
        torch_fused_sgd(group, inputs, buffers, created)
        return {"momentum_buffer": buffers}
    scale = sghmc_noise_scale(lr, momentum, temperature, group["num_data"])
    scalars = (lr, momentum, 1.0 - float(group["dampening"]), group["weight_decay"], scale)
    nesterov = bool(group["nesterov"])
    for part in parts(inputs):
        for first in (True, False):  # FIRST is a compile-time argument: one call for each
            chosen = [i for i in part.members if created[i] is first]
            if not chosen:
                continue
            here = part._replace(members=chosen)
            assert not here.narrow  # (a half parameter keeps a master at T > 0)
            columns = [buffers, inputs.largest]
            here.launch_members(
                _sghmc, group, inputs, columns, *scalars, FIRST=first, NESTEROV=nesterov
            )
    return {"momentum_buffer": buffers}
