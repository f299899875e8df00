r"""One HMC transition as a pure function of tensors, for ``HMC.step(loss_fn=...)``.

``HMC.step(closure)`` moves the parameters in place and lets the closure's ``backward()``
fill ``.grad``: the torch.optim way, but a Python round trip per leapfrog step that
``torch.compile`` cannot fuse (``Tensor.backward`` breaks the graph). Given instead a
*loss function* of the parameters, the whole transition -- potential and kinetic energy at
the start, ``num_steps`` leapfrog steps with gradients from :func:`torch.func.grad`,
the Metropolis test and the selection of the next
state -- is a function of tensors with no Python branch on their values, which
``torch.compile`` turns into one graph (``HMC(..., compile=True)``).

The mathematics is ``hmc_dynamics``', called from here (not copied): the same
:func:`~samplers_as_optim.hmc.dynamics.leapfrog_`, ``potential_energy``,
``scaled_gradients``, ``kinetic_energy``, ``metropolis_test`` and
``transition_diagnostics``. The random numbers (momenta and the
uniform of the test) are drawn by the caller from the chain's counter-based stream and
passed in, so this path and the closure path see the same numbers.

The parameters given to ``loss_fn`` are a dict ``{name: tensor}`` when the optimizer
knows every parameter's name (built from ``model.named_parameters()``), ready for
:func:`torch.func.functional_call`; otherwise a tuple in the optimizer's order.
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..names import parameter_name
from . import dynamics
from .start import Start
from .transition_draws import TransitionDraws

__all__ = [
    "Transition",
    "code_key",
    "compiled_copy",
    "compiled_transition",
    "evaluate_start",
    "frozen_parameters",
    "functional_start",
    "pack_parameters",
    "parameter_names",
    "run_transition",
    "transition",
    "transition_options",
    "value_and_gradients",
]


class Transition(NamedTuple):
    """What one transition returns (per chain: shape ``[]``, or ``[K]`` for K members)."""

    positions: list[Tensor]  #: the chain's next state
    gradients: list[Tensor]  #: the mean loss's gradient there (not N-scaled, no decay)
    loss: Tensor  #: the mean loss there
    diagnostics: dict[str, Tensor]  #: see ``HMC.diagnostics``


#: what autograd and torch.func say of a function that writes in place into its inputs
#: (leaves that require grad) or into a tensor it captured
_LEAF_IN_PLACE = "leaf Variable that requires grad is being used in an in-place operation"
_CAPTURED_IN_PLACE = "mutate a captured Tensor"
_WRITES_ITS_INPUTS = (
    "Invalid loss_fn: it writes in place into the parameters it receives (expected a pure "
    "function of the parameters that leaves them unchanged: out-of-place operations, such as "
    "w * 0.5 rather than w.mul_(0.5) or w.clamp_(...))"
)
_WRITES_CAPTURED = (
    "Invalid loss_fn: it modifies a tensor in place that it does not create, such as a "
    "BatchNorm running statistic in train mode, or a parameter written through its module "
    "(model.weight.mul_(...), .data) instead of the tensors it receives (expected a pure "
    "function of the parameters: give functional_call copies of the buffers, "
    "{**params, **{k: b.clone() for k, b in model.named_buffers()}}, put the model in "
    "eval mode, or use step(closure))"
)


def pack_parameters(names: Sequence[str] | None, tensors: Sequence[Tensor]) -> Any:
    """What ``loss_fn`` receives: ``{name: tensor}`` when named, else a tuple."""
    if names is None:
        return tuple(tensors)
    return dict(zip(names, tensors, strict=True))


def parameter_names(param_groups: Sequence[dict[str, Any]]) -> tuple[str, ...] | None:
    """The parameters' names for ``loss_fn`` (all of them known), else None."""
    names: list[str] = []
    for group in param_groups:
        given = group.get("param_names")
        for position, p in enumerate(group["params"]):
            name = given[position] if given else parameter_name(p)
            if name is None:
                return None
            names.append(name)
    return tuple(names)


def frozen_parameters(param_groups: Sequence[dict[str, Any]]) -> list[Tensor | None] | None:
    """For ``loss_fn``: each parameter, None if it is sampled, itself if it is frozen.

    None when every parameter is sampled (requires grad).
    """
    params = [p for g in param_groups for p in g["params"]]
    if all(p.requires_grad for p in params):
        return None
    return [None if p.requires_grad else p.detach() for p in params]


def evaluate_start(
    loss_fn: Callable[[Any], Any], param_groups: Sequence[dict[str, Any]]
) -> tuple[list[Tensor], Tensor, list[Tensor], int | None]:
    """The start of a functional chain: its parameters, the loss, its gradients, K.

    The chain is the parameters that require grad, as with a closure (whose
    ``backward()`` leaves the others without a gradient); ``loss_fn`` still receives
    every parameter, the frozen ones as constants.
    """
    chain = [p for g in param_groups for p in g["params"] if p.requires_grad]
    if not chain:
        raise ValueError(
            "HMC.step: no parameter requires grad (expected at least one parameter "
            "with requires_grad=True to sample)"
        )
    # copies: a loss_fn writing into what it receives is refused with nothing changed
    positions = [p.detach().clone() for p in chain]
    frozen = frozen_parameters(param_groups)
    fixed = None if frozen is None else [None if c is None else c.clone() for c in frozen]
    names = parameter_names(param_groups)
    loss, grads = value_and_gradients(loss_fn, names, positions, None, fixed=fixed, check=False)
    members = dynamics.members_of(loss, chain, "loss_fn") if loss.dim() == 1 else None
    return chain, loss, grads, members


def functional_start(
    loss_fn: Callable[[Any], Any], param_groups: Sequence[dict[str, Any]]
) -> Start:
    """:func:`evaluate_start` as a :class:`~.start.Start` (no cached energy)."""
    return Start(*evaluate_start(loss_fn, param_groups), None)


def value_and_gradients(
    loss_fn: Callable[[Any], Any],
    names: Sequence[str] | None,
    positions: Sequence[Tensor],
    members: int | None,
    *,
    fixed: Sequence[Tensor | None] | None = None,
    check: bool = True,
) -> tuple[Tensor, list[Tensor]]:
    """The mean loss at ``positions`` and its gradient (of the members' sum, per member).

    ``fixed``: every parameter ``loss_fn`` receives, in order, None where the next of
    ``positions`` goes and a constant (a frozen parameter: not differentiated, not moved)
    elsewhere; None: ``positions`` are all of them. ``check``: that the loss has the shape
    ``members`` implies (off at the start of a chain, where the shape decides ``members``).

    Raises:
        ValueError: ``loss_fn`` returned something other than a scalar, or one loss per
            member (shape ``[K]``) for an ensemble; or it wrote in place into the tensors
            it received, or into one it captured (a parameter written through its module,
            a BatchNorm running statistic). Checked in eager mode only; a compiled chain's
            start is evaluated eagerly, so its first step checks ``loss_fn`` too.
    """

    def total(*tensors: Tensor) -> tuple[Tensor, Tensor]:
        given: Sequence[Tensor] = tensors
        if fixed is not None:
            moving = iter(tensors)
            given = [next(moving) if constant is None else constant for constant in fixed]
        loss = loss_fn(pack_parameters(names, given))
        if not isinstance(loss, Tensor) or loss.dim() > 1:
            shape = tuple(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__
            raise ValueError(
                f"Invalid loss returned by loss_fn: {shape} (expected a tensor: the mean loss, "
                "a scalar, or one per ensemble member, shape [K])"
            )
        return loss.sum(), loss

    gradient = torch.func.grad(total, argnums=tuple(range(len(positions))), has_aux=True)
    if torch.compiler.is_compiling():  # traced: no Python checks in the graph
        grads, loss = gradient(*positions)
    else:
        constants = [c for c in fixed or () if c is not None]
        grads, loss = _without_writes(gradient, positions, constants)
    loss = loss.detach()
    if not check:
        return loss, list(grads)
    if (members is None and loss.dim() != 0) or (members is not None and loss.shape != (members,)):
        raise ValueError(
            f"Invalid loss returned by loss_fn: shape {tuple(loss.shape)} (expected "
            + (
                "a scalar, as at the start of the transition)"
                if members is None
                else f"one loss per ensemble member, shape [{members}])"
            )
        )
    return loss, list(grads)


def _without_writes(
    gradient: Callable[..., tuple[Any, Tensor]],
    positions: Sequence[Tensor],
    constants: Sequence[Tensor],
) -> tuple[Any, Tensor]:
    """``gradient(*positions)``, refusing a ``loss_fn`` that writes into its inputs.

    Autograd refuses an in-place write into a position (a leaf that requires grad) or into
    a captured tensor; one under ``torch.no_grad()`` it lets through, which the tensors'
    version counters show (the positions and the frozen parameters given as constants).
    """
    watched = [*positions, *constants]
    versions = [t._version for t in watched]
    try:
        result = gradient(*positions)
    except RuntimeError as error:
        if _LEAF_IN_PLACE in str(error):
            raise ValueError(_WRITES_ITS_INPUTS) from error
        if _CAPTURED_IN_PLACE in str(error):
            raise ValueError(_WRITES_CAPTURED) from error
        raise
    if any(t._version != version for t, version in zip(watched, versions, strict=True)):
        raise ValueError(_WRITES_ITS_INPUTS)
    return result


def transition(
    loss_fn: Callable[[Any], Any],
    names: Sequence[str] | None,
    positions: Sequence[Tensor],
    gradients: Sequence[Tensor],
    loss: Tensor,
    momenta: Sequence[Tensor],
    uniform: Tensor,
    multiplier: Tensor,
    root_lr: Sequence[float],
    inverse_mass: Sequence[Tensor | None],
    decays: Sequence[float],
    step_size: Tensor,
    num_accepted: Tensor,
    divergences: Tensor,
    fixed: Sequence[Tensor | None] | None = None,
    *,
    num_data: int,
    temperature: float,
    num_steps: int,
    members: int | None,
) -> Transition:
    r"""One HMC transition from ``positions`` (not modified): the next state and the test.

    Args:
        loss_fn: the mean loss of the parameters (see the module docstring).
        names: the parameters' names (``loss_fn`` gets a dict), or None (a tuple).
        positions: :math:`\theta`, the chain's current state.
        gradients: the mean loss's gradient at ``positions``.
        loss: the mean loss at ``positions``.
        momenta: the momentum :math:`r \sim \mathcal N(0, T M)` of this transition.
        uniform: :math:`u` of the Metropolis test, per chain (float64).
        multiplier: the step multiplier :math:`s` per chain (float64).
        root_lr: :math:`\sqrt{lr/N}` per tensor (its param group's).
        inverse_mass: :math:`M^{-1}` per tensor (None: the identity).
        decays: each tensor's weight decay :math:`\lambda`.
        step_size: the step size reported in the diagnostics.
        num_accepted: the running count of acceptances before this transition.
        divergences: the running count of divergences before this transition.
        fixed: the frozen parameters ``loss_fn`` also receives, or None (see
            :func:`value_and_gradients`).
        num_data: N.
        temperature: T.
        num_steps: the number of leapfrog steps.
        members: K for an ensemble (one chain per member), None for one chain.
    """
    decays = list(decays)
    start = list(positions)
    step_sizes = dynamics.tensor_step_sizes(multiplier, root_lr, start, members)
    current = [p.clone() for p in start]
    momenta = [r.clone() for r in momenta]
    potential0 = dynamics.potential_energy(loss, start, decays, num_data, members)
    scaled0 = dynamics.scaled_gradients(start, list(gradients), decays, num_data)
    energy0 = potential0 + dynamics.kinetic_energy(momenta, inverse_mass, members)
    end_loss, raw, energy1 = _trajectory_(
        loss_fn,
        names,
        fixed,
        (current, momenta, scaled0),
        (list(step_sizes), list(inverse_mass), decays),
        num_data=num_data,
        num_steps=num_steps,
        members=members,
    )
    energy_error, log_accept, accepted = dynamics.metropolis_test(
        energy0, energy1, torch.log(uniform), temperature
    )

    def pick(new: Tensor, old: Tensor) -> Tensor:
        return torch.where(dynamics.member_view(accepted, new, members), new, old)

    picked = [pick(new, old) for new, old in zip(current, start, strict=True)]
    picked_gradients = [pick(new, old) for new, old in zip(raw, gradients, strict=True)]
    picked_loss = torch.where(accepted.to(loss.device), end_loss, loss)
    diagnostics = dynamics.transition_diagnostics(
        energy_error, log_accept, accepted, step_size, temperature, num_accepted, divergences
    )
    return Transition(picked, picked_gradients, picked_loss, diagnostics)


def _trajectory_(
    loss_fn: Callable[[Any], Any],
    names: Sequence[str] | None,
    fixed: Sequence[Tensor | None] | None,
    state: tuple[list[Tensor], list[Tensor], list[Tensor]],
    steps: tuple[list[Tensor], list[Tensor | None], list[float]],
    *,
    num_data: int,
    num_steps: int,
    members: int | None,
) -> tuple[Tensor, list[Tensor], Tensor]:
    """The leapfrog trajectory, moving ``state``'s positions and momenta in place.

    ``state``: the positions, momenta and scaled gradient at the start; ``steps``: the
    step sizes, inverse masses and decays (see :func:`transition`). Returns the mean loss
    and its raw gradients at the end (the trajectory's last evaluation), and the energy
    there.
    """
    current, momenta, scaled0 = state
    step_sizes, inverse_mass, decays = steps
    last: dict[str, Any] = {}

    def potential_gradient() -> tuple[None, list[Tensor]]:
        value, raw = value_and_gradients(loss_fn, names, current, members, fixed=fixed)
        last["loss"], last["raw"] = value, raw
        return None, dynamics.scaled_gradients(current, raw, decays, num_data)

    dynamics.leapfrog_(
        current,
        momenta,
        scaled0,
        potential_gradient,
        step_sizes=step_sizes,
        inverse_mass=inverse_mass,
        num_steps=num_steps,
    )
    potential1 = dynamics.potential_energy(last["loss"], current, decays, num_data, members)
    energy1 = potential1 + dynamics.kinetic_energy(momenta, inverse_mass, members)
    return last["loss"], last["raw"], energy1


#: compiled copies of :func:`transition` (and of ``run.chain_chunk``), per loss function's
#: code, per (function, device type)
_COMPILED: weakref.WeakKeyDictionary[Any, dict[tuple[str, str], Callable[..., Any]]] = (
    weakref.WeakKeyDictionary()
)


def compiled_transition(
    loss_fn: Callable[[Any], Any], device: torch.device
) -> Callable[..., Transition]:
    """:func:`transition` through ``torch.compile``, for this ``loss_fn``'s code.

    TorchDynamo keeps one cache of graphs per code object, guarded by what the traced
    code reads: the loss function's code and captured variables among it. Every
    optimizer calling one compiled :func:`transition` with different loss functions would
    share that cache (recompiling as they alternate, up to dynamo's limit, after which it
    falls back to eager; torch 2.13 even crashes explaining some such recompilations). So
    each distinct loss-function code gets its own copy of :func:`transition` (a new code
    object, hence a cache of its own), shared by every optimizer and every closure of
    that code: K chains of one model in a loop compile once. On the CPU the graph's
    wrapper is compiled C++ (inductor's ``cpp_wrapper``: a few microseconds less per
    call, which matters for small models); elsewhere inductor's defaults.
    """
    compiled: Callable[..., Transition] = compiled_copy(transition, loss_fn, device)
    return compiled


def code_key(loss_fn: Callable[[Any], Any]) -> Any:
    """What the compiled copies are cached by: the loss function's code (else its type)."""
    code = getattr(loss_fn, "__code__", None)
    return code if code is not None else type(loss_fn)


def compiled_copy(
    function: Callable[..., Any], loss_fn: Callable[[Any], Any], device: torch.device
) -> Callable[..., Any]:
    """A copy of ``function`` through ``torch.compile`` for this ``loss_fn``'s code and device.

    See :func:`compiled_transition`: one copy (one code object, one dynamo cache) per
    function, loss-function code and device type, made once and shared.
    """
    key = code_key(loss_fn)
    per_device = _COMPILED.get(key)
    if per_device is None:
        per_device = _COMPILED[key] = {}
    compiled = per_device.get((function.__name__, device.type))
    if compiled is None:
        copy = types.FunctionType(
            function.__code__.replace(),
            function.__globals__,
            function.__name__,
            function.__defaults__,
            function.__closure__,
        )
        copy.__kwdefaults__ = function.__kwdefaults__
        options: dict[str, str | int | bool | Callable[..., Any]] = {}
        if device.type == "cpu":
            options["cpp_wrapper"] = True
        compiled = torch.compile(copy, dynamic=False, options=options)
        per_device[(function.__name__, device.type)] = compiled
    return compiled


def run_transition(
    loss_fn: Callable[[Any], Any],
    param_groups: Sequence[dict[str, Any]],
    start: Start,
    draws: TransitionDraws,
) -> Transition:
    """``HMC.step(loss_fn=...)``'s transition from ``start``, with ``draws``' numbers.

    :func:`transition` (through :func:`compiled_transition` when param group 0 says
    ``compile``) on the optimizer's parameters: the chain's values, every parameter's
    name when all are known, the frozen ones as constants; N, T and the number of
    leapfrog steps are param group 0's. Nothing is modified.
    """
    first, chain = param_groups[0], start.chain
    compiled = first.get("compile", False)
    step = compiled_transition(loss_fn, chain[0].device) if compiled else transition
    return step(
        loss_fn,
        parameter_names(param_groups),
        [p.detach() for p in chain],
        start.gradients,
        start.loss,
        draws.momenta,
        draws.uniform,
        draws.multiplier,
        [draws.root_lr[id(p)] for p in chain],
        draws.inverse_mass,
        [draws.decay[id(p)] for p in chain],
        draws.step_size,
        draws.num_accepted,
        draws.divergences,
        frozen_parameters(param_groups),
        **transition_options(param_groups, start.members),
    )


def transition_options(
    param_groups: Sequence[dict[str, Any]], members: int | None
) -> dict[str, Any]:
    """:func:`transition`'s keywords: N, T and the leapfrog steps of param group 0, and K."""
    first = param_groups[0]
    return {
        "num_data": int(first["num_data"]),
        "temperature": float(first["temperature"]),
        "num_steps": int(first["num_steps"]),
        "members": members,
    }
