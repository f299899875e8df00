"""Building a ParallelEnsemble's members: drawing, checking, selecting and stacking them.

The members are drawn (a module re-initialised, or a factory called, under per-member
seeds), checked to share one layout, and copied one at a time into preallocated
``[K, ...]`` storage; with a ``subset`` only the selected tensors are stacked and the rest
is shared. Under ``torch.distributed`` a rank builds its share of the members only.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..core.streams import derive_seed
from ..names import set_member_dims, set_parameter_layout


def _reset(module: nn.Module) -> None:
    """Draw fresh values for every parameter and buffer, as the module's constructor does.

    Calls ``reset_parameters()`` (or ``nn.MultiheadAttention``'s ``_reset_parameters()``)
    on every submodule that has one, parents first.

    Raises:
        ValueError: a submodule owns parameters but neither it nor an ancestor can reset
            them (so every member would start equal).
    """
    resettable: set[str] = set()
    for prefix, submodule in module.named_modules():
        reset = getattr(submodule, "reset_parameters", None)
        if not callable(reset):
            reset = getattr(submodule, "_reset_parameters", None)
        if callable(reset):
            resettable.add(prefix)
            reset()
            continue
        own = [key for key, value in submodule._parameters.items() if value is not None]
        parts = prefix.split(".") if prefix else []
        ancestors = {".".join(parts[:depth]) for depth in range(len(parts))}
        if own and not ancestors & resettable:
            where = f"submodule {prefix!r}" if prefix else "the module itself"
            raise ValueError(
                f"Invalid module_or_factory: {where} ({type(submodule).__name__}) owns "
                f"parameters {own} but has no reset_parameters() to draw them again for each "
                "member (expected a factory, e.g. lambda: MyNet(), or "
                "ParallelEnsemble.from_modules)"
            )


def _tensors(module: nn.Module) -> dict[str, Tensor]:
    """A module's parameters, then its buffers, by name (tied tensors once)."""
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


def _layout(module: nn.Module) -> dict[str, tuple[Any, ...]]:
    return {
        name: (
            "parameter" if isinstance(tensor, nn.Parameter) else "buffer",
            tuple(tensor.shape),
            tensor.dtype,
            tensor.device,
            tensor.requires_grad,
        )
        for name, tensor in _tensors(module).items()
    }


def _check_same_layout(
    argname: str, index: int, module: Any, first: nn.Module, expected: dict[str, tuple[Any, ...]]
) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"Invalid {argname}: member {index} is a {type(module).__name__} (expected an "
            "nn.Module)"
        )
    if type(module) is not type(first):
        raise ValueError(
            f"Invalid {argname}: member {index} is a {type(module).__name__} (expected a "
            f"{type(first).__name__}, like member 0)"
        )
    layout = _layout(module)
    if list(layout) != list(expected):
        raise ValueError(
            f"Invalid {argname}: member {index} has parameters and buffers "
            f"{sorted(layout)} (expected {sorted(expected)}, like member 0)"
        )
    fields = ("kind", "shape", "dtype", "device", "requires_grad")
    for name, description in layout.items():
        for field, got, want in zip(fields, description, expected[name], strict=True):
            if got != want:
                raise ValueError(
                    f"Invalid {argname}: member {index} has {name!r} with {field} {got} "
                    f"(expected {want}, like member 0)"
                )


@contextlib.contextmanager
def _member_rng(seed: int | None, index: int) -> Iterator[None]:
    """Seed torch's RNG for member ``index`` (and restore it after); nothing when seed is None."""
    if seed is None:
        yield
        return
    with torch.random.fork_rng():
        torch.manual_seed(derive_seed(seed, index))
        yield


def _reset_copies(module: nn.Module, seed: int | None, index: int) -> Iterator[nn.Module]:
    """Member ``index`` on: one working copy of ``module``, re-initialised for each."""
    work = copy.deepcopy(module)  # one working copy, re-initialised for each member
    while True:
        with _member_rng(seed, index):
            _reset(work)
        yield work
        index += 1


def _factory_calls(factory: Callable[[], nn.Module], seed: int | None, index: int) -> Iterator[Any]:
    """Member ``index`` on: ``factory()`` under each member's seed."""
    while True:
        with _member_rng(seed, index):
            member = factory()
        yield member
        index += 1


def _drawn_members(
    module_or_factory: nn.Module | Callable[[], nn.Module],
    seed: int | None,
    subset: Any,
    start: int,
) -> Iterator[Any]:
    """Members ``start``, ``start + 1``, ... as the constructor draws them.

    The module itself each time (with a subset: its values are every member's start),
    re-initialised copies of a module, or the factory's modules, each under its member's
    seed; with ``seed=None`` the members before ``start`` are drawn (and dropped) too, so
    the global RNG gives every rank the same members.
    """
    first_index = 0 if seed is None else start  # seed None: the global RNG's order
    members: Iterator[Any]
    if isinstance(module_or_factory, nn.Module) and subset is not None:
        members = itertools.repeat(module_or_factory)  # the subset's values, K times
    elif isinstance(module_or_factory, nn.Module):
        members = _reset_copies(module_or_factory, seed, first_index)
    else:
        members = _factory_calls(module_or_factory, seed, first_index)
    return itertools.islice(members, start - first_index, None)


#: what ``subset`` must be, for the messages
_SUBSET_EXPECTED = (
    "expected 'trainable', a sequence of parameter or buffer names, or a predicate "
    "subset(name, tensor) -> bool"
)


def _check_subset(subset: Any) -> None:
    """Check what of ``subset`` can be checked without a model: its kind, and not empty.

    Raises:
        ValueError: ``subset`` is not None, "trainable", names or a predicate, or it is an
            empty sequence of names.
    """
    if subset is None or callable(subset):
        return
    if isinstance(subset, str):
        if subset != "trainable":
            raise ValueError(f"Invalid subset: {subset!r} ({_SUBSET_EXPECTED})")
        return
    if not (isinstance(subset, Sequence) and all(isinstance(name, str) for name in subset)):
        raise ValueError(f"Invalid subset: {subset!r} ({_SUBSET_EXPECTED})")
    if not subset:
        raise ValueError(
            f"Invalid subset: {subset!r} (expected at least one parameter or buffer name)"
        )


def _check_module_or_factory(module_or_factory: Any, subset: Any) -> None:
    """Refuse what is neither a module nor a factory, and a subset the module lacks."""
    if not isinstance(module_or_factory, nn.Module) and not callable(module_or_factory):
        raise TypeError(
            f"Invalid module_or_factory: {module_or_factory!r} (expected an nn.Module or "
            "a callable that returns one)"
        )
    if isinstance(module_or_factory, nn.Module) and subset is not None:
        _select(module_or_factory, subset)  # its names, against the module itself


@contextlib.contextmanager
def _global_rng_kept_on_error() -> Iterator[None]:
    """Put torch's global RNG back as it was if the body raises.

    A construction with ``seed=None`` draws its members from the global RNG; one refused
    on what it finds in a member (a layout, a shared tensor, a subset's names) leaves the
    RNG as if it had not been tried. The CPU generator, and the CUDA generators when CUDA
    is already initialised.
    """
    cpu = torch.random.get_rng_state()
    initialised = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]  # unannotated
    cuda = torch.cuda.get_rng_state_all() if initialised else None
    try:
        yield
    except BaseException:
        torch.random.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        raise


def _select(module: nn.Module, subset: Any) -> list[str]:
    """The names ``subset`` picks among ``module``'s parameters and buffers, in their order.

    Raises:
        ValueError: ``subset`` is not "trainable", names or a predicate; a name is unknown;
            nothing is selected.
    """
    tensors = _tensors(module)
    expected = _SUBSET_EXPECTED
    if isinstance(subset, str):
        if subset != "trainable":
            raise ValueError(f"Invalid subset: {subset!r} ({expected})")
        names = [name for name, param in module.named_parameters() if param.requires_grad]
    elif callable(subset):
        names = [name for name, tensor in tensors.items() if subset(name, tensor)]
    elif isinstance(subset, Sequence) and all(isinstance(name, str) for name in subset):
        unknown = sorted(set(subset) - set(tensors))
        if unknown:
            raise ValueError(
                f"Invalid subset: names {unknown} are not parameters or buffers of "
                f"{type(module).__name__} (expected names from named_parameters() or "
                "named_buffers())"
            )
        chosen = set(subset)
        names = [name for name in tensors if name in chosen]
    else:
        raise ValueError(f"Invalid subset: {subset!r} ({expected})")
    if not names:
        raise ValueError(
            f"Invalid subset: {subset!r} selects no parameter or buffer of "
            f"{type(module).__name__} (expected at least one)"
        )
    return names


def _stack_members(
    members: Iterator[nn.Module], num_members: int, argname: str, subset: Any = None
) -> tuple[nn.Module, dict[str, Tensor]]:
    """Copy each member into preallocated ``[K, ...]`` storage, one member alive at a time.

    With ``subset``, only the selected tensors are stacked; every other tensor is the first
    member's, and the other members must hold equal values there (they are shared).

    Returns:
        (the first member, name -> stacked tensor).
    """
    first: nn.Module | None = None
    expected: dict[str, tuple[Any, ...]] = {}
    storage: dict[str, Tensor] = {}
    shared: dict[str, Tensor] = {}
    with torch.no_grad():
        for index in range(num_members):
            member = next(members)
            if first is None:
                if not isinstance(member, nn.Module):
                    raise TypeError(
                        f"Invalid {argname}: it produced a {type(member).__name__} (expected "
                        "an nn.Module)"
                    )
                if any(
                    # exists at runtime; torch's parameter.pyi stub does not declare it
                    isinstance(t, nn.parameter.UninitializedTensorMixin)  # type: ignore[attr-defined]
                    for t in _tensors(member).values()
                ):
                    raise ValueError(
                        f"Invalid {argname}: {type(member).__name__} has uninitialized (lazy) "
                        "parameters (expected a module whose shapes are known: run one "
                        "forward pass first)"
                    )
                first = member
                expected = _layout(member)
                tensors = _tensors(member)
                names = list(tensors) if subset is None else _select(member, subset)
                storage = {
                    name: torch.empty(
                        (num_members, *tensors[name].shape),
                        dtype=tensors[name].dtype,
                        device=tensors[name].device,
                    )
                    for name in names
                }
                shared = {name: t for name, t in tensors.items() if name not in storage}
            elif member is not first:
                _check_same_layout(argname, index, member, first, expected)
                tensors = _tensors(member)
                for name, tensor in shared.items():
                    if not torch.equal(tensors[name], tensor):
                        raise ValueError(
                            f"Invalid {argname}: member {index} has {name!r}, outside the "
                            "subset, different from member 0's (expected the same shared "
                            "values in every member, e.g. a factory that deep-copies one "
                            "base model and adds its own adapters)"
                        )
            tensors = _tensors(member)
            for name in storage:
                storage[name][index].copy_(tensors[name])
    assert first is not None
    return first, storage


def _template(first: nn.Module, storage: Mapping[str, Tensor]) -> nn.Module:
    """A copy of ``first`` whose parameters and buffers are the stacked tensors.

    Tensors not in ``storage`` (outside a subset) are ``first``'s own, shared, not copied.
    """
    memo: dict[int, Any] = {}
    for name, tensor in _tensors(first).items():
        if name not in storage:
            memo[id(tensor)] = tensor
        elif isinstance(tensor, nn.Parameter):
            stacked = nn.Parameter(storage[name], requires_grad=tensor.requires_grad)
            set_member_dims(stacked, 1)  # pooled statistics stay within a member
            memo[id(tensor)] = stacked
        else:
            memo[id(tensor)] = storage[name]
    return copy.deepcopy(first, memo)


def _share(num_members: int, process_group: Any) -> tuple[int, int]:
    """``(first member, count)`` of this rank's share of ``num_members``."""
    if process_group is None:
        return 0, num_members
    distributed = torch.distributed
    if not (distributed.is_available() and distributed.is_initialized()):
        raise ValueError(
            f"Invalid process_group: {process_group!r} (expected a group of an initialised "
            "torch.distributed process group, or None)"
        )
    ranks = distributed.get_world_size(process_group)
    if num_members % ranks:
        raise ValueError(
            f"Invalid num_members: {num_members} (expected a multiple of the process group's "
            f"{ranks} ranks, which share the members equally)"
        )
    count = num_members // ranks
    return distributed.get_rank(process_group) * count, count


def _gather_members(tensor: Tensor, process_group: Any, num_members: int, dim: int) -> Tensor:
    """Every rank's ``tensor`` (its ``num_members`` members along ``dim``), concatenated.

    ``tensor`` itself without a process group. See ``ParallelEnsemble.all_gather``.
    """
    if process_group is None:
        return tensor
    if tensor.dim() <= dim or tensor.shape[dim] != num_members:
        raise ValueError(
            f"Invalid tensor: shape {tuple(tensor.shape)} (expected this rank's "
            f"{num_members} members along dim {dim})"
        )
    distributed = torch.distributed
    tensor = tensor.detach().contiguous()
    parts = [torch.empty_like(tensor) for _ in range(distributed.get_world_size(process_group))]
    distributed.all_gather(parts, tensor, group=process_group)
    return torch.cat(parts, dim=dim)


def _set_member_layouts(params: Iterable[Tensor], start: int, num_members: int) -> None:
    """Mark each stacked parameter as members ``start, ...`` of ``num_members`` in all."""
    for param in params:
        per_member = param[0].numel()
        set_parameter_layout(param, start * per_member, num_members * per_member)


def _unstack_member(
    template: nn.Module, stacked: Mapping[str, Tensor], index: int, *, share_rest: bool
) -> nn.Module:
    """A copy of ``template`` holding member ``index``'s slice of every ``stacked`` tensor.

    The slices are detached copies (a parameter stays a parameter, with its
    ``requires_grad``); with ``share_rest``, the template's other tensors are shared, not
    copied.
    """
    memo: dict[int, Any] = {}
    if share_rest:
        memo.update((id(tensor), tensor) for tensor in _tensors(template).values())
    with torch.no_grad():
        for tensor in stacked.values():
            value = tensor[index].clone()
            if isinstance(tensor, nn.Parameter):
                value = nn.Parameter(value, requires_grad=tensor.requires_grad)
            memo[id(tensor)] = value
    return copy.deepcopy(template, memo)
