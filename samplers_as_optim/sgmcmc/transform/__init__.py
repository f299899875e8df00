r"""What the torchopt transformations of SGLD, SGHMC and SGNHT share, written once.

The counterpart of :mod:`._optimizer` for the functional front end. A sampler module
supplies its state ``NamedTuple`` (buffer fields, then ``seed`` and ``count``), a function
that builds the initial buffers, and a small adapter that calls the sampler's pure kernel;
:func:`sampler_transformation` turns them into a ``torchopt.base.GradientTransformation``.
Everything else lives here: validation (the Optimizer's own, so the messages are the
same word for word), schedules, flattening the updates tree, skipping ``None`` updates,
the refusal of non-finite gradients, drawing the noise, and the final scaling by
``-lr``.

The state holds the chain's whole random state, ``seed`` and the step counter ``count``,
as Python integers next to the buffers (as optax's ``AddNoiseState`` holds a key): the
noise of a leaf at step ``count`` is ``NoiseStream(seed).draw(leaf, step=count,
key=k)`` with the leaf's key ``k`` from :func:`leaf_noise_keys`, the draw an Optimizer
with that seed makes for the same parameter at the same step. So
``update`` is a pure function of ``(updates, state, params)``; nothing lives in a closure
but the hyperparameters.

Rounding. The update returned is ``d.mul(-lr)`` for the kernel's direction ``d``, as
torchopt's ``scale(-lr)`` computes it; ``torchopt.apply_updates`` then adds it. That is
bit for bit what the Optimizers do at temperature > 0 and what ``torchopt.sgd`` does at
temperature 0; ``torch.optim.SGD`` instead adds ``d`` with ``alpha=-lr`` in one fused
multiply-add, which can differ from the two roundings by one unit in the last place.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torchopt import pytree
from torchopt.base import GradientTransformation

from ...core.streams import NoiseStream, parameter_key, seed_from_global_rng
from ...core.validation import check_seed
from .. import fused as fused_module
from ..definition import (
    SamplerDefinition,
    UpdateInput,
    arguments_doc,
    generated_function,
    transform_example_doc,
)
from ..definition.arguments import RETURNS_DOC, pick
from ..definition.momentum_units import MOMENTUM_RATE, rescale_momentum
from ..fused import check_fused, fused_message
from ..fused.transform import fused_update, fused_update_refusal
from ..optimizer import SamplerOptimizer
from ..tensor_lists import buckets, default_foreach, may_be_non_finite, scalar_operand
from .state import PUBLIC_MODULE as PUBLIC_MODULE  # re-exported: langevin_noise
from .state import buffer_names, initial_buffers, state_class

__all__ = [
    "KernelInput",
    "KernelOutput",
    "ScalarOrSchedule",
    "chain_dims",
    "leaf_noise_keys",
    "pick",  # (defined with the shared arguments; the samplers import it there)
    "sampler_transformation",
    "transformation_of",
]

#: A hyperparameter given as a number, or as a schedule: a callable of the step count
#: (a Python int, starting at 0) returning a number, as torchopt's ``ScalarOrSchedule``.
ScalarOrSchedule = float | Tensor | Callable[[int], Any]


@functools.lru_cache(maxsize=64)
def leaf_noise_keys(treespec: Any) -> tuple[int, ...]:
    """The noise key of each leaf of a params tree, the key an Optimizer gives it.

    A leaf whose path holds a string (a dict such as ``dict(model.named_parameters())``
    or a nested one) is keyed by its name, the path joined with dots (``"0.weight"``), as
    an Optimizer given ``named_parameters()`` keys it; a leaf of a list or tuple, or a
    single tensor, by its index among the leaves, as an Optimizer given unnamed
    parameters keys it.
    """
    keys = []
    for index, path in enumerate(pytree.treespec_paths(treespec)):
        named = any(isinstance(part, str) for part in path)
        keys.append(parameter_key(".".join(map(str, path)) if named else index))
    return tuple(keys)


class KernelInput(NamedTuple):
    """The tensors a sampler's kernel adapter receives, restricted to leaves with an update."""

    params: list[Tensor]
    grads: list[Tensor]
    #: one list per buffer field of the state (an empty list for an empty field)
    buffers: tuple[list[Any], ...]
    #: standard-normal noise, one tensor per gradient; None at temperature 0 and when fused
    noise: list[Tensor] | None
    #: when the update is fused: each leaf's noise key (the kernel draws the fused
    #: stream of ``seed``, ``sgmcmc/fused/transform``) and the kernel's results are the
    #: updates themselves, :math:`-lr\,d`; None: unfused
    keys: list[int] | None = None
    #: the chain's seed (read when fused)
    seed: int = 0


#: The result of a kernel adapter: the directions ``d`` and the new buffer fields.
KernelOutput = tuple[list[Tensor], tuple[list[Any], ...]]

#: ``kernel(group, inputs) -> (directions, new_buffers)``. ``group`` holds the
#: hyperparameters, ``lr`` and ``temperature`` resolved to floats at this step, and
#: ``count``, ``inplace`` and ``foreach`` (resolved to a bool).
Kernel = Callable[[dict[str, Any], KernelInput], KernelOutput]

#: ``refusal(group, leaves, functorch) -> reason or None``: why an update cannot be fused
#: (``fused/transform.fused_update_refusal``); ``leaves`` holds ``(where, update, param)``
#: per leaf with an update, ``functorch`` whether they are inside a ``torch.func`` transform.
FusedRefusal = Callable[[Mapping[str, Any], list[tuple[str, Tensor, Tensor]], bool], "str | None"]

#: The hyperparameters a composable part leaves at their neutral value.
_NEUTRAL = {"weight_decay": 0.0, "dampening": 0.0, "nesterov": False, "maximize": False}


def chain_dims(state: Any) -> Any:
    """``in_dims``/``out_dims`` for ``torch.func.vmap`` over a leading chain dimension.

    Maps every tensor of ``state`` (any transformation's state, chains included) to 0 and
    everything else (the ``seed`` and ``count`` integers, shared by all chains) to None.
    It depends only on which leaves are tensors, so the state that ``init`` builds from
    the stacked parameters gives the dims for vmapping ``init`` itself (see
    :mod:`samplers_as_optim.transforms`).
    """
    return pytree.tree_map(
        lambda leaf: 0 if isinstance(leaf, Tensor) else None, state, none_is_leaf=True
    )


def _resolve(value: Any, count: int) -> Any:
    return value(count) if callable(value) else value


def _path_name(path: tuple[Any, ...]) -> str:
    return "".join(f"[{key!r}]" for key in path) or "(the updates tensor)"


def _refuse_non_finite(name: str, updates: Any, leaves: list[Tensor | None], count: int) -> None:
    """Raise FloatingPointError, before anything changes, if an update holds NaN or inf.

    Fast path :func:`may_be_non_finite` (the Optimizers' guard); skipped inside a
    ``torch.func`` transform (vmap, grad), where a value cannot steer Python control flow.
    """
    present = [leaf for leaf in leaves if leaf is not None]
    if _in_functorch(present) or not may_be_non_finite([leaf.detach() for leaf in present]):
        return
    paths, all_leaves, _ = pytree.tree_flatten_with_path(updates, none_is_leaf=True)
    for path, leaf in zip(paths, all_leaves, strict=True):
        if leaf is not None and not bool(torch.isfinite(leaf).all()):
            raise FloatingPointError(
                f"{name} refused step {count + 1}: non-finite gradient in updates"
                f"{_path_name(path)} of shape {tuple(leaf.shape)}; nothing was changed"
            )


#: the leaf dtypes a chain at temperature > 0 refuses (:func:`_refuse_half_precision`)
_HALF_DTYPES = (torch.float16, torch.bfloat16)


def _refuse_half_precision(tree: Any, updates: list[Any], from_updates: bool) -> None:
    r"""Refuse a float16/bfloat16 position at temperature > 0, before anything changes.

    A step moves a leaf by about :math:`\sqrt{2\,lr\,T/N}\,\xi`; in half precision that
    is mostly below half a unit in the last place of the leaf and ``apply_updates``
    rounds it away: the chain freezes without a word (SGLD, ``lr=1e-4``, ``N=1000``, 100
    steps from ones with gradient :math:`\theta - 1`, 100,000 elements: a spread of
    0.00009 in bfloat16 against 0.00443 in float32; float16 gives 0.00481, too wide, and
    freezes at a smaller ``lr``). A transformation has no place for a float32 copy of the
    position (the Optimizers keep one, ``step/half_precision``), so it refuses. ``tree`` is the
    params tree, or the updates where no params were given (``from_updates``): their
    dtype then stands for the parameters'. Only leaves with an update are checked.
    """
    paths, leaves, _ = pytree.tree_flatten_with_path(tree, none_is_leaf=True)
    for path, leaf, update in zip(paths, leaves, updates, strict=True):
        if update is None or not isinstance(leaf, Tensor) or leaf.dtype not in _HALF_DTYPES:
            continue
        remedy = (
            "in half precision a step at temperature > 0 mostly rounds away and the chain "
            "freezes; keep the parameters in float32 (torch.autocast still computes in half "
            "precision), or use the sampler's torch.optim class, which keeps a float32 "
            "master copy of a half-precision parameter"
        )
        where = "".join(f"[{key!r}]" for key in path)
        if from_updates:
            raise TypeError(
                f"Invalid params: None, so updates{where} stands for its "
                f"parameter: a {leaf.dtype} leaf at temperature > 0 (expected float32 or "
                f"float64 leaves: {remedy}; give params=... if the parameters are float32)"
            )
        raise TypeError(
            f"Invalid params: params{where} is a {leaf.dtype} leaf at temperature "
            f"> 0 (expected float32 or float64 leaves: {remedy})"
        )


def _in_functorch(tensors: list[Tensor]) -> bool:
    """Whether ``tensors`` are inside a ``torch.func`` transform (vmap, grad)."""
    return any(torch._C._functorch.is_functorch_wrapped_tensor(tensor) for tensor in tensors)


def _scale_by_neg_lr(
    directions: list[Tensor], updates: list[Tensor], lr: float, *, inplace: bool, foreach: bool
) -> list[Tensor]:
    """``d.mul(-lr)`` per direction, written into ``updates`` when ``inplace``."""
    if inplace:
        for direction, update in zip(directions, updates, strict=True):
            if direction is not update:
                update.copy_(direction)
        if foreach:
            # out of place, then copied: on the CPU torch's in-place foreach multiply
            # rounds a Python scalar to a bfloat16/float16 tensor's dtype first, which
            # the Optimizers' step (``apply_step_``) does not
            for index in buckets(updates):
                bucket = [updates[i] for i in index]
                factor = scalar_operand(-lr, bucket[0])
                torch._foreach_copy_(bucket, torch._foreach_mul(bucket, factor))
        else:
            for update in updates:
                update.mul_(-lr)
        return updates
    if not foreach:
        return [direction.mul(-lr) for direction in directions]
    scaled = list(directions)
    for index in buckets(directions):
        bucket = [directions[i] for i in index]
        products = torch._foreach_mul(bucket, scalar_operand(-lr, bucket[0]))
        for i, out in zip(index, products, strict=True):
            scaled[i] = out
    return scaled


def sampler_transformation(
    arguments: Mapping[str, Any],
    *,
    name: str,
    state_type: type[Any],
    optimizer_class: type[SamplerOptimizer],
    init_buffers: Callable[[list[Tensor | None]], tuple[tuple[Any, ...], ...]],
    kernel: Kernel,
    scale_by_lr: bool = True,
    fused: bool | None = False,
    refusal: FusedRefusal | None = None,
) -> GradientTransformation:
    """Build a sampler's ``GradientTransformation`` around its pure kernel.

    Args:
        arguments: the public factory's arguments (its ``locals()``): the param-group
            hyperparameters, where ``lr`` and ``temperature`` may be schedules, and
            ``seed``. Hyperparameters it lacks take their neutral value (no weight decay,
            dampening, nesterov or maximize).
        name: the public name, for messages (``"transforms.sghmc"``).
        state_type: a NamedTuple whose fields are the buffer fields (each a tuple with
            one entry per leaf of the params tree, or empty), then ``seed`` and ``count``.
        optimizer_class: the matching Optimizer, whose ``check_hyperparameters`` is
            used, so that the messages are the same.
        init_buffers: the initial buffer fields from the list of param leaves.
        kernel: calls the sampler's kernel (see :data:`Kernel`).
        scale_by_lr: return ``-lr * d`` (a sampler) or ``d`` itself (a part to chain
            before a torchopt optimizer, such as the Langevin noise).
        fused: as the Optimizers' ``fused``: None takes the fused path at T > 0 where
            ``refusal`` finds no reason against it (and ``fused.DEFAULT_ON_CUDA``), True
            takes it or raises ``ValueError`` saying why not, False never; fused, the
            kernel adapter is given the leaves' noise keys (``KernelInput.keys``) and
            returns the updates themselves.
        refusal: why an update cannot be fused (:data:`FusedRefusal`); None: never fused.
    """
    group = {**_NEUTRAL, **arguments}
    seed = group.pop("seed")
    validate = optimizer_class.check_hyperparameters
    scheduled = tuple(key for key in ("lr", "temperature") if callable(group[key]))
    validate({**group, **{key: _resolve(group[key], 0) for key in scheduled}}, where="")
    seed = check_seed(seed)
    seed = seed_from_global_rng() if seed is None else seed
    static = {key: float(group[key]) for key in ("lr", "temperature") if key not in scheduled}
    fused = check_fused(fused)
    if fused and refusal is None:
        raise ValueError(fused_message(f"{name} has no fused update"))
    if fused and refusal is not None:
        at_start = {**group, **{key: _resolve(group[key], 0) for key in scheduled}}
        reason = refusal(at_start, [], False)
        if reason is not None:
            raise ValueError(fused_message(reason))
    sampler = _Sampler(
        name=name,
        state_type=state_type,
        group=group,
        seed=seed,
        validate=validate,
        scheduled=scheduled,
        static=static,
        init_buffers=init_buffers,
        kernel=kernel,
        scale_by_lr=scale_by_lr,
        fused=fused,
        refusal=refusal,
    )
    return GradientTransformation(sampler.init, sampler.update)


@dataclasses.dataclass(frozen=True, eq=False)
class _Sampler:
    """:func:`sampler_transformation`'s ``init`` and ``update``, on its Args validated once."""

    name: str
    state_type: type[Any]
    #: the hyperparameters and their neutral values; ``lr`` and ``temperature`` may be schedules
    group: dict[str, Any]
    seed: int
    validate: Callable[..., Any]
    #: which of ``lr`` and ``temperature`` are schedules
    scheduled: tuple[str, ...]
    #: those that are not, as floats
    static: dict[str, float]
    init_buffers: Callable[[list[Tensor | None]], tuple[tuple[Any, ...], ...]]
    kernel: Kernel
    scale_by_lr: bool
    fused: bool | None
    refusal: FusedRefusal | None

    def fused_here(self, updates: Any, leaves: list[Any], params: list[Any], values: Any) -> bool:
        """Whether this update is fused; with ``fused=True``, raise if it cannot be."""
        if (
            self.fused is False
            or self.refusal is None
            or (self.fused is None and not fused_module.DEFAULT_ON_CUDA)
            or (self.fused is None and float(values["temperature"]) == 0)  # torchopt.sgd's own
        ):
            return False
        paths, _, _ = pytree.tree_flatten_with_path(updates, none_is_leaf=True)
        given = [
            (f"updates{_path_name(path)}", leaf, param)
            for path, leaf, param in zip(paths, leaves, params, strict=True)
            if leaf is not None
        ]
        present = [leaf for _, leaf, _ in given]
        reason = self.refusal(values, given, _in_functorch(present))
        if reason is not None and self.fused:
            raise ValueError(fused_message(reason))
        return reason is None

    def hyperparameters_at(self, count: int) -> dict[str, Any]:
        """The hyperparameters at step ``count``: the schedules' values, validated."""
        if not self.scheduled:
            return {**self.group, **self.static}
        values = {**self.group, **{key: _resolve(self.group[key], count) for key in self.scheduled}}
        self.validate(values, where=f" at schedule step {count}")
        return {**values, "lr": float(values["lr"]), "temperature": float(values["temperature"])}

    def init(self, params: Any) -> Any:
        """Torchopt's ``init``: the initial buffers, the chain's seed and a count of 0."""
        leaves = pytree.tree_leaves(params, none_is_leaf=True)
        return self.state_type(*self.init_buffers(leaves), seed=self.seed, count=0)

    def update(
        self, updates: Any, state: Any, *, params: Any = None, inplace: bool = True
    ) -> tuple[Any, Any]:
        """Torchopt's ``update``: refusals first, then the kernel's step (:meth:`step`)."""
        if not isinstance(state, self.state_type):
            raise TypeError(
                f"Invalid state: {type(state).__name__} (expected the "
                f"{self.state_type.__name__} that {self.name}(...).init returns)"
            )
        count = state.count
        values = self.hyperparameters_at(count)
        lr, temperature = values["lr"], values["temperature"]
        leaves, treespec = pytree.tree_flatten(updates, none_is_leaf=True)
        param_leaves = _param_leaves(params, leaves, self.group["weight_decay"])
        if temperature > 0:
            _refuse_half_precision(updates if params is None else params, leaves, params is None)
        _refuse_non_finite(self.name, updates, leaves, count)
        active = [i for i, leaf in enumerate(leaves) if leaf is not None]
        if not active or (temperature > 0 and lr == 0):
            # a step of length zero: no time passes, nothing but the counter changes
            if self.scale_by_lr:
                grads = [leaves[i] for i in active]
                zeros = [grad.zero_() if inplace else torch.zeros_like(grad) for grad in grads]
                leaves = _scatter(leaves, active, zeros)
            return pytree.tree_unflatten(treespec, leaves), state._replace(count=count + 1)
        directions, buffers = self.step(
            updates, state, values, (leaves, treespec), param_leaves, active, inplace=inplace
        )
        return (
            pytree.tree_unflatten(treespec, _scatter(leaves, active, directions)),
            self.state_type(*buffers, seed=state.seed, count=count + 1),
        )

    def step(
        self,
        updates: Any,
        state: Any,
        values: dict[str, Any],
        flat: tuple[list[Any], Any],
        param_leaves: list[Any],
        active: list[int],
        *,
        inplace: bool,
    ) -> tuple[list[Tensor], tuple[Any, ...]]:
        """The kernel on the ``active`` leaves: their updates and the new buffer fields.

        ``flat`` is ``(leaves, treespec)`` of ``updates``; ``values`` the hyperparameters at
        this step (:meth:`hyperparameters_at`).
        """
        (leaves, treespec), count = flat, state.count
        grads = [leaves[i] for i in active]
        # Parameters enter a kernel only through weight decay. As in torchopt, they are
        # detached unless the updates carry a graph (MetaOptimizer), so that no graph grows
        # from step to step inside torchopt.Optimizer.
        params_in = [
            param_leaves[i] if leaves[i].requires_grad else param_leaves[i].detach() for i in active
        ]
        foreach = self.group["foreach"]
        if foreach is None:  # torch.optim's choice, but vmap has no rule for foreach ops
            foreach = default_foreach(grads) and not _in_functorch(grads)
        noise = None
        keys = leaf_noise_keys(treespec)
        fusing = self.fused_here(updates, leaves, param_leaves, values)
        if values["temperature"] > 0 and not fusing:
            noise = NoiseStream(state.seed).standard_normal(
                grads, [keys[i] for i in active], step=count
            )
        fields = state[:-2]
        directions, new_fields = self.kernel(
            {**values, "count": count, "inplace": inplace, "foreach": foreach},
            KernelInput(
                params_in,
                grads,
                tuple([field[i] for i in active] if field else [] for field in fields),
                noise,
                [keys[i] for i in active] if fusing else None,
                state.seed,
            ),
        )
        if fusing:  # the kernel's results are the updates (written into grads if inplace)
            pass
        elif self.scale_by_lr:
            directions = _scale_by_neg_lr(
                directions, grads, values["lr"], inplace=inplace, foreach=foreach
            )
        elif inplace:
            for direction, grad in zip(directions, grads, strict=True):
                if direction is not grad:
                    grad.copy_(direction)
            directions = grads
        buffers = tuple(
            tuple(_scatter(list(field), active, new)) if field else field
            for field, new in zip(fields, new_fields, strict=True)
        )
        return directions, buffers


def _param_leaves(params: Any, leaves: list[Any], weight_decay: float) -> list[Any]:
    """The leaves of ``params``, aligned with the updates' (the updates if params is None)."""
    if params is None:
        if weight_decay != 0:
            raise ValueError(
                f"Invalid params: None (expected the parameters: weight_decay={weight_decay!r} "
                "needs them; call update(updates, state, params=params))"
            )
        return leaves
    param_leaves = pytree.tree_leaves(params, none_is_leaf=True)
    if len(param_leaves) != len(leaves):
        raise ValueError(
            f"Invalid params: {len(param_leaves)} tensors (expected one per update, "
            f"{len(leaves)}, in the tree structure of the updates)"
        )
    return param_leaves


def _scatter(values: list[Any], index: list[int], new: list[Any]) -> list[Any]:
    out = list(values)
    for i, value in zip(index, new, strict=True):
        out[i] = value
    return out


def transformation_of(
    definition: SamplerDefinition, optimizer_class: type[SamplerOptimizer]
) -> tuple[Callable[..., GradientTransformation], type[Any]]:
    """A sampler's transformation factory and state class, built from its definition.

    The state is a NamedTuple named ``<Name>State`` with one field per declared buffer
    (each a tuple with one entry per leaf, or empty where the hyperparameters keep no such
    buffer), ``momentum_lr`` for a sampler whose momentum is kept in SGD units (the rate
    each buffer was written at, a float or None), then ``seed`` and ``count``
    (``transform/state``). The factory has the declared signature (the hyperparameters
    with ``transform=True``) and validates with ``optimizer_class.check_hyperparameters``,
    so that both front ends refuse the same values with the same messages.
    """
    state_type = state_class(definition)
    transform = definition.transform_hyperparameters()
    parameters = [
        (
            h.name,
            h.default_in_transform(),
            h.transform_annotation or h.annotation,
            h.positional if h.transform_positional is None else h.transform_positional,
        )
        for h in transform
    ]
    parameters = [p for p in parameters if p[3]] + [p for p in parameters if not p[3]]
    order = [p[0] for p in parameters]
    entries = [
        (h.transform_doc or h.doc) for h in sorted(transform, key=lambda h: order.index(h.name))
    ]
    doc = definition.transform_doc.format(
        arguments=arguments_doc(entries, RETURNS_DOC),
        example=transform_example_doc(definition.transform_name, definition.example),
    )
    factory = generated_function(
        definition.transform_name,
        parameters,
        functools.partial(_build, definition, optimizer_class, state_type),
        returns="GradientTransformation",
        module=PUBLIC_MODULE,
        doc=doc,
    )
    return factory, state_type


def _build(
    definition: SamplerDefinition,
    optimizer_class: type[SamplerOptimizer],
    state_type: type[Any],
    arguments: dict[str, Any],
) -> GradientTransformation:
    """The transformation that :func:`transformation_of`'s factory builds from its arguments."""
    arguments = dict(arguments)
    fused = arguments.pop("fused")
    name = f"transforms.{definition.transform_name}"
    return sampler_transformation(
        arguments,
        name=name,
        state_type=state_type,
        optimizer_class=optimizer_class,
        init_buffers=functools.partial(initial_buffers, definition, arguments),
        kernel=functools.partial(_definition_kernel, definition, buffer_names(definition)),
        fused=fused,
        refusal=functools.partial(fused_update_refusal, definition, name),
    )


def _definition_kernel(
    definition: SamplerDefinition, names: list[str], group: dict[str, Any], inputs: KernelInput
) -> KernelOutput:
    """The :data:`Kernel` of a sampler's transformation: its definition's update, or fused.

    ``names`` are the state's buffer fields (``state.buffer_names``). The
    momentum in SGD units is first re-expressed at this step's ``lr`` (``momentum_units``);
    the buffer fields the hyperparameters keep no buffer in are empty.
    """
    rated = definition.momentum_in_lr_units
    momentum = definition.momentum_buffer
    given = dict(zip(names, inputs.buffers, strict=True))
    used = definition.state_fields(group)
    rates: list[Any] = given.get(MOMENTUM_RATE, [])
    if rated and given.get(momentum):
        given[momentum], rates = rescale_momentum(
            given[momentum],
            rates,
            **pick(group, "lr", "temperature", "foreach", "inplace"),
        )
    if inputs.keys is not None:  # fused: the kernel gives the updates themselves
        updates, fresh = fused_update(
            definition,
            group,
            inputs.grads,
            inputs.params,
            {name: given[name] for name in used},
            seed=inputs.seed,
            count=group["count"],
            keys=inputs.keys,
            inplace=group["inplace"],
        )
        kept = [list(fresh[state.name]) if state.name in used else [] for state in definition.state]
        return updates, (*kept, *([rates] if rated else []))
    directions, new = definition.update(
        {**group, "initial_state": group["count"] == 0},
        UpdateInput(
            inputs.params, inputs.grads, {name: given[name] for name in used}, inputs.noise
        ),
        foreach=group["foreach"],
        inplace=group["inplace"],
    )
    out = [list(new[state.name]) if state.name in used else [] for state in definition.state]
    return directions, (*out, *([rates] if rated else []))
