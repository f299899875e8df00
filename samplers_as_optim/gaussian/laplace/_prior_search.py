r"""Tuning a fitted Laplace's prior precision (and noise): by the evidence or on held-out data.

``marglik``: Adam on :math:`\log\Lambda_0` (one value, one per layer, or one per weight)
and :math:`\log\sigma` (regression), maximising the Laplace evidence
(:mod:`._evidence`); the logarithms keep every value positive, as laplace-torch and
Immer et al. (2021, §3) do. ``gridsearch``: a scalar prior precision from a list, scored
by the negative log-likelihood of the GLM (linearised) predictive on a validation loader,
:math:`-\sum_i\log p(y_i\mid x_i)`: the exact Gaussian for regression, the probit (or
Laplace bridge) closed form for classification, or Monte Carlo with the same draws for
every value (:mod:`._prior_grid`, which computes each batch's Jacobians once for the
whole grid); laplace-torch's default is the same GLM probit score. :class:`PriorTuning`
is the front end, ``Laplace.optimize_prior_precision``, mixed into ``Laplace``.

References:
    Immer et al. (2021), Scalable marginal likelihood estimation for model selection in
    deep learning, §3 and Algorithm 1.
    Daxberger et al. (2021), Laplace Redux — effortless Bayesian deep learning, §2.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any, Protocol, TypeVar

import torch
from torch import Tensor, nn

from ...core.progress import ProgressBar, check_progress, progress_bar
from ...core.validation import check_choice, check_learning_rate, check_positive, check_positive_int
from .._weight_gaussian import batches_on, evaluating
from ..flat import Treated
from ..likelihoods import Likelihood, Regression
from ..linearised.glm_predictive import LINK_APPROXIMATIONS
from ._evidence import FitTerms, curvature_rank
from ._prior_forms import Groups, read_prior
from ._prior_grid import CurvatureBasis, batch_scores

__all__ = [
    "HyperParameters",
    "PriorTuning",
    "check_residuals",
    "grid_scores",
    "gridsearch",
    "marglik_search",
]

_STRUCTURES = ("scalar", "layerwise", "diag")


class TunableLaplace(Protocol):
    """What tuning reads and writes of a fitted ``Laplace`` (kept apart from its module)."""

    model: nn.Module
    treated: Treated
    structure: str
    likelihood: Likelihood
    _groups: Groups

    @property
    def prior_precision(self) -> Any: ...

    @prior_precision.setter
    def prior_precision(self, value: Any) -> None: ...

    @property
    def noise_std(self) -> float | None: ...

    def _reference(self) -> Tensor: ...

    def _set_hyperparameters(self, prior: Any, noise_std: float | None) -> None: ...

    def log_marginal_likelihood(
        self, prior_precision: Any = None, noise_std: Any = None
    ) -> Tensor: ...

    @property
    def temperature(self) -> float: ...

    def _fitted(self) -> tuple[dict[str, Tensor], Any]: ...

    def _fitted_terms(self) -> FitTerms: ...


_Tunable = TypeVar("_Tunable", bound=TunableLaplace)


def check_tune_noise(la: TunableLaplace, tune_noise: Any) -> bool:
    """``tune_noise``: None (True for regression), or a bool, True only for regression."""
    regression = isinstance(la.likelihood, Regression)
    if tune_noise is None:
        return regression
    if not isinstance(tune_noise, bool):
        raise TypeError(f"Invalid tune_noise: {tune_noise!r} (expected None, True or False)")
    if tune_noise and not regression:
        raise ValueError(
            "Invalid tune_noise: True (expected None or False: the noise is tuned only for "
            "likelihood='regression')"
        )
    return tune_noise


class HyperParameters:
    r"""The logarithms of the prior precision (in a structure) and of σ, as leaf tensors.

    ``"scalar"``: one value; ``"layerwise"``: one per group of names sharing a prior (a
    treated tensor, or a KFAC layer's weight and bias); ``"diag"``: one per weight.
    :meth:`prior` expands them to the per-tensor (layerwise) or flat (diag) form of
    :meth:`~samplers_as_optim.gaussian.laplace.Laplace.log_marginal_likelihood`.
    """

    def __init__(
        self,
        la: TunableLaplace,
        prior_structure: str,
        tune_noise: bool,
        init_prior_precision: float | None,
    ) -> None:
        self.structure = check_choice("prior_structure", prior_structure, _STRUCTURES)
        if self.structure == "diag" and la.structure == "kron":
            raise ValueError(
                "Invalid prior_structure: 'diag' (expected 'scalar' or 'layerwise' with "
                "structure='kron': it keeps one prior precision per layer)"
            )
        ref = la._reference()
        groups = la._groups
        names = la.treated.names
        self._index = torch.tensor(
            [next(g for g, group in enumerate(groups) if name in group) for name in names],
            device=ref.device,
        )
        if init_prior_precision is not None:
            number = check_positive("init_prior_precision", init_prior_precision)
            current = torch.full((la.treated.numel,), number, dtype=ref.dtype, device=ref.device)
        else:
            current, _ = read_prior(
                la.prior_precision, la.treated, ref, structure=la.structure, groups=groups
            )
            if current.dim() == 2:
                current = current.diagonal()
        pieces = la.treated.unflatten(current)
        if self.structure == "scalar":
            start = current.mean().reshape(1)
        elif self.structure == "layerwise":
            start = torch.stack([pieces[group[0]].mean() for group in groups])
        else:
            start = current
        self.log_prior = start.detach().clone().log().requires_grad_(True)
        self.log_noise: Tensor | None = None
        if tune_noise:
            noise = la.noise_std
            assert noise is not None
            self.log_noise = torch.tensor(math.log(noise), dtype=ref.dtype, device=ref.device)
            self.log_noise.requires_grad_(True)

    def parameters(self) -> list[Tensor]:
        """The leaves an optimiser updates."""
        return [self.log_prior] + ([] if self.log_noise is None else [self.log_noise])

    def prior(self) -> Tensor:
        """The prior precision in a form ``log_marginal_likelihood`` takes (differentiable)."""
        value = self.log_prior.exp()
        if self.structure == "layerwise":
            return value.index_select(0, self._index)
        return value.reshape(()) if self.structure == "scalar" else value

    def noise(self) -> Tensor | None:
        """σ, or None when the noise is not tuned."""
        return None if self.log_noise is None else self.log_noise.exp()

    def install(self, la: TunableLaplace) -> None:
        """Write the values into ``la`` (a float for a scalar prior) and rebuild it once."""
        with torch.no_grad():
            prior = self.prior().detach().clone()
            noise = self.noise()
        value: Any = float(prior) if self.structure == "scalar" else prior
        la._set_hyperparameters(value, None if noise is None else float(noise))


def marglik_search(
    la: TunableLaplace,
    prior_structure: str,
    tune_noise: bool | None,
    num_steps: int,
    lr: float,
    init_prior_precision: float | None,
    progress: bool | None,
) -> None:
    """Adam on the log prior precision (and log σ), maximising the evidence."""
    tune = check_tune_noise(la, tune_noise)
    num_steps = check_positive_int("num_steps", num_steps)
    lr = check_learning_rate(lr)
    if not lr > 0.0:
        raise ValueError(f"Invalid lr: {lr!r} (expected a finite number > 0)")
    on = check_progress(progress)
    hyper = HyperParameters(la, prior_structure, tune, init_prior_precision)
    evidence_steps(la, hyper, num_steps, lr, on)
    hyper.install(la)


def evidence_steps(
    la: TunableLaplace,
    hyper: HyperParameters,
    num_steps: int,
    lr: float,
    on: bool,
    optimizer: torch.optim.Optimizer | None = None,
) -> Tensor:
    """``num_steps`` Adam steps on ``-la.log_marginal_likelihood``; the last evidence.

    Raises:
        ValueError: σ is tuned and the fit is exact (:func:`check_residuals`).
    """
    if hyper.log_noise is not None:
        check_residuals(la._fitted_terms())
    optimizer = optimizer if optimizer is not None else torch.optim.Adam(hyper.parameters(), lr=lr)
    value = torch.tensor(float("nan"))
    with ProgressBar(on, num_steps, "optimize_prior_precision") as bar:
        for step in range(num_steps):
            optimizer.zero_grad()
            noise = hyper.noise()
            if noise is not None:
                _check_noise_step(noise, step, None, la._fitted_terms())
            value = la.log_marginal_likelihood(hyper.prior(), noise)
            number = float(value.detach())
            if noise is not None and not math.isfinite(number):
                _check_noise_step(noise, step, number, la._fitted_terms())
            torch.autograd.backward(-value)
            optimizer.step()
            bar.update()
            bar.set_postfix(log_marglik=number)
    return value.detach()


def _check_noise_step(noise: Tensor, step: int, evidence: float | None, terms: FitTerms) -> None:
    """Refuse a tuned σ that left the dtype's range (or whose evidence is not finite)."""
    sigma = float(noise.detach())
    if evidence is None and sigma > 0.0 and math.isfinite(sigma):
        return
    where = "" if evidence is None else f", where the evidence is {evidence}"
    sse = float("nan") if terms.sse is None else float(terms.sse)
    raise ValueError(
        f"Invalid tune_noise: True for this fit (noise_std reached {sigma:.3g} after {step} "
        f"evidence steps{where} in {noise.dtype}: the residuals, SSE = {sse:.3g}, are too "
        "small for the evidence's maximiser in noise_std to be represented; expected "
        "tune_noise=False with noise_std set to the targets' known noise, or float64)"
    )


def check_residuals(terms: FitTerms) -> None:
    r"""Refuse to tune σ on an exact fit whose evidence has no maximiser in σ.

    At SSE = 0 the evidence depends on σ through :math:`-NO\log\sigma - \tfrac12\sum_j
    \log(\delta_j + (\sigma_0/\sigma)^2 c_j)` (GGN, :math:`c_j` the eigenvalues of the
    stored curvature; the empirical Fisher vanishes with the residuals). Its derivative
    is :math:`g(\sigma)/\sigma` with :math:`g(\sigma) = -NO + \sum_j c_j\sigma_0^2/
    (\delta_j\sigma^2 + c_j\sigma_0^2)`, which decreases from :math:`-NO + r` (σ → 0;
    r the number of nonzero :math:`c_j`, :func:`._evidence.curvature_rank`) to
    :math:`-NO` (σ → ∞). With the exact GGN (``"dense"``) :math:`r \le NO` (C sums at
    most NO rank-one terms), so g < 0 for every σ > 0: the evidence increases all the
    way to σ = 0, and Adam would walk log σ down until σ underflows. Refused. A
    diagonal or KFAC curvature can have r > NO (more nonzero entries than the GGN's
    rank); its evidence then has a maximiser σ > 0, and the tuning runs.

    Raises:
        ValueError: the fit's summed squared residual is exactly 0 and r <= NO (with
            the empirical Fisher, which vanishes there, always).
    """
    if terms.sse is None or bool(terms.sse > 0):
        return
    if terms.noise_power / 2 * curvature_rank(terms) <= terms.num_outputs:
        raise ValueError(
            "Invalid tune_noise: True for an exact fit (SSE = 0: the model reproduces every "
            "target, so the evidence increases as noise_std decreases, all the way to 0, and "
            "has no maximiser; expected tune_noise=False with noise_std set to the targets' "
            "known noise, or data the model does not interpolate)"
        )


def _check_grid(grid: Sequence[float] | None) -> list[float]:
    if grid is None:
        return torch.logspace(-4, 4, 21, dtype=torch.float64).tolist()
    expected = "expected a non-empty sequence of finite numbers > 0"
    if isinstance(grid, (str, bytes)) or not isinstance(grid, (Sequence, Tensor)):
        raise TypeError(f"Invalid grid: {grid!r} ({expected})")
    values = [float(value) for value in grid]
    if not values or not all(math.isfinite(value) and value > 0 for value in values):
        raise ValueError(f"Invalid grid: {list(grid)!r} ({expected})")
    return values


def gridsearch(
    la: TunableLaplace,
    prior_structure: str,
    tune_noise: bool | None,
    val_loader: Iterable[Any] | None,
    grid: Sequence[float] | None,
    link_approx: str,
    num_samples: int,
    progress: bool | None,
) -> Tensor:
    """Set the lowest-scoring scalar prior precision of ``grid``; return the scores.

    The score is the validation NLL of :func:`grid_scores`; the first of equal ones wins.
    """
    structure = check_choice("prior_structure", prior_structure, _STRUCTURES)
    if structure != "scalar":
        raise ValueError(
            f"Invalid prior_structure: {structure!r} (expected 'scalar' for method='gridsearch')"
        )
    if tune_noise:
        raise ValueError(
            f"Invalid tune_noise: {tune_noise!r} (expected None or False for "
            "method='gridsearch', which tunes the prior precision only)"
        )
    if val_loader is None:
        raise ValueError(
            "Invalid val_loader: None (expected (inputs, targets) batches for method='gridsearch')"
        )
    values = _check_grid(grid)
    link_approx = check_choice("link_approx", link_approx, LINK_APPROXIMATIONS)
    num_samples = check_positive_int("num_samples", num_samples)
    on = check_progress(progress)
    if la.likelihood.name == "callable" and link_approx != "mc":
        raise ValueError(
            f"Invalid link_approx: {link_approx!r} (expected 'mc' with a callable "
            "likelihood, whose predictive has no closed form)"
        )
    scores = grid_scores(la, val_loader, values, link_approx, num_samples, on)
    if bool(scores.isnan().any()):
        value = values[int(scores.isnan().nonzero()[0, 0])]
        raise ValueError(
            f"Invalid val_loader: the validation negative log-likelihood is NaN at "
            f"prior_precision {value!r} (expected a log-likelihood that is a number for "
            "every validation example)"
        )
    best = int(torch.argmin(scores))
    original = la.prior_precision
    try:
        la.prior_precision = values[best]
    except BaseException:
        la.prior_precision = original
        raise
    return scores


def grid_scores(
    la: TunableLaplace,
    val_loader: Iterable[Any],
    values: Sequence[float],
    link_approx: str,
    num_samples: int,
    progress: bool,
) -> Tensor:
    r"""The validation NLL of the GLM predictive for each scalar prior of ``values``.

    :math:`\sum_b` :func:`._prior_grid.batch_scores` over the batches of
    ``val_loader``, the Jacobians of each batch computed once for the whole grid; batch
    b's Monte Carlo draws (``link_approx="mc"``) come from a generator seeded with b.
    ``la`` is left as it is.
    """
    mean, _ = la._fitted()
    ref = la._reference()
    basis = CurvatureBasis(la._fitted_terms(), la.treated, la.noise_std)
    grid = torch.tensor(list(values), dtype=ref.dtype, device=ref.device)
    total = torch.zeros_like(grid)
    seen = 0
    batches = progress_bar(val_loader, progress, "optimize_prior_precision")
    with evaluating(la.model):
        for index, (inputs, targets) in enumerate(batches_on(batches, ref.device)):
            generator = None
            if link_approx == "mc":
                generator = torch.Generator(device=ref.device).manual_seed(index)
            total += batch_scores(
                la.model,
                mean,
                basis,
                la.likelihood,
                grid,
                la.temperature,
                inputs,
                targets,
                link_approx,
                num_samples,
                generator,
            )
            seen += inputs.shape[0]
    if seen == 0:
        raise ValueError("Invalid val_loader: it yielded no examples (expected validation data)")
    return total


class PriorTuning:
    """The tuning's front end, ``optimize_prior_precision``: a mixin of ``Laplace``.

    Kept beside what it calls, apart from ``laplace``'s fit and posterior; the class it
    is mixed into is a :class:`TunableLaplace`.
    """

    def optimize_prior_precision(
        self: _Tunable,
        method: str = "marglik",
        *,
        prior_structure: str = "scalar",
        tune_noise: bool | None = None,
        num_steps: int = 100,
        lr: float = 0.1,
        init_prior_precision: float | None = None,
        val_loader: Iterable[Any] | None = None,
        grid: Sequence[float] | None = None,
        link_approx: str = "probit",
        num_samples: int = 100,
        progress: bool | None = None,
    ) -> _Tunable:
        r"""Tune ``prior_precision`` (and ``noise_std``) by the evidence or on validation data.

        ``method="marglik"``: Adam on :math:`\log\Lambda_0` (and :math:`\log\sigma` when
        ``tune_noise``), ``num_steps`` steps of ``lr``, maximising
        :meth:`log_marginal_likelihood` (Immer et al. 2021; no new pass over the data:
        the curvature is stored). ``method="gridsearch"``: every value δ of ``grid`` as
        a scalar prior precision, scored by the validation negative log-likelihood
        :math:`-\sum_i\log p(y_i\mid x_i)` on ``val_loader`` of the GLM predictive
        (:meth:`predictive`) at the current ``temperature`` (and ``noise_std``); the
        lowest wins (the first of equal ones). The score, its cost (no refit per δ) and
        laplace-torch's arguments: :mod:`~samplers_as_optim.gaussian.laplace`. Afterwards
        ``prior_precision`` (and ``noise_std``) hold the result and the posterior is
        rebuilt from it, so sampling and predictions use it.

        Args:
            method: ``"marglik"`` (default) or ``"gridsearch"``.
            prior_structure: ``"scalar"`` (default: one precision for every weight),
                ``"layerwise"`` (one per treated tensor; with ``structure="kron"`` one per
                layer, weight and bias sharing it) or ``"diag"`` (one per weight; not with
                ``"kron"``). ``"gridsearch"`` takes ``"scalar"`` only.
            tune_noise: tune σ too (default: None, True for ``likelihood="regression"``;
                True is refused for the other likelihoods). ``"marglik"`` only.
            num_steps: Adam steps (default: 100; an integer >= 1).
            lr: Adam's learning rate on the logarithms (default: 0.1; a finite number > 0).
            init_prior_precision: the starting value of every precision for
                ``"marglik"`` (default: None, the current ``prior_precision`` in the chosen
                structure; a finite number > 0).
            val_loader: ``(inputs, targets)`` batches for ``"gridsearch"`` (required there).
            grid: the prior precisions tried by ``"gridsearch"`` (default: None, 21
                values from 1e-4 to 1e4, log-spaced; finite numbers > 0).
            link_approx: the predictive that ``"gridsearch"`` scores: ``"probit"``
                (default), ``"bridge"`` or ``"bridge_norm"`` (classification closed
                forms; for regression any of the three is the exact Gaussian) or
                ``"mc"`` (``num_samples`` draws; the only one for a callable
                likelihood).
            num_samples: function-space draws per input for ``link_approx="mc"``
                (default: 100; an integer >= 1; unused by the closed forms).
            progress: a bar over the steps (``"marglik"``) or the validation batches
                (``"gridsearch"``) (default: None, where standard error is a terminal and
                tqdm is installed).

        Returns:
            ``self``.

        Raises:
            RuntimeError: the approximation is not fitted.
            ValueError, TypeError: an argument outside what is listed above; for
                ``"marglik"`` with ``tune_noise`` also a fit that reproduces every target
                (SSE = 0) where the evidence increases all the way to ``noise_std`` = 0,
                or a σ that leaves the dtype's range; for ``"gridsearch"`` also a
                validation batch holding NaN or inf, targets the likelihood refuses, a
                Jacobian holding NaN or inf, or a NaN score; nothing changes then.
        """
        self._fitted_terms()
        if check_choice("method", method, ("marglik", "gridsearch")) == "marglik":
            marglik_search(
                self, prior_structure, tune_noise, num_steps, lr, init_prior_precision, progress
            )
        else:
            grid_options = (val_loader, grid, link_approx, num_samples)
            gridsearch(self, prior_structure, tune_noise, *grid_options, progress)
        return self
