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

Adaptation (warm-up). With ``target_accept`` the step multiplier :math:`s` follows
dual averaging (Hoffman & Gelman 2014, Algorithm 5; see ``_dual_averaging``) until
:meth:`HMC.end_warmup`, which freezes the averaged iterate :math:`\bar s`. With
``mass="adapt"`` the diagonal mass is estimated from the warm-up draws
(:math:`M^{-1} \propto` their variance, regularised as Stan does and normalised to mean 1
per chain so that ``lr`` keeps its meaning); :meth:`HMC.warmup` runs Stan's windowed
schedule (mass updated at the end of doubling windows, step size re-adapted after each).
Adaptation breaks the Markov property, so samples are drawn after the warm-up.

Jitter. With ``jitter`` j each transition uses :math:`s (1 + j (2u - 1))`,
:math:`u \sim U(0, 1)`: the trajectory length :math:`L\epsilon` varies, which avoids the
periodic orbits a fixed length can fall into (Neal 2011, Section 5.4.2.2).

Parallel chains. When the closure returns one loss per member (shape ``[K]``, the
members' mean losses, for parameters stacked with the member dimension first, as in a
:class:`~samplers_as_optim.ParallelEnsemble`), the K chains share every vmapped forward
and backward but each has its own energy, Metropolis test, step size and diagnostics:
K independent chains.

Randomness is counter based (``samplers_as_optim.core.streams``): the momentum of a parameter
is ``NoiseStream(seed).draw`` at ``(step, parameter key)``, scaled by
:math:`\sqrt{T M}`; the uniforms of the test and of the jitter come from generators
seeded by ``(seed, step, key)`` with keys of their own. The chain's random state is
``group["seed"]`` and ``group["step"]``, as for the other samplers.

References:
    R. M. Neal. MCMC using Hamiltonian dynamics. Handbook of MCMC, 2011 (Eq. 5.18--5.20,
    Section 5.3.2.1).
    M. D. Hoffman and A. Gelman. The No-U-Turn Sampler. JMLR 15, 2014 (Algorithm 5).
    P. Izmailov, S. Vikram, M. D. Hoffman, A. G. Wilson. What are Bayesian neural network
    posteriors really like? ICML 2021.
"""

from __future__ import annotations

import copy
import hashlib
import math
import reprlib
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

import torch
from torch import Tensor
from torch.optim import Optimizer

from ..core.dtensor import is_dtensor
from ..core.streams import NoiseStream, derive_seed, parameter_key, seed_from_global_rng
from ..core.validation import (
    check_nonnegative,
    check_num_data,
    check_open_unit_interval,
    check_positive,
    check_positive_int,
    check_seed,
    check_temperature,
)
from ..names import parameter_layout, parameter_name
from ..sgmcmc.optimizer import check_representable as check_scalars_fit
from ._dual_averaging import (
    DualAveragingState,
    dual_averaging_init,
    dual_averaging_update,
)
from .dynamics import (
    StepSize,
    gradient_map,
    kinetic_energy,
    leapfrog_,
    member_sum,
    member_view,
    metropolis_log_accept,
    metropolis_test,
    potential_energy,
    scaled_gradients,
    tensor_step_sizes,
    transition_diagnostics,
)

__all__ = [
    "HMC",
    "kinetic_energy",
    "leapfrog_",
    "metropolis_log_accept",
    "metropolis_test",
    "potential_energy",
    "scaled_gradients",
    "tensor_step_sizes",
    "transition_diagnostics",
]

_broadcast_shapes: Callable[..., torch.Size] = torch.broadcast_shapes
#: keys of the uniforms of the accept test and of the jitter (apart from parameter keys)
_ACCEPT_KEY = derive_seed(0x484D43, 1)
_JITTER_KEY = derive_seed(0x484D43, 2)
#: the optimizer-level entry of ``self.state``: adaptation and diagnostics
_STATE_KEY = "hmc"
#: the entry of a saved state holding the start of the next step (see ``HMC.state_dict``)
_START_KEY = "start"
POOLED_ADAPTATION = True
#: hyperparameters that one Metropolis test needs to be the same in every group
_SHARED = ("num_data", "temperature", "num_steps", "jitter", "target_accept")


def _check_one_of(closure: Any, loss_fn: Any, *, where: str, expected: str) -> None:
    """Exactly one of ``closure`` and ``loss_fn`` (the two ways to evaluate the loss), callable."""
    if (closure is None) == (loss_fn is None):
        raise ValueError(
            f"{where} needs a closure or a loss_fn, not "
            + ("neither" if closure is None else "both")
            + f" (expected {expected})"
        )
    if closure is not None and not callable(closure):
        raise TypeError(
            f"Invalid closure: {reprlib.repr(closure)} (expected a callable that zeroes the "
            "gradients, computes the full-batch mean loss, calls backward() and returns the loss)"
        )
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(
            f"Invalid loss_fn: {reprlib.repr(loss_fn)} (expected a callable: the full-batch "
            "mean loss as a function of the parameters)"
        )


def _closure_loss(value: Any) -> Tensor:
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


#: the largest finite value of each dtype met so far (``torch.finfo`` costs a call per step)
_LARGEST: dict[torch.dtype, float] = {}


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


def _fingerprint(tensors: Sequence[Tensor]) -> str | None:
    """A digest of the tensors' shapes, dtypes and bytes (None where torch has no numpy).

    Says whether a start carried in a state dict (``HMC.state_dict``) was computed at the
    parameters it is loaded into: equal digests, equal bits.
    """
    digest = hashlib.blake2b(digest_size=16)
    for tensor in tensors:
        flat = tensor.detach().reshape(-1).contiguous().cpu()
        digest.update(f"{tuple(tensor.shape)} {tensor.dtype};".encode())
        try:
            digest.update(flat.view(torch.uint8).numpy().tobytes())
        except (RuntimeError, TypeError):  # torch built or installed without numpy
            return None
    return digest.hexdigest()


def _check_start(start: Any) -> None:
    """Raise unless ``start`` is None or the start of a step as ``HMC.state_dict`` saves it."""
    if start is None:
        return
    valid = (
        isinstance(start, dict)
        and isinstance(start.get("params"), list)
        and len(start["params"]) > 0
        and all(type(i) is int for i in start["params"])
        and isinstance(start.get("loss"), Tensor)
        and isinstance(start.get("gradients"), list)
        and len(start["gradients"]) == len(start["params"])
        and all(isinstance(g, Tensor) for g in start["gradients"])
        and isinstance(start.get("fingerprint"), str)
    )
    if not valid:
        raise ValueError(
            f"Invalid state_dict: its 'hmc' entry's {_START_KEY!r} is {reprlib.repr(start)} "
            "(expected None or what HMC.state_dict() saves there: a dict of 'params', "
            "'loss', 'gradients' and 'fingerprint')"
        )


class _Undo:
    """What a step may change, as it was before the step (``HMC._save``, ``HMC._restore``)."""

    def __init__(self) -> None:
        #: (parameter, its .grad, a copy of the values or None, the .grad's version)
        self.grads: list[tuple[Tensor, Tensor | None, Tensor | None, int]] = []
        #: (parameter, a copy of its values, its version), added before the step moves it
        self.values: list[tuple[Tensor, Tensor, int]] = []
        self.steps: list[Any] = []
        self.hmc: dict[str, Any] = {}
        self.param_state: dict[Tensor, dict[str, Any]] | None = None
        self.cache: tuple[list[int], list[int], Tensor, list[Tensor]] | None = None
        self.cache_valid = False
        self.start: tuple[tuple[Any, ...], Tensor, list[Tensor]] | None = None
        self.loaded: dict[str, Any] | None = None


def _members_of(loss: Tensor, chain: Sequence[Tensor], source: str) -> int:
    """K, for a loss of one value per member: every parameter must be stacked K first."""
    members = int(loss.shape[0])
    for p in chain:
        if p.dim() == 0 or p.shape[0] != members:
            raise ValueError(
                f"Invalid loss returned by {source}: shape {tuple(loss.shape)} (one loss per "
                f"member) but a parameter has shape {tuple(p.shape)} (expected every "
                f"parameter stacked with the {members} members first)"
            )
    return members


class HMC(Optimizer):
    r"""Full-batch Hamiltonian Monte Carlo with a Metropolis test, as an optimizer.

    One ``step(closure)`` is one Markov transition: a fresh momentum
    :math:`r \sim \mathcal N(0, T M)`, ``num_steps`` leapfrog steps of size
    :math:`\epsilon = s\sqrt{lr/N}`, and a Metropolis accept/reject at temperature T (see
    the module docstring for the derivation of the units and of exactness). The closure
    zeroes the gradients, computes the full-batch mean loss, calls ``backward()`` and
    returns the loss, as for ``torch.optim.LBFGS``; it is called ``num_steps`` times per
    step (plus once when the parameters were changed from outside since the last step).
    After a step each parameter holds the chain's new state and ``.grad`` the gradient of
    the mean loss there (exactly the values before the step when it was rejected). A step
    that raises (a failing closure or loss function, an interrupt) changes nothing at all.

    ``step(loss_fn=...)`` is the functional alternative to the closure: the mean loss as
    a function of the parameters (a dict by name, as ``torch.func.functional_call``
    takes it, or a tuple), differentiated with ``torch.func.grad``. It is the same chain
    (the same random numbers and decisions, states equal up to rounding), and with
    ``compile=True`` the whole transition -- every leapfrog step's forward and backward,
    the energies, the test -- runs as one ``torch.compile`` graph instead of one Python
    round trip per leapfrog step (see ``benchmarks/bench_hmc.py`` for what it saves).

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

    #: runtime, not the chain's state (rebuilt after loading, see ``_reset_runtime``)
    _streams: dict[int, NoiseStream]
    _keys: dict[int, int] | None
    #: (parameter ids, their versions, loss, raw gradients) at the end of the last step
    _cache: tuple[list[int], list[int], Tensor, list[Tensor]] | None
    #: (U, grad U) at the cached start, with the (N, weight decays) they were made with
    _start: tuple[tuple[Any, ...], Tensor, list[Tensor]] | None
    #: the hyperparameters last validated (plain numbers only), see ``_check_groups``
    _checked: tuple[Any, ...] | None
    #: whether step(closure) has said that compile=True does not apply to it
    _warned_compile: bool
    #: the start carried by a loaded state (see ``_portable_start``), until the next step
    _loaded_start: dict[str, Any] | None

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
        self._check_group(defaults, where="")
        if not (mass is None or isinstance(mass, (str, Sequence))):
            raise TypeError(
                f"Invalid mass: {mass!r} (expected None, 'adapt' or a sequence of tensors, "
                "one per parameter)"
            )
        if isinstance(mass, str) and mass != "adapt":
            raise ValueError(
                f"Invalid mass: {mass!r} (expected None, 'adapt' or a sequence of tensors, "
                "one per parameter)"
            )
        defaults["seed"] = seed_from_global_rng() if seed is None else seed
        defaults["step"] = 0
        super().__init__(params, defaults)
        self._reset_runtime()
        for index, group in enumerate(self.param_groups):
            where = "" if len(self.param_groups) == 1 else f" in param group {index}"
            self._check_representable(group, where=where)
        all_params = [p for group in self.param_groups for p in group["params"]]
        for p in all_params:
            if is_dtensor(p) or parameter_layout(p) not in (None, (0, p.numel())):
                raise NotImplementedError(
                    f"HMC does not support parameters split over processes yet (a parameter "
                    f"of shape {tuple(p.shape)} is a DTensor shard or a ParallelEnsemble "
                    "share of a process group): its energy and accept test need the whole "
                    "chain; run HMC in one process per chain"
                )
        if isinstance(mass, Sequence) and not isinstance(mass, str):
            self._set_mass(all_params, list(mass))
        adapt_mass = mass == "adapt"
        cast(Any, self.state)[_STATE_KEY] = {
            "warmup": target_accept is not None or adapt_mass,
            "adapt_mass": adapt_mass,
            "collect_mass": adapt_mass,
            "mass_count": 0,
            "log_step": None,  # log s per chain, created at the first step
            "dual_averaging": None,
            "diagnostics": None,
        }

    # ------------------------------------------------------------------ validation
    @staticmethod
    def _check_group(group: dict[str, Any], *, where: str) -> None:
        check_positive("lr", group["lr"], where=where)
        check_positive_int("num_steps", group["num_steps"], where=where)
        check_num_data(group["num_data"], where=where)
        check_temperature(
            group["temperature"],
            where=where,
            positive=True,
            reason="the Metropolis test divides by T",
        )
        check_nonnegative("weight_decay", group["weight_decay"], where=where)
        jitter = group["jitter"]
        if isinstance(jitter, bool) or not isinstance(jitter, (int, float)):
            raise TypeError(f"Invalid jitter{where}: {jitter!r} (expected a number in [0, 1))")
        if not 0.0 <= jitter < 1.0:
            raise ValueError(f"Invalid jitter{where}: {jitter!r} (expected a number in [0, 1))")
        if group["target_accept"] is not None:
            check_open_unit_interval("target_accept", group["target_accept"], where=where)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Validate a param group (shared hyperparameters must match), then add it."""
        where = ""
        if isinstance(param_group, dict) and hasattr(self, "param_groups"):
            where = f" in param group {len(self.param_groups)}"
            if self.param_groups:
                param_group.setdefault("seed", self.param_groups[0]["seed"])
                param_group.setdefault("step", self.param_groups[0]["step"])
            candidate = {**self.defaults, **param_group}
            self._check_group(candidate, where=where)
            check_seed(candidate["seed"], where=where)
        super().add_param_group(param_group)
        self._keys = None
        if hasattr(self, "_checked"):  # after the constructor (which checks every group)
            try:
                self._check_representable(self.param_groups[-1], where=where)
            except ValueError:
                self.param_groups.pop()
                raise

    def _check_representable(self, group: dict[str, Any], *, where: str) -> None:
        r"""Raise unless ``lr``, ``weight_decay`` and ``num_data`` fit the group's dtypes.

        The samplers' check (``_optimizer.check_representable``) without its noise scale
        (HMC has none: its momentum is drawn at scale :math:`\sqrt{T M}`). The leapfrog
        step :math:`\sqrt{lr/N}\,(1 + j) < 2\sqrt{lr}` then fits too, and a step passes
        it (as ``alpha``) and N to torch as scalars of the parameters' dtype.
        """
        params = [p for p in group["params"] if p.is_floating_point()]
        check_scalars_fit({**group, "temperature": 0.0}, params, where=where)
        for dtype in {p.dtype for p in params}:
            largest = torch.finfo(dtype).max
            if not group["num_data"] <= largest:
                raise ValueError(
                    f"Invalid num_data{where}: {group['num_data']!r} (expected a value that "
                    f"fits {dtype}, at most {largest:.3g})"
                )

    def _check_groups(self) -> None:
        # validated once per distinct setting: a step re-checks only what changed
        names = ("lr", "num_steps", "num_data", "temperature", "weight_decay", *_SHARED)
        values = tuple((type(g[n]), g[n]) for g in self.param_groups for n in names)
        plain = all(kind in (int, float, type(None)) for kind, _ in values)
        dtypes = tuple(p.dtype for g in self.param_groups for p in g["params"])
        if plain and (values, dtypes) == self._checked:
            return
        self._checked = None
        first = self.param_groups[0]
        for index, group in enumerate(self.param_groups):
            where = f" in param group {index}"
            self._check_group(group, where=where)
            for name in _SHARED:
                if group[name] != first[name]:
                    raise ValueError(
                        f"Invalid {name}{where}: {group[name]!r} (expected the value of param "
                        f"group 0, {first[name]!r}: one Metropolis test covers every group)"
                    )
            self._check_representable(group, where=where)
        self._checked = (values, dtypes) if plain else None

    def _set_mass(self, params: list[Tensor], masses: list[Any]) -> None:
        if len(masses) != len(params):
            raise ValueError(
                f"Invalid mass: {len(masses)} tensors (expected one per parameter, {len(params)})"
            )
        for index, (param, m) in enumerate(zip(params, masses, strict=True)):
            if not isinstance(m, Tensor):
                raise TypeError(
                    f"Invalid mass[{index}]: {m!r} (expected a tensor of positive numbers)"
                )
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
            self.state[param]["mass"] = m.detach().to(param.device, param.dtype).clone()

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

    # ------------------------------------------------------------------ runtime
    def _reset_runtime(self) -> None:
        """What is not the chain's state: noise streams, keys, the gradient cache."""
        self._streams = {}
        self._keys = None
        self._cache = None
        self._start = None
        self._checked = None
        self._warned_compile = False
        self._loaded_start = None

    def __getstate__(self) -> dict[str, Any]:
        """``torch.optim``'s pickled state, and the start of the next step (see ``state_dict``)."""
        state: dict[str, Any] = super().__getstate__()
        start = self._portable_start()
        return state if start is None else {**state, _START_KEY: start}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore a pickled or deep-copied optimizer: the same chain continues."""
        state = dict(state)
        start = state.pop(_START_KEY, None)
        super().__setstate__(state)
        self._reset_runtime()
        self._loaded_start = start

    def _stream(self, seed: int) -> NoiseStream:
        stream = self._streams.get(seed)
        if stream is None:
            stream = self._streams[seed] = NoiseStream(seed)
        return stream

    def _noise_key(self, param: Tensor) -> int:
        """The key of a parameter's momentum: its name if known, else its index."""
        if self._keys is None:
            self._keys = {}
            index = 0
            for group in self.param_groups:
                names = group.get("param_names")
                for position, p in enumerate(group["params"]):
                    identity = names[position] if names else parameter_name(p)
                    self._keys[id(p)] = parameter_key(index if identity is None else identity)
                    index += 1
        return self._keys[id(param)]

    # ------------------------------------------------------------------ state
    @property
    def _hmc_state(self) -> dict[str, Any]:
        """The optimizer-level entry of ``self.state``: adaptation and diagnostics."""
        found: dict[str, Any] = cast(Any, self.state)[_STATE_KEY]
        return found

    @property
    def seed(self) -> int:
        """The seed of the chain (param group 0's ``seed``)."""
        return int(self.param_groups[0]["seed"])

    @property
    def steps_taken(self) -> int:
        """How many transitions this optimizer has made (restored by ``load_state_dict``)."""
        return int(self.param_groups[0]["step"])

    @property
    def warming_up(self) -> bool:
        """Whether the step size (or the mass) is still being adapted."""
        return bool(self._hmc_state["warmup"])

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

        With ``compile=True`` the ``"hmc"`` entry also carries the start of the next step
        (``"start"``: the loss and its gradient at the current parameters, as the last
        compiled transition computed them, with a digest of the parameters). The start is
        otherwise evaluated again after loading; eagerly that gives the same bits, but a
        compiled graph's fused arithmetic may differ from eager in the last place, and a
        resumed chain would then drift from the uninterrupted one. The loaded start is used
        only at parameters with the same digest (the same bits), else evaluated again.
        """
        state_dict = super().state_dict()
        state = dict(state_dict["state"])
        state[_STATE_KEY] = copy.deepcopy(state[_STATE_KEY])
        start = self._portable_start()
        if start is not None:
            state[_STATE_KEY][_START_KEY] = start
        state_dict["state"] = state
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state saved by :meth:`state_dict`: the chain continues bit for bit."""
        saved = state_dict.get("state", {}).get(_STATE_KEY)
        if not isinstance(saved, dict):
            raise ValueError(
                "Invalid state_dict: no 'hmc' entry in its state (expected the state_dict() "
                "of an HMC optimizer)"
            )
        for group in state_dict.get("param_groups", []):
            if "seed" not in group or "step" not in group:
                raise ValueError(
                    "Invalid state_dict: its param groups lack the chain's random state "
                    "('seed' and 'step') (expected the state_dict() of an HMC optimizer)"
                )
        saved = copy.deepcopy(saved)
        start = saved.pop(_START_KEY, None)
        _check_start(start)
        super().load_state_dict(state_dict)
        cast(Any, self.state)[_STATE_KEY] = saved
        self._reset_runtime()
        self._loaded_start = start

    def _portable_start(self) -> dict[str, Any] | None:
        """The cached start of the next step, by parameter position, for a saved state.

        Only with ``compile=True`` (see :meth:`state_dict`); None without a valid cache.
        """
        if not self.param_groups[0].get("compile", False):
            return None
        cache = self._cache
        if cache is None or self._versions_of(cache[0]) != cache[1]:
            return self._loaded_start  # loaded and not used yet (checked when it is)
        position = {
            id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])
        }
        chain = self._params_by_id(cache[0])
        fingerprint = _fingerprint(chain)
        if fingerprint is None:
            return None
        return {
            "params": [position[id(p)] for p in chain],
            "loss": cache[2],
            "gradients": list(cache[3]),
            "fingerprint": fingerprint,
        }

    def _loaded_start_here(
        self, functional: bool
    ) -> tuple[list[Tensor], Tensor, list[Tensor]] | None:
        """The loaded start (chain, loss, raw gradients) if made at the current parameters.

        ``functional``: for ``loss_fn``, whose chain is the parameters that require grad
        (a closure's is those its ``backward()`` reaches, as when the start was saved).
        """
        start = self._loaded_start
        if start is None:
            return None
        params = [p for g in self.param_groups for p in g["params"]]
        if not all(0 <= i < len(params) for i in start["params"]):
            return None
        chain = [params[i] for i in start["params"]]
        if functional:
            sampled = [p for p in params if p.requires_grad]
            if len(sampled) != len(chain) or any(
                a is not b for a, b in zip(sampled, chain, strict=True)
            ):
                return None
        shapes = all(g.shape == p.shape for g, p in zip(start["gradients"], chain, strict=True))
        if not shapes or _fingerprint(chain) != start["fingerprint"]:
            return None
        loss = start["loss"].to(chain[0].device)
        grads = [g.to(p.device) for g, p in zip(start["gradients"], chain, strict=True)]
        return chain, loss, grads

    # ------------------------------------------------------------------ evaluation
    def _evaluate(
        self, closure: Callable[[], Any], chain: list[Tensor] | None, members: int | None
    ) -> tuple[list[Tensor], Tensor, list[Tensor], int | None]:
        """Call the closure; return the chain's parameters, the loss, the raw gradients.

        ``chain`` None: the start of a transition, which decides the chain (and ``members``
        from the loss's shape); otherwise the loss must have the start's shape.
        """
        with torch.enable_grad():
            loss = _closure_loss(closure())
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
                f"Invalid loss returned by the closure: shape {tuple(loss.shape)} (expected "
                + expected
            )
        if chain is None:
            chain = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
            if not chain:
                raise ValueError(
                    "HMC.step: no parameter has a gradient after the closure (expected the "
                    "closure to call backward())"
                )
            if loss.dim() == 1:
                members = _members_of(loss, chain, "the closure")
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

    def _reevaluate(
        self, closure: Callable[[], Any], chain: list[Tensor], members: int | None
    ) -> tuple[Tensor, list[Tensor]]:
        """:meth:`_evaluate` inside a trajectory (the chain known): the loss, the gradients."""
        with torch.enable_grad():
            loss = _closure_loss(closure())
        if loss.shape != (() if members is None else (members,)):
            return self._evaluate(lambda: loss, chain, members)[1:3]  # raises the error
        grads = [p.grad for p in chain]
        for g in grads:
            if g is None or g.is_sparse:
                return self._evaluate(lambda: loss, chain, members)[1:3]  # raises the error
        return loss, grads  # type: ignore[return-value]

    def _potential(
        self,
        chain: list[Tensor],
        loss: Tensor,
        grads: list[Tensor],
        members: int | None,
        decay: dict[int, float],
        num_data: int,
        *,
        gradients: bool = True,
    ) -> tuple[Tensor, list[Tensor]]:
        r""":math:`U` (float64) and :math:`\nabla U` (see :func:`potential_energy`)."""
        decays = [decay[id(p)] for p in chain]
        potential = potential_energy(loss, chain, decays, num_data, members)
        grad = scaled_gradients(chain, grads, decays, num_data) if gradients else []
        return potential, grad

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

        A step that raises -- whatever the exception, ``KeyboardInterrupt`` included, and
        wherever in the trajectory -- leaves everything as it was before the step, bit for
        bit: the parameters, their ``.grad``, the optimizer's state (the random counters
        among it: a retried step draws the same momentum) and the diagnostics.
        """
        _check_one_of(
            closure,
            loss_fn,
            where="HMC.step",
            expected="a closure that zeroes the gradients, computes the full-batch loss, calls "
            "backward() and returns the loss; or loss_fn, the full-batch loss as a function "
            "of the parameters",
        )
        self._check_groups()
        undo = self._save(clone_grads=closure is not None)
        try:
            return self._step(closure, loss_fn, undo)
        except BaseException:
            self._restore(undo)
            raise

    def _save(self, *, clone_grads: bool) -> _Undo:
        """What a step may change, as it is now (see :meth:`_restore`).

        The gradients' tensors are kept, and with ``clone_grads`` (a closure, which may
        zero them in place) their values too; the parameters' values are added by the step
        before it moves them (``undo.values``).
        """
        undo = _Undo()
        for group in self.param_groups:
            undo.steps.append(group["step"])
            for p in group["params"]:
                grad = p.grad
                if grad is None:
                    undo.grads.append((p, None, None, 0))
                else:
                    saved = grad.clone() if clone_grads else None
                    undo.grads.append((p, grad, saved, grad._version))
        hmc = self._hmc_state
        undo.hmc = dict(hmc)  # a step replaces the entries, never changes them in place
        if hmc["adapt_mass"] and hmc["collect_mass"]:  # the step adds a draw to the estimate
            undo.param_state = {
                p: dict(self.state[p])
                for group in self.param_groups
                for p in group["params"]
                if p in self.state
            }
        cache = self._cache
        undo.cache = cache
        undo.cache_valid = cache is not None and self._versions_of(cache[0]) == cache[1]
        undo.start = self._start
        undo.loaded = self._loaded_start
        return undo

    def _restore(self, undo: _Undo) -> None:
        """Put back what :meth:`_save` saved: the state before a step that failed."""
        for p, value, version in undo.values:
            if p._version != version:
                p.copy_(value)
        for p, grad, saved, version in undo.grads:
            p.grad = grad
            if grad is not None and saved is not None and grad._version != version:
                grad.copy_(saved)
        hmc = self._hmc_state
        hmc.clear()
        hmc.update(undo.hmc)
        if undo.param_state is not None:
            for p, *_ in undo.grads:
                if p in undo.param_state:
                    self.state[p] = undo.param_state[p]
                elif p in self.state:
                    del self.state[p]
        for group, step in zip(self.param_groups, undo.steps, strict=True):
            group["step"] = step
        cache = undo.cache
        if cache is not None and undo.cache_valid:  # still the start (the versions moved on)
            cache = (cache[0], self._versions_of(cache[0]), cache[2], cache[3])
        self._cache = cache
        self._start = undo.start
        self._loaded_start = undo.loaded

    def _step(
        self,
        closure: Callable[[], Any] | None,
        loss_fn: Callable[[Any], Tensor] | None,
        undo: _Undo,
    ) -> Tensor:
        """The transition of :meth:`step` (which undoes it, from ``undo``, if it raises)."""
        hmc = self._hmc_state
        first = self.param_groups[0]
        num_data = int(first["num_data"])
        temperature = float(first["temperature"])
        num_steps = int(first["num_steps"])
        jitter = float(first["jitter"])
        decay: dict[int, float] = {}
        root_lr: dict[int, float] = {}
        group_of: dict[int, dict[str, Any]] = {}
        for group in self.param_groups:
            for p in group["params"]:
                decay[id(p)] = float(group["weight_decay"])
                root_lr[id(p)] = math.sqrt(float(group["lr"]) / num_data)
                group_of[id(p)] = group

        # the start: (U, grad U) at the current parameters, cached from the last step (or
        # loaded with the state)
        cache = self._cache
        start_cache = self._start
        self._start = None
        loaded = None if undo.cache_valid else self._loaded_start_here(loss_fn is not None)
        self._loaded_start = None
        if cache is not None and undo.cache_valid:
            chain = [p for p in self._params_by_id(cache[0])]
            loss0, raw0 = cache[2], cache[3]
            members = None if loss0.dim() == 0 else int(loss0.shape[0])
        elif loaded is not None:
            chain, loss0, raw0 = loaded
            members = None if loss0.dim() == 0 else int(loss0.shape[0])
            start_cache = None
        elif loss_fn is not None:
            chain, loss0, raw0, members = self._evaluate_function(loss_fn)
            start_cache = None
        else:
            assert closure is not None
            chain, loss0, fresh, members = self._evaluate(closure, None, None)
            raw0 = [g.clone() for g in fresh]
            start_cache = None
        device = chain[0].device

        # the step size: s (per chain), jittered, times sqrt(lr / N) per group
        if hmc["log_step"] is None:
            shape = () if members is None else (members,)
            initial = torch.zeros(shape, dtype=torch.float64, device=device)
            hmc["log_step"] = initial
            if first["target_accept"] is not None and hmc["warmup"]:
                hmc["dual_averaging"] = dual_averaging_init(initial)._asdict()
        log_step = hmc["log_step"]
        multiplier = torch.exp(log_step)
        step0 = int(first["step"])
        stream0 = self._stream(int(first["seed"]))
        if jitter > 0:
            generator = stream0.generator(device, step=step0, key=_JITTER_KEY, block=0)
            u = torch.rand(log_step.shape, generator=generator, dtype=torch.float64, device=device)
            multiplier = multiplier * (1 + jitter * (2 * u - 1))
        step_sizes: list[StepSize]
        if members is None and loss_fn is None:  # Python floats, for updates with alpha
            scale = float(multiplier)
            step_sizes = [_in_range(scale * root_lr[id(p)], p.dtype) for p in chain]
        elif loss_fn is None:
            step_sizes = list(
                tensor_step_sizes(multiplier, [root_lr[id(p)] for p in chain], chain, members)
            )
        inverse_mass = [self._inverse_mass(p) for p in chain]

        # the momentum r ~ N(0, T M), from the counter-based stream
        momenta = []
        for p, inv in zip(chain, inverse_mass, strict=True):
            group = group_of[id(p)]
            xi = self._stream(int(group["seed"])).draw(
                p, step=int(group["step"]), key=self._noise_key(p)
            )
            scale = math.sqrt(temperature)
            if inv is not None:
                xi = xi * (scale / inv.sqrt())
            elif scale != 1.0:  # (xi * 1.0 is xi, bit for bit)
                xi = xi * scale
            momenta.append(xi)
        # the uniform of the Metropolis test
        generator = stream0.generator(device, step=step0, key=_ACCEPT_KEY, block=0)
        shape = () if members is None else (members,)
        uniform = torch.rand(shape, generator=generator, dtype=torch.float64, device=device)
        previous = hmc["diagnostics"]
        if previous is None:
            counts = torch.zeros(shape, dtype=torch.int64, device=device)
            previous = {"num_accepted": counts, "divergences": counts}
        params0 = self.param_groups[0]["params"]
        step_size = multiplier * root_lr[id(params0[0])] if params0 else multiplier

        loss: Tensor
        raw: list[Tensor]
        if loss_fn is not None:  # the whole transition as a function of tensors
            result = self._transition(loss_fn, device)(
                loss_fn,
                self._loss_fn_names(),
                [p.detach() for p in chain],
                raw0,
                loss0,
                momenta,
                uniform,
                multiplier,
                [root_lr[id(p)] for p in chain],
                inverse_mass,
                [decay[id(p)] for p in chain],
                step_size,
                previous["num_accepted"],
                previous["divergences"],
                self._frozen(),
                num_data=num_data,
                temperature=temperature,
                num_steps=num_steps,
                members=members,
            )
            undo.values = [(p, p.clone(), p._version) for p in chain]
            for p, new, g in zip(chain, result.positions, result.gradients, strict=True):
                p.copy_(new)
                p.grad = g.clone()
            diagnostics = result.diagnostics
            loss, raw = result.loss, result.gradients
        else:
            assert closure is not None
            if first.get("compile", False) and not self._warned_compile:
                self._warned_compile = True
                warnings.warn(
                    "HMC(compile=True) compiles step(loss_fn=...) only: step(closure) runs "
                    "eagerly (Tensor.backward() breaks a compiled graph); give step a loss "
                    "function of the parameters to compile the transition",
                    UserWarning,
                    stacklevel=4,
                )
            start = [p.clone() for p in chain]
            undo.values = [(p, p0, p._version) for p, p0 in zip(chain, start, strict=True)]
            energy_error, log_accept, accepted, loss, raw = self._closure_trajectory(
                closure,
                chain,
                start,
                momenta,
                step_sizes,
                inverse_mass,
                torch.log(uniform),
                loss0=loss0,
                raw0=raw0,
                start_cache=start_cache,
                decay=decay,
                members=members,
            )
            diagnostics = transition_diagnostics(
                energy_error,
                log_accept,
                accepted,
                step_size,
                temperature,
                previous["num_accepted"],
                previous["divergences"],
            )

        # diagnostics, adaptation, counters
        hmc["diagnostics"] = diagnostics
        if hmc["warmup"]:
            self._adapt(hmc, chain, diagnostics["accept_prob"], members)
        for group in self.param_groups:
            group["step"] += 1
        self._cache = (
            [id(p) for p in chain],
            self._versions_of([id(p) for p in chain]),
            loss,
            raw,
        )
        return loss

    def _closure_trajectory(
        self,
        closure: Callable[[], Any],
        chain: list[Tensor],
        start: list[Tensor],
        momenta: list[Tensor],
        step_sizes: list[StepSize],
        inverse_mass: list[Tensor | None],
        log_uniform: Tensor,
        *,
        loss0: Tensor,
        raw0: list[Tensor],
        start_cache: tuple[tuple[Any, ...], Tensor, list[Tensor]] | None,
        decay: dict[int, float],
        members: int | None,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, list[Tensor]]:
        """The trajectory and test in place, the closure filling ``.grad`` at each step.

        ``start``: copies of the parameters' values at the start. ``start_cache``: U and
        grad U at the start, as the last step left them (reused when made with the same N
        and weight decays). Returns ``(energy error, log acceptance,
        accepted, loss, raw gradients)`` at the chain's next state, which the parameters
        (and their ``.grad``) then hold.
        """
        first = self.param_groups[0]
        num_data, temperature = int(first["num_data"]), float(first["temperature"])
        signature = (num_data, *(decay[id(p)] for p in chain))
        if start_cache is not None and start_cache[0] == signature:
            potential0, gradients0 = start_cache[1], start_cache[2]  # the same bits, unrecomputed
        else:
            potential0, gradients0 = self._potential(chain, loss0, raw0, members, decay, num_data)
        energy0 = potential0 + kinetic_energy(momenta, inverse_mass, members)
        last: dict[str, Any] = {}
        gradient = gradient_map(chain, [decay[id(p)] for p in chain], num_data)

        def potential_gradient() -> tuple[None, list[Tensor]]:
            loss, raw = self._reevaluate(closure, chain, members)
            last["loss"], last["raw"] = loss, raw
            return None, gradient(raw)

        _, gradients1 = leapfrog_(
            chain,
            momenta,
            gradients0,
            potential_gradient,
            step_sizes=step_sizes,
            inverse_mass=inverse_mass,
            num_steps=int(first["num_steps"]),
        )
        potential1, _ = self._potential(
            chain, last["loss"], [], members, decay, num_data, gradients=False
        )
        energy1 = potential1 + kinetic_energy(momenta, inverse_mass, members)
        energy_error, log_accept, accepted = metropolis_test(
            energy0, energy1, log_uniform, temperature
        )
        loss1, raw1 = last["loss"], last["raw"]
        if members is None:
            if bool(accepted):
                loss, raw = loss1, [g.clone() for g in raw1]
                self._start = (signature, potential1, gradients1)
            else:
                for p, p0, g in zip(chain, start, raw0, strict=True):
                    p.copy_(p0)
                    p.grad = g.clone()
                loss, raw = loss0, raw0
                self._start = (signature, potential0, gradients0)
        else:
            raw = []
            for p, p0, g0, g1 in zip(chain, start, raw0, raw1, strict=True):
                keep = member_view(accepted, p, members)
                p.copy_(torch.where(keep, p, p0))
                raw.append(torch.where(keep, g1, g0))
                p.grad = raw[-1].clone()
            loss = torch.where(accepted.to(loss1.device), loss1, loss0)
        return energy_error, log_accept, accepted, loss, raw

    def _transition(
        self, loss_fn: Callable[[Any], Tensor], device: torch.device
    ) -> Callable[..., Any]:
        """The functional transition, compiled (per loss function) when ``compile=True``."""
        from . import _functional as _hmc_functional

        if not self.param_groups[0].get("compile", False):
            return _hmc_functional.transition
        return _hmc_functional.compiled_transition(loss_fn, device)

    def _loss_fn_names(self) -> tuple[str, ...] | None:
        """The parameters' names for ``loss_fn`` (all of them known), else None."""
        names: list[str] = []
        for group in self.param_groups:
            given = group.get("param_names")
            for position, p in enumerate(group["params"]):
                name = given[position] if given else parameter_name(p)
                if name is None:
                    return None
                names.append(name)
        return tuple(names)

    def _evaluate_function(
        self, loss_fn: Callable[[Any], Tensor]
    ) -> tuple[list[Tensor], Tensor, list[Tensor], int | None]:
        """The start of a functional chain: its parameters, the loss, its gradients.

        The chain is the parameters that require grad, as with a closure (whose
        ``backward()`` leaves the others without a gradient); ``loss_fn`` still receives
        every parameter, the frozen ones as constants.
        """
        from ._functional import value_and_gradients

        chain = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        if not chain:
            raise ValueError(
                "HMC.step: no parameter requires grad (expected at least one parameter "
                "with requires_grad=True to sample)"
            )
        # copies: a loss_fn writing into what it receives is refused with nothing changed
        positions = [p.detach().clone() for p in chain]
        frozen = self._frozen()
        fixed = None if frozen is None else [None if c is None else c.clone() for c in frozen]
        names = self._loss_fn_names()
        loss, grads = value_and_gradients(loss_fn, names, positions, None, fixed=fixed, check=False)
        members = _members_of(loss, chain, "loss_fn") if loss.dim() == 1 else None
        return chain, loss, grads, members

    def _frozen(self) -> list[Tensor | None] | None:
        """For ``loss_fn``: each parameter, None if it is sampled, itself if it is frozen."""
        params = [p for g in self.param_groups for p in g["params"]]
        if all(p.requires_grad for p in params):
            return None
        return [None if p.requires_grad else p.detach() for p in params]

    def _params_by_id(self, ids: list[int]) -> list[Tensor]:
        by_id = {id(p): p for g in self.param_groups for p in g["params"]}
        return [by_id[i] for i in ids]

    def _versions_of(self, ids: list[int]) -> list[int]:
        by_id = {id(p): p for g in self.param_groups for p in g["params"]}
        if not all(i in by_id for i in ids):
            return []
        return [hash((by_id[i]._version, by_id[i].data_ptr())) for i in ids]

    def _inverse_mass(self, param: Tensor) -> Tensor | None:
        mass = self.state[param].get("mass") if param in self.state else None
        return None if mass is None else 1.0 / mass

    # ------------------------------------------------------------------ warm-up
    def _adapt(
        self, hmc: dict[str, Any], chain: list[Tensor], accept_prob: Tensor, members: int | None
    ) -> None:
        target = self.param_groups[0]["target_accept"]
        if target is not None and hmc["dual_averaging"] is not None:
            state = DualAveragingState(**hmc["dual_averaging"])
            if members is not None and POOLED_ADAPTATION:
                accept_prob = accept_prob.mean().expand_as(accept_prob)
            state = dual_averaging_update(state, accept_prob, float(target))
            hmc["dual_averaging"] = state._asdict()
            hmc["log_step"] = state.log_step
        if hmc["adapt_mass"] and hmc["collect_mass"]:
            hmc["mass_count"] += 1
            n = hmc["mass_count"]
            for p in chain:
                state = self.state[p]
                if "mass_mean" not in state or n == 1:
                    state["mass_mean"] = p.detach().clone()
                    state["mass_m2"] = torch.zeros_like(p)
                    continue
                delta = p - state["mass_mean"]
                state["mass_mean"] = state["mass_mean"] + delta / n
                state["mass_m2"] = state["mass_m2"] + delta * (p - state["mass_mean"])

    def update_mass(self) -> bool:
        r"""Set the mass from the draws collected since the last update (``mass="adapt"``).

        :math:`M^{-1}` becomes the regularised variance of the draws (Stan's
        :math:`\frac{n}{n+5}\hat\sigma^2 + 10^{-3}\frac{5}{n+5}`), normalised to mean 1
        per chain; the estimator restarts, and so does dual averaging (from the current
        step size). Returns whether the mass was updated (it needs 3 draws or more).
        """
        hmc = self._hmc_state
        n = hmc["mass_count"]
        chain = [p for g in self.param_groups for p in g["params"] if "mass_m2" in self.state[p]]
        if not hmc["adapt_mass"] or n < 3 or not chain:
            return False
        members = (
            None
            if hmc["log_step"] is None or hmc["log_step"].dim() == 0
            else int(hmc["log_step"].shape[0])
        )
        variances = []
        for p in chain:
            var = self.state[p]["mass_m2"] / (n - 1)
            variances.append((n / (n + 5.0)) * var + 1e-3 * (5.0 / (n + 5.0)))
        total = sum(member_sum(v, members) for v in variances)
        count = sum(v.numel() for v in variances) // (1 if members is None else members)
        mean = total / count
        for p, var in zip(chain, variances, strict=True):
            scale = member_view(mean.to(var.dtype), var, members)
            self.state[p]["mass"] = scale / var
            del self.state[p]["mass_mean"], self.state[p]["mass_m2"]
        hmc["mass_count"] = 0
        if self.param_groups[0]["target_accept"] is not None and hmc["log_step"] is not None:
            hmc["dual_averaging"] = dual_averaging_init(hmc["log_step"])._asdict()
        return True

    def end_warmup(self) -> None:
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
        averaged = hmc["dual_averaging"]
        if averaged is not None and averaged["count"] > 0:
            hmc["log_step"] = averaged["log_step_avg"]
        for p in [p for g in self.param_groups for p in g["params"]]:
            for key in ("mass_mean", "mass_m2"):
                self.state[p].pop(key, None) if p in self.state else None
        hmc.update(warmup=False, collect_mass=False, dual_averaging=None)
        if hmc["diagnostics"] is not None:  # the counts start again with the sampling
            hmc["diagnostics"]["num_accepted"] = torch.zeros_like(
                hmc["diagnostics"]["num_accepted"]
            )
            hmc["diagnostics"]["divergences"] = torch.zeros_like(hmc["diagnostics"]["divergences"])

    def warmup(
        self,
        closure: Callable[[], Any] | None = None,
        num_steps: int | None = None,
        *,
        loss_fn: Callable[[Any], Tensor] | None = None,
    ) -> None:
        """Run ``num_steps`` warm-up transitions with Stan's schedule, then :meth:`end_warmup`.

        Each transition is ``step(closure)``, or ``step(loss_fn=loss_fn)`` (give one of
        them, as to :meth:`step`): ``opt.warmup(closure, 100)`` or
        ``opt.warmup(num_steps=100, loss_fn=loss_fn)``.

        Step size only: dual averaging throughout. With ``mass="adapt"``: a first 15% for
        the step size alone, then windows of doubling length (the last one stretched to
        the end of the middle 75%) after each of which the mass is set from the window's
        draws and dual averaging restarts, then a last 10% for the step size alone
        (Stan's reference manual, "HMC algorithm parameters": the 15% / 75% / 10% split
        Stan falls back to for short warm-ups, with a first window of about 1/35 of the
        middle part, as Stan's 25 steps of 875).
        """
        num_steps = check_positive_int("num_steps", num_steps)
        _check_one_of(closure, loss_fn, where="HMC.warmup", expected="what step() takes")
        hmc = self._hmc_state
        if not hmc["warmup"]:
            raise ValueError(
                "HMC.warmup: the warm-up is over (expected target_accept or mass='adapt', "
                "before end_warmup())"
            )
        ends: set[int] = set()
        init = term = 0
        if hmc["adapt_mass"] and num_steps >= 20:
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
        collect = hmc["collect_mass"]
        for t in range(num_steps):
            hmc["collect_mass"] = hmc["adapt_mass"] and init <= t < num_steps - term
            try:
                if loss_fn is None:
                    self.step(closure)
                else:
                    self.step(loss_fn=loss_fn)
            except BaseException:  # the failed step changed nothing; nor does the schedule
                hmc["collect_mass"] = collect
                raise
            if t + 1 in ends:
                self.update_mass()
        hmc["collect_mass"] = False
        self.end_warmup()
