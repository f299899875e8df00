r"""HMC's dynamics: the leapfrog integrator, the energies and the Metropolis test.

Pure functions over lists of tensors, shared by the two ways ``HMC`` runs a transition:
``step(closure)`` (``closure_transition``: in place, gradients from ``backward()``) and
``step(loss_fn=...)`` (``_functional``: a function of tensors, gradients from
``torch.func``, compiled on request). The units are the samplers' (``docs/design.md``):
potential ``U = N L``, leapfrog step ``sqrt(lr / N)`` per parameter, momentum
``r ~ N(0, T M)``; the derivation is in ``hmc.sampler``'s module docstring. Each function
also takes K chains stacked along a leading dimension (a ``ParallelEnsemble``), summing
energies per member.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

import torch
from torch import Tensor

#: an energy error (in units of T) above this counts as a divergence (Stan's threshold)
DIVERGENCE_THRESHOLD = 1000.0
StepSize = Tensor | float


def _pick(tensors: Sequence[Tensor], index: list[int] | None) -> list[Tensor]:
    """``tensors`` at ``index`` (all of them, as a list, when ``index`` is None)."""
    return list(tensors) if index is None else [tensors[i] for i in index]


def _group_by(pairs: Iterable[tuple[int, Any]]) -> dict[Any, list[int]]:
    """The positions ``i`` of ``(i, key)`` pairs, grouped by equal key."""
    groups: dict[Any, list[int]] = {}
    for i, key in pairs:
        groups.setdefault(key, []).append(i)
    return groups


class _Leapfrog:
    r"""The coefficients of one trajectory's leapfrog steps, grouped for ``torch._foreach_*``.

    Computed once per trajectory (not per step): a kick
    :math:`r \leftarrow r - \tfrac{\epsilon}{2} \nabla U` is ``r.add_(g, alpha=-eps / 2)``
    for a float step and ``r.sub_(g * (eps / 2))`` for a tensor one; a drift
    :math:`\theta \leftarrow \theta + \epsilon M^{-1} r` is ``theta.add_(r, alpha=eps)``, or
    ``theta.add_(r * (eps M^{-1}))``. The tensors sharing a float coefficient take one
    foreach op; each result is bit for bit that of the per-tensor op.
    """

    def __init__(
        self,
        positions: Sequence[Tensor],
        momenta: Sequence[Tensor],
        step_sizes: Sequence[StepSize],
        inverse_mass: Sequence[Tensor | None],
    ) -> None:
        count = len(positions)
        if not len(momenta) == len(step_sizes) == len(inverse_mass) == count:
            raise ValueError(
                f"leapfrog_: {count} positions, {len(momenta)} momenta, {len(step_sizes)} step "
                f"sizes and {len(inverse_mass)} inverse masses (expected one of each per tensor)"
            )
        self.kick_scalar: list[tuple[float, list[int] | None, list[Tensor]]]
        self.drift_scalar: list[tuple[float, list[Tensor], list[Tensor]]]
        self.kick_tensor: list[int] | None = None
        self.kick_momenta: list[Tensor] = []
        self.kick_halves: list[Tensor] = []
        self.drift_positions: list[Tensor] = []
        self.drift_momenta: list[Tensor] = []
        self.drift_scales: list[Tensor] = []
        first = step_sizes[0] if count else None
        if (
            isinstance(first, float)
            and all(eps == first and isinstance(eps, float) for eps in step_sizes)
            and all(inv is None for inv in inverse_mass)
        ):  # the usual case, one float step and the identity mass: the plan at once
            self.kick_scalar = [(-first / 2, None, list(momenta))]
            self.drift_scalar = [(first, list(positions), list(momenta))]
            return
        floats = {i: float(eps) for i, eps in enumerate(step_sizes) if not isinstance(eps, Tensor)}
        # kicks: one foreach op per distinct float step, one for all the tensor steps
        self.kick_scalar = [
            (alpha, None if len(where) == count else where, _pick(momenta, where))
            for alpha, where in _group_by((i, -eps / 2) for i, eps in floats.items()).items()
        ]
        where = [i for i in range(count) if i not in floats]
        self.kick_tensor = where or None
        self.kick_momenta = _pick(momenta, where)
        self.kick_halves = [cast(Tensor, step_sizes[i]) / 2 for i in where]
        # drifts: the same with eps * M^-1 (a tensor) where the mass is not the identity
        plain = {i: eps for i, eps in floats.items() if inverse_mass[i] is None}
        self.drift_scalar = [
            (eps, _pick(positions, where), _pick(momenta, where))
            for eps, where in _group_by(plain.items()).items()
        ]
        where = [i for i in range(count) if i not in plain]
        self.drift_positions = _pick(positions, where)
        self.drift_momenta = _pick(momenta, where)
        for i in where:
            eps, inv = step_sizes[i], inverse_mass[i]
            self.drift_scales.append(cast(Tensor, eps if inv is None else eps * inv))

    def kick(self, gradients: Sequence[Tensor]) -> None:
        r""":math:`r \leftarrow r - \tfrac{\epsilon}{2} \nabla U`."""
        for alpha, index, momenta in self.kick_scalar:
            _add_(momenta, _pick(gradients, index), alpha)
        if self.kick_tensor is not None:
            grads = _pick(gradients, self.kick_tensor)
            _sub_(self.kick_momenta, _mul(grads, self.kick_halves))

    def drift(self) -> None:
        r""":math:`\theta \leftarrow \theta + \epsilon M^{-1} r`."""
        for eps, positions, momenta in self.drift_scalar:
            _add_(positions, momenta, eps)
        if self.drift_positions:
            _add_(self.drift_positions, _mul(self.drift_momenta, self.drift_scales))


def _differentiated(tensors: Sequence[Tensor]) -> bool:
    """Whether autograd records in-place ops on ``tensors`` (then no foreach ops, see below).

    Also while ``torch.compile`` traces: inductor fuses per-tensor ops as well, and a
    ``while_loop`` body (``HMC.run``) cannot hold in-place foreach ops (torch 2.13's alias
    check of a loop body expects one tensor per written argument).
    """
    if torch.compiler.is_compiling():
        return True
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _add_(out: list[Tensor], other: list[Tensor], alpha: float | None = None) -> None:
    """``x.add_(y, alpha=alpha)`` (``x.add_(y)`` when ``alpha`` is None) for each pair.

    One foreach op, or per-tensor ops for one tensor (cheaper) and where autograd records
    them (the foreach ops' in-place derivatives save inputs that later steps modify).
    """
    if len(out) == 1 or _differentiated(out):
        for x, y in zip(out, other, strict=True):
            if alpha is None:
                x.add_(y)
            else:
                x.add_(y, alpha=alpha)
    elif alpha is None:
        torch._foreach_add_(out, other)
    else:
        torch._foreach_add_(out, other, alpha=alpha)


def _sub_(out: list[Tensor], other: list[Tensor]) -> None:
    """``x.sub_(y)`` for each pair, as :func:`_add_`."""
    if len(out) == 1 or _differentiated(out):
        for x, y in zip(out, other, strict=True):
            x.sub_(y)
    else:
        torch._foreach_sub_(out, other)


def _mul(tensors: list[Tensor], factors: list[Tensor]) -> list[Tensor]:
    """``x * f`` for each pair (broadcasting)."""
    if len(tensors) == 1 or _differentiated(tensors):
        return [x * f for x, f in zip(tensors, factors, strict=True)]
    return list(torch._foreach_mul(tensors, factors))


def leapfrog_(
    positions: Sequence[Tensor],
    momenta: Sequence[Tensor],
    gradients: Sequence[Tensor],
    potential_gradient: Callable[[], tuple[Any, list[Tensor]]],
    *,
    step_sizes: Sequence[StepSize],
    inverse_mass: Sequence[Tensor | None],
    num_steps: int,
) -> tuple[Any, list[Tensor]]:
    r"""``num_steps`` leapfrog steps of :math:`H = U + \tfrac12 r^\top M^{-1} r`, in place.

    Each step is :math:`r \leftarrow r - \tfrac{\epsilon}{2}\nabla U`,
    :math:`\theta \leftarrow \theta + \epsilon M^{-1} r`,
    :math:`r \leftarrow r - \tfrac{\epsilon}{2}\nabla U` (Neal 2011, Eq. 5.18--5.20). The
    coefficients are computed once and the tensors updated with ``torch._foreach_*`` ops
    (one per distinct step size), so a step costs a few dispatches whatever the number of
    tensors.

    Args:
        positions: the tensors :math:`\theta`, updated in place.
        momenta: the tensors :math:`r`, updated in place.
        gradients: :math:`\nabla U` at ``positions`` on entry.
        potential_gradient: evaluates :math:`(U, \nabla U)` at the current ``positions``.
        step_sizes: :math:`\epsilon` per tensor (a float, or a tensor broadcasting to it).
        inverse_mass: :math:`M^{-1}` per tensor (None: the identity).
        num_steps: the number of leapfrog steps (>= 1).

    Returns:
        :math:`(U, \nabla U)` at the end point (from the last ``potential_gradient``).
    """
    plan = _Leapfrog(positions, momenta, step_sizes, inverse_mass)
    potential: Any = None
    gradients = list(gradients)
    for _ in range(num_steps):
        plan.kick(gradients)
        plan.drift()
        potential, gradients = potential_gradient()
        plan.kick(gradients)
    return potential, gradients


def member_sum(tensor: Tensor, members: int | None) -> Tensor:
    """Sum in float64: over everything (one chain), or per member (leading dimension K)."""
    tensor = tensor.to(torch.float64)
    return tensor.sum() if members is None else tensor.reshape(members, -1).sum(1)


def kinetic_energy(
    momenta: Sequence[Tensor], inverse_mass: Sequence[Tensor | None], members: int | None
) -> Tensor:
    r""":math:`\tfrac12 r^\top M^{-1} r` in float64, per member when ``members`` is K."""
    total = None
    for r, inv in zip(momenta, inverse_mass, strict=True):
        term = r * r if inv is None else r * r * inv
        part = member_sum(term, members)
        total = part if total is None else total + part
    assert total is not None
    return total / 2


def metropolis_log_accept(energy_change: Tensor, temperature: float) -> Tensor:
    r"""Log acceptance probability :math:`\min(0, -\Delta H / T)`; NaN counts as -inf."""
    log_accept = torch.clamp(-energy_change / temperature, max=0.0)
    return torch.nan_to_num(log_accept, nan=-math.inf)


def members_of(loss: Tensor, chain: Sequence[Tensor], source: str) -> int:
    """K, for a loss of one value per member: every parameter must be stacked K first.

    ``source`` names where the loss came from in the message (``"the closure"``).
    """
    members = int(loss.shape[0])
    for p in chain:
        if p.dim() == 0 or p.shape[0] != members:
            raise ValueError(
                f"Invalid loss returned by {source}: shape {tuple(loss.shape)} (one loss per "
                f"member) but a parameter has shape {tuple(p.shape)} (expected every "
                f"parameter stacked with the {members} members first)"
            )
    return members


def member_view(value: Tensor, like: Tensor, members: int | None) -> Tensor:
    """``value`` ([] or [K]) shaped to broadcast against ``like`` (member dimension first)."""
    if members is None or value.dim() == 0:
        return value
    return value.reshape((members,) + (1,) * (like.dim() - 1))


def _scaled_gradient(
    params: list[Tensor], grads: list[Tensor], weight_decay: float, num_data: int
) -> list[Tensor]:
    """``(g + weight_decay * p) * num_data`` for each pair, in foreach ops."""
    if len(params) == 1 or torch.compiler.is_compiling():  # plain ops (see _differentiated)
        return [
            (g + weight_decay * p) * num_data if weight_decay != 0.0 else g * num_data
            for g, p in zip(grads, params, strict=True)
        ]
    if weight_decay == 0.0:
        return list(torch._foreach_mul(grads, num_data))
    out = torch._foreach_mul(params, weight_decay)
    torch._foreach_add_(out, grads)  # g + wd p: addition commutes bit for bit
    torch._foreach_mul_(out, num_data)
    return list(out)


def gradient_map(
    chain: Sequence[Tensor], decays: Sequence[float], num_data: int
) -> Callable[[list[Tensor]], list[Tensor]]:
    r"""The map from raw gradients to :math:`\nabla U = N (g + \lambda \theta)`.

    ``(g + wd * p) * num_data`` (or ``g * num_data``) per parameter, with one foreach op
    per distinct weight decay (grouped once per trajectory): the same bits as the
    per-parameter expression.
    """
    chain = list(chain)
    groups = list(_group_by(enumerate(decays)).items())
    if len(groups) == 1:
        wd = groups[0][0]
        return lambda grads: _scaled_gradient(chain, grads, wd, num_data)
    parts = [(wd, where, _pick(chain, where)) for wd, where in groups]

    def gradient(grads: list[Tensor]) -> list[Tensor]:
        out = list(grads)
        for wd, where, params in parts:
            scaled = _scaled_gradient(params, _pick(grads, where), wd, num_data)
            for i, part in zip(where, scaled, strict=True):
                out[i] = part
        return out

    return gradient


def scaled_gradients(
    positions: Sequence[Tensor], grads: list[Tensor], decays: Sequence[float], num_data: int
) -> list[Tensor]:
    r""":math:`\nabla U = N (g + \lambda \theta)` per tensor, from the mean loss's ``grads``."""
    return gradient_map(positions, decays, num_data)(grads)


def potential_energy(
    loss: Tensor,
    positions: Sequence[Tensor],
    decays: Sequence[float],
    num_data: int,
    members: int | None,
) -> Tensor:
    r""":math:`U = N(L + \sum_i \tfrac{\lambda_i}{2} \lVert\theta_i\rVert^2)` in float64.

    Per member when ``members`` is K.
    """
    potential = loss.to(torch.float64)
    for p, wd in zip(positions, decays, strict=True):
        if wd != 0.0:
            potential = potential + (wd / 2) * member_sum(p * p, members)
    return potential * num_data


def metropolis_test(
    energy0: Tensor, energy1: Tensor, log_uniform: Tensor, temperature: float
) -> tuple[Tensor, Tensor, Tensor]:
    r"""The Metropolis test of a proposal: ``(energy change, log acceptance, accepted)``.

    Accepts where :math:`\log u < \min(0, -\Delta H / T)`, ``u`` uniform on (0, 1).
    """
    energy_error = energy1 - energy0
    log_accept = metropolis_log_accept(energy_error, temperature)
    return energy_error, log_accept, log_uniform < log_accept


def tensor_step_sizes(
    multiplier: Tensor, root_lr: Sequence[float], like: Sequence[Tensor], members: int | None
) -> list[Tensor]:
    r""":math:`\epsilon = s \sqrt{lr/N}` per tensor, in its dtype, shaped to broadcast.

    ``multiplier`` is :math:`s` per chain (float64, ``[]`` or ``[K]``), ``root_lr`` the
    :math:`\sqrt{lr/N}` of each tensor's param group.
    """
    return [
        member_view((multiplier * r).to(p.dtype), p, members)
        for r, p in zip(root_lr, like, strict=True)
    ]


def transition_diagnostics(
    energy_error: Tensor,
    log_accept: Tensor,
    accepted: Tensor,
    step_size: Tensor,
    temperature: float,
    num_accepted: Tensor,
    divergences: Tensor,
) -> dict[str, Tensor]:
    """A transition's diagnostics (see :attr:`HMC.diagnostics`), counts carried over."""
    scaled_error = energy_error / temperature
    divergent = ~(scaled_error <= DIVERGENCE_THRESHOLD)
    return {
        "accept_prob": torch.exp(log_accept),
        "accepted": accepted,
        "energy_error": scaled_error,
        "divergent": divergent,
        "step_size": step_size,
        "num_accepted": accepted.long() + num_accepted,
        "divergences": divergent.long() + divergences,
    }
