"""Draw the next step's noise on a worker thread while the forward and backward passes run.

On the CPU, drawing the standard normals is most of a sampler step's cost (Mersenne
Twister, about as expensive as ``uniform_``), and nothing else can make it cheaper. But
the noise of a step is known in advance: it is a pure function of ``(seed, step, key,
block)`` (``samplers_as_optim._random``), independent of the gradients. So right after
step ``s`` the Optimizer hands the draws of step ``s + 1`` to a worker thread, which
fills one preallocated buffer per parameter while the caller runs ``zero_grad``, the
forward and the backward pass on the main thread (torch releases the GIL inside its
kernels, so the two run on two cores). Step ``s + 1`` waits for the worker, then uses
the buffers whose tag ``(seed, step, key, shard, shape, dtype)`` matches what it would
draw itself; anything else (a temperature switched on, a loaded state) is drawn on the
spot. The numbers are the same either way (``NoiseStream.fill_`` in place, or
``NoiseStream.draw``).

Cost: one parameter-sized buffer for each CPU parameter drawn ahead (those of at least
``PREFETCH_MIN_NUMEL`` elements, in groups at temperature > 0), kept between steps.
Smaller parameters draw in the step (handing them over costs more than it saves), and so
do CUDA parameters (their draw is a fast kernel of its own).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

import torch
from torch import Tensor

from .._random import NoiseStream

__all__ = ["NoisePrefetcher", "NoiseRequest"]

_executor: ThreadPoolExecutor | None = None
_executor_pid: int | None = None
_executor_lock = threading.Lock()


def _shared_executor() -> ThreadPoolExecutor:
    """One worker thread per process, shared by every Optimizer (created after a fork)."""
    global _executor, _executor_pid
    with _executor_lock:
        if _executor is None or _executor_pid != os.getpid():
            _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sampler-noise")
            _executor_pid = os.getpid()
        return _executor


class NoiseRequest(NamedTuple):
    """What to draw for one parameter: its noise at ``step`` under ``seed`` and ``key``."""

    param: Tensor
    seed: int
    step: int
    key: int
    shard: int | None


def _tag(request: NoiseRequest) -> tuple:
    param = request.param
    return (request.seed, request.step, request.key, request.shard, param.shape, param.dtype)


class NoisePrefetcher:
    """One Optimizer's prefetched noise: its buffers, their tags and the pending draw."""

    def __init__(self) -> None:
        self._buffers: dict[int, Tensor] = {}
        self._tags: dict[int, tuple] = {}
        self._pending: Future | None = None
        self._streams: dict[int, NoiseStream] = {}

    def submit(self, requests: list[NoiseRequest]) -> None:
        """Start drawing ``requests`` on the worker thread (after the current draw, if any)."""
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
        self._pending = _shared_executor().submit(self._draw, requests)

    def _draw(self, requests: list[NoiseRequest]) -> list[tuple[int, tuple]]:
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

    def take(self, request: NoiseRequest) -> Tensor | None:
        """The prefetched noise for ``request`` (call :meth:`wait` first), or None."""
        if self._tags.get(id(request.param)) != _tag(request):
            return None
        return self._buffers[id(request.param)]
