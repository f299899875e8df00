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
stored in its dtype and :math:`\theta` rounded once. At :math:`T = 0` no noise is drawn
and the step is torch's fused SGD step, dampening and Nesterov included. It reads
:math:`\theta`, :math:`g` and :math:`b` once and writes :math:`\theta` and :math:`b`
once; nothing is written when the step's flag (the largest absolute gradient) is not
finite. With ``momentum=0`` it is SGLD's kernel, as the reference update is SGLD's. One
launch per tensor.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from . import _sgld_fused
from ._fused_launch import FusedInput, as_float64_bits, constexpr, launch_elementwise
from ._fused_launch import optional_module as _optional_module
from .sghmc import sghmc_noise_scale

__all__ = ["launch", "unsupported"]

tl: Any = _optional_module("triton.language")

#: arguments whose values change between steps: not specialised on (one compiled kernel)
_VARYING = ("offset", "seed", "lr_bits", "momentum_bits", "gain_bits", "decay_bits", "scale_bits")


def _sghmc(
    param: Any,
    grad: Any,
    buffer: Any,
    largest: Any,
    numel: Any,
    offset: Any,
    seed: Any,
    lr_bits: Any,
    momentum_bits: Any,
    gain_bits: Any,
    decay_bits: Any,
    scale_bits: Any,
    BLOCK: constexpr,  # noqa: N803
    MAXIMIZE: constexpr,  # noqa: N803
    DECAY: constexpr,  # noqa: N803
    FIRST: constexpr,  # noqa: N803
    NESTEROV: constexpr,  # noqa: N803
    NOISE: constexpr,  # noqa: N803
) -> None:
    index = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    # nothing is read or written unless every gradient is finite: the largest absolute
    # gradient is at most the largest float64 (false for NaN and infinity)
    worst = tl.load(largest)
    mask = index < tl.where(worst <= 1.7976931348623157e308, numel, 0)
    lr = lr_bits.to(tl.int64).to(tl.float64, bitcast=True)
    momentum = momentum_bits.to(tl.int64).to(tl.float64, bitcast=True)
    p = tl.load(param + index, mask=mask)
    g = tl.load(grad + index, mask=mask)
    if MAXIMIZE:
        g = -g
    if DECAY:
        decay = decay_bits.to(tl.int64).to(tl.float64, bitcast=True)
        g = (g.to(tl.float64) + decay * p.to(tl.float64)).to(p.dtype)
    if FIRST:
        b = g.to(tl.float64)
    else:
        gain = gain_bits.to(tl.int64).to(tl.float64, bitcast=True)
        old = tl.load(buffer + index, mask=mask)
        b = momentum * old.to(tl.float64) + gain * g.to(tl.float64)
    if NOISE:
        scale = scale_bits.to(tl.int64).to(tl.float64, bitcast=True)
        xi = tl.randn(seed, offset + index)
        b = b + scale * xi.to(tl.float64)
    tl.store(buffer + index, b.to(buffer.dtype.element_ty), mask=mask)
    d = (g.to(tl.float64) + momentum * b).to(p.dtype) if NESTEROV else b.to(p.dtype)
    p = (p.to(tl.float64) - lr * d.to(tl.float64)).to(p.dtype)
    tl.store(param + index, p, mask=mask)


def unsupported(group: Mapping[str, Any], temperature: float) -> str | None:
    """Every SGHMC option is supported."""
    return None


def launch(group: Mapping[str, Any], inputs: FusedInput) -> Mapping[str, list[Tensor]]:
    """Take SGHMC's step on every tensor of ``inputs`` in place (one launch per tensor).

    A buffer the step creates (the first step, as SGD's) starts as zeros, which a step
    skipped for a non-finite gradient leaves, as the unfused step does.
    """
    momentum = float(group["momentum"])
    if momentum == 0:  # SGLD, keeping no buffer (as torch.optim.SGD)
        return _sgld_fused.launch(group, inputs)
    lr, temperature = float(group["lr"]), float(group["temperature"])
    weight_decay = float(group["weight_decay"])
    scale = sghmc_noise_scale(lr, momentum, temperature, group["num_data"])
    buffers: list[Tensor] = []
    for i, (param, grad, seed, offset, largest) in enumerate(
        zip(inputs.params, inputs.grads, inputs.seeds, inputs.offsets, inputs.largest, strict=True)
    ):
        buffer = inputs.buffers["momentum_buffer"][i]
        first = buffer is None
        if buffer is None:
            buffer = torch.zeros_like(param, memory_format=torch.contiguous_format)
        buffers.append(buffer)
        launch_elementwise(
            _sghmc,
            param,
            grad,
            buffer,
            largest,
            param.numel(),
            offset,
            seed,
            as_float64_bits(lr),
            as_float64_bits(momentum),
            as_float64_bits(1.0 - float(group["dampening"])),
            as_float64_bits(weight_decay),
            as_float64_bits(scale),
            do_not_specialize=_VARYING,
            MAXIMIZE=bool(group["maximize"]),
            DECAY=weight_decay != 0,
            FIRST=first,
            NESTEROV=bool(group["nesterov"]),
            NOISE=temperature > 0,
        )
    return {"momentum_buffer": buffers}
