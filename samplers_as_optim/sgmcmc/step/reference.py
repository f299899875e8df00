"""The reference backend of the step pipeline: one param group's update by torch ops.

After the guard (``step/nonfinite``, ``step/grad_scaler``), a group's step is the pipeline of
``docs/design.md`` ("The step"): its tensors and state made ready (``step/ready``),
the noise (``step/group_noise``, drawn ahead by ``step/prefetch`` where it was), the sampler's
pure update (its definition's ``update``: foreach kernels, or on the CPU chunk by chunk,
``step/chunked``), the step ``theta <- theta - lr d`` (``tensor_lists.apply_step_``) and
the write-back of half-precision masters (``step/half_precision``). The fused backend
(``fused/backend``) runs the same stages in one Triton kernel per tensor.

A step the device may skip (``keep``: ``nonfinite="skip"`` or a ``GradScaler``'s
``found_inf``) selects every new parameter and buffer against the old one with
``torch.where``, without a host synchronisation.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..definition import UpdateInput
from ..tensor_lists import apply_step_, default_foreach
from .chunked import chunkable, update_in_chunks
from .grad_scaler import unscaled_grads
from .group_noise import GroupNoise, group_noise
from .half_precision import store_masters_
from .nonfinite import kept
from .plan import StepRates
from .ready import positions, ready_state
from .skipped_host import exact_step_unless_skipped, rescale_gate

__all__ = ["call_update", "update_group"]


def update_group(
    opt: Any,
    group: dict[str, Any],
    params: list[Tensor],
    grads: list[Tensor],
    rates: StepRates,
    *,
    keep: dict[torch.device, Tensor] | None = None,
    grad_scale: Tensor | None = None,
) -> None:
    """Draw the noise, call the sampler's update, store its state and take the step.

    ``keep`` (``nonfinite="skip"``, or a ``GradScaler``'s ``found_inf``): per device, a
    0-d boolean tensor, False when the step must change nothing; the new parameters and
    buffers are then selected with ``torch.where`` against the old ones, without a host
    synchronisation. ``grad_scale`` (a ``GradScaler``'s): the update reads each gradient
    as ``g / grad_scale``, ``.grad`` is left as it is. ``rates``: the group's plan.

    A float16/bfloat16 parameter at T > 0, or one that has a master already, is updated
    through its float32 master (``step/half_precision``): the update runs on the master with
    the gradient widened, then the parameter takes its rounding.
    """
    masters, tensors = positions(opt, params, rates.temperature, rates.layout)
    if grad_scale is not None or tensors is not params:
        grads = unscaled_grads(grads, grad_scale, widen=[m is not None for m in masters])
    _update_tensors(opt, group, params, tensors, grads, rates, keep=keep)
    if tensors is not params:
        store_masters_(params, masters, opt._master_sync)


def _update_tensors(
    opt: Any,
    group: dict[str, Any],
    params: list[Tensor],
    tensors: list[Tensor],
    grads: list[Tensor],
    rates: StepRates,
    *,
    keep: dict[torch.device, Tensor] | None,
) -> None:
    """:func:`update_group` on ``tensors`` (each parameter, or its master).

    ``params`` key the state and the noise; ``tensors`` are updated in place. On the
    CPU without foreach, large tensors are updated chunk by chunk, in cache
    (``step/chunked``), with the same numbers.
    """
    lr, temperature, fields = rates.lr, rates.temperature, rates.fields
    foreach = group["foreach"]
    if foreach is None:  # under compile, whole tensors (both paths: the same numbers)
        if rates.layout is not None:  # (a planned step: not traced)
            foreach = rates.layout.foreach
        else:
            foreach = torch.compiler.is_compiling() or default_foreach(params)
    gate = rescale_gate(keep, opt.host_state)  # (where a skip puts back the rate)
    states = ready_state(opt, group, rates, params, tensors, foreach=foreach, unless_nonfinite=gate)
    buffers: list[list[Any]] = [[state.get(name) for state in states] for name in fields]
    exact = opt.definition.zero_temperature_step
    if exact is not None and temperature == 0:
        inputs = UpdateInput(tensors, grads, dict(zip(fields, buffers, strict=True)), None)
        at_zero = {**group, "lr": lr, "temperature": 0.0}
        if exact_step_unless_skipped(exact, at_zero, inputs, foreach, keep, opt.host_state):
            return
    noise_of = None
    if temperature > 0:
        noise_of = group_noise(opt, group, params, tensors, rates.scratch, rates.layout)
    if (
        keep is None
        and not foreach
        and isinstance(noise_of, GroupNoise | None)
        and opt.chunked_kernel
        and chunkable(tensors, grads, buffers)
    ):

        def kernel(
            ps: list[Tensor], gs: list[Tensor], bs: list[list[Any]], noise: list[Tensor] | None
        ) -> list[Tensor]:
            return call_update(opt, group, fields, ps, gs, bs, noise, lr, temperature, False)[0]

        update_in_chunks(kernel, tensors, grads, buffers, noise_of, lr=lr, temperature=temperature)
        return
    noise = None if noise_of is None else noise_of.all()
    old = None if keep is None else [_copies(field, foreach) for field in buffers]
    directions, new_buffers = call_update(
        opt, group, fields, tensors, grads, buffers, noise, lr, temperature, foreach
    )
    _store(opt, fields, states, new_buffers, old, keep)
    kinds = None if rates.layout is None or tensors is not params else rates.layout.buckets
    apply_step_(
        tensors, directions, lr=lr, as_sgd=temperature == 0, foreach=foreach, keep=keep, kinds=kinds
    )


def _copies(field: list[Any], foreach: bool) -> list[Any]:
    """A field's buffers, copied before the update writes them: a skipped step selects them."""
    if foreach and field and all(isinstance(buffer, Tensor) for buffer in field):
        return list(torch._foreach_clone(field))
    return [None if buffer is None else buffer.clone() for buffer in field]


def _store(
    opt: Any,
    fields: tuple[str, ...],
    states: list[dict[str, Any]],
    new_buffers: list[list[Any]],
    old: list[list[Any]] | None,
    keep: dict[torch.device, Tensor] | None,
) -> None:
    """Write the update's new buffers into the states (selected against ``old`` if kept)."""
    for f, (name, field) in enumerate(zip(fields, new_buffers, strict=True)):
        host = name in opt.host_state  # put back if skipped (``step/skipped_host``)
        for i, (state, value) in enumerate(zip(states, field, strict=True)):
            if value is None:  # not created yet: torch.optim keeps tensors only
                state.pop(name, None)
                continue
            if old is not None and keep is not None and isinstance(value, Tensor) and not host:
                value = kept(value, old[f][i], keep)
            state[name] = value


def call_update(
    opt: Any,
    group: dict[str, Any],
    fields: tuple[str, ...],
    params: list[Tensor],
    grads: list[Tensor],
    buffers: list[list[Any]],
    noise: list[Tensor] | None,
    lr: float,
    temperature: float,
    foreach: bool,
) -> tuple[list[Tensor], list[list[Any]]]:
    """Call the sampler's pure update: ``(directions, new buffers per field)``."""
    directions, new = opt.definition.update(
        {**group, "lr": lr, "temperature": temperature, "initial_state": False},
        UpdateInput(params, grads, dict(zip(fields, buffers, strict=True)), noise),
        foreach=foreach,
        inplace=True,
    )
    return directions, [list(new[name]) for name in fields]
