"""The chain's noise stream: :class:`KeyedNormal`'s numbers, eager or traced.

The numbers are defined once, eagerly, in ``_keyed_normal`` (see its docstring: a pure
function of ``(seed, step, key, position)``, drawn in blocks). Traced by
``torch.compile``, a draw becomes the custom op of ``_noise_op``, one node of the graph
that runs the same eager draw, so a compiled and an eager chain see the same noise.
:class:`NoiseStream` is the stream the optimizers and transforms use: it picks between
the two. The layering is ``_keyed_normal`` (eager) < ``_noise_op`` (the op) < this module.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .keyed_normal import (
    BLOCK,
    KeyedNormal,
    block_bounds,
    derive_seed,
    key_from_int64,
    key_to_int64,
    parameter_key,
    seed_from_global_rng,
)
from .noise_op import COMPILED_DRAW, compiled_draw

__all__ = [
    "BLOCK",
    "NoiseStream",
    "block_bounds",
    "derive_seed",
    "key_from_int64",
    "key_to_int64",
    "parameter_key",
    "seed_from_global_rng",
]


class NoiseStream(KeyedNormal):
    """:class:`KeyedNormal`, whose draws become one custom op when traced.

    Args:
        seed: the chain's seed, an integer in [0, 2**64).
    """

    def draw(
        self,
        like: Tensor,
        *,
        step: int,
        key: int,
        shard: int | None = None,
        layout: tuple[int, int] | None = None,
        ahead: bool = False,
    ) -> Tensor:
        """:meth:`KeyedNormal.draw`; traced, the custom op (the same numbers).

        ``ahead`` (traced code only, see ``_noise_op``): also start drawing the next
        step's noise on the worker thread.
        """
        if COMPILED_DRAW and torch.compiler.is_compiling():  # one node (see _noise_op)
            return compiled_draw(
                like, seed=self.seed, step=step, key=key, shard=shard, layout=layout, ahead=ahead
            )
        return super().draw(like, step=step, key=key, shard=shard, layout=layout)
