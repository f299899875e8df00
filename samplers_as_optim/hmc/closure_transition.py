r"""HMC's transition by closure: the torch.optim way, in place.

``HMC.step(closure)``: the closure zeroes the gradients, computes the full-batch mean
loss, calls ``backward()`` and returns the loss, as for ``torch.optim.LBFGS``. The
trajectory moves the parameters in place and calls the closure once per leapfrog step to
fill their ``.grad``; the Metropolis test then keeps the end point or puts the start back
(per member for an ensemble), leaving each parameter's ``.grad`` the gradient of the mean
loss at the chain's new state. The mathematics is :mod:`~samplers_as_optim.hmc.dynamics`'
(the same functions as the compiled way, ``step(loss_fn=...)``); the random numbers come
from the caller.
"""

from __future__ import annotations

import math
import reprlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from .dynamics import (
    StepSize,
    gradient_map,
    kinetic_energy,
    leapfrog_,
    member_view,
    members_of,
    metropolis_test,
    potential_energy,
    scaled_gradients,
    tensor_step_sizes,
    transition_diagnostics,
)
from .start import Energy, Start
from .transition_draws import TransitionDraws

__all__ = [
    "NOT_COMPILED",
    "closure_loss",
    "closure_start",
    "closure_step_sizes",
    "closure_trajectory",
    "closure_transition",
    "evaluate_closure",
    "potential",
    "reevaluate_closure",
]

#: the warning of ``HMC(compile=True).step(closure)``
NOT_COMPILED = (
    "HMC(compile=True) compiles step(loss_fn=...) only: step(closure) runs eagerly "
    "(Tensor.backward() breaks a compiled graph); give step a loss function of the "
    "parameters to compile the transition"
)
#: the largest finite value of each dtype met so far (``torch.finfo`` costs a call per step)
_LARGEST: dict[torch.dtype, float] = {}


def closure_loss(value: Any) -> Tensor:
    """What the closure returned, as a detached tensor (a number or array: float64)."""
    if isinstance(value, Tensor):
        return value.detach()
    if value is not None and not isinstance(value, (bool, str, bytes)):
        try:
            return torch.as_tensor(value, dtype=torch.float64)
        except (TypeError, ValueError, RuntimeError):
            pass
    raise TypeError(
        f"Invalid loss returned by the closure: {reprlib.repr(value)} (expected the full-batch "
        "mean loss, a tensor: a scalar, or one loss per ensemble member, shape [K]; the "
        "closure must end with `return loss`)"
    )


def _in_range(step: float, dtype: torch.dtype) -> float:
    """A float leapfrog step, infinite where it overflows ``dtype``.

    Torch refuses an ``alpha`` beyond the tensor's dtype, while a tensor step rounds to
    infinity there; either way the trajectory diverges and the proposal is rejected, which
    a float step now does too (``lr`` itself is checked to fit, see
    ``HMC._check_representable``: only an adapted multiplier can get this far).
    """
    largest = _LARGEST.get(dtype)
    if largest is None:
        largest = _LARGEST[dtype] = float(torch.finfo(dtype).max)
    return step if abs(step) <= largest else math.copysign(math.inf, step)


def closure_step_sizes(
    multiplier: Tensor, root_lr: Sequence[float], chain: Sequence[Tensor], members: int | None
) -> list[StepSize]:
    r"""The leapfrog step :math:`\epsilon = s\sqrt{lr/N}` of each parameter of ``chain``.

    Python floats for one chain (updates with ``alpha``), tensors per member for an
    ensemble (see :func:`~samplers_as_optim.hmc.dynamics.tensor_step_sizes`).
    """
    if members is None:
        scale = float(multiplier)
        return [_in_range(scale * r, p.dtype) for r, p in zip(root_lr, chain, strict=True)]
    return list(tensor_step_sizes(multiplier, list(root_lr), list(chain), members))


def evaluate_closure(
    closure: Callable[[], Any],
    params: Sequence[Tensor],
    chain: list[Tensor] | None,
    members: int | None,
) -> tuple[list[Tensor], Tensor, list[Tensor], int | None]:
    """Call the closure; return the chain's parameters, the loss, the raw gradients.

    ``params``: every parameter of the optimizer, in order. ``chain`` None: the start of a
    transition, which decides the chain (the parameters with a gradient after the
    closure, and ``members`` from the loss's shape); otherwise the loss must have the
    start's shape.
    """
    with torch.enable_grad():
        loss = closure_loss(closure())
    if chain is None:
        wrong = loss.dim() > 1
        expected = "a scalar, or one loss per ensemble member, shape [K])"
    elif members is None:
        wrong = loss.dim() != 0
        expected = "a scalar, as at the start of the transition)"
    else:
        wrong = loss.shape != (members,)
        expected = f"one loss per ensemble member, shape [{members}], as at the start)"
    if wrong:
        raise ValueError(
            f"Invalid loss returned by the closure: shape {tuple(loss.shape)} (expected " + expected
        )
    if chain is None:
        chain = [p for p in params if p.grad is not None]
        if not chain:
            raise ValueError(
                "HMC.step: no parameter has a gradient after the closure (expected the "
                "closure to call backward())"
            )
        if loss.dim() == 1:
            members = members_of(loss, chain, "the closure")
    grads = []
    for p in chain:
        if p.grad is None:
            raise ValueError(
                f"HMC.step: a parameter of shape {tuple(p.shape)} had a gradient at the "
                "start of the transition but has none now (expected the same closure, "
                "differentiating the same parameters, at every evaluation)"
            )
        if p.grad.is_sparse:
            raise TypeError(f"HMC does not support sparse gradients (shape {tuple(p.shape)})")
        grads.append(p.grad)
    return chain, loss, grads, members


def closure_start(closure: Callable[[], Any], params: Sequence[Tensor]) -> Start:
    """The start of a transition by closure: the closure's chain, loss and gradients (copies)."""
    chain, loss, fresh, members = evaluate_closure(closure, params, None, None)
    return Start(chain, loss, [g.clone() for g in fresh], members, None)


def reevaluate_closure(
    closure: Callable[[], Any], params: Sequence[Tensor], chain: list[Tensor], members: int | None
) -> tuple[Tensor, list[Tensor]]:
    """:func:`evaluate_closure` inside a trajectory (the chain known): loss, gradients."""
    with torch.enable_grad():
        loss = closure_loss(closure())
    if loss.shape != (() if members is None else (members,)):
        return evaluate_closure(lambda: loss, params, chain, members)[1:3]  # raises the error
    grads = [p.grad for p in chain]
    for g in grads:
        if g is None or g.is_sparse:
            return evaluate_closure(lambda: loss, params, chain, members)[1:3]  # raises it
    return loss, grads  # type: ignore[return-value]


def potential(
    chain: list[Tensor],
    loss: Tensor,
    grads: list[Tensor],
    members: int | None,
    decay: dict[int, float],
    num_data: int,
    *,
    gradients: bool = True,
) -> tuple[Tensor, list[Tensor]]:
    r""":math:`U` (float64) and :math:`\nabla U` (see :func:`.dynamics.potential_energy`)."""
    decays = [decay[id(p)] for p in chain]
    energy = potential_energy(loss, chain, decays, num_data, members)
    grad = scaled_gradients(chain, grads, decays, num_data) if gradients else []
    return energy, grad


def closure_trajectory(
    closure: Callable[[], Any],
    params: Sequence[Tensor],
    chain: list[Tensor],
    start: list[Tensor],
    momenta: list[Tensor],
    step_sizes: list[StepSize],
    inverse_mass: list[Tensor | None],
    log_uniform: Tensor,
    *,
    loss0: Tensor,
    raw0: list[Tensor],
    start_energy: Energy | None,
    decay: dict[int, float],
    members: int | None,
    num_data: int,
    temperature: float,
    num_steps: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, list[Tensor], Energy | None]:
    """The trajectory and test in place, the closure filling ``.grad`` at each step.

    ``start``: copies of the parameters' values at the start. ``start_energy``: U and
    grad U at the start, as the last step left them (reused when made with the same N
    and weight decays). Returns ``(energy error, log acceptance, accepted, loss, raw
    gradients, energy)`` at the chain's next state, which the parameters (and their
    ``.grad``) then hold; ``energy`` is U and grad U there (for one chain, else None),
    for the next step to reuse.
    """
    signature = (num_data, *(decay[id(p)] for p in chain))
    if start_energy is not None and start_energy[0] == signature:
        potential0, gradients0 = start_energy[1], start_energy[2]  # the same bits, unrecomputed
    else:
        potential0, gradients0 = potential(chain, loss0, raw0, members, decay, num_data)
    energy0 = potential0 + kinetic_energy(momenta, inverse_mass, members)
    last: dict[str, Any] = {}
    gradient = gradient_map(chain, [decay[id(p)] for p in chain], num_data)

    def potential_gradient() -> tuple[None, list[Tensor]]:
        loss, raw = reevaluate_closure(closure, params, chain, members)
        last["loss"], last["raw"] = loss, raw
        return None, gradient(raw)

    _, gradients1 = leapfrog_(
        chain,
        momenta,
        gradients0,
        potential_gradient,
        step_sizes=step_sizes,
        inverse_mass=inverse_mass,
        num_steps=num_steps,
    )
    potential1, _ = potential(chain, last["loss"], [], members, decay, num_data, gradients=False)
    energy1 = potential1 + kinetic_energy(momenta, inverse_mass, members)
    energy_error, log_accept, accepted = metropolis_test(energy0, energy1, log_uniform, temperature)
    loss1, raw1 = last["loss"], last["raw"]
    energy: Energy | None = None
    if members is None:
        if bool(accepted):
            loss, raw = loss1, [g.clone() for g in raw1]
            energy = (signature, potential1, gradients1)
        else:
            for p, p0, g in zip(chain, start, raw0, strict=True):
                p.copy_(p0)
                p.grad = g.clone()
            loss, raw = loss0, raw0
            energy = (signature, potential0, gradients0)
    else:
        raw = []
        for p, p0, g0, g1 in zip(chain, start, raw0, raw1, strict=True):
            keep = member_view(accepted, p, members)
            p.copy_(torch.where(keep, p, p0))
            raw.append(torch.where(keep, g1, g0))
            p.grad = raw[-1].clone()
        loss = torch.where(accepted.to(loss1.device), loss1, loss0)
    return energy_error, log_accept, accepted, loss, raw, energy


def closure_transition(
    closure: Callable[[], Any],
    param_groups: Sequence[dict[str, Any]],
    start: Start,
    draws: TransitionDraws,
    start_values: list[Tensor],
) -> tuple[Tensor, list[Tensor], dict[str, Tensor], Energy | None]:
    """One transition by closure from ``start``, with ``draws``' random numbers.

    ``param_groups``: the optimizer's (N, T and the number of leapfrog steps are param
    group 0's). ``start_values``: copies of the chain's values at the start. The
    parameters (and their ``.grad``) then hold the chain's next state. Returns the loss
    and the raw gradients there, the diagnostics, and U and grad U there (see
    :func:`closure_trajectory`).
    """
    first = param_groups[0]
    temperature = float(first["temperature"])
    params = [p for group in param_groups for p in group["params"]]
    chain, members = start.chain, start.members
    step_sizes = closure_step_sizes(
        draws.multiplier, [draws.root_lr[id(p)] for p in chain], chain, members
    )
    energy_error, log_accept, accepted, loss, raw, energy = closure_trajectory(
        closure,
        params,
        chain,
        start_values,
        draws.momenta,
        step_sizes,
        draws.inverse_mass,
        torch.log(draws.uniform),
        loss0=start.loss,
        raw0=start.gradients,
        start_energy=start.energy,
        decay=draws.decay,
        members=members,
        num_data=int(first["num_data"]),
        temperature=temperature,
        num_steps=int(first["num_steps"]),
    )
    diagnostics = transition_diagnostics(
        energy_error,
        log_accept,
        accepted,
        draws.step_size,
        temperature,
        draws.num_accepted,
        draws.divergences,
    )
    return loss, raw, diagnostics, energy
