r"""HMC's warm-up: the step size by dual averaging, the diagonal mass from the draws.

Step size. Dual averaging (Hoffman & Gelman 2014, Algorithm 5) tunes the log step
multiplier :math:`\log s` so that the average acceptance probability :math:`\alpha` of the
Metropolis test approaches a target :math:`\delta`. After the :math:`m`-th adapted
transition (Hoffman & Gelman 2014, Eq. (6) and Algorithm 5):

.. math::

    \bar H_m = \Big(1 - \frac{1}{m + t_0}\Big) \bar H_{m-1} + \frac{\delta - \alpha_m}{m + t_0},
    \qquad
    \log\epsilon_{m} = \mu - \frac{\sqrt m}{\gamma} \bar H_m,
    \qquad
    \log\bar\epsilon_m = m^{-\kappa} \log\epsilon_m + (1 - m^{-\kappa}) \log\bar\epsilon_{m-1},

with :math:`\mu = \log(10\,\epsilon_0)`, :math:`\gamma = 0.05`, :math:`t_0 = 10`,
:math:`\kappa = 0.75` (the paper's values). During warm-up the sampler uses
:math:`\epsilon_m`; afterwards it freezes :math:`\bar\epsilon`. Every quantity is a
tensor, one entry per chain (a 0-dim tensor for one chain); the K chains of a
``ParallelEnsemble`` adapt from their mean acceptance (``POOLED_ADAPTATION``).

Mass. With ``mass="adapt"`` the warm-up draws are accumulated per parameter (Welford's
running mean and sum of squared deviations, in the parameter's state as ``"mass_mean"``
and ``"mass_m2"``); :func:`update_mass_` sets :math:`M^{-1}` to their variance,
regularised as Stan does and normalised to mean 1 per chain so that ``lr`` keeps its
meaning (``docs/design.md``, SGD units), and restarts dual averaging.

Schedule. :func:`warmup_windows` is Stan's windowed schedule, which ``HMC.warmup`` runs:
the mass updated at the end of doubling windows, the step size re-adapted after each.

The optimizer's warm-up methods (``HMC.warmup``, ``end_warmup``, ``update_mass`` and
``warming_up``) are :class:`WarmupMethods`, which ``HMC`` inherits.

The state these functions read and write is HMC's: the optimizer-level ``"hmc"`` entry
of its state (``log_step``, ``dual_averaging``, ``mass_count``, ...) and the
per-parameter states; they change it in place, as one transition or one call of the
optimizer's warm-up methods does.

References:
    M. D. Hoffman and A. Gelman. The No-U-Turn Sampler. JMLR 15, 2014 (Algorithm 5).
    Stan Reference Manual, "HMC algorithm parameters" (the adaptation windows).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor

from ..core.progress import ProgressBar, check_progress
from ..core.validation import check_positive_int
from .arguments import check_one_of
from .dynamics import member_sum, member_view

__all__ = [
    "POOLED_ADAPTATION",
    "DualAveragingState",
    "WarmupMethods",
    "adapt_",
    "dual_averaging_init",
    "dual_averaging_update",
    "end_adaptation_",
    "initial_state",
    "run_warmup",
    "set_masses_",
    "start_step_size_",
    "update_mass_",
    "warmup_windows",
]

GAMMA = 0.05
T0 = 10.0
KAPPA = 0.75
#: the K chains of an ensemble adapt their step sizes from their mean acceptance
POOLED_ADAPTATION = True

_broadcast_shapes: Callable[..., torch.Size] = torch.broadcast_shapes


# ---------------------------------------------------------------------- dual averaging
class DualAveragingState(NamedTuple):
    """The dual-averaging iterates (each a float64 tensor, one entry per chain)."""

    log_step: Tensor  #: :math:`\log\epsilon_m`, used for the next transition
    log_step_avg: Tensor  #: :math:`\log\bar\epsilon_m`, frozen after warm-up
    h_bar: Tensor  #: :math:`\bar H_m`
    mu: Tensor  #: :math:`\mu = \log(10\,\epsilon_0)`
    count: int  # type: ignore[assignment]  #: :math:`m`, transitions adapted so far


def dual_averaging_init(log_step: Tensor) -> DualAveragingState:
    """Start adapting from the step size ``exp(log_step)`` (one entry per chain)."""
    log_step = log_step.to(torch.float64)
    zeros = torch.zeros_like(log_step)
    return DualAveragingState(log_step, zeros, zeros, log_step + math.log(10.0), 0)


def dual_averaging_update(
    state: DualAveragingState, accept_prob: Tensor, target: float
) -> DualAveragingState:
    """One step of Algorithm 5 given the last transition's acceptance probability."""
    m = state.count + 1
    eta = 1.0 / (m + T0)
    h_bar = (1.0 - eta) * state.h_bar + eta * (target - accept_prob.to(torch.float64))
    log_step = state.mu - math.sqrt(m) / GAMMA * h_bar
    weight = m**-KAPPA
    log_step_avg = weight * log_step + (1.0 - weight) * state.log_step_avg
    return DualAveragingState(log_step, log_step_avg, h_bar, state.mu, m)


def start_step_size_(
    hmc: dict[str, Any], members: int | None, device: torch.device, target_accept: Any
) -> Tensor:
    r"""The log step multiplier :math:`\log s` per chain, created (0) at the first step.

    Dual averaging starts then too, when adapting (``target_accept``) during warm-up.
    """
    if hmc["log_step"] is None:
        shape = () if members is None else (members,)
        initial = torch.zeros(shape, dtype=torch.float64, device=device)
        hmc["log_step"] = initial
        if target_accept is not None and hmc["warmup"]:
            hmc["dual_averaging"] = dual_averaging_init(initial)._asdict()
    log_step: Tensor = hmc["log_step"]
    return log_step


# ---------------------------------------------------------------------- one transition
def adapt_(
    hmc: dict[str, Any],
    state: Mapping[Tensor, Any],
    chain: list[Tensor],
    accept_prob: Tensor,
    members: int | None,
    target_accept: Any,
) -> None:
    """Adapt after a warm-up transition: a dual-averaging step, the chain's draw collected.

    ``state`` is the optimizer's per-parameter state; ``chain`` the parameters the
    transition moved, at their new values.
    """
    if target_accept is not None and hmc["dual_averaging"] is not None:
        averaging = DualAveragingState(**hmc["dual_averaging"])
        if members is not None and POOLED_ADAPTATION:
            accept_prob = accept_prob.mean().expand_as(accept_prob)
        averaging = dual_averaging_update(averaging, accept_prob, float(target_accept))
        hmc["dual_averaging"] = averaging._asdict()
        hmc["log_step"] = averaging.log_step
    if hmc["adapt_mass"] and hmc["collect_mass"]:
        hmc["mass_count"] += 1
        n = hmc["mass_count"]
        for p in chain:
            entry = state[p]
            if "mass_mean" not in entry or n == 1:
                entry["mass_mean"] = p.detach().clone()
                entry["mass_m2"] = torch.zeros_like(p)
                continue
            delta = p - entry["mass_mean"]
            entry["mass_mean"] = entry["mass_mean"] + delta / n
            entry["mass_m2"] = entry["mass_m2"] + delta * (p - entry["mass_mean"])


# ---------------------------------------------------------------------- the mass
def set_masses_(state: Mapping[Tensor, Any], params: list[Tensor], masses: list[Any]) -> None:
    """Validate a given diagonal mass (one tensor per parameter) and set it in ``state``."""
    if len(masses) != len(params):
        raise ValueError(
            f"Invalid mass: {len(masses)} tensors (expected one per parameter, {len(params)})"
        )
    for index, (param, m) in enumerate(zip(params, masses, strict=True)):
        if not isinstance(m, Tensor):
            raise TypeError(f"Invalid mass[{index}]: {m!r} (expected a tensor of positive numbers)")
        try:
            shape = _broadcast_shapes(m.shape, param.shape)
        except RuntimeError:
            shape = None
        if shape != param.shape:
            raise ValueError(
                f"Invalid mass[{index}]: shape {tuple(m.shape)} (expected a shape that "
                f"broadcasts to its parameter's, {tuple(param.shape)})"
            )
        if not bool(torch.isfinite(m).all()) or not bool((m > 0).all()):
            raise ValueError(f"Invalid mass[{index}]: {m!r} (expected finite numbers > 0)")
        state[param]["mass"] = m.detach().to(param.device, param.dtype).clone()


def update_mass_(
    hmc: dict[str, Any], state: Mapping[Tensor, Any], params: list[Tensor], target_accept: Any
) -> bool:
    r"""Set the mass from the draws collected since the last update; whether it was set.

    :math:`M^{-1}` becomes the regularised variance of the draws (Stan's
    :math:`\frac{n}{n+5}\hat\sigma^2 + 10^{-3}\frac{5}{n+5}`), normalised to mean 1 per
    chain; the estimator restarts, and so does dual averaging (from the current step
    size). Needs 3 draws or more. ``params``: every parameter, in the optimizer's order.
    """
    n = hmc["mass_count"]
    chain = [p for p in params if "mass_m2" in state[p]]
    if not hmc["adapt_mass"] or n < 3 or not chain:
        return False
    members = (
        None
        if hmc["log_step"] is None or hmc["log_step"].dim() == 0
        else int(hmc["log_step"].shape[0])
    )
    variances = []
    for p in chain:
        var = state[p]["mass_m2"] / (n - 1)
        variances.append((n / (n + 5.0)) * var + 1e-3 * (5.0 / (n + 5.0)))
    total = sum(member_sum(v, members) for v in variances)
    count = sum(v.numel() for v in variances) // (1 if members is None else members)
    mean = total / count
    for p, var in zip(chain, variances, strict=True):
        scale = member_view(mean.to(var.dtype), var, members)
        state[p]["mass"] = scale / var
        del state[p]["mass_mean"], state[p]["mass_m2"]
    hmc["mass_count"] = 0
    if target_accept is not None and hmc["log_step"] is not None:
        hmc["dual_averaging"] = dual_averaging_init(hmc["log_step"])._asdict()
    return True


# ---------------------------------------------------------------------- the end of warm-up
def end_adaptation_(hmc: dict[str, Any], state: Mapping[Tensor, Any], params: list[Tensor]) -> None:
    """Freeze the adaptation: the averaged step size, no estimator, the counts from zero.

    (After the last mass update, which ``HMC.end_warmup`` makes first.)
    """
    averaged = hmc["dual_averaging"]
    if averaged is not None and averaged["count"] > 0:
        hmc["log_step"] = averaged["log_step_avg"]
    for p in params:
        for key in ("mass_mean", "mass_m2"):
            state[p].pop(key, None) if p in state else None
    hmc.update(warmup=False, collect_mass=False, dual_averaging=None)
    if hmc["diagnostics"] is not None:  # the counts start again with the sampling
        hmc["diagnostics"]["num_accepted"] = torch.zeros_like(hmc["diagnostics"]["num_accepted"])
        hmc["diagnostics"]["divergences"] = torch.zeros_like(hmc["diagnostics"]["divergences"])


def initial_state(target_accept: Any, adapt_mass: bool) -> dict[str, Any]:
    """HMC's optimizer-level state before the first step: adaptation and diagnostics."""
    return {
        "warmup": target_accept is not None or adapt_mass,
        "adapt_mass": adapt_mass,
        "collect_mass": adapt_mass,
        "mass_count": 0,
        "log_step": None,  # log s per chain, created at the first step
        "dual_averaging": None,
        "diagnostics": None,
    }


def run_warmup(
    hmc: dict[str, Any],
    num_steps: int,
    step: Callable[[], Any],
    update_mass: Callable[[], bool],
    bar: ProgressBar | None = None,
) -> None:
    """Make ``num_steps`` warm-up transitions (``step``) on the schedule of :func:`warmup_windows`.

    Draws are collected for the mass in the windows only, and ``update_mass`` is called at
    each window's end. A step that raises changed nothing; nor does the schedule then.
    ``bar`` (a progress bar) advances by one per transition.
    """
    init, term, ends = warmup_windows(num_steps, hmc["adapt_mass"])
    collect = hmc["collect_mass"]
    for t in range(num_steps):
        hmc["collect_mass"] = hmc["adapt_mass"] and init <= t < num_steps - term
        try:
            step()
        except BaseException:  # the failed step changed nothing; nor does the schedule
            hmc["collect_mass"] = collect
            raise
        if t + 1 in ends:
            update_mass()
        if bar is not None:
            bar.update()
    hmc["collect_mass"] = False


def warmup_windows(num_steps: int, adapt_mass: bool) -> tuple[int, int, set[int]]:
    """Stan's schedule for ``num_steps`` warm-up transitions: ``(init, term, window ends)``.

    Step size only (``adapt_mass`` False, or fewer than 20 steps): no windows. With the
    mass: a first ``init`` (15%) for the step size alone, then windows of doubling length
    (the last one stretched to the end of the middle 75%) at whose ends (transition
    counts, from 1) the mass is set, then a last ``term`` (10%) for the step size alone
    (Stan's reference manual, "HMC algorithm parameters": the 15% / 75% / 10% split Stan
    falls back to for short warm-ups, with a first window of about 1/35 of the middle
    part, as Stan's 25 steps of 875). Draws are collected for ``init <= t < num_steps -
    term``.
    """
    ends: set[int] = set()
    init = term = 0
    if adapt_mass and num_steps >= 20:
        init, term = int(0.15 * num_steps), int(0.1 * num_steps)
        slow = num_steps - init - term
        window, position = max(5, round(slow / 35)), init
        while position + window < init + slow:
            nxt = position + window
            if nxt + 2 * window > init + slow:
                nxt = init + slow
            ends.add(nxt)
            position, window = nxt, 2 * window
        ends.add(init + slow)
    return init, term, ends


# ---------------------------------------------------------------------- HMC's methods
class _Warmed(Protocol):
    """What :class:`WarmupMethods` uses of the ``HMC`` optimizer that inherits them."""

    param_groups: list[dict[str, Any]]
    state: Any

    @property
    def _hmc_state(self) -> dict[str, Any]: ...

    def _params(self) -> list[Tensor]: ...

    def step(
        self,
        closure: Callable[[], Any] | None = None,
        *,
        loss_fn: Callable[[Any], Tensor] | None = None,
    ) -> Tensor: ...

    def update_mass(self) -> bool: ...

    def end_warmup(self) -> None: ...


class WarmupMethods:
    """``HMC``'s warm-up methods, on the functions above (``HMC`` inherits them)."""

    @property
    def warming_up(self: _Warmed) -> bool:
        """Whether the step size (or the mass) is still being adapted."""
        return bool(self._hmc_state["warmup"])

    def update_mass(self: _Warmed) -> bool:
        r"""Set the mass from the draws collected since the last update (``mass="adapt"``).

        :math:`M^{-1}` becomes the regularised variance of the draws (Stan's
        :math:`\frac{n}{n+5}\hat\sigma^2 + 10^{-3}\frac{5}{n+5}`), normalised to mean 1
        per chain; the estimator restarts, and so does dual averaging (from the current
        step size). Returns whether the mass was updated (it needs 3 draws or more).
        """
        target = self.param_groups[0]["target_accept"]
        return update_mass_(self._hmc_state, self.state, self._params(), target)

    def end_warmup(self: _Warmed) -> None:
        """Freeze the adaptation: the step size becomes dual averaging's averaged iterate.

        With ``mass="adapt"`` the mass is first set from the draws collected (see
        :meth:`update_mass`; :meth:`warmup` re-adapts the step size after each update,
        which this does not). Later steps are ordinary, exactly invariant transitions.
        """
        hmc = self._hmc_state
        if not hmc["warmup"]:
            return
        if hmc["adapt_mass"] and hmc["collect_mass"]:
            self.update_mass()
        end_adaptation_(hmc, self.state, self._params())

    def warmup(
        self: _Warmed,
        closure: Callable[[], Any] | None = None,
        num_steps: int | None = None,
        *,
        loss_fn: Callable[[Any], Tensor] | None = None,
        progress: bool | None = None,
    ) -> None:
        """Run ``num_steps`` warm-up transitions with Stan's schedule, then :meth:`end_warmup`.

        Each transition is ``step(closure)``, or ``step(loss_fn=loss_fn)`` (give one of
        them, as to :meth:`step`): ``opt.warmup(closure, 100)`` or
        ``opt.warmup(num_steps=100, loss_fn=loss_fn)``. ``progress``: a tqdm bar over
        the transitions (default None: where standard error is a terminal and tqdm is
        installed; True or False to choose; see ``core/progress``).

        Step size only: dual averaging throughout. With ``mass="adapt"``: a first 15% for
        the step size alone, then windows of doubling length after each of which the mass
        is set from the window's draws and dual averaging restarts, then a last 10% for
        the step size alone (Stan's schedule, see ``adaptation.warmup_windows``).
        """
        num_steps = check_positive_int("num_steps", num_steps)
        check_one_of(closure, loss_fn, where="HMC.warmup", expected="what step() takes")
        show = check_progress(progress)
        hmc = self._hmc_state
        if not hmc["warmup"]:
            raise ValueError(
                "HMC.warmup: the warm-up is over (expected target_accept or mass='adapt', "
                "before end_warmup())"
            )
        with ProgressBar(show, num_steps, "HMC warm-up") as bar:
            step = lambda: self.step(closure, loss_fn=loss_fn)  # noqa: E731 (one of them)
            run_warmup(hmc, num_steps, step, self.update_mass, bar)
        self.end_warmup()
