r"""What one HMC transition draws from the chain: step multiplier, momenta, test uniform.

Randomness is counter based (``samplers_as_optim.core.streams``, ``docs/design.md``):
the momentum of a parameter is ``NoiseStream(seed).draw`` at ``(step, parameter key)``,
scaled by :math:`\sqrt{T M}`; the uniforms of the Metropolis test and of the jitter come
from generators seeded by ``(seed, step, key)`` with keys of their own. Both ways to run
a transition (by closure, by loss function) take these same numbers, so they are the same
chain. :func:`draw_transitions` draws the numbers of several consecutive transitions at once
(for ``HMC.run``), stacked along a leading dimension: for each transition the numbers
:func:`draw_transition` draws at its step, bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..core.streams import NoiseStream, block_bounds, derive_seed
from .adaptation import start_step_size_
from .start import Start

__all__ = ["TransitionDraws", "draw_transition", "draw_transitions"]

#: keys of the uniforms of the accept test and of the jitter (apart from parameter keys)
_ACCEPT_KEY = derive_seed(0x484D43, 1)
_JITTER_KEY = derive_seed(0x484D43, 2)


class TransitionDraws(NamedTuple):
    """One transition's scalars per parameter, step multiplier and random numbers."""

    decay: dict[int, float]  #: each parameter's weight decay, by ``id``
    root_lr: dict[int, float]  #: each parameter's :math:`\sqrt{lr/N}`, by ``id``
    multiplier: Tensor  #: the step multiplier :math:`s` per chain (float64), jittered
    inverse_mass: list[Tensor | None]  #: per parameter of the chain (None: the identity)
    momenta: list[Tensor]  #: :math:`r \sim \mathcal N(0, T M)` per parameter of the chain
    uniform: Tensor  #: :math:`u` of the Metropolis test, per chain (float64)
    step_size: Tensor  #: the leapfrog step of param group 0, for the diagnostics
    num_accepted: Tensor  #: the running count of acceptances before this transition
    divergences: Tensor  #: the running count of divergences before this transition


def _inverse_mass(state: Mapping[Any, Any], param: Tensor) -> Tensor | None:
    """:math:`M^{-1}` of a parameter: from its state's ``"mass"``, else None (the identity)."""
    mass = state[param].get("mass") if param in state else None
    return None if mass is None else 1.0 / mass


def _setting(
    param_groups: Sequence[dict[str, Any]], hmc: dict[str, Any], start: Start
) -> tuple[float, float, dict[int, float], dict[int, float], dict[int, dict[str, Any]], Tensor]:
    r"""What a transition's draws read before drawing, all but param group 0's seed and step.

    Group 0's temperature and jitter; each parameter's weight decay, :math:`\sqrt{lr/N}` and
    param group, by ``id``; the chain's log step multiplier :math:`\log s`, which
    ``start_step_size_`` creates at the first transition.
    """
    first = param_groups[0]
    temperature = float(first["temperature"])
    jitter = float(first["jitter"])
    num_data = int(first["num_data"])
    decay: dict[int, float] = {}
    root_lr: dict[int, float] = {}
    group_of: dict[int, dict[str, Any]] = {}
    for group in param_groups:
        for p in group["params"]:
            decay[id(p)] = float(group["weight_decay"])
            root_lr[id(p)] = math.sqrt(float(group["lr"]) / num_data)
            group_of[id(p)] = group
    device = start.chain[0].device
    log_step = start_step_size_(hmc, start.members, device, first["target_accept"])
    return temperature, jitter, decay, root_lr, group_of, log_step


def _momentum(xi: Tensor, inverse_mass: Tensor | None, temperature: float) -> Tensor:
    r""":math:`r = \sqrt{T M}\,\xi` from standard normal ``xi`` (any leading dimensions)."""
    scale = math.sqrt(temperature)
    if inverse_mass is not None:
        return xi * (scale / inverse_mass.sqrt())
    if scale != 1.0:  # (xi * 1.0 is xi, bit for bit)
        return xi * scale
    return xi


def _step_and_counts(
    hmc: dict[str, Any],
    first: dict[str, Any],
    root_lr: dict[int, float],
    multiplier: Tensor,
    like: Tensor,
    shape: tuple[int, ...],
) -> tuple[Tensor, Tensor, Tensor]:
    """:class:`TransitionDraws`' last three fields: a step size and the running counts.

    The step size is param group ``first``'s; the counts are those before this
    transition (``shape``: one per chain; zeros on ``like``'s device at the first).
    """
    previous = hmc["diagnostics"]
    if previous is None:  # two tensors: one aliasing the other recompiles a compiled step
        previous = {
            key: torch.zeros(shape, dtype=torch.int64, device=like.device)
            for key in ("num_accepted", "divergences")
        }
    params0 = first["params"]
    step_size = multiplier * root_lr[id(params0[0])] if params0 else multiplier
    return step_size, previous["num_accepted"], previous["divergences"]


def draw_transition(
    param_groups: Sequence[dict[str, Any]],
    state: Mapping[Any, Any],
    hmc: dict[str, Any],
    start: Start,
    stream: Callable[[int], NoiseStream],
    keys: Sequence[int],
) -> TransitionDraws:
    """Draw what a transition from ``start`` needs (nothing changes but the first step size).

    Args:
        param_groups: the optimizer's param groups (their seeds and step counters).
        state: the optimizer's per-parameter state (a parameter's ``"mass"``).
        hmc: the optimizer-level ``"hmc"`` state: the log step multiplier (created at
            the first transition) and the last diagnostics (their running counts).
        start: where the transition starts (the chain and K).
        stream: the chain's noise stream of a seed.
        keys: the noise key of each parameter of the chain.
    """
    first = param_groups[0]
    temperature, jitter, decay, root_lr, group_of, log_step = _setting(param_groups, hmc, start)
    chain, members = start.chain, start.members
    device = chain[0].device

    # the step size: s (per chain), jittered, times sqrt(lr / N) per group
    multiplier = torch.exp(log_step)
    step0 = int(first["step"])
    stream0 = stream(int(first["seed"]))
    if jitter > 0:
        generator = stream0.generator(device, step=step0, key=_JITTER_KEY, block=0)
        u = torch.rand(log_step.shape, generator=generator, dtype=torch.float64, device=device)
        multiplier = multiplier * (1 + jitter * (2 * u - 1))
    inverse_mass = [_inverse_mass(state, p) for p in chain]

    # the momentum r ~ N(0, T M), from the counter-based stream
    momenta = []
    for p, inv, key in zip(chain, inverse_mass, keys, strict=True):
        group = group_of[id(p)]
        xi = stream(int(group["seed"])).draw(p, step=int(group["step"]), key=key)
        momenta.append(_momentum(xi, inv, temperature))
    # the uniform of the Metropolis test
    generator = stream0.generator(device, step=step0, key=_ACCEPT_KEY, block=0)
    shape = () if members is None else (members,)
    uniform = torch.rand(shape, generator=generator, dtype=torch.float64, device=device)
    last = _step_and_counts(hmc, first, root_lr, multiplier, chain[0], shape)
    return TransitionDraws(decay, root_lr, multiplier, inverse_mass, momenta, uniform, *last)


def draw_transitions(
    param_groups: Sequence[dict[str, Any]],
    state: Mapping[Any, Any],
    hmc: dict[str, Any],
    start: Start,
    stream: Callable[[int], NoiseStream],
    keys: Sequence[int],
    *,
    offset: int,
    count: int,
    capacity: int,
) -> TransitionDraws:
    """The numbers of ``count`` consecutive transitions, stacked (for ``HMC.run``).

    Transition ``t`` (``0 <= t < count``) is the one each param group makes at its step
    ``group["step"] + offset + t``; its entry of each stacked tensor is, bit for bit, what
    :func:`draw_transition` draws at that step (the counters are read, not advanced). Only
    after the warm-up (the step multiplier does not change between the transitions).

    Returns:
        A :class:`TransitionDraws` whose ``momenta`` (one ``[capacity, *shape]`` tensor per
        parameter of the chain), ``uniform``, ``multiplier`` and ``step_size`` (each
        ``[capacity]``, or ``[capacity, K]`` for K members) hold transition ``t`` at row
        ``t``, zeros from row ``count`` on; the running counts are those before the first.
    """
    first = param_groups[0]
    temperature, jitter, decay, root_lr, group_of, log_step = _setting(param_groups, hmc, start)
    chain, members = start.chain, start.members
    device = chain[0].device
    shape = () if members is None else (members,)
    step0 = int(first["step"]) + offset
    stream0 = stream(int(first["seed"]))

    def uniforms(key: int) -> Tensor:
        out = torch.zeros((capacity, *shape), dtype=torch.float64, device=device)
        for t in range(count):  # torch.rand(shape, generator=...) is uniform_ of that shape
            generator = stream0.generator(device, step=step0 + t, key=key, block=0)
            out[t].uniform_(generator=generator)
        return out

    multiplier = torch.exp(log_step).expand(capacity, *shape).contiguous()
    if jitter > 0:
        multiplier = multiplier * (1 + jitter * (2 * uniforms(_JITTER_KEY) - 1))
    multiplier[count:] = 0.0
    inverse_mass = [_inverse_mass(state, p) for p in chain]
    momenta = []
    for p, inv, key in zip(chain, inverse_mass, keys, strict=True):
        group = group_of[id(p)]
        noise, steps = stream(int(group["seed"])), int(group["step"]) + offset
        xi = torch.zeros((capacity, p.numel()), dtype=p.dtype, device=p.device)
        bounds = list(enumerate(block_bounds(p.numel())))
        for t in range(count):  # KeyedNormal.fill_ (draw's numbers, in place), inlined
            row = xi[t]
            for block, (low, high) in bounds:
                generator = noise.generator(device, step=steps + t, key=key, block=block)
                (row if len(bounds) == 1 else row[low:high]).normal_(generator=generator)
        momenta.append(_momentum(xi.view(capacity, *p.shape), inv, temperature))
    uniform = uniforms(_ACCEPT_KEY)
    last = _step_and_counts(hmc, first, root_lr, multiplier, chain[0], shape)
    return TransitionDraws(decay, root_lr, multiplier, inverse_mass, momenta, uniform, *last)
