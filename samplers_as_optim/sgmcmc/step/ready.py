"""The pipeline's first stage for a param group: the tensors stepped and their state, ready.

Both backends (``step/reference``, ``fused/backend``) start a group's update here: each
parameter's float32 master where it keeps one (``step/half_precision``), the per-parameter
state the sampler's update reads, created where it is missing (a first step, a state
loaded from another sampler), and state kept in lr's units re-expressed when ``lr`` has
changed (``momentum_units``; ``docs/design.md``). The functions take the optimizer
(``SamplerOptimizer``) whose state they read and write.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..definition.momentum_units import rescale_momentum_state
from .half_precision import HALF_DTYPES, compute_tensors
from .plan import StepRates, TensorLayout

__all__ = ["init_state", "positions", "ready_state", "reexpress_state"]


def positions(
    opt: Any, params: list[Tensor], temperature: float, layout: TensorLayout | None = None
) -> tuple[list[Any], list[Tensor]]:
    """Each parameter's float32 master (None without one), and the tensors stepped.

    The tensor a parameter's step updates is its master, or the parameter itself
    (``step/half_precision``). Without a half-precision parameter the tensors are
    ``params`` itself (the same list), which the reference backend reads as "no master".
    ``layout``: the parameters' (the plan's), which knows their dtypes.
    """
    half = any(param.dtype in HALF_DTYPES for param in params) if layout is None else layout.half
    if not half:
        return [None] * len(params), params
    masters = compute_tensors(
        params, opt.state, temperature=temperature, skip=opt.host_state, sync=opt._master_sync
    )
    tensors = [p if m is None else m for p, m in zip(params, masters, strict=True)]
    return masters, tensors


def init_state(opt: Any, group: dict[str, Any], param: Tensor, state: dict[str, Any]) -> None:
    """Create what a parameter's state lacks before a step (keeping what is there).

    Called before its first step, and when a loaded state lacks a field (an SGD or
    SGHMC checkpoint loaded into SGNHT has no thermostat). A field whose definition has
    no ``init`` is created by the update at the first step (SGD's momentum).
    """
    for field in opt.definition.state:
        if field.init is not None and field.used(group) and field.name not in state:
            state[field.name] = field.init(param, group)


def _created_fields(opt: Any, group: dict[str, Any], scratch: dict[str, Any]) -> frozenset[str]:
    """The fields :func:`init_state` creates in this group's states, kept per plan.

    A state holding them all is ready: one lacking only fields the update makes (a
    buffer not made yet, a preconditioner not frozen yet) is not changed by
    :func:`init_state`, which is then not called.
    """
    found = scratch.get("created_fields")
    if found is None:
        found = scratch["created_fields"] = frozenset(
            field.name
            for field in opt.definition.state
            if field.init is not None and field.used(group)
        )
    return found


def ready_state(
    opt: Any,
    group: dict[str, Any],
    rates: StepRates,
    params: list[Tensor],
    tensors: list[Tensor],
    *,
    foreach: bool,
    unless_nonfinite: dict[torch.device, Tensor] | None = None,
) -> list[dict[str, Any]]:
    """The per-parameter states of the group's fields (``rates.fields``), ready for this step.

    What a state lacks is created (new, or loaded from another kind) like its
    ``tensors``; state in lr's units follows a change of lr (``unless_nonfinite`` as for
    :func:`reexpress_state`). No field: no state (an empty list).
    """
    lr, temperature, fields = rates.lr, rates.temperature, rates.fields
    if not fields:
        return []
    state_of = opt.state
    states = [state_of[p] for p in params]
    created = _created_fields(opt, group, rates.scratch)
    for tensor, state in zip(tensors, states, strict=True):
        if not created <= state.keys():
            init_state(opt, group, tensor, state)
    reexpress_state(
        opt,
        params,
        states,
        lr=lr,
        temperature=temperature,
        foreach=foreach,
        unless_nonfinite=unless_nonfinite,
        scratch=rates.scratch,
    )
    return states


def reexpress_state(
    opt: Any,
    params: list[Tensor],
    states: list[dict[str, Any]],
    *,
    lr: float,
    temperature: float,
    foreach: bool,
    unless_nonfinite: dict[torch.device, Tensor] | None = None,
    scratch: dict[str, Any] | None = None,
) -> None:
    """Re-express state kept in lr's units when lr has changed, before the update.

    A sampler whose state holds a momentum buffer in SGD units
    (``momentum_in_lr_units``: SGHMC, SGNHT, BAOA) rescales it at T > 0 so that the
    chain's physical momentum is kept (``docs/design.md``;
    :func:`~.momentum_units.rescale_momentum_state`), reading the rate each buffer was
    written at through the optimizer's ``HostScalars``; other samplers keep no such
    state. ``unless_nonfinite`` (per device): where it is not finite the buffers keep
    every bit (a step the device skips). ``scratch``: the plan's, where the rates found
    up to date are remembered.
    """
    if opt.momentum_in_lr_units:
        rescale_momentum_state(
            states,
            lr=lr,
            temperature=temperature,
            foreach=foreach,
            params=params,
            known=opt._host_scalars,
            buffer=opt.definition.momentum_buffer,
            unless_nonfinite=unless_nonfinite,
            verified=scratch,
        )
