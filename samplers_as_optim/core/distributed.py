"""What the ranks of a ``torch.distributed`` job must agree on before a sampler steps.

A data-parallel replica (DDP) differs from its peers only by the noise it draws: the
gradients are all-reduced, so with one seed every rank takes the same step and the
replicas stay equal. The common recipe ``torch.manual_seed(base + rank)`` would give
each rank its own seed when ``seed=None`` draws it from the global RNG, and the replicas
would drift apart without any error. So, under an initialised process group, the first
step of an optimizer gathers every rank's chain state once (one ``all_gather_object``):

* seeds drawn from the global RNG (``seed=None``) are replaced by rank 0's;
* seeds the user gave (or a checkpoint holds) must be equal on every rank, and so must
  the step counters; otherwise every rank raises the same ``ValueError``;
* when the ranks hold different parameters (a sharded optimizer such as
  ``ZeroRedundancyOptimizer``, where each rank updates its own share) and some have no
  name, the noise of a parameter is keyed by its index in this rank's share, which
  another rank's parameter shares: each rank then also keys by the rank, so that two
  ranks never draw the same numbers for different parameters. With names
  (:func:`~samplers_as_optim.name_parameters`) no rank key is needed, and a sharded run
  draws the numbers of a 1-process run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ChainAgreement", "agree_across_ranks"]


@dataclass(frozen=True)
class ChainAgreement:
    """The outcome of :func:`agree_across_ranks` for this rank.

    Attributes:
        seeds: the seed of each param group to use from now on.
        shard: None when every rank holds the same parameters (replicas) or every
            parameter is named; this rank's index when unnamed parameters are sharded
            over the ranks.
    """

    seeds: list[int]
    shard: int | None


def agree_across_ranks(
    seeds: list[int],
    steps: list[int],
    shapes: list[list[tuple[int, ...]]],
    *,
    given: bool,
    named: bool = False,
) -> ChainAgreement:
    """Make the ranks of the default process group agree on the chain's random state.

    A no-op (the seeds unchanged, ``shard=None``) without an initialised process group
    of two or more ranks. Every rank must call it (it is one collective).

    Args:
        seeds: this rank's seed per param group.
        steps: this rank's step counter per param group.
        shapes: the shapes of each param group's parameters (to tell replicas from shards).
        given: whether the seeds were chosen (by the user or a checkpoint) rather than
            drawn from this rank's global RNG.
        named: whether every parameter's noise is keyed by its name (then shards need no
            rank key).

    Returns:
        The seeds to use and whether this rank holds a shard.

    Raises:
        ValueError: the ranks hold different chosen seeds or different step counters (the
            same message on every rank).
    """
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return ChainAgreement(list(seeds), None)
    mine: dict[str, Any] = {"seeds": seeds, "steps": steps, "shapes": shapes, "given": given}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    reference = everyone[0]
    for rank, other in enumerate(everyone):
        if other["steps"] != reference["steps"]:
            raise ValueError(
                f"Invalid step counters: rank {rank} is at step {other['steps']} and rank 0 "
                f"at {reference['steps']} (expected every rank to resume from the same "
                "checkpoint)"
            )
        if other["given"] and other["seeds"] != reference["seeds"]:
            raise ValueError(
                f"Invalid seed: rank {rank} has {_show(other['seeds'])} and rank 0 "
                f"{_show(reference['seeds'])} (expected the same seed on every rank: "
                "different seeds give each data-parallel replica its own noise, and the "
                "replicas drift apart; pass one seed, or seed=None to use rank 0's)"
            )
    sharded = any(other["shapes"] != reference["shapes"] for other in everyone)
    return ChainAgreement(
        list(reference["seeds"]), dist.get_rank() if sharded and not named else None
    )


def _show(seeds: list[int]) -> str:
    return repr(seeds[0]) if len(set(seeds)) == 1 else repr(seeds)
