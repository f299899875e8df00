"""The state of a sampler's torchopt transformation: its class and its initial buffers.

Both are read from the sampler's definition (:func:`.transformation.transformation_of`): a
NamedTuple ``<Name>State`` with one field per declared buffer (each a tuple with one entry
per leaf, or empty where the hyperparameters keep no such buffer), ``momentum_lr`` for a
sampler whose momentum is kept in SGD units, then ``seed`` and ``count``. A state pickled
before some of its fields existed (``StateField.legacy``) still loads.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..definition import SamplerDefinition
from ..definition.momentum_units import MOMENTUM_RATE

__all__ = ["PUBLIC_MODULE", "buffer_names", "initial_buffers", "state_class"]

#: the module whose names the transformations' state classes are (for pickling)
PUBLIC_MODULE = "samplers_as_optim.transforms"


def buffer_names(definition: SamplerDefinition) -> list[str]:
    """The state's fields before ``seed`` and ``count``: the buffers, then the momentum rate."""
    rated = [MOMENTUM_RATE] if definition.momentum_in_lr_units else []
    return [state.name for state in definition.state] + rated


def state_class(definition: SamplerDefinition) -> type[Any]:
    """The NamedTuple ``<Name>State`` of ``definition``'s transformation, documented."""
    lines = [f"The state of :func:`{definition.transform_name}`: buffers and the chain's "]
    lines[0] += "random state.\n\nAttributes:"
    for state in definition.state:
        lines.append(f"    {state.name}: {state.doc}")
    if definition.momentum_in_lr_units:
        lines.append(
            f"    {MOMENTUM_RATE}: per leaf, the learning rate (a float) at which its momentum "
            "buffer was last written, None before its first update at temperature > 0: a "
            "later update at another ``lr`` first rescales the buffer (docs/design.md)."
        )
    lines.append("    seed: the seed of the chain's noise.")
    lines.append(
        "    count: the number of updates taken, the step of the next noise draw and of "
        "the schedules."
    )
    fields: list[tuple[str, Any]] = [(name, tuple[Any, ...]) for name in buffer_names(definition)]
    fields += [("seed", int), ("count", int)]
    state_type: type[Any] = NamedTuple(f"{definition.name}State", fields)  # type: ignore[misc]
    if any(state.legacy is not None for state in definition.state):
        state_type = _loading_legacy_states(state_type, definition)  # type: ignore[misc]
    state_type.__module__ = PUBLIC_MODULE
    state_type.__doc__ = "\n".join(lines)
    return state_type


def _loading_legacy_states(base: type[Any], definition: SamplerDefinition) -> type[Any]:
    """``base`` whose constructor also takes the fields of an older version's state.

    A state pickled before some fields existed (``StateField.legacy``) is rebuilt with
    ``cls(*old_values)`` (or by keyword): the missing fields are derived from the old ones.
    """
    added = [state for state in definition.state if state.legacy is not None]
    new_names = {state.name for state in added}
    old_names = [name for name in base._fields if name not in new_names]

    def __new__(cls: type[Any], *args: Any, **kwargs: Any) -> Any:  # noqa: N807
        given = dict(zip(base._fields, args, strict=False)) | kwargs
        if len(args) == len(old_names) and not kwargs:
            given = dict(zip(old_names, args, strict=True))
        if not all(name in given for name in new_names):
            old = {name: given[name] for name in old_names if name in given}
            for state in added:
                assert state.legacy is not None
                given.setdefault(state.name, state.legacy(old))
        make: Any = base.__new__
        return make(cls, **given)

    namespace: dict[str, Any] = {"__slots__": (), "__new__": __new__}
    return type(base.__name__, (base,), namespace)


def initial_buffers(
    definition: SamplerDefinition, group: Mapping[str, Any], leaves: list[Tensor | None]
) -> tuple[Any, ...]:
    """The buffer fields of a new state for the param leaves ``leaves`` (None: no leaf)."""
    used = definition.state_fields(group)
    buffers: list[tuple[Any, ...]] = []
    for state in definition.state:
        if state.name not in used:
            buffers.append(())
            continue
        init = state.init or (lambda leaf, _: torch.zeros_like(leaf))
        if state.host:  # a number read in Python: a float here (``StateField.host``)
            buffers.append(
                tuple(None if leaf is None else float(init(leaf, group)) for leaf in leaves)
            )
            continue
        buffers.append(tuple(None if leaf is None else init(leaf, group) for leaf in leaves))
    if definition.momentum_in_lr_units:
        buffers.append((None,) * len(leaves) if definition.momentum_buffer in used else ())
    return tuple(buffers)
