"""IVON's weight perturbations: which numbers a draw uses, and drawing them ahead.

A draw's standard normals are the chain core's keyed noise (``docs/design.md``, "Noise:
a pure function of (seed, step, key, position)"): for a parameter with noise key k, the
draw number ``index`` of a step (counted from 0 since the last ``step()``) uses the key
``derive_seed(k, domain, index)``, with domain 0 for training draws
(``sampled_params(train=True)``) and 1 for the others. So evaluating the posterior
between steps never changes the training run, and a checkpoint (which holds the step and
the two counters) resumes the same draws.

On the CPU, drawing the normals costs about as much as the rest of IVON's work
together. The next training draw is known in advance (the next index of this step, or
index 0 of the next step), so right after a training draw the next one is handed to the
package's worker thread (``samplers_as_optim.core.worker``), which fills one buffer per
large parameter while the forward and backward passes run; the numbers are the same
(``NoiseStream.fill_`` either way). The filled buffer is handed over and the optimizer's
spare one taken in exchange, so nothing is copied or allocated in a step.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import NamedTuple

import torch
from torch import Tensor

from ...core.streams import NoiseStream, derive_seed
from ...core.worker import shared_executor

__all__ = [
    "PREFETCH_MIN_NUMEL",
    "DrawRequest",
    "Prefetcher",
    "draw_key",
    "fill_normals",
    "next_training_draws",
]

#: parameters smaller than this draw on the spot (handing them over costs more)
PREFETCH_MIN_NUMEL = 2**16
TRAIN, EVAL = 0, 1


def draw_key(key: int, *, train: bool, index: int) -> int:
    """The noise key of draw ``index`` of a step for a parameter keyed ``key``."""
    return derive_seed(key, TRAIN if train else EVAL, index)


class DrawRequest(NamedTuple):
    """One parameter's normals: its noise at ``step`` under ``seed`` and ``key``."""

    param: Tensor
    seed: int
    step: int
    key: int
    shard: int | None


Tag = tuple[int, int, int, "int | None", torch.Size, torch.dtype]


def _tag(request: DrawRequest) -> Tag:
    param = request.param
    return (request.seed, request.step, request.key, request.shard, param.shape, param.dtype)


class Prefetcher:
    """One optimizer's normals drawn ahead on the worker thread (CPU parameters only)."""

    def __init__(self) -> None:
        self._buffers: dict[int, Tensor] = {}
        self._tags: dict[int, Tag] = {}
        self._pending: Future[list[tuple[int, Tag]]] | None = None
        self._streams: dict[int, NoiseStream] = {}

    def submit(self, requests: list[DrawRequest]) -> None:
        """Start drawing the large CPU parameters of ``requests`` on the worker thread."""
        requests = [
            r
            for r in requests
            if r.param.device.type == "cpu" and r.param.numel() >= PREFETCH_MIN_NUMEL
        ]
        if not requests:
            return
        self.wait()
        for request in requests:
            param = request.param
            buffer = self._buffers.get(id(param))
            if buffer is None or buffer.shape != param.shape or buffer.dtype != param.dtype:
                self._buffers[id(param)] = torch.empty_like(
                    param, memory_format=torch.contiguous_format
                )
            self._tags.pop(id(param), None)  # invalid until drawn
        self._pending = shared_executor().submit(self._draw, requests)

    def _draw(self, requests: list[DrawRequest]) -> list[tuple[int, Tag]]:
        drawn = []
        for request in requests:
            stream = self._streams.get(request.seed)
            if stream is None:
                stream = self._streams[request.seed] = NoiseStream(request.seed)
            stream.fill_(
                self._buffers[id(request.param)],
                step=request.step,
                key=request.key,
                shard=request.shard,
            )
            drawn.append((id(request.param), _tag(request)))
        return drawn

    def wait(self) -> None:
        """Wait for the pending draw and record what it drew."""
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        for ident, tag in pending.result():
            self._tags[ident] = tag

    def take(self, request: DrawRequest, spare: Tensor) -> Tensor | None:
        """The normals drawn ahead for ``request`` (call :meth:`wait` first), or None.

        The caller gets the buffer, and the prefetcher takes ``spare`` (shaped like the
        parameter) as the buffer of its next draw for that parameter: no copy.
        """
        ident = id(request.param)
        if self._tags.get(ident) != _tag(request):
            return None
        buffer = self._buffers[ident]
        self._buffers[ident] = spare
        del self._tags[ident]
        return buffer


def fill_normals(
    stream: NoiseStream,
    prefetcher: Prefetcher | None,
    requests: list[DrawRequest],
    buffers: list[Tensor],
) -> None:
    """Put each request's normals in ``buffers`` (in place, or the worker's buffer).

    A request the worker drew ahead replaces its entry of ``buffers`` by the worker's
    buffer (which the caller keeps), the old one going to the worker; any other is drawn
    into its buffer on the spot: the same numbers either way.
    """
    for position, request in enumerate(requests):
        spare = buffers[position]
        drawn = None if prefetcher is None else prefetcher.take(request, spare)
        if drawn is None:
            stream.fill_(spare, step=request.step, key=request.key, shard=request.shard)
        else:
            buffers[position] = drawn


def next_training_draws(
    params: list[Tensor],
    keys: list[int],
    seed: int,
    step: int,
    count: int,
    mc_samples: int,
    shard: int | None,
) -> list[DrawRequest]:
    """After training draw ``count`` (from 0) of ``step``: the requests of the next one.

    The next draw of this step while fewer than ``mc_samples`` were drawn, else the first
    of the next step.
    """
    within = count + 1 < mc_samples
    index, at = (count + 1, step) if within else (0, step + 1)
    return [
        DrawRequest(p, seed, at, draw_key(k, train=True, index=index), shard)
        for p, k in zip(params, keys, strict=True)
    ]
