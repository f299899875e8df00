"""Each sampler's fused kernel, by its definition's name: the registry of the fused backend.

A sampler's Triton kernel lives beside its definition (``sgmcmc/sghmc/triton_kernel`` for
SGHMC: its update's arithmetic next to the reference update) and is named here, one line
in :data:`KERNELS`, so that the sampler's module and the Optimizer's reference step
import nothing of the fused backend. A kernel module imports Triton, so each one is
imported on first use, by its loader below, never when the package is imported. Adding
a sampler's kernel: its ``triton_kernel`` module (``launch`` and ``unsupported``,
``fused/launch.FusedKernel``), a loader and a line here, and its tests.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

from .launch import FusedKernel

__all__ = ["KERNELS", "fused_kernel", "has_fused_kernel"]


def _sgld() -> Any:
    from ..sgld import triton_kernel

    return triton_kernel


def _sghmc() -> Any:
    from ..sghmc import triton_kernel

    return triton_kernel


def _sgnht() -> Any:
    from ..sgnht import triton_kernel

    return triton_kernel


def _psgld() -> Any:
    from ..psgld import triton_kernel

    return triton_kernel


def _baoa() -> Any:
    from ..baoa import triton_kernel

    return triton_kernel


def _adamw_sghmc() -> Any:
    from ..adamw_sghmc import triton_kernel

    return triton_kernel


#: the loader of each sampler's kernel module, by ``SamplerDefinition.name``
KERNELS: dict[str, Callable[[], Any]] = {
    "SGLD": _sgld,
    "SGHMC": _sghmc,
    "SGNHT": _sgnht,
    "PSGLD": _psgld,
    "BAOA": _baoa,
    "AdamWSGHMC": _adamw_sghmc,
}


def has_fused_kernel(definition: Any) -> bool:
    """Whether the sampler ``definition`` declares has a fused kernel."""
    return definition.name in KERNELS


def fused_kernel(definition: Any) -> FusedKernel:
    """The module of ``definition``'s fused kernel (its loader imports it now, and Triton)."""
    loader = KERNELS.get(definition.name)
    if loader is None:
        raise ValueError(f"{definition.name} has no fused kernel")
    return cast("FusedKernel", loader())
