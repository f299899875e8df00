"""``torch.amp.GradScaler``'s protocol with optimizers that unscale and skip themselves.

``GradScaler.step(optimizer)`` sees ``optimizer._step_supports_amp_scaling`` and then
neither unscales the gradients nor reads anything back to Python: it sets
``optimizer.grad_scale`` (its scale, a 1-element float32 tensor; None when ``unscale_``
was called already) and ``optimizer.found_inf`` (a float32 tensor, > 0 when a gradient
held NaN or infinity), calls ``step()``, and deletes both (as with torch's fused
optimizers). A sampler's step then

- reads each gradient as :math:`g / s` (:func:`unscaled_grads`; ``.grad`` itself is
  left as it was, scaled), in float32 or wider;
- is skipped on the device exactly when ``found_inf > 0`` (:func:`keep_flags`, and
  :func:`found_inf_flags` for the fused kernels' flag), without a host synchronisation
  and without ``FloatingPointError`` whatever ``nonfinite`` says: an overflow is the
  scaler's business, which halves its scale and goes on. Such a step is counted in
  ``group["skipped_steps"]`` and advances the chain's step counter (the noise index), as
  ``nonfinite="skip"`` does; the host counts it advanced (``StateField.host``: RMSprop's
  and AdamW's step counts) are put back (``step/skipped_host``), as torch's fused Adam takes
  its count back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from .nonfinite import count_skipped_where

__all__ = [
    "ScalerInput",
    "found_inf_flags",
    "keep_flags",
    "on_device",
    "scaler_input",
    "unscaled_grads",
]

#: one param group's gathered step: (its index, the group, params and their gradients)
Gathered = Sequence[tuple[int, dict[str, Any], list[Tensor], list[Tensor]]]


class ScalerInput(NamedTuple):
    """What ``GradScaler.step`` handed to this step (each may be None).

    Attributes:
        grad_scale: the scale the gradients carry, a 1-element floating tensor.
        found_inf: a 1-element floating tensor, > 0 when the step must be skipped.
    """

    grad_scale: Tensor | None
    found_inf: Tensor | None


def _check(name: str, value: Any) -> Tensor | None:
    if value is None:
        return None
    if not isinstance(value, Tensor) or not value.is_floating_point() or value.numel() != 1:
        shown = (
            f"a {value.dtype} tensor of shape {tuple(value.shape)}"
            if isinstance(value, Tensor)
            else repr(value)
        )
        raise TypeError(
            f"Invalid {name}: {shown} (expected None or a 1-element floating tensor, as "
            "torch.amp.GradScaler.step sets it)"
        )
    return value


def scaler_input(optimizer: Any) -> ScalerInput:
    """The ``grad_scale`` and ``found_inf`` attributes ``GradScaler.step`` set, checked."""
    return ScalerInput(
        _check("grad_scale", getattr(optimizer, "grad_scale", None)),
        _check("found_inf", getattr(optimizer, "found_inf", None)),
    )


def on_device(value: Tensor, device: torch.device, cache: dict[torch.device, Tensor]) -> Tensor:
    """``value`` as a 0-d float32 tensor on ``device`` (copied once per device, no wait)."""
    if device not in cache:
        cache[device] = value.reshape(()).to(
            device=device, dtype=torch.float32, non_blocking=device.type != "cpu"
        )
    return cache[device]


def unscaled_grads(
    grads: list[Tensor], scale: Tensor | None, *, widen: Sequence[bool] | None = None
) -> list[Tensor]:
    """Each gradient as the update reads it: :math:`g / s`, widened where asked.

    ``widen[i]``: gradient ``i`` is read in float32 (a half-precision parameter with a
    master, ``step/half_precision``). Otherwise the quotient is computed in float32 or
    wider (the promotion of the gradient's dtype with float32) and kept in the gradient's
    dtype, as ``GradScaler.unscale_`` would leave it. Never modifies a gradient; returns
    ``grads`` itself when there is nothing to do.
    """
    flags = list(widen) if widen is not None else [False] * len(grads)
    if scale is None and not any(flags):
        return grads
    scales: dict[torch.device, Tensor] = {}
    out = []
    for grad, wide in zip(grads, flags, strict=True):
        if scale is None:
            out.append(grad.float() if wide else grad)
            continue
        s = on_device(scale, grad.device, scales)
        if wide or grad.dtype in (torch.float16, torch.bfloat16):
            quotient = grad.float().div_(s)
            out.append(quotient if wide else quotient.to(grad.dtype))
        else:
            out.append(grad.div(s))  # float32 or float64: computed in the gradient's dtype
    return out


def keep_flags(
    gathered: Gathered, found_inf: Tensor, *, count: bool = True
) -> dict[torch.device, Tensor]:
    """Per device of the step's parameters, a 0-d boolean: True where it is kept.

    ``found_inf == 0``, copied to each device without waiting; the skipped step is
    counted in each group's ``skipped_steps`` (``count``).
    """
    cache: dict[torch.device, Tensor] = {}
    devices = {param.device for _, _, params, _ in gathered for param in params}
    keep = {device: on_device(found_inf, device, cache).eq(0) for device in devices}
    if count:
        count_skipped_where(gathered, {d: k.logical_not() for d, k in keep.items()})
    return keep


def found_inf_flags(gathered: Gathered, found_inf: Tensor) -> dict[torch.device, Tensor]:
    """The fused kernels' flag from ``found_inf``: per device, a 1-element float64 tensor.

    0 when the step is kept, infinity when it is skipped: the kernels then write nothing
    (``fused/nonfinite``). The skipped step is counted in each group's ``skipped_steps``.
    """
    keep = keep_flags(gathered, found_inf)
    return {
        device: torch.where(
            flag, torch.zeros((), dtype=torch.float64, device=device), float("inf")
        ).reshape(1)
        for device, flag in keep.items()
    }
