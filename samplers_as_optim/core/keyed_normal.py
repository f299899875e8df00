"""Counter-based Gaussian noise for the samplers, keyed by parameter and position (eager).

Every sampler step needs fresh standard-normal noise ``xi ~ N(0, I)``. Here the noise of
one element is a pure function of ``(seed, step, key, position)``: ``key`` identifies
the parameter (:func:`parameter_key` of its name, or of its index among the optimizer's
parameters when it has no name) and ``position`` is the element's index in the flattened
parameter. Elements are drawn in blocks of :data:`BLOCK`: block ``b`` (elements
``[b BLOCK, (b + 1) BLOCK)``) is ``torch.randn`` of its size from a generator re-seeded
with :func:`derive_seed` ``(seed, step, key, b)``. An Optimizer derives the key once and
keeps it in the parameter's state (``state["noise_key"]``, :func:`key_to_int64`), so a
loaded state draws with the keys it was drawn with, whatever names or positions the
loading optimizer gives its parameters. Consequences:

* the whole random state of a chain is two integers, ``seed`` and the step counter, so a
  ``state_dict`` round trip resumes the chain bit for bit, and a state can be saved
  anywhere (the torchopt transforms keep exactly these two numbers in their state, as
  optax's ``AddNoiseState`` keeps a key);
* an Optimizer and a transform built with one seed draw identical noise;
* a parameter's noise does not depend on which other parameters have a gradient, how
  they are grouped, or in what order they are updated; a part of a tensor (a chunk, a
  shard) needs only the blocks it overlaps;
* the same seed on every data-parallel rank gives identical noise on every rank, so
  replicas stay in sync;
* nothing is drawn from, or disturbs, torch's global RNG after construction.

Noise on a CUDA device comes from that device's generator (Philox), on the CPU from the
CPU generator (Mersenne Twister): for one seed the two give different numbers, as
``torch.randn`` does.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

__all__ = [
    "BLOCK",
    "KeyedNormal",
    "block_bounds",
    "derive_seed",
    "extend_seed",
    "key_from_int64",
    "key_to_int64",
    "parameter_key",
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


#: SplitMix64 rounds of counters already seen: seeds, keys and block indices recur
_COUNTER_HASHES: dict[int, int] = {}


def _counter_hash(counter: int) -> int:
    """``_splitmix64(counter)``, remembered (a plain dict, which TorchDynamo traces)."""
    hashed = _COUNTER_HASHES.get(counter)
    if hashed is None:
        if len(_COUNTER_HASHES) >= 4096:
            _COUNTER_HASHES.clear()
        hashed = _COUNTER_HASHES[counter] = _splitmix64(counter)
    return hashed


def derive_seed(seed: int, *counters: int) -> int:
    """Mix ``seed`` and any number of non-negative counters into one 64-bit seed.

    Distinct ``(seed, *counters)`` tuples give unrelated seeds (each counter goes through
    a full SplitMix64 round), which is how the noise of different steps, param groups and
    devices is kept independent.
    """
    return extend_seed(_counter_hash(seed & _MASK64), *counters)


def extend_seed(derived: int, *counters: int) -> int:
    """``derive_seed(seed, *first, *counters)`` given ``derived = derive_seed(seed, *first)``.

    For many seeds sharing their first counters (one step's keys): the shared part is
    mixed once.
    """
    h = derived
    for counter in counters:
        h = _splitmix64(h ^ _counter_hash(counter & _MASK64))
    return h


def seed_from_global_rng() -> int:
    """Draw a 63-bit seed from torch's global CPU generator.

    Used when a sampler is built with ``seed=None``, so ``torch.manual_seed`` still
    governs a whole run.
    """
    return int(torch.randint(0, 2**63 - 1, (), dtype=torch.int64).item())


#: elements per independently seeded block of noise (also the CPU update's chunk size)
BLOCK = 2**18


_NAME_DOMAIN = 0x6E616D65  # keeps name keys apart from index keys


def parameter_key(identity: str | int) -> int:
    """The 64-bit key of a parameter's noise: from its name, or from its index.

    Names are hashed with BLAKE2b (stable across processes and Python versions, unlike
    ``hash``) in a domain of their own; indices are mixed with SplitMix64.
    """
    if isinstance(identity, str):
        digest = hashlib.blake2b(identity.encode(), digest_size=8).digest()
        return derive_seed(_NAME_DOMAIN, int.from_bytes(digest, "little"))
    return derive_seed(identity)


def key_to_int64(key: int) -> int:
    """A 64-bit key in [0, 2**64) as the int64 that holds its bits (for a tensor)."""
    key &= _MASK64
    return key - (1 << 64) if key >= 1 << 63 else key


def key_from_int64(value: int) -> int:
    """The key in [0, 2**64) whose bits the int64 ``value`` holds (:func:`key_to_int64`)."""
    return value & _MASK64


def block_bounds(numel: int, block: int | None = None) -> list[tuple[int, int]]:
    """``[start, stop)`` of each block (of ``block`` elements, default :data:`BLOCK`)."""
    size = BLOCK if block is None else block
    return [(start, min(numel, start + size)) for start in range(0, numel, size)]


class KeyedNormal:
    """Standard-normal noise indexed by ``(step, key, block)``, one generator per device.

    Args:
        seed: the chain's seed, an integer in [0, 2**64).

    The generators are scratch space: their state is recomputed from ``seed`` for every
    block, so only ``seed`` (and the caller's step counter) needs saving.
    """

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def generator(
        self, device: torch.device, *, step: int, key: int, block: int, shard: int | None = None
    ) -> torch.Generator:
        """The device's generator seeded for one block.

        The seed is ``derive_seed(seed, step, key, block)``, with ``shard`` appended for
        one rank's share of a sharded optimizer whose parameters have no names.
        """
        shards = () if shard is None else (shard,)
        return self._seeded(device, derive_seed(self.seed, step, key, block, *shards))

    def fill_block_(
        self, out: Tensor, *, step: int, key: int, block: int, shard: int | None = None
    ) -> Tensor:
        """Fill ``out`` (contiguous, the size of block ``block``) with that block's noise.

        ``normal_`` into it gives the numbers ``torch.randn`` of its size gives from the
        same generator, so a block drawn in place equals the one :meth:`draw` returns.
        """
        generator = self.generator(out.device, step=step, key=key, block=block, shard=shard)
        return out.normal_(generator=generator)

    def fill_(self, out: Tensor, *, step: int, key: int, shard: int | None = None) -> Tensor:
        """Fill contiguous ``out`` with a parameter's noise in place: :meth:`draw`'s numbers."""
        flat = out.view(-1)
        for block, (start, stop) in enumerate(block_bounds(flat.numel())):
            self.fill_block_(flat[start:stop], step=step, key=key, block=block, shard=shard)
        return out

    def draw(
        self,
        like: Tensor,
        *,
        step: int,
        key: int,
        shard: int | None = None,
        layout: tuple[int, int] | None = None,
    ) -> Tensor:
        """The noise of one parameter: ``xi`` shaped like ``like`` (its dtype and device).

        One ``torch.randn`` per block, concatenated; a tensor of at most one block is
        one ``torch.randn`` of its shape. Works inside ``torch.func.vmap``
        (with ``randomness="different"`` each vmapped entry gets its own numbers).

        ``layout=(offset, total)`` says that ``like`` holds elements ``[offset, offset +
        numel)`` of a tensor of ``total`` elements spread over several processes (a
        ``ParallelEnsemble`` split over ranks): its noise is then that part of the whole
        tensor's, drawn from the blocks it overlaps.
        """
        dtype, device = like.dtype, like.device
        if layout is not None and layout != (0, like.numel()):
            return self._draw_part(like, step=step, key=key, shard=shard, layout=layout)
        bounds = block_bounds(like.numel())
        if len(bounds) <= 1:
            generator = self.generator(like.device, step=step, key=key, block=0, shard=shard)
            return torch.randn(like.shape, generator=generator, dtype=dtype, device=device)
        blocks = [
            torch.randn(
                stop - start,
                generator=self.generator(like.device, step=step, key=key, block=b, shard=shard),
                dtype=dtype,
                device=device,
            )
            for b, (start, stop) in enumerate(bounds)
        ]
        return torch.cat(blocks).reshape(like.shape)

    def draw_many(
        self,
        likes: Sequence[Tensor],
        keys: Sequence[int],
        *,
        step: int,
        shard: int | None = None,
        out: Sequence[Tensor | None] | None = None,
    ) -> list[Tensor]:
        """:meth:`draw` of each of ``likes`` (whole tensors) with its key: the same numbers.

        The seed's and the step's part of :func:`derive_seed` is mixed once for all of
        them, and a tensor of one block is one ``manual_seed`` and one ``normal_`` into
        a new contiguous tensor (``torch.randn`` is exactly that): the per-tensor cost of
        a step's noise, for many small tensors. ``out``: a contiguous tensor like each
        to fill instead of a new one (None: a new one).
        """
        seeds = self._single_block_seeds(step=step, shard=shard)
        drawn = []
        for like, key, target in zip(likes, keys, out or [None] * len(likes), strict=True):
            if like.numel() > BLOCK:
                drawn.append(self.draw(like, step=step, key=key, shard=shard))
                continue
            generator = self._seeded(like.device, seeds(key))
            if target is None:
                target = torch.empty_like(like, memory_format=torch.contiguous_format)
            drawn.append(target.normal_(generator=generator))
        return drawn

    def fill_many_(
        self, outs: Sequence[Tensor], keys: Sequence[int], *, step: int, shard: int | None = None
    ) -> None:
        """:meth:`fill_` of each of ``outs`` (contiguous) with its key: the same numbers.

        The seed's and the step's part of the seeds mixed once for all, as in
        :meth:`draw_many`; a tensor of one block is one ``manual_seed`` and one ``normal_``.
        """
        seeds = self._single_block_seeds(step=step, shard=shard)
        for out, key in zip(outs, keys, strict=True):
            if out.numel() > BLOCK:
                self.fill_(out, step=step, key=key, shard=shard)
            else:
                out.normal_(generator=self._seeded(out.device, seeds(key)))

    def _single_block_seeds(self, *, step: int, shard: int | None) -> Callable[[int], int]:
        """``derive_seed(seed, step, key, 0[, shard])`` as a function of ``key``.

        Written out, with the seed's and the step's part mixed once.
        """
        prefix = extend_seed(_counter_hash(self.seed & _MASK64), step)
        block0 = _counter_hash(0)
        last = None if shard is None else _counter_hash(shard & _MASK64)

        def seed_of(key: int) -> int:
            h = _splitmix64(_splitmix64(prefix ^ _counter_hash(key & _MASK64)) ^ block0)
            return h if last is None else _splitmix64(h ^ last)

        return seed_of

    def _seeded(self, device: torch.device, seed: int) -> torch.Generator:
        """The device's generator, seeded with ``seed``."""
        generator = self._generators.get(device)
        if generator is None:
            generator = self._generators[device] = torch.Generator(device=device)
        return generator.manual_seed(seed)

    def _draw_part(
        self, like: Tensor, *, step: int, key: int, shard: int | None, layout: tuple[int, int]
    ) -> Tensor:
        offset, total = layout
        stop = offset + like.numel()
        if not 0 <= offset <= stop <= total:
            raise ValueError(
                f"Invalid layout: {layout!r} for {like.numel()} elements (expected an offset "
                "and a total with offset + numel <= total)"
            )
        parts = []
        size = BLOCK
        for b in range(offset // size, -(-stop // size)):
            start, end = b * size, min(total, (b + 1) * size)
            generator = self.generator(like.device, step=step, key=key, block=b, shard=shard)
            block = torch.randn(
                end - start, generator=generator, dtype=like.dtype, device=like.device
            )
            parts.append(block[max(offset, start) - start : min(stop, end) - start])
        return torch.cat(parts).reshape(like.shape)

    def standard_normal(
        self,
        like: Sequence[Tensor],
        keys: Sequence[int],
        *,
        step: int,
        shard: int | None = None,
    ) -> list[Tensor]:
        """Draw ``xi ~ N(0, I)`` for each tensor of ``like``, keyed by ``keys``.

        Args:
            like: tensors giving the shape, dtype and device of each draw.
            keys: each tensor's :func:`parameter_key`.
            step: the step counter (the same step always gives the same noise).
            shard: this rank's index when the ranks update different, unnamed parameters.

        Returns:
            One fresh tensor per entry of ``like``.
        """
        return [
            self.draw(tensor, step=step, key=key, shard=shard)
            for tensor, key in zip(like, keys, strict=True)
        ]
