"""The step's second backend, the fused one, registered by the package that holds it.

A step runs one of two backends (``docs/design.md``, "The step pipeline"): the reference
one (``step/reference``: torch operations, foreach or chunked), which every optimizer
takes and which this folder holds, or the fused one (``sgmcmc/fused/backend``: one
Triton kernel per tensor), which a GPU model takes by default at T > 0. The fused
backend registers itself here (:func:`register_fused_backend`) when
``samplers_as_optim.sgmcmc`` is imported, which any import of the package does first. So
the Optimizer's step asks this slot, and what a reader of the reference step opens holds
nothing of the fused one: its kernels, their launch, Triton's conventions, as torch's
``sgd()`` names its fused function and leaves the kernel to a compiled library.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from torch import Tensor

__all__ = ["FusedBackend", "check_fused", "fused_backend", "register_fused_backend"]

#: ``(index, group, params, grads)`` per param group (``grads`` None at construction)
Groups = Sequence[tuple[int, dict[str, Any], list[Tensor], list[Tensor] | None]]


class FusedBackend(Protocol):
    """What the Optimizer asks of the fused backend (``sgmcmc/fused/backend``)."""

    def check_construction(self, definition: Any, groups: Groups) -> None:
        """Raise ``ValueError`` where ``fused=True`` cannot run, as far as known before a step."""

    def takes_step(self, opt: Any, gathered: list[Any], *, compiling: bool) -> bool:
        """Whether this step is fused; with ``fused=True``, raise if it cannot be."""

    def step(self, opt: Any, gathered: list[Any], rates: list[Any], scaler: Any) -> None:
        """Every group's step by the sampler's fused kernel, checked on the device."""


_REGISTERED: list[FusedBackend] = []


def register_fused_backend(backend: FusedBackend) -> None:
    """Make ``backend`` the fused one (``sgmcmc/fused/backend`` calls it on import)."""
    _REGISTERED[:] = [backend]


def fused_backend() -> FusedBackend:
    """The registered fused backend."""
    if not _REGISTERED:
        raise RuntimeError(
            "no fused backend is registered: importing samplers_as_optim.sgmcmc registers it"
        )
    return _REGISTERED[0]


def check_fused(value: Any) -> bool | None:
    """The ``fused`` argument: None (fused where it can run), True or False."""
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"Invalid fused: {value!r} (expected None, True or False)")
    return value
