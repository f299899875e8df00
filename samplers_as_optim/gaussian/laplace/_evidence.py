r"""The Laplace evidence: log marginal likelihood at the fitted weights.

With :math:`\theta_*` the fitted weights, the prior :math:`\mathcal N(0,\Lambda_0^{-1})`
and the posterior precision :math:`\Lambda = \Lambda_0 + c\,C` (C the curvature
:math:`\frac Nn\sum_i C_i` of the fit, c its scale for a changed regression noise), the
Laplace approximation of :math:`\log p(D)` (MacKay 1992; Immer et al. 2021, eq. 3-4;
Daxberger et al. 2021, §2) is

.. math::

    \log p(D) \approx \log p(D\mid\theta_*) - \tfrac12\theta_*^\top\Lambda_0\theta_*
    - \tfrac12\log\det\Lambda + \tfrac12\log\det\Lambda_0,

the :math:`(2\pi)^{P/2}` of the prior and of the Gaussian integral cancelling. It is the
temperature-1 evidence whatever ``temperature`` is. For a Gaussian likelihood with noise
σ on O outputs,

.. math::

    \log p(D\mid\theta_*) = -\tfrac{NO}{2}\log(2\pi\sigma^2) - \frac{\mathrm{SSE}}{2\sigma^2},
    \qquad \mathrm{SSE} = \frac Nn\sum_{i=1}^n \lVert y_i - f(x_i;\theta_*)\rVert^2,

and its curvature scales as :math:`\sigma^{-2}` (GGN: :math:`J^\top J/\sigma^2`) or
:math:`\sigma^{-4}` (empirical Fisher: gradients :math:`\propto 1/\sigma^2`). :class:`FitTerms`
keeps what :meth:`~samplers_as_optim.gaussian.laplace.Laplace.fit` measured at the noise
:math:`\sigma_0` it ran with, so any prior and noise are evaluated without a new pass:
:math:`c = (\sigma_0/\sigma)^k`. Every function here is differentiable in the prior
precision and σ.

References:
    MacKay (1992), A practical Bayesian framework for backpropagation networks.
    Immer et al. (2021), Scalable marginal likelihood estimation for model selection in
    deep learning, eq. 3-4.
    Daxberger et al. (2021), Laplace Redux — effortless Bayesian deep learning, §2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .._wide_linalg import cholesky_ex, eigvalsh, wide_dtype
from ..flat import Treated
from ..kfac import KronCurvature
from ..likelihoods import Likelihood, Regression
from ._lowrank import LowRankCurvature, lowrank_logdet

__all__ = [
    "DataSums",
    "FitTerms",
    "curvature_rank",
    "curvature_scale",
    "data_term",
    "log_marginal_likelihood",
    "posterior_logdet",
]

Curvature = dict[str, Tensor] | Tensor | KronCurvature | LowRankCurvature


@dataclass
class FitTerms:
    r"""What a fit keeps for the evidence and for a later change of prior or noise.

    Attributes:
        curvature: :math:`\frac Nn\sum_i C_i` without the prior, at ``fit_noise``: a dict
            of diagonals, a (P, P) matrix, a
            :class:`~samplers_as_optim.gaussian.kfac.KronCurvature` or a
            :class:`~._lowrank.LowRankCurvature`.
        log_likelihood: :math:`\frac Nn\sum_i\log p(y_i\mid x_i,\theta_*)` (0-d) at
            ``fit_noise``.
        sse: regression only: :math:`\frac Nn\sum_i\lVert y_i-f_i\rVert^2` (0-d), else
            None.
        num_outputs: regression only: N·O, the Gaussian terms of the likelihood.
        fit_noise: σ₀, the regression noise of the pass (None otherwise).
        noise_power: k, the curvature scales as :math:`\sigma^{-k}` (2 GGN, 4 EF).
        eigenvalues: a dense curvature's eigenvalues (clipped at 0), computed on first use
            by :func:`posterior_logdet` for a scalar prior.
    """

    curvature: Curvature
    log_likelihood: Tensor
    sse: Tensor | None
    num_outputs: float
    fit_noise: float | None
    noise_power: int
    eigenvalues: Tensor | None = None


def curvature_scale(terms: FitTerms, noise_std: Tensor | float | None) -> Tensor | float:
    r""":math:`c = (\sigma_0/\sigma)^k`: the stored curvature's factor at noise σ (1 if none)."""
    if terms.fit_noise is None or noise_std is None:
        return 1.0
    return (terms.fit_noise / noise_std) ** terms.noise_power


def data_term(terms: FitTerms, noise_std: Tensor | float | None) -> Tensor:
    r""":math:`\log p(D\mid\theta_*)`, scaled to N examples, at noise σ for regression."""
    if terms.sse is None or noise_std is None:
        return terms.log_likelihood
    sigma = torch.as_tensor(noise_std, dtype=terms.sse.dtype, device=terms.sse.device)
    return (
        -0.5 * terms.num_outputs * (math.log(2 * math.pi) + 2.0 * sigma.log())
        - 0.5 * terms.sse / sigma.square()
    )


def _prior_term(mean: Tensor, prior: Tensor) -> Tensor:
    r""":math:`-\frac12\theta_*^\top\Lambda_0\theta_* + \frac12\log\det\Lambda_0`."""
    if prior.dim() == 2:
        cholesky = _cholesky(prior, "prior_precision")
        return -0.5 * mean @ prior @ mean + cholesky.diagonal().log().sum().to(prior.dtype)
    return -0.5 * (prior * mean.square()).sum() + 0.5 * prior.log().sum()


def _cholesky(matrix: Tensor, what: str) -> Tensor:
    cholesky: Tensor
    cholesky, info = cholesky_ex(matrix)  # float32 for a half-precision matrix
    if int(info) != 0:
        raise ValueError(
            f"Invalid {what}: the posterior precision is not positive definite in "
            f"{matrix.dtype} (expected a prior precision large enough to dominate "
            "round-off; increase it or use float64)"
        )
    return cholesky


def posterior_logdet(
    terms: FitTerms,
    treated: Treated,
    prior: Tensor,
    blocks: Tensor | None,
    scale: Tensor | float,
    scalar: bool = False,
) -> Tensor:
    r""":math:`\log\det(\Lambda_0 + c\,C)` for the stored curvature's structure.

    ``prior`` is the flat diagonal (P,) or a dense (P, P) prior; ``blocks`` the per-block
    priors of a KFAC curvature (see :mod:`._prior_forms`); ``scalar``: ``prior`` is one
    value δ everywhere, so a dense :math:`\log\det(\delta I + cC) = \sum_j\log(\delta +
    c\lambda_j)` from C's eigenvalues (computed once), else a Cholesky factorisation; a
    low-rank curvature by the determinant lemma (:func:`~._lowrank.lowrank_logdet`).
    """
    curvature = terms.curvature
    if isinstance(curvature, LowRankCurvature):
        return lowrank_logdet(curvature, prior, scale)
    if isinstance(curvature, KronCurvature):
        assert blocks is not None
        scale_tensor = torch.as_tensor(scale, dtype=prior.dtype, device=prior.device)
        return curvature.logdet(blocks, treated.unflatten(prior), scale_tensor)
    if isinstance(curvature, dict):
        return torch.log(prior + scale * treated.flatten(curvature)).sum()
    if scalar:  # delta I + c C: exact through C's eigenvalues, no factorisation per call
        if terms.eigenvalues is None:
            terms.eigenvalues = eigvalsh(curvature).clamp(min=0.0)
        return torch.log(prior[0] + scale * terms.eigenvalues).sum()
    matrix = prior if prior.dim() == 2 else torch.diag(prior)
    wide = wide_dtype(curvature.dtype)  # float32 for a half-precision curvature
    posterior = matrix.to(wide) + scale * curvature.to(wide)
    logdet = 2.0 * _cholesky(posterior, "prior_precision").diagonal().log().sum()
    return logdet.to(curvature.dtype)


def _above_roundoff(values: Tensor, size: int) -> int:
    """How many of ``values`` (>= 0) exceed round-off: ``size * eps`` times their largest."""
    if values.numel() == 0:
        return 0
    top = values.max()
    return int((values > top * size * torch.finfo(values.dtype).eps).sum()) if top > 0 else 0


def curvature_rank(terms: FitTerms) -> int:
    r"""The number of the stored curvature's eigenvalues above round-off.

    Diagonal: the entries of each tensor; dense: the eigenvalues (computed once and kept,
    as :func:`posterior_logdet` does); KFAC: per block the products
    :math:`\lambda_{G,a}\lambda_{A,b}` of the factors' eigenvalues above round-off, plus
    the diagonal part; low-rank: :meth:`~._lowrank.LowRankCurvature.rank`. "Above
    round-off": larger than ``size * eps`` times the largest eigenvalue of their matrix
    (``size`` its dimension, ``eps`` its dtype's).
    """
    curvature = terms.curvature
    if isinstance(curvature, LowRankCurvature):
        return curvature.rank()
    if isinstance(curvature, KronCurvature):
        count = sum(
            _above_roundoff(block.g_eigenvalues, block.g_eigenvalues.numel())
            * _above_roundoff(block.a_eigenvalues, block.a_eigenvalues.numel())
            for block in curvature.blocks
        )
        return count + sum(
            _above_roundoff(value.reshape(-1), 1) for value in curvature.diagonal.values()
        )
    if isinstance(curvature, dict):
        return sum(_above_roundoff(value.reshape(-1), 1) for value in curvature.values())
    if terms.eigenvalues is None:
        terms.eigenvalues = eigvalsh(curvature).clamp(min=0.0)
    return _above_roundoff(terms.eigenvalues, curvature.shape[0])


def log_marginal_likelihood(
    terms: FitTerms,
    treated: Treated,
    mean: Tensor,
    prior: Tensor,
    blocks: Tensor | None,
    noise_std: Tensor | float | None,
    scalar: bool = False,
) -> Tensor:
    r"""The Laplace evidence (module docstring), a 0-d tensor.

    Args:
        terms: what the fit kept.
        treated: the treated parameters (their flat order).
        mean: :math:`\theta_*`, flat (P,).
        prior: :math:`\Lambda_0`: its flat diagonal (P,) or a (P, P) matrix.
        blocks: the per-block priors for a KFAC curvature, else None.
        noise_std: σ for regression (None otherwise).
        scalar: ``prior`` holds one value (see :func:`posterior_logdet`).
    """
    scale = curvature_scale(terms, noise_std)
    return (
        data_term(terms, noise_std)
        + _prior_term(mean, prior)
        - 0.5 * posterior_logdet(terms, treated, prior, blocks, scale, scalar)
    )


class DataSums:
    r"""A fit's running data term: :math:`\sum_i -\log p(y_i\mid x_i,\theta_*)`, SSE, counts.

    One extra forward per batch (no grad) at the fitted weights, in the mode the pass
    runs in (eval).
    """

    def __init__(self) -> None:
        self.nll: Tensor | float = 0.0
        self.sse: Tensor | None = None
        self.outputs = 0
        self.seen = 0

    def add(
        self, model: nn.Module, likelihood: Likelihood, inputs: Tensor, targets: Tensor
    ) -> None:
        """Add one batch."""
        with torch.no_grad():
            output = model(inputs)
            self.nll = self.nll + likelihood.nll(output, targets).sum()
            if isinstance(likelihood, Regression):
                sse = (targets - output).square().sum()
                self.sse = sse if self.sse is None else self.sse + sse
                self.outputs += output.numel()
        self.seen += inputs.shape[0]

    def scale(self, num_data: int) -> float:
        """N/n; refuses an empty pass."""
        if self.seen == 0:
            raise ValueError("Invalid loader: it yielded no examples (expected one pass over data)")
        return num_data / self.seen

    def terms(
        self, curvature: Curvature, scale: float, fit_noise: float | None, kind: str
    ) -> FitTerms:
        """The :class:`FitTerms` of the pass, every sum scaled by N/n."""
        assert isinstance(self.nll, Tensor)
        return FitTerms(
            curvature=curvature,
            log_likelihood=-scale * self.nll,
            sse=None if self.sse is None else scale * self.sse,
            num_outputs=scale * self.outputs,
            fit_noise=fit_noise,
            noise_power=2 if kind == "ggn" else 4,
        )
