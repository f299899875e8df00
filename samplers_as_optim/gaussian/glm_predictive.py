r"""The GLM predictive: the function-space Gaussian through the likelihood, in closed form.

Given the linearised network's Gaussian over each input's outputs,
:math:`f\sim\mathcal N(\bar f, \Sigma_f)` with :math:`\bar f = f(x;\theta_*)` and
:math:`\Sigma_f = T J\Lambda^{-1}J^\top`
(:mod:`~samplers_as_optim.gaussian.function_space`; Immer, Korzepa & Bauer 2021), the
predictive :math:`p(y\mid x) = \int p(y\mid f)\,\mathcal N(f;\bar f,\Sigma_f)\,df` is

* **regression** (Gaussian noise σ): exactly :math:`\mathcal N(\bar f,\;
  \mathrm{diag}\,\Sigma_f + \sigma^2)`, returned as a
  :class:`~samplers_as_optim.predictive.RegressionPrediction` with ``epistemic`` =
  :math:`\mathrm{diag}\,\Sigma_f`, ``aleatoric`` = :math:`\sigma^2`, ``total`` their sum;
* **classification** (softmax), which has no closed form, approximated by ``link_approx``:

  - ``"probit"``: :math:`\mathrm{softmax}\big(\bar f/\sqrt{1 + \tfrac\pi8
    \mathrm{diag}\,\Sigma_f}\big)` (MacKay 1992; :func:`~samplers_as_optim.predictive.probit`);
  - ``"bridge"`` / ``"bridge_norm"``: the mean of the Laplace bridge's Dirichlet
    (Hobbhahn, Kristiadi & Hennig 2022;
    :func:`~samplers_as_optim.predictive.laplace_bridge`, ``normalize=True`` for
    ``"bridge_norm"``);
  - ``"mc"``: :math:`\frac1S\sum_s\mathrm{softmax}(f_s)` over S draws
    :math:`f_s\sim\mathcal N(\bar f,\Sigma_f)`.

  The result is a :class:`~samplers_as_optim.predictive.ClassificationPrediction`:
  ``log_probs``, ``probs`` and ``total`` (the entropy of ``probs``) are the
  approximation's; ``aleatoric`` (the mean entropy of :math:`\mathrm{softmax}(f_s)`)
  and ``epistemic`` (the mutual information, :math:`H[\frac1S\sum_s p_s] -`
  ``aleatoric``) come from the S function-space draws, which cost
  :math:`O(S\cdot B\cdot K)` after one K x K eigendecomposition per input. For
  ``"mc"`` every field is :func:`~samplers_as_optim.predictive.classification` of the
  draws, so ``total = aleatoric + epistemic``; for the closed forms ``total`` is the
  closed form's entropy and the identity holds only as far as the closed form matches
  the Monte Carlo average.

The draws use the covariance's eigendecomposition (negative round-off eigenvalues set
to 0), so a singular :math:`\Sigma_f` (fewer treated weights than outputs, or the
softmax's shift direction) is drawn exactly.

References:
    MacKay (1992), The evidence framework applied to classification networks. Neural
    Computation 4(5).
    Immer, Korzepa & Bauer (2021), Improving predictions of Bayesian neural nets via
    local linearization. AISTATS.
    Daxberger, Kristiadi, Immer, Eschenhagen, Bauer & Hennig (2021), Laplace Redux —
    effortless Bayesian deep learning. NeurIPS, §2 and §4.
    Hobbhahn, Kristiadi & Hennig (2022), Fast predictive uncertainty for classification
    with Bayesian deep networks. UAI.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import predictive
from ._wide_linalg import eigh
from .function_space import FunctionSpaceGaussian

__all__ = ["LINK_APPROXIMATIONS", "classification_predictive", "draw", "regression_predictive"]

LINK_APPROXIMATIONS: tuple[str, ...] = ("probit", "bridge", "bridge_norm", "mc")


def draw(
    gaussian: FunctionSpaceGaussian, num_samples: int, generator: torch.Generator | None
) -> Tensor:
    r"""S draws :math:`\bar f + U\,\mathrm{diag}(\sqrt{\lambda})\,\xi_s`: ``(S, B, *out)``.

    :math:`\Sigma_f = U\mathrm{diag}(\lambda)U^\top` per input (``eigh``), λ clamped at 0.
    """
    mean, covariance = gaussian
    values, vectors = eigh(covariance)  # in float32 for half precision
    root = vectors * values.clamp(min=0.0).sqrt().unsqueeze(-2)
    noise = torch.randn(
        num_samples,
        *covariance.shape[:-1],
        generator=generator,
        dtype=covariance.dtype,
        device=covariance.device,
    )
    steps = torch.einsum("bij,sbj->sbi", root, noise)
    return mean + steps.reshape(num_samples, *mean.shape)


def _entropy(log_probs: Tensor) -> Tensor:
    probs = log_probs.exp()
    return -(probs * torch.where(probs > 0, log_probs, 0.0)).sum(-1)


def classification_predictive(
    gaussian: FunctionSpaceGaussian,
    link_approx: str,
    num_samples: int,
    generator: torch.Generator | None,
) -> predictive.ClassificationPrediction:
    """The classification predictive of ``(B, K)`` Gaussian logits (module docstring)."""
    sampled = predictive.classification(draw(gaussian, num_samples, generator))
    if link_approx == "mc":
        return sampled
    mean, covariance = gaussian
    if link_approx == "probit":
        logits = predictive.probit(mean, covariance.diagonal(dim1=-2, dim2=-1))
    else:
        logits = predictive.laplace_bridge(mean, covariance, normalize=link_approx == "bridge_norm")
    log_probs = logits.log_softmax(-1)
    total = _entropy(log_probs)
    aleatoric = sampled.aleatoric
    return predictive.ClassificationPrediction(
        log_probs, log_probs.exp(), total, aleatoric, sampled.epistemic
    )


def regression_predictive(
    gaussian: FunctionSpaceGaussian, noise_variance: Tensor
) -> predictive.RegressionPrediction:
    r"""The exact Gaussian predictive: ``epistemic`` = diag Σ_f, ``aleatoric`` = σ²."""
    mean, covariance = gaussian
    epistemic = covariance.diagonal(dim1=-2, dim2=-1).reshape(mean.shape)
    aleatoric = noise_variance.to(mean).expand_as(mean)
    return predictive.RegressionPrediction(mean, epistemic + aleatoric, aleatoric, epistemic)
