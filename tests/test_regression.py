"""Regression: ``GaussianLikelihood`` (σ sampled), ``HeteroscedasticGaussian``, the
ensemble's loss with a likelihood per member, and the predictive helpers."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributions import Gamma, Normal

from samplers_as_optim import (
    SGHMC,
    GaussianLikelihood,
    HeteroscedasticGaussian,
    ParallelEnsemble,
    predictive,
)
from samplers_as_optim.regression import gaussian_nll

N = 40


# ---------------------------------------------------------------------- GaussianLikelihood
def test_loss_is_the_mean_nll_plus_the_gamma_prior_on_the_precision_over_n():
    torch.manual_seed(0)
    alpha, beta, sigma = 2.5, 0.7, 0.6
    likelihood = GaussianLikelihood(sigma, num_data=N, prior_shape=alpha, prior_rate=beta).double()
    with torch.no_grad():  # log σ exactly, not its float32 rounding
        likelihood.log_noise_std.fill_(math.log(sigma))
    output, target = torch.randn(8, 3, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    nll = -Normal(output, sigma).log_prob(target).sum(dim=1).mean()
    # the prior of s = log σ: Gamma(α, β) on τ = σ⁻², times the Jacobian |dτ/ds| = 2τ
    tau = torch.tensor(sigma**-2, dtype=torch.float64)
    gamma = Gamma(torch.tensor(alpha, dtype=torch.float64), torch.tensor(beta, dtype=torch.float64))
    log_prior = gamma.log_prob(tau) + torch.log(2 * tau)
    expected = nll - log_prior / N
    assert likelihood(output, target).item() == pytest.approx(expected.item(), rel=1e-12)
    assert likelihood.loss(output, target).item() == pytest.approx(expected.item(), rel=1e-12)
    assert likelihood.noise_std.item() == pytest.approx(sigma, rel=1e-12)


def test_the_gradient_in_s_is_that_of_the_formula():
    torch.manual_seed(1)
    likelihood = GaussianLikelihood(0.8, num_data=N).double()
    with torch.no_grad():
        likelihood.log_noise_std.fill_(math.log(0.8))
    output, target = (
        torch.randn(16, 1, dtype=torch.float64),
        torch.randn(16, 1, dtype=torch.float64),
    )
    likelihood(output, target).backward()
    s = math.log(0.8)
    sse = float((target - output).square().sum())
    # d/ds [ (n/B)(s + r²/(2σ²)) ... ]: mean NLL gives 1 − mean(r²)/σ², the prior 2α − 2βe^{−2s}
    expected = (1 - sse / 16 / math.exp(2 * s)) + (2 - 2 * math.exp(-2 * s)) / N
    assert likelihood.log_noise_std.grad.item() == pytest.approx(expected, rel=1e-12)


def test_fixed_noise_is_a_buffer_and_the_plain_nll():
    likelihood = GaussianLikelihood(0.5, learn=False)
    assert list(likelihood.parameters()) == []
    assert "log_noise_std" in dict(likelihood.named_buffers())
    output, target = torch.zeros(4, 1), torch.ones(4, 1)
    expected = -Normal(0.0, 0.5).log_prob(torch.tensor(1.0))
    assert likelihood(output, target).item() == pytest.approx(expected.item(), rel=1e-6)
    assert likelihood.prior_nll().item() == 0.0


def test_reset_parameters_returns_to_the_initial_noise():
    likelihood = GaussianLikelihood(2.0, num_data=N)
    with torch.no_grad():
        likelihood.log_noise_std.fill_(5.0)
    likelihood.reset_parameters()
    assert likelihood.noise_std.item() == pytest.approx(2.0)
    assert "noise_std=2" in repr(likelihood) and "num_data=40" in repr(likelihood)


@pytest.mark.slow
def test_sampled_noise_follows_its_conjugate_posterior():
    """SGHMC on s = log σ alone, the residuals fixed: τ = σ⁻² ~ Gamma(α + n/2, β + SSE/2).

    The chain's mean of τ is compared with the exact posterior mean; the tolerance is 5
    batch-means standard errors of the chain (20 batches of 320 steps, each about 30
    relaxation times of this chain). The step's bias is far below it: the potential's
    curvature in s is about 2N here, so lr·λ ≈ 0.04, which shifts the variance of s by
    a few percent and the mean of τ = e^{-2s} by about 0.1%, against a standard error of
    about 1%.
    """
    torch.manual_seed(0)
    alpha, beta, n = 1.0, 1.0, 50
    residuals = torch.randn(n, 1) * 0.7
    exact = (alpha + n / 2) / (beta + float(residuals.square().sum()) / 2)

    def run(lr: float, steps: int) -> tuple[float, float]:
        likelihood = GaussianLikelihood(1.0, num_data=n, prior_shape=alpha, prior_rate=beta)
        optimizer = SGHMC(likelihood.parameters(), lr=lr, momentum=0.9, num_data=n, seed=1)
        taus = []
        for step in range(steps):
            optimizer.zero_grad()
            likelihood(torch.zeros(n, 1), residuals).backward()
            optimizer.step()
            if step >= steps // 5:
                taus.append(float(likelihood.noise_std.detach()) ** -2)
        values = torch.tensor(taus, dtype=torch.float64)
        batches = values[: len(values) // 20 * 20].reshape(20, -1).mean(dim=1)
        return float(values.mean()), float(batches.std() / math.sqrt(20))

    mean, se = run(0.02, 8000)
    assert abs(mean - exact) < 5 * se, (mean, exact, se)


# ----------------------------------------------------------------- HeteroscedasticGaussian
def test_heteroscedastic_loss_is_the_gaussian_nll_with_a_softplus_scale():
    torch.manual_seed(2)
    head = HeteroscedasticGaussian(min_std=0.01)
    output = torch.randn(6, 4, dtype=torch.float64)  # D = 2
    target = torch.randn(6, 2, dtype=torch.float64)
    std = F.softplus(output[:, 2:]) + 0.01
    expected = F.gaussian_nll_loss(output[:, :2], target, std.square(), full=True, reduction="sum")
    assert head(output, target).item() == pytest.approx(expected.item() / 6, rel=1e-12)
    mean, got_std = head.mean_and_std(output)
    assert torch.equal(mean, output[:, :2]) and torch.allclose(got_std, std)
    one = torch.randn(5, 2)
    assert head.loss(one, one[:, 0]).item() == pytest.approx(head(one, one[:, :1]).item())
    assert repr(head) == "HeteroscedasticGaussian(min_std=0.01)"


# ------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: GaussianLikelihood(0.0, num_data=N), ValueError, "Invalid noise_std: 0.0"),
        (lambda: GaussianLikelihood(num_data=N, learn=1), TypeError, "Invalid learn: 1"),
        (
            lambda: GaussianLikelihood(num_data=N, prior_shape=-1.0),
            ValueError,
            "Invalid prior_shape: -1.0 (expected a finite number > 0)",
        ),
        (
            lambda: GaussianLikelihood(num_data=N, prior_rate=math.nan),
            ValueError,
            "Invalid prior_rate: nan",
        ),
        (
            lambda: GaussianLikelihood(),
            ValueError,
            "Invalid num_data: None (expected a positive integer: the number of training "
            "examples, by which the prior on the noise is divided; required with learn=True)",
        ),
        (lambda: GaussianLikelihood(num_data=0), ValueError, "Invalid num_data: 0"),
        (
            lambda: GaussianLikelihood(num_data=N)(torch.zeros(4, 1), torch.zeros(4)),
            ValueError,
            "Invalid target: shape (4,) (expected the output's shape (4, 1))",
        ),
        (
            lambda: GaussianLikelihood(num_data=N)(
                torch.zeros(4), torch.zeros(4, dtype=torch.long)
            ),
            TypeError,
            "Invalid target: torch.int64 (expected a floating-point tensor)",
        ),
        (
            lambda: GaussianLikelihood(num_data=N)([0.0], torch.zeros(1)),
            TypeError,
            "Invalid output: list (expected a floating-point tensor)",
        ),
        (
            lambda: GaussianLikelihood(num_data=N)(torch.tensor(0.0), torch.tensor(0.0)),
            ValueError,
            "Invalid output: shape () (expected (batch, ...) predicted means)",
        ),
        (lambda: HeteroscedasticGaussian(min_std=0), ValueError, "Invalid min_std: 0"),
        (
            lambda: HeteroscedasticGaussian()(torch.zeros(4, 3), torch.zeros(4, 1)),
            ValueError,
            "Invalid output: shape (4, 3) (expected a last dimension 2D: D means, then D raw "
            "scales)",
        ),
        (
            lambda: HeteroscedasticGaussian()(torch.zeros(4, 2, 2), torch.zeros(4, 2)),
            ValueError,
            "Invalid output: shape (4, 2, 2) (expected (batch, 2D): D means, then D raw scales)",
        ),
        (
            lambda: HeteroscedasticGaussian()(torch.zeros(4, 4), torch.zeros(4)),
            ValueError,
            "Invalid target: shape (4,) (expected (4, 2), or (batch,) for one output)",
        ),
        (
            lambda: HeteroscedasticGaussian().mean_and_std("x"),
            TypeError,
            "Invalid output: str (expected a floating-point tensor)",
        ),
        (
            lambda: GaussianLikelihood(num_data=N)(torch.zeros(0, 1), torch.zeros(0, 1)),
            ValueError,
            "Invalid output: shape (0, 1) (expected at least one example: the loss is the mean "
            "over the batch)",
        ),
        (
            lambda: GaussianLikelihood(learn=False)(torch.zeros(0), torch.zeros(0)),
            ValueError,
            "Invalid output: shape (0,) (expected at least one example",
        ),
        (
            lambda: HeteroscedasticGaussian()(torch.zeros(0, 2), torch.zeros(0)),
            ValueError,
            "Invalid output: shape (0, 2) (expected at least one example: the loss is the mean "
            "over the batch)",
        ),
    ],
)
def test_refusals(call, error, message):
    with pytest.raises(error) as info:
        call()
    assert str(info.value).startswith(message)


def test_an_empty_batch_is_refused_and_changes_nothing():
    """A mean over no examples is undefined: refused, rather than a NaN loss (torch's own
    losses give NaN) that a sampler's step would carry into the weights and σ."""
    likelihood = GaussianLikelihood(0.5, num_data=N)
    before = likelihood.log_noise_std.detach().clone()
    output = torch.zeros(0, 3, requires_grad=True)
    with pytest.raises(ValueError, match=r"Invalid output: shape \(0, 3\) \(expected at least"):
        likelihood(output, torch.zeros(0, 3))
    assert torch.equal(likelihood.log_noise_std.detach(), before)
    assert likelihood.log_noise_std.grad is None and output.grad is None


def test_gaussian_nll_of_an_empty_batch_is_empty():
    """The per-example NLL is well defined on no examples: no values."""
    for shape in ((0,), (0, 3), (0, 2, 2)):
        got = gaussian_nll(torch.zeros(shape), torch.tensor(1.0), torch.zeros(shape))
        assert got.shape == (0,)
    full = gaussian_nll(torch.zeros(2, 3), torch.tensor(1.0), torch.zeros(2, 3))
    assert torch.allclose(full, torch.full((2,), 3 * 0.5 * math.log(2 * math.pi)))


# ------------------------------------------------------------------------------- ensemble
def _ensemble(members: int = 3):
    torch.manual_seed(3)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    ensemble = ParallelEnsemble(net, members, seed=0)
    noise = ParallelEnsemble(GaussianLikelihood(0.5, num_data=N), members, seed=1)
    with torch.no_grad():
        noise.module.log_noise_std.copy_(torch.linspace(-1.0, 0.5, members))
    return ensemble, noise


def _single_gradients(ensemble, noise, k, x, y):
    member = ensemble.member(k)
    likelihood = GaussianLikelihood(0.5, num_data=N)
    with torch.no_grad():
        likelihood.log_noise_std.copy_(noise.module.log_noise_std[k])
    loss = likelihood(member(x), y)
    loss.backward()
    return loss, {n: p.grad for n, p in member.named_parameters()}, likelihood.log_noise_std.grad


def test_each_member_has_its_own_noise_and_a_single_models_gradient():
    ensemble, noise = _ensemble()
    x, y = torch.randn(10, 4), torch.randn(10, 1)
    loss = ensemble.loss(noise, ensemble(x), y)
    loss.backward()
    total = 0.0
    for k in range(3):
        single_loss, grads, sigma_grad = _single_gradients(ensemble, noise, k, x, y)
        total += single_loss.item()
        for name, grad in grads.items():
            # equal to rounding (vmap's batched kernels; bit for bit on some builds)
            stacked = dict(ensemble.module.named_parameters())[name].grad[k]
            assert torch.allclose(stacked, grad, rtol=1e-6, atol=1e-7), name
        assert torch.allclose(noise.module.log_noise_std.grad[k], sigma_grad, rtol=1e-6)
    assert loss.item() == pytest.approx(total, rel=1e-6)
    # the same through the module-level function, the stacked module, and in chunks
    assert torch.equal(ensemble.loss(noise.module, ensemble(x), y), loss)
    from samplers_as_optim import ensemble_loss

    assert torch.equal(ensemble_loss(noise, ensemble(x), y), loss)
    expected = {
        n: p.grad.clone() for n, p in [*ensemble.named_parameters(), *noise.named_parameters()]
    }
    ensemble.zero_grad()
    noise.zero_grad()
    chunked = ensemble.backward(noise, x, targets=y, chunk_size=2)
    assert chunked.item() == pytest.approx(loss.item(), rel=1e-6)
    for name, parameter in [*ensemble.named_parameters(), *noise.named_parameters()]:
        assert torch.allclose(parameter.grad, expected[name], rtol=1e-6, atol=1e-7), name


def test_per_member_targets_with_a_likelihood_module():
    ensemble, noise = _ensemble()
    x, y = torch.randn(3, 10, 4), torch.randn(3, 10, 1)
    loss = ensemble.loss(noise, ensemble(x, per_member_inputs=True), y, per_member_targets=True)
    expected = sum(_single_gradients(ensemble, noise, k, x[k], y[k])[0].item() for k in range(3))
    assert loss.item() == pytest.approx(expected, rel=1e-6)


def test_a_loss_module_not_stacked_over_the_members_is_refused():
    ensemble, _ = _ensemble()
    x, y = torch.randn(10, 4), torch.randn(10, 1)
    with pytest.raises(ValueError) as info:
        ensemble.loss(GaussianLikelihood(num_data=N), ensemble(x), y)
    assert str(info.value).startswith(
        "Invalid loss_fn: GaussianLikelihood with tensors {'log_noise_std': ()} (expected a "
        "loss module whose parameters and buffers are stacked along a leading member "
        "dimension, 3 members here"
    )
    other = ParallelEnsemble(GaussianLikelihood(num_data=N), 2)
    with pytest.raises(ValueError, match=r"Invalid loss_fn: GaussianLikelihood with tensors"):
        ensemble.loss(other, ensemble(x), y)


def test_parallel_sghmc_samples_each_members_noise():
    ensemble, noise = _ensemble(2)
    optimizer = SGHMC([*ensemble.parameters(), *noise.parameters()], lr=1e-3, num_data=N, seed=0)
    x, y = torch.randn(N, 4), torch.randn(N, 1)
    before = noise.module.log_noise_std.detach().clone()
    optimizer.zero_grad()
    ensemble.loss(noise, ensemble(x), y).backward()
    optimizer.step()
    after = noise.module.log_noise_std.detach()
    assert bool((after != before).all())


# ----------------------------------------------------------------------------- predictive
def test_gaussian_regression_aligns_one_sigma_per_sample():
    torch.manual_seed(4)
    means, stds = torch.randn(5, 7, 1), torch.rand(5) + 0.1
    got = predictive.gaussian_regression(means, stds)
    expected = predictive.regression(means, stds.square().reshape(5, 1, 1))
    for field, value in zip(got, expected, strict=True):
        assert torch.allclose(field, value)
    fixed = predictive.gaussian_regression(means, 0.5)
    assert torch.allclose(fixed.aleatoric, torch.full((7, 1), 0.25))


def test_heteroscedastic_regression_is_the_mixture_of_the_heads_gaussians():
    torch.manual_seed(5)
    head = HeteroscedasticGaussian()
    outputs = torch.randn(4, 6, 2)
    mean, std = head.mean_and_std(outputs)
    got = predictive.heteroscedastic_regression(outputs, head)
    assert torch.allclose(got.aleatoric, std.square().mean(0))
    assert torch.allclose(got.mean, mean.mean(0))
    assert torch.allclose(got.epistemic, mean.var(0, unbiased=False))


def test_regression_scores_in_the_original_units():
    torch.manual_seed(6)
    means, variances, targets = torch.randn(3, 9, 1), torch.rand(3, 9, 1) + 0.2, torch.randn(9, 1)
    scale, shift = 4.0, 10.0
    scores = predictive.regression_scores(means, variances, targets, target_std=scale)
    original = predictive.regression_scores(
        means * scale + shift, variances * scale**2, targets * scale + shift
    )
    assert scores.rmse.item() == pytest.approx(original.rmse.item(), rel=1e-5)
    assert scores.log_likelihood.item() == pytest.approx(original.log_likelihood.item(), rel=1e-5)
    rmse = (means.mean(0) - targets).square().mean().sqrt()
    assert original.rmse.item() == pytest.approx(scale * rmse.item(), rel=1e-5)
    nll = predictive.regression_nll(means, variances, targets)
    assert scores.log_likelihood.item() == pytest.approx(-nll.item() - math.log(scale), rel=1e-6)


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (
            lambda: predictive.gaussian_regression(torch.zeros(2, 3), torch.tensor([1.0, 0.0])),
            ValueError,
            "Invalid noise_std: values not > 0 (expected standard deviations > 0)",
        ),
        (
            lambda: predictive.gaussian_regression(torch.zeros(2, 3), "1"),
            TypeError,
            "Invalid noise_std: str (expected a tensor or a number)",
        ),
        (
            lambda: predictive.gaussian_regression(torch.zeros(2, 3), torch.ones(4)),
            ValueError,
            "Invalid noise_std: shape (4,) (expected (), [S] = [2] (one per sample), or a "
            "shape that broadcasts to the means' (2, 3))",
        ),
        (
            lambda: predictive.gaussian_regression(torch.zeros(2, 3), torch.ones(5, 2, 3)),
            ValueError,
            "Invalid noise_std: shape (5, 2, 3) (expected (), [S] = [2] (one per sample), or "
            "a shape that broadcasts to the means' (2, 3))",
        ),
        (
            lambda: predictive.gaussian_regression(torch.zeros(2, 3), torch.ones(2, 1, 1)),
            ValueError,
            "Invalid noise_std: shape (2, 1, 1) (expected (), [S] = [2]",
        ),
        (
            lambda: predictive.heteroscedastic_regression(
                torch.zeros(2, 0, 2), HeteroscedasticGaussian()
            ),
            ValueError,
            "Invalid outputs: shape (2, 0, 2) (expected a non-empty tensor [samples, B, 2D]",
        ),
        (
            lambda: predictive.regression_scores(
                torch.zeros(2, 3), torch.ones(4, 2, 3), torch.zeros(3)
            ),
            ValueError,
            "Invalid variances: shape (4, 2, 3) (expected a shape that broadcasts to the means' "
            "(2, 3))",
        ),
        (
            lambda: predictive.regression_scores(torch.zeros(2, 3), 1.0, torch.zeros(2, 3)),
            ValueError,
            "Invalid targets: shape (2, 3) (expected (3,), the means' shape without the sample "
            "dimension)",
        ),
        (
            lambda: predictive.heteroscedastic_regression(torch.zeros(2, 3, 2), "head"),
            TypeError,
            "Invalid head: str (expected a HeteroscedasticGaussian)",
        ),
        (
            lambda: predictive.regression_scores(
                torch.zeros(1, 2), 1.0, torch.zeros(2), target_std=0.0
            ),
            ValueError,
            "Invalid target_std: 0.0 (expected a finite number > 0)",
        ),
    ],
)
def test_predictive_refusals(call, error, message):
    with pytest.raises(error) as info:
        call()
    assert str(info.value).startswith(message)


def test_an_ensemble_of_heteroscedastic_members():
    torch.manual_seed(7)
    ensemble = ParallelEnsemble(lambda: nn.Linear(3, 2), 3, seed=0)
    head = HeteroscedasticGaussian()
    x, y = torch.randn(8, 3), torch.randn(8)
    outputs = ensemble(x)
    expected = sum(head(outputs[k], y).item() for k in range(3))
    assert ensemble.loss(head, outputs, y).item() == pytest.approx(expected, rel=1e-6)
    prediction = predictive.heteroscedastic_regression(outputs.detach(), head)
    assert prediction.mean.shape == (8, 1)
