r"""Bayesian model averaging, predictive uncertainty and its decomposition, and metrics.

The inputs are per-sample model outputs with a leading sample dimension ``S``, exactly what
:func:`~samplers_as_optim.samples.stacked.call_stacked` returns for stacked samples from any method
(SGMCMC, ensembles, Laplace, VI): logits ``[S, B, ..., K]`` (classes last) for
classification, means and variances ``[S, B, ...]`` for regression.

**Classification.** The Bayesian model average (BMA) of the per-sample predictive
distributions :math:`p_s = \mathrm{softmax}(f_s)` is computed in log space,

.. math::
    \log \bar p = \operatorname{logsumexp}_s(\log p_s) - \log S,

so that confident samples whose probabilities underflow still contribute exactly. Its
entropy splits into an aleatoric and an epistemic part (e.g. Depeweg et al. 2018):

.. math::
    \underbrace{H[\bar p]}_{\text{total}}
    = \underbrace{\tfrac{1}{S}\textstyle\sum_s H[p_s]}_{\text{aleatoric}}
    + \underbrace{\tfrac{1}{S}\textstyle\sum_s \mathrm{KL}(p_s \,\|\, \bar p)}
      _{\text{epistemic (mutual information)}},

with :math:`H[p] = -\sum_k p_k \log p_k` in nats and :math:`0 \log 0 = 0`. The epistemic
term is computed as the mean KL divergence and clamped at 0 (rounding can make a tiny
mutual information negative); its absolute accuracy is that of the log-probabilities, about
1e-7 nats in float32 and 1e-15 in float64, so compare tiny values in float64.

**Regression.** For per-sample Gaussian predictions :math:`N(\mu_s, \sigma^2_s)` the BMA is
the mixture :math:`\frac{1}{S}\sum_s N(\mu_s, \sigma_s^2)`, whose mean and variance follow
from the law of total variance:

.. math::
    \bar\mu = \tfrac{1}{S}\textstyle\sum_s \mu_s, \qquad
    \underbrace{\sigma^2}_{\text{total}}
    = \underbrace{\tfrac{1}{S}\textstyle\sum_s \sigma^2_s}_{\text{aleatoric}}
    + \underbrace{\tfrac{1}{S}\textstyle\sum_s (\mu_s - \bar\mu)^2}_{\text{epistemic}}.

**Metrics** take the BMA outputs: :func:`accuracy`, :func:`nll`, :func:`brier`,
:func:`ece` and :func:`regression_nll` measure a predictive distribution against labels;
:func:`auroc` scores out-of-distribution detection from any uncertainty score;
:func:`agreement` and :func:`total_variation` compare two predictive distributions, as
Izmailov et al. (2021) compare approximate posteriors with HMC.

References:
    Depeweg, Hernández-Lobato, Doshi-Velez and Udluft (2018). Decomposition of
    uncertainty in Bayesian deep learning for efficient and risk-sensitive learning. *ICML*.

    Guo, Pleiss, Sun and Weinberger (2017). On calibration of modern neural networks.
    *ICML*. (Expected calibration error.)

    Brier (1950). Verification of forecasts expressed in terms of probability. *Monthly
    Weather Review* 78(1).

    Izmailov, Vikram, Hoffman and Wilson (2021). What are Bayesian neural network
    posteriors really like? *ICML*. (Top-1 agreement and total variation.)

Example:
    >>> import torch
    >>> from samplers_as_optim import predictive
    >>> from samplers_as_optim.samples.stacked import call_stacked, stack_modules
    >>> _ = torch.manual_seed(0)
    >>> members = [torch.nn.Linear(4, 3) for _ in range(8)]     # 8 posterior samples
    >>> logits = call_stacked(members[0], stack_modules(members), torch.randn(5, 4))
    >>> prediction = predictive.classification(logits)
    >>> prediction.probs.shape, prediction.epistemic.shape
    (torch.Size([5, 3]), torch.Size([5]))
    >>> torch.allclose(prediction.total, prediction.aleatoric + prediction.epistemic)
    True
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from ._predictive_checks import (
    Reduction,
    apply_reduction,
    check_gaussian_logits,
    check_log_probs,
    check_logits,
    check_probs,
    check_same_shape,
    check_scores,
    check_targets,
    check_tensor,
    compute_dtype,
)
from ._predictive_regression import (
    RegressionPrediction,
    RegressionScores,
    gaussian_regression,
    heteroscedastic_regression,
    regression,
    regression_nll,
    regression_scores,
)
from .core.validation import check_positive_int
from .samples.ranks import average_ranks, sort_rows

__all__ = [
    "ClassificationPrediction",
    "RegressionPrediction",
    "RegressionScores",
    "accuracy",
    "agreement",
    "auroc",
    "brier",
    "classification",
    "ece",
    "gaussian_regression",
    "heteroscedastic_regression",
    "laplace_bridge",
    "nll",
    "probit",
    "regression",
    "regression_nll",
    "regression_scores",
    "total_variation",
]


class ClassificationPrediction(NamedTuple):
    """Bayesian model average of a classifier and its uncertainty (see :func:`classification`).

    Attributes:
        log_probs: ``[B, ..., K]`` log of the averaged predictive probabilities.
        probs: ``[B, ..., K]`` the averaged predictive probabilities.
        total: ``[B, ...]`` entropy of ``probs`` (nats).
        aleatoric: ``[B, ...]`` mean entropy of the per-sample predictions.
        epistemic: ``[B, ...]`` mutual information between the label and the parameters.
    """

    log_probs: Tensor
    probs: Tensor
    total: Tensor
    aleatoric: Tensor
    epistemic: Tensor


def _plogp(probs: Tensor, log_probs: Tensor) -> Tensor:
    """Elementwise p log p with 0 log 0 = 0, also where log p is -inf.

    The logarithm is masked before the product so that gradients stay finite too.
    """
    return probs * torch.where(probs > 0, log_probs, 0.0)


# --------------------------------------------------------------------------- averaging


def classification(logits: Tensor) -> ClassificationPrediction:
    r"""Bayesian model average of per-sample logits, with its uncertainty decomposition.

    .. math::
        \log \bar p = \operatorname{logsumexp}_s \log\mathrm{softmax}(f_s) - \log S,
        \quad H[\bar p] = \tfrac{1}{S}\textstyle\sum_s H[p_s]
        + \tfrac{1}{S}\textstyle\sum_s \mathrm{KL}(p_s \| \bar p)

    Args:
        logits: ``[S, B, ..., K]``: S samples, at least one batch dimension, classes
            last (what ``call_stacked`` returns); a 2-D tensor is refused as ambiguous.
            ``-inf`` marks impossible classes. float16/bfloat16 are averaged in float32.

    Returns:
        :class:`ClassificationPrediction` ``(log_probs, probs, total, aleatoric,
        epistemic)``; entropies in nats.

    Raises:
        TypeError: ``logits`` is not a floating tensor.
        ValueError: fewer than 3 dimensions, or logits that give NaN (NaN, +inf, or every
            class -inf).

    Example:
        >>> import torch
        >>> from samplers_as_optim import predictive
        >>> agree = torch.tensor([[[2.0, 0.0]], [[2.0, 0.0]]])    # S=2 samples, B=1, K=2
        >>> disagree = torch.tensor([[[4.0, 0.0]], [[0.0, 4.0]]])
        >>> predictive.classification(agree).epistemic
        tensor([0.])
        >>> p = predictive.classification(disagree)
        >>> p.probs, bool(p.epistemic > p.aleatoric)
        (tensor([[0.5000, 0.5000]]), True)
    """
    logits = check_logits(logits)
    log_p = torch.log_softmax(compute_dtype(logits), dim=-1)
    # A class that every sample rules out (-inf throughout) stays at -inf; it is kept out of
    # logsumexp, whose gradient there would be exp(-inf - (-inf)) = NaN.
    impossible = torch.isneginf(log_p).all(dim=0)
    log_mean = torch.logsumexp(torch.where(impossible, 0.0, log_p), dim=0)
    log_mean = torch.where(impossible, -math.inf, log_mean - math.log(log_p.shape[0]))
    if bool(log_mean.isnan().any()):
        raise ValueError(
            "Invalid logits: they give NaN probabilities (expected finite logits, or -inf for "
            "impossible classes but not for every class)"
        )
    probs = log_mean.exp()
    p = log_p.exp()
    total = -_plogp(probs, log_mean).sum(dim=-1)
    aleatoric = -_plogp(p, log_p).sum(dim=-1).mean(dim=0)
    epistemic = _plogp(p, log_p - log_mean).sum(dim=-1).mean(dim=0).clamp(min=0.0)
    return ClassificationPrediction(log_mean, probs, total, aleatoric, epistemic)


# --------------------------------------------------------------------------- closed-form links


def probit(mean: Tensor, variance: Tensor) -> Tensor:
    r"""Probit-approximated softmax of Gaussian logits: the logits whose softmax it is.

    For logits :math:`f \sim \mathcal N(\mu, \Sigma)`, :math:`\mathbb E[\mathrm{softmax}(f)]`
    has no closed form; the probit approximation (MacKay 1992; Daxberger et al. 2021, §2,
    laplace-torch's ``link_approx="probit"``) replaces it by

    .. math::
        \bar p = \mathrm{softmax}(\kappa\odot\mu), \qquad
        \kappa_k = \big(1 + \tfrac{\pi}{8}\Sigma_{kk}\big)^{-1/2}.

    For two classes whose second logit is fixed (:math:`\Sigma_{22} = 0`), it is the
    classical :math:`\mathbb E[\sigma(f)] \approx \sigma(\mu/\sqrt{1 + \pi v/8})`, with
    :math:`\sigma(x) \approx \Phi(x\sqrt{\pi/8})` (absolute error below 0.02 for every
    :math:`\mu, v`). Only the marginal variances enter.

    Args:
        mean: ``[B, ..., K]`` the logits' mean (classes last).
        variance: ``[B, ..., K]`` their marginal variances :math:`\Sigma_{kk}` (>= 0).

    Returns:
        ``[B, ..., K]`` the scaled logits :math:`\kappa\odot\mu`:
        ``.softmax(-1)`` gives the predictive probabilities, ``.log_softmax(-1)`` their
        logarithm (what :func:`nll` takes).

    Raises:
        TypeError: a non-floating tensor.
        ValueError: shapes that differ, negative or NaN variances.

    Example:
        >>> import torch
        >>> from samplers_as_optim import predictive
        >>> mean = torch.tensor([[2.0, 0.0]])
        >>> predictive.probit(mean, torch.zeros(1, 2)).softmax(-1)   # no variance: softmax
        tensor([[0.8808, 0.1192]])
        >>> predictive.probit(mean, torch.tensor([[8.0, 0.0]])).softmax(-1)  # less confident
        tensor([[0.7277, 0.2723]])
    """
    variance = check_gaussian_logits(mean, variance, "variance", 0)
    return mean * torch.rsqrt(1.0 + math.pi / 8.0 * variance)


def laplace_bridge(mean: Tensor, covariance: Tensor, *, normalize: bool = False) -> Tensor:
    r"""The Laplace bridge: the Dirichlet over class probabilities of Gaussian logits.

    Hobbhahn, Kristiadi & Hennig (2022), eq. 6, after laplace-torch's ``"bridge"``: the
    logits :math:`f\sim\mathcal N(\mu,\Sigma)` are first conditioned on
    :math:`\mathbf 1^\top f = 0` (the softmax does not see the sum), with
    :math:`s = \Sigma\mathbf 1` and :math:`t = \mathbf 1^\top\Sigma\mathbf 1`,

    .. math::
        \mu' = \mu - s\,\frac{\mathbf 1^\top\mu}{t}, \qquad
        v_k = \Sigma_{kk} - \frac{s_k^2}{t}

    (skipped where t = 0), then mapped to a Dirichlet :math:`\mathrm{Dir}(\alpha)` with

    .. math::
        \alpha_k = \frac{1}{v_k}\Big(1 - \frac 2K + \frac{e^{\mu'_k}}{K^2}
        \sum_{l=1}^K e^{-\mu'_l}\Big),

    whose mean :math:`\alpha/\sum_l\alpha_l` is the predictive. ``normalize=True`` is
    laplace-torch's ``"bridge_norm"``: with :math:`\bar v = \mathrm{mean}_k(v_k)/
    \sqrt{K/2}`, :math:`\mu'` is divided by :math:`\sqrt{\bar v}` and :math:`v` by
    :math:`\bar v` first. Computed in log space: a class whose conditioned variance is 0
    gets the dtype's smallest positive variance (the formula's limit: it takes all the
    mass), so the result stays finite; the bracket is > 0 for K >= 2.

    Args:
        mean: ``[B, ..., K]`` the logits' mean, K >= 2.
        covariance: ``[B, ..., K, K]`` their covariance (symmetric positive semi-definite).
        normalize: rescale the variances first (default: False).

    Returns:
        ``[B, ..., K]`` :math:`\log\alpha`, the log-concentrations: ``.exp()`` gives
        :math:`\alpha` (e.g. for ``torch.distributions.Dirichlet``), ``.softmax(-1)`` the
        Dirichlet's mean, i.e. the predictive probabilities, and ``.log_softmax(-1)`` their
        logarithm.

    Raises:
        TypeError: a non-floating tensor or a non-bool ``normalize``.
        ValueError: fewer than 2 classes, shapes that do not match, negative variances or
            NaN.

    Example:
        >>> import torch
        >>> from samplers_as_optim import predictive
        >>> mean, covariance = torch.tensor([[1.0, 0.0, -1.0]]), torch.eye(3).unsqueeze(0)
        >>> predictive.laplace_bridge(mean, covariance).softmax(-1)
        tensor([[0.5490, 0.2758, 0.1752]])
    """
    covariance = check_gaussian_logits(mean, covariance, "covariance", 1)
    if not isinstance(normalize, bool):
        raise TypeError(f"Invalid normalize: {normalize!r} (expected True or False)")
    classes = mean.shape[-1]
    if classes < 2:
        raise ValueError(
            f"Invalid mean: {classes} class(es) (expected K >= 2 logits for the Laplace bridge)"
        )
    diagonal = covariance.diagonal(dim1=-2, dim2=-1)
    return bridge_from_moments(mean, diagonal, covariance.sum(-1), normalize)


def bridge_from_moments(mean: Tensor, diagonal: Tensor, sums: Tensor, normalize: bool) -> Tensor:
    r""":func:`laplace_bridge` from the moments it reads, unchecked, without the K x K matrix.

    :math:`\mathrm{diag}\,\Sigma` and the row sums :math:`s = \Sigma\mathbf 1` are all
    the bridge reads of Σ: a factored covariance (a last layer over many classes) passes
    them directly.
    """
    classes = mean.shape[-1]
    total = sums.sum(-1, keepdim=True)
    conditioned = total > 0
    safe = torch.where(conditioned, total, 1.0)
    shifted = torch.where(conditioned, mean - sums * mean.sum(-1, keepdim=True) / safe, mean)
    variance = torch.where(conditioned, diagonal - sums.square() / safe, diagonal)
    variance = variance.clamp(min=0.0)
    if normalize:
        scale = variance.mean(-1, keepdim=True) / math.sqrt(classes / 2)
        scale = torch.where(scale > 0, scale, 1.0)
        shifted = shifted * scale.rsqrt()
        variance = variance / scale
    log_bracket = torch.logaddexp(
        torch.tensor(math.log1p(-2 / classes) if classes > 2 else -math.inf).to(mean),
        shifted + torch.logsumexp(-shifted, dim=-1, keepdim=True) - 2 * math.log(classes),
    )
    tiny = torch.finfo(variance.dtype).tiny
    return log_bracket - variance.clamp(min=tiny).log()


# --------------------------------------------------------------------------- metrics


def accuracy(probs: Tensor, targets: Tensor, *, reduction: Reduction = "mean") -> Tensor:
    """Top-1 accuracy: 1 where ``argmax(probs) == target``.

    Args:
        probs: ``[B, ..., K]`` predictive probabilities (any scores with the same argmax,
            e.g. log-probabilities, work too).
        targets: ``[B, ...]`` integer class indices.
        reduction: ``"mean"`` (default), ``"sum"`` or ``"none"`` (per-input 0/1 values).

    Returns:
        The reduced accuracy (float tensor).

    Raises:
        TypeError: bad tensor types.
        ValueError: shape mismatch, targets outside ``[0, K)`` or an unknown ``reduction``.

    Example:
        >>> import torch
        >>> from samplers_as_optim import predictive
        >>> predictive.accuracy(torch.tensor([[0.9, 0.1], [0.2, 0.8]]), torch.tensor([0, 0]))
        tensor(0.5000)
    """
    probs = check_tensor("probs", probs, min_dim=1, layout="[B, ..., K] of probabilities")
    targets = check_targets(targets, probs)
    return apply_reduction((probs.argmax(dim=-1) == targets).to(probs.dtype), reduction)


def nll(log_probs: Tensor, targets: Tensor, *, reduction: Reduction = "mean") -> Tensor:
    r"""Negative log predictive probability of the labels, :math:`-\log \bar p_{y}` (nats).

    Takes log-probabilities (:attr:`ClassificationPrediction.log_probs`) so that confident
    mistakes are measured without underflow, like ``torch.nn.functional.nll_loss``.

    Args:
        log_probs: ``[B, ..., K]`` log predictive probabilities.
        targets: ``[B, ...]`` integer class indices.
        reduction: ``"mean"`` (default), ``"sum"`` or ``"none"``.

    Returns:
        The reduced NLL.

    Raises:
        TypeError: bad tensor types.
        ValueError: shape mismatch, targets outside ``[0, K)``, positive log-probabilities
            or an unknown ``reduction``.

    Example:
        >>> import torch
        >>> from samplers_as_optim import predictive
        >>> log_probs = torch.tensor([[0.5, 0.5], [0.25, 0.75]]).log()
        >>> predictive.nll(log_probs, torch.tensor([0, 1]), reduction="none")
        tensor([0.6931, 0.2877])
    """
    log_probs = check_log_probs(log_probs)
    targets = check_targets(targets, log_probs)
    picked = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return apply_reduction(-picked, reduction)


def brier(probs: Tensor, targets: Tensor, *, reduction: Reduction = "mean") -> Tensor:
    r"""Brier score :math:`\sum_k (\bar p_k - \mathbb{1}[y = k])^2`, in [0, 2] (Brier 1950).

    The multiclass definition, summed over classes (scikit-learn's ``brier_score_loss``
    with ``scale_by_half=False``).

    Args:
        probs: ``[B, ..., K]`` predictive probabilities.
        targets: ``[B, ...]`` integer class indices.
        reduction: ``"mean"`` (default), ``"sum"`` or ``"none"``.

    Returns:
        The reduced Brier score.

    Raises:
        TypeError: bad tensor types.
        ValueError: probabilities outside [0, 1], shape mismatch, targets outside
            ``[0, K)`` or an unknown ``reduction``.

    Example:
        >>> import torch
        >>> from samplers_as_optim import predictive
        >>> predictive.brier(torch.tensor([[0.75, 0.25]]), torch.tensor([0]))
        tensor(0.1250)
    """
    probs = check_probs("probs", probs)
    targets = check_targets(targets, probs)
    one_hot = torch.nn.functional.one_hot(targets, probs.shape[-1]).to(probs.dtype)
    return apply_reduction((probs - one_hot).square().sum(dim=-1), reduction)


def ece(probs: Tensor, targets: Tensor, *, num_bins: int = 15) -> Tensor:
    r"""Expected calibration error of the top-label confidence (Guo et al. 2017, eq. 3).

    .. math::
        \mathrm{ECE} = \sum_{m=1}^{M} \frac{|B_m|}{n}
        \big|\mathrm{acc}(B_m) - \mathrm{conf}(B_m)\big|,

    where :math:`B_m` holds the inputs whose confidence :math:`\max_k \bar p_k` lies in
    :math:`((m-1)/M, m/M]` (:math:`B_1` also takes confidence 0), :math:`\mathrm{acc}` is
    the fraction whose argmax is the label and :math:`\mathrm{conf}` the mean confidence.

    Args:
        probs: ``[B, ..., K]`` predictive probabilities (all inputs are pooled).
        targets: ``[B, ...]`` integer class indices.
        num_bins: M, equal-width confidence bins, an integer >= 1; default 15 (Guo et al.).

    Returns:
        ECE, a scalar tensor in [0, 1].

    Raises:
        TypeError: bad tensor types or a non-integer ``num_bins``.
        ValueError: probabilities outside [0, 1], shape mismatch, targets outside
            ``[0, K)`` or ``num_bins`` < 1.

    Example:
        >>> import torch
        >>> from samplers_as_optim import predictive
        >>> probs = torch.tensor([[0.9, 0.1], [0.9, 0.1], [0.6, 0.4], [0.6, 0.4]])
        >>> predictive.ece(probs, torch.tensor([0, 0, 0, 1]), num_bins=10)
        tensor(0.1000)
    """
    num_bins = check_positive_int("num_bins", num_bins)
    probs = check_probs("probs", probs)
    targets = check_targets(targets, probs)
    confidence, predicted = probs.reshape(-1, probs.shape[-1]).max(dim=-1)
    correct = (predicted == targets.reshape(-1)).to(probs.dtype)
    edges = torch.linspace(0, 1, num_bins + 1, dtype=torch.float64, device=probs.device)
    bins = torch.bucketize(confidence.to(torch.float64), edges[1:-1], right=False)
    gap = torch.zeros(num_bins, dtype=torch.float64, device=probs.device)
    gap.index_add_(0, bins, (correct - confidence).to(torch.float64))  # n_m (acc_m - conf_m)
    return (gap.abs().sum() / confidence.numel()).to(probs.dtype)


def auroc(in_scores: Tensor, out_scores: Tensor) -> Tensor:
    r"""Area under the ROC curve for telling out-of-distribution inputs from any score.

    Higher scores should mean "more likely out of distribution" (e.g.
    :attr:`ClassificationPrediction.total` or ``.epistemic``, or a regression variance).
    The AUROC is the probability that a random out-of-distribution input scores higher than
    a random in-distribution one, ties counting one half (the Mann-Whitney statistic):

    .. math::
        \mathrm{AUROC} = \frac{R_{\text{out}} - n_{\text{out}}(n_{\text{out}}+1)/2}
                              {n_{\text{in}}\, n_{\text{out}}},

    with :math:`R_{\text{out}}` the sum of the out-of-distribution scores' average ranks in
    the pooled sample. 0.5 is chance, 1 perfect separation.

    Args:
        in_scores: scores on in-distribution inputs (any shape, flattened).
        out_scores: scores on out-of-distribution inputs (any shape, flattened).

    Returns:
        AUROC, a float64 scalar tensor.

    Raises:
        TypeError: either is not a floating tensor.
        ValueError: either is empty or holds NaN.

    Example:
        >>> import torch
        >>> from samplers_as_optim import predictive
        >>> predictive.auroc(torch.tensor([0.1, 0.2, 0.4]), torch.tensor([0.3, 0.5]))
        tensor(0.8333, dtype=torch.float64)
    """
    pooled = check_scores(in_scores, out_scores)
    n_in, n_out = in_scores.numel(), out_scores.numel()
    values, order = sort_rows(pooled.detach().unsqueeze(0))
    ranks = average_ranks(values.to(pooled.device))[0]
    rank_sum = ranks[order[0].to(pooled.device) >= n_in].sum()
    return (rank_sum - n_out * (n_out + 1) / 2) / (n_in * n_out)


def agreement(probs: Tensor, other: Tensor, *, reduction: Reduction = "mean") -> Tensor:
    r"""Top-1 agreement: 1 where the two predictive distributions have the same argmax.

    .. math::
        \mathrm{agreement}(p, q) = \tfrac{1}{B}\textstyle\sum_i
        \mathbb{1}\big[\arg\max_k p_{ik} = \arg\max_k q_{ik}\big]

    Izmailov et al. (2021) use it to measure how closely an approximate posterior's
    predictions follow a reference (HMC) predictive distribution.

    Args:
        probs: ``[B, ..., K]`` predictive probabilities (or any scores with their argmax).
        other: the other predictive distribution, same shape.
        reduction: ``"mean"`` (default), ``"sum"`` or ``"none"``.

    Returns:
        The reduced agreement, in [0, 1] for ``"mean"``.

    Raises:
        TypeError: bad tensor types.
        ValueError: shapes differ or an unknown ``reduction``.

    Example:
        >>> import torch
        >>> from samplers_as_optim import predictive
        >>> p = torch.tensor([[0.6, 0.4], [0.3, 0.7]])
        >>> q = torch.tensor([[0.9, 0.1], [0.8, 0.2]])
        >>> predictive.agreement(p, q)
        tensor(0.5000)
    """
    probs = check_tensor("probs", probs, min_dim=1, layout="[B, ..., K] of probabilities")
    other = check_tensor("other", other, min_dim=1, layout="[B, ..., K] of probabilities")
    check_same_shape(probs, other, ("probs", "other"))
    same = probs.argmax(dim=-1) == other.argmax(dim=-1)
    return apply_reduction(same.to(probs.dtype), reduction)


def total_variation(probs: Tensor, other: Tensor, *, reduction: Reduction = "mean") -> Tensor:
    r"""Total variation distance between two predictive distributions, per input in [0, 1].

    .. math::
        \mathrm{TV}(p, q) = \tfrac{1}{2}\textstyle\sum_k |p_k - q_k|

    averaged over inputs with ``reduction="mean"`` (Izmailov et al. 2021).

    Args:
        probs: ``[B, ..., K]`` predictive probabilities.
        other: the other predictive distribution, same shape.
        reduction: ``"mean"`` (default), ``"sum"`` or ``"none"``.

    Returns:
        The reduced total variation distance.

    Raises:
        TypeError: bad tensor types.
        ValueError: probabilities outside [0, 1], shapes differ or an unknown ``reduction``.

    Example:
        >>> import torch
        >>> from samplers_as_optim import predictive
        >>> p = torch.tensor([[0.5, 0.5, 0.0]])
        >>> q = torch.tensor([[0.25, 0.25, 0.5]])
        >>> predictive.total_variation(p, q)
        tensor(0.5000)
    """
    probs = check_probs("probs", probs)
    other = check_probs("other", other)
    check_same_shape(probs, other, ("probs", "other"))
    return apply_reduction(0.5 * (probs - other).abs().sum(dim=-1), reduction)
