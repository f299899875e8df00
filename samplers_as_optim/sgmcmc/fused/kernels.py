"""Each sampler's fused kernel, by its definition: the registry of the fused backend.

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

from ..adamw_sghmc import DEFINITION as ADAMW_SGHMC
from ..baoa import DEFINITION as BAOA
from ..definition import SamplerDefinition
from ..psgld import DEFINITION as PSGLD
from ..sghmc import DEFINITION as SGHMC
from ..sgld import DEFINITION as SGLD
from ..sgnht import DEFINITION as SGNHT
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


#: each sampler's definition and the loader of its kernel module, by the sampler's name
KERNELS: dict[str, tuple[SamplerDefinition, Callable[[], Any]]] = {
    "SGLD": (SGLD, _sgld),
    "SGHMC": (SGHMC, _sghmc),
    "SGNHT": (SGNHT, _sgnht),
    "PSGLD": (PSGLD, _psgld),
    "BAOA": (BAOA, _baoa),
    "AdamWSGHMC": (ADAMW_SGHMC, _adamw_sghmc),
}


def has_fused_kernel(definition: SamplerDefinition) -> bool:
    """Whether ``definition`` is one of those with a fused kernel (itself, not its name)."""
    entry = KERNELS.get(definition.name)
    return entry is not None and entry[0] is definition


def fused_kernel(definition: SamplerDefinition) -> FusedKernel:
    """The module of ``definition``'s fused kernel (its loader imports it now, and Triton)."""
    if not has_fused_kernel(definition):
        raise ValueError(f"{definition.name} has no fused kernel")
    return cast("FusedKernel", KERNELS[definition.name][1]())
