r"""The warm-up's restart: a chain whose lr is unstable is started again, at a tenth of it.

A Robbins-Monro step on log lr (``temperature/warmup``) corrects an lr that heats the
chain by a few percent, one window at a time. An lr past the stability limit of the
stiffest direction is another matter: there the chain is not hot but diverging, and it
is thrown far from where it started within a few steps (seen on the regression
benchmark at ten times the guide's lr: the gradient's squared norm grew 27-, 46- and
44-fold on three consecutive steps, then the noise scale jumped from e^-1.6 to e^20),
long before a window ends. Once thrown, no lr brings the chain back in the warm-up's
time.

What is watched. Before each step, the squared norm :math:`s_t` of the gradients of the
param groups at T > 0 (one host read per step, during the warm-up only). A linear
instability makes :math:`s_t` grow geometrically, by the square of the unstable mode's
factor, every step; a chain that thermalises from a mode grows it polynomially (about
:math:`t^3` from rest: consecutive ratios 8, 3.4, 2.4, ...), one that descends from its
initialisation shrinks it, and a stable oscillation's zero crossings are followed by its
earlier peaks. So the chain is declared diverging when :math:`s_t` has grown at least
``4``-fold on each of the last ``3`` steps *and* is ``1000`` times the largest value it
had before that run of growth began (or is not finite).

What is done. The state saved when the warm-up started (the parameters, the optimizer's
state, the monitor's) is put back, every group's lr at T > 0 is divided by 10, the
adaptation starts again (its windows and gains), and the gradients of that step are
zeroed so that the step runs from the restored state without them (a step of noise
alone). The chain's step counter runs on (the noise is not replayed), and so does the
warm-up's count: it ends when it would have. What the optimizer does not hold is not
put back: a module's buffers (BatchNorm's running statistics) follow the restarted
chain. After ``max_restarts`` restarts the warm-up intervenes no more (a gradient that is
not finite at any lr is the model's).
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from torch import Tensor

from ...core.dtensor import is_dtensor
from ..step.grad_scaler import scaler_input

__all__ = ["GROWTH", "JUMP", "RUN", "DivergenceWatch", "Snapshot", "sampling_gradient_norm"]

#: the per-step growth of the squared gradient norm that counts as a step of divergence
GROWTH = 4.0
#: the consecutive such steps
RUN = 3
#: and the factor by which the norm must exceed its largest value before the run
JUMP = 1000.0


def sampling_gradient_norm(optimizer: Any) -> float | None:
    """The squared norm of the gradients of the param groups at T > 0 (a host read).

    Under a ``GradScaler`` the gradients are read unscaled, and a step whose
    ``found_inf`` is set (which the step skips) gives None: nothing to observe.
    """
    scaler = scaler_input(optimizer)
    if scaler.found_inf is not None and float(scaler.found_inf.sum()) > 0:
        return None
    scale = 1.0 if scaler.grad_scale is None else float(scaler.grad_scale.sum())
    parts: list[Tensor] = []
    for group in optimizer.param_groups:
        if float(group["temperature"]) == 0:
            continue
        for param in group["params"]:
            grad = param.grad
            if grad is None:
                continue
            square = grad.detach().double().pow(2).sum()
            parts.append(square.full_tensor() if is_dtensor(square) else square)
    if not parts:
        return 0.0
    devices = {part.device for part in parts}
    device = parts[0].device if len(devices) == 1 else torch.device("cpu")
    return float(torch.stack([part.to(device) for part in parts]).sum()) / scale**2


class DivergenceWatch:
    """The squared gradient norms since the (re)start, and whether they say "diverging"."""

    def __init__(self) -> None:
        self.before = 0.0  # the largest value before the current run of growth
        self.last: float | None = None
        self.run = 0  # consecutive steps of growth by GROWTH

    def observe(self, value: float) -> bool:
        """Add one step's squared norm; True if the chain is diverging (module docstring)."""
        if not math.isfinite(value):
            return True
        last, self.last = self.last, value
        if last is not None and last > 0 and value >= GROWTH * last:
            if self.run == 0:  # the run's base is the last value before it
                self.before = max(self.before, last)
            self.run += 1
        else:
            if last is not None:
                self.before = max(self.before, last)
            self.run = 0
        return self.run >= RUN and value >= JUMP * self.before

    def state(self) -> tuple[float, float | None, int]:
        """What resumes it: the largest value before the run, the last value, the run."""
        return self.before, self.last, self.run

    @classmethod
    def from_state(cls, state: Any) -> DivergenceWatch:
        """The watch :meth:`state` describes."""
        watch = cls()
        before, last, run = state
        watch.before = float(before)
        watch.last = None if last is None else float(last)
        watch.run = int(run)
        return watch


class Snapshot:
    """The parameters and the optimizer's state at the warm-up's start, to restart from.

    Copies (the parameters, every tensor of ``optimizer.state_dict()``): as much memory
    again as the parameters and the sampler's buffers, for the warm-up's length.
    """

    def __init__(self, params: list[Tensor], optimizer_state: dict[str, Any]) -> None:
        self.params = params
        self.optimizer_state = optimizer_state

    @classmethod
    def take(cls, optimizer: Any) -> Snapshot:
        """Copies of ``optimizer``'s parameters and state, now."""
        params = [p.detach().clone() for group in optimizer.param_groups for p in group["params"]]
        return cls(params, copy.deepcopy(optimizer.state_dict()))

    @torch.no_grad()
    def restore(self, optimizer: Any) -> None:
        """Put the parameters and the state back; the groups keep their step counters."""
        steps = [group["step"] for group in optimizer.param_groups]
        optimizer.load_state_dict(copy.deepcopy(self.optimizer_state))
        for group, step in zip(optimizer.param_groups, steps, strict=True):
            group["step"] = step
        params = [p for group in optimizer.param_groups for p in group["params"]]
        for param, saved in zip(params, self.params, strict=True):
            param.copy_(saved)

    def state(self) -> dict[str, Any]:
        """Copies of what it holds (plain values and tensors), for a checkpoint."""
        return {"params": list(self.params), "optimizer": self.optimizer_state}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Snapshot:
        """The snapshot :meth:`state` describes (copied: the checkpoint stays as it is)."""
        return cls([p.clone() for p in state["params"]], copy.deepcopy(state["optimizer"]))
