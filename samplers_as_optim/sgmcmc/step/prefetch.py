"""Draw the next step's noise while the forward and backward passes run.

On the CPU, drawing the standard normals is most of a sampler step's cost (Mersenne
Twister, about as expensive as ``uniform_``), and nothing else can make it cheaper. But
the noise of a step is known in advance: it is a pure function of ``(seed, step, key,
block)`` (``samplers_as_optim.core.streams``), independent of the gradients. So right after
step ``s`` the Optimizer hands the draws of step ``s + 1`` to a worker thread, which
fills one preallocated buffer per parameter while the caller runs ``zero_grad``, the
forward and the backward pass on the main thread (torch releases the GIL inside its
kernels, so the two run on two cores). Step ``s + 1`` waits for the worker, then uses
the buffers whose tag ``(seed, step, key, shard, shape, dtype)`` matches what it would
draw itself; anything else (a temperature switched on, a loaded state) is drawn on the
spot. The numbers are the same either way (``NoiseStream.fill_`` in place, or
``NoiseStream.draw``).

On a CUDA device the draw is queued on a side stream of that device instead (its own
generator, re-seeded per block, as in the step): the kernels run beside the forward and
backward kernels of the next iteration, and the step makes its stream wait for the side
stream's event before it reads the buffers. The side stream first waits for the current
stream, so a buffer is never overwritten while the previous step still reads it.

Cost: one parameter-sized buffer for each parameter drawn ahead (those of at least
``PREFETCH_MIN_NUMEL`` elements, in groups at temperature > 0), kept between steps.
Smaller parameters draw in the step (handing them over costs more than it saves).
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import NamedTuple

import torch
from torch import Tensor

from ...core.streams import NoiseStream
from ...core.worker import shared_executor

__all__ = ["NoisePrefetcher", "NoiseRequest"]


class NoiseRequest(NamedTuple):
    """What to draw for one parameter: its noise at ``step`` under ``seed`` and ``key``."""

    param: Tensor
    seed: int
    step: int
    key: int
    shard: int | None


#: what identifies a draw: seed, step, key, shard, shape and dtype
Tag = tuple[int, int, int, "int | None", torch.Size, torch.dtype]


def _tag(request: NoiseRequest) -> Tag:
    param = request.param
    return (request.seed, request.step, request.key, request.shard, param.shape, param.dtype)


class NoisePrefetcher:
    """One Optimizer's prefetched noise: its buffers, their tags and the pending draw."""

    def __init__(self) -> None:
        self._buffers: dict[int, Tensor] = {}
        self._tags: dict[int, Tag] = {}
        self._pending: Future[list[tuple[int, Tag]]] | None = None
        self._streams: dict[int, NoiseStream] = {}
        self._side_streams: dict[torch.device, torch.cuda.Stream] = {}
        self._events: dict[torch.device, torch.cuda.Event] = {}

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
        on_cpu = [request for request in requests if request.param.device.type == "cpu"]
        on_cuda = [request for request in requests if request.param.device.type == "cuda"]
        if on_cuda:
            self._draw_on_side_streams(on_cuda)
        if on_cpu:
            self._pending = shared_executor().submit(self._draw, on_cpu)

    def _draw_on_side_streams(self, requests: list[NoiseRequest]) -> None:
        """Queue the CUDA draws on each device's side stream; record when they are done."""
        devices = {request.param.device for request in requests}
        for device in devices:
            side = self._side_streams.get(device)
            if side is None:
                side = self._side_streams[device] = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                drawn = self._draw([r for r in requests if r.param.device == device])
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(side)
            self._events[device] = event
            for ident, tag in drawn:
                self._tags[ident] = tag

    def _draw(self, requests: list[NoiseRequest]) -> list[tuple[int, Tag]]:
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

    def holds_any(self) -> bool:
        """Whether any noise has been drawn ahead (:meth:`take` can only miss otherwise)."""
        return bool(self._tags)

    def take(self, request: NoiseRequest, spare: Tensor | None = None) -> Tensor | None:
        """The prefetched noise for ``request`` (call :meth:`wait` first), or None.

        Given a ``spare`` (IVON), the caller keeps the buffer and ``spare`` replaces it.
        """
        ident = id(request.param)
        if self._tags.get(ident) != _tag(request):
            return None
        device = request.param.device
        if device.type == "cuda":  # the draw was queued on the side stream
            torch.cuda.current_stream(device).wait_event(self._events[device])
        buffer = self._buffers[ident]
        if spare is not None:
            self._buffers[ident] = spare
            del self._tags[ident]
        return buffer
