"""The one layout every method's samples share, and the one way to run a model over them.

A *stacked* set of parameters is a ``dict`` mapping a module's parameter (and, optionally,
buffer) names, as in ``module.named_parameters()``, to tensors with one extra leading
dimension of size S: ensemble members, collected SGMCMC samples, Laplace or VI draws.
Names absent from the dict keep the module's own values, shared by all S (so a
posterior over a subset of the parameters, LoRA-style, is a smaller dict).

:func:`call_stacked` runs the module for all S at once with
``torch.func.vmap(torch.func.functional_call)``, in chunks of S when asked, so the same
code serves a :class:`~samplers_as_optim.ParallelEnsemble`'s forward and every
predictive computation.

Example:
    >>> import torch
    >>> from samplers_as_optim.stacked import call_stacked, stack_modules
    >>> members = [torch.nn.Linear(3, 2) for _ in range(4)]
    >>> stacked = stack_modules(members)
    >>> call_stacked(members[0], stacked, torch.randn(5, 3)).shape
    torch.Size([4, 5, 2])
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, vmap

__all__ = ["call_stacked", "num_stacked", "stack_modules", "stack_states", "unstack"]


def num_stacked(stacked: Mapping[str, Tensor]) -> int:
    """The common leading size S of a stacked dict; ValueError if empty or inconsistent."""
    if not stacked:
        raise ValueError("Invalid stacked parameters: {} (expected at least one tensor)")
    sizes = {name: tensor.shape[0] if tensor.dim() else None for name, tensor in stacked.items()}
    distinct = set(sizes.values())
    if len(distinct) != 1 or None in distinct:
        raise ValueError(
            f"Invalid stacked parameters: leading sizes {sizes} (expected every tensor to "
            "have the same leading sample dimension)"
        )
    return distinct.pop()


def stack_states(states: Sequence[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """Stack equally-keyed dicts of tensors along a new leading dimension (detached copies)."""
    if not states:
        raise ValueError("Invalid states: [] (expected at least one dict of tensors)")
    keys = list(states[0])
    for index, state in enumerate(states):
        if list(state) != keys:
            raise ValueError(
                f"Invalid states: entry {index} has keys {sorted(state)} (expected the keys "
                f"of entry 0, {sorted(keys)})"
            )
    return {key: torch.stack([state[key].detach() for state in states]) for key in keys}


def stack_modules(modules: Sequence[nn.Module], *, buffers: bool = False) -> dict[str, Tensor]:
    """Stack the parameters (and, with ``buffers=True``, the buffers) of same-shaped modules."""
    states = []
    for module in modules:
        state = dict(module.named_parameters())
        if buffers:
            state.update(module.named_buffers())
        states.append(state)
    return stack_states(states)


def unstack(stacked: Mapping[str, Tensor], index: int) -> dict[str, Tensor]:
    """The ``index``-th entry of a stacked dict (views, not copies)."""
    size = num_stacked(stacked)
    if not -size <= index < size:
        raise IndexError(f"Invalid index: {index} (expected an integer in [{-size}, {size}))")
    return {name: tensor[index] for name, tensor in stacked.items()}


def call_stacked(
    module: nn.Module,
    stacked: Mapping[str, Tensor],
    *args: Any,
    per_sample_inputs: bool = False,
    chunk_size: int | None = None,
    randomness: str = "different",
    **kwargs: Any,
) -> Any:
    """Run ``module`` once per stacked entry, all entries in one vmapped call.

    Args:
        module: the model; its own parameters and buffers fill in any name absent from
            ``stacked``. It is not modified.
        stacked: name -> tensor with a leading dimension S (see the module docstring).
        *args: the module's positional inputs.
        per_sample_inputs: False (default): every entry sees the same inputs; True: each
            tensor in ``args`` has a leading dimension S and entry i sees slice i.
        chunk_size: evaluate at most this many entries at a time (bounds activation
            memory); None evaluates all at once.
        randomness: ``torch.func.vmap``'s randomness mode; "different" (default) gives
            each entry its own dropout mask.
        **kwargs: keyword inputs, shared by all entries.

    Returns:
        The module's output with a leading dimension S (for each tensor in the output).
    """
    size = num_stacked(stacked)
    if chunk_size is not None and (isinstance(chunk_size, bool) or chunk_size < 1):
        raise ValueError(f"Invalid chunk_size: {chunk_size!r} (expected None or an integer >= 1)")
    shared = {
        name: tensor
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]
        if name not in stacked
    }
    unknown = set(stacked) - {n for n, _ in module.named_parameters()} - {
        n for n, _ in module.named_buffers()
    }
    if unknown:
        raise KeyError(
            f"Invalid stacked parameters: names {sorted(unknown)} are not parameters or "
            f"buffers of {type(module).__name__}"
        )
    if per_sample_inputs:
        for position, arg in enumerate(args):
            if isinstance(arg, Tensor) and (arg.dim() == 0 or arg.shape[0] != size):
                raise ValueError(
                    f"Invalid input {position}: shape {tuple(arg.shape)} (expected a leading "
                    f"dimension of {size}, one slice per stacked entry, with "
                    "per_sample_inputs=True)"
                )

    def run(entry: dict[str, Tensor], *inputs: Any) -> Any:
        return functional_call(module, (entry, shared), inputs, kwargs, strict=False)

    in_dims = (0, *((0 if isinstance(a, Tensor) else None) if per_sample_inputs else None
                    for a in args))
    return vmap(run, in_dims=in_dims, randomness=randomness, chunk_size=chunk_size)(
        dict(stacked), *args
    )
