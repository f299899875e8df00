"""The fused noise stream's numbers drawn alone: ``tl.randn(seed, offset + i)``.

What the fused kernels draw in registers (``fused/io.normal``), written to a tensor
(``fused.fused_normal``), so that a test can give the reference update the very noise of
a fused step.
"""

from __future__ import annotations

from torch import Tensor

from .io import normal, tl
from .launch import KernelArg, constexpr, launch_elementwise

__all__ = ["draw_"]


def _draw(
    out: KernelArg,
    numel: KernelArg,
    offset: KernelArg,
    seed: KernelArg,
    BLOCK: constexpr,  # noqa: N803
) -> None:
    index = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out + index, normal(seed, offset, index), mask=index < numel)


def draw_(out: Tensor, *, seed: int, offset: int) -> Tensor:
    """Fill contiguous float32 ``out`` with elements ``[offset, offset + numel)``.

    Of the fused stream keyed ``seed`` (a Philox key: ``fused.fused_noise_seed``).
    """
    launch_elementwise(_draw, out, out.numel(), offset, seed, do_not_specialize=("offset", "seed"))
    return out
