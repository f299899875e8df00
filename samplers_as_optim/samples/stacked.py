r"""The one layout every method's samples share, and the one way to run a model over them.

A *stacked* set of parameters is a ``dict`` mapping a module's parameter (and buffer)
names, as in ``module.named_parameters()``, to tensors with one extra leading dimension
of size S: ensemble members, collected SGMCMC samples, Laplace or VI draws. Names absent
from the dict keep the module's own values, shared by all S (so a posterior over a
subset of the parameters, LoRA-style, is a smaller dict). Buffers that change with the
weights, such as BatchNorm's running statistics, belong in the dict: each entry is then
evaluated with its own. :func:`stack_modules`, ``SampleCollector`` and
``ParallelEnsemble`` put them there by default; Laplace and VI draws are parameters
around one fitted model, whose buffers are the right ones for all of them.

:func:`call_stacked` runs the module for all S at once with ``torch.func.vmap``, in
chunks of S when asked, so the same code serves a
:class:`~samplers_as_optim.ParallelEnsemble`'s forward and every predictive computation:
there is one vmapped forward in the package.

How the module sees entry i: for the duration of the call, each parameter or buffer
named in the dict is swapped, in the module that owns it, for that entry's slice
(exactly what ``torch.func.functional_call`` does, with the bookkeeping done once per
call instead of once per traced function; tied weights follow their tensor). The
module is restored afterwards, also when the forward raises.

Example:
    >>> import torch
    >>> from samplers_as_optim.samples.stacked import call_stacked, stack_modules
    >>> _ = torch.manual_seed(0)
    >>> members = [torch.nn.Linear(3, 2) for _ in range(4)]
    >>> stacked = stack_modules(members)
    >>> x = torch.randn(5, 3)
    >>> out = call_stacked(members[0], stacked, x)
    >>> out.shape
    torch.Size([4, 5, 2])
    >>> torch.allclose(out[2], members[2](x))
    True
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.func import vmap
from torch.nn.parameter import is_lazy
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from ..core.validation import check_bool, check_choice, check_chunk_size

__all__ = ["call_stacked", "num_stacked", "stack_modules", "stack_states", "unstack"]

RANDOMNESS = ("different", "same", "error")

#: one place a tensor lives in a module: (the owner's ``_parameters`` or ``_buffers``
#: dict, the key in it)
_Table = dict[str, Any]
_Slot = tuple[_Table, str]


def num_stacked(stacked: Mapping[str, Tensor]) -> int:
    """The common leading size S of a stacked dict.

    Args:
        stacked: name -> tensor, each with the same leading dimension.

    Returns:
        S, the size of the leading dimension.

    Raises:
        ValueError: the dict is empty, a tensor is 0-dimensional, or the leading sizes
            differ.

    Example:
        >>> import torch
        >>> num_stacked({"weight": torch.zeros(7, 2, 3), "bias": torch.zeros(7, 2)})
        7
    """
    if not stacked:
        raise ValueError("Invalid stacked parameters: {} (expected at least one tensor)")
    sizes = {name: tensor.shape[0] if tensor.dim() else None for name, tensor in stacked.items()}
    distinct = set(sizes.values())
    if len(distinct) != 1 or None in distinct:
        raise ValueError(
            f"Invalid stacked parameters: leading sizes {sizes} (expected every tensor to "
            "have the same leading sample dimension)"
        )
    return cast(int, distinct.pop())  # None excluded above


def stack_states(states: Sequence[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """Stack equally-keyed dicts of tensors along a new leading dimension.

    Args:
        states: dicts with the same keys, in the same order; tensors under one key share
            a shape.

    Returns:
        name -> tensor ``[len(states), *shape]``: new memory, detached from autograd.

    Raises:
        ValueError: ``states`` is empty or the keys differ.

    Example:
        >>> import torch
        >>> stack_states([{"w": torch.zeros(2)}, {"w": torch.ones(2)}])["w"]
        tensor([[0., 0.],
                [1., 1.]])
    """
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


def stack_modules(modules: Sequence[nn.Module], *, buffers: bool = True) -> dict[str, Tensor]:
    """Stack the parameters and the buffers of same-shaped modules.

    Args:
        modules: modules of one architecture.
        buffers: also stack the buffers (default: True, so that each entry is evaluated
            with its own BatchNorm statistics; False: the parameters only, and every
            entry uses the buffers of the module given to :func:`call_stacked`).

    Returns:
        The stacked dict (see :func:`stack_states`), keyed as ``named_parameters()``
        and ``named_buffers()``.

    Example:
        >>> import torch
        >>> stacked = stack_modules([torch.nn.Linear(3, 2) for _ in range(5)])
        >>> {name: tuple(tensor.shape) for name, tensor in stacked.items()}
        {'weight': (5, 2, 3), 'bias': (5, 2)}
    """
    states = []
    for module in modules:
        state: dict[str, Tensor] = dict(module.named_parameters())
        if buffers:
            state.update(module.named_buffers())
        states.append(state)
    return stack_states(states)


def unstack(stacked: Mapping[str, Tensor], index: int) -> dict[str, Tensor]:
    """The ``index``-th entry of a stacked dict (views, not copies).

    Args:
        stacked: name -> tensor with a leading dimension S.
        index: an integer in [-S, S).

    Returns:
        name -> ``stacked[name][index]``.

    Raises:
        IndexError: ``index`` is out of range.

    Example:
        >>> import torch
        >>> unstack({"w": torch.arange(6.0).reshape(3, 2)}, -1)
        {'w': tensor([4., 5.])}
    """
    size = num_stacked(stacked)
    if isinstance(index, bool) or not isinstance(index, int) or not -size <= index < size:
        raise IndexError(f"Invalid index: {index!r} (expected an integer in [{-size}, {size}))")
    return {name: tensor[index] for name, tensor in stacked.items()}


def _tensor_slots(module: nn.Module) -> dict[str, tuple[Tensor, list[_Slot]]]:
    """Every parameter and buffer name of ``module``, tied names included.

    Returns:
        name -> (the tensor, every slot holding that tensor). Two tied names map to the
        same tensor and the same slots, so swapping through either name swaps both.
    """
    slots_by_tensor: dict[int, list[_Slot]] = {}
    named: dict[str, Tensor] = {}
    for prefix, owner in module.named_modules(remove_duplicate=False):
        for table in (owner._parameters, owner._buffers):
            for key, tensor in table.items():
                if tensor is None:
                    continue
                name = f"{prefix}.{key}" if prefix else key
                named[name] = tensor
                slots = slots_by_tensor.setdefault(id(tensor), [])
                if not any(existing is table and k == key for existing, k in slots):
                    slots.append((table, key))
    return {name: (tensor, slots_by_tensor[id(tensor)]) for name, tensor in named.items()}


def bind_stacked(module: nn.Module, stacked: Mapping[str, Tensor]) -> list[tuple[_Table, str, str]]:
    """Where each stacked name goes in ``module``: a list of (table, key, name).

    Raises:
        KeyError: a name is not a parameter or buffer of ``module``.
        ValueError: two names given are tied (the same tensor), which is ambiguous; a
            tensor is not ``[S, *shape]`` with the module's own shape (see
            :func:`_check_shapes`).
    """
    names = list(stacked)
    slots = _tensor_slots(module)
    unknown = [name for name in names if name not in slots]
    if unknown:
        raise KeyError(
            f"Invalid stacked parameters: names {sorted(unknown)} are not parameters or "
            f"buffers of {type(module).__name__}"
        )
    _check_shapes(module, stacked, slots)
    bound: list[tuple[_Table, str, str]] = []
    seen: dict[int, str] = {}
    for name in names:
        tensor, tensor_slots = slots[name]
        if id(tensor) in seen:
            raise ValueError(
                f"Invalid stacked parameters: names {seen[id(tensor)]!r} and {name!r} are the "
                f"same (tied) tensor of {type(module).__name__} (expected one of them)"
            )
        seen[id(tensor)] = name
        bound.extend((table, key, name) for table, key in tensor_slots)
    return bound


def _check_shapes(
    module: nn.Module,
    stacked: Mapping[str, Tensor],
    slots: Mapping[str, tuple[Tensor, list[_Slot]]],
) -> None:
    """Refuse a stacked tensor that is not ``[S, *shape]`` of the module's own shape.

    Samples of another model would otherwise reach the forward (torch's "mat1 and mat2
    shapes cannot be multiplied") or, when every tensor is swapped, run the other
    architecture silently. A tensor shaped exactly like the module's own passes: a
    ``ParallelEnsemble``'s ``module`` holds stacked tensors, and ``ensemble.stacked()``
    is shaped like them; otherwise it lacks its sample dimension, which the forward's
    failure reports (:func:`_explain_missing_sample_dimension`). Uninitialised (lazy)
    tensors have no shape yet and are not checked. One comparison of sizes per name.
    """
    wrong: list[str] = []
    for name, tensor in stacked.items():
        own = slots[name][0]
        if is_lazy(own):
            continue
        if tensor.shape[1:] != own.shape and tensor.shape != own.shape:
            wrong.append(name)
    if not wrong:
        return
    name, own = wrong[0], slots[wrong[0]][0]
    also = "; also mismatched: " + ", ".join(map(repr, wrong[1:3])) if wrong[1:] else ""
    if len(wrong) > 3:
        also += f" and {len(wrong) - 3} more"
    raise ValueError(
        f"Invalid stacked parameters: {name!r} has shape {tuple(stacked[name].shape)} "
        f"(expected [S{''.join(f', {size}' for size in own.shape)}]: S samples of "
        f"{type(module).__name__}'s {name!r}, of shape {tuple(own.shape)}{also})"
    )


def bind_all_tensors(module: nn.Module) -> tuple[dict[str, Tensor], list[tuple[_Table, str, str]]]:
    """Every tensor of ``module`` and where it goes, in one traversal (the ensemble's case).

    Returns:
        (name -> tensor, one name per tensor: the first, as ``named_parameters()`` gives it;
        the bound slots, as :func:`bind_stacked` gives them for those names).
    """
    tensors: dict[str, Tensor] = {}
    canonical: dict[int, str] = {}
    bound: list[tuple[_Table, str, str]] = []
    seen_slots: set[tuple[int, str]] = set()
    for prefix, owner in module.named_modules(remove_duplicate=False):
        for table in (owner._parameters, owner._buffers):
            for key, tensor in table.items():
                if tensor is None or (id(table), key) in seen_slots:
                    continue
                seen_slots.add((id(table), key))
                name = canonical.get(id(tensor))
                if name is None:
                    name = f"{prefix}.{key}" if prefix else key
                    canonical[id(tensor)] = name
                    tensors[name] = tensor
                bound.append((table, key, name))
    return tensors, bound


def _in_dims(args: Sequence[Any], per_sample_inputs: bool) -> tuple[Any, ...]:
    """The ``in_dims`` of the inputs: 0 on every tensor leaf when per sample, else None."""
    if not per_sample_inputs:
        return tuple(None for _ in args)
    return tuple(
        tree_map(lambda leaf: 0 if isinstance(leaf, Tensor) else None, arg) for arg in args
    )


def check_per_sample_inputs(args: Sequence[Any], size: int) -> None:
    for position, arg in enumerate(args):
        for leaf in tree_flatten(arg)[0]:
            if isinstance(leaf, Tensor) and (leaf.dim() == 0 or leaf.shape[0] != size):
                raise ValueError(
                    f"Invalid input {position}: shape {tuple(leaf.shape)} (expected a leading "
                    f"dimension of {size}, one slice per stacked entry, with "
                    "per_sample_inputs=True)"
                )


def _call_bound(
    module: nn.Module,
    bound: Sequence[tuple[_Table, str, str]],
    tensor: Callable[[str], Tensor],
    inputs: Sequence[Any],
    kwargs: dict[str, Any],
) -> Any:
    """``module(*inputs, **kwargs)`` with every bound slot holding ``tensor(name)``.

    The slots get their own tensors back afterwards, also when the module raises.
    """
    saved = [table[key] for table, key, _ in bound]
    try:
        for table, key, name in bound:
            table[key] = tensor(name)
        return module(*inputs, **kwargs)
    finally:
        for (table, key, _), original in zip(bound, saved, strict=True):
            table[key] = original


def vmapped_call(
    module: nn.Module,
    bound: Sequence[tuple[_Table, str, str]],
    stacked: dict[str, Tensor],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    per_sample_inputs: bool,
    chunk_size: int | None,
    randomness: str,
) -> Any:
    """The package's one vmapped forward (arguments already checked)."""

    def run(entry: dict[str, Tensor], *inputs: Any) -> Any:
        return _call_bound(module, bound, entry.__getitem__, inputs, kwargs)

    in_dims = (0, *_in_dims(args, per_sample_inputs))
    batched: Callable[..., Any] = vmap(
        run, in_dims=in_dims, randomness=randomness, chunk_size=chunk_size
    )
    return batched(stacked, *args)


def looped_call(
    module: nn.Module,
    bound: Sequence[tuple[_Table, str, str]],
    stacked: dict[str, Tensor],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    per_sample_inputs: bool,
    randomness: str,
) -> Any:
    """What :func:`vmapped_call` computes, one entry after another (no ``vmap``).

    For models ``torch.func.vmap`` cannot trace (data-dependent control flow on a batched
    tensor, ``.item()``, in-place ops on unbatched tensors, ...). Entry i runs the module
    with every bound tensor swapped for ``stacked[name][i]`` (a view: autograd and in-place
    buffer updates reach the stacked tensor) and the outputs are stacked leaf by leaf;
    non-tensor leaves are entry 0's. Random draws: one after another from torch's
    generators ("different"), or from the same generator state for every entry ("same");
    "error" cannot be enforced without vmap and behaves as "different".
    """
    size = num_stacked(stacked)
    same = randomness == "same"
    cuda = sorted(
        {tensor.device.index or 0 for tensor in stacked.values() if tensor.device.type == "cuda"}
    )
    states = None
    if same:
        states = (torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in cuda])
    results: list[Any] = []
    for index in range(size):
        if states is not None:  # every entry draws from the same generator state
            torch.set_rng_state(states[0])
            for device, state in zip(cuda, states[1], strict=True):
                torch.cuda.set_rng_state(state, device)
        inputs = args
        if per_sample_inputs:
            inputs = tuple(
                tree_map(lambda v, i=index: v[i] if isinstance(v, Tensor) else v, arg)
                for arg in args
            )

        def entry(name: str, index: int = index) -> Tensor:
            return stacked[name][index]  # a view: autograd and in-place updates reach it

        results.append(_call_bound(module, bound, entry, inputs, kwargs))
    leaves, spec = tree_flatten(results[0])
    columns = [tree_flatten(result)[0] for result in results]
    stacked_leaves = [
        torch.stack([column[position] for column in columns]) if isinstance(leaf, Tensor) else leaf
        for position, leaf in enumerate(leaves)
    ]
    return tree_unflatten(stacked_leaves, spec)


def vmapped_else_looped(
    module: nn.Module,
    stacked: Mapping[str, Tensor],
    vmapped: Callable[[], Any],
    looped: Callable[[], Any],
) -> tuple[Any, Exception | None]:
    """``vmapped()``; where it raises, ``looped()`` with the buffers put back first.

    For a forward that falls back to :func:`looped_call` where vmap cannot trace the model
    (``ParallelEnsemble``'s ``backend="auto"``): the buffers among ``stacked`` are kept
    first, in case the failed attempt updated some (BatchNorm statistics) before vmap gave
    up. Returns the outputs and the vmapped call's error (None if it worked); an error of
    ``looped()`` propagates (a model that fails there too has a bug of its own).
    """
    parameters = {name for name, _ in module.named_parameters()}
    with torch.no_grad():
        kept = {n: t.clone() for n, t in stacked.items() if n not in parameters}
    try:
        return vmapped(), None
    except Exception as error:
        with torch.no_grad():
            for name, value in kept.items():
                stacked[name].copy_(value)
        return looped(), error


def call_stacked(
    module: nn.Module,
    stacked: Mapping[str, Tensor],
    *args: Any,
    per_sample_inputs: bool = False,
    chunk_size: int | None = None,
    randomness: str = "different",
    **kwargs: Any,
) -> Any:
    r"""Run ``module`` once per stacked entry, all entries in one vmapped call.

    Entry i computes ``module(*args, **kwargs)`` with the parameters and buffers named in
    ``stacked`` replaced by ``stacked[name][i]``; every other parameter and buffer keeps
    the module's own value, shared by all entries. Autograd flows into ``stacked``; buffers
    that the forward updates in place (BatchNorm's running statistics in train mode) are
    updated in their stacked tensor, entry by entry, so stack them when the module trains,
    and predict in eval mode (in train mode, collected samples' statistics would change).

    Args:
        module: the model; it is not modified (its tensors are swapped back afterwards).
        stacked: name -> tensor with a leading dimension S (see the module docstring).
        *args: the module's positional inputs (tensors or pytrees of tensors).
        per_sample_inputs: False (default): every entry sees the same inputs; True: each
            tensor in ``args`` has a leading dimension S and entry i sees slice i.
        chunk_size: evaluate at most this many entries at a time, so activation memory
            stays bounded by ``chunk_size`` entries (default: None, all S at once). The
            result is the same.
        randomness: ``torch.func.vmap``'s randomness mode (default: "different", each
            entry draws its own dropout mask; "same": one mask for all; "error").
        **kwargs: keyword inputs, shared by all entries.

    Returns:
        The module's output with a leading dimension S (on every tensor of the output).

    Raises:
        TypeError: ``module`` is not an ``nn.Module``.
        KeyError: a name in ``stacked`` is not a parameter or buffer of ``module``.
        ValueError: inconsistent leading sizes, tied names given twice, a tensor that is
            not ``[S, *shape]`` with the shape of the module's own (samples of another
            model; the message names the first such tensor, its shape and the one
            expected), a bad ``chunk_size`` or ``randomness``, or (with
            ``per_sample_inputs``) an input whose leading dimension is not S.

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh())
        >>> samples = {"0.weight": torch.randn(10, 4, 3)}  # the bias stays shared
        >>> call_stacked(model, samples, torch.randn(6, 3), chunk_size=4).shape
        torch.Size([10, 6, 4])
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"Invalid module: {module!r} (expected an nn.Module)")
    size = num_stacked(stacked)
    chunk_size = check_chunk_size(chunk_size)
    check_choice("randomness", randomness, RANDOMNESS)
    check_bool("per_sample_inputs", per_sample_inputs)
    bound = bind_stacked(module, stacked)
    if per_sample_inputs:
        check_per_sample_inputs(args, size)
    try:
        return vmapped_call(
            module,
            bound,
            dict(stacked),
            args,
            kwargs,
            per_sample_inputs=per_sample_inputs,
            chunk_size=chunk_size,
            randomness=randomness,
        )
    except RuntimeError as error:
        _explain_missing_sample_dimension(module, stacked, size, error)
        raise


def _explain_missing_sample_dimension(
    module: nn.Module, stacked: Mapping[str, Tensor], size: int, error: RuntimeError
) -> None:
    """After the model failed: raise a clear error if an entry lacks its sample dimension.

    An entry shaped exactly like the module's own tensor was read as ``size`` samples of
    its trailing shape, the likeliest cause. (Such an entry is not refused up front: a
    ``ParallelEnsemble``'s ``module`` holds stacked tensors, and ``ensemble.stacked()``
    is then shaped like them, correctly.)
    """
    slots = _tensor_slots(module)
    for name, tensor in stacked.items():
        own = slots[name][0]
        if tensor.shape == own.shape:
            raise ValueError(
                f"Invalid stacked parameters: {name!r} has shape {tuple(tensor.shape)}, the "
                f"shape of the module's own tensor, so it was read as {size} samples of shape "
                f"{tuple(tensor.shape[1:])} and the model failed (expected [S, "
                f"{', '.join(map(str, own.shape))}]: add the sample dimension, e.g. "
                "tensor.unsqueeze(0) for one sample)"
            ) from error
