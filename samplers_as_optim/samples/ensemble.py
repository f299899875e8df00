r"""A deep ensemble as one module: K members stacked, run in one vmapped call.

:class:`ParallelEnsemble` holds K copies of a model's parameters and buffers stacked
along a leading dimension and runs all members through
:func:`~samplers_as_optim.samples.stacked.call_stacked` (one ``torch.func.vmap``). Any optimizer
over ``ensemble.parameters()`` then trains every member at once: ``torch.optim.SGD`` gives
a deep ensemble (Lakshminarayanan et al., 2017), :class:`~samplers_as_optim.SGHMC` gives
parallel SGMCMC, the "Bayesian deep ensemble" of the posteriors paper, Section 4.2: K
independent chains whose final states are K (asymptotically) exact posterior samples.

The loss convention. Train on the sum over members of each member's usual mean loss,

.. math::

    \mathcal L(\theta_1, \dots, \theta_K) = \sum_{k=1}^K L_k(\theta_k), \qquad
    \nabla_{\theta_k} \mathcal L = \nabla L_k(\theta_k),

so member k's gradient is exactly what a single model would get: it does not depend on
K, and ``SGHMC(ensemble.parameters(), num_data=N)`` applies to every member the update of
a single SGHMC chain on N training examples (``num_data`` is the training-set size, not
K N). Averaging over members instead would divide every gradient by K, silently changing
the learning rate and, for a sampler, the temperature. :func:`ensemble_loss` (and the
method :meth:`ParallelEnsemble.loss`) applies a loss per member and sums, so this is the
easy thing to write. The samplers draw noise element by element, so with a stacked
parameter the members' noise is independent.

Data. Deep ensembles and parallel chains usually see the data in a different order per
member: pass one batch per member, ``ensemble(x, per_member_inputs=True)`` with ``x`` of
shape ``[K, B, ...]`` (e.g. ``x_train[perms[:, i:i + B]]`` for K permutations), and
``per_member_targets=True`` to the loss.

Exactness. Member k computes what its own model would, with vmap's batched kernels:
outputs and gradients equal a separately run model to rounding, and bit for bit where
the batched matmul rounds like the single one (on the CPU builds tested, for the MLPs in
the tests and benchmarks, 20 steps of SGD match K separately trained models exactly).

Memory. One vmapped call holds all K members' activations at once, where a loop over K
models holds one member's; for activation-heavy models :meth:`ParallelEnsemble.backward`
runs forward and backward a chunk of members at a time.

A subset of the parameters. ``ParallelEnsemble(model, K, subset="trainable")`` stacks
only the parameters that require grad (a PEFT model's LoRA adapters, or any names or
predicate) and shares the rest, unbatched, between the members: memory is the frozen base
once plus K times the adapters, and the layers before the first adapter run once for all
members. This is the posteriors paper's Bayesian LoRA (Section 5.3: a 10-member SGHMC
ensemble over a language model's last attention layer). Models that ``torch.func.vmap``
cannot trace run as a loop over the members with the same API and results
(``backend="auto"``, announced once).

Example:
    >>> import torch
    >>> import torch.nn.functional as F
    >>> from samplers_as_optim import SGHMC
    >>> from samplers_as_optim.samples.ensemble import ParallelEnsemble
    >>> _ = torch.manual_seed(0)
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    >>> ensemble = ParallelEnsemble(net, num_members=5, seed=0)
    >>> optimizer = SGHMC(ensemble.parameters(), lr=1e-2, num_data=100, seed=0)
    >>> x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    >>> outputs = ensemble(x)  # [5, 16, 3]: every member sees the same batch
    >>> loss = ensemble.loss(F.cross_entropy, outputs, y)  # sum of the members' mean losses
    >>> optimizer.zero_grad()
    >>> loss.backward()
    >>> optimizer.step()
    >>> ensemble.member(2)(x).shape  # an ordinary nn.Module
    torch.Size([16, 3])
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import vmap
from torch.utils._pytree import tree_flatten, tree_map

from ..core.streams import derive_seed
from ..core.validation import (
    check_bool,
    check_choice,
    check_chunk_size,
    check_positive_int,
    check_seed,
)
from ..names import set_parameter_layout
from .stacked import (
    RANDOMNESS,
    bind_all_tensors,
    bind_stacked,
    check_per_sample_inputs,
    looped_call,
    vmapped_call,
)

#: how the members are run: "auto" (vmap, falling back to a loop), "vmap" or "loop"
BACKENDS = ("auto", "vmap", "loop")

#: what ``subset`` accepts: "trainable", names, or a predicate on (name, tensor)
Subset = str | Sequence[str] | Callable[[str, Tensor], bool]

__all__ = ["ParallelEnsemble", "ensemble_loss"]


def ensemble_loss(
    loss_fn: Callable[[Any, Any], Tensor],
    outputs: Any,
    targets: Any,
    *,
    per_member_targets: bool = False,
) -> Tensor:
    r"""The sum over members of each member's mean loss: :math:`\sum_k L(o_k, y_k)`.

    ``loss_fn`` is applied to each member's outputs separately (with ``torch.func.vmap``,
    so any loss written for one model works), then the K scalars are summed. Member k's
    gradient is then the gradient a single model would get, bit for bit (see the module
    docstring). For torch's unweighted cross-entropy or NLL with shared class-index
    targets the K B examples go through ``loss_fn`` at once instead (faster, the same
    gradients bit for bit; the value may differ in the last bit).

    Args:
        loss_fn: ``loss_fn(outputs_k, targets_k)`` returns member k's loss as a scalar,
            usually a mean over the batch (``F.cross_entropy``, ``nn.MSELoss()``, ...).
        outputs: the ensemble's outputs, a tensor (or pytree of tensors) with leading
            dimension K.
        targets: shared by all members (default), e.g. ``[B]`` class labels; or, with
            ``per_member_targets=True``, one set per member with leading dimension K.
        per_member_targets: whether ``targets`` carries a leading member dimension
            (default: False).

    Returns:
        A scalar tensor: the sum of the K members' losses.

    Raises:
        ValueError: ``outputs`` (or per-member ``targets``) lack a common leading
            dimension, or ``loss_fn`` does not return a scalar per member.

    Example:
        >>> import torch
        >>> import torch.nn.functional as F
        >>> outputs = torch.zeros(3, 4, 2)  # K = 3 members, B = 4, two classes
        >>> ensemble_loss(F.cross_entropy, outputs, torch.tensor([0, 1, 1, 0]))
        tensor(2.0794)
    """
    check_bool("per_member_targets", per_member_targets)
    size = _leading_size("outputs", outputs)
    if per_member_targets:
        target_size = _leading_size("targets", targets)
        if target_size != size:
            raise ValueError(
                f"Invalid targets: leading dimension {target_size} (expected {size}, one set "
                "of targets per member, with per_member_targets=True)"
            )

    def member_loss(member_outputs: Any, member_targets: Any) -> Tensor:
        value = loss_fn(member_outputs, member_targets)
        if not isinstance(value, Tensor) or value.dim() != 0:
            shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
            raise ValueError(
                f"Invalid loss_fn: it returned {shape} per member (expected a scalar tensor, "
                "the member's mean loss: use reduction='mean')"
            )
        return value

    if not per_member_targets and _is_plain_class_nll(loss_fn, outputs, targets):
        # Fast path, same gradients bit for bit: with shared class-index targets, torch's
        # mean over all K*B examples is divided by K*B, and K * (g / (K*B)) rounds exactly
        # as g / B does, so each member's gradient is the one a single model gets.
        size = outputs.shape[0]
        flat_targets = targets.expand(size, *targets.shape).reshape(-1, *targets.shape[1:])
        return cast(Tensor, loss_fn(outputs.flatten(0, 1), flat_targets) * size)
    in_dims = (0, 0 if per_member_targets else None)
    return vmap(member_loss, in_dims=in_dims)(outputs, targets).sum()


def _is_plain_class_nll(loss_fn: Any, outputs: Any, targets: Any) -> bool:
    """Whether ``loss_fn`` is torch's unweighted mean cross-entropy or NLL on class indices."""
    if loss_fn is F.cross_entropy or loss_fn is F.nll_loss:
        pass
    elif type(loss_fn) in (nn.CrossEntropyLoss, nn.NLLLoss):
        if loss_fn.weight is not None or loss_fn.reduction != "mean":
            return False
        if getattr(loss_fn, "label_smoothing", 0.0) != 0.0:
            return False
    else:
        return False
    return (
        isinstance(outputs, Tensor)
        and isinstance(targets, Tensor)
        and outputs.dim() >= 3
        and not targets.is_floating_point()
        and targets.dim() == outputs.dim() - 2
    )


def _leading_size(name: str, value: Any) -> int:
    leaves = [leaf for leaf in tree_flatten(value)[0] if isinstance(leaf, Tensor)]
    sizes = {tuple(leaf.shape[:1]) for leaf in leaves}
    if not leaves or len(sizes) != 1 or () in sizes:
        shapes = [tuple(leaf.shape) for leaf in leaves]
        raise ValueError(
            f"Invalid {name}: shapes {shapes} (expected tensors with a common leading "
            "member dimension)"
        )
    return sizes.pop()[0]


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
            memo[id(tensor)] = nn.Parameter(storage[name], requires_grad=tensor.requires_grad)
        else:
            memo[id(tensor)] = storage[name]
    return copy.deepcopy(first, memo)


class ParallelEnsemble(nn.Module):
    r"""K models with stacked parameters, trained and run in parallel by one vmapped call.

    The members' parameters and buffers live in ``ensemble.module``, a copy of the model
    whose every tensor has a leading member dimension K (``ensemble.module[0].weight`` has
    shape ``[K, out, in]``); ``named_parameters()``, ``state_dict()`` and optimizers see
    these ``[K, ...]`` tensors. The forward swaps each member's slice into the model inside
    ``torch.func.vmap`` (:func:`~samplers_as_optim.samples.stacked.call_stacked`), so any model
    that runs under ``vmap`` works: dropout draws a different mask per member
    (``randomness="different"``), and BatchNorm in train mode updates each member's own
    running statistics.

    Members are initialised independently: with a factory, ``factory()`` is called K times;
    with a module, K copies of it are re-initialised with each submodule's
    ``reset_parameters()`` (its own values are not used; to start from given weights, use
    :meth:`from_modules`). With ``seed=None`` the draws come from torch's global RNG in
    member order, exactly as ``[factory() for _ in range(K)]`` would make them; with an
    integer seed, member k is drawn under its own seed derived from ``(seed, k)`` and the
    global RNG is left untouched. Every argument is checked before the factory is first
    called; a construction refused on what only a member shows (its layout, a subset's
    names) puts the global RNG back as it was.

    Train on :meth:`loss` (the sum over members of each member's mean loss): with
    ``torch.optim.SGD`` this is a deep ensemble, with ``SGHMC(num_data=N)`` parallel SGHMC
    (see the module docstring for why the sum is the right convention).

    Args:
        module_or_factory: an ``nn.Module`` to re-initialise K times, or a callable that
            returns a new module of one architecture each time it is called.
        num_members: K, the number of members (an integer >= 1).
        seed: None (default: torch's global RNG) or an integer in [0, 2**64) that makes
            the initialisation reproducible on its own.
        chunk_size: run at most this many members at a time in the forward (default:
            None, all at once); bounds activation memory for prediction at the cost of
            speed. The results are the same.
        randomness: ``torch.func.vmap``'s randomness mode (default: "different": each
            member draws its own dropout mask; "same"; "error").
        process_group: None (default: every member here), or a ``torch.distributed``
            process group of R ranks (``torch.distributed.group.WORLD`` for all) over
            which the K members are split: this rank holds members
            ``member_indices`` (K/R of them, consecutive; K must be a multiple of R), and
            ``num_members`` is that share. Member i is initialised as member i of the
            whole ensemble, and a sampler draws its noise as for the whole stacked tensor,
            so the chains do not depend on R; :meth:`all_gather` collects what each rank
            computed for its members (predictions, samples) for the model average and the
            diagnostics. With ``seed=None`` every rank draws all K initialisations in
            order from its global RNG (give every rank the same ``torch.manual_seed``)
            and keeps its share; with an integer seed it draws only its own.
        subset: None (default: every parameter and buffer is stacked), or which tensors
            to stack: ``"trainable"`` (the parameters that require grad: a PEFT model's
            LoRA adapters), a sequence of names from ``named_parameters()`` /
            ``named_buffers()``, or a predicate ``subset(name, tensor) -> bool``. Every
            other tensor is shared by all members, not copied: it is passed to the
            vmapped forward unbatched, so memory is the base once plus K times the subset,
            and layers that touch no stacked tensor run once for all members. A module
            given with a subset is not re-initialised: every member starts from its
            values of the subset (K equal starts; SGHMC's noise separates them), and its
            other tensors are shared with it (the module itself is not modified). A factory
            is called K times, under the member seeds as without a subset (e.g. ``lambda:
            get_peft_model(copy.deepcopy(base), config)`` draws each member's adapters),
            and must give equal values outside the subset. Shared parameters that require
            grad receive the sum of the members' gradients: freeze them unless you mean
            to train a shared trunk.
        backend: how the members run: ``"auto"`` (default) one ``torch.func.vmap`` call,
            and where vmap cannot trace the model (data-dependent control flow on a
            member's values, ``.item()``, ...) a loop over the members, announced once by
            a ``RuntimeWarning``; ``"vmap"`` (never the loop: vmap's errors propagate); or
            ``"loop"`` (always the loop). The loop computes what vmap does, member by
            member, with the same API: outputs and gradients equal to rounding (vmap's
            batched kernels may round the last bit differently), in-place buffer updates
            reach each member's slice, dropout draws one member after another.

    Example:
        >>> import torch
        >>> _ = torch.manual_seed(0)
        >>> factory = lambda: torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
        >>> ensemble = ParallelEnsemble(factory, 6)
        >>> ensemble.module[0].weight.shape
        torch.Size([6, 4, 3])
        >>> ensemble(torch.randn(10, 3)).shape  # a batch shared by all members
        torch.Size([6, 10, 4])
        >>> ensemble(torch.randn(6, 10, 3), per_member_inputs=True).shape  # one per member
        torch.Size([6, 10, 4])
        >>> ensemble.module[1].num_batches_tracked  # each member's BatchNorm statistics
        tensor([2, 2, 2, 2, 2, 2])
    """

    def __init__(
        self,
        module_or_factory: nn.Module | Callable[[], nn.Module],
        num_members: int,
        *,
        seed: int | None = None,
        chunk_size: int | None = None,
        randomness: str = "different",
        process_group: Any = None,
        subset: Subset | None = None,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        # every argument first: nothing is built and the global RNG is not touched for a
        # construction that is refused
        num_members = check_positive_int("num_members", num_members)
        seed = check_seed(seed)
        check_chunk_size(chunk_size)
        check_choice("randomness", randomness, RANDOMNESS)
        check_choice("backend", backend, BACKENDS)
        _check_subset(subset)
        if not isinstance(module_or_factory, nn.Module) and not callable(module_or_factory):
            raise TypeError(
                f"Invalid module_or_factory: {module_or_factory!r} (expected an nn.Module or "
                "a callable that returns one)"
            )
        if isinstance(module_or_factory, nn.Module) and subset is not None:
            _select(module_or_factory, subset)  # its names, against the module itself
        start, count = _share(num_members, process_group)
        first_index = 0 if seed is None else start  # seed None: the global RNG's order
        members: Iterator[Any]
        if isinstance(module_or_factory, nn.Module) and subset is not None:
            members = itertools.repeat(module_or_factory)  # the subset's values, K times
        elif isinstance(module_or_factory, nn.Module):
            members = self._reset_copies(module_or_factory, seed, first_index)
        else:
            members = self._factory_calls(module_or_factory, seed, first_index)
        members = itertools.islice(members, start - first_index, None)
        with _global_rng_kept_on_error():
            first, storage = _stack_members(members, count, "module_or_factory", subset)
        self._setup(_template(first, storage), count, chunk_size, randomness, storage, backend)
        self.process_group = process_group
        self.member_indices = list(range(start, start + count))
        if process_group is not None:
            for param in self.stacked(buffers=False).values():
                per_member = param[0].numel()
                set_parameter_layout(param, start * per_member, num_members * per_member)

    @staticmethod
    def _reset_copies(module: nn.Module, seed: int | None, index: int) -> Iterator[nn.Module]:
        work = copy.deepcopy(module)  # one working copy, re-initialised for each member
        while True:
            with _member_rng(seed, index):
                _reset(work)
            yield work
            index += 1

    @staticmethod
    def _factory_calls(
        factory: Callable[[], nn.Module], seed: int | None, index: int
    ) -> Iterator[Any]:
        while True:
            with _member_rng(seed, index):
                member = factory()
            yield member
            index += 1

    def _setup(
        self,
        template: nn.Module,
        num_members: int,
        chunk_size: Any,
        randomness: Any,
        storage: Mapping[str, Tensor],
        backend: str,
    ) -> None:
        self.module = template
        self.num_members = num_members
        self.process_group = None  # typed Any by __init__'s assignment
        self.member_indices = list(range(num_members))
        self.chunk_size = check_chunk_size(chunk_size)
        self.randomness = check_choice("randomness", randomness, RANDOMNESS)
        self.backend = check_choice("backend", backend, BACKENDS)
        every = list(_tensors(template))
        #: the stacked names, or None when every parameter and buffer is stacked
        self.subset: list[str] | None = None if list(storage) == every else list(storage)
        #: whether the vmapped forward has worked (None: not tried yet), for "auto"
        self._vmap_works: bool | None = None

    @classmethod
    def from_modules(
        cls,
        modules: Sequence[nn.Module],
        *,
        chunk_size: int | None = None,
        randomness: str = "different",
        subset: Subset | None = None,
        backend: str = "auto",
    ) -> ParallelEnsemble:
        r"""An ensemble whose members start as copies of given (e.g. trained) modules.

        Args:
            modules: K modules of one class and architecture (same parameter and buffer
                names, shapes, dtypes and devices). They are copied, not modified; passing
                one module K times gives K identical members.
            chunk_size: as in the constructor.
            randomness: as in the constructor.
            subset: as in the constructor: only these tensors are stacked; the others
                must be equal in every module, and member 0's are shared (not copied).
            backend: as in the constructor.

        Returns:
            The ensemble; member k equals ``modules[k]``.

        Raises:
            ValueError: ``modules`` is empty, its entries differ in class or layout, or
                (with ``subset``) in a shared tensor.
            TypeError: an entry is not an ``nn.Module``.

        Example:
            >>> import torch
            >>> models = [torch.nn.Linear(2, 1) for _ in range(3)]
            >>> ensemble = ParallelEnsemble.from_modules(models)
            >>> torch.equal(ensemble.member(1).weight, models[1].weight)
            True
        """
        if isinstance(modules, nn.Module) or not isinstance(modules, Sequence) or not modules:
            raise ValueError(
                f"Invalid modules: {modules!r} (expected a non-empty sequence of nn.Modules)"
            )
        check_chunk_size(chunk_size)
        check_choice("randomness", randomness, RANDOMNESS)
        check_choice("backend", backend, BACKENDS)
        _check_subset(subset)
        ensemble = cls.__new__(cls)
        nn.Module.__init__(ensemble)
        first, storage = _stack_members(iter(modules), len(modules), "modules", subset)
        template = _template(first, storage)
        ensemble._setup(template, len(modules), chunk_size, randomness, storage, backend)
        return ensemble

    # ------------------------------------------------------------------ the stacked layout
    def stacked(self, *, buffers: bool = True) -> dict[str, Tensor]:
        """The members' parameters (and buffers) by the model's own names, each ``[K, ...]``.

        These are the ensemble's tensors themselves (not copies): the layout every method's
        samples share, ready for :func:`~samplers_as_optim.samples.stacked.call_stacked` with the
        original model, or with ``ensemble.member(0)``. With a ``subset``, only its
        tensors (the others are shared by every member).

        Args:
            buffers: include the buffers (default: True).

        Returns:
            name -> tensor with leading dimension K.
        """
        check_bool("buffers", buffers)
        tensors: dict[str, Tensor] = dict(self.module.named_parameters())
        if buffers:
            tensors.update(self.module.named_buffers())
        if self.subset is not None:
            tensors = {name: tensors[name] for name in self.subset if name in tensors}
        return tensors

    def _binding(self) -> tuple[dict[str, Tensor], list[tuple[dict[str, Any], str, str]]]:
        """The stacked tensors by name, and the module slots they are swapped into."""
        if self.subset is None:
            return bind_all_tensors(self.module)
        stacked = self.stacked()
        return stacked, bind_stacked(self.module, stacked)

    def _run(
        self,
        bound: list[tuple[dict[str, Any], str, str]],
        stacked: dict[str, Tensor],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        per_member_inputs: bool,
        chunk_size: int | None,
    ) -> Any:
        """The members' outputs: one vmapped call, or a loop over members (see ``backend``)."""
        loop = self.backend == "loop" or (self.backend == "auto" and self._vmap_works is False)
        if loop:
            return looped_call(
                self.module,
                bound,
                stacked,
                args,
                kwargs,
                per_sample_inputs=per_member_inputs,
                randomness=self.randomness,
            )
        vmapped: dict[str, Any] = dict(
            per_sample_inputs=per_member_inputs, randomness=self.randomness
        )
        if self.backend == "vmap" or self._vmap_works:
            return vmapped_call(
                self.module, bound, stacked, args, kwargs, chunk_size=chunk_size, **vmapped
            )
        # The first call under "auto": keep the buffers, in case a failed attempt updated
        # some (BatchNorm statistics) before vmap gave up.
        parameters = {name for name, _ in self.module.named_parameters()}
        with torch.no_grad():
            kept = {n: t.clone() for n, t in stacked.items() if n not in parameters}
        try:
            outputs = vmapped_call(
                self.module, bound, stacked, args, kwargs, chunk_size=chunk_size, **vmapped
            )
        except Exception as error:
            with torch.no_grad():
                for name, value in kept.items():
                    stacked[name].copy_(value)
            outputs = looped_call(
                self.module,
                bound,
                stacked,
                args,
                kwargs,
                per_sample_inputs=per_member_inputs,
                randomness=self.randomness,
            )  # a model that fails here too has a bug of its own: that error propagates
            self._vmap_works = False
            reason = str(error).strip().splitlines()[0] if str(error).strip() else ""
            warnings.warn(
                f"ParallelEnsemble: torch.func.vmap cannot run {type(self.module).__name__} "
                f"({type(error).__name__}: {reason[:200]}); running its "
                f"{self.num_members} members one after another instead, with the same "
                "results, more slowly (pass backend='loop' to skip the attempt, or "
                "backend='vmap' to see the error)",
                RuntimeWarning,
                stacklevel=3,
            )
            return outputs
        self._vmap_works = True
        return outputs

    def member(self, index: int) -> nn.Module:
        """Member ``index`` as an ordinary module (a copy of its current values).

        Args:
            index: an integer in [-K, K).

        Returns:
            A new module of the model's class holding member ``index``'s parameters and
            buffers (detached copies; ``requires_grad`` and the train/eval mode as here).
            With a ``subset``, the tensors outside it are the ensemble's own, shared (the
            frozen base is not copied).

        Raises:
            IndexError: ``index`` is out of range.
        """
        size = self.num_members
        if isinstance(index, bool) or not isinstance(index, int) or not -size <= index < size:
            raise IndexError(f"Invalid index: {index!r} (expected an integer in [{-size}, {size}))")
        memo: dict[int, Any] = {}
        if self.subset is not None:  # the tensors outside the subset are shared
            memo.update((id(tensor), tensor) for tensor in _tensors(self.module).values())
        with torch.no_grad():
            for tensor in self.stacked().values():
                value = tensor[index].clone()
                if isinstance(tensor, nn.Parameter):
                    value = nn.Parameter(value, requires_grad=tensor.requires_grad)
                memo[id(tensor)] = value
        return copy.deepcopy(self.module, memo)

    def members(self) -> list[nn.Module]:
        """All members as ordinary modules (see :meth:`member`)."""
        return [self.member(index) for index in range(self.num_members)]

    # ------------------------------------------------------------------ forward and loss
    def forward(self, *args: Any, per_member_inputs: bool = False, **kwargs: Any) -> Any:
        """Run every member on the inputs, in one vmapped call.

        Args:
            *args: the model's positional inputs, shared by all members (``[B, ...]``), or
                with ``per_member_inputs=True`` one batch per member (``[K, B, ...]``).
            per_member_inputs: whether each tensor in ``args`` has a leading member
                dimension (default: False).
            **kwargs: keyword inputs, shared by all members.

        Returns:
            The model's output with a leading member dimension K.

        Raises:
            ValueError: ``per_member_inputs=True`` and an input's leading dimension is not K.
        """
        check_bool("per_member_inputs", per_member_inputs)
        stacked, bound = self._binding()
        if per_member_inputs:
            check_per_sample_inputs(args, self.num_members)
        return self._run(
            bound,
            stacked,
            args,
            kwargs,
            per_member_inputs=per_member_inputs,
            chunk_size=self.chunk_size,
        )

    def loss(
        self,
        loss_fn: Callable[[Any, Any], Tensor],
        outputs: Any,
        targets: Any,
        *,
        per_member_targets: bool = False,
    ) -> Tensor:
        """The training loss: the sum over members of each member's mean loss.

        See :func:`ensemble_loss`; this method also checks that ``outputs`` has K members.

        Args:
            loss_fn: ``loss_fn(outputs_k, targets_k)`` -> member k's scalar mean loss.
            outputs: this ensemble's outputs, leading dimension K.
            targets: shared by all members, or one set per member (leading dimension K)
                with ``per_member_targets=True``.
            per_member_targets: whether ``targets`` has a leading member dimension.

        Returns:
            A scalar tensor.
        """
        size = _leading_size("outputs", outputs)
        if size != self.num_members:
            raise ValueError(
                f"Invalid outputs: leading dimension {size} (expected {self.num_members}, "
                "one output per member)"
            )
        return ensemble_loss(loss_fn, outputs, targets, per_member_targets=per_member_targets)

    def backward(
        self,
        loss_fn: Callable[[Any, Any], Tensor],
        *args: Any,
        targets: Any,
        chunk_size: int | None = None,
        per_member_inputs: bool = False,
        per_member_targets: bool = False,
        **kwargs: Any,
    ) -> Tensor:
        """Forward, loss and backward, at most ``chunk_size`` members at a time.

        Accumulates into every parameter's ``.grad`` the gradients of
        ``self.loss(loss_fn, self(*args), targets)``, exactly as calling ``.backward()``
        on that loss would, but runs the members in chunks, each chunk's forward followed
        at once by its backward: only one chunk's activations are alive at a time, so
        training memory is the parameters, their gradients and ``chunk_size`` members'
        activations (the whole ensemble's activations with a plain ``.backward()``).
        Smaller chunks cost speed (one vmapped call per chunk). Dropout masks are drawn
        per chunk, so with dropout the result differs from the unchunked run as any
        other draw would.

        Args:
            loss_fn: as for :meth:`loss`.
            *args: the model's inputs, as for :meth:`forward`.
            targets: as for :meth:`loss` (keyword-only).
            chunk_size: members per chunk (default: None, all at once).
            per_member_inputs: as for :meth:`forward`.
            per_member_targets: as for :meth:`loss`.
            **kwargs: keyword inputs of the model, shared by all members.

        Returns:
            The loss (detached): the sum over members of each member's mean loss.

        Example:
            >>> import torch
            >>> import torch.nn.functional as F
            >>> ensemble = ParallelEnsemble(lambda: torch.nn.Linear(3, 2), 4, seed=0)
            >>> optimizer = torch.optim.SGD(ensemble.parameters(), lr=0.1)
            >>> x, y = torch.randn(5, 3), torch.tensor([0, 1, 1, 0, 1])
            >>> optimizer.zero_grad()
            >>> loss = ensemble.backward(F.cross_entropy, x, targets=y, chunk_size=2)
            >>> optimizer.step()
        """
        chunk_size = check_chunk_size(chunk_size)
        check_bool("per_member_inputs", per_member_inputs)
        check_bool("per_member_targets", per_member_targets)
        size = self.num_members
        if per_member_inputs:
            check_per_sample_inputs(args, size)
        if per_member_targets and _leading_size("targets", targets) != size:
            raise ValueError(
                f"Invalid targets: leading dimension {_leading_size('targets', targets)} "
                f"(expected {size}, one set of targets per member, with "
                "per_member_targets=True)"
            )
        if chunk_size is None or chunk_size >= size:
            outputs = self(*args, per_member_inputs=per_member_inputs, **kwargs)
            loss = ensemble_loss(loss_fn, outputs, targets, per_member_targets=per_member_targets)
            loss.backward()  # type: ignore[no-untyped-call]  # unannotated in torch
            return loss.detach()
        stacked, bound = self._binding()
        for tensor in stacked.values():
            if tensor.requires_grad and tensor.grad is None:
                tensor.grad = torch.zeros_like(tensor)
        step = chunk_size
        total = None
        for start in range(0, size, step):
            stop = min(start + step, size)
            entry = {}
            for name, tensor in stacked.items():
                # A leaf view of the chunk whose .grad is a view of the stacked .grad:
                # autograd accumulates into it in place, so no full-size gradient is ever
                # materialised for a chunk.
                view = tensor.detach()[start:stop]
                if tensor.requires_grad:
                    view.requires_grad_()
                    view.grad = cast(Tensor, tensor.grad)[start:stop]  # zero-filled above
                entry[name] = view

            def part(value: Any, flag: bool, start: int = start, stop: int = stop) -> Any:
                if not flag:
                    return value
                return tree_map(lambda v: v[start:stop] if isinstance(v, Tensor) else v, value)

            outputs = self._run(
                bound,
                entry,
                tuple(part(arg, per_member_inputs) for arg in args),
                kwargs,
                per_member_inputs=per_member_inputs,
                chunk_size=None,
            )
            loss = ensemble_loss(
                loss_fn,
                outputs,
                part(targets, per_member_targets),
                per_member_targets=per_member_targets,
            )
            loss.backward()  # type: ignore[no-untyped-call]  # unannotated in torch
            total = loss.detach() if total is None else total + loss.detach()
        assert total is not None
        return total

    def all_gather(self, tensor: Tensor, *, dim: int = 0) -> Tensor:
        """Concatenate every rank's ``tensor`` along its member dimension, in member order.

        ``tensor`` holds this rank's members along ``dim``: the ensemble's predictions
        ``[K/R, B, ...]`` (``dim=0``), or a ``SampleCollector``'s samples of it
        ``[S, K/R, ...]`` (``dim=1``). Every rank of the process group must call it; the
        result, on every rank, is what one process holding all K members would have.
        Without a process group it returns ``tensor`` itself.

        Raises:
            ValueError: ``tensor``'s size along ``dim`` is not this rank's member count.
        """
        if self.process_group is None:
            return tensor
        if tensor.dim() <= dim or tensor.shape[dim] != self.num_members:
            raise ValueError(
                f"Invalid tensor: shape {tuple(tensor.shape)} (expected this rank's "
                f"{self.num_members} members along dim {dim})"
            )
        distributed = torch.distributed
        tensor = tensor.detach().contiguous()
        parts = [
            torch.empty_like(tensor) for _ in range(distributed.get_world_size(self.process_group))
        ]
        distributed.all_gather(parts, tensor, group=self.process_group)
        return torch.cat(parts, dim=dim)

    def extra_repr(self) -> str:
        """The number of members (and the forward's settings when not the default)."""
        text = f"num_members={self.num_members}"
        if self.chunk_size is not None:
            text += f", chunk_size={self.chunk_size}"
        if self.randomness != "different":
            text += f", randomness={self.randomness!r}"
        if self.subset is not None:
            text += f", subset=<{len(self.subset)} tensors>"
        if self.backend != "auto":
            text += f", backend={self.backend!r}"
        return text


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
