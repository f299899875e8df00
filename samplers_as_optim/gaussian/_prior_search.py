r"""Tuning a fitted Laplace's prior precision (and noise): by the evidence or on held-out data.

``marglik``: Adam on :math:`\log\Lambda_0` (one value, one per layer, or one per weight)
and :math:`\log\sigma` (regression), maximising the Laplace evidence
(:mod:`._evidence`); the logarithms keep every value positive, as laplace-torch and
Immer et al. (2021, §3) do. ``gridsearch``: a scalar prior precision from a list, scored
by the negative log-likelihood of the linearised predictive on a validation loader,
:math:`-\sum_i\log\frac1S\sum_s p(y_i\mid f_\text{lin}(x_i;\theta_s))`, with the same
draws (one generator seed) for every value, so the comparison is not blurred by Monte
Carlo noise.

References:
    Immer et al. (2021), Scalable marginal likelihood estimation for model selection in
    deep learning, §3 and Algorithm 1.
    Daxberger et al. (2021), Laplace Redux — effortless Bayesian deep learning, §2.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from ..core.progress import ProgressBar, check_progress
from ..core.validation import check_choice, check_learning_rate, check_positive, check_positive_int
from ._prior_forms import Groups, read_prior
from ._weight_gaussian import _batches_on, _evaluating
from .flat import Treated
from .likelihoods import Likelihood, Regression

__all__ = ["HyperParameters", "gridsearch", "marglik_search"]

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

    def predict(
        self,
        x: Tensor,
        num_samples: int = 100,
        *,
        linear: bool = ...,
        generator: torch.Generator | None = None,
        chunk_size: int | None = None,
    ) -> Tensor: ...


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
    *,
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
    """``num_steps`` Adam steps on ``-la.log_marginal_likelihood``; the last evidence."""
    optimizer = optimizer if optimizer is not None else torch.optim.Adam(hyper.parameters(), lr=lr)
    value = torch.tensor(float("nan"))
    with ProgressBar(on, num_steps, "optimize_prior_precision") as bar:
        for _ in range(num_steps):
            optimizer.zero_grad()
            value = la.log_marginal_likelihood(hyper.prior(), hyper.noise())
            torch.autograd.backward(-value)
            optimizer.step()
            bar.update()
            bar.set_postfix(log_marglik=float(value.detach()))
    return value.detach()


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
    *,
    prior_structure: str,
    tune_noise: bool | None,
    val_loader: Iterable[Any] | None,
    grid: Sequence[float] | None,
    num_samples: int,
    progress: bool | None,
) -> None:
    """The scalar prior precision of ``grid`` with the lowest validation NLL."""
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
    num_samples = check_positive_int("num_samples", num_samples)
    on = check_progress(progress)
    batches = list(_batches_on(val_loader, la._reference().device))
    if not batches:
        raise ValueError("Invalid val_loader: it yielded no examples (expected validation data)")
    original = la.prior_precision
    scores = []
    try:
        with ProgressBar(on, len(values), "optimize_prior_precision") as bar:
            for value in values:
                la.prior_precision = value
                scores.append(_validation_nll(la, batches, num_samples))
                bar.update()
    except BaseException:
        la.prior_precision = original
        raise
    best = min(range(len(values)), key=lambda index: scores[index])
    la.prior_precision = values[best]


def _validation_nll(
    la: TunableLaplace, batches: list[tuple[Tensor, Tensor]], num_samples: int
) -> float:
    r""":math:`-\sum_i \log\frac1S\sum_s p(y_i\mid f_\text{lin}(x_i;\theta_s))`."""
    device = la._reference().device
    total = 0.0
    with torch.no_grad(), _evaluating(la.model):
        for index, (inputs, targets) in enumerate(batches):
            generator = torch.Generator(device=device).manual_seed(index)
            outputs = la.predict(inputs, num_samples, linear=True, generator=generator)
            nll = torch.stack([la.likelihood.nll(output, targets) for output in outputs])
            log_mean = torch.logsumexp(-nll, dim=0) - math.log(num_samples)
            total -= float(log_mean.sum())
    return total
