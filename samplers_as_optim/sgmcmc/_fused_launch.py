"""What every fused kernel module shares: Triton's language, float64 scalars, the launch.

Importing this module does not import Triton (``sgmcmc/fused`` imports it with the
package); a kernel module imports Triton's language with :func:`optional_module` (None
where Triton is missing, so that the module still imports, for pytest's doctest
collection) and writes its kernels as plain functions that :func:`launch_elementwise`
jits on first launch, when ``TRITON_INTERPRET`` is read. A kernel's compile-time
arguments are annotated :data:`constexpr`: Triton reads the annotation's text.
"""

from __future__ import annotations

import importlib
import struct
from collections.abc import Callable, Mapping
from functools import cache
from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor

__all__ = [
    "FusedInput",
    "FusedKernel",
    "as_float64_bits",
    "block_size",
    "constexpr",
    "launch_elementwise",
    "optional_module",
]

#: the annotation of a kernel's compile-time arguments (Triton reads its text,
#: ``"constexpr"``, from the annotation; to a type checker it is an int)
constexpr = int


def optional_module(name: str) -> Any:
    """The module ``name`` (``"triton.language"``), or None where it cannot be imported."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def as_float64_bits(value: float) -> int:
    """The bits of a float64 as a signed 64-bit integer, for a kernel to bitcast back.

    Triton passes a Python float to a kernel as float32; torch's fused optimizers take
    their scalars as float64, and so do these kernels, through their bits.
    """
    signed: int = struct.unpack("<q", struct.pack("<d", float(value)))[0]
    return signed


def block_size(device: torch.device) -> int:
    """Elements per Triton program: 1024 on a GPU, more under the interpreter.

    (The interpreter runs its programs one after the other in Python.) The numbers do
    not depend on it.
    """
    return 1024 if device.type == "cuda" else 16384


@cache
def _jitted(function: Callable[..., Any], do_not_specialize: tuple[str, ...]) -> Any:
    """``triton.jit(function)``, made on first launch (so ``TRITON_INTERPRET`` is read then)."""
    triton = importlib.import_module("triton")
    return triton.jit(function, do_not_specialize=list(do_not_specialize))


def launch_elementwise(
    kernel: Callable[..., Any],
    first: Tensor,
    *args: Any,
    do_not_specialize: tuple[str, ...] = (),
    **constants: Any,
) -> None:
    """Launch an elementwise kernel over ``first``'s elements, one program per block.

    Calls ``kernel(first, *args, BLOCK=..., **constants)`` (jitted on first use) on a grid
    of ``ceil(numel / BLOCK)`` programs, on ``first``'s device and torch's current
    stream; nothing for an empty tensor.
    """
    numel = first.numel()
    if numel == 0:
        return
    block = block_size(first.device)
    grid = ((numel + block - 1) // block,)
    jitted = _jitted(kernel, do_not_specialize)
    if first.device.type == "cuda":
        with torch.cuda.device(first.device):
            jitted[grid](first, *args, BLOCK=block, **constants)
    else:
        jitted[grid](first, *args, BLOCK=block, **constants)


class FusedInput(NamedTuple):
    """What a sampler's fused kernel reads: one param group's tensors at one step.

    Attributes:
        params: the parameters with a gradient, contiguous (updated in place).
        grads: their gradients, contiguous (never modified).
        buffers: each state field the group keeps, one value per parameter (None where
            the kernel creates it, as SGD's momentum buffer at its first step); updated
            in place.
        seeds: each parameter's Philox key at this step (``fused.fused_noise_seed``;
            unused at temperature 0).
        offsets: the global index of each parameter's first element (a shard's offset
            in the whole tensor, else 0).
        largest: each parameter's device flag, a 1-element float64 tensor: the largest
            absolute gradient of the step over every parameter, NaN or infinity when one
            is not finite, and then the kernel writes nothing.
    """

    params: list[Tensor]
    grads: list[Tensor]
    buffers: Mapping[str, list[Tensor | None]]
    seeds: list[int]
    offsets: list[int]
    largest: list[Tensor]


class FusedKernel(Protocol):
    """What the module named by ``SamplerDefinition.fused_kernel`` provides."""

    def unsupported(self, group: Mapping[str, Any], temperature: float) -> str | None:
        """Why the kernel cannot take a param group's step (an option), or None."""

    def launch(self, group: Mapping[str, Any], inputs: FusedInput) -> Mapping[str, list[Tensor]]:
        """Take the step in place; return every state field's buffers (created ones too).

        ``group`` holds the hyperparameters, ``lr`` and ``temperature`` as floats.
        """
