r"""SGNHT's fused Triton kernels: ``sgnht.sgnht_direction`` and the step, in two phases.

SGNHT's thermostat :math:`\alpha` (one per tensor of :math:`n` elements) moves by the
kinetic energy of the whole tensor, a reduction, but only *after* the buffer and the
parameter have moved: the step reads the old :math:`\alpha`, and the new one serves the
next step. So the two phases need no host synchronisation and read each tensor once:

1. one elementwise pass per tensor (small tensors share launches) reads :math:`\alpha`
   from device memory and, per element, with :math:`\sigma = \sqrt{2(1-\mu)T/(N\,lr)}`
   (:math:`g'`, :math:`\xi` and what every kernel does alike: ``fused/io``'s module
   docstring), in float64,

   .. math::

       b' = (1 - \alpha)\, b + g' + \sigma\xi, \qquad \theta \leftarrow \theta - lr\, b',

   storing :math:`b'` in the buffer's dtype and :math:`\theta` rounded once (the
   direction is :math:`b'` rounded to the parameter's dtype, as the reference's buffer
   is), and writes the sum over its block of :math:`e^2`, :math:`e = b'` (``"ding"``) or
   :math:`e = b + b' = (2 - \alpha) b + g' + \sigma\xi` (``"symmetric"``), in float64,
   to a scratch tensor of partial sums (one float64 per block: no atomics, so the sum
   is the same on every run);
2. one launch per param group and thermostat dtype, one program per tensor, adds the
   tensor's partial sums in a fixed order (chunks of :data:`CHUNK`, each summed by
   ``tl.sum``) and stores

   .. math::

       \alpha \leftarrow \alpha + \textstyle\sum e^2 \cdot f / n - lr\,T/N, \qquad
       f = lr^2 \text{ (``"ding"``)}, \quad lr^2/4 \text{ (``"symmetric"``)},

   in float64, rounded once to the thermostat's dtype.

Both read the step's device flag and write nothing when it is not finite: the
parameter, the buffer and :math:`\alpha` keep every bit. An empty tensor has nothing to
thermostat: its :math:`\alpha` stays as it is. The reference rounds each operation in
the parameter's dtype and sums :math:`e^2` in the thermostat's; this kernel agrees with
it up to that rounding (``tests/test_fused_sgnht_baoa.py``, through Triton's interpreter
on the CPU only: no GPU has run these kernels). SGNHT refuses temperature 0, where a
half parameter would have no master: the kernel has no ``NARROW`` variant.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch
from torch import Tensor

from ..definition.noise_scales import sghmc_noise_scale
from ..fused import io as fio
from ..fused import launch as _fused_launch
from ..fused.io import tl
from ..fused.launch import (
    FusedInput,
    KernelArg,
    as_float64_bits,
    constexpr,
    launch_programs,
    parts,
    upload_table,
)

__all__ = ["CHUNK", "launch", "unsupported"]

#: partial sums added per iteration of the thermostat's program (phase 2)
CHUNK = 1024


def _sgnht(
    table: KernelArg, count: KernelArg, programs: KernelArg,  # (fused/launch.launch_tensors)
    numel: KernelArg, offset: KernelArg, seed: KernelArg,
    param: KernelArg, grad: KernelArg, buffer: KernelArg, thermostat: KernelArg,
    largest: KernelArg, partials: KernelArg, master: KernelArg, grad_scale: KernelArg,
    lr_bits: KernelArg, decay_bits: KernelArg, scale_bits: KernelArg,
    BLOCK: constexpr, MULTI: constexpr, MAXIMIZE: constexpr, DECAY: constexpr,  # noqa: N803
    SYMMETRIC: constexpr, UNSCALE: constexpr, MASTER: constexpr, BF16: constexpr,  # noqa: N803
) -> None:  # fmt: skip
    """Phase 1: the buffer, the parameter and each block's sum of :math:`e^2`.

    Columns (``fused/io.this_block``): 3 param, 4 grad, 5 buffer, 6 thermostat, 7 largest,
    8 partials, 9 master.
    """
    block, rows, index, mask, offset, seed = fio.this_block(
        table, count, programs, numel, offset, seed, largest, 7, BLOCK, MULTI
    )
    param, position, p, g = fio.read_inputs(
        rows, count, param, grad, master, 9, grad_scale, index, mask, MULTI, UNSCALE, MASTER, False
    )
    g = fio.effective_gradient(g, p, decay_bits, MAXIMIZE, DECAY)
    thermostat = fio.column(rows, count, 6, thermostat, MULTI)
    friction = 1.0 - tl.load(thermostat).to(tl.float64)
    buffer = fio.column(rows, count, 5, buffer, MULTI)
    partials = fio.column(rows, count, 8, partials, MULTI)
    old = tl.load(buffer + index, mask=mask).to(tl.float64)
    xi = fio.normal(seed, offset, index)
    kick = g.to(tl.float64) + fio.float64(scale_bits) * xi.to(tl.float64)
    b = friction * old + kick
    energy = (friction + 1.0) * old + kick if SYMMETRIC else b
    tl.store(partials + block, tl.sum(tl.where(mask, energy * energy, 0.0)))
    fio.store_state(buffer, b, index, mask, False, BF16)
    d = b.to(p.dtype)
    fio.store_moved(param, position, p, fio.float64(lr_bits), d, index, mask, MASTER, False, BF16)


def _thermostat(
    table: KernelArg,
    count: KernelArg,
    thermostat: KernelArg,
    factor_bits: KernelArg,
    cooling_bits: KernelArg,
    BLOCK: constexpr,  # noqa: N803
) -> None:
    """Phase 2: tensor ``t = program_id`` adds its partial sums and moves its thermostat.

    Table rows of ``count`` entries: numel, number of partial sums, their pointer (float64),
    the thermostat's pointer (``thermostat``'s dtype), the flag's pointer.
    """
    t = tl.program_id(0)
    numel = tl.load(table + t)
    blocks = tl.load(table + count + t)
    partials = tl.load(table + 2 * count + t).to(tl.pointer_type(tl.float64), bitcast=True)
    thermostat = tl.load(table + 3 * count + t).to(thermostat.dtype, bitcast=True)
    largest = tl.load(table + 4 * count + t).to(tl.pointer_type(tl.float64), bitcast=True)
    total = tl.sum(tl.zeros([BLOCK], dtype=tl.float64), axis=0)
    for start in range(0, blocks, BLOCK):
        index = start + tl.arange(0, BLOCK)
        total += tl.sum(tl.load(partials + index, mask=index < blocks, other=0.0))
    factor, cooling = fio.float64(factor_bits), fio.float64(cooling_bits)
    alpha = tl.load(thermostat).to(tl.float64)
    alpha = alpha + (total * (factor / numel.to(tl.float64)) - cooling)
    tl.store(thermostat, alpha.to(thermostat.dtype.element_ty), mask=fio.step_is_finite(largest))


def unsupported(group: Mapping[str, Any], temperature: float) -> str | None:
    """Every SGNHT option is supported (both ``kinetic_energy`` estimates)."""
    return None


def launch(group: Mapping[str, Any], inputs: FusedInput) -> Mapping[str, list[Tensor]]:
    """Take SGNHT's step on every tensor of ``inputs`` in place: the two phases.

    The buffers and thermostats exist (the state fields' init); the partial sums live in
    one scratch float64 tensor per device for the step. Launches: phase 1's (one per
    large tensor, one per device and dtypes for the small ones) and one per device and
    thermostat dtype for phase 2.
    """
    lr, temperature, num_data = float(group["lr"]), float(group["temperature"]), group["num_data"]
    symmetric = group["kinetic_energy"] == "symmetric"
    buffers = cast(list[Tensor], inputs.buffers["momentum_buffer"])  # set by the state's init
    thermostats = cast(list[Tensor], inputs.buffers["thermostat"])
    partials = _partial_sums(inputs.params)
    noise_scale = sghmc_noise_scale(lr, float(group["momentum"]), temperature, num_data)
    scalars = (lr, group["weight_decay"], noise_scale)
    for part in parts(inputs):
        assert not part.narrow  # (a half parameter keeps a master at T > 0)
        columns = [buffers, thermostats, inputs.largest, partials]
        part.launch_members(_sgnht, group, inputs, columns, *scalars, SYMMETRIC=symmetric)
    factor = lr * lr / 4 if symmetric else lr * lr
    _move_thermostats(inputs, thermostats, partials, factor, lr * temperature / num_data)
    return {"momentum_buffer": buffers, "thermostat": thermostats}


def _partial_sums(params: list[Tensor]) -> list[Tensor]:
    """Each tensor's slice of one float64 scratch tensor per device: one entry per block."""
    sizes: dict[torch.device, int] = {}
    for param in params:
        sizes[param.device] = sizes.get(param.device, 0) + _blocks(param)
    scratch = {
        device: torch.empty(size, dtype=torch.float64, device=device)
        for device, size in sizes.items()
    }
    starts = dict.fromkeys(sizes, 0)
    views = []
    for param in params:
        blocks = _blocks(param)
        start = starts[param.device]
        views.append(scratch[param.device][start : start + blocks])
        starts[param.device] = start + blocks
    return views


def _blocks(param: Tensor) -> int:
    """The number of phase 1's programs (blocks) over ``param``: its partial sums."""
    block = _fused_launch.block_size(param.device)  # the launch's, read at each call
    return (param.numel() + block - 1) // block


def _move_thermostats(
    inputs: FusedInput,
    thermostats: list[Tensor],
    partials: list[Tensor],
    factor: float,
    cooling: float,
) -> None:
    """Phase 2: one launch per device and thermostat dtype, one program per tensor."""
    batches: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, param in enumerate(inputs.params):
        if param.numel():  # an empty tensor has nothing to thermostat
            batches.setdefault((param.device, thermostats[i].dtype), []).append(i)
    for (device, _), members in batches.items():
        rows = [inputs.params[i].numel() for i in members]
        rows += [partials[i].numel() for i in members]
        rows += [partials[i].data_ptr() for i in members]
        rows += [thermostats[i].data_ptr() for i in members]
        rows += [inputs.largest[i].data_ptr() for i in members]
        launch_programs(
            _thermostat,
            len(members),
            device,
            upload_table(rows, device),
            len(members),
            thermostats[members[0]],
            as_float64_bits(factor),
            as_float64_bits(cooling),
            block=CHUNK,
            do_not_specialize=("count",),
        )
