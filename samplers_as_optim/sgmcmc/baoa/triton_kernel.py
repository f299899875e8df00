r"""BAOA's fused Triton kernel: ``baoa.baoa_direction`` and the step in one pass.

Per element, with :math:`\sigma = \sqrt{(1-\mu^2)T/(N\,lr)}` (``baoa.baoa_noise_scale``;
:math:`g'`, :math:`\xi` and what every kernel does alike: ``fused/io``'s module
docstring), in float64 (Leimkuhler & Matthews' BAOAB with the half kicks merged, in SGD
units: the derivation is in :mod:`.baoa`):

.. math::

    v = b + g', \qquad b \leftarrow \mu\, v + \sigma\,\xi, \qquad
    \theta \leftarrow \theta - lr\, d, \quad d = (v + b)/2,

:math:`d` rounded to the parameter's dtype (as the reference's direction is). At
:math:`T = 0` no noise is drawn: the step is ``torch.optim.SGD(lr * (1 + momentum) / 2,
momentum)``'s up to rounding, as the reference's is. The reference rounds each operation
in the parameter's dtype; the kernel agrees with it up to that rounding
(``tests/test_fused_sgnht_baoa.py``, through Triton's interpreter on the CPU only: no GPU
has run this kernel).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

from torch import Tensor

from ..definition.noise_scales import baoa_noise_scale
from ..fused import io as fio
from ..fused.io import tl
from ..fused.launch import FusedInput, KernelArg, constexpr, parts

__all__ = ["launch", "unsupported"]


def _baoa(
    table: KernelArg, count: KernelArg, programs: KernelArg,  # (fused/launch.launch_tensors)
    numel: KernelArg, offset: KernelArg, seed: KernelArg,
    param: KernelArg, grad: KernelArg, buffer: KernelArg, largest: KernelArg, master: KernelArg,
    grad_scale: KernelArg, lr_bits: KernelArg, momentum_bits: KernelArg,
    decay_bits: KernelArg, scale_bits: KernelArg,
    BLOCK: constexpr, MULTI: constexpr, MAXIMIZE: constexpr, DECAY: constexpr,  # noqa: N803
    NOISE: constexpr, UNSCALE: constexpr, MASTER: constexpr, NARROW: constexpr,  # noqa: N803
    BF16: constexpr,  # noqa: N803
) -> None:  # fmt: skip
    """The step of this program's block: the kick (B), the O step, the two half drifts (A).

    Columns (``fused/io.this_block``): 3 param, 4 grad, 5 buffer, 6 largest, 7 master.
    """
    _, rows, index, mask, offset, seed = fio.this_block(
        table, count, programs, numel, offset, seed, largest, 6, BLOCK, MULTI
    )
    param, position, p, g = fio.read_inputs(
        rows, count, param, grad, master, 7, grad_scale, index, mask, MULTI, UNSCALE, MASTER, NARROW
    )
    buffer = fio.column(rows, count, 5, buffer, MULTI)
    g = fio.effective_gradient(g, p, decay_bits, MAXIMIZE, DECAY)
    v = tl.load(buffer + index, mask=mask).to(tl.float64) + g.to(tl.float64)  # B: the kick
    b = fio.float64(momentum_bits) * v  # O
    if NOISE:
        b = b + fio.float64(scale_bits) * fio.normal(seed, offset, index).to(tl.float64)
    fio.store_state(buffer, b, index, mask, NARROW, BF16)
    d = ((v + b) * 0.5).to(p.dtype)  # the two half drifts (A)
    fio.store_moved(param, position, p, fio.float64(lr_bits), d, index, mask, MASTER, NARROW, BF16)


def unsupported(group: Mapping[str, Any], temperature: float) -> str | None:
    """Every BAOA option is supported (``dampening`` and ``nesterov`` are refused by BAOA)."""
    return None


def launch(group: Mapping[str, Any], inputs: FusedInput) -> Mapping[str, list[Tensor]]:
    """Take BAOA's step on every tensor of ``inputs`` in place (small ones share launches)."""
    lr, temperature = float(group["lr"]), float(group["temperature"])
    momentum = float(group["momentum"])
    buffers = cast(list[Tensor], inputs.buffers["momentum_buffer"])  # set by the state's init
    # the O step's noise (0 at T = 0, where none is drawn)
    noise_scale = baoa_noise_scale(lr, momentum, temperature, group["num_data"])
    scalars = (lr, momentum, group["weight_decay"], noise_scale)
    for part in parts(inputs):
        columns = [buffers, inputs.largest]
        noise, narrow = temperature > 0, part.narrow
        part.launch_members(_baoa, group, inputs, columns, *scalars, NOISE=noise, NARROW=narrow)
    return {"momentum_buffer": buffers}
