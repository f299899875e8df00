r"""The lr re-expression of a momentum buffer kept in SGD units (``docs/design.md``).

SGHMC, SGNHT and BAOA keep torch's momentum buffer :math:`b = -r/\sqrt{N\,lr}`, so the
buffer depends on the learning rate while the chain's state, the physical momentum
:math:`r`, does not. When ``lr`` changes at temperature > 0 (or at a restart of the
cyclical schedule) the buffer is re-expressed in the new units, :math:`b \leftarrow
\sqrt{lr_0/lr_1}\,b`; the derivation is in ``sghmc``'s module docstring. Written once
here for every sampler that keeps such a buffer, the Optimizers (``SamplerOptimizer``
with ``momentum_in_lr_units``) and the transforms alike.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ..tensor_lists import HostScalars, buckets, host_scalar, host_value, known_buffer

__all__ = ["MOMENTUM_RATE", "rescale_momentum", "rescale_momentum_state"]

#: the per-parameter entry (and transformation state field) that holds the learning rate
#: at which a momentum buffer was last written
MOMENTUM_RATE = "momentum_lr"


def rescale_momentum(
    momentum_buffers: list[Tensor | None],
    buffer_lrs: list[float | None],
    *,
    lr: float,
    temperature: float,
    foreach: bool,
    inplace: bool = True,
    unless_nonfinite: dict[torch.device, Tensor] | None = None,
) -> tuple[list[Tensor | None], list[float | None]]:
    r"""Re-express momentum buffers written at another learning rate in this step's units.

    .. math::

        b \leftarrow \sqrt{lr_b / lr}\; b \qquad \text{at } T > 0,

    which keeps the physical momentum :math:`r = -\sqrt{N\, lr}\, b` (see the module
    docstring), for each buffer whose recorded rate :math:`lr_b` is known and differs
    from ``lr``. At :math:`T = 0` nothing is rescaled (the buffers are SGD's). Shared by
    SGHMC and SGNHT, whose thermostat needs no rescaling (see :mod:`.sgnht`), and by both
    front ends; called just before the kernel, which then writes every buffer at ``lr``.

    Args:
        momentum_buffers: one buffer or None (not created yet) per parameter.
        buffer_lrs: the learning rate at which each buffer was last written, or None
            when unknown (a buffer that has only been SGD's, or a fresh one): then it is
            taken to be ``lr``.
        lr: this step's learning rate, > 0 when ``temperature`` > 0.
        temperature: T >= 0.
        foreach: multi-tensor path; both paths give the same numbers.
        inplace: rescale the given buffers in place, or return new ones.
        unless_nonfinite: per device, the step's largest gradient magnitude there (a 0-d
            or one-element tensor): rescale only where it is finite, decided on the
            device (a factor of exactly 1 otherwise, so the buffer keeps every bit). The
            fused step with ``nonfinite="raise"`` passes it, so that a step it refuses
            later has not re-expressed a buffer whose record it puts back.

    Returns:
        ``(momentum_buffers, buffer_lrs)`` to hand to the kernel and to record after the
        step: ``lr`` for every buffer at :math:`T > 0`; at :math:`T = 0` the record is
        kept up to date where there is one (so that a schedule switching the temperature
        back on rescales from the right units) and not created where there is none, so
        that the state stays ``torch.optim.SGD``'s.
    """
    if temperature == 0:
        new_lrs = [old if old is None or lr == 0 else lr for old in buffer_lrs]
        return list(momentum_buffers), new_lrs
    buffers = list(momentum_buffers)
    by_rate: dict[float, list[int]] = {}
    for i, (buffer, old) in enumerate(zip(buffers, buffer_lrs, strict=True)):
        if buffer is not None and old is not None and old != lr:
            by_rate.setdefault(old, []).append(i)
    for old, index in by_rate.items():
        factor = math.sqrt(old / lr)
        chosen = [known_buffer(buffers[i]) for i in index]  # only buffers with a rate
        gated: dict[torch.device, Tensor] = {}
        if not foreach:
            for i, buffer in zip(index, chosen, strict=True):
                scale = _gated(factor, buffer.device, unless_nonfinite, gated)
                buffers[i] = buffer.mul_(scale) if inplace else buffer.mul(scale)
            continue
        for bucket in buckets(chosen):
            tensors = [chosen[j] for j in bucket]
            # out of place (then copied): on the CPU the in-place foreach multiply rounds
            # the factor to a bfloat16/float16 buffer's dtype first, unlike mul_
            scale = _gated(factor, tensors[0].device, unless_nonfinite, gated)
            scaled = list(torch._foreach_mul(tensors, scale))
            if inplace:
                torch._foreach_copy_(tensors, scaled)
                scaled = tensors
            for j, tensor in zip(bucket, scaled, strict=True):
                buffers[index[j]] = tensor
    return buffers, [lr] * len(buffers)


def _gated(
    factor: float,
    device: torch.device,
    unless_nonfinite: dict[torch.device, Tensor] | None,
    cache: dict[torch.device, Tensor],
) -> float | Tensor:
    """The factor, or (``unless_nonfinite``) a float64 0-d tensor of it or of 1 on ``device``.

    A buffer times the tensor rounds as times the Python float: both are read in the
    buffer's compute type.
    """
    if unless_nonfinite is None or device not in unless_nonfinite:
        return factor
    if device not in cache:
        cache[device] = torch.where(
            unless_nonfinite[device].reshape(()).isfinite(),
            torch.tensor(factor, dtype=torch.float64, device=device),
            torch.ones((), dtype=torch.float64, device=device),
        )
    return cache[device]


def rescale_momentum_state(
    states: list[dict[str, Any]],
    *,
    lr: float,
    temperature: float,
    foreach: bool,
    params: Sequence[Tensor] | None = None,
    known: HostScalars | None = None,
    buffer: str = "momentum_buffer",
    unless_nonfinite: dict[torch.device, Tensor] | None = None,
    verified: dict[str, Any] | None = None,
) -> None:
    """:func:`rescale_momentum` on an Optimizer's per-parameter states, in place.

    Reads ``buffer`` (``"momentum_buffer"``; AdamW's ``"exp_avg"``) and its recorded rate
    ``"momentum_lr"`` (absent from a ``torch.optim.SGD`` state) and records the rate of the
    coming step. The rate is a 0-d float64 tensor on the CPU, as ``torch.optim`` keeps every
    per-parameter state entry a tensor (checkpoints written before it was one hold a float,
    read alike and replaced); an entry is replaced when its rate changes, never modified in
    place.

    Args:
        states: the per-parameter states.
        lr: this step's learning rate.
        temperature: this step's temperature.
        foreach: multi-tensor path; both paths give the same numbers.
        params: the parameters of ``states``, with ``known``: the rates ``known``
            remembers are not read back from their tensors (an Optimizer's step).
        known: the Optimizer's :class:`~._common.HostScalars` of its rates.
        buffer: the name of the momentum buffer in the states.
        unless_nonfinite: as for :func:`rescale_momentum`.
        verified: a dict kept from step to step (a step's plan's scratch), where the
            records a call left are remembered with its ``lr`` and ``temperature``: a
            call that finds the same record tensors and rates does nothing, as it would
            (records are replaced, never modified in place).
    """
    records = [state.get(MOMENTUM_RATE) for state in states]
    if verified is not None:
        last = verified.get("momentum_rates")
        if (
            last is not None
            and last[0] == (lr, temperature)
            and len(last[1]) == len(records)
            and all(map(operator.is_, last[1], records))
        ):
            return
    _rescale_states(
        states, records, lr, temperature, foreach, params, known, buffer, unless_nonfinite
    )
    if verified is not None:
        verified["momentum_rates"] = ((lr, temperature), [s.get(MOMENTUM_RATE) for s in states])


def _rescale_states(
    states: list[dict[str, Any]],
    records: list[Any],
    lr: float,
    temperature: float,
    foreach: bool,
    params: Sequence[Tensor] | None,
    known: HostScalars | None,
    buffer: str,
    unless_nonfinite: dict[torch.device, Tensor] | None,
) -> None:
    """:func:`rescale_momentum_state` given the states' ``records``."""
    if temperature == 0 and records.count(None) == len(records):
        return  # SGD's buffers, with no record to keep up to date
    if params is not None and known is not None:
        rates = [known.value(p, r) for p, r in zip(params, records, strict=True)]
    else:
        rates = [host_value(record) for record in records]
    if all(rate == lr for rate in rates) and all(isinstance(r, Tensor) for r in records):
        return  # every buffer is in this step's units and its record says so already
    _, new_rates = rescale_momentum(
        [state.get(buffer) for state in states],
        rates,
        lr=lr,
        temperature=temperature,
        foreach=foreach,
        unless_nonfinite=unless_nonfinite,
    )
    for i, (state, record, rate, new) in enumerate(
        zip(states, records, rates, new_rates, strict=True)
    ):
        if new is None or (new == rate and isinstance(record, Tensor)):
            continue  # unchanged: the same tensor, whose value ``known`` remembers
        if params is not None and known is not None:
            state[MOMENTUM_RATE] = known.tensor(params[i], new)
        else:
            state[MOMENTUM_RATE] = host_scalar(new)
