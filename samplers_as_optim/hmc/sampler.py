r"""Hamiltonian Monte Carlo with a Metropolis correction, as a ``torch.optim`` optimizer.

The target. With the full-batch mean loss :math:`L` (docs/design.md) and weight decay
:math:`\lambda_g` per param group, the potential is

.. math::

    U(\theta) = N \Big(L(\theta) + \sum_g \tfrac{\lambda_g}{2} \lVert\theta_g\rVert^2\Big),
    \qquad p_T(\theta) \propto \exp(-U(\theta) / T),

the posterior under the prior :math:`\mathcal N(0, 1/(N\lambda))` at temperature T.

One transition (Neal 2011, Sections 5.2--5.3; Betancourt 2017). Draw a momentum
:math:`r \sim \mathcal N(0, T M)` (``M`` diagonal, the ``mass``), take ``num_steps``
leapfrog steps of size :math:`\epsilon`,

.. math::

    r \leftarrow r - \tfrac{\epsilon}{2} \nabla U(\theta), \qquad
    \theta \leftarrow \theta + \epsilon M^{-1} r, \qquad
    r \leftarrow r - \tfrac{\epsilon}{2} \nabla U(\theta),

and accept the end point :math:`(\theta', r')` with probability
:math:`\min\big(1, \exp(-(H(\theta', r') - H(\theta, r)) / T)\big)`,
:math:`H = U + \tfrac12 r^\top M^{-1} r`. The joint density
:math:`\exp(-H/T)` has :math:`p_T` as its marginal and the leapfrog map is reversible
(under a flip of :math:`r`) and volume preserving, so the test makes :math:`p_T` exactly
invariant, whatever :math:`\epsilon`: there is no step-size bias (unlike SGLD/SGHMC).
A rejected proposal leaves the parameters and their gradients exactly as they were.

Units: ``lr`` is the samplers' step. SGHMC in SGD units (docs/design.md) is
:math:`b \leftarrow \mu b + g + \dots,\ \theta \leftarrow \theta - lr\, b`. Its physical
momentum is :math:`r = -\sqrt{N\,lr}\, b`; substituting,
:math:`\theta \leftarrow \theta + \sqrt{lr/N}\; r` and
:math:`r \leftarrow \mu r - \sqrt{lr/N}\; N g = \mu r - \sqrt{lr/N}\; \nabla U`: the
Hamiltonian dynamics of :math:`U` with time step :math:`\sqrt{lr/N}`. HMC uses the same
time step,

.. math::

    \epsilon = s \sqrt{lr / N},

(:math:`s = 1` unless adapted, see below), so moving between SGHMC and HMC needs no
rescaling. Check: one leapfrog step from :math:`r = 0` moves
:math:`\theta \leftarrow \theta - \tfrac{\epsilon^2}{2} N g = \theta - \tfrac{lr}{2} g`,
half an SGD step. A param group with its own ``lr`` has its own :math:`\epsilon_g`; a
per-coordinate step is a change of the mass matrix (:math:`M_g \propto
\epsilon^2/\epsilon_g^2`), so the test stays exact.

Adaptation (warm-up, see ``adaptation``). With ``target_accept`` the step multiplier
:math:`s` follows dual averaging (Hoffman & Gelman 2014, Algorithm 5) until
:meth:`HMC.end_warmup` freezes its averaged iterate; with ``mass="adapt"`` the diagonal
mass is estimated from the warm-up draws; :meth:`HMC.warmup` runs Stan's windowed
schedule. Adaptation breaks the Markov property, so samples are drawn after the warm-up.

Jitter. With ``jitter`` j each transition uses :math:`s (1 + j (2u - 1))`,
:math:`u \sim U(0, 1)`: the trajectory length :math:`L\epsilon` varies, which avoids the
periodic orbits a fixed length can fall into (Neal 2011, Section 5.4.2.2).

Parallel chains. When the closure returns one loss per member (shape ``[K]``, the
members' mean losses, for parameters stacked with the member dimension first, as in a
:class:`~samplers_as_optim.ParallelEnsemble`), the K chains share every vmapped forward
and backward but each has its own energy, Metropolis test, step size and diagnostics:
K independent chains.

Randomness is counter based (see ``transition_draws``), and the chain is the SG-MCMC
samplers' (``samplers_as_optim.core.chain``, ``docs/design.md``): its random state is
``group["seed"]`` and ``group["step"]``, and each parameter's state keeps the key its
momentum is drawn with (``state["noise_key"]``), so a state saved by an optimizer built
from ``parameters()`` continues bit for bit in one built from ``named_parameters()``.

The parts: this module is the optimizer (its param groups, state and the two ways to
step); ``arguments`` checks its arguments; ``closure_transition`` runs a transition by
closure, ``_functional`` one by loss function, both from ``transition_draws``' numbers
with ``dynamics``' mathematics; ``adaptation`` adapts during the warm-up and holds the
warm-up's methods; ``start`` carries the start of the next transition from the last;
``rollback`` is what a step that raises puts back.

References:
    R. M. Neal. MCMC using Hamiltonian dynamics. Handbook of MCMC, 2011 (Eq. 5.18--5.20,
    Section 5.3.2.1).
    M. D. Hoffman and A. Gelman. The No-U-Turn Sampler. JMLR 15, 2014 (Algorithm 5).
    P. Izmailov, S. Vikram, M. D. Hoffman, A. G. Wilson. What are Bayesian neural network
    posteriors really like? ICML 2021.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

import torch
from torch import Tensor

from ..core.chain import ChainOptimizer, at_group
from ..core.streams import seed_from_global_rng
from ..core.validation import check_seed
from . import adaptation
from .arguments import (
    check_fits,
    check_group,
    check_groups,
    check_mass,
    check_one_of,
    check_whole,
)
from .closure_transition import NOT_COMPILED, closure_start, closure_transition
from .rollback import Rollback
from .run import HMCRun, run_chain
from .start import START_KEY, Start, TransitionStart, check_start
from .transition_draws import TransitionDraws, draw_transition

__all__ = ["HMC"]

#: the optimizer-level entry of ``self.state``: adaptation and diagnostics
_STATE_KEY = "hmc"


class HMC(adaptation.WarmupMethods, ChainOptimizer):
    r"""Full-batch Hamiltonian Monte Carlo with a Metropolis test, as an optimizer.

    One ``step(closure)`` is one Markov transition: a fresh momentum
    :math:`r \sim \mathcal N(0, T M)`, ``num_steps`` leapfrog steps of size
    :math:`\epsilon = s\sqrt{lr/N}`, and a Metropolis accept/reject at temperature T (see
    the module docstring for the derivation of the units and of exactness). The closure
    zeroes the gradients, computes the full-batch mean loss, calls ``backward()`` and
    returns the loss, as for ``torch.optim.LBFGS``; it is called ``num_steps`` times per
    step (plus once for its start unless it reuses the last step's end, see :meth:`step`).
    After a step each parameter holds the chain's new state and ``.grad`` the gradient of
    the mean loss there (exactly the values before the step when it was rejected). A step
    that raises (a failing closure or loss function, an interrupt) changes nothing at all.

    ``step(loss_fn=...)`` is the functional alternative to the closure: the mean loss as
    a function of the parameters (a dict by name, as ``torch.func.functional_call``
    takes it, or a tuple), differentiated with ``torch.func.grad``. It is the same chain
    (the same random numbers and decisions, states equal up to rounding), and with
    ``compile=True`` the whole transition -- every leapfrog step's forward and backward,
    the energies, the test -- runs as one ``torch.compile`` graph instead of one Python
    round trip per leapfrog step (see ``benchmarks/bench_hmc.py`` for what it saves);
    :meth:`run` makes many such transitions per call, the same chain.

    With parameters stacked along a leading member dimension K (a
    :class:`~samplers_as_optim.ParallelEnsemble`) the closure may return the K members'
    losses (shape ``[K]``, call ``backward()`` on their sum): every member is then a chain
    of its own with its own accept/reject, step size and diagnostics.

    Args:
        params: iterable of parameters or of dicts defining param groups. ``lr`` and
            ``weight_decay`` may differ between groups; the other hyperparameters must be
            the same in every group (one Metropolis test covers all parameters).
            Parameters whose ``.grad`` is None after the closure are left out.
        lr: the samplers' step (required, a finite number > 0): the leapfrog step is
            :math:`\sqrt{lr / N}` (times the adapted multiplier, see ``target_accept``),
            the time step of SGHMC with the same ``lr``.
        num_steps: leapfrog steps per transition (required, an integer >= 1).
        num_data: the number of training examples N (required, a positive integer). The
            potential is ``N * (loss + weight decay term)``.
        temperature: T, the target is ``p(theta | D) ** (1 / T)`` (default: 1.0; a finite
            number > 0: the Metropolis test divides by T).
        weight_decay: L2 penalty as in ``torch.optim.SGD`` (default: 0; a finite number
            >= 0); a prior N(0, s**2) on every weight is ``1 / (num_data * s**2)``.
        seed: seed of the chain's randomness (default: None: drawn once from torch's
            global RNG at construction; an integer in [0, 2**64)).
        jitter: each transition's step size is multiplied by a uniform number in
            ``[1 - jitter, 1 + jitter]`` (default: 0.0; a number in [0, 1)).
        target_accept: adapt the step size during warm-up by dual averaging towards this
            mean acceptance probability (default: None: no adaptation; a number in
            (0, 1), 0.65-0.8 is usual). Warm-up lasts until :meth:`end_warmup` (or use
            :meth:`warmup`).
        mass: the diagonal mass matrix: None (the identity), a sequence of positive
            tensors, one per parameter in the optimizer's order, each broadcastable to
            its parameter's shape, or ``"adapt"`` (estimated during warm-up).
        compile: run ``step(loss_fn=...)`` transitions through ``torch.compile``
            (default: False). The first step compiles (seconds to a minute); the step
            size is a tensor input, so jitter and adaptation do not recompile, but a new
            ``lr``, ``num_steps`` or ``temperature`` does. No effect on ``step(closure)``.

    Example:
        >>> import torch
        >>> from samplers_as_optim import HMC
        >>> _ = torch.manual_seed(0)
        >>> x, y = torch.randn(50, 3), torch.randint(0, 2, (50,)).float()
        >>> model = torch.nn.Linear(3, 1)
        >>> opt = HMC(model.parameters(), lr=0.05, num_steps=10, num_data=50, seed=0)
        >>> def closure():
        ...     opt.zero_grad()
        ...     loss = torch.nn.functional.binary_cross_entropy_with_logits(
        ...         model(x).squeeze(-1), y)
        ...     loss.backward()
        ...     return loss
        >>> for _ in range(20):
        ...     loss = opt.step(closure)
        >>> sorted(opt.diagnostics)[:4]
        ['accept_prob', 'accepted', 'divergences', 'divergent']

        The same chain from a loss function (add ``compile=True`` for one graph):

        >>> from torch.func import functional_call
        >>> opt = HMC(model.named_parameters(), lr=0.05, num_steps=10, num_data=50, seed=0)
        >>> def loss_fn(params):
        ...     logits = functional_call(model, params, (x,)).squeeze(-1)
        ...     return torch.nn.functional.binary_cross_entropy_with_logits(logits, y)
        >>> loss = opt.step(loss_fn=loss_fn)
    """

    #: HMC samples only at temperature > 0 (read by schedules such as CyclicalSGMCMC)
    requires_positive_temperature = True
    zero_temperature_fault = "its Metropolis test divides by T"

    #: runtime, not the chain's state (rebuilt after loading, see ``_reset_runtime``):
    #: the start of the next transition, as the last one left it (see ``start``)
    _next: TransitionStart
    #: the hyperparameters last validated (plain numbers only), see ``_check_groups``
    _checked: tuple[Any, ...] | None
    #: whether step(closure) has said that compile=True does not apply to it
    _warned_compile: bool

    def __init__(
        self,
        params: Iterable[Any],
        lr: float,
        num_steps: int,
        *,
        num_data: int,
        temperature: float = 1.0,
        weight_decay: float = 0.0,
        seed: int | None = None,
        jitter: float = 0.0,
        target_accept: float | None = None,
        mass: Sequence[Tensor] | str | None = None,
        compile: bool = False,
    ) -> None:
        seed = check_seed(seed)
        if not isinstance(compile, bool):
            raise TypeError(f"Invalid compile: {compile!r} (expected True or False)")
        defaults = {
            "lr": lr,
            "num_steps": num_steps,
            "num_data": num_data,
            "temperature": temperature,
            "weight_decay": weight_decay,
            "jitter": jitter,
            "target_accept": target_accept,
            "compile": compile,
        }
        self.check_hyperparameters(defaults)
        check_mass(mass)
        defaults["seed"] = seed_from_global_rng() if seed is None else seed
        defaults["step"] = 0
        super().__init__(params, defaults)
        self._reset_runtime()
        for index, group in enumerate(self.param_groups):
            check_fits(group, where="" if len(self.param_groups) == 1 else at_group(index))
        all_params = self._params()
        check_whole(all_params)
        if isinstance(mass, Sequence) and not isinstance(mass, str):
            adaptation.set_masses_(self.state, all_params, list(mass))
        cast(Any, self.state)[_STATE_KEY] = adaptation.initial_state(target_accept, mass == "adapt")

    # ------------------------------------------------------------------ param groups
    @classmethod
    def check_hyperparameters(cls, group: dict[str, Any], *, where: str = "") -> None:
        """Validate one param group's hyperparameters (see ``arguments.check_group``)."""
        check_group(group, where=where)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Validate a param group, then add it (see ``ChainOptimizer.add_param_group``).

        Its scalars must fit its parameters' dtypes too; that the groups share what one
        Metropolis test needs (``arguments.SHARED``) is checked at the next step.
        """
        super().add_param_group(param_group)  # its hyperparameters, seed and step checked
        if hasattr(self, "_checked"):  # after the constructor (which checks every group)
            try:
                check_fits(self.param_groups[-1], where=at_group(len(self.param_groups) - 1))
            except ValueError:
                self.param_groups.pop()
                raise

    def _check_groups(self) -> None:
        """Validate the groups before a step (again only where something changed)."""
        checked, self._checked = self._checked, None
        self._checked = check_groups(self.param_groups, checked)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients, as ``torch.optim.Optimizer.zero_grad`` does.

        The closure calls this ``num_steps`` times per step, so it skips the base class's
        profiler range and dispatch (a sizeable share of a small model's leapfrog step);
        the effect on the gradients is the same.
        """
        for group in self.param_groups:
            for p in group["params"]:
                grad = p.grad
                if grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                    continue
                if grad.grad_fn is not None:
                    grad.detach_()
                else:
                    grad.requires_grad_(False)
                grad.zero_()

    def _params(self) -> list[Tensor]:
        """Every parameter, in the optimizer's order."""
        return [p for g in self.param_groups for p in g["params"]]

    # ------------------------------------------------------------------ runtime and state
    def _reset_runtime(self) -> None:
        """What is not the chain's state: noise streams and keys, the next step's start."""
        self._reset_chain_runtime()
        self._next = TransitionStart()
        self._checked = None
        self._warned_compile = False

    def __getstate__(self) -> dict[str, Any]:
        """``torch.optim``'s pickled state, and the start of the next step (see ``state_dict``)."""
        state: dict[str, Any] = super().__getstate__()
        start = self._portable_start()
        return state if start is None else {**state, START_KEY: start}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore a pickled or deep-copied optimizer: the same chain continues."""
        state = dict(state)
        start = state.pop(START_KEY, None)
        super().__setstate__(state)
        self._reset_runtime()
        self._next.loaded = start

    @property
    def _hmc_state(self) -> dict[str, Any]:
        """The optimizer-level entry of ``self.state``: adaptation and diagnostics."""
        found: dict[str, Any] = cast(Any, self.state)[_STATE_KEY]
        return found

    @property
    def diagnostics(self) -> dict[str, Tensor]:
        r"""The last transition's diagnostics (one entry per chain, float64/int64/bool).

        ``accept_prob`` (the Metropolis probability), ``accepted``, ``energy_error``
        (:math:`\Delta H / T`), ``divergent`` (energy error above
        ``DIVERGENCE_THRESHOLD`` or not finite), ``step_size`` (the leapfrog step of
        param group 0, jitter included), and the running counts ``num_accepted`` and
        ``divergences`` (since the end of the warm-up, when there is one). Empty before the
        first step.
        """
        found = self._hmc_state["diagnostics"]
        return {} if found is None else dict(found)

    def state_dict(self) -> dict[str, Any]:
        """``torch.optim``'s state dict; the adaptation and diagnostics travel as ``"hmc"``.

        Each parameter's state holds the key its momentum is drawn with (``"noise_key"``,
        see ``samplers_as_optim.core.chain``). With ``compile=True`` the ``"hmc"`` entry
        also carries the start of the next step (``"start"``: the loss and gradient at the
        current parameters, with their digest), so that a resumed compiled chain goes on
        from the same bits as the uninterrupted one (taken where the first step's own
        evaluation of its target agrees with it up to rounding, see ``start``).
        """
        state_dict = super().state_dict()
        state = dict(state_dict["state"])
        state[_STATE_KEY] = copy.deepcopy(state[_STATE_KEY])
        start = self._portable_start()
        if start is not None:
            state[_STATE_KEY][START_KEY] = start
        state_dict["state"] = state
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state saved by :meth:`state_dict`: the chain continues bit for bit.

        The saved noise keys are used as they are, so the chain continues whether this
        optimizer names its parameters as the saved one did or not. A state without them
        (written before HMC stored them) keys the momenta by this optimizer's names or
        positions, as HMC then did. Everything is checked before anything changes.
        """
        saved = state_dict.get("state", {}).get(_STATE_KEY)
        if not isinstance(saved, dict):
            raise ValueError(
                "Invalid state_dict: no 'hmc' entry in its state (expected the state_dict() "
                "of an HMC optimizer)"
            )
        groups = state_dict.get("param_groups", [])
        if not self._hold_chain_state(groups):
            raise ValueError(
                "Invalid state_dict: its param groups lack the chain's random state "
                "('seed' and 'step') (expected the state_dict() of an HMC optimizer)"
            )
        self._check_saved_chain(state_dict)
        saved = copy.deepcopy(saved)
        start = saved.pop(START_KEY, None)
        check_start(start)
        super().load_state_dict(state_dict)
        self._restore_noise_keys(state_dict)
        cast(Any, self.state)[_STATE_KEY] = saved
        self._reset_runtime()
        self._next.loaded = start

    def _portable_start(self) -> dict[str, Any] | None:
        """The start of the next step for a saved state (``compile=True`` only), or None."""
        if not self.param_groups[0].get("compile", False):
            return None
        return self._next.portable(self._params())

    # ------------------------------------------------------------------ the transition
    @torch.no_grad()
    def step(  # type: ignore[override]
        self,
        closure: Callable[[], Any] | None = None,
        *,
        loss_fn: Callable[[Any], Tensor] | None = None,
    ) -> Tensor:
        """Make one HMC transition (momentum, leapfrog trajectory, Metropolis test).

        Give exactly one of ``closure`` (the torch.optim way) and ``loss_fn`` (the
        functional way, which ``compile=True`` runs as one compiled graph).

        Args:
            closure: zeroes the gradients, computes the full-batch mean loss (a scalar, or
                one per ensemble member), calls ``backward()`` and returns the loss.
            loss_fn: the full-batch mean loss (a scalar, or one per ensemble member) as a
                pure function of the parameters, without ``backward()``: it receives a dict
                ``{name: tensor}`` when the optimizer knows every parameter's name (built
                from ``model.named_parameters()``, ready for
                ``torch.func.functional_call(model, params, x)``), else a tuple in the
                optimizer's order. Gradients come from ``torch.func.grad``. Every parameter
                that requires grad is sampled (one the loss does not use, from its prior:
                the weight decay), the others are constants; a closure's chain leaves out
                the parameters its ``backward()`` gives no gradient.

        Returns:
            The mean loss at the chain's new state (per member for an ensemble).

        Raises:
            ValueError: neither or both of ``closure`` and ``loss_fn``, an invalid
                hyperparameter, a loss of the wrong shape, or a ``loss_fn`` that writes
                into its parameters.
            TypeError: a ``closure`` or ``loss_fn`` that is not callable, or a closure
                that returns something other than a loss (such as None).

        The start, the loss and its gradient at the current parameters, is the last step's
        end (not evaluated again) when this step gets the same ``closure`` or ``loss_fn``
        object (a bound method: of the same object) and nothing wrote into the parameters
        since; otherwise (another target, the first step after loading a state) it is
        evaluated first. A step that raises -- whatever the exception, ``KeyboardInterrupt``
        included, and wherever in the trajectory -- leaves everything as it was before the
        step, bit for bit: the parameters, their ``.grad``, the optimizer's state (the random
        counters among it: a retried step draws the same momentum) and the diagnostics.
        """
        check_one_of(
            closure,
            loss_fn,
            where="HMC.step",
            expected="a closure that zeroes the gradients, computes the full-batch loss, calls "
            "backward() and returns the loss; or loss_fn, the full-batch loss as a function "
            "of the parameters",
        )
        self._check_groups()
        undo = Rollback(
            self.param_groups, self.state, self._hmc_state, self._next, clone_grads=loss_fn is None
        )
        try:
            if loss_fn is not None:
                return self._loss_fn_step(loss_fn, undo)
            assert closure is not None
            return self._closure_step(closure, undo)
        except BaseException:
            undo.restore()
            raise

    @torch.no_grad()
    def run(
        self,
        loss_fn: Callable[[Any], Tensor],
        num_draws: int,
        *,
        thin: int = 1,
        progress: bool | None = None,
    ) -> HMCRun:
        """``num_draws * thin`` transitions in one call; every ``thin``-th state is a draw.

        The chain of as many ``step(loss_fn=loss_fn)`` calls, bit for bit: the draws, and
        the optimizer afterwards (parameters, ``.grad``, ``state_dict()``); with
        ``compile=True`` up to 64 transitions per compiled region, as BlackJAX's
        ``lax.scan``. During the warm-up each transition is a ``step``. A run that raises
        changes nothing (see ``hmc.run``).

        Args:
            loss_fn: the full-batch mean loss of the parameters, as for :meth:`step`.
            num_draws: the number of draws (an integer >= 1).
            thin: transitions per draw (default: 1; an integer >= 1).
            progress: a tqdm bar over the transitions (default None: where standard error
                is a terminal and tqdm is installed; True or False to choose).

        Returns:
            :class:`~samplers_as_optim.hmc.run.HMCRun`: ``samples`` (name ->
            ``[num_draws, *shape]``), the ``loss`` and ``diagnostics`` of each draw.
        """
        return run_chain(self, loss_fn, num_draws, thin=thin, progress=progress)

    def _closure_step(self, closure: Callable[[], Any], undo: Rollback) -> Tensor:
        """:meth:`step` by closure (see ``closure_transition``), moving the parameters."""
        params = self._params()
        evaluate = lambda: closure_start(closure, params)  # noqa: E731
        start = self._next.take(params, closure, valid=undo.start_valid, evaluate=evaluate)
        draws = self._draw(start)
        if self.param_groups[0].get("compile", False) and not self._warned_compile:
            self._warned_compile = True
            warnings.warn(NOT_COMPILED, UserWarning, stacklevel=4)
        start_values = [p.clone() for p in start.chain]
        undo.keep_values(start.chain, start_values)
        loss, raw, diagnostics, self._next.energy = closure_transition(
            closure, self.param_groups, start, draws, start_values
        )
        return self._finish(start, diagnostics, loss, raw, closure)

    def _loss_fn_step(self, loss_fn: Callable[[Any], Tensor], undo: Rollback) -> Tensor:
        """:meth:`step` by loss function (see ``_functional``), then moving the parameters."""
        from . import _functional  # the functional path, loaded on first use

        evaluate = lambda: _functional.functional_start(loss_fn, self.param_groups)  # noqa: E731
        start = self._next.take(self._params(), loss_fn, valid=undo.start_valid, evaluate=evaluate)
        result = _functional.run_transition(loss_fn, self.param_groups, start, self._draw(start))
        undo.keep_values(start.chain)
        for p, new, g in zip(start.chain, result.positions, result.gradients, strict=True):
            p.copy_(new)
            p.grad = g.clone()
        return self._finish(start, result.diagnostics, result.loss, result.gradients, loss_fn)

    def _draw(self, start: Start) -> TransitionDraws:
        """This transition's step multiplier and random numbers (see ``transition_draws``)."""
        keys = self._noise_keys(start.chain)
        return draw_transition(
            self.param_groups, self.state, self._hmc_state, start, self._stream, keys
        )

    def _finish(
        self,
        start: Start,
        diagnostics: dict[str, Tensor],
        loss: Tensor,
        raw: list[Tensor],
        target: Callable[..., Any],
    ) -> Tensor:
        """After a transition: diagnostics, adaptation, noise keys, counters, next start."""
        hmc = self._hmc_state
        hmc["diagnostics"] = diagnostics
        if hmc["warmup"]:
            target = self.param_groups[0]["target_accept"]
            adaptation.adapt_(
                hmc, self.state, start.chain, diagnostics["accept_prob"], start.members, target
            )
        self._record_noise_keys(start.chain)  # the keys the momenta were drawn with
        for group in self.param_groups:
            group["step"] += 1
        self._next.remember(self._params(), start.chain, loss, raw, target)
        return loss
