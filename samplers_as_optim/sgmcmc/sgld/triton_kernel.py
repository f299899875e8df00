r"""SGLD's fused Triton kernel: ``sgld.sgld_direction`` and the step in one pass.

Per element, with :math:`c = \sqrt{2T/(N\,lr)}` (:math:`g'`, :math:`\xi` and what every
kernel does alike: ``fused/io``'s module docstring),

.. math::

    \theta \leftarrow \theta - lr\,(g' - c\,\xi).

The kernel runs at :math:`T > 0`; at :math:`T = 0` the launch hands the step to torch's
own fused SGD op (``fused/launch.torch_fused_sgd``), ``SGD(fused=True)`` bit for bit,
a half parameter without master included (the kernel has no ``NARROW`` variant).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from torch import Tensor

from ..fused import io as fio
from ..fused.io import tl
from ..fused.launch import FusedInput, KernelArg, constexpr, parts, torch_fused_sgd

__all__ = ["launch", "unsupported"]


def _sgld(
    table: KernelArg, count: KernelArg, programs: KernelArg,  # (fused/launch.launch_tensors)
    numel: KernelArg, offset: KernelArg, seed: KernelArg,
    param: KernelArg, grad: KernelArg, largest: KernelArg, master: KernelArg,
    grad_scale: KernelArg, lr_bits: KernelArg, decay_bits: KernelArg, scale_bits: KernelArg,
    BLOCK: constexpr, MULTI: constexpr, MAXIMIZE: constexpr, DECAY: constexpr,  # noqa: N803
    UNSCALE: constexpr, MASTER: constexpr, BF16: constexpr,  # noqa: N803
) -> None:  # fmt: skip
    r"""The step of this program's block: :math:`\theta - lr\,(g' - c\,\xi)`.

    Columns (``fused/io.this_block``): 3 param, 4 grad, 5 largest, 6 master.
    """
    _, rows, index, mask, offset, seed = fio.this_block(
        table, count, programs, numel, offset, seed, largest, 5, BLOCK, MULTI
    )
    param, position, p, g = fio.read_inputs(
        rows, count, param, grad, master, 6, grad_scale, index, mask, MULTI, UNSCALE, MASTER, False
    )
    g = fio.effective_gradient(g, p, decay_bits, MAXIMIZE, DECAY)
    xi = fio.normal(seed, offset, index)  # (T > 0 only: at T = 0 torch's fused SGD steps)
    d = g.to(tl.float64) - fio.float64(scale_bits) * xi.to(tl.float64)
    fio.store_moved(param, position, p, fio.float64(lr_bits), d, index, mask, MASTER, False, BF16)


def unsupported(group: Mapping[str, Any], temperature: float) -> str | None:
    """Every SGLD option is supported."""
    return None


def launch(group: Mapping[str, Any], inputs: FusedInput) -> Mapping[str, list[Tensor]]:
    """Take SGLD's step on every tensor of ``inputs`` in place (small ones share launches)."""
    lr, temperature = float(group["lr"]), float(group["temperature"])
    if temperature == 0:  # torch.optim.SGD(fused=True)'s own step
        torch_fused_sgd(group, inputs)
        return {}
    scale = math.sqrt(2.0 * temperature / (group["num_data"] * lr))
    for part in parts(inputs):
        assert not part.narrow  # (a half parameter keeps a master at T > 0)
        part.launch_members(
            _sgld, group, inputs, [inputs.largest], lr, group["weight_decay"], scale
        )
    return {}
