r"""The GLM predictive: the function-space Gaussian through the likelihood, in closed form.

Given the linearised network's Gaussian over each input's outputs,
:math:`f\sim\mathcal N(\bar f, \Sigma_f)` with :math:`\bar f = f(x;\theta_*)` and
:math:`\Sigma_f = T J\Lambda^{-1}J^\top`
(:mod:`~samplers_as_optim.gaussian.linearised.function_space`; Immer, Korzepa & Bauer 2021), the
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

An output with positions, ``(B, *positions, K)`` (a language model's ``(batch,
sequence, vocabulary)`` logits; one observation per position, as the fit reads it:
:mod:`~samplers_as_optim.gaussian.likelihoods`), is predicted position by position from
the K x K diagonal blocks of :math:`\Sigma_f` (``function_space(x,
per_position=True)``), as if the B·T positions were a batch of B·T inputs (the same
draws, in that order): the fields gain the positions (``probs`` ``(B, *positions,
K)``, the entropies ``(B, *positions)``).

The draws use the covariance's eigendecomposition (negative round-off eigenvalues set
to 0), so a singular :math:`\Sigma_f` (fewer treated weights than outputs, or the
softmax's shift direction) is drawn exactly.

``Laplace.predictive`` and ``ExtendedKalmanFilter.predictive`` are the method of
``GLMPredictive`` here, mixed into the Gaussian they share (``_weight_gaussian``), which
gives the function-space Gaussian it puts through the likelihood.

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

from typing import Any, Protocol

import torch
from torch import Tensor

from ... import predictive
from ...core.validation import check_choice, check_positive_int
from ...predictive import ClassificationPrediction, RegressionPrediction
from .._wide_linalg import eigh
from ..likelihoods import Likelihood
from .function_space import FunctionSpaceGaussian

__all__ = [
    "LINK_APPROXIMATIONS",
    "GLMPredictive",
    "classification_predictive",
    "draw",
    "regression_predictive",
]

LINK_APPROXIMATIONS: tuple[str, ...] = ("probit", "bridge", "bridge_norm", "mc")


class _Linearised(Protocol):
    """What the closed forms read of a Gaussian over a network's weights (Laplace, the EKF)."""

    @property
    def likelihood(self) -> Likelihood: ...

    @property
    def noise_std(self) -> Any: ...

    def function_space(
        self, x: Tensor, *, chunk_size: int | None = None, per_position: bool = False
    ) -> FunctionSpaceGaussian: ...


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


def _closed_form(
    linearised: _Linearised,
    x: Tensor,
    link_approx: str,
    num_samples: int,
    generator: torch.Generator | None,
    chunk_size: int | None,
) -> ClassificationPrediction | RegressionPrediction:
    """The work of :meth:`GLMPredictive.predictive`: its checks, then the closed form."""
    name = linearised.likelihood.name
    if name == "callable":
        raise ValueError(
            "Invalid likelihood: a callable (expected 'classification' or 'regression' "
            "for predictive(); for a callable likelihood use function_space(x), the "
            "Gaussian over the outputs, or the draws of predict(x))"
        )
    link_approx = check_choice("link_approx", link_approx, LINK_APPROXIMATIONS)
    num_samples = check_positive_int("num_samples", num_samples)
    gaussian = linearised.function_space(x, chunk_size=chunk_size, per_position=True)
    if name == "regression":
        noise = torch.as_tensor(
            linearised.noise_std, dtype=gaussian.mean.dtype, device=gaussian.mean.device
        )
        return regression_predictive(gaussian, noise.square())
    mean, covariance = gaussian
    if mean.dim() < 2:
        raise ValueError(
            f"Invalid model output: shape {tuple(mean.shape)} (expected (batch, classes) or "
            "(batch, *positions, classes) logits for likelihood='classification')"
        )
    if mean.dim() == 2:
        return classification_predictive(gaussian, link_approx, num_samples, generator)
    # each position's K x K block, as a batch of B * T inputs (the same draws, in order)
    lead, classes = mean.shape[:-1], mean.shape[-1]
    flat = FunctionSpaceGaussian(
        mean.reshape(-1, classes), covariance.reshape(-1, classes, classes)
    )
    result = classification_predictive(flat, link_approx, num_samples, generator)
    return ClassificationPrediction(
        result.log_probs.reshape(mean.shape),
        result.probs.reshape(mean.shape),
        result.total.reshape(lead),
        result.aleatoric.reshape(lead),
        result.epistemic.reshape(lead),
    )


class GLMPredictive:
    """The GLM predictive in closed form as a method: a mixin of Laplace's and the EKF's Gaussian.

    Where the function-space Gaussian (``function_space``) comes from is the Gaussian's
    business (``_weight_gaussian``); :meth:`predictive` puts it through the likelihood.
    """

    def predictive(
        self: _Linearised,
        x: Tensor,
        *,
        link_approx: str = "probit",
        num_samples: int = 100,
        generator: torch.Generator | None = None,
        chunk_size: int | None = None,
    ) -> ClassificationPrediction | RegressionPrediction:
        r"""The GLM predictive distribution, in closed form where there is one.

        The function-space Gaussian of :meth:`function_space`,
        :math:`f \sim \mathcal N(\bar f, \Sigma_f)` with :math:`\bar f = f(x;\theta_*)`
        and :math:`\Sigma_f = T J\Lambda^{-1}J^\top`, through the likelihood
        (Immer, Korzepa & Bauer 2021; Daxberger et al. 2021, §2 and §4; see
        :mod:`~samplers_as_optim.gaussian.linearised.glm_predictive`):

        * ``likelihood="regression"``: exact,
          :math:`\mathcal N(\bar f, \mathrm{diag}\,\Sigma_f + \sigma^2)`:
          a :class:`~samplers_as_optim.predictive.RegressionPrediction` with ``mean``
          :math:`\bar f`, ``epistemic`` :math:`\mathrm{diag}\,\Sigma_f` (per output),
          ``aleatoric`` :math:`\sigma^2` (``noise_std**2``), ``total`` their sum;
          ``link_approx``, ``num_samples`` and ``generator`` are not used.
        * ``likelihood="classification"``: a
          :class:`~samplers_as_optim.predictive.ClassificationPrediction` whose
          ``probs``/``log_probs`` are ``link_approx``'s:
          ``"probit"`` (default) :math:`\mathrm{softmax}(\bar f/\sqrt{1 +
          \tfrac\pi8\mathrm{diag}\,\Sigma_f})` (MacKay 1992), ``"bridge"`` the
          Laplace bridge's Dirichlet mean (Hobbhahn, Kristiadi & Hennig 2022),
          ``"bridge_norm"`` its normalised variant (laplace-torch's), ``"mc"`` the
          average softmax of ``num_samples`` draws of the logits; ``total`` is the
          entropy of ``probs``; ``aleatoric`` (the mean entropy of the draws' softmax)
          and ``epistemic`` (their mutual information) come from ``num_samples``
          function-space draws, so ``total`` equals ``aleatoric + epistemic`` exactly
          for ``"mc"`` only.
        * a callable likelihood: refused (its predictive has no closed form here; take
          :meth:`function_space` or ``predict(x)``'s draws through it).

        Cost: that of :meth:`function_space`, plus one O x O eigendecomposition per
        input for the draws (K x K per position for outputs with positions).

        Args:
            x: a batch of inputs on the parameters' device.
            link_approx: ``"probit"`` (default), ``"bridge"``, ``"bridge_norm"`` or
                ``"mc"`` (classification only).
            num_samples: S, function-space draws for the uncertainty split (and for
                ``"mc"``) (default: 100; an integer >= 1).
            generator: ``torch.Generator`` for the draws (default: None, global RNG).
            chunk_size: inputs per Jacobian chunk (default: None, automatic).

        Returns:
            A ``ClassificationPrediction`` (``[B, *positions, K]`` probabilities,
            ``[B, *positions]`` entropies: outputs with positions are predicted per
            position, module docstring) or a ``RegressionPrediction`` (each
            ``(B, *out)``); detached.

        Raises:
            RuntimeError: not fitted yet.
            ValueError: a callable likelihood, an unknown ``link_approx``, a bad
                ``num_samples`` or ``chunk_size``, classification outputs that are not
                ``(batch, classes)`` or ``(batch, *positions, classes)`` logits, or one
                input's Jacobian too large for memory.

        Example:
            >>> import torch
            >>> from torch.utils.data import DataLoader, TensorDataset
            >>> from samplers_as_optim import Laplace
            >>> _ = torch.manual_seed(0)
            >>> model = torch.nn.Sequential(
            ...     torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
            >>> x, y = torch.randn(64, 4), torch.randint(0, 3, (64,))
            >>> la = Laplace(model, num_data=64, likelihood="classification")
            >>> la = la.fit(DataLoader(TensorDataset(x, y), batch_size=16))
            >>> prediction = la.predictive(x[:5])             # probit, closed form
            >>> prediction.probs.shape, prediction.epistemic.shape
            (torch.Size([5, 3]), torch.Size([5]))
        """
        return _closed_form(self, x, link_approx, num_samples, generator, chunk_size)
