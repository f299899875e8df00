"""Where HMC's next transition starts: the loss and gradients the last one ended with.

A transition needs the loss and its gradient at the current parameters. The last step
computed them at its end, which is where the next one starts, so :class:`TransitionStart`
keeps them (with the parameters' versions, which say whether anything moved the
parameters since) and the potential energy and its gradient made from them; a step reuses
them instead of evaluating the loss again. With ``compile=True`` ``HMC.state_dict`` also
carries that start (:meth:`TransitionStart.portable`, with a digest of the parameters), so
that a resumed compiled chain starts from the very bits the uninterrupted one would have
(a compiled graph's fused arithmetic may differ from eager in the last place); a loaded
start is used only at parameters with the same digest.
"""

from __future__ import annotations

import hashlib
import reprlib
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

__all__ = ["START_KEY", "Start", "TransitionStart", "check_start", "fingerprint"]

#: the entry of a saved ``"hmc"`` state holding the start of the next step
START_KEY = "start"

#: (parameter ids, their versions, loss, raw gradients) at the end of the last step
End = tuple[list[int], list[int], Tensor, list[Tensor]]
#: (U, grad U) at the cached start, with the (N, weight decays) they were made with
Energy = tuple[tuple[Any, ...], Tensor, list[Tensor]]


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
        #: the chain, its versions, the loss and raw gradients at the end of the last step
        self.end: End | None = None
        #: (U, grad U) at that end, with the (N, weight decays) they were made with
        self.energy: Energy | None = None
        #: the start carried by a loaded state (see :meth:`portable`), until the next step
        self.loaded: dict[str, Any] | None = None

    def valid(self, params: Sequence[Tensor]) -> bool:
        """Whether the last step's end is still the parameters' state (nothing moved them)."""
        end = self.end
        return end is not None and versions_of(params, end[0]) == end[1]

    def remember(
        self, params: Sequence[Tensor], chain: list[Tensor], loss: Tensor, raw: list[Tensor]
    ) -> None:
        """Keep the end of a step: the chain's loss and raw gradients at its new values."""
        ids = [id(p) for p in chain]
        self.end = (ids, versions_of(params, ids), loss, raw)

    def take(self, params: Sequence[Tensor], *, valid: bool, functional: bool) -> Start | None:
        """The start a step reuses (the last step's end, else a loaded one), or None.

        ``valid``: :meth:`valid`, as it was before the step. ``functional``: for
        ``loss_fn``, whose chain is the parameters that require grad (see
        :meth:`loaded_here`). Either way the cached energy and the loaded start are used
        up: the step leaves a new end, or (if it raises) puts these back.
        """
        end, energy = self.end, self.energy
        self.energy = None
        loaded = None if valid else self.loaded_here(params, functional)
        self.loaded = None
        if end is not None and valid:
            chain = list(params_by_id(params, end[0]))
            loss, raw = end[2], end[3]
            return Start(chain, loss, raw, None if loss.dim() == 0 else int(loss.shape[0]), energy)
        if loaded is not None:
            chain, loss, raw = loaded
            return Start(chain, loss, raw, None if loss.dim() == 0 else int(loss.shape[0]), None)
        return None

    def portable(self, params: Sequence[Tensor]) -> dict[str, Any] | None:
        """The start of the next step, by parameter position, for a saved state.

        None without a valid end (unless a loaded start was not used yet: that one, checked
        when it is used) or where torch has no numpy.
        """
        end = self.end
        if end is None or versions_of(params, end[0]) != end[1]:
            return self.loaded  # loaded and not used yet (checked when it is)
        position = {id(p): i for i, p in enumerate(params)}
        chain = params_by_id(params, end[0])
        digest = fingerprint(chain)
        if digest is None:
            return None
        return {
            "params": [position[id(p)] for p in chain],
            "loss": end[2],
            "gradients": list(end[3]),
            "fingerprint": digest,
        }

    def loaded_here(
        self, params: Sequence[Tensor], functional: bool
    ) -> tuple[list[Tensor], Tensor, list[Tensor]] | None:
        """The loaded start (chain, loss, raw gradients) if made at the current parameters.

        ``functional``: for ``loss_fn``, whose chain is the parameters that require grad
        (a closure's is those its ``backward()`` reaches, as when the start was saved).
        """
        start = self.loaded
        if start is None:
            return None
        if not all(0 <= i < len(params) for i in start["params"]):
            return None
        chain = [params[i] for i in start["params"]]
        if functional:
            sampled = [p for p in params if p.requires_grad]
            if len(sampled) != len(chain) or any(
                a is not b for a, b in zip(sampled, chain, strict=True)
            ):
                return None
        shapes = all(g.shape == p.shape for g, p in zip(start["gradients"], chain, strict=True))
        if not shapes or fingerprint(chain) != start["fingerprint"]:
            return None
        loss = start["loss"].to(chain[0].device)
        grads = [g.to(p.device) for g, p in zip(start["gradients"], chain, strict=True)]
        return chain, loss, grads
