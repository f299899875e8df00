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

import functools
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import Tensor, nn

from ..core.validation import (
    check_bool,
    check_choice,
    check_chunk_size,
    check_positive_int,
    check_seed,
)
from ._ensemble_loss import (
    backward_in_chunks,
    check_member_size,
    ensemble_loss,
)
from ._ensemble_members import (
    _check_module_or_factory,
    _check_subset,
    _drawn_members,
    _gather_members,
    _global_rng_kept_on_error,
    _set_member_layouts,
    _share,
    _stack_members,
    _template,
    _tensors,
    _unstack_member,
)
from .stacked import (
    RANDOMNESS,
    bind_all_tensors,
    bind_stacked,
    check_per_sample_inputs,
    looped_call,
    vmapped_call,
    vmapped_else_looped,
)

#: how the members are run: "auto" (vmap, falling back to a loop), "vmap" or "loop"
BACKENDS = ("auto", "vmap", "loop")

#: what ``subset`` accepts: "trainable", names, or a predicate on (name, tensor)
Subset = str | Sequence[str] | Callable[[str, Tensor], bool]

__all__ = ["ParallelEnsemble", "ensemble_loss"]


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
        _check_module_or_factory(module_or_factory, subset)
        start, count = _share(num_members, process_group)
        members = _drawn_members(module_or_factory, seed, subset, start)
        with _global_rng_kept_on_error():
            first, storage = _stack_members(members, count, "module_or_factory", subset)
        self._setup(_template(first, storage), count, chunk_size, randomness, storage, backend)
        self.process_group = process_group
        self.member_indices = list(range(start, start + count))
        if process_group is not None:
            _set_member_layouts(self.stacked(buffers=False).values(), start, num_members)

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
        common: dict[str, Any] = dict(
            per_sample_inputs=per_member_inputs, randomness=self.randomness
        )

        def loop() -> Any:
            return looped_call(self.module, bound, stacked, args, kwargs, **common)

        def vmapped() -> Any:
            return vmapped_call(
                self.module, bound, stacked, args, kwargs, chunk_size=chunk_size, **common
            )

        if self.backend == "loop" or (self.backend == "auto" and self._vmap_works is False):
            return loop()
        if self.backend == "vmap" or self._vmap_works:
            return vmapped()
        # The first call under "auto": vmap, else the loop (whose own error propagates).
        outputs, error = vmapped_else_looped(self.module, stacked, vmapped, loop)
        self._vmap_works = error is None
        if error is not None:
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
        shared = self.subset is not None  # the tensors outside the subset are shared
        return _unstack_member(self.module, self.stacked(), index, share_rest=shared)

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
            loss_fn: ``loss_fn(outputs_k, targets_k)`` -> member k's scalar mean loss; or
                a loss module with parameters of its own, stacked per member: a
                ``ParallelEnsemble`` of it. For regression with a sampled noise scale,
                ``noise = ParallelEnsemble(GaussianLikelihood(num_data=N), K)``, an
                optimizer over ``[*ensemble.parameters(), *noise.parameters()]`` and
                ``ensemble.loss(noise, ensemble(x), y)``: member k's loss uses member
                k's σ, and its gradients are a single model's.
            outputs: this ensemble's outputs, leading dimension K.
            targets: shared by all members, or one set per member (leading dimension K)
                with ``per_member_targets=True``.
            per_member_targets: whether ``targets`` has a leading member dimension.

        Returns:
            A scalar tensor.

        Raises:
            ValueError: ``outputs`` without K members, or a loss module whose tensors are
                not stacked over K members.
        """
        check_member_size("outputs", outputs, self.num_members)
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
        if per_member_targets:
            check_member_size("targets", targets, size)
        if chunk_size is None or chunk_size >= size:
            outputs = self(*args, per_member_inputs=per_member_inputs, **kwargs)
            loss = ensemble_loss(loss_fn, outputs, targets, per_member_targets=per_member_targets)
            loss.backward()  # type: ignore[no-untyped-call]  # unannotated in torch
            return loss.detach()
        stacked, bound = self._binding()
        run = functools.partial(  # run(entry, inputs): the members in entry, unchunked
            self._run, bound, kwargs=kwargs, per_member_inputs=per_member_inputs, chunk_size=None
        )
        return backward_in_chunks(
            run,
            stacked,
            loss_fn,
            args,
            targets,
            size=size,
            chunk_size=chunk_size,
            per_member_inputs=per_member_inputs,
            per_member_targets=per_member_targets,
        )

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
        return _gather_members(tensor, self.process_group, self.num_members, dim)

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
