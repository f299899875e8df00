"""The keyed noise draw as one ``torch.library`` custom op, so ``torch.compile`` keeps it.

``KeyedNormal.draw`` re-seeds a ``torch.Generator`` for every block of noise, which
TorchDynamo cannot trace ("torch.Generator.manual_seed() is a stateful RNG operation"):
traced directly, a sampler's step would break into several graphs. Wrapped in a custom
op, the whole draw is one opaque node of the graph: the compiled step calls it with the
chain's ``(seed, step, key, shard, layout)`` at run time and gets exactly the numbers the
eager step draws (the op runs ``KeyedNormal.draw`` itself), so a compiled and an eager
chain see the same noise bit for bit.

The op is a pure function of its arguments (the noise of a step is a function of the
chain's counters, not of any generator state), so the graph may treat it as such. The
step counter is passed as a ``SymInt``: with it left symbolic, one compiled graph serves
every step instead of one recompilation per step.

Needs torch >= 2.13: torch 2.11's inductor loses the symbolic step in the op's call
("NameError: name 's50' is not defined"). On older versions the draw is traced as
before: TorchDynamo breaks the graph at the generator, and the step is still correct.

Drawing ahead (``overlap_noise``, on the CPU): when asked to, the op hands the draw of
the *next* step (step + 1, the same key) to the prefetch worker thread before returning,
so that it runs beside the forward and backward passes that follow, as in the eager
step; the next call with that step takes it (the numbers are the same: ``fill_`` is
``draw``). The worker allocates a fresh tensor for each draw, and the op gives it away:
the compiled graph owns what the op returns, as it owns any op's output, so nothing the
graph may reuse is ever written again. The op's result is still a pure function of its
arguments; only its cost depends on what was drawn ahead.

The 64-bit seed and key are unsigned; the op's integers are signed 64-bit, so they cross
the boundary as two's complement (:func:`to_signed` / :func:`to_unsigned`).
"""

from __future__ import annotations

from concurrent.futures import Future

import torch
from torch import Tensor

from .keyed_normal import KeyedNormal
from .worker import shared_executor

__all__ = ["COMPILED_DRAW", "compiled_draw", "to_signed", "to_unsigned"]

_NO_VALUE = -1


def _version(text: str) -> tuple[int, int]:
    major, minor = text.split("+")[0].split(".")[:2]
    return int(major), int(minor)


#: whether traced code draws through the custom op (torch >= 2.13, see above)
COMPILED_DRAW = _version(torch.__version__) >= (2, 13)


def to_signed(value: int) -> int:
    """An integer in [0, 2**64) as the signed 64-bit integer with the same bits."""
    return value - (1 << 64) if value >= (1 << 63) else value


def to_unsigned(value: int) -> int:
    """Inverse of :func:`to_signed`."""
    return value + (1 << 64) if value < 0 else value


#: draws handed to the worker: (seed, key, shard, shape, dtype, device) -> (step, draw)
_AHEAD: dict[tuple[object, ...], tuple[int, Future[Tensor]]] = {}


def _fill(
    seed: int, shape: torch.Size, dtype: torch.dtype, device: torch.device, **where: int | None
) -> Tensor:
    """A fresh tensor of the chain's noise (``KeyedNormal.fill_``: ``draw``'s numbers)."""
    out = torch.empty(shape, dtype=dtype, device=device)
    return KeyedNormal(seed).fill_(out, **where)  # type: ignore[arg-type]


@torch.library.custom_op("samplers_as_optim::keyed_normal", mutates_args=())
def _keyed_normal(
    like: Tensor,
    seed: int,
    step: int,
    key: int,
    shard: int,
    offset: int,
    total: int,
    ahead: bool,
) -> Tensor:
    seed, key = to_unsigned(seed), to_unsigned(key)
    part = None if shard == _NO_VALUE else shard
    if offset != _NO_VALUE:
        return KeyedNormal(seed).draw(like, step=step, key=key, shard=part, layout=(offset, total))
    ident = (seed, key, part, like.shape, like.dtype, like.device)
    drawn = _AHEAD.pop(ident, None)
    noise = None
    if drawn is not None:
        noise = drawn[1].result()  # wait for it, and for the worker to be free
        if drawn[0] != step:
            noise = None  # drawn for another step (a step without noise came between)
    if noise is None:
        noise = _fill(seed, like.shape, like.dtype, like.device, step=step, key=key, shard=part)
    if ahead:
        _AHEAD[ident] = (
            step + 1,
            shared_executor().submit(
                _fill, seed, like.shape, like.dtype, like.device, step=step + 1, key=key, shard=part
            ),
        )
    return noise


@_keyed_normal.register_fake
def _keyed_normal_fake(like: Tensor, *where: int | bool) -> Tensor:
    """The op's output under tracing: a tensor like ``like`` (``where`` locates the draw)."""
    return torch.empty(like.shape, dtype=like.dtype, device=like.device)


def compiled_draw(
    like: Tensor,
    *,
    seed: int,
    step: int,
    key: int,
    shard: int | None,
    layout: tuple[int, int] | None,
    ahead: bool = False,
) -> Tensor:
    """``KeyedNormal(seed).draw(like, ...)`` through the custom op (for traced code).

    ``ahead``: also start drawing step + 1's noise on the worker thread (see above).
    """
    offset, total = (_NO_VALUE, _NO_VALUE) if layout is None else layout
    noise: Tensor = _keyed_normal(
        like,
        to_signed(seed),
        step,
        to_signed(key),
        _NO_VALUE if shard is None else shard,
        offset,
        total,
        ahead,
    )
    return noise
