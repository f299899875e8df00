"""What loading an SG-MCMC sampler's state checks, and how it migrates older checkpoints.

A sampler's ``state_dict()`` holds the chain's random state in its param groups and each
parameter's noise key and momentum rate in its state (``docs/design.md``). Loading one
refuses, before anything changes, a state that would silently restart the noise or
reach the parameters as NaN; it migrates what earlier versions wrote (the chain state
beside the groups, a rate kept as a float) and accepts a genuine ``torch.optim.SGD``
checkpoint.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from torch import Tensor

from ...core.chain import NOISE_KEY, check_saved_noise_key
from ..definition.momentum_units import MOMENTUM_RATE
from ..tensor_lists import host_scalar
from .half_precision import MASTER, check_saved_master, is_half, restore_master_state_

__all__ = [
    "MOMENTUM_RATE",
    "check_saved_masters",
    "counters_copied",
    "migrate_momentum_rates",
    "refuse_non_finite_state",
    "restore_momentum_rate",
    "restore_own_dtype_state",
    "saved_groups_with_chain_state",
    "valid_rate",
    "warn_if_keyed_otherwise",
]

#: where checkpoints written before the chain state moved into the param groups kept it
LEGACY_SAMPLER_KEY = "sampler"
#: param-group entries that only a sampler (not torch.optim.SGD) writes
SAMPLER_ONLY_KEYS = ("num_data", "temperature")


def counters_copied(state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` with each group's counter tensors (``step``, ``skipped_steps``) copied.

    A capturable step advances its counter in place, and the skip count is always
    advanced in place: a state dict held in memory keeps the values it was taken at, as
    one holding a Python ``int`` does.
    """
    for group in state_dict.get("param_groups", []):
        for name in ("step", "skipped_steps"):
            if isinstance(group.get(name), Tensor):
                group[name] = group[name].clone()
    return state_dict


def saved_groups_with_chain_state(
    state_dict: dict[str, Any], holds_chain_state: bool
) -> list[dict[str, Any]]:
    """The saved param groups, the chain state of a 0.1.0 checkpoint moved into them.

    ``state_dict`` loses its legacy ``"sampler"`` entry (a copy, given by the caller).
    Raises ``ValueError`` for groups that hold sampler hyperparameters but no chain
    state (a wrapper dropped it: loading would silently restart the noise); a
    ``torch.optim.SGD`` checkpoint has neither and passes.
    """
    saved_groups = [dict(group) for group in state_dict.get("param_groups", [])]
    legacy = state_dict.pop(LEGACY_SAMPLER_KEY, None)
    if legacy is not None:  # written by 0.1.0: {"seed", "steps"} beside the groups
        for group in saved_groups:
            group.update(seed=legacy["seed"], step=legacy["steps"])
    elif not holds_chain_state:
        found = sorted(
            {key for group in saved_groups for key in SAMPLER_ONLY_KEYS}
            & {key for group in saved_groups for key in group}
        )
        if found:
            raise ValueError(
                f"Invalid state_dict: its param groups hold {', '.join(found)} but not "
                "the chain's random state ('seed' and 'step'), so loading it would "
                "silently restart the noise (expected a sampler's state_dict(), or a "
                "torch.optim.SGD checkpoint, which has neither)"
            )
    return saved_groups


def warn_if_keyed_otherwise(
    name: str,
    current_groups: list[dict[str, Any]],
    saved_groups: list[dict[str, Any]],
    saved_state: dict[Any, Any],
) -> None:
    """Warn where parameters without a saved key will be keyed by name, not position."""
    named_now = any("param_names" in group for group in current_groups)
    named_then = any("param_names" in group for group in saved_groups)
    keyless = sum(
        NOISE_KEY not in (saved_state.get(param_id) or {})
        for group in saved_groups
        for param_id in group.get("params", [])
    )
    if named_now and not named_then and keyless and all("seed" in g for g in saved_groups):
        warnings.warn(
            f"{name}.load_state_dict: this optimizer was given parameter "
            "names and the saved one was not, so the noise is now keyed by name, not "
            f"by position, for the {keyless} parameter(s) whose saved state holds no "
            "noise key (a checkpoint written before the samplers stored the keys, or "
            "parameters that have not drawn noise yet: frozen, or only stepped at "
            "temperature 0): they go on with other (equally valid) noise than the saved "
            "run would have drawn. For an exact resume, build the optimizer as the "
            "saved one was built (model.parameters() rather than named_parameters()).",
            stacklevel=3,
        )


def restore_momentum_rate(state: dict[str, Any], saved: dict[str, Any]) -> None:
    """Keep a saved rate on the CPU in its own dtype (a float becomes a tensor; None, none)."""
    value = saved[MOMENTUM_RATE]
    if value is None:
        state.pop(MOMENTUM_RATE, None)
    elif isinstance(value, Tensor):
        state[MOMENTUM_RATE] = value.detach().to(device="cpu", copy=True)
    else:
        state[MOMENTUM_RATE] = host_scalar(float(value))


def migrate_momentum_rates(states: Any) -> None:
    """A rate kept as a float (or None) by an earlier version becomes a tensor (or none)."""
    for state in states:
        if not isinstance(state, dict) or MOMENTUM_RATE not in state:
            continue
        rate = state[MOMENTUM_RATE]
        if rate is None:
            del state[MOMENTUM_RATE]
        elif not isinstance(rate, Tensor):
            state[MOMENTUM_RATE] = host_scalar(float(rate))


def valid_rate(value: Any) -> bool:
    """None, or a finite number > 0 (a float, or a 0-d floating tensor)."""
    if value is None:
        return True
    if isinstance(value, Tensor):
        if value.dim() != 0 or not value.is_floating_point():
            return False
        value = float(value)
    elif not isinstance(value, float):
        return False
    return math.isfinite(value) and value > 0


def refuse_non_finite_state(saved_state: dict[Any, Any]) -> None:
    """Raise if a saved per-parameter buffer holds NaN or infinity (before loading it).

    Also checks the learning rate recorded with a momentum buffer (``"momentum_lr"``):
    None or a finite number > 0, since the next change of lr rescales the buffer by it;
    and the noise key (``"noise_key"``): a 0-d int64 tensor.
    """
    for param_id, entries in saved_state.items():
        for key, value in (entries or {}).items():
            if key == MOMENTUM_RATE and not valid_rate(value):
                raise ValueError(
                    f"Invalid state_dict: 'momentum_lr' of parameter {param_id} is "
                    f"{value!r} (expected None or a finite number > 0: the learning rate "
                    "its momentum buffer was written at)"
                )
            if key == NOISE_KEY:
                check_saved_noise_key(param_id, value)
            if (
                isinstance(value, Tensor)
                and value.is_floating_point()
                and not bool(torch.isfinite(value).all())
            ):
                raise ValueError(
                    f"Invalid state_dict: {key!r} of parameter {param_id} holds NaN or "
                    "infinity (expected finite buffers: they would reach the parameters at "
                    "the next step)"
                )


def restore_own_dtype_state(opt: Any, state_dict: dict[str, Any]) -> None:
    """Undo torch's cast of some saved entries to the parameter's dtype and device.

    ``own_dtype_state`` (a thermostat) keeps its dtype on the parameter's device,
    ``host_state`` (AdamW's step count) its dtype on the CPU, a half-precision
    parameter's master and buffers float32 (``step/half_precision``); the
    noise key (``ChainOptimizer._restore_noise_keys``) and the rate of a momentum
    buffer (``step/checkpoint.restore_momentum_rate``) keep theirs on the CPU.
    """
    opt._restore_noise_keys(state_dict)
    saved_state = state_dict.get("state", {})
    for group, saved_group in zip(opt.param_groups, state_dict["param_groups"], strict=True):
        for param, param_id in zip(group["params"], saved_group["params"], strict=True):
            saved = saved_state.get(param_id) or {}
            for key in opt.own_dtype_state:
                value = saved.get(key)
                if isinstance(value, Tensor):
                    opt.state[param][key] = value.to(device=param.device, copy=True)
            for key in opt.host_state:
                value = saved.get(key)
                if isinstance(value, Tensor):
                    opt.state[param][key] = value.detach().to(device="cpu", copy=True)
            if MOMENTUM_RATE in saved:  # (indexing opt.state creates an entry)
                restore_momentum_rate(opt.state[param], saved)
            if MASTER in saved:  # a half parameter's float32 master and buffers
                restore_master_state_(
                    param, opt.state[param], saved, (*opt.host_state, MOMENTUM_RATE)
                )


def check_saved_masters(
    opt: Any, saved_groups: list[dict[str, Any]], saved_state: dict[Any, Any]
) -> None:
    """Refuse a saved ``master_param`` that does not fit its parameter (before loading)."""
    for group, saved_group in zip(opt.param_groups, saved_groups, strict=False):
        for param, param_id in zip(group["params"], saved_group.get("params", []), strict=False):
            saved = saved_state.get(param_id) or {}
            if MASTER in saved and is_half(param):
                check_saved_master(param_id, param, saved[MASTER])
