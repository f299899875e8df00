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
package's worker thread (the samplers' ``sgmcmc/step/prefetch``), which fills one buffer per
large parameter while the forward and backward passes run; the numbers are the same
(``NoiseStream.fill_`` either way). The filled buffer is handed over and the optimizer's
spare one taken in exchange, so nothing is copied or allocated in a step.
"""

from __future__ import annotations

from torch import Tensor

from ...core.streams import NoiseStream, derive_seed
from ...sgmcmc.step.group_noise import drawn_ahead
from ...sgmcmc.step.prefetch import NoisePrefetcher, NoiseRequest

__all__ = ["draw_key", "fill_normals", "next_training_draws", "submit_ahead"]

TRAIN, EVAL = 0, 1


#: draw keys already derived: the same few recur at every step (``index`` restarts at 0)
_DRAW_KEYS: dict[tuple[int, bool, int], int] = {}


def draw_key(key: int, *, train: bool, index: int) -> int:
    """The noise key of draw ``index`` of a step for a parameter keyed ``key`` (remembered)."""
    found = _DRAW_KEYS.get((key, train, index))
    if found is None:
        if len(_DRAW_KEYS) >= 4096:  # (bounded: many parameters, many draws)
            _DRAW_KEYS.clear()
        found = _DRAW_KEYS[(key, train, index)] = derive_seed(key, TRAIN if train else EVAL, index)
    return found


def submit_ahead(prefetcher: NoisePrefetcher, requests: list[NoiseRequest]) -> None:
    """Hand the worker the draws of the large CPU parameters.

    The samplers' rule (``step/group_noise.drawn_ahead``): smaller ones cost less to draw
    on the spot than to hand over.
    """
    prefetcher.submit([request for request in requests if drawn_ahead(request.param)])


def fill_normals(
    stream: NoiseStream,
    prefetcher: NoisePrefetcher | None,
    requests: list[NoiseRequest],
    buffers: list[Tensor],
) -> None:
    """Put each request's normals in ``buffers`` (in place, or the worker's buffer).

    A request the worker drew ahead replaces its entry of ``buffers`` by the worker's
    buffer (which the caller keeps), the old one going to the worker; any other is drawn
    into its buffer on the spot: the same numbers either way.
    """
    left: list[int] = []  # the positions drawn here
    for position, request in enumerate(requests):
        drawn = None if prefetcher is None else prefetcher.take(request, buffers[position])
        if drawn is None:
            left.append(position)
        else:
            buffers[position] = drawn
    if not left:
        return
    first = requests[left[0]]
    if all((requests[i].step, requests[i].shard) == (first.step, first.shard) for i in left):
        outs, keys = [buffers[i] for i in left], [requests[i].key for i in left]
        stream.fill_many_(outs, keys, step=first.step, shard=first.shard)  # (seeds mixed once)
        return
    for i in left:
        request = requests[i]
        stream.fill_(buffers[i], step=request.step, key=request.key, shard=request.shard)


def next_training_draws(
    params: list[Tensor],
    keys: list[int],
    seed: int,
    step: int,
    count: int,
    mc_samples: int,
    shard: int | None,
) -> list[NoiseRequest]:
    """After training draw ``count`` (from 0) of ``step``: the requests of the next one.

    The next draw of this step while fewer than ``mc_samples`` were drawn, else the first
    of the next step.
    """
    within = count + 1 < mc_samples
    index, at = (count + 1, step) if within else (0, step + 1)
    return [
        NoiseRequest(p, seed, at, draw_key(k, train=True, index=index), shard)
        for p, k in zip(params, keys, strict=True)
    ]
