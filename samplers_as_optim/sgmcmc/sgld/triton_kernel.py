r"""SGLD's fused Triton kernel: ``sgld.sgld_direction`` and the step in one pass.

Per element, with :math:`g' = \pm g + \lambda\theta` (rounded to the position's dtype,
as ``torch.optim.SGD(fused=True)`` rounds it) and :math:`c = \sqrt{2T/(N\,lr)}`,

.. math::

    \theta \leftarrow \theta - lr\,(g' - c\,\xi), \qquad \xi = \texttt{tl.randn}(seed,
    \text{global index}),

in float64 and rounded once. The kernel runs at :math:`T > 0`; at :math:`T = 0` the
launch hands the step to torch's own fused SGD op (``fused/launch.torch_fused_sgd``),
``SGD(fused=True)`` bit for bit. It reads
:math:`\theta` and :math:`g` once and writes :math:`\theta` once; nothing is written
when the step's flag (the largest absolute gradient) is not finite. Small tensors share
launches (``fused/launch.launch_tensors``), each with its own noise key: the numbers of
one launch per tensor.

Mixed precision (``fused/launch``'s module docstring): with a GradScaler scale
:math:`s` the gradient is read as :math:`g/s` (float64 division, rounded once to the
position's dtype); a float16/bfloat16 parameter with a float32 master steps on the
master, as a float32 parameter would, and receives its rounding to nearest. (One
without a master exists at temperature 0 only, where torch's op steps it: the kernel
has no ``NARROW`` variant.)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

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

__all__ = ["launch", "unsupported"]

tl: Any = _optional_module("triton.language")

#: arguments whose values change between steps: not specialised on (one compiled kernel)
_VARYING = ("count", "programs", "offset", "seed", "lr_bits", "decay_bits", "scale_bits")


def _sgld(
    table: KernelArg,
    count: KernelArg,
    programs: KernelArg,
    numel: KernelArg,
    offset: KernelArg,
    seed: KernelArg,
    param: KernelArg,
    grad: KernelArg,
    largest: KernelArg,
    master: KernelArg,
    grad_scale: KernelArg,
    lr_bits: KernelArg,
    decay_bits: KernelArg,
    scale_bits: KernelArg,
    BLOCK: constexpr,  # noqa: N803
    MULTI: constexpr,  # noqa: N803
    MAXIMIZE: constexpr,  # noqa: N803
    DECAY: constexpr,  # noqa: N803
    UNSCALE: constexpr,  # noqa: N803
    MASTER: constexpr,  # noqa: N803
    BF16: constexpr,  # noqa: N803
) -> None:
    _, rows, index, mask, offset, seed = fio.this_block(
        table, count, programs, numel, offset, seed, largest, 5, BLOCK, MULTI
    )
    param, position, p, g = fio.read_inputs(
        rows, count, param, grad, master, 6, grad_scale, index, mask, MULTI, UNSCALE, MASTER, False
    )
    g = fio.effective_gradient(g, p, decay_bits, MAXIMIZE, DECAY)
    xi = fio.normal(seed, offset, index)  # (T > 0 only: at T = 0 torch's fused SGD steps)
    direction = g.to(tl.float64) - fio.float64(scale_bits) * xi.to(tl.float64)
    new = (p.to(tl.float64) - fio.float64(lr_bits) * direction).to(p.dtype)
    fio.store_position(param, position, new, index, mask, MASTER, False, BF16)


def unsupported(group: Mapping[str, Any], temperature: float) -> str | None:
    """Every SGLD option is supported."""
    return None


def launch(group: Mapping[str, Any], inputs: FusedInput) -> Mapping[str, list[Tensor]]:
    """Take SGLD's step on every tensor of ``inputs`` in place (small ones share launches)."""
    lr, temperature = float(group["lr"]), float(group["temperature"])
    if temperature == 0:  # torch.optim.SGD(fused=True)'s own step
        torch_fused_sgd(group, inputs)
        return {}
    weight_decay = float(group["weight_decay"])
    scale = math.sqrt(2.0 * temperature / (group["num_data"] * lr))
    for part in parts(inputs):
        assert not part.narrow  # (a half parameter keeps a master at T > 0)
        launch_tensors(
            _sgld,
            [part.take(column) for column in (inputs.params, inputs.grads, inputs.largest)]
            + [part.positions(inputs)],
            part.scale_argument(inputs),
            as_float64_bits(lr),
            as_float64_bits(weight_decay),
            as_float64_bits(scale),
            offsets=part.take(inputs.offsets),
            seeds=part.take(inputs.seeds),
            do_not_specialize=_VARYING,
            MAXIMIZE=bool(group["maximize"]),
            DECAY=weight_decay != 0,
            **part.flags(),
        )
    return {}
