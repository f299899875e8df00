r"""Counter-based Gaussian noise computed on the device: the capturable step's stream.

The keyed stream (``core/keyed_normal``) seeds a ``torch.Generator`` on the host for
every block of a step's noise, so a CUDA graph replay, which runs none of the step's
Python, would replay the captured seeds: the same noise at every step. A capturable step
(``capturable=True``) draws from this stream instead, whose every number is computed by
tensor operations from the chain's step counter *on the device*, so that a replay, reading
the counter the previous replay advanced, draws the next step's noise.

The numbers (a pure function of ``(seed, key, step, position)``, as the keyed stream's):

* on the host, once per parameter: :math:`h = ` ``derive_seed(seed, DOMAIN, key[, shard])``
  (SplitMix64 rounds of the chain's seed and the parameter's noise key, in a domain of
  their own, so that the two streams never share a seed);
* on the device, once per step: :math:`s = \operatorname{sm}(t)` for the step counter
  :math:`t`, and per parameter :math:`b = \operatorname{sm}(h \oplus s)`;
* per element at position :math:`p` (its index in the flattened whole parameter):
  :math:`x = \operatorname{sm}(b + p\gamma) = \operatorname{mix}(b + (p+1)\gamma)`, the
  SplitMix64 sequence that starts at :math:`b` (Steele, Lea & Flood 2014, "Fast
  splittable pseudorandom number generators", OOPSLA; :math:`\operatorname{sm}(z) =
  \operatorname{mix}(z + \gamma)` with :math:`\gamma` = ``0x9E3779B97F4A7C15`` and their
  64-bit finaliser ``mix``), the counter-based construction of Salmon et al. 2011
  ("Parallel random numbers: as easy as 1, 2, 3", SC'11);
* the normal, by Box & Muller (1958): two uniforms from the bits of :math:`x`,
  :math:`u_1 = (\lfloor x / 2^{64-m} \rfloor + \tfrac12)\, 2^{-m}` from its high
  :math:`m` bits and :math:`u_2 = (x \bmod 2^m)\, 2^{-m}` from its low ones, and
  :math:`\xi = \sqrt{-2 \ln u_1}\, \cos(2\pi u_2)`, computed in float32 with
  :math:`m = 24` (:math:`u_1` rounded to float32 above :math:`2^{-1}`, the tail cut at
  :math:`5.9\sigma`, probability :math:`4 \cdot 10^{-9}`) or in float64 with
  :math:`m = 32` (exact, cut at :math:`6.7\sigma`).

The 64-bit words live in int64 tensors, whose multiplications wrap modulo :math:`2^{64}`
and whose right shift is arithmetic; a logical shift is the arithmetic one masked.
The same numbers come out on every device up to the last bits of ``log`` and ``cos``
(the integers are exact everywhere): unlike the keyed stream, a CPU and a CUDA chain of
one seed draw the same noise. The cost is a few dozen elementwise operations per param
group (not per tensor: a group's tensors are drawn as one flat buffer, in chunks of
:data:`CHUNK` elements), which a CUDA graph replays without their Python. Traced by
``torch.compile`` the draw is one custom op running these same operations (Inductor's
fused version of them is wrong on the CPU: see ``_counter_normal_op``), so a compiled
and an eager chain draw the same numbers bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from .keyed_normal import derive_seed, key_to_int64

__all__ = ["CHUNK", "DOMAIN", "CounterLayout", "counter_normal_", "mix_step", "parameter_bases"]

#: keeps this stream's seeds apart from the keyed stream's (``derive_seed(seed, DOMAIN, ...)``)
DOMAIN = 0x6361707475726564  # "captured"
#: elements of a group's flat noise computed at once (the int64 temporaries' size)
CHUNK = 2**22

_MASK64 = (1 << 64) - 1
_GAMMA = key_to_int64(0x9E3779B97F4A7C15)
_C1 = key_to_int64(0xBF58476D1CE4E5B9)
_C2 = key_to_int64(0x94D049BB133111EB)


def _mix_(x: Tensor) -> Tensor:
    """SplitMix64's finaliser on int64 ``x``, in place (logical shifts: masked)."""
    for shift, multiplier in ((30, _C1), (27, _C2)):
        x.bitwise_xor_(torch.bitwise_right_shift(x, shift).bitwise_and_((1 << (64 - shift)) - 1))
        x.mul_(multiplier)
    return x.bitwise_xor_(torch.bitwise_right_shift(x, 31).bitwise_and_((1 << 33) - 1))


def mix_step(step: Tensor) -> Tensor:
    r""":math:`s = \operatorname{sm}(t)`: the step counter's part of every base, on its device."""
    return _mix_(step.to(torch.int64).add(_GAMMA))


def parameter_bases(hashes: Tensor, mixed_step: Tensor) -> Tensor:
    r"""Each parameter's :math:`b = \operatorname{sm}(h \oplus s)`, from its host hash :math:`h`."""
    return _mix_(torch.bitwise_xor(hashes, mixed_step).add_(_GAMMA))


class CounterLayout:
    """Where each tensor of a group's flat noise sits, and what is fixed per tensor.

    Made once per plan (host integers only). Tensor ``i`` holds flat elements
    ``[starts[i], starts[i] + numels[i])``, which are elements ``[offsets[i], ...)`` of its
    whole parameter (a share's offset, else 0).

    Args:
        seed: the chain's seed.
        keys: each tensor's noise key (``state["noise_key"]``).
        numels: each tensor's number of elements.
        offsets: each tensor's position in its whole parameter (None: all 0).
        shard: this rank's index, where sharded ranks key unnamed parameters by place.
        device: where the draws run.
    """

    def __init__(
        self,
        seed: int,
        keys: Sequence[int],
        numels: Sequence[int],
        *,
        offsets: Sequence[int] | None = None,
        shard: int | None = None,
        device: torch.device,
    ) -> None:
        shards = () if shard is None else (shard,)
        offsets = [0] * len(numels) if offsets is None else list(offsets)
        hashes = [key_to_int64(derive_seed(seed, DOMAIN, key, *shards)) for key in keys]
        starts = [sum(numels[:i]) for i in range(len(numels))]
        self.total = sum(numels)
        self.numels = list(numels)
        self.hashes = torch.tensor(hashes, dtype=torch.int64, device=device)
        # sm(b + p gamma) = mix(b + (flat index - start + offset + 1) gamma): the tensor's part
        shifts = [
            key_to_int64((offset - start + 1) * _GAMMA)
            for offset, start in zip(offsets, starts, strict=True)
        ]
        self.shifts = torch.tensor(shifts, dtype=torch.int64, device=device)
        #: per chunk of the flat index, flat: ``begin, end, count, (i, first, last) * count``
        self.chunks = self._chunks(starts)

    def _chunks(self, starts: list[int]) -> list[int]:
        chunks = []
        for begin in range(0, self.total, CHUNK):
            end = min(self.total, begin + CHUNK)
            pieces = [
                (i, max(begin, start) - begin, min(end, start + numel) - begin)
                for i, (start, numel) in enumerate(zip(starts, self.numels, strict=True))
                if start < end and start + numel > begin
            ]
            chunks += [begin, end, len(pieces), *(n for piece in pieces for n in piece)]
        return chunks


def counter_normal_(out: Tensor, layout: CounterLayout, step: Tensor) -> Tensor:
    """Fill flat ``out`` (``layout.total`` elements) with the step's noise (module docstring).

    ``step``: the chain's step counter, a 0-d integer tensor on ``out``'s device, read
    by the operations only (nothing reaches the host). ``out`` is float32 or float64
    (a float16/bfloat16 ``out`` takes the float32 numbers' rounding).
    """
    if torch.compiler.is_compiling():  # one opaque node (see _counter_normal_op)
        _counter_normal_op(out, layout.hashes, layout.shifts, step, layout.chunks)
    else:
        _fill(out, layout.hashes, layout.shifts, step, layout.chunks)
    return out


def _fill(out: Tensor, hashes: Tensor, shifts: Tensor, step: Tensor, chunks: list[int]) -> None:
    """:func:`counter_normal_`'s operations (``chunks``: ``CounterLayout.chunks``)."""
    wide = out.dtype == torch.float64
    bits = 32 if wide else 24
    compute = torch.float64 if wide else torch.float32
    starts = parameter_bases(hashes, mix_step(step)).add_(shifts)
    at = 0
    while at < len(chunks):
        begin, end, count = chunks[at : at + 3]
        x = torch.arange(begin, end, dtype=torch.int64, device=out.device).mul_(_GAMMA)
        for piece in range(at + 3, at + 3 + 3 * count, 3):  # (a slice each: no index kept)
            i, first, last = chunks[piece : piece + 3]
            x[first:last].add_(starts[i])
        at += 3 + 3 * count
        _mix_(x)
        high = torch.bitwise_right_shift(x, 64 - bits).bitwise_and_((1 << bits) - 1)
        radius = high.to(compute).add_(0.5).mul_(2.0**-bits).log_().mul_(-2.0).sqrt_()
        angle = x.bitwise_and_((1 << bits) - 1).to(compute).mul_(2.0 * math.pi * 2.0**-bits)
        out[begin:end].copy_(angle.cos_().mul_(radius))


@torch.library.custom_op("samplers_as_optim::counter_normal_", mutates_args=("out",))
def _counter_normal_op(
    out: Tensor, hashes: Tensor, shifts: Tensor, step: Tensor, chunks: list[int]
) -> None:
    """The draw as one ``torch.library`` op: traced code runs the eager operations.

    Fused by Inductor, the hash goes wrong on the CPU (torch 2.13): the elements past a
    kernel's last full vector, which its scalar loop computes, differ from the eager
    ones (``bitwise_right_shift`` of ``arange * gamma + b`` reproduces it; the vectorised
    elements agree). Opaque, the compiled draw is the eager draw, bit for bit.
    """
    _fill(out, hashes, shifts, step, chunks)


@_counter_normal_op.register_fake
def _counter_normal_fake(out: Tensor, *_: object) -> None:
    """Nothing to make: the op writes ``out``."""
