"""Pieces every sampler kernel shares, written once.

Every kernel in this package computes a *direction* ``d`` per parameter; the step is
``theta <- theta - lr * d``. The gradient entering a kernel is the one
``torch.optim.SGD`` would use,

    g' = (-g if maximize else g) + weight_decay * theta,

computed with the same operations in the same order as ``torch.optim.SGD`` (single-tensor
and foreach), which is what makes the samplers equal SGD bit for bit at temperature 0.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from ..core.dtensor import full_tensor, is_dtensor, local_tensor

__all__ = [
    "HostScalars",
    "add_scalar_",
    "all_finite",
    "apply_step_",
    "buckets",
    "default_foreach",
    "effective_grad",
    "effective_grads",
    "gradients_may_be_non_finite",
    "host_scalar",
    "host_value",
    "known_buffer",
    "may_be_non_finite",
    "mul_each_",
    "mul_scalar_",
    "plus_scalar",
    "scalar_operand",
    "select_",
]


def effective_grad(grad: Tensor, param: Tensor, *, weight_decay: float, maximize: bool) -> Tensor:
    """Return ``g'`` for one tensor (never modifies ``grad``)."""
    out = -grad if maximize else grad
    if weight_decay != 0:
        out = out.add(param, alpha=weight_decay)
    return out


def effective_grads(
    grads: list[Tensor], params: list[Tensor], *, weight_decay: float, maximize: bool
) -> tuple[list[Tensor], bool]:
    """Return ``g'`` for a list of same-device, same-dtype tensors with foreach ops.

    Returns:
        ``(grads, owned)``: ``owned`` is True when the returned tensors are fresh (safe
        to modify in place), False when they are the caller's gradients themselves.
    """
    owned = False
    if maximize:
        grads = list(torch._foreach_neg(grads))
        owned = True
    if weight_decay != 0:
        if owned:
            torch._foreach_add_(grads, params, alpha=weight_decay)
        else:
            grads = list(torch._foreach_add(grads, params, alpha=weight_decay))
            owned = True
    return grads, owned


def bucketed_grads(
    params: list[Tensor], grads: list[Tensor], *, weight_decay: float, maximize: bool
) -> Iterator[tuple[list[int], list[Tensor], bool]]:
    """Per (device, dtype) bucket of a foreach kernel: ``(indices, g', owned)``.

    ``g'`` is :func:`effective_grads` of the bucket's gradients and parameters, and
    ``owned`` says whether it may be modified in place.
    """
    for index in buckets(params):
        bucket, owned = effective_grads(
            [grads[i] for i in index],
            [params[i] for i in index],
            weight_decay=weight_decay,
            maximize=maximize,
        )
        yield index, bucket, owned


def buckets(tensors: Sequence[Tensor]) -> list[list[int]]:
    """Indices of ``tensors`` grouped by (device, dtype), for foreach kernels."""
    kinds = [(tensor.device, tensor.dtype) for tensor in tensors]
    if not kinds:
        return []
    if kinds.count(kinds[0]) == len(kinds):  # one bucket: no dict to build
        return [list(range(len(kinds)))]
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for index, tensor in enumerate(tensors):
        groups.setdefault((tensor.device, tensor.dtype), []).append(index)
    return list(groups.values())


def may_be_non_finite(tensors: Sequence[Tensor]) -> bool:
    """False when every tensor is certainly finite: the fast half of the non-finite guard.

    The sum of per-tensor L2 norms (one foreach reduction and one host synchronisation per
    device and dtype) is finite exactly when every tensor is, unless it overflows; so True
    means "check the tensors one by one", which the caller does to name the culprit.
    """
    for index in buckets(tensors):
        norms = torch._foreach_norm([tensors[i] for i in index])
        if not bool(torch.isfinite(torch.stack(norms).sum())):
            return True
    return False


#: dtypes whose gradients :func:`gradients_may_be_non_finite` checks in one pass
_CHECKED_IN_ONE_PASS = (torch.float32, torch.float64)


#: per device, the scale 1 and the found flag of :func:`gradients_may_be_non_finite`
_FLAGS: dict[torch.device, tuple[Tensor, Tensor]] = {}


def gradients_may_be_non_finite(
    grads: Sequence[Tensor], kinds: list[list[int]] | None = None
) -> bool:
    """:func:`may_be_non_finite` of an Optimizer's gradients, exact and in one pass.

    Where every gradient is a plain dense float32/float64 tensor outside autograd, one
    ``torch._amp_foreach_non_finite_check_and_unscale_`` per device (GradScaler's own
    check, with a scale of exactly 1, where it returns each element unchanged, bit for
    bit) sets a flag read once: about a fifth of the norms' cost for a small model, and
    exact (no overflow). The kernel writes every element back, so the gradients' version
    counters move: only gradients that no graph can hold (``requires_grad`` False) and
    that own their elements (contiguous) take it; others take the norms. ``kinds``:
    ``buckets(grads)``, where the caller knows it.
    """
    if not _checked_in_one_pass(grads):
        return may_be_non_finite(grads)
    suspect = False
    for index in buckets(grads) if kinds is None else kinds:
        one, found = _flags_on(grads[index[0]].device)
        torch._amp_foreach_non_finite_check_and_unscale_([grads[i] for i in index], found, one)
        if bool(found):
            found.zero_()  # (the kernel only ever sets it: zero again for the next check)
            suspect = True
    return suspect


def _checked_in_one_pass(grads: Sequence[Tensor]) -> bool:
    """Whether GradScaler's check may read ``grads`` (:func:`gradients_may_be_non_finite`)."""
    return all(
        type(grad) is Tensor
        and grad.dtype in _CHECKED_IN_ONE_PASS
        and not grad.requires_grad
        and grad.is_contiguous()
        for grad in grads
    )


def _flags_on(device: torch.device) -> tuple[Tensor, Tensor]:
    """The kept scale 1 (never written) and found flag (zero between checks) of a device."""
    kept = _FLAGS.get(device)
    if kept is None:
        kept = _FLAGS[device] = (
            torch.ones(1, dtype=torch.float32, device=device),
            torch.zeros(1, dtype=torch.float32, device=device),
        )
    return kept


def all_finite(
    tensors: Sequence[Tensor], kinds: list[list[int]] | None = None, *, one_pass: bool = False
) -> dict[torch.device, Tensor]:
    """Whether every tensor is finite, as a 0-d boolean tensor on each tensors' device.

    Nothing is read back to Python (no host synchronisation). Exact: a tensor's smallest
    and largest elements (``torch.aminmax``, which propagates NaN and cannot overflow)
    are finite exactly when every element is. (The L2 norm of the eager check can
    overflow, and the ``inf``-norm is ten times slower on the CPU.) With tensors on
    several devices, each device's flag holds the verdict over all of them (a CPU flag
    over accelerator tensors waits for them: the one synchronisation left).

    ``one_pass`` (the eager step's gradients): where every tensor is one
    :func:`gradients_may_be_non_finite` checks in one pass, GradScaler's check (a scale
    of exactly 1: each element unchanged) sets a new flag per device, one call per
    device and dtype instead of four operations per tensor; exact too, elementwise.
    ``kinds``: ``buckets(tensors)``, where the caller knows it.
    """
    if one_pass and _checked_in_one_pass(tensors):
        flags = _one_pass_flags(tensors, kinds)
    else:
        flags = []
        for tensor in tensors:  # (a DTensor's flag made whole: every rank's verdict)
            if tensor.numel():
                smallest, largest = torch.aminmax(tensor)
                flags.append(full_tensor(torch.isfinite(torch.stack((smallest, largest))).all()))
    devices = {tensor.device for tensor in tensors}
    verdict: dict[torch.device, Tensor] = {}
    for device in devices:
        # to an accelerator without waiting; to the CPU a copy must wait for the value
        on_device = [flag.to(device, non_blocking=device.type != "cpu") for flag in flags]
        if not on_device:
            verdict[device] = torch.ones((), dtype=torch.bool, device=device)
        elif len(on_device) == 1:
            verdict[device] = on_device[0]
        else:
            verdict[device] = torch.stack(on_device).all()
    return verdict


def _one_pass_flags(tensors: Sequence[Tensor], kinds: list[list[int]] | None) -> list[Tensor]:
    """Per device, a 0-d boolean: no element of its tensors is NaN or infinite (one pass)."""
    found_on: dict[torch.device, Tensor] = {}  # (new flags: each is read later, on the device)
    for index in buckets(tensors) if kinds is None else kinds:
        device = tensors[index[0]].device
        if device not in found_on:
            found_on[device] = torch.zeros(1, dtype=torch.float32, device=device)
        bucket, found, one = [tensors[i] for i in index], found_on[device], _flags_on(device)[0]
        torch._amp_foreach_non_finite_check_and_unscale_(bucket, found, one)
    return [found.view(()).eq(0) for found in found_on.values()]


def default_foreach(tensors: Sequence[Tensor]) -> bool:
    """torch.optim's default: foreach when every tensor is a plain tensor on an accelerator."""
    return bool(tensors) and all(
        type(t) in (Tensor, torch.nn.Parameter) and t.device.type in ("cuda", "xpu")
        for t in tensors
    )


def apply_step_(
    params: list[Tensor],
    directions: list[Tensor],
    *,
    lr: float,
    as_sgd: bool,
    foreach: bool,
    keep: dict[torch.device, Tensor] | None = None,
    kinds: list[list[int]] | None = None,
) -> None:
    """Take the step ``theta <- theta - lr * d`` in place.

    Two roundings of the same step, because ``add_(d, alpha=-lr)`` is a fused
    multiply-add while a torchopt transform's update is the rounded ``-lr * d`` added
    afterwards:

    * ``as_sgd=True`` (temperature 0): ``param.add_(d, alpha=-lr)``, exactly
      ``torch.optim.SGD``'s operation;
    * ``as_sgd=False`` (temperature > 0): ``param.add_(d * -lr)``, exactly what a
      torchopt transform's update followed by ``torchopt.apply_updates`` does, so an
      Optimizer and a transform with one seed produce the same chain bit for bit.

    ``keep`` (``nonfinite="skip"``): per device, a 0-d boolean tensor; where it is False
    the parameters keep their values (``torch.where``, the same roundings otherwise).
    ``kinds``: ``buckets(params)``, where the caller knows it.
    """
    alpha = -lr if as_sgd else 1  # (1: the rounded product added, exactly)
    if not foreach:
        for param, direction in zip(params, directions, strict=True):
            step = direction if as_sgd else direction.mul(scalar_operand(-lr, direction))
            if keep is None:
                param.add_(step, alpha=alpha)
            else:
                select_(param, keep[param.device], param.add(step, alpha=alpha), param)
        return
    for index in buckets(params) if kinds is None else kinds:
        bucket_params = params if len(index) == len(params) else [params[i] for i in index]
        steps: list[Tensor] | tuple[Tensor, ...] = [directions[i] for i in index]
        if not as_sgd:
            steps = torch._foreach_mul(steps, scalar_operand(-lr, steps[0]))
        if keep is None:
            torch._foreach_add_(bucket_params, steps, alpha=alpha)
            continue
        moved = torch._foreach_add(bucket_params, steps, alpha=alpha)
        for param, new in zip(bucket_params, moved, strict=True):
            select_(param, keep[param.device], new, param)


def select_(out: Tensor, keep: Tensor, new: Tensor, old: Tensor) -> Tensor:
    """``out <- torch.where(keep, new, old)``: written in place, one operation for a plain tensor.

    ``out`` is ``new`` or ``old`` (the select writes over one of its operands, element by
    element: the same values as ``copy_`` of the select). ``keep`` is a plain tensor
    (:func:`all_finite`'s); a DTensor selects in its local shard, another tensor subclass
    takes the select and then its ``copy_``.
    """
    if type(out) in (Tensor, torch.nn.Parameter):
        return torch.where(keep, new, old, out=out)
    if is_dtensor(out):  # (the verdict is every rank's: each selects in its own shard)
        torch.where(keep, local_tensor(new), local_tensor(old), out=local_tensor(out))
        return out
    return out.copy_(torch.where(keep, new, old))


#: the 0-d operands :func:`scalar_operand` made, by (value, dtype): read, never written
_OPERANDS: dict[tuple[Any, ...], Tensor] = {}


def scalar_operand(value: float, like: Tensor) -> float | Tensor:
    """``value`` for ``mul`` by tensors like ``like``: the same product, made cheaper.

    On the CPU in float32/float64 a 0-d tensor of their dtype (``mul`` wraps a Python
    number per tensor, 5 us each), made once per value and dtype and kept (a step
    multiplies by the same few numbers every time; only ever read); else the number
    (kernels use the unrounded number). Traced by ``torch.compile``, or under
    ``torch.inference_mode`` (whose tensors autograd may not save later), a new tensor.
    """
    dtype = like.dtype
    if not like.is_cpu or dtype not in (torch.float32, torch.float64):
        return value
    if value != value or torch.compiler.is_compiling() or torch.is_inference_mode_enabled():
        return torch.tensor(value, dtype=dtype)  # (NaN != NaN as a key)
    key = (value, dtype) if value != 0 else (value, dtype, math.copysign(1.0, value))
    operand = _OPERANDS.get(key)  # (0.0 == -0.0 as keys: a zero's key holds its sign)
    if operand is None:
        if len(_OPERANDS) >= 1024:  # (a schedule moves lr at every step: bounded)
            _OPERANDS.clear()
        operand = _OPERANDS[key] = torch.tensor(value, dtype=dtype)
    return operand


def _of_one_dtype(tensors: list[Tensor]) -> bool:
    """Whether the (non-empty) list's tensors share a dtype, so one operand serves them all."""
    return all(tensor.dtype == tensors[0].dtype for tensor in tensors)


def _list_operand(value: float, tensors: list[Tensor]) -> float | Tensor:
    """:func:`scalar_operand` for a list of tensors of one dtype; the number otherwise."""
    return scalar_operand(value, tensors[0]) if _of_one_dtype(tensors) else value


def _addend(value: float, tensors: list[Tensor]) -> tuple[float | Tensor, dict[str, float]]:
    """A foreach add's operand and keywords (``alpha`` picks the tensor's overload)."""
    operand = _list_operand(value, tensors)
    return operand, {"alpha": 1.0} if isinstance(operand, Tensor) else {}


def mul_scalar_(tensors: list[Tensor], value: float) -> None:
    """``tensors[i] *= value`` in one foreach call, the same products as with the number.

    On the CPU the operand is a kept 0-d tensor (:func:`scalar_operand`), which a foreach
    call does not wrap again for each tensor as it wraps a Python number.
    """
    if tensors:
        torch._foreach_mul_(tensors, _list_operand(value, tensors))


def mul_each_(tensors: list[Tensor], values: list[float]) -> None:
    """``tensors[i] *= values[i]`` in one foreach call, as :func:`mul_scalar_` (same products)."""
    if not tensors:
        return
    one = _of_one_dtype(tensors)
    operands: list[Any] = [scalar_operand(v, tensors[0]) if one else v for v in values]
    torch._foreach_mul_(tensors, operands)


def add_scalar_(tensors: list[Tensor], value: float) -> None:
    """``tensors[i] += value`` in one foreach call, as :func:`mul_scalar_` (the same sums)."""
    if tensors:
        operand, keywords = _addend(value, tensors)
        torch._foreach_add_(tensors, operand, **keywords)


def plus_scalar(tensors: list[Tensor], value: float) -> list[Tensor]:
    """``tensors[i] + value``, new tensors, as :func:`add_scalar_` (the same sums)."""
    if not tensors:
        return []
    operand, keywords = _addend(value, tensors)
    return list(torch._foreach_add(tensors, operand, **keywords))


def host_scalar(value: float) -> Tensor:
    """``value`` as a 0-d float64 tensor on the CPU: a number kept in per-parameter state.

    ``torch.optim`` keeps every entry of a parameter's state a tensor (its step counters
    are 0-d CPU tensors); float64 holds a Python float exactly, and on the CPU reading it
    back costs no device synchronisation.
    """
    return torch.tensor(value, dtype=torch.float64)


def host_value(stored: Tensor | float | None) -> float | None:
    """The number a state entry holds: a 0-d tensor's value, a float as is, None for None."""
    return None if stored is None else float(stored)


class HostScalars:
    """The values of 0-d state tensors (:func:`host_scalar`) a step reads, known to Python.

    A step that needs such a number in Python (to decide whether, and by how much, to
    rescale a buffer) would otherwise read the tensor back every step: a host round trip
    per parameter in eager mode and a graph break under ``torch.compile``. This remembers,
    per parameter, the tensor last written or read and its value, and trusts the value
    while the state still holds that very tensor: a loaded or replaced entry is a new
    tensor, read once. The samplers replace such entries, never modify them in place.
    """

    def __init__(self) -> None:
        self._known: dict[int, tuple[Tensor, float]] = {}

    def value(self, param: Tensor, stored: Tensor | float | None) -> float | None:
        """The number ``stored`` (``param``'s state entry) holds."""
        if not isinstance(stored, Tensor):
            return host_value(stored)
        known = self._known.get(id(param))
        if known is not None and known[0] is stored:
            return known[1]
        value = float(stored)
        self._known[id(param)] = (stored, value)
        return value

    def tensor(self, param: Tensor, value: float) -> Tensor:
        """A new entry holding ``value`` for ``param``'s state (:func:`host_scalar`)."""
        stored = host_scalar(value)
        self._known[id(param)] = (stored, value)
        return stored


def known_buffer(buffer: Tensor | None) -> Tensor:
    """A buffer known to exist (for the type checker)."""
    assert buffer is not None
    return buffer
