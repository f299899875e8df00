"""HMC's all-or-nothing step: what a step may change, saved before it, put back if it raises.

A transition moves the parameters in place, lets a closure rewrite their ``.grad``,
advances the step counters, adapts, records noise keys and replaces the cached start of
the next step. ``HMC.step`` saves what it may change in a :class:`Rollback` first; if the
step raises -- whatever the exception, ``KeyboardInterrupt`` included, and wherever in
the trajectory -- :meth:`Rollback.restore` puts everything back, bit for bit, so that a
retried step draws the same momentum (its counters are the same) from the same state.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor

from ..core.chain import NOISE_KEY
from .start import End, Energy, TransitionStart, versions_of

__all__ = ["Rollback"]


class Rollback:
    """What a step may change, as it was before the step.

    Args:
        param_groups: the optimizer's param groups (their step counters).
        state: the optimizer's per-parameter state.
        hmc: the optimizer-level entry of its state (adaptation and diagnostics); a step
            replaces its entries, never changes them in place.
        start: the start of the next step (see :class:`~.start.TransitionStart`).
        clone_grads: keep the gradients' values too (a closure may zero them in place),
            not only the tensors.
    """

    def __init__(
        self,
        param_groups: list[dict[str, Any]],
        state: Any,
        hmc: dict[str, Any],
        start: TransitionStart,
        *,
        clone_grads: bool,
    ) -> None:
        self._param_groups = param_groups
        self._state = state
        self._hmc = hmc
        self._start = start
        self._params: list[Tensor] = [p for group in param_groups for p in group["params"]]
        #: (parameter, its .grad, a copy of the values or None, the .grad's version)
        self.grads: list[tuple[Tensor, Tensor | None, Tensor | None, int]] = []
        #: (parameter, a copy of its values, its version), added before the step moves it
        self.values: list[tuple[Tensor, Tensor, int]] = []
        self.steps = [group["step"] for group in param_groups]
        for p in self._params:
            grad = p.grad
            if grad is None:
                self.grads.append((p, None, None, 0))
            else:
                saved = grad.clone() if clone_grads else None
                self.grads.append((p, grad, saved, grad._version))
        self.hmc = dict(hmc)
        #: the per-parameter states, where the step adds a draw to the mass estimate
        self.param_state: dict[Tensor, dict[str, Any]] | None = None
        if hmc["adapt_mass"] and hmc["collect_mass"]:
            self.param_state = {p: dict(state[p]) for p in self._params if p in state}
        #: the parameters whose state holds no noise key yet, and whether they have a state
        self.keyless = [(p, p in state) for p in self._params if NOISE_KEY not in state.get(p, ())]
        self.end: End | None = start.end
        #: whether the last step's end is still the parameters' state (reused if of the
        #: step's target)
        self.start_valid = start.valid(self._params)
        self.energy: Energy | None = start.energy
        self.loaded = start.loaded

    def keep_values(self, chain: Sequence[Tensor], copies: Sequence[Tensor] | None = None) -> None:
        """Note the chain's values before the step moves them (``copies`` if made already)."""
        if copies is None:
            self.values = [(p, p.clone(), p._version) for p in chain]
        else:
            self.values = [(p, p0, p._version) for p, p0 in zip(chain, copies, strict=True)]

    def restore(self) -> None:
        """Put back what was saved: the state before a step that failed."""
        for p, value, version in self.values:
            if p._version != version:
                p.copy_(value)
        for p, grad, saved, version in self.grads:
            p.grad = grad
            if grad is not None and saved is not None and grad._version != version:
                grad.copy_(saved)
        state = self._state
        hmc = self._hmc
        hmc.clear()
        hmc.update(self.hmc)
        for p, had_state in self.keyless:  # keys the step recorded
            entry = state.get(p)
            if entry is not None:
                entry.pop(NOISE_KEY, None)
                if not had_state and not entry:
                    del state[p]
        if self.param_state is not None:
            for p, *_ in self.grads:
                if p in self.param_state:
                    state[p] = self.param_state[p]
                elif p in state:
                    del state[p]
        for group, step in zip(self._param_groups, self.steps, strict=True):
            group["step"] = step
        end = self.end
        if end is not None and self.start_valid:  # still the start (the versions moved on)
            end = end._replace(versions=versions_of(self._params, end.ids))
        self._start.end = end
        self._start.energy = self.energy
        self._start.loaded = self.loaded
