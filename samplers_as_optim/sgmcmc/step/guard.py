"""The pipeline's guard: what a step does with a non-finite gradient or a GradScaler's verdict.

One stage for both backends, decided before anything changes (``docs/design.md``,
"Refusals"):

* ``nonfinite="raise"`` (the default): the reference backend refuses a non-finite
  gradient here, naming the parameter, after one host read (``step/nonfinite``); the fused
  backend checks on the device (its verdict: ``fused/backend.FusedVerdict``) and the
  refusal is raised by the next ``step()`` or ``state_dict()``
  (:func:`raise_deferred_refusal`; ``fused/nonfinite.DeferredRefusal``), which puts back
  what the step recorded on the host;
* ``nonfinite="skip"``: the step is a no-op selected on the device, counted in
  ``group["skipped_steps"]``, without a synchronisation;
* under ``torch.amp.GradScaler`` its ``found_inf`` decides instead, whatever the policy
  (``step/grad_scaler``).

A skipped step puts back what it advanced on the host (``step/skipped_host``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .grad_scaler import ScalerInput, keep_flags
from .nonfinite import finite_flags, refuse_non_finite_gradients
from .skipped_host import host_record, settle_skipped

__all__ = ["raise_deferred_refusal", "skip_record", "verdict"]


def verdict(
    opt: Any, gathered: list[Any], scaler: ScalerInput, kinds: list[list[int]] | None = None
) -> tuple[dict[torch.device, Tensor] | None, Callable[[], None] | None]:
    """The reference backend's verdict, and the host record a skip puts back.

    Per device, a boolean, False where the step is skipped (a ``GradScaler``'s
    ``found_inf``, or ``nonfinite="skip"``), or None: ``nonfinite="raise"`` refused a
    non-finite gradient here already, before anything changed. ``kinds``: the
    gradients' buckets by device and dtype, where the plan knows them.
    """
    keep = None
    if scaler.found_inf is not None:  # the scaler's verdict, on the device
        keep = keep_flags(gathered, scaler.found_inf)
    elif opt._nonfinite == "raise":
        refuse_non_finite_gradients(type(opt).__name__, gathered, kinds)
    else:  # (traced or captured: the check of four operations per tensor, as tested there)
        one_pass = not (opt._capturable or torch.compiler.is_compiling())
        keep = finite_flags(gathered, kinds, one_pass=one_pass)
    return keep, None if keep is None else skip_record(opt, gathered)


def skip_record(opt: Any, gathered: list[Any]) -> Callable[[], None] | None:
    """What a skipped step puts back on the host (``step/skipped_host``); None if nothing."""
    if not opt.host_state:
        return None
    return host_record(opt.state, opt.param_groups, gathered, opt.host_state, counters=False)


def raise_deferred_refusal(opt: Any) -> None:
    """Raise the refusal of the last fused step (``nonfinite="raise"``), if refused.

    Reads the verdict the step copied to the host (waiting, at most, for that copy,
    queued at the end of the step), puts back what the step recorded on the host and
    raises; the kernels changed no parameter or buffer. First, a skipped step's host
    record waiting for its verdict is put back if skipped (``step/skipped_host``).
    """
    runtime = opt._runtime
    settle_skipped(runtime)
    refusal = runtime.pop("refusal", None)
    if refusal is None:
        return
    found = refusal.culprit()
    if found is None:
        return
    culprit, step = found
    refusal.rollback()
    raise FloatingPointError(
        f"{type(opt).__name__} refused step {step}: non-finite gradient in {culprit}; "
        "no parameter or buffer was changed (the fused step checks the gradients on "
        "the device, without a host synchronisation: this call, the next after that "
        "step, raises it and changes nothing either)"
    )
