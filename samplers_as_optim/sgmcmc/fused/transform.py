r"""The transforms' fused path: a sampler's fused kernel computing a torchopt update.

A transformation returns the update :math:`u = -lr\,d` and leaves the parameters to
``torchopt.apply_updates``; the fused kernels take an Optimizer's step
:math:`\theta \leftarrow \theta - lr\,d` in place. Two ways join them, per sampler
(:data:`HOW`):

* ``"update"`` (PSGLD's ``psgld/triton_kernel``, AdamWSGHMC's
  ``adamw_sghmc/triton_kernel``): the kernel's ``launch`` takes ``updates`` and writes
  :math:`-lr\,d` there, reading the parameter only for the weight decay (and PSGLD's correction);
* ``"from zero"`` (the ``triton_kernel`` of SGLD, SGHMC, SGNHT and BAOA, which read the
  parameter only for the weight decay): the kernel steps a zero
  "parameter", :math:`0 - lr\,d`, with :math:`g' = \pm g + \lambda\theta` formed before
  it (torch operations, one pass) and passed as the gradient. The buffers are the
  transformation's state, updated by the kernel as an Optimizer's are: SGNHT's
  thermostat :math:`\alpha` (a 0-dim tensor per leaf) moves by the kinetic energy of the
  buffers alone (phase 2 of its kernel reads none of :math:`\theta`), BAOA's buffer is
  its momentum. A field the update creates on its first step (SGHMC's momentum, as
  ``torch.optim.SGD``'s, ``StateField.init`` None) is handed to the kernel as None at
  ``count == 0``, where the transformation's state holds zeros in its place; a field
  with an initial value (SGNHT's :math:`b = 0` and :math:`\alpha = 1 - \mu`, BAOA's
  :math:`b = 0`) is handed as the state holds it.

Either way the kernel computes in float64 and rounds :math:`-lr\,d` once, where the
unfused transform rounds :math:`d` and then :math:`-lr\,d`: the two agree up to that
rounding. The noise is the fused stream (``fused.fused_normal``) keyed as an Optimizer
keys it: ``fused_noise_seed(seed, count, key)`` with the leaf's key
(``transformation.leaf_noise_keys``) at the element's global index (its offset,
``names.set_parameter_layout``, when the parameter leaf carries one), so that a
transform and a fused Optimizer of one seed draw the same :math:`\xi`. Non-finite
updates are refused before the kernel by the transformation's own check (a host
synchronisation, as the unfused transform): the kernels are handed a finite flag.
Checked through Triton's interpreter on the CPU only (``tests/test_fused_transforms.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from ..definition import SamplerDefinition
from ..tensor_lists import effective_grad
from . import _tensor_refusal, fused_kernel, fused_noise_seeds, parameter_offset
from . import triton_importable as _triton_importable
from .kernels import has_fused_kernel
from .launch import FusedInput

__all__ = ["HOW", "fused_update", "fused_update_refusal"]

#: how each sampler's fused kernel gives a transform's update (module docstring), by the
#: sampler's name (``SamplerDefinition.name``)
HOW = {"PSGLD": "update", "AdamWSGHMC": "update"} | {
    "SGLD": "from zero",
    "SGHMC": "from zero",
    "SGNHT": "from zero",
    "BAOA": "from zero",
}


def fused_update_refusal(
    definition: SamplerDefinition,
    name: str,
    group: Mapping[str, Any],
    leaves: Sequence[tuple[str, Tensor, Tensor]],
    functorch: bool,
) -> str | None:
    """Why this update of the transformation ``name`` cannot be fused, or None.

    With ``definition`` and ``name`` bound, a :data:`~.transform.FusedRefusal`.

    ``leaves`` holds ``(where, update, param)`` for each leaf with an update (``where``
    names it: ``"updates['w']"``). Checked in the order of cost: Triton is imported
    only where the rest allows the fused path.
    """
    if not has_fused_kernel(definition) or definition.name not in HOW:
        return f"{name} has no fused update yet"
    if functorch:
        return "inside a torch.func transform (vmap, grad) the Triton kernels cannot run"
    for where, update, param in leaves:
        if update.requires_grad:
            return f"{where} carries a graph: the fused kernels are not differentiable"
        why = _tensor_refusal(update)
        if why is not None:
            return f"{where} {why}"
        if param is update:
            continue
        why = _tensor_refusal(param)
        if why is None and (param.dtype, param.device) != (update.dtype, update.device):
            why = f"is {param.dtype} on {param.device}, unlike its update"
        if why is not None:
            return f"the parameter of {where} {why}"
    if not _triton_importable():
        return "Triton cannot be imported (pip install triton)"
    option = fused_kernel(definition).unsupported(group, float(group["temperature"]))
    return None if option is None else option


def fused_update(
    definition: SamplerDefinition,
    group: Mapping[str, Any],
    grads: list[Tensor],
    params: list[Tensor],
    buffers: Mapping[str, list[Any]],
    *,
    seed: int,
    count: int,
    keys: list[int],
    inplace: bool,
) -> tuple[list[Tensor], dict[str, list[Any]]]:
    r"""The updates :math:`-lr\,d` and the new buffers, by the sampler's fused kernel.

    ``buffers`` holds each state field the group keeps (the transformation's: tensors,
    and floats for the host numbers); with ``inplace`` the tensors are updated in place
    and the updates written into ``grads``, else nothing given is modified.
    """
    kernel = fused_kernel(definition)
    temperature = float(group["temperature"])
    seeds = fused_noise_seeds(seed, count, keys) if temperature > 0 else [0] * len(keys)
    offsets = [parameter_offset(param) for param in params]
    flags = {grad.device: torch.zeros(1, dtype=torch.float64, device=grad.device) for grad in grads}
    largest = [flags[grad.device] for grad in grads]
    given = {
        field: [
            value.clone() if isinstance(value, Tensor) and not inplace else value
            for value in values
        ]
        for field, values in buffers.items()
    }
    if HOW[definition.name] == "update":
        outs = grads if inplace else [torch.empty_like(grad) for grad in grads]
        inputs = FusedInput(params, grads, given, seeds, offsets, largest)
        new = kernel.launch(group, inputs, updates=outs)  # type: ignore[call-arg]
        return outs, {field: list(new[field]) for field in buffers}
    # "from zero": the kernel steps theta = 0 with g' given as the gradient
    weight_decay, maximize = float(group["weight_decay"]), bool(group["maximize"])
    folded = [
        effective_grad(grad, param, weight_decay=weight_decay, maximize=maximize).contiguous()
        for grad, param in zip(grads, params, strict=True)
    ]
    if count == 0:  # the zeros of a fresh state stand for a buffer the kernel creates
        created = {state.name for state in definition.state if state.init is None}
        given = {
            field: [None] * len(grads) if field in created else values
            for field, values in given.items()
        }
    zeros = [torch.zeros_like(grad) for grad in grads]
    neutral = {**group, "weight_decay": 0.0, "maximize": False}
    new = kernel.launch(neutral, FusedInput(zeros, folded, given, seeds, offsets, largest))
    if inplace:
        for grad, update in zip(grads, zeros, strict=True):
            grad.copy_(update)
        zeros = grads
    return zeros, {field: list(new.get(field, given[field])) for field in buffers}
