"""Where HMC's next transition starts: the loss and gradients the last one ended with.

A transition needs the loss and its gradient at the current parameters. The last step
computed them at its end, which is where the next one starts, so :class:`TransitionStart`
keeps them (with the parameters' versions, which say whether anything moved the
parameters since, and the target they are of: the loss function or closure, see
:class:`Target`) and the potential energy and its gradient made from them. The next step
reuses them instead of evaluating the loss again when it is given the same target object
and nothing wrote into the parameters since; otherwise (another loss function or closure,
parameters changed from outside) it evaluates its own target's start.

With ``compile=True`` ``HMC.state_dict`` also carries that start
(:meth:`TransitionStart.portable`, with a digest of the parameters), so that a resumed
compiled chain starts from the very bits the uninterrupted one would have (a compiled
graph's fused arithmetic may differ from eager in the last place). Which target it was of
cannot be saved, so the first step after loading evaluates its own target's start anyway,
and takes the carried bits instead only at parameters with the same digest, where that
evaluation agrees with them up to rounding (:func:`agrees`): the same target.
"""

from __future__ import annotations

import hashlib
import reprlib
import types
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

__all__ = [
    "START_KEY",
    "End",
    "Start",
    "Target",
    "TransitionStart",
    "agrees",
    "check_start",
    "fingerprint",
]

#: the entry of a saved ``"hmc"`` state holding the start of the next step
START_KEY = "start"
#: a carried start agrees with a fresh evaluation when every element is within this many
#: units in the last place of the tensor's largest magnitude (at most a relative 1e-3)
_ROUNDING_ULPS = 1024

#: (U, grad U) at the cached start, with the (N, weight decays) they were made with
Energy = tuple[tuple[Any, ...], Tensor, list[Tensor]]


class Target:
    """The loss function or closure a start was computed with, known by identity.

    Held by weak reference where the object allows one (so that neither its memory nor
    its address is kept: a later function at a recycled address is not taken for it),
    else by strong reference. A bound method (``model.loss``, a new object at each
    access) is known by its object and function: the same method of the same object is
    the same target.
    """

    def __init__(self, target: Callable[..., Any]) -> None:
        self._parts = tuple(_reference(part) for part in _parts(target))

    def is_(self, target: Callable[..., Any]) -> bool:
        """Whether ``target`` is the object (or bound method) this was made from."""
        parts = _parts(target)
        return len(parts) == len(self._parts) and all(
            (held() if weak else held) is part
            for (weak, held), part in zip(self._parts, parts, strict=True)
        )


def _parts(target: Callable[..., Any]) -> tuple[Any, ...]:
    """What identifies a target: a bound method's object and function, else itself."""
    if isinstance(target, types.MethodType):
        return (target.__self__, target.__func__)
    return (target,)


def _reference(part: Any) -> tuple[bool, Any]:
    """(True, a weak reference) where ``part`` takes one, else (False, ``part``)."""
    try:
        return True, weakref.ref(part)
    except TypeError:
        return False, part


class End(NamedTuple):
    """The end of the last step: where the next one starts if nothing changed since."""

    ids: list[int]  #: the chain's parameters, by ``id``
    versions: list[int]  #: their versions and storages then (see ``versions_of``)
    loss: Tensor  #: the mean loss there
    gradients: list[Tensor]  #: its raw gradients
    target: Target  #: the loss function or closure they are of


class Start(NamedTuple):
    """Where a transition starts: the chain, the mean loss and its raw gradients there."""

    chain: list[Tensor]  #: the parameters the transition moves
    loss: Tensor  #: the mean loss (per member for an ensemble)
    gradients: list[Tensor]  #: its gradient, per parameter of ``chain``
    members: int | None  #: K for an ensemble, else None
    energy: Energy | None  #: U and grad U there, when the last step left them


def fingerprint(tensors: Sequence[Tensor]) -> str | None:
    """A digest of the tensors' shapes, dtypes and bytes (None where torch has no numpy).

    Says whether a start carried in a state dict (``HMC.state_dict``) was computed at the
    parameters it is loaded into: equal digests, equal bits.
    """
    digest = hashlib.blake2b(digest_size=16)
    for tensor in tensors:
        flat = tensor.detach().reshape(-1).contiguous().cpu()
        digest.update(f"{tuple(tensor.shape)} {tensor.dtype};".encode())
        try:
            digest.update(flat.view(torch.uint8).numpy().tobytes())
        except (RuntimeError, TypeError):  # torch built or installed without numpy
            return None
    return digest.hexdigest()


def check_start(start: Any) -> None:
    """Raise unless ``start`` is None or the start of a step as ``HMC.state_dict`` saves it."""
    if start is None:
        return
    valid = (
        isinstance(start, dict)
        and isinstance(start.get("params"), list)
        and len(start["params"]) > 0
        and all(type(i) is int for i in start["params"])
        and isinstance(start.get("loss"), Tensor)
        and isinstance(start.get("gradients"), list)
        and len(start["gradients"]) == len(start["params"])
        and all(isinstance(g, Tensor) for g in start["gradients"])
        and isinstance(start.get("fingerprint"), str)
    )
    if not valid:
        raise ValueError(
            f"Invalid state_dict: its 'hmc' entry's {START_KEY!r} is {reprlib.repr(start)} "
            "(expected None or what HMC.state_dict() saves there: a dict of 'params', "
            "'loss', 'gradients' and 'fingerprint')"
        )


def agrees(carried: Tensor, fresh: Tensor) -> bool:
    """Whether ``carried`` is ``fresh`` up to rounding (the same evaluation, compiled or not).

    Same shape and dtype, and every element within :data:`_ROUNDING_ULPS` units in the
    last place (at most a relative 1e-3) of ``fresh``'s largest finite magnitude; the
    non-finite elements equal. Reads the tensors on the host (once per resume).
    """
    if carried.shape != fresh.shape or carried.dtype != fresh.dtype:
        return False
    if not carried.is_floating_point():
        return torch.equal(carried, fresh)
    finite = torch.isfinite(fresh)
    if not torch.equal(finite, torch.isfinite(carried)):
        return False
    tolerance = min(_ROUNDING_ULPS * torch.finfo(fresh.dtype).eps, 1e-3)
    scale = torch.where(finite, fresh, 0).abs().amax() if fresh.numel() else 0.0
    close = torch.isclose(carried, fresh, rtol=0.0, atol=float(tolerance * scale), equal_nan=True)
    return bool(close.all())


def params_by_id(params: Sequence[Tensor], ids: list[int]) -> list[Tensor]:
    """The parameters of ``params`` with these ``id``s, in that order."""
    by_id = {id(p): p for p in params}
    return [by_id[i] for i in ids]


def versions_of(params: Sequence[Tensor], ids: list[int]) -> list[int]:
    """The versions (and storages) of the parameters with these ids; [] if one is gone."""
    by_id = {id(p): p for p in params}
    if not all(i in by_id for i in ids):
        return []
    return [hash((by_id[i]._version, by_id[i].data_ptr())) for i in ids]


class TransitionStart:
    """The start of the next transition, as the last step (or a loaded state) left it.

    Runtime, not the chain's state: ``HMC`` rebuilds it empty after loading or
    unpickling (where a carried start is put in ``loaded``). Every method takes the
    optimizer's parameters, in its order.
    """

    def __init__(self) -> None:
        #: the end of the last step: the chain, its versions, loss, raw gradients, target
        self.end: End | None = None
        #: (U, grad U) at that end, with the (N, weight decays) they were made with
        self.energy: Energy | None = None
        #: the start carried by a loaded state (see :meth:`portable`), until the next step
        self.loaded: dict[str, Any] | None = None

    def valid(self, params: Sequence[Tensor]) -> bool:
        """Whether the last step's end is still the parameters' state (nothing moved them)."""
        end = self.end
        return end is not None and versions_of(params, end.ids) == end.versions

    def remember(
        self,
        params: Sequence[Tensor],
        chain: list[Tensor],
        loss: Tensor,
        raw: list[Tensor],
        target: Callable[..., Any],
    ) -> None:
        """Keep the end of a step: the chain's loss and raw gradients of ``target`` there."""
        ids = [id(p) for p in chain]
        self.end = End(ids, versions_of(params, ids), loss, raw, Target(target))

    def take(
        self,
        params: Sequence[Tensor],
        target: Callable[..., Any],
        *,
        valid: bool,
        evaluate: Callable[[], Start],
    ) -> Start:
        """The start of a step with ``target`` (a loss function or closure).

        The last step's end (and its energy) where it is of the same target object and
        ``valid`` (:meth:`valid`, as it was before the step); else ``evaluate()``, the
        target's own start at the current parameters -- or, for the first step after a
        loaded state, the carried start where it was made at these parameters and
        ``evaluate()`` agrees with it up to rounding (:func:`agrees`). Either way the cached
        energy and the loaded start are used up: the step leaves a new end, or (if it
        raises) puts these back.
        """
        end, energy, loaded = self.end, self.energy, self.loaded
        self.energy = self.loaded = None
        if end is not None and valid and end.target.is_(target):
            chain = params_by_id(params, end.ids)
            return Start(chain, end.loss, end.gradients, _members(end.loss), energy)
        fresh = evaluate()
        carried = None if valid or loaded is None else self.loaded_here(params, loaded)
        if carried is None:
            return fresh
        chain, loss, raw = carried
        same = len(chain) == len(fresh.chain) and all(
            a is b for a, b in zip(chain, fresh.chain, strict=False)
        )
        if not same or not all(map(agrees, [loss, *raw], [fresh.loss, *fresh.gradients])):
            return fresh
        return Start(chain, loss, raw, fresh.members, None)

    def portable(self, params: Sequence[Tensor]) -> dict[str, Any] | None:
        """The start of the next step, by parameter position, for a saved state.

        None without a valid end (unless a loaded start was not used yet: that one, checked
        when it is used) or where torch has no numpy.
        """
        end = self.end
        if end is None or versions_of(params, end.ids) != end.versions:
            return self.loaded  # loaded and not used yet (checked when it is)
        position = {id(p): i for i, p in enumerate(params)}
        chain = params_by_id(params, end.ids)
        digest = fingerprint(chain)
        if digest is None:
            return None
        return {
            "params": [position[id(p)] for p in chain],
            "loss": end.loss,
            "gradients": list(end.gradients),
            "fingerprint": digest,
        }

    @staticmethod
    def loaded_here(
        params: Sequence[Tensor], start: dict[str, Any]
    ) -> tuple[list[Tensor], Tensor, list[Tensor]] | None:
        """A loaded start's (chain, loss, raw gradients) if made at the current parameters."""
        if not all(0 <= i < len(params) for i in start["params"]):
            return None
        chain = [params[i] for i in start["params"]]
        shapes = all(g.shape == p.shape for g, p in zip(start["gradients"], chain, strict=True))
        if not shapes or fingerprint(chain) != start["fingerprint"]:
            return None
        loss = start["loss"].to(chain[0].device)
        grads = [g.to(p.device) for g, p in zip(start["gradients"], chain, strict=True)]
        return chain, loss, grads


def _members(loss: Tensor) -> int | None:
    """K for a loss per ensemble member (shape ``[K]``), else None."""
    return None if loss.dim() == 0 else int(loss.shape[0])
