"""Counter-based Gaussian noise for the samplers.

Every sampler step needs fresh standard-normal noise ``xi ~ N(0, I)``. Here the noise of
one step is a pure function of ``(seed, step, stream)``: before drawing, the generator of
each device is re-seeded with :func:`derive_seed` of those integers, then noise is drawn
tensor by tensor in the order given. Consequences:

* the whole random state of a chain is two integers, ``seed`` and the step counter, so a
  ``state_dict`` round trip resumes the chain bit for bit, and a state can be saved
  anywhere (the torchopt transforms keep exactly these two numbers in their state, as
  optax's ``AddNoiseState`` keeps a key);
* an Optimizer and a transform built with one seed draw identical noise;
* the same seed on every data-parallel rank gives identical noise on every rank, so
  replicas stay in sync (for sharded parameters, FSDP/ZeRO, give each rank its own seed);
* nothing is drawn from, or disturbs, torch's global RNG after construction.

Noise on a CUDA device comes from that device's generator (Philox), on the CPU from the
CPU generator (Mersenne Twister): for one seed the two give different numbers, as
``torch.randn`` does.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "NoiseStream",
    "chunk_bounds",
    "chunked_draws_match",
    "derive_seed",
    "draw_standard_normal",
    "seed_from_global_rng",
]

_MASK64 = (1 << 64) - 1
_GOLDEN64 = 0x9E3779B97F4A7C15


def _splitmix64(x: int) -> int:
    """One round of SplitMix64 (Steele, Lea & Flood 2014): a bijective 64-bit mixer."""
    x = (x + _GOLDEN64) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def derive_seed(seed: int, *counters: int) -> int:
    """Mix ``seed`` and any number of non-negative counters into one 64-bit seed.

    Distinct ``(seed, *counters)`` tuples give unrelated seeds (each counter goes through
    a full SplitMix64 round), which is how the noise of different steps, param groups and
    devices is kept independent.
    """
    h = _splitmix64(seed & _MASK64)
    for counter in counters:
        h = _splitmix64(h ^ _splitmix64(counter & _MASK64))
    return h


def seed_from_global_rng() -> int:
    """Draw a 63-bit seed from torch's global CPU generator.

    Used when a sampler is built with ``seed=None``, so ``torch.manual_seed`` still
    governs a whole run.
    """
    return int(torch.randint(0, 2**63 - 1, (), dtype=torch.int64).item())


class NoiseStream:
    """Standard-normal noise indexed by ``(step, stream)``, one generator per device.

    Args:
        seed: the chain's seed, an integer in [0, 2**64).

    The generators are scratch space: their state is recomputed from ``seed`` at every
    draw, so only ``seed`` (and the caller's step counter) needs saving.
    """

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def _generator(self, device: torch.device) -> torch.Generator:
        generator = self._generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device)
            self._generators[device] = generator
        return generator

    def generators(
        self, like: Sequence[Tensor], *, step: int, stream: int, shard: int | None = None
    ) -> list[torch.Generator]:
        """The generator to draw each tensor's noise from, re-seeded for ``(step, stream)``.

        The devices of ``like`` are numbered in order of first appearance; device ``j`` is
        seeded with ``derive_seed(seed, step, stream, j)``, or ``derive_seed(seed, step,
        stream, j, shard)`` for one rank's shard of a sharded optimizer. Tensors on one
        device share its generator, so their noise must be drawn in the order of ``like``.
        """
        seeded: dict[torch.device, torch.Generator] = {}
        shards = () if shard is None else (shard,)
        for tensor in like:
            device = tensor.device
            if device not in seeded:
                generator = self._generator(device)
                generator.manual_seed(derive_seed(self.seed, step, stream, len(seeded), *shards))
                seeded[device] = generator
        return [seeded[tensor.device] for tensor in like]

    def standard_normal(self, like: Sequence[Tensor], *, step: int, stream: int) -> list[Tensor]:
        """Draw ``xi ~ N(0, I)`` shaped like each tensor of ``like``, in order.

        Args:
            like: tensors giving the shape, dtype and device of each draw.
            step: the step counter (the same step always gives the same noise).
            stream: an independent stream within the step (the param group index).

        Returns:
            One fresh tensor per entry of ``like`` (see :meth:`generators` for the seeds).
        """
        return draw_standard_normal(like, self.generators(like, step=step, stream=stream))


def draw_standard_normal(
    like: Sequence[Tensor], generators: Sequence[torch.Generator]
) -> list[Tensor]:
    """One ``torch.randn`` shaped like each tensor, from its generator, in order."""
    return [
        torch.randn(t.shape, generator=g, dtype=t.dtype, device=t.device)
        for t, g in zip(like, generators, strict=True)
    ]


def chunk_bounds(numel: int, size: int) -> list[tuple[int, int]]:
    """``[start, stop)`` ranges of at most ``size + 15`` elements covering ``range(numel)``.

    A last range shorter than 16 is merged into the one before: drawn this way, chunk by
    chunk with ``normal_``, a tensor's noise equals one ``torch.randn`` of the whole
    tensor (torch's CPU kernel fills blocks of 16), which :func:`chunked_draws_match`
    checks for the running torch.
    """
    bounds = [[start, min(numel, start + size)] for start in range(0, numel, size)]
    if len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] < 16:
        last = bounds.pop()
        bounds[-1][1] = last[1]
    return [(start, stop) for start, stop in bounds]


@functools.cache
def chunked_draws_match(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether chunked ``normal_`` draws equal one ``randn`` here (checked once per kind)."""
    for numel in (5, 16, 3 * 64 + 5, 3 * 64 + 21, 1000):
        whole = torch.randn(
            numel, generator=torch.Generator(device).manual_seed(numel), dtype=dtype, device=device
        )
        generator = torch.Generator(device).manual_seed(numel)
        scratch = torch.empty(64 + 15, dtype=dtype, device=device)
        parts = [
            scratch[: stop - start].normal_(generator=generator).clone()
            for start, stop in chunk_bounds(numel, 64)
        ]
        if not torch.equal(whole, torch.cat(parts)):
            return False
    return True
