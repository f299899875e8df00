r"""BAOA's fused Triton kernel: ``baoa.baoa_direction`` and the step in one pass.

Per element, with :math:`g' = \pm g + \lambda\theta` rounded to the parameter's dtype,
:math:`\sigma = \sqrt{(1-\mu^2)T/(N\,lr)}` (``baoa.baoa_noise_scale``) and :math:`\xi =
\texttt{tl.randn}(seed, \text{global index})`, in float64 (Leimkuhler & Matthews' BAOAB
with the half kicks merged, in SGD units: the derivation is in :mod:`.baoa`):

.. math::

    v = b + g', \qquad b \leftarrow \mu\, v + \sigma\,\xi, \qquad
    \theta \leftarrow \theta - lr\, d, \quad d = (v + b)/2,

the buffer stored in its dtype, :math:`d` rounded to the parameter's dtype (as the
reference's direction is) and :math:`\theta` rounded once. At :math:`T = 0` no noise is
drawn: the step is ``torch.optim.SGD(lr * (1 + momentum) / 2, momentum)``'s up to
rounding, as the reference's is. It reads :math:`\theta`, :math:`g` and :math:`b` once
and writes :math:`\theta` and :math:`b` once; nothing is written when the step's flag (the
largest absolute gradient) is not finite. Small tensors share launches
(``fused/launch.launch_tensors``), each with its own noise key. The reference rounds each
operation in the parameter's dtype; the kernel agrees with it up to that rounding
(``tests/test_fused_sgnht_baoa.py``, through Triton's interpreter on the CPU only: no GPU
has run this kernel).

Mixed precision (``fused/launch``'s module docstring): with a GradScaler scale
:math:`s` the gradient is read as :math:`g/s` (float64 division, rounded once to the
position's dtype); a float16/bfloat16 parameter with a float32 master steps on the
master, as a float32 parameter would, and receives its rounding to nearest; one without
master (temperature 0) is computed in float32 and stored, with its state, in its dtype.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

from torch import Tensor

from ..fused import io as fio
from ..fused.launch import (
    FusedInput,
    KernelArg,
    as_float64_bits,
    constexpr,
    launch_tensors,
    parts,
)
from ..fused.launch import optional_module as _optional_module
from ..noise_scales import baoa_noise_scale

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
    "decay_bits",
    "scale_bits",
)


def _baoa(
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
    decay_bits: KernelArg,
    scale_bits: KernelArg,
    BLOCK: constexpr,  # noqa: N803
    MULTI: constexpr,  # noqa: N803
    MAXIMIZE: constexpr,  # noqa: N803
    DECAY: constexpr,  # noqa: N803
    NOISE: constexpr,  # noqa: N803
    UNSCALE: constexpr,  # noqa: N803
    MASTER: constexpr,  # noqa: N803
    NARROW: constexpr,  # noqa: N803
    BF16: constexpr,  # noqa: N803
) -> None:
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
    new = (p.to(tl.float64) - fio.float64(lr_bits) * d.to(tl.float64)).to(p.dtype)
    fio.store_position(param, position, new, index, mask, MASTER, NARROW, BF16)


def unsupported(group: Mapping[str, Any], temperature: float) -> str | None:
    """Every BAOA option is supported (``dampening`` and ``nesterov`` are refused by BAOA)."""
    return None


def launch(group: Mapping[str, Any], inputs: FusedInput) -> Mapping[str, list[Tensor]]:
    """Take BAOA's step on every tensor of ``inputs`` in place (small ones share launches)."""
    lr, temperature = float(group["lr"]), float(group["temperature"])
    momentum, weight_decay = float(group["momentum"]), float(group["weight_decay"])
    buffers = cast(list[Tensor], inputs.buffers["momentum_buffer"])  # set by the state's init
    # the O step's noise (0 at T = 0, where none is drawn)
    noise_scale = baoa_noise_scale(lr, momentum, temperature, group["num_data"])
    for part in parts(inputs):
        launch_tensors(
            _baoa,
            [part.take(column) for column in (inputs.params, inputs.grads, buffers)]
            + [part.take(inputs.largest), part.positions(inputs)],
            part.scale_argument(inputs),
            as_float64_bits(lr),
            as_float64_bits(momentum),
            as_float64_bits(weight_decay),
            as_float64_bits(noise_scale),
            offsets=part.take(inputs.offsets),
            seeds=part.take(inputs.seeds),
            do_not_specialize=_VARYING,
            MAXIMIZE=bool(group["maximize"]),
            DECAY=weight_decay != 0,
            NOISE=temperature > 0,
            NARROW=part.narrow,
            **part.flags(),
        )
    return {"momentum_buffer": buffers}
