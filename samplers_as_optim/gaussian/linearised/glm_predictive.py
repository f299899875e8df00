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
  :math:`O(S\cdot B\cdot K^2)` after one K x K eigendecomposition per input (a last
  layer: through its factor, below). For
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
to 0; :func:`covariance_root` fixes each eigenvector's sign, so that a round-off change
of :math:`\Sigma_f` does not change the draws), so a singular :math:`\Sigma_f` (fewer
treated weights than outputs, or the softmax's shift direction) is drawn exactly.

**A last layer over many classes** (:mod:`._last_layer`: the treated weights are one
``nn.Linear``'s, its output the model's; ``"diag"``, ``"kron"`` or ``"lowrank"``) keeps
:math:`\Sigma_f` factored, per input and per position, and no link forms it: probit
and regression read its diagonal, the bridges its diagonal and row sums
:math:`\Sigma_f\mathbf 1` (``predictive.bridge_from_moments``, the same operations as
:func:`~samplers_as_optim.predictive.laplace_bridge`), and the draws are
:math:`\bar f + R\xi` through the structure's own square root R (:math:`Q_G
\mathrm{diag}(\sqrt w)` for KFAC, O(S C²) per input; the low-rank one, O(C k² + k³ +
S C k); the diagonal, O(S C)): the same law as the eigendecomposition's draws, not the
same numbers for a given generator. Per input, memory grows with C (O(C) for KFAC and
diag, O(Ck) for low rank, plus :math:`Q_G` once), time with C except KFAC's diagonal,
row sums and draws, which read :math:`Q_G` (C² per input, as one matrix product for the
batch).

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
from ...predictive import ClassificationPrediction, RegressionPrediction, bridge_from_moments
from .._wide_linalg import eigh
from ..likelihoods import Likelihood
from .function_space import FactoredGaussian, FunctionSpaceGaussian

__all__ = [
    "LINK_APPROXIMATIONS",
    "GLMPredictive",
    "bridge_from_moments",
    "classification_predictive",
    "covariance_root",
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

    def _output_gaussian(
        self, x: Tensor, chunk_size: int | None
    ) -> FunctionSpaceGaussian | FactoredGaussian: ...


def covariance_root(covariance: Tensor) -> Tensor:
    r"""A square root :math:`R = U\mathrm{diag}(\sqrt\lambda)` of each ``(..., K, K)`` Σ.

    :math:`\Sigma = U\mathrm{diag}(\lambda)U^\top` (``eigh``, in float32 for half
    precision), λ clamped at 0; each eigenvector's sign is fixed so that its inner
    product with :math:`w = (\sqrt2, \sqrt3, \dots, \sqrt{K+1})` is >= 0. ``eigh``'s
    own sign can flip under a round-off change of Σ, which would change the draws; this
    choice is a function of Σ (where its eigenvalues are distinct and
    :math:`u^\top w \ne 0`), so two computations of the same Σ draw the same.
    """
    values, vectors = eigh(covariance)
    size = covariance.shape[-1]
    weights = torch.arange(2, size + 2, dtype=vectors.dtype, device=vectors.device).sqrt()
    projections = weights @ vectors
    signs = torch.ones_like(projections).masked_fill(projections < 0, -1.0)
    return vectors * (signs * values.clamp(min=0.0).sqrt()).unsqueeze(-2)


def draw(
    gaussian: FunctionSpaceGaussian, num_samples: int, generator: torch.Generator | None
) -> Tensor:
    r"""S draws :math:`\bar f + R\,\xi_s`: ``(S, B, *out)``, R = :func:`covariance_root`."""
    mean, covariance = gaussian
    root = covariance_root(covariance)
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


def factored_classification(
    gaussian: FactoredGaussian,
    link_approx: str,
    num_samples: int,
    generator: torch.Generator | None,
) -> predictive.ClassificationPrediction:
    r"""The classification predictive of a last layer's factored Gaussian (module docstring).

    The draws are :math:`\bar f + R\xi_s` through the factor's own square root R
    (:meth:`~._last_layer.OutputCovariance.steps`), ξ ``(S, B, *positions, C)`` standard
    normal, as many as :func:`draw` takes; the closed forms read the diagonal
    (``"probit"``) and the row sums (the bridges) of :math:`\Sigma_f`.
    """
    mean, covariance = gaussian
    noise = torch.randn(
        num_samples, *mean.shape, generator=generator, dtype=mean.dtype, device=mean.device
    )
    sampled = predictive.classification(mean + covariance.steps(noise))
    if link_approx == "mc":
        return sampled
    if link_approx == "probit":
        logits = predictive.probit(mean, covariance.diagonal())
    else:
        logits = bridge_from_moments(
            mean, covariance.diagonal(), covariance.row_sums(), link_approx == "bridge_norm"
        )
    log_probs = logits.log_softmax(-1)
    return predictive.ClassificationPrediction(
        log_probs, log_probs.exp(), _entropy(log_probs), sampled.aleatoric, sampled.epistemic
    )


def regression_predictive(
    gaussian: FunctionSpaceGaussian, noise_variance: Tensor
) -> predictive.RegressionPrediction:
    r"""The exact Gaussian predictive: ``epistemic`` = diag Σ_f, ``aleatoric`` = σ²."""
    mean, covariance = gaussian
    return _regression(mean, covariance.diagonal(dim1=-2, dim2=-1), noise_variance)


def _regression(
    mean: Tensor, variances: Tensor, noise_variance: Tensor
) -> predictive.RegressionPrediction:
    epistemic = variances.reshape(mean.shape)
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
    gaussian = linearised._output_gaussian(x, chunk_size)
    if name == "regression":
        noise = torch.as_tensor(
            linearised.noise_std, dtype=gaussian.mean.dtype, device=gaussian.mean.device
        )
        if isinstance(gaussian, FactoredGaussian):
            return _regression(gaussian.mean, gaussian.covariance.diagonal(), noise.square())
        return regression_predictive(gaussian, noise.square())
    if gaussian.mean.dim() < 2:
        raise ValueError(
            f"Invalid model output: shape {tuple(gaussian.mean.shape)} (expected (batch, "
            "classes) or (batch, *positions, classes) logits for likelihood='classification')"
        )
    if isinstance(gaussian, FactoredGaussian):
        return factored_classification(gaussian, link_approx, num_samples, generator)
    mean, covariance = gaussian
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
        input for the draws (K x K per position for outputs with positions); a last
        layer with ``"diag"``, ``"kron"`` or ``"lowrank"`` forms neither the Jacobian
        nor any C x C matrix (module docstring).

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
