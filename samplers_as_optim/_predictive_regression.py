r"""The regression half of :mod:`~samplers_as_optim.predictive`: Gaussian-mixture BMAs.

The mixture of per-sample Gaussians :math:`\frac1S\sum_s N(\mu_s, \sigma_s^2)`, its
moments (:func:`regression`) and its exact density (:func:`regression_nll`), and the
front ends for the package's two regression likelihoods (:func:`gaussian_regression`,
:func:`heteroscedastic_regression`) and for test scores (:func:`regression_scores`).
Every name here is public through :mod:`~samplers_as_optim.predictive`, which documents
the decomposition.
"""

from __future__ import annotations

import math
from typing import NamedTuple, overload

import torch
from torch import Tensor

from ._predictive_checks import Reduction, apply_reduction, check_tensor, compute_dtype
from .core.validation import check_positive
from .regression import HeteroscedasticGaussian

__all__ = [
    "RegressionPrediction",
    "RegressionScores",
    "gaussian_regression",
    "heteroscedastic_regression",
    "regression",
    "regression_nll",
    "regression_scores",
]

#: pickled, documented and shown by the public module's name
PUBLIC_MODULE = "samplers_as_optim.predictive"


class RegressionPrediction(NamedTuple):
    r"""Mean and variance of a Gaussian-mixture predictive (see :func:`regression`).

    The last two fields are the mixture itself, :math:`\frac1S\sum_s N(\mu_s, \sigma_s^2)`:
    :func:`regression`, :func:`gaussian_regression` and :func:`heteroscedastic_regression`
    fill them, so that :func:`regression_scores` of the prediction scores the exact
    mixture. A prediction made without them (Laplace's GLM predictive, which is exactly
    Gaussian) is the single Gaussian ``N(mean, total)``.

    Attributes:
        mean: ``[B, ...]`` predictive mean.
        total: ``[B, ...]`` predictive variance, ``aleatoric + epistemic``.
        aleatoric: ``[B, ...]`` mean of the per-sample noise variances.
        epistemic: ``[B, ...]`` variance of the per-sample means (over samples, ddof 0).
        sample_means: ``[S, B, ...]`` the per-sample means :math:`\mu_s`, or ``None``.
        sample_variances: ``[S, B, ...]`` the per-sample noise variances
            :math:`\sigma_s^2` (a broadcast view of those given), or ``None``.
    """

    mean: Tensor
    total: Tensor
    aleatoric: Tensor
    epistemic: Tensor
    sample_means: Tensor | None = None
    sample_variances: Tensor | None = None


def regression(means: Tensor, variances: Tensor | float) -> RegressionPrediction:
    r"""Mean and variance of the Gaussian-mixture BMA, split by the law of total variance.

    .. math::
        \bar\mu = \tfrac{1}{S}\textstyle\sum_s \mu_s, \qquad
        \sigma^2 = \tfrac{1}{S}\textstyle\sum_s \sigma_s^2
        + \tfrac{1}{S}\textstyle\sum_s (\mu_s - \bar\mu)^2

    Args:
        means: ``[S, B, ...]`` per-sample predictive means.
        variances: per-sample noise variances ``[S, B, ...]``, or anything that broadcasts
            to ``means`` (``[B, ...]``, a scalar tensor or a float: a known noise variance).
            Must be >= 0.

    Returns:
        :class:`RegressionPrediction` ``(mean, total, aleatoric, epistemic)``, each
        ``[B, ...]``, with the mixture's ``sample_means`` and ``sample_variances``
        (``[S, B, ...]``).

    Raises:
        TypeError: ``means`` is not a floating tensor or ``variances`` not a number/tensor.
        ValueError: ``means`` without a sample dimension, ``variances`` that do not
            broadcast to the means' shape (or only to a larger one), are negative or NaN.

    Example:
        >>> import torch
        >>> from samplers_as_optim import predictive
        >>> means = torch.tensor([[1.0, 0.0], [3.0, 0.0]])        # S=2 samples, B=2
        >>> prediction = predictive.regression(means, 0.5)
        >>> prediction.mean, prediction.epistemic, prediction.total
        (tensor([2., 0.]), tensor([1., 0.]), tensor([1.5000, 0.5000]))
    """
    means = compute_dtype(
        check_tensor("means", means, min_dim=1, layout="[samples, B, ...] of means")
    )
    variances = _check_variances(variances, means)
    mean = means.mean(dim=0)
    epistemic = (means - mean).square().mean(dim=0)
    variances = variances.expand_as(means)
    aleatoric = variances.mean(dim=0)
    return RegressionPrediction(mean, aleatoric + epistemic, aleatoric, epistemic, means, variances)


def _broadcasts_to(shape: torch.Size, target: torch.Size) -> bool:
    """Whether ``shape`` broadcasts to ``target`` itself (not to a larger shape)."""
    try:
        broadcast = torch.broadcast_shapes(shape, target)  # type: ignore[no-untyped-call]
    except RuntimeError:
        return False
    return bool(broadcast == target)


def _check_variances(variances: object, means: Tensor, *, positive: bool = False) -> Tensor:
    if isinstance(variances, bool) or not isinstance(variances, (Tensor, int, float)):
        raise TypeError(
            f"Invalid variances: {type(variances).__name__} (expected a tensor or a number)"
        )
    variances = torch.as_tensor(variances, dtype=means.dtype, device=means.device)
    if not _broadcasts_to(variances.shape, means.shape):
        raise ValueError(
            f"Invalid variances: shape {tuple(variances.shape)} (expected a shape that "
            f"broadcasts to the means' {tuple(means.shape)})"
        )
    bad = variances.isnan() | (variances <= 0 if positive else variances < 0)
    if bool(bad.any()):
        bound = "> 0" if positive else ">= 0"
        raise ValueError(f"Invalid variances: values not {bound} (expected variances {bound})")
    return variances


def regression_nll(
    means: Tensor,
    variances: Tensor | float,
    targets: Tensor,
    *,
    reduction: Reduction = "mean",
) -> Tensor:
    r"""Negative log density of the targets under the Gaussian-mixture BMA (nats).

    .. math::
        -\log \tfrac{1}{S}\textstyle\sum_s N(y \mid \mu_s, \sigma_s^2)
        = -\operatorname{logsumexp}_s\Big[-\tfrac12\log(2\pi\sigma_s^2)
          - \tfrac{(y-\mu_s)^2}{2\sigma_s^2}\Big] + \log S

    This is the exact BMA likelihood, not that of a Gaussian with the mixture's moments.

    Args:
        means: ``[S, B, ...]`` per-sample predictive means.
        variances: per-sample noise variances broadcasting to ``means`` (a float for a
            known noise variance); must be > 0.
        targets: ``[B, ...]`` observed values.
        reduction: ``"mean"`` (default), ``"sum"`` or ``"none"``.

    Returns:
        The reduced NLL.

    Raises:
        TypeError: bad tensor types.
        ValueError: shape mismatch, variances not > 0 or an unknown ``reduction``.

    Example:
        >>> import torch
        >>> from samplers_as_optim import predictive
        >>> predictive.regression_nll(torch.zeros(3, 1), 1.0, torch.zeros(1))  # log(2π)/2
        tensor(0.9189)
    """
    means = compute_dtype(
        check_tensor("means", means, min_dim=1, layout="[samples, B, ...] of means")
    )
    variances = _check_variances(variances, means, positive=True)
    targets = check_tensor("targets", targets, min_dim=0, layout="[B, ...] of targets")
    if targets.shape != means.shape[1:]:
        raise ValueError(
            f"Invalid targets: shape {tuple(targets.shape)} (expected {tuple(means.shape[1:])},"
            " the means' shape without the sample dimension)"
        )
    variances = variances.expand_as(means)
    log_density = -0.5 * (
        torch.log(2 * math.pi * variances) + (targets - means).square() / variances
    )
    log_mixture = torch.logsumexp(log_density, dim=0) - math.log(means.shape[0])
    return apply_reduction(-log_mixture, reduction)


class RegressionScores(NamedTuple):
    """Test scores of a regression predictive, per target value, in the targets' units."""

    #: root mean squared error of the predictive mean
    rmse: Tensor
    #: mean log density of the targets under the predictive (nats per target value)
    log_likelihood: Tensor


def gaussian_regression(means: Tensor, noise_std: Tensor | float) -> RegressionPrediction:
    r"""The BMA of samples of (means, σ) with a homoscedastic σ per sample.

    :func:`regression` with :math:`\sigma_s^2` as the variances: ``noise_std`` may be
    one σ per sample, shape ``[S]`` (e.g. ``samples["log_noise_std"].exp()`` of a
    :class:`~samplers_as_optim.GaussianLikelihood` sampled with the weights), which is
    aligned with the means' sample dimension; a float or 0-d tensor (a fixed σ); or
    anything that broadcasts to ``means``.

    Args:
        means: ``[S, B, ...]`` per-sample predicted means.
        noise_std: σ, as above (> 0).

    Returns:
        :class:`RegressionPrediction` ``(mean, total, aleatoric, epistemic)`` and the
        mixture's ``sample_means`` and ``sample_variances``.

    Raises:
        TypeError: ``means`` is not a floating tensor, or ``noise_std`` not a number/tensor.
        ValueError: ``noise_std`` not > 0, or of a shape that fits none of the rules (one
            that broadcasts to a larger shape than the means' is refused too).

    Example:
        >>> import torch
        >>> from samplers_as_optim import predictive
        >>> means = torch.tensor([[0.0], [2.0]])  # S = 2 samples, B = 1
        >>> predictive.gaussian_regression(means, torch.tensor([1.0, 3.0])).aleatoric
        tensor([5.])
    """
    means = compute_dtype(
        check_tensor("means", means, min_dim=1, layout="[samples, B, ...] of means")
    )
    if isinstance(noise_std, bool) or not isinstance(noise_std, (Tensor, int, float)):
        raise TypeError(
            f"Invalid noise_std: {type(noise_std).__name__} (expected a tensor or a number)"
        )
    std = torch.as_tensor(noise_std, dtype=means.dtype, device=means.device)
    if std.dim() == 1 and std.shape[0] == means.shape[0] and means.dim() > 1:
        std = std.reshape(-1, *([1] * (means.dim() - 1)))
    elif not _broadcasts_to(std.shape, means.shape):
        raise ValueError(
            f"Invalid noise_std: shape {tuple(std.shape)} (expected (), [S] = "
            f"[{means.shape[0]}] (one per sample), or a shape that broadcasts to the means' "
            f"{tuple(means.shape)})"
        )
    if bool((std.isnan() | (std <= 0)).any()):
        raise ValueError("Invalid noise_std: values not > 0 (expected standard deviations > 0)")
    return regression(means, std.square())


def heteroscedastic_regression(
    outputs: Tensor, head: HeteroscedasticGaussian
) -> RegressionPrediction:
    """The BMA of samples of a heteroscedastic head's outputs ``[S, B, 2D]``.

    Each sample's outputs are split by ``head.mean_and_std`` (D means, D σ from the raw
    scales) and the mixture is :func:`regression`'s.

    Args:
        outputs: ``[S, B, 2D]`` stacked outputs of a network trained with ``head``.
        head: the :class:`~samplers_as_optim.HeteroscedasticGaussian` it was trained with.

    Returns:
        :class:`RegressionPrediction`, each field ``[B, D]``.

    Raises:
        TypeError: ``head`` is not a HeteroscedasticGaussian, or ``outputs`` not a tensor.
        ValueError: ``outputs`` without a sample dimension or with an odd last dimension.

    Example:
        >>> import torch
        >>> from samplers_as_optim import HeteroscedasticGaussian, predictive
        >>> outputs = torch.zeros(3, 5, 2)  # S = 3, B = 5, D = 1
        >>> predictive.heteroscedastic_regression(outputs, HeteroscedasticGaussian()).mean.shape
        torch.Size([5, 1])
    """
    if not isinstance(head, HeteroscedasticGaussian):
        raise TypeError(f"Invalid head: {type(head).__name__} (expected a HeteroscedasticGaussian)")
    outputs = check_tensor("outputs", outputs, min_dim=3, layout="[samples, B, 2D] of outputs")
    mean, std = head.mean_and_std(outputs)
    return regression(mean, std.square())


@overload
def regression_scores(
    prediction: RegressionPrediction, targets: Tensor, /, *, target_std: float = 1.0
) -> RegressionScores: ...


@overload
def regression_scores(
    means: Tensor,
    variances: Tensor | float,
    targets: Tensor,
    *,
    target_std: float = 1.0,
) -> RegressionScores: ...


def regression_scores(
    means: Tensor | RegressionPrediction,
    variances: Tensor | float | None = None,
    targets: Tensor | None = None,
    *,
    target_std: float = 1.0,
) -> RegressionScores:
    r"""Test RMSE and log-likelihood per target value, in the targets' original units.

    Called as ``regression_scores(prediction, targets, target_std=s)`` with a
    :class:`RegressionPrediction` of :func:`regression`, :func:`gaussian_regression` or
    :func:`heteroscedastic_regression`, or as ``regression_scores(means, variances,
    targets, target_std=s)``. The log-likelihood is the mean over the target values of the
    log density of the exact mixture :math:`\frac1S\sum_s N(\mu_s, \sigma_s^2)`
    (:func:`regression_nll`),

    .. math::
        \frac1B\sum_b \Big[\operatorname{logsumexp}_s \log N(y_b \mid \mu_{s,b},
        \sigma_{s,b}^2) - \log S\Big] - \log s,

    with the prediction's ``sample_means`` and ``sample_variances`` (each sample with its
    own σ, not the mean σ² that is the prediction's ``aleatoric``); a prediction without
    them (Laplace's GLM predictive) is the single Gaussian ``N(mean, total)``. The RMSE
    is that of the mixture's mean.

    A model trained on standardised targets :math:`\tilde y = (y - m)/s` predicts in
    those units; with ``target_std`` = s the scores are those of the original y:
    :math:`\mathrm{RMSE}_y = s\,\mathrm{RMSE}_{\tilde y}` and, since
    :math:`p(y) = p(\tilde y)/s`, the log-likelihood per value is the standardised one
    minus :math:`\log s`.

    Args:
        means: ``[S, B, ...]`` per-sample predicted means (standardised units), or a
            :class:`RegressionPrediction` in place of ``(means, variances)``.
        variances: per-sample noise variances, as for :func:`regression_nll` (> 0);
            not with a prediction.
        targets: ``[B, ...]`` (standardised units).
        target_std: s (default: 1.0, the scores in the units given; > 0).

    Returns:
        :class:`RegressionScores` ``(rmse, log_likelihood)``, 0-d tensors.

    Raises:
        TypeError: as :func:`regression_nll`; ``variances`` with a prediction, or missing
            ``variances`` or ``targets``.
        ValueError: as :func:`regression_nll`, a bad ``target_std``, or a prediction with
            only one of ``sample_means`` and ``sample_variances``.

    Example:
        >>> import torch
        >>> from samplers_as_optim import predictive
        >>> scores = predictive.regression_scores(
        ...     torch.zeros(1, 2), 1.0, torch.tensor([1.0, -1.0]), target_std=2.0)
        >>> scores.rmse, scores.log_likelihood  # 2 * 1; -(log(2π)/2 + 1/2) - log 2
        (tensor(2.), tensor(-2.1121))
        >>> sampled = predictive.gaussian_regression(torch.zeros(2, 2), torch.tensor([1.0, 2.0]))
        >>> y = torch.tensor([1.0, -1.0])  # under (N(0, 1) + N(0, 4)) / 2, not N(0, 2.5)
        >>> predictive.regression_scores(sampled, y).log_likelihood
        tensor(-1.5654)
    """
    if isinstance(means, RegressionPrediction):
        means, variances, targets = _mixture_of(means, variances, targets)
    elif variances is None:
        raise TypeError(
            "Invalid variances: None (expected per-sample variances, a tensor or a number, "
            "or a RegressionPrediction in place of (means, variances))"
        )
    if targets is None:
        raise TypeError("Invalid targets: None (expected a tensor [B, ...] of targets)")
    scale = check_positive("target_std", target_std)
    nll_value = regression_nll(means, variances, targets)
    mean = means.mean(dim=0).to(nll_value.dtype)
    rmse = (mean - targets.to(nll_value.dtype)).square().mean().sqrt()
    return RegressionScores(rmse * scale, -nll_value - math.log(scale))


def _mixture_of(
    prediction: RegressionPrediction,
    second: Tensor | float | None,
    targets: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(means, variances, targets)`` of ``regression_scores(prediction, targets)``.

    The targets come second there, where ``(means, variances, targets)`` has the variances.
    """
    if targets is not None and second is not None:
        raise TypeError(
            f"Invalid variances: {type(second).__name__} given with a RegressionPrediction "
            "(expected regression_scores(prediction, targets): the prediction carries its "
            "per-sample variances)"
        )
    if targets is None:
        targets = second  # type: ignore[assignment]  # checked as targets by regression_nll
    sample_means, sample_variances = prediction.sample_means, prediction.sample_variances
    if (sample_means is None) != (sample_variances is None):
        given, missing = (
            ("sample_means", "sample_variances")
            if sample_variances is None
            else ("sample_variances", "sample_means")
        )
        raise ValueError(
            f"Invalid prediction: {given} without {missing} (expected both, as "
            "predictive.regression returns them, or neither for a single Gaussian)"
        )
    if sample_means is None or sample_variances is None:  # a Gaussian: a mixture of one
        return prediction.mean.unsqueeze(0), prediction.total, targets
    return sample_means, sample_variances, targets


for _public in __all__:  # every name here is predictive's
    globals()[_public].__module__ = PUBLIC_MODULE
