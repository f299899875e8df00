"""The fused backend of the step pipeline: every group's update by the sampler's Triton kernel.

The same stages as the reference backend (``step/reference``): the guard
(:class:`FusedVerdict`: the kernels' flag on the device), the tensors and state made
ready (``step/ready``), then one kernel per tensor (``fused/kernels``) that reads each
parameter, gradient and buffer once, unscales the gradient (a GradScaler's scale), draws
the fused noise stream in registers (``fused.fused_noise_seeds``), takes the sampler's
update, writes the buffers and the parameter (through its float32 master, rounded back,
for a half-precision parameter) and writes nothing when the flag says the step is skipped
or refused.

Which backend a step takes is decided by :func:`takes_fused_step` (``fused=True``,
``fused=None`` on CUDA, never under ``torch.compile``). The module registers the backend
with the step (``step/backends``) when it is imported, which ``samplers_as_optim.sgmcmc``
does: the reference step imports nothing of this folder.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .. import fused as fused_module
from ..step.backends import Groups, register_fused_backend
from ..step.grad_scaler import ScalerInput, found_inf_flags, on_device
from ..step.guard import skip_record
from ..step.plan import StepRates
from ..step.ready import positions, ready_state
from ..step.skipped_host import host_record, put_back_if_skipped
from ..tensor_lists import default_foreach
from . import (
    DEFAULT_ON_CUDA,
    fused_message,
    fused_noise_seeds,
    fused_refusal,
    parameter_offset,
)
from .kernels import fused_kernel
from .launch import FusedInput
from .nonfinite import DeferredRefusal, check_gradients, count_skipped

__all__ = ["FusedVerdict", "TritonBackend", "fused_step", "takes_fused_step"]


class FusedVerdict:
    """The fused backend's guard: the kernels' flag per device, and what follows it.

    Attributes:
        largest: per device, a 1-element float64 tensor the kernels read: finite when
            the step is kept (nothing is written otherwise).
        finite_where: ``largest`` where a skip or refusal must keep the buffers'
            every bit through the lr re-expression, else None.
    """

    def __init__(self, opt: Any, gathered: list[Any], scaler: ScalerInput) -> None:
        self.check = self.rollback = None
        if scaler.found_inf is not None:
            self.largest = found_inf_flags(gathered, scaler.found_inf)
        else:
            self.check = check_gradients(gathered)
            self.largest = self.check.largest
            if opt._nonfinite == "skip":
                count_skipped(gathered, self.largest)
            else:
                self.rollback = host_record(
                    opt.state, opt.param_groups, gathered, opt.host_state, counters=True
                )
        self.record: Callable[[], None] | None = (
            skip_record(opt, gathered) if self.rollback is None else None
        )
        refused_or_skipped = self.rollback is not None or self.record is not None
        self.finite_where = self.largest if refused_or_skipped else None

    def settle(self, opt: Any) -> None:
        """After the kernels: leave the refusal to the next call, or the skip's record."""
        if self.rollback is not None and self.check is not None:
            steps = {id(group): int(group["step"]) for group in opt.param_groups}
            opt._runtime["refusal"] = DeferredRefusal(
                self.check, steps=steps, rollback=self.rollback
            )
        if self.record is not None:
            kept = {device: flag.isfinite().reshape(()) for device, flag in self.largest.items()}
            put_back_if_skipped(opt._runtime, self.record, kept)


def check_construction(definition: Any, groups: Groups) -> None:
    """Raise where ``fused=True`` cannot run, as far as the parameters tell before a step."""
    reason = fused_refusal(definition, groups)
    if reason is not None:
        raise ValueError(fused_message(reason))


def takes_fused_step(opt: Any, gathered: list[Any], *, compiling: bool) -> bool:
    """Whether this step is fused (``fused``); with ``fused=True``, raise if it cannot be.

    ``fused=None`` takes the fused path where :func:`~.fused.fused_refusal` finds no
    reason against it and no param group sets ``foreach`` (a choice of the unfused
    kernels); never under ``torch.compile``, which traces the unfused step, nor for a
    step without gradients (which would only import Triton), nor where every group is at
    temperature 0: there the step is ``torch.optim``'s default (foreach) step, bit for
    bit, as the optimizer it replaces takes it (``fused=True`` is ``SGD(fused=True)``'s
    step at T = 0), nor where no parameter is on a CUDA device, nor for a ``capturable``
    optimizer (whose counter the kernels cannot read).
    """
    fused = opt._fused
    if fused is False or (fused is None and (compiling or not DEFAULT_ON_CUDA)):
        return False
    if fused is None and (
        opt._capturable
        or any(group["foreach"] is not None for _, group, *_ in gathered)
        or not any(params for _, _, params, _ in gathered)
        or all(float(group["temperature"]) == 0 for _, group, params, _ in gathered if params)
        or not (_any_on_cuda(gathered) or _fused_on_cpu())
    ):
        return False
    reason = fused_refusal(opt.definition, gathered, opt.state, compiling=compiling)
    if reason is not None and fused:
        raise ValueError(fused_message(reason))
    return reason is None


def _any_on_cuda(gathered: list[Any]) -> bool:
    return any(param.is_cuda for _, _, params, _ in gathered for param in params)


def _fused_on_cpu() -> bool:
    """Whether tests run the kernels on CPU tensors (``fused.RUN_ON_CPU_UNDER_INTERPRETER``).

    Read from the module at each call: the tests set the flag on it.
    """
    return bool(fused_module.RUN_ON_CPU_UNDER_INTERPRETER)


def fused_step(opt: Any, gathered: list[Any], rates: list[StepRates], scaler: ScalerInput) -> None:
    """Every group's step by the sampler's fused kernel, checked on the device.

    The kernels read the flag of the guard (:class:`FusedVerdict`) and write
    nothing when a gradient is not finite: with ``nonfinite="skip"`` the step is counted
    as skipped, with ``"raise"`` the verdict is read by the next ``step()`` or
    ``state_dict()``, which can then put back what this step recorded on the host. Under
    a ``GradScaler`` its ``found_inf`` is the flag: no check of the gradients, no refusal.
    """
    verdict = FusedVerdict(opt, gathered, scaler)
    for (_, group, params, grads), planned_rates in zip(gathered, rates, strict=True):
        temperature, lr = planned_rates.temperature, planned_rates.lr
        if not params or (temperature > 0 and lr == 0):
            continue  # a step of length zero: no time passes, nothing changes
        _update_group(
            opt,
            group,
            params,
            grads,
            planned_rates,
            largest=verdict.largest,
            grad_scale=scaler.grad_scale,
            finite_where=verdict.finite_where,
        )
        if temperature > 0:  # the keys the noise was drawn with (``core/chain``)
            opt._record_noise_keys(params)
    verdict.settle(opt)


def _grad_scales(params: list[Tensor], grad_scale: Tensor) -> list[Tensor]:
    """The GradScaler's scale as a float32 1-element tensor on each parameter's device."""
    on: dict[torch.device, Tensor] = {}  # (``grad_scaler.on_device``: one copy per device)
    return [on_device(grad_scale, param.device, on).reshape(1) for param in params]


def _update_group(
    opt: Any,
    group: dict[str, Any],
    params: list[Tensor],
    grads: list[Tensor],
    rates: StepRates,
    *,
    largest: dict[torch.device, Tensor],
    grad_scale: Tensor | None = None,
    finite_where: dict[torch.device, Tensor] | None = None,
) -> None:
    """One param group's step by the sampler's fused kernel (``sgmcmc/fused``).

    The state is created and re-expressed in lr's units as by the reference backend
    (a step refused later keeps every bit of its buffers: ``finite_where``); the kernel
    then reads and writes each parameter and buffer once. A half-precision parameter's
    float32 master (``step/half_precision``) and the GradScaler's scale go to the kernel
    (``FusedInput.masters``, ``FusedInput.grad_scales``).
    """
    lr, temperature, fields = rates.lr, rates.temperature, rates.fields
    masters, tensors = positions(opt, params, temperature)
    foreach = default_foreach(params)
    states = ready_state(
        opt, group, rates, params, tensors, foreach=foreach, unless_nonfinite=finite_where
    )
    keys = opt._noise_keys(params) if temperature > 0 else [0] * len(params)
    seeds = (
        fused_noise_seeds(group["seed"], group["step"], keys, opt._shard)
        if temperature > 0
        else [0] * len(params)
    )
    extra: dict[str, Any] = {}  # the fields of FusedInput a plain step leaves out
    if grad_scale is not None:
        extra["grad_scales"] = _grad_scales(params, grad_scale)
    if any(master is not None for master in masters):
        extra["masters"] = masters
    inputs = FusedInput(
        params,
        grads,
        {name: [state.get(name) for state in states] for name in fields},
        seeds,
        [parameter_offset(param) for param in params],
        [largest[param.device] for param in params],
        **extra,
    )
    new = fused_kernel(opt.definition).launch(
        {**group, "lr": lr, "temperature": temperature}, inputs
    )
    for param, master in zip(params, masters, strict=True):
        if master is not None:  # the kernel wrote its rounding into the parameter
            opt._master_sync.written(param, master)
    for name in fields:
        for state, value in zip(states, new[name], strict=True):
            if value is None:  # not created yet (a frozen preconditioner)
                state.pop(name, None)
            else:
                state[name] = value


class TritonBackend:
    """The fused backend as the step asks for it (``step/backends.FusedBackend``)."""

    check_construction = staticmethod(check_construction)
    takes_step = staticmethod(takes_fused_step)
    step = staticmethod(fused_step)


register_fused_backend(TritonBackend())
