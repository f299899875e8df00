"""IVON's refusals: its arguments, a step's non-finite averages, and what ranks average.

One place for the checks of ``ivon``'s optimizer (``docs/design.md``, "Refusals"): the
hyperparameters of a param group (at construction, for a group added later, and before
each draw and step, where a schedule may have moved them), the messages of a step that
cannot be taken, and the averaging of a step's statistics over the ranks (``sync``).
"""

from __future__ import annotations

import numbers
from typing import Any

import torch
from torch import Tensor

from ...core.validation import (
    check_bool,
    check_choice,
    check_finite,
    check_learning_rate,
    check_nonnegative,
    check_positive,
    check_temperature,
    refuse,
)
from ...sgmcmc.tensor_lists import gradients_may_be_non_finite
from ._kernel import HESS_APPROX, STATISTIC

__all__ = [
    "CHANGED_PARAMETERS",
    "COUNTERS",
    "HYPERPARAMETERS",
    "average_over_ranks",
    "check_group",
    "refuse_non_finite",
]

#: one param group's part of a step: its index, the group, its parameters, their states
Work = list[tuple[int, dict[str, Any], list[Tensor], list[dict[str, Any]]]]

#: the param-group entries a param group's hyperparameters are checked from
HYPERPARAMETERS: tuple[str, ...] = ("lr", "ess", "hess_init", "beta1", "beta2", "weight_decay")
HYPERPARAMETERS += ("hess_approx", "clip_radius", "debias", "rescale_lr", "temperature")
#: why a step, or a training draw, finds other parameters than the step's first draw
CHANGED_PARAMETERS = (
    "IVON: the parameters drawn changed within one step (requires_grad was switched, or "
    "hess_approx changed, between sampled_params(train=True) rounds or before step()); "
    "change them only right after step()"
)
#: the param-group entries counting the current step's draws (training, other)
COUNTERS = ("train_draws", "eval_draws")
_PRICE_AT_ZERO = (
    "hess_approx='price' divides by the perturbation's variance T / (ess (h + "
    "weight_decay)), which is 0 at T = 0; use hess_approx='gradsq' for T = 0"
)


def _check_unit(name: str, value: Any, *, closed: bool, reason: str, where: str) -> float:
    number = check_finite(name, value, where=where)
    if not (number >= 0.0 and (number <= 1.0 if closed else number < 1.0)):
        refuse(
            name, value, ("a number in [0, 1]" if closed else "a number in [0, 1)") + reason, where
        )
    return number


def check_group(group: dict[str, Any], *, where: str = "") -> None:
    """Validate one param group's hyperparameters (``where`` locates the group).

    Raises:
        ValueError, TypeError: naming the argument, its value and what is allowed.
    """
    check_learning_rate(group["lr"], where=where)
    check_positive("ess", group["ess"], where=where)
    check_positive("hess_init", group["hess_init"], where=where)
    reason = ": the bias correction divides by 1 - beta1**t"
    _check_unit("beta1", group["beta1"], closed=False, where=where, reason=reason)
    _check_unit("beta2", group["beta2"], closed=True, where=where, reason="")
    check_nonnegative("weight_decay", group["weight_decay"], where=where)
    method = check_choice("hess_approx", group["hess_approx"], HESS_APPROX, where=where)
    radius = group["clip_radius"]
    if isinstance(radius, bool) or not isinstance(radius, numbers.Real) or not float(radius) > 0:
        refuse("clip_radius", radius, "a number > 0, or inf", where)
    check_bool("debias", group["debias"], where=where)
    check_bool("rescale_lr", group["rescale_lr"], where=where)
    check_temperature(
        group["temperature"], where=where, positive=method == "price", reason=_PRICE_AT_ZERO
    )


def refuse_non_finite(work: Work) -> None:
    """Raise before anything changes if an averaged gradient or statistic is not finite.

    Fast path: GradScaler's check of them in one pass, read once
    (``tensor_lists.gradients_may_be_non_finite``: exact, each element written back as it
    was); only on suspicion is each tensor checked, to name it.

    Raises:
        FloatingPointError: naming the step, the param group and the parameter.
    """
    tensors = [
        s[key]
        for _, g, _, states in work
        for s in states
        for key in ("avg_grad", STATISTIC[g["hess_approx"]])
    ]
    if not gradients_may_be_non_finite(tensors):
        return
    for index, group, params, states in work:
        keys = ("avg_grad", STATISTIC[group["hess_approx"]])
        for param, state in zip(params, states, strict=True):
            if all(bool(torch.isfinite(state[key]).all()) for key in keys):
                continue
            position = next(i for i, p in enumerate(group["params"]) if p is param)
            raise FloatingPointError(
                f"IVON refused step {group['step'] + 1}: non-finite gradient in param "
                f"group {index}, parameter {position} of shape {tuple(param.shape)}; the "
                "parameters and the posterior were not changed, and this step's training "
                "draws were discarded (draw again)"
            )


def average_over_ranks(work: Work) -> None:
    """Under an initialised process group of 2 or more ranks, average the statistics.

    Each rank drew the same perturbation (one seed), so the averages of ĝ and of the
    statistic over the ranks are those of the ranks' data together.
    """
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return
    size = dist.get_world_size()
    for _, group, _, states in work:
        for state in states:
            for key in ("avg_grad", STATISTIC[group["hess_approx"]]):
                dist.all_reduce(state[key])
                state[key].div_(size)
