r"""AdamWSGHMC's fused Triton kernel at temperature > 0; torch's fused AdamW at 0.

At temperature > 0, per element, with :math:`g' = \pm g` (the decay is decoupled),
:math:`t` the parameter's step count after this step and :math:`\sigma =
\sqrt{2T/(N\,lr)}` (:math:`\xi` and what every kernel does alike: ``fused/io``'s module
docstring), in float64 and rounded where the state is stored
(``adamw_sghmc.adamw_sghmc_direction``; Chen et al. 2014, Eq. 9, in AdamW's units as
that module derives):

.. math::

    V &\leftarrow \beta_2 V + (1-\beta_2)\, g'^2, \qquad
    m \leftarrow m + (1-\beta_1)\big(g' + \sigma\, r\, \xi - m\big), \\
    \theta &\leftarrow \theta - lr\,\big(m / a + \lambda\theta\big),

with :math:`a` the sampling preconditioner of :mod:`.sampling_preconditioner` and
:math:`r = \sqrt{a}`, 0 where :math:`a = \epsilon` (no scale: no noise). Frozen,
:math:`a` is read as kept, in its compact pooled shape (``fused/pooled``); before its
freeze, ``"factored"`` pools :math:`\sqrt{\bar V'/(1-\beta_2^t)} + \epsilon` of this
step's second moment before the kernel, by torch operations on the device (a
reduction), and ``"elementwise"`` computes :math:`\sqrt{V'/(1-\beta_2^t)} + \epsilon`
in registers. One launch per tensor.

At temperature 0 the step is ``torch.optim.AdamW(fused=True)``'s: torch's own
functional Adam with ``fused=True`` (``amsgrad`` included), told of a non-finite
gradient by ``found_inf`` (torch's fused optimizers then write nothing) and of a
GradScaler's scale by ``grad_scale`` (given copies of the gradients, which it unscales in
place), its step counts passed as device tensors filled from the host counts (no host
synchronisation). A parameter with a float32 master takes the kernel's temperature-0
step instead (AdamW's update, below, on the master).

``launch`` with ``updates`` (the transforms' fused path) writes the update
:math:`-lr\,(m/a + \lambda\theta)` there and leaves the parameter unchanged; at
temperature 0 the kernel then computes AdamW's update itself (:math:`a = \sqrt{V}/
\sqrt{1-\beta_2^t} + \epsilon`, the maximum of :math:`V` with ``amsgrad``, :math:`m`
divided by :math:`1-\beta_1^t`), in float64 and rounded once.
Checked through Triton's interpreter on the CPU only (``tests/test_fused_adaptive.py``):
compiled for an sm_90 GPU by Triton's compiler
(``tests/test_fused_transforms.py``), no GPU has run it yet. A half parameter without
master exists at temperature 0 only, where torch's fused AdamW steps it (the transforms'
fused path takes float32 and float64 only): the kernel has no ``NARROW`` variant.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from ..definition.noise_scales import adamw_sghmc_noise_scale, torch_adamw_step
from ..fused import io as fio
from ..fused.io import tl
from ..fused.launch import FusedInput, KernelArg, Part, constexpr, parts
from ..fused.pooled import Moment, kernel_preconditioner, launch_alone, pooled, second_moment
from ..sampling_preconditioner import advanced, prior_floor, released

__all__ = ["launch", "unsupported"]


def _adamw_sghmc(
    param: KernelArg, grad: KernelArg, exp_avg: KernelArg, exp_avg_sq: KernelArg,
    max_exp_avg_sq: KernelArg, pre: KernelArg, out: KernelArg,
    largest: KernelArg, master: KernelArg, grad_scale: KernelArg,
    numel: KernelArg, offset: KernelArg, seed: KernelArg,
    lr_bits: KernelArg, beta1_bits: KernelArg, beta2_bits: KernelArg, eps_bits: KernelArg,
    correction_bits: KernelArg, first_correction_bits: KernelArg,
    decay_bits: KernelArg, scale_bits: KernelArg,
    inner: KernelArg, row_stride: KernelArg, rows: KernelArg,  # (fused/pooled.Layout)
    column_stride: KernelArg, columns: KernelArg,
    BLOCK: constexpr, MAXIMIZE: constexpr, DECAY: constexpr, POOLED: constexpr,  # noqa: N803
    NOISE: constexpr, AMSGRAD: constexpr, UPDATE: constexpr,  # noqa: N803
    UNSCALE: constexpr, MASTER: constexpr, BF16: constexpr,  # noqa: N803
) -> None:  # fmt: skip
    """The step of this program's block: :math:`V`, :math:`a`, :math:`m`, then the position."""
    index, mask = fio.elements(tl.program_id(0).to(tl.int64), numel, largest, BLOCK)
    lr, eps = fio.float64(lr_bits), fio.float64(eps_bits)
    beta1, beta2 = fio.float64(beta1_bits), fio.float64(beta2_bits)
    position, p, g = fio.position_and_gradient(
        param, master, grad, grad_scale, index, mask, UNSCALE, MASTER, False
    )
    g = fio.effective_gradient(g, p, decay_bits, MAXIMIZE, False)  # (the decay is decoupled)
    g64 = g.to(tl.float64)
    v = second_moment(exp_avg_sq, g64, beta2, p, index, mask)
    tl.store(exp_avg_sq + index, v.to(exp_avg_sq.dtype.element_ty), mask=mask)
    correction = fio.float64(correction_bits)
    if POOLED:
        a = pooled(pre, index, mask, inner, row_stride, rows, column_stride, columns)
    elif NOISE:
        a = (tl.sqrt(v.to(tl.float64) / correction) + eps).to(p.dtype)
    else:  # AdamW's own denominator (temperature 0)
        second = v
        if AMSGRAD:
            second = tl.maximum(tl.load(max_exp_avg_sq + index, mask=mask), v)
            tl.store(max_exp_avg_sq + index, second.to(max_exp_avg_sq.dtype.element_ty), mask=mask)
        a = (tl.sqrt(second.to(tl.float64)) / tl.sqrt(correction) + eps).to(p.dtype)
    a64 = a.to(tl.float64)
    kick = g64
    if NOISE:  # sqrt(a), 0 where a = eps (no scale: no noise)
        root = tl.where(a == eps.to(p.dtype), 0.0, tl.sqrt(a64).to(p.dtype))
        xi = fio.normal(seed, offset, index).to(tl.float64)
        kick = g64 + fio.float64(scale_bits) * xi * root.to(tl.float64)
    m = tl.load(exp_avg + index, mask=mask).to(tl.float64)
    m = (m + (1.0 - beta1) * (kick - m)).to(p.dtype)
    tl.store(exp_avg + index, m.to(exp_avg.dtype.element_ty), mask=mask)
    d = m.to(tl.float64) / a64
    if not NOISE:  # AdamW's bias correction of the momentum (temperature 0 only)
        d = d / fio.float64(first_correction_bits)
    if DECAY:
        d = d + fio.float64(decay_bits) * p.to(tl.float64)
    fio.store_step(out, param, position, p, lr, d, index, mask, UPDATE, MASTER, False, BF16)


def unsupported(group: Mapping[str, Any], temperature: float) -> str | None:
    """Every AdamWSGHMC option is supported (``amsgrad`` only at temperature 0, as unfused)."""
    return None


def _adamw(
    group: Mapping[str, Any], inputs: FusedInput, part: Part, buffers: dict[str, list[Any]]
) -> None:
    """Temperature 0: ``torch.optim.AdamW(fused=True)``'s step, per device.

    ``found_inf`` set from the step's flag, ``grad_scale`` from ``part``'s scale (torch's
    fused AdamW divides the gradients by it itself, in place: it is given copies, so that
    ``.grad`` is never written); ``part``'s parameters keep no master.
    """
    devices: dict[torch.device, list[int]] = {}
    for i in part.members:
        devices.setdefault(inputs.params[i].device, []).append(i)
    for device, index in devices.items():
        # torch's fused Adam counts on the device: fill tensors there from the host counts
        steps = [
            torch.full((), float(buffers["step"][i]), dtype=torch.float32, device=device)
            for i in index
        ]
        for i in index:
            buffers["step"][i] = advanced(buffers["step"][i], True)
            buffers["preconditioner_step"][i] = released(buffers["preconditioner_step"][i], True)
        found_inf = inputs.largest[index[0]].isfinite().logical_not().to(torch.float32)
        maxima = buffers.get("max_exp_avg_sq") or []
        # torch's fused AdamW writes the gradients it unscales: it gets copies of them
        grads = [inputs.grads[i] for i in index]
        tensors = [
            [inputs.params[i] for i in index],
            grads if part.scale is None else [grad.clone() for grad in grads],
            [buffers["exp_avg"][i] for i in index],
            [buffers["exp_avg_sq"][i] for i in index],
            [maxima[i] for i in index] if maxima else [],
            steps,
        ]
        scale = None if part.scale is None else part.scale.reshape(())
        options = {"foreach": None, "fused": True, "grad_scale": scale}
        torch_adamw_step(group, tensors, **options, found_inf=found_inf.reshape(()))


def launch(
    group: Mapping[str, Any], inputs: FusedInput, updates: list[Tensor] | None = None
) -> Mapping[str, list[Any]]:
    r"""Take AdamWSGHMC's step on every tensor of ``inputs`` in place (one launch per tensor).

    Returns every state field of ``inputs.buffers`` (the step counts advanced, a
    preconditioner frozen or released). With ``updates`` (temperature > 0; one
    contiguous tensor per parameter), write :math:`-lr\,d` there and leave the
    parameters unchanged. At temperature 0 the parameters without a master take torch's
    fused AdamW step; those with one, the kernel's (on the master).
    """
    buffers: dict[str, list[Any]] = {name: list(v) for name, v in inputs.buffers.items()}
    torch_step = float(group["temperature"]) == 0 and updates is None
    for part in parts(inputs):
        if torch_step and not part.master:
            _adamw(group, inputs, part, buffers)
            continue
        for i in part.members:
            _launch_one(group, inputs, part.alone(i), buffers, updates)
    return buffers


def _launch_one(
    group: Mapping[str, Any],
    inputs: FusedInput,
    part: Part,
    buffers: dict[str, list[Any]],
    updates: list[Tensor] | None,
) -> None:
    """The step of ``part``'s one parameter :math:`i`; its state fields advanced in ``buffers``."""
    (i,) = part.members
    assert not part.narrow  # (a half parameter without master takes torch's step: T = 0)
    lr, temperature = float(group["lr"]), float(group["temperature"])
    amsgrad = bool(group["amsgrad"]) and temperature == 0
    beta1, beta2 = (float(beta) for beta in group["betas"])
    weight_decay = float(group["weight_decay"])
    buffers["step"][i] = advanced(buffers["step"][i], True)
    step = float(buffers["step"][i])
    correction = 1 - beta2**step
    scale = adamw_sghmc_noise_scale(lr, temperature, group["num_data"])
    moment = Moment(
        "exp_avg_sq",
        beta2,
        correction=correction,
        before=1 - beta2 ** (step - 1) or 1.0,  # (V is still 0 at step 1)
        root=True,
        floor=prior_floor(temperature, float(group["prior_weight_decay"]), group["num_data"]),
    )
    pre, where = kernel_preconditioner(group, inputs, part, buffers, moment)
    maximum = buffers["max_exp_avg_sq"][i] if amsgrad else None
    out = None if updates is None else updates[i]
    tensors = [buffers["exp_avg"][i], buffers["exp_avg_sq"][i], maximum, pre, out]
    scalars = (lr, beta1, beta2, group["eps"], correction, 1 - beta1**step, weight_decay, scale)
    flags = {"POOLED": pre is not None, "NOISE": temperature > 0, "AMSGRAD": amsgrad}
    launch_alone(
        _adamw_sghmc, group, inputs, part, tensors, scalars, where, **flags, UPDATE=out is not None
    )
