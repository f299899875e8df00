"""The noise stage of a param group's step: the keyed stream, or the capturable one.

:class:`GroupNoise` (the default): prefetched where it was, drawn otherwise. A
parameter's noise is whole (shaped like it; an FSDP2 shard's rows of the whole
parameter's noise; a ``ParallelEnsemble`` share's part) or, for the CPU update chunk by
chunk (``step/chunked``), one block at a time; every way gives the numbers of
``NoiseStream.draw`` (``docs/design.md``, "Noise").

:class:`CounterGroupNoise` (a ``capturable`` optimizer's): the whole group's noise computed on
the device from its step counter tensor (``core/counter_normal``), into a flat buffer the
plan keeps, so that a captured step's replay draws the next step's numbers.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ...core.counter_normal import CounterLayout, counter_normal_
from ...core.dtensor import is_dtensor, local_layout, wrap_like
from ...core.streams import NoiseStream
from ...names import parameter_layout
from .half_precision import HALF_DTYPES, MASTER
from .plan import TensorLayout, drawn_whole
from .prefetch import NoisePrefetcher, NoiseRequest

__all__ = [
    "PREFETCH_MIN_NUMEL",
    "CounterGroupNoise",
    "GroupNoise",
    "drawn_ahead",
    "group_noise",
    "large",
    "next_noise_requests",
]

#: Parameters with at least this many elements have their noise drawn ahead (on the
#: worker thread, or a CUDA side stream: ``overlap_noise``); smaller ones draw in the step.
PREFETCH_MIN_NUMEL = 2**16


def large(param: Tensor) -> bool:
    """Whether a parameter is large enough for its noise to be drawn ahead."""
    return param.numel() >= PREFETCH_MIN_NUMEL


def drawn_ahead(param: Tensor) -> bool:
    """Whether a parameter's next noise is drawn ahead on the worker (CPU, large)."""
    return param.device.type == "cpu" and large(param)


def group_noise(
    opt: Any,
    group: dict[str, Any],
    params: list[Tensor],
    tensors: list[Tensor],
    scratch: Any,
    layout: TensorLayout | None = None,
) -> GroupNoise | CounterGroupNoise:
    """The noise of ``group``'s step for ``tensors`` (each parameter, or its master).

    ``params`` key the noise; ``scratch``: the plan's (None: a step not planned);
    ``layout``: the parameters' (the plan's), used where ``tensors`` are the parameters.
    """
    if opt._capturable:
        return CounterGroupNoise(
            tensors,
            params,
            seed=group["seed"],
            keys=opt._noise_keys(params),
            step=group["step"],
            shard=opt._shard,
            scratch={} if scratch is None else scratch,
        )
    return GroupNoise(
        tensors,
        stream=opt._stream(group["seed"]),
        keys=opt._noise_keys(params),
        step=group["step"],
        shard=opt._shard,
        prefetcher=opt._prefetcher,
        ahead=opt._overlap_noise,
        scratch=scratch,
        layout=layout if tensors is params else None,
    )


class CounterGroupNoise:
    """A capturable group's noise: ``core/counter_normal``'s, from the device counter.

    The tensors are drawn per dtype and device as one flat buffer, which the plan's
    ``scratch`` keeps with its layout (the same memory at every step, as a captured
    graph reads it); each tensor's noise is a view of it. A share of a larger tensor
    (``ParallelEnsemble`` over ranks) draws its part of the whole tensor's numbers.
    """

    def __init__(
        self,
        tensors: list[Tensor],
        params: list[Tensor],
        *,
        seed: int,
        keys: list[int],
        step: Tensor,
        shard: int | None,
        scratch: dict[str, Any],
    ) -> None:
        self.tensors, self.params, self.step = tensors, params, step
        self.seed, self.keys, self.shard, self.scratch = seed, keys, shard, scratch

    def all(self) -> list[Tensor]:
        """Every tensor's noise, shaped like it, in order."""
        signature = tuple((id(t), t.shape, t.dtype, t.device) for t in self.tensors)
        kept = self.scratch.get("counter_noise")
        if kept is None or kept[0] != signature:
            kept = self.scratch["counter_noise"] = (signature, self._buffers())
        noise: list[Tensor | None] = [None] * len(self.tensors)
        for indices, layout, flat in kept[1]:
            counter_normal_(flat, layout, self.step)
            for i, piece in zip(indices, flat.split(layout.numels), strict=True):
                noise[i] = piece.view(self.tensors[i].shape)
        return noise  # type: ignore[return-value]

    def _buffers(self) -> list[tuple[list[int], CounterLayout, Tensor]]:
        """Per dtype and device: the tensors' indices, their layout, the flat buffer."""
        kinds: dict[tuple[torch.dtype, torch.device], list[int]] = {}
        for i, tensor in enumerate(self.tensors):
            kinds.setdefault((tensor.dtype, tensor.device), []).append(i)
        buffers = []
        for (dtype, device), indices in kinds.items():
            shares = [parameter_layout(self.params[i]) for i in indices]
            layout = CounterLayout(
                self.seed,
                [self.keys[i] for i in indices],
                [self.tensors[i].numel() for i in indices],
                offsets=[0 if share is None else share[0] for share in shares],
                shard=self.shard,
                device=device,
            )
            buffers.append((indices, layout, torch.empty(layout.total, dtype=dtype, device=device)))
        return buffers


class GroupNoise:
    """The noise of one param group's step: prefetched where it was, drawn otherwise."""

    def __init__(
        self,
        params: list[Tensor],
        *,
        stream: NoiseStream,
        keys: list[int],
        step: int,
        shard: int | None,
        prefetcher: NoisePrefetcher | None,
        ahead: bool,
        scratch: dict[str, Any] | None = None,
        layout: TensorLayout | None = None,
    ) -> None:
        self.params = params
        self.scratch = scratch  # (the plan's: ``_kept_outputs``)
        self.layout = layout  # (``params``': which are drawn together, and into what)
        self.stream = stream
        self.keys = keys
        self.step = step
        self.shard = shard
        self.prefetched: list[Tensor | None] = [None] * len(params)
        #: under torch.compile, whether the draw hands the next step's to the worker
        self.ahead = ahead
        self.any_prefetched = prefetcher is not None and prefetcher.holds_any()
        if prefetcher is not None and self.any_prefetched:
            self.prefetched = [
                prefetcher.take(NoiseRequest(param, stream.seed, step, key, shard))
                for param, key in zip(params, keys, strict=True)
            ]

    def all(self) -> list[Tensor]:
        """Every parameter's noise, shaped like it (:meth:`whole` of each, in order).

        The plain tensors not drawn ahead (neither DTensors nor shares of a larger
        tensor) are drawn together (``KeyedNormal.draw_many``: the same numbers); traced
        by ``torch.compile``, each is the draw's custom op.
        """
        if torch.compiler.is_compiling():
            return [self.whole(i) for i in range(len(self.params))]
        params, layout = self.params, self.layout
        if layout is None:
            plain = [i for i, param in enumerate(params) if drawn_whole(param)]
        else:  # (the plan's: which are drawn here, and the tensors they are drawn into)
            plain = layout.drawn
        if self.any_prefetched:  # (those drawn ahead are not drawn again)
            plain = [i for i in plain if self.prefetched[i] is None]
        whole = len(plain) == len(params)
        likes = params if whole else [params[i] for i in plain]
        outputs: list[Tensor | None] | None
        if layout is not None and whole:
            if layout.noise is None:  # (the plan's tensors: kept when the layout changes)
                scratch = {} if self.scratch is None else self.scratch
                layout.noise = _kept_outputs(scratch, likes)
            outputs = layout.noise
        else:
            outputs = None if self.scratch is None else _kept_outputs(self.scratch, likes)
        drawn = self.stream.draw_many(
            likes,
            self.keys if whole else [self.keys[i] for i in plain],
            step=self.step,
            shard=self.shard,
            out=outputs,
        )
        if whole:
            return drawn
        out = list(self.prefetched)
        for i, noise in zip(plain, drawn, strict=True):
            out[i] = noise
        return [self.whole(i) if noise is None else noise for i, noise in enumerate(out)]

    def whole(self, i: int) -> Tensor:
        """Parameter i's noise, shaped like it."""
        prefetched = self.prefetched[i]
        if prefetched is not None:
            return prefetched
        param = self.params[i]
        if is_dtensor(param):  # FSDP2: this rank's rows of the whole parameter's noise
            local, layout = local_layout(param)
            noise = self.stream.draw(
                local, step=self.step, key=self.keys[i], shard=self.shard, layout=layout
            )
            return wrap_like(noise, param)
        share = parameter_layout(param)
        return self.stream.draw(
            param,
            step=self.step,
            key=self.keys[i],
            shard=self.shard,
            layout=share,
            ahead=self.ahead and share is None and drawn_ahead(param),
        )

    def block(self, i: int, block: int, start: int, stop: int, scratch: Tensor) -> Tensor:
        """Elements ``[start, stop)`` of parameter i's noise (its block ``block``)."""
        prefetched = self.prefetched[i]
        if prefetched is not None:
            return prefetched.view(-1)[start:stop]
        return self.stream.fill_block_(
            scratch[: stop - start], step=self.step, key=self.keys[i], block=block, shard=self.shard
        )


#: the most elements of a group's noise drawn into kept tensors (:func:`_kept_outputs`)
KEPT_NUMEL = 2**20


def _kept_outputs(scratch: dict[str, Any], likes: list[Tensor]) -> list[Tensor | None]:
    """Tensors kept in the plan's ``scratch`` to draw small tensors' noise into.

    A small tensor's noise costs as much to allocate as to draw; the update only reads
    it, within the step. Below :data:`PREFETCH_MIN_NUMEL` elements each and
    :data:`KEPT_NUMEL` in all (None: a new tensor); one that no longer matches is new.
    """
    kept: dict[int, Tensor] = scratch.setdefault("noise", {})
    outputs: list[Tensor | None] = []
    for like in likes:
        out = kept.get(id(like))
        kind = (like.shape, like.dtype, like.device)
        if out is None or (out.shape, out.dtype, out.device) != kind:
            if out is not None:  # (no longer like its tensor: dropped)
                scratch["noise_numel"] -= kept.pop(id(like)).numel()
            out = None
            numel = scratch.get("noise_numel", 0) + like.numel()
            if like.numel() < PREFETCH_MIN_NUMEL and numel <= KEPT_NUMEL:
                out = kept[id(like)] = torch.empty(like.shape, dtype=like.dtype, device=like.device)
                scratch["noise_numel"] = numel
        outputs.append(out)
    return outputs


def next_noise_requests(opt: Any) -> list[NoiseRequest]:
    """The next step's draws to prefetch: large CPU and CUDA parameters of groups at T > 0.

    Handing a draw to the worker costs about as much as drawing a few ten thousand
    normals (the hand-off, and the worker's Python competing for the GIL), so smaller
    parameters draw in the step, and a small model hands nothing over. A half-precision
    parameter's noise is drawn like its float32 master (``step/half_precision``). Which
    parameters are large is found once per plan: one that grows later draws in the step,
    one that shrinks is drawn ahead at its new size (the same numbers either way).
    """
    if opt._capturable:  # (drawn on the device, in the step)
        return []
    requests = []
    plans = opt._runtime["plans"]
    for group in opt.param_groups:
        if not (float(group["temperature"]) > 0 and float(group["lr"]) > 0):
            continue
        plan = plans.get(id(group))
        ahead = None if plan is None else plan.scratch.get("ahead")
        if ahead is None:  # (the plan's parameters, once: sizes and devices rarely change)
            ahead = [
                param
                for param in group["params"]
                if large(param) and param.device.type in ("cpu", "cuda") and drawn_whole(param)
            ]
            if plan is not None and plan.params is group["params"]:
                plan.scratch["ahead"] = ahead
        if not ahead:
            continue
        params = [param for param in ahead if param.requires_grad]
        requests += [
            NoiseRequest(_noise_like(opt, param), group["seed"], group["step"], key, opt._shard)
            for param, key in zip(params, opt._noise_keys(params), strict=True)
        ]
    return requests


def _noise_like(opt: Any, param: Tensor) -> Tensor:
    """The tensor ``param``'s noise is drawn like: its float32 master where it has one."""
    if param.dtype in HALF_DTYPES:
        state = opt.state.get(param)
        if state and isinstance(state.get(MASTER), Tensor):
            master: Tensor = state[MASTER]
            return master
    return param
