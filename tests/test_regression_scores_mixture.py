"""``regression_scores`` of a ``RegressionPrediction`` is the exact mixture's (issue #36).

The regression guide scores a sampled (θ, σ) predictive with
``regression_scores(prediction, targets, target_std=s)``: the prediction carries the
per-sample means and variances it was built from, and the log-likelihood is that of the
mixture (1/S) Σ_s N(μ_s, σ_s²), not that of every sample with the mean σ² (the
``.aleatoric`` the guide passed before).
"""

from __future__ import annotations

import math

import pytest
import torch

from samplers_as_optim import HeteroscedasticGaussian, predictive


def exact_mixture_log_likelihood(means, stds, targets):
    """Mean over targets of log (1/S) Σ_s N(y | μ_s, σ_s²), written out independently."""
    log_density = torch.distributions.Normal(means, stds).log_prob(targets)  # [S, B, 1]
    return (torch.logsumexp(log_density, dim=0) - math.log(means.shape[0])).mean()


def sampled_case(seed=0, num_samples=6, batch=40):
    """Per-sample means and one σ per sample that varies a lot across samples (float64)."""
    generator = torch.Generator().manual_seed(seed)
    means = torch.randn(num_samples, batch, 1, generator=generator, dtype=torch.float64)
    stds = torch.logspace(-1, 0.5, num_samples, dtype=torch.float64)  # σ from 0.1 to 3.2
    targets = torch.randn(batch, 1, generator=generator, dtype=torch.float64)
    return means, stds, targets


def test_the_guides_call_scores_the_exact_mixture():
    means, stds, targets = sampled_case()
    prediction = predictive.gaussian_regression(means, stds)  # the guide's SGHMC predictive
    scale = 7.0
    scores = predictive.regression_scores(prediction, targets, target_std=scale)
    expected = exact_mixture_log_likelihood(means, stds.reshape(-1, 1, 1), targets)
    assert scores.log_likelihood.item() == pytest.approx(
        expected.item() - math.log(scale), rel=1e-12
    )
    rmse = (means.mean(0) - targets).square().mean().sqrt() * scale
    assert scores.rmse.item() == pytest.approx(rmse.item(), rel=1e-12)
    # the same as the explicit (means, per-sample variances) form
    explicit = predictive.regression_scores(
        means, stds.square().reshape(-1, 1, 1), targets, target_std=scale
    )
    assert torch.equal(scores.log_likelihood, explicit.log_likelihood)
    assert torch.equal(scores.rmse, explicit.rmse)


def test_the_mixture_differs_measurably_from_the_mean_variance_score():
    means, stds, targets = sampled_case(seed=1)
    prediction = predictive.gaussian_regression(means, stds)
    exact = predictive.regression_scores(prediction, targets)
    old = predictive.regression_scores(means, prediction.aleatoric, targets)  # the old guide
    assert abs(exact.log_likelihood.item() - old.log_likelihood.item()) > 0.1
    # with one σ for every sample the two agree, as they should
    same = predictive.gaussian_regression(means, 0.7)
    assert predictive.regression_scores(same, targets).log_likelihood.item() == pytest.approx(
        predictive.regression_scores(means, same.aleatoric, targets).log_likelihood.item(),
        rel=1e-12,
    )


def test_every_predictive_carries_its_components():
    means, stds, targets = sampled_case(seed=2, num_samples=3, batch=5)
    variances = stds.square().reshape(-1, 1, 1)
    for prediction in (
        predictive.regression(means, variances),
        predictive.gaussian_regression(means, stds),
    ):
        assert torch.equal(prediction.sample_means, means)
        assert torch.equal(prediction.sample_variances, variances.expand_as(means))
    # a known noise variance (a float) is every sample's
    known = predictive.regression(means, 0.5)
    assert torch.equal(known.sample_variances, torch.full_like(means, 0.5))
    # the heteroscedastic head's per-sample σ(x)
    head = HeteroscedasticGaussian()
    outputs = torch.randn(4, 5, 2, dtype=torch.float64)
    mean, std = head.mean_and_std(outputs)
    hetero = predictive.heteroscedastic_regression(outputs, head)
    assert torch.equal(hetero.sample_means, mean)
    assert torch.equal(hetero.sample_variances, std.square())
    expected = exact_mixture_log_likelihood(mean, std, targets[:, :1].expand(5, 1))
    got = predictive.regression_scores(hetero, targets[:, :1].expand(5, 1))
    assert got.log_likelihood.item() == pytest.approx(expected.item(), rel=1e-12)


def test_the_first_four_fields_are_unchanged():
    means, stds, _ = sampled_case(seed=3, num_samples=3, batch=5)
    prediction = predictive.gaussian_regression(means, stds)
    mean, total, aleatoric, epistemic = prediction[:4]
    assert torch.equal(mean, means.mean(0))
    assert torch.allclose(aleatoric, stds.square().mean().expand(5, 1))
    assert torch.allclose(epistemic, means.var(0, unbiased=False))
    assert torch.allclose(total, aleatoric + epistemic)


def test_a_prediction_without_samples_is_scored_as_its_gaussian():
    """Laplace's GLM predictive is exactly N(mean, total): a mixture of one."""
    means, _, targets = sampled_case(seed=4, num_samples=1, batch=8)
    mean, total = means[0], torch.full((8, 1), 0.3, dtype=torch.float64)
    gaussian = predictive.RegressionPrediction(mean, total, total, torch.zeros_like(total))
    assert gaussian.sample_means is None and gaussian.sample_variances is None
    scores = predictive.regression_scores(gaussian, targets, target_std=2.0)
    expected = torch.distributions.Normal(mean, total.sqrt()).log_prob(targets).mean()
    assert scores.log_likelihood.item() == pytest.approx(expected.item() - math.log(2.0))
    old = predictive.regression_scores(mean.unsqueeze(0), total, targets, target_std=2.0)
    assert torch.equal(scores.log_likelihood, old.log_likelihood)
    assert torch.equal(scores.rmse, old.rmse)
    # targets by keyword too
    keyword = predictive.regression_scores(gaussian, targets=targets, target_std=2.0)
    assert torch.equal(keyword.log_likelihood, scores.log_likelihood)


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (
            lambda p, y: predictive.regression_scores(p, p.aleatoric, y),
            TypeError,
            "Invalid variances: Tensor given with a RegressionPrediction (expected "
            "regression_scores(prediction, targets): the prediction carries its per-sample "
            "variances)",
        ),
        (
            lambda p, y: predictive.regression_scores(p),
            TypeError,
            "Invalid targets: None (expected a tensor [B, ...] of targets)",
        ),
        (
            lambda p, y: predictive.regression_scores(p.sample_means, targets=y),
            TypeError,
            "Invalid variances: None (expected per-sample variances, a tensor or a number, "
            "or a RegressionPrediction in place of (means, variances))",
        ),
        (
            lambda p, y: predictive.regression_scores(p.sample_means, p.sample_variances),
            TypeError,
            "Invalid targets: None (expected a tensor [B, ...] of targets)",
        ),
        (
            lambda p, y: predictive.regression_scores(p._replace(sample_variances=None), y),
            ValueError,
            "Invalid prediction: sample_means without sample_variances (expected both, as "
            "predictive.regression returns them, or neither for a single Gaussian)",
        ),
        (
            lambda p, y: predictive.regression_scores(p._replace(sample_means=None), y),
            ValueError,
            "Invalid prediction: sample_variances without sample_means (expected both, as "
            "predictive.regression returns them, or neither for a single Gaussian)",
        ),
        (
            lambda p, y: predictive.regression_scores(p, y[:3]),
            ValueError,
            "Invalid targets: shape (3, 1) (expected (5, 1), the means' shape without the "
            "sample dimension)",
        ),
    ],
)
def test_refusals(call, error, message):
    means, stds, targets = sampled_case(seed=5, num_samples=3, batch=5)
    prediction = predictive.gaussian_regression(means, stds)
    with pytest.raises(error) as info:
        call(prediction, targets)
    assert str(info.value) == message
