"""The CPU update chunk by chunk: large tensors in the noise's blocks, in cache.

On the CPU without foreach, tensors larger than :data:`CHUNK` elements are updated chunk
by chunk (the kernel on views, the noise drawn into a scratch chunk): the same operations
on the same numbers, so the same results bit for bit, but each chunk stays in cache
across the kernel's passes. That keeps a step within ~15% of SGD's step plus drawing the
noise, instead of ~30% for whole tensors. Only an elementwise update may run so
(``SamplerDefinition.chunked_kernel``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
from torch import Tensor

from ...core import streams
from ...core.streams import block_bounds
from ..tensor_lists import apply_step_
from .group_noise import GroupNoise
from .plan import drawn_whole

__all__ = ["CHUNK", "chunkable", "update_in_chunks"]

#: Tensors with more elements than this are updated chunk by chunk on the CPU, in the
#: noise's blocks (``streams.BLOCK`` elements), so that a chunk draws exactly its block.
CHUNK = streams.BLOCK

#: ``kernel(params, grads, buffers, noise) -> directions`` on (views of) the tensors
ChunkKernel = Callable[
    [list[Tensor], list[Tensor], list[list[Tensor | None]], list[Tensor] | None], list[Tensor]
]


def chunkable(
    params: list[Tensor], grads: list[Tensor], buffers: list[list[Tensor | None]]
) -> bool:
    """Whether a group's update may run chunk by chunk (CPU, contiguous, whole tensors)."""
    if not any(p.numel() > CHUNK for p in params):
        return False
    if not all(map(drawn_whole, params)):
        return False  # a share of a larger tensor draws its part of that one's noise
    tensors = [*params, *grads, *(b for field in buffers for b in field)]
    # not e.g. SGHMC's first step, whose buffers the kernel creates
    return all(t is not None and t.device.type == "cpu" and t.is_contiguous() for t in tensors)


def update_in_chunks(
    kernel: ChunkKernel,
    params: list[Tensor],
    grads: list[Tensor],
    buffers: list[list[Tensor | None]],
    noise_of: GroupNoise | None,
    *,
    lr: float,
    temperature: float,
) -> None:
    """Update CPU tensors, large ones chunk by chunk (buffers in place), and step.

    A chunk is a block of the noise (:data:`~samplers_as_optim.core.streams.BLOCK`): a
    view of the prefetched noise, or drawn with ``normal_`` into a scratch tensor from
    the block's own generator: the numbers of ``NoiseStream.draw``, which draws each
    block with ``torch.randn``.
    """

    def update(
        ps: list[Tensor],
        gs: list[Tensor],
        bs: list[list[Tensor | None]],
        noise: list[Tensor] | None,
    ) -> None:
        directions = kernel(ps, gs, bs, noise)
        apply_step_(ps, directions, lr=lr, as_sgd=temperature == 0, foreach=False)

    def flat(tensor: Tensor, start: int, stop: int) -> Tensor:
        return tensor.view(-1)[start:stop]

    small: list[int] = []  # consecutive small tensors, updated together in order

    def flush() -> None:
        if small:
            noise = None if noise_of is None else [noise_of.whole(i) for i in small]
            bs = [[field[i] for i in small] for field in buffers]
            update([params[i] for i in small], [grads[i] for i in small], bs, noise)
            small.clear()

    scratch: dict[tuple[torch.device, torch.dtype], Tensor] = {}
    for i, param in enumerate(params):
        if param.numel() <= CHUNK:
            small.append(i)
            continue
        flush()
        kind = (param.device, param.dtype)
        if kind not in scratch:
            scratch[kind] = param.new_empty(streams.BLOCK)
        for block, (start, stop) in enumerate(block_bounds(param.numel())):
            noise = None
            if noise_of is not None:
                noise = [noise_of.block(i, block, start, stop, scratch[kind])]
            update(
                [flat(param, start, stop)],
                [flat(grads[i], start, stop)],
                [[flat(cast(Tensor, field[i]), start, stop)] for field in buffers],
                noise,
            )
    flush()
