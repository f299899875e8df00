r"""IVON, the improved variational online Newton method, as a ``torch.optim`` drop-in for AdamW.

IVON (Shen et al. 2024, Algorithm 1) learns a mean-field Gaussian
:math:`q(\theta) = \mathcal N(m, \mathrm{diag}(\sigma^2))` over the weights by
natural-gradient variational learning, at about Adam's cost: the mean m *is* the model's
parameters, and per weight the optimizer keeps a gradient momentum ḡ and a Hessian
estimate h.

**Symbols.** λ = ``ess``, the number of training examples N (``num_data`` elsewhere in
the package); δ = ``weight_decay``; T = ``temperature``;
:math:`\bar\ell(\theta)` the mean loss the user's ``backward()`` differentiates, *without*
the prior: as in AdamW, the optimizer adds the weight decay itself. The target is then
the posterior of ``docs/design.md`` under the prior :math:`\mathcal N(0, 1/(\lambda\delta))`
on every weight (``weight_decay = 1 / (N σ_p²)``, as for the samplers), with potential
:math:`U(\theta) = \lambda\big(\bar\ell(\theta) + \tfrac\delta2\lVert\theta\rVert^2\big)`.

**One step** t, after S training draws (``sampled_params(train=True)`` rounds, S =
``mc_samples`` in ``step(closure)``), each at :math:`\theta_s = m + \varepsilon_s`:

.. math::

    \varepsilon_s = \sigma\odot\xi_s,\ \ \xi_s\sim\mathcal N(0, I), \qquad
    \sigma^2 = \frac{T}{\lambda\,(h + \delta)},

    \hat g = \frac1S\sum_s \nabla\bar\ell(\theta_s), \qquad
    \hat h = \frac1S\sum_s \frac{\varepsilon_s\odot\nabla\bar\ell(\theta_s)}{\sigma^2}
    \ \ (\texttt{"price"}) \quad\text{or}\quad
    \hat h = \frac\lambda S\sum_s \nabla\bar\ell(\theta_s)^2\ \ (\texttt{"gradsq"}),

    \bar g \leftarrow \beta_1\bar g + (1-\beta_1)\hat g, \qquad
    h \leftarrow \beta_2 h + (1-\beta_2)\hat h + \tfrac12(1-\beta_2)^2
    \frac{(h - \hat h)^2}{h + \delta},

    m \leftarrow m - \alpha\,\mathrm{clip}\Big(\frac{\bar g/(1-\beta_1^t) + \delta m}
    {h + \delta},\ \pm r\Big), \qquad \alpha = lr\,(h_0 + \delta)\ \text{(``rescale_lr``)},

h₀ = ``hess_init``, r = ``clip_radius``: Algorithm 1 of the paper, with ĝ, ĥ, the
momentum, the h update (its ``β₂`` line), the debiased mean update and σ in its notation,
and ivon-opt's ``rescale_lr``.

**Why.** (i) ĥ (``"price"``) is unbiased for :math:`\mathrm{diag}\,\mathbb E_q[\nabla^2
\bar\ell]`: for Gaussian q, Stein's lemma gives :math:`\mathbb E_q[\nabla\bar\ell(\theta)
(\theta - m)^\top] = \mathbb E_q[\nabla^2\bar\ell]\,\Sigma`, whose diagonal divided by
:math:`\sigma_i^2` is :math:`\mathbb E[\varepsilon_i g_i]/\sigma_i^2` (the
reparameterisation-trick estimator of the paper; Price 1958). (ii) The h update is the
natural-gradient step on the precision with the second-order correction of Lin, Schmidt
& Khan (2020), which keeps it positive: with x = h + δ and u = (1-β₂)(ĥ - h)/x, the new
h + δ is :math:`x(1 + u + u^2/2) > 0` whatever ĥ. (iii) The mean update is the natural
gradient step on m (the Bayesian learning rule, Khan & Rue 2023), with momentum.

**Temperature.** The tempered target :math:`p_T \propto (p(D\mid\theta)p(\theta))^{1/T}
= e^{-U/T}` of ``docs/design.md`` has :math:`\mathrm{KL}(q\,\|\,p_T) = \mathbb E_q[U]/T -
\mathcal H(q) + c`. For Gaussian q with precision S, natural-gradient VI on it has the
fixed point :math:`S = \mathbb E_q[\nabla^2 U]/T = \lambda(\mathbb E_q[\nabla^2\bar\ell]
+ \delta)/T` and moves the mean by :math:`S^{-1}\mathbb E_q[\nabla U]/T =
(\mathbb E_q[\nabla\bar\ell] + \delta m)/(\mathbb E_q[\nabla^2\bar\ell] + \delta)`: T
cancels. So h estimates :math:`\mathbb E_q[\nabla^2\bar\ell]` at every T, the mean
update does not depend on T, and tempering only *divides the precision by T*:
σ² = T/(λ(h + δ)) (the Price estimator divides by this σ², so ĥ = ε g λ(h + δ)/T). At
the optimum on a Gaussian target of precision Λ the variances are
:math:`T/\mathrm{diag}(\Lambda)`, mean-field VI's optimum (``MeanFieldVI`` has the same).
What each argument does, never mixed: ``ess`` is how much data the likelihood holds (it
scales the precision together with the prior's per-example δ, and, for ``"gradsq"``, the
estimate ĥ itself); ``temperature`` divides the posterior precision. ivon-opt has no
temperature, and its users emulate one through ``ess``: with ``"price"`` (only),
``IVON(ess=N, temperature=T)`` takes exactly ivon-opt's ``IVON(ess=N / T)`` steps.

**T = 0.** ``"price"`` divides by σ² = 0, so it needs T > 0 (refused with that reason).
``"gradsq"`` needs no perturbation: at T = 0 the draws are the mean itself
(``sampled_params`` changes nothing) and the step is a deterministic, Adam-like optimizer
with the preconditioner h + δ; ``sample(n)`` gives n copies of the mean.

**Learning rate.** ḡ and h do not depend on the units of lr (unlike the samplers' SGD-unit
momenta), so a scheduler changes nothing but the step length.

**Randomness** is the chain core's (``samplers_as_optim.core.chain``): ``seed`` and
``step`` in the param groups, each parameter's noise key in its state, and the draw
counters ``train_draws``/``eval_draws`` of the current step in the param groups (see
``_noise``); nothing is drawn from torch's global RNG after construction, and
``state_dict`` round trips, ``copy.deepcopy`` and pickling continue the same run bit for
bit (a checkpoint is taken outside ``sampled_params``, where the parameters hold m).

**Differences from ivon-opt 0.1.3** (the same arguments, defaults and updates otherwise):
the temperature; the keyed noise (not ``torch.randn`` on the global RNG); per-parameter
state (``"momentum"``, ``"hess"``; any mix of dtypes and devices) rather than one flat
vector per group; the step counter of the bias correction is saved (ivon-opt's
``current_step`` is not in its ``state_dict``, so its resume restarts the correction);
parameters with ``requires_grad=False`` are neither perturbed nor updated (ivon-opt
perturbs them and applies momentum and weight decay to them); a gradient that is None at
a draw's end counts as zero (ivon-opt fails); ``sampled_params`` restores the parameters
also when its body raises, and refuses to nest; ``step(closure)`` opens
``sampled_params(train=True)`` around each call of the closure (a closure that opens its
own, as in ivon-opt's examples, works as is); ``step()`` refuses without a training draw,
and refuses a non-finite average gradient (changing nothing); ``beta1 = 1`` is refused
(the bias correction would divide by 0); ``sync`` also averages ``"gradsq"``'s statistic,
and the ranks share the perturbation (one seed, agreed as for the samplers). Not
supported: sparse gradients, complex parameters, parameters sharded over ranks (ZeRO,
FSDP), ``torch.compile`` of the step.

References:
    Y. Shen, N. Daheim, B. Cong, P. Nickl, G. M. Marconi, C. Bazan, R. Yokota,
    I. Gurevych, D. Cremers, M. E. Khan, T. Möllenhoff. Variational learning is effective
    for large deep networks. ICML 2024 (arXiv:2402.17641), Algorithm 1.
    W. Lin, M. Schmidt, M. E. Khan. Handling the positive-definite constraint in the
    Bayesian learning rule. ICML 2020.
    M. E. Khan, H. Rue. The Bayesian learning rule. JMLR 24, 2023.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn

from ...core.chain import at_group
from ...core.streams import seed_from_global_rng
from ...core.validation import check_bool, check_positive_int, check_seed
from ...samples.stacked import call_stacked
from ...sgmcmc.step.prefetch import NoisePrefetcher
from ._checks import (
    CHANGED_PARAMETERS,
    COUNTERS,
    Work,
    average_over_ranks,
    check_group,
    refuse_non_finite,
)
from ._draws import IVONDraws, draw_samples, posterior
from ._kernel import STATISTIC, update_
from ._state_checks import check_saved_groups, check_saved_state

__all__ = ["IVON"]


class IVON(IVONDraws):
    r"""Improved variational online Newton (Shen et al. 2024): mean-field VI as AdamW.

    A drop-in for ``torch.optim.AdamW`` with ivon-opt's arguments, in its order and with
    its defaults: the training loop draws weights with :meth:`sampled_params` before each
    forward and backward, and :meth:`step` updates the Gaussian
    :math:`q = \mathcal N(m, \mathrm{diag}(\sigma^2))`, σ² = T / (ess (h + weight_decay))
    (module docstring: the update, its derivation, the temperature and what differs from
    ivon-opt). The parameters hold the mean m outside :meth:`sampled_params`;
    :meth:`sample`, :attr:`mean`, :attr:`std` and :meth:`predict` give the posterior in
    the package's one sample layout (name -> ``[n, *shape]``, for
    :func:`~samplers_as_optim.call_stacked` and :mod:`~samplers_as_optim.predictive`).

    Args:
        params: parameters, ``named_parameters()`` (the names key the noise and the
            samples), or dicts defining param groups; every hyperparameter below but
            ``mc_samples``, ``sync``, ``seed`` and ``overlap_noise`` may differ per group.
        lr: learning rate (required; a finite number >= 0; ivon-opt suggests 0.1 with
            ``rescale_lr``).
        ess: λ, the number of training examples N, as ``num_data`` elsewhere (required;
            a finite number > 0).
        hess_init: h at the start (default: 1.0; a finite number > 0).
        beta1: the gradient momentum's decay (default: 0.9; in [0, 1)).
        beta2: the Hessian estimate's decay (default: 0.99999; in [0, 1]).
        weight_decay: δ, the prior N(0, 1 / (ess δ)) on every weight (default: 1e-4, as
            ivon-opt; a finite number >= 0); ``1 / (N prior_std**2)``.
        mc_samples: draws per ``step(closure)`` (default: 1; an integer >= 1).
        hess_approx: ``"price"`` (default; the reparameterisation estimator) or
            ``"gradsq"`` (squared gradients).
        clip_radius: clip each coordinate of the preconditioned step to ±clip_radius
            (default: inf; a number > 0).
        sync: under an initialised ``torch.distributed`` process group, average the
            step's gradient statistics over the ranks before the step (default: False;
            for data parallelism without DDP's own gradient averaging).
        debias: divide the momentum by 1 - beta1**t (default: True).
        rescale_lr: multiply lr by hess_init + weight_decay (default: True).
        temperature: T, the target is ``(p(D | θ) p(θ)) ** (1 / T)``; the variances are
            multiplied by T (default: 1.0; a finite number >= 0, > 0 with ``"price"``).
        seed: seed of the weight perturbations (default: None: drawn once from torch's
            global RNG at construction; an integer in [0, 2**64)).
        overlap_noise: draw the next training draw's normals on a worker thread while
            the forward and backward passes run (default: True; the same numbers).

    Example:
        >>> import torch
        >>> from samplers_as_optim import IVON
        >>> _ = torch.manual_seed(0)
        >>> x = torch.randn(256, 3)
        >>> y = x @ torch.tensor([1.0, -2.0, 0.5]) + 0.3 * torch.randn(256)
        >>> model = torch.nn.Linear(3, 1)
        >>> opt = IVON(model.named_parameters(), lr=0.1, ess=256, beta2=0.99,
        ...            weight_decay=1 / 256, seed=0)  # prior N(0, 1) on every weight
        >>> for _ in range(300):
        ...     with opt.sampled_params(train=True):
        ...         opt.zero_grad()
        ...         nll = ((model(x).squeeze(-1) - y) ** 2).mean() / (2 * 0.3**2)
        ...         nll.backward()
        ...     opt.step()
        >>> bool((opt.mean["weight"] - torch.tensor([1.0, -2.0, 0.5])).abs().max() < 0.1)
        True
        >>> opt.std["weight"].round(decimals=2)  # 1 / sqrt(diag of the posterior precision)
        tensor([[0.0200, 0.0200, 0.0200]])
        >>> opt.predict(model, x[:2], num_samples=10).shape
        torch.Size([10, 2, 1])
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float,
        ess: float,
        hess_init: float = 1.0,
        beta1: float = 0.9,
        beta2: float = 0.99999,
        weight_decay: float = 1e-4,
        mc_samples: int = 1,
        hess_approx: str = "price",
        clip_radius: float = math.inf,
        sync: bool = False,
        debias: bool = True,
        rescale_lr: bool = True,
        *,
        temperature: float = 1.0,
        seed: int | None = None,
        overlap_noise: bool = True,
    ) -> None:
        seed = check_seed(seed)
        self.mc_samples = check_positive_int("mc_samples", mc_samples)
        self._sync = check_bool("sync", sync)
        self._overlap_noise = check_bool("overlap_noise", overlap_noise)
        defaults: dict[str, Any] = {
            "lr": lr,
            "ess": ess,
            "hess_init": hess_init,
            "beta1": beta1,
            "beta2": beta2,
            "weight_decay": weight_decay,
            "hess_approx": hess_approx,
            "clip_radius": clip_radius,
            "debias": debias,
            "rescale_lr": rescale_lr,
            "temperature": temperature,
        }
        self.check_hyperparameters(defaults)
        defaults.update(seed=seed_from_global_rng() if seed is None else seed, step=0)
        defaults.update(dict.fromkeys(COUNTERS, 0))
        self._reset_runtime(seed_given=seed is not None)
        super().__init__(params, defaults)
        for group in self.param_groups:
            for param in group["params"]:
                if not param.is_floating_point():
                    raise TypeError(
                        f"Invalid params: a {param.dtype} tensor of shape "
                        f"{tuple(param.shape)} (expected real floating-point parameters)"
                    )

    # ------------------------------------------------------------------ checks and checkpoints
    @classmethod
    def check_hyperparameters(cls, group: dict[str, Any], *, where: str = "") -> None:
        """Validate one param group's hyperparameters (``where`` locates the group)."""
        check_group(group, where=where)

    def _reset_runtime(self, *, seed_given: bool) -> None:
        """What is not the chain's state: streams and keys, the open draw, the prefetch."""
        self._reset_chain_runtime()
        self._runtime.update(
            draw=None, agreed=False, seed_given=seed_given, checked={}, buffers={}, drawn={}
        )
        self._prefetcher = NoisePrefetcher() if self._overlap_noise else None

    def __getstate__(self) -> dict[str, Any]:
        """``torch.optim``'s state (the whole run) plus the optimizer-wide options."""
        return {
            **super().__getstate__(),
            "mc_samples": self.mc_samples,
            "_sync": self._sync,
            "_overlap_noise": self._overlap_noise,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore a pickled or deep-copied optimizer (or a loaded state): the run continues."""
        state.setdefault("mc_samples", getattr(self, "mc_samples", 1))
        state.setdefault("_sync", getattr(self, "_sync", False))
        state.setdefault("_overlap_noise", getattr(self, "_overlap_noise", True))
        super().__setstate__(state)
        self._reset_runtime(seed_given=True)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state saved by :meth:`state_dict`: the run continues bit for bit.

        Everything is checked before anything changes: the groups' hyperparameters, seed
        and counters, and each parameter's state (``_state_checks``: its entries,
        their shapes, finite values, hess + weight_decay > 0).

        Raises:
            ValueError: the state is not an IVON optimizer's, or holds an invalid value.
            RuntimeError: called inside :meth:`sampled_params`.
        """
        self._refuse_inside_draw("load_state_dict()")
        groups = state_dict.get("param_groups", [])
        check_saved_groups(groups)
        self._check_saved_chain(state_dict)
        for index, group in enumerate(groups):
            self.check_hyperparameters(group, where=at_group(index))
        check_saved_state(self.param_groups, state_dict)
        super().load_state_dict(state_dict)
        self._restore_noise_keys(state_dict)

    def state_dict(self) -> dict[str, Any]:
        """``torch.optim``'s state dict, with the running averages only within a step.

        The param groups hold the chain's ``seed``, ``step`` and draw counters, each
        parameter's state its ``momentum``, ``hess`` and ``noise_key``; between the
        training draws of a step also the running averages (``avg_grad``, ``avg_nxg`` or
        ``avg_gsq``), which are left out otherwise.
        """
        state_dict = super().state_dict()
        averages = ("avg_grad", *STATISTIC.values())
        index = 0
        packed = dict(state_dict["state"])
        for group in self.param_groups:
            for _ in group["params"]:
                entry = packed.get(index)
                if entry is not None and group["train_draws"] == 0:
                    packed[index] = {k: v for k, v in entry.items() if k not in averages}
                index += 1
        state_dict["state"] = packed
        return state_dict

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Update q from the training draws since the last step.

        A param group without a training draw since the last step (one added in between)
        is left as it is. Refused steps change nothing but discard the step's training
        draws when their averages are not finite.

        Args:
            closure: optional; called ``mc_samples`` times, each inside
                ``sampled_params(train=True)`` (a closure that opens it itself works as
                is); it zeroes the gradients, computes the loss, calls ``backward()`` and
                returns the loss.

        Returns:
            The closure's mean loss, or None.

        Raises:
            RuntimeError: no ``sampled_params(train=True)`` round since the last step, or
                called inside ``sampled_params``.
            FloatingPointError: an averaged gradient holds NaN or infinity; nothing was
                changed.
            ValueError: a param group holds an invalid hyperparameter (a schedule may
                have moved it); nothing was changed.
        """
        self._refuse_inside_draw("step()")
        loss = None
        if closure is not None:
            losses = []
            for _ in range(self.mc_samples):
                with torch.enable_grad(), self._draw(True, by_step=True):
                    losses.append(closure())
            loss = sum(losses) / self.mc_samples
        work = self._step_work()
        drawn = self._runtime["drawn"]
        try:
            refuse_non_finite(work)
        except FloatingPointError:  # the averages hold the non-finite values: discard them
            for _, group, _, _ in work:
                group["train_draws"] = 0
            drawn.clear()
            raise
        if self._sync:
            average_over_ranks(work)
        for _, group, params, states in work:
            self._update_group(group, params, states)
        for group in self.param_groups:
            group["step"] += 1
            group.update(dict.fromkeys(COUNTERS, 0))
        drawn.clear()
        return loss

    def _step_work(self) -> Work:
        """The groups a step updates, each checked; refused when none has a training draw."""
        work = []
        drawn = self._runtime["drawn"]
        for index, group in enumerate(self.param_groups):
            self._check_group(index, group)
            if group["train_draws"] == 0:
                continue
            params = [p for p in group["params"] if p.requires_grad]
            members = tuple(id(p) for p in params)
            key = STATISTIC[group["hess_approx"]]
            states = [self.state[p] for p in params]
            if drawn.get(index, members) != members or not all(key in s for s in states):
                raise RuntimeError(CHANGED_PARAMETERS)
            if params:
                work.append((index, group, params, states))
        if not work:
            raise RuntimeError(
                "IVON.step() needs the gradients of at least one sampled_params(train=True) "
                "round since the last step (or a closure)"
            )
        return work

    def _update_group(
        self, group: dict[str, Any], params: list[Tensor], states: list[dict[str, Any]]
    ) -> None:
        """One group's update from its step's averages (``_kernel.update_``)."""
        method = group["hess_approx"]
        update_(
            params,
            [s["momentum"] for s in states],
            [s["hess"] for s in states],
            [s["avg_grad"] for s in states],
            [s[STATISTIC[method]] for s in states],
            self._buffers(params),
            lr=float(group["lr"]),
            ess=float(group["ess"]),
            temperature=float(group["temperature"]),
            beta1=float(group["beta1"]),
            beta2=float(group["beta2"]),
            weight_decay=float(group["weight_decay"]),
            hess_init=float(group["hess_init"]),
            clip_radius=float(group["clip_radius"]),
            step=group["step"] + 1,
            hess_approx=method,
            debias=group["debias"],
            rescale_lr=group["rescale_lr"],
        )

    # ------------------------------------------------------------------ the posterior
    def _posterior(self) -> list[tuple[str, Tensor, Tensor]]:
        """(name, m, σ) of every parameter that requires a gradient (m also in a draw)."""
        active = self._runtime["draw"]
        parts = [] if active is None else [part for part in active.groups if part.perturbed]
        saved = {id(p): m for part in parts for p, m in zip(part.params, part.means, strict=True)}
        return posterior(self.param_groups, self.state, saved)

    @property
    def mean(self) -> dict[str, Tensor]:
        """The posterior mean m, name -> tensor shaped like the parameter (a copy)."""
        return {name: mean for name, mean, _ in self._posterior()}

    @property
    def std(self) -> dict[str, Tensor]:
        """The posterior standard deviations σ = sqrt(T / (ess (h + weight_decay)))."""
        return {name: std for name, _, std in self._posterior()}

    @torch.no_grad()
    def sample(self, n: int, *, generator: torch.Generator | None = None) -> dict[str, Tensor]:
        """Draw n weights from q in the stacked layout, name -> ``[n, *shape]``.

        Args:
            n: the number of draws (an integer >= 1).
            generator: ``torch.Generator`` for reproducible draws (default: None, torch's
                global RNG, as ``MeanFieldVI.sample``); the training run's noise is not
                touched either way.

        Returns:
            New tensors, for :func:`~samplers_as_optim.call_stacked`.

        Raises:
            ValueError: a parameter has no name (see the class docstring).
        """
        return draw_samples(self._posterior(), check_positive_int("n", n), generator)

    def predict(
        self,
        model: nn.Module,
        x: Any,
        num_samples: int = 100,
        *,
        generator: torch.Generator | None = None,
        chunk_size: int | None = None,
    ) -> Any:
        """The model's outputs under ``num_samples`` draws from q, stacked along dim 0.

        The layout of a ``ParallelEnsemble``'s output, for :mod:`samplers_as_optim.predictive`
        (``predictive.classification(opt.predict(model, x))`` for a classifier).

        Args:
            model: the module these parameters belong to.
            x: a batch of inputs.
            num_samples: S (default: 100; an integer >= 1).
            generator: ``torch.Generator`` for the draws (default: None, global RNG).
            chunk_size: evaluate at most this many draws at once (default: None, all).

        Returns:
            Outputs of shape ``(S, *model(x).shape)``, without gradients.
        """
        samples = self.sample(num_samples, generator=generator)
        with torch.no_grad():
            return call_stacked(model, samples, x, chunk_size=chunk_size)
