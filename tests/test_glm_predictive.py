"""The GLM predictive: the function-space Gaussian, its closed forms, and predict's default.

Exactness runs in float64: the function-space covariance T J Lambda^-1 J^T against a
brute-force one (the full Jacobian by jacrev, the inverse of the dense precision), and the
regression predictive of a dense Laplace on Bayesian linear regression against the
conjugate posterior predictive. The Monte Carlo checks draw with fixed seeds and bound
the error by a stated number of the estimator's standard deviations.
"""

import math
import re

import numpy as np
import pytest
import torch
from torch import nn
from torch.func import functional_call, jacrev
from torch.utils.data import DataLoader, TensorDataset

from samplers_as_optim import SWAG, ExtendedKalmanFilter, Laplace, predictive
from samplers_as_optim.gaussian.kfac import KronPrecision
from samplers_as_optim.gaussian.linearised import output_jacobians as _output_jacobians

pytestmark = pytest.mark.usefixtures("float64_default")

TEMPERATURE = 0.7
NOISE = 0.5


def assert_close(actual, expected, rtol=1e-10, atol=1e-12):
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


def net():
    """A Linear/Tanh/LayerNorm/Linear classifier: KFAC blocks and a diagonal part."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.LayerNorm(8), nn.Linear(8, 3))


def class_data(n=48, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=gen), torch.randint(0, 3, (n,), generator=gen)


def loader(x, y, batch_size=16):
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


def fitted(structure, subset=None, temperature=TEMPERATURE, model=None):
    x, y = class_data()
    model = net() if model is None else model
    la = Laplace(
        model,
        num_data=len(x),
        likelihood="classification",
        structure=structure,
        prior_precision=2.0,
        temperature=temperature,
        subset=subset,
    )
    return la.fit(loader(x, y)), x


def brute_force_covariance(la, x):
    """T J Sigma J^T from the batch Jacobian (jacrev) and the inverted dense precision."""
    names = la.treated.names
    jac = jacrev(lambda p: functional_call(la.model, p, (x,)))(la.mean)
    batch, outputs = x.shape[0], jac[names[0]].shape[1]
    per_input = torch.cat([jac[n].reshape(batch, outputs, -1) for n in names], -1)  # (B, O, P)
    precision = la.precision
    if isinstance(precision, dict):
        sigma = torch.diag(1.0 / la.treated.flatten(precision))
    elif isinstance(precision, KronPrecision):
        sigma = torch.linalg.inv(precision.dense())
    else:
        sigma = torch.linalg.inv(precision)
    return la.temperature * per_input @ sigma @ per_input.mT


STRUCTURES = [
    (structure, subset)
    for structure in ("diag", "dense", "kron")
    for subset in (None, "last_layer")
]


@pytest.mark.parametrize(("structure", "subset"), STRUCTURES)
def test_function_space_covariance_is_the_brute_force_one(structure, subset):
    la, x = fitted(structure, subset)
    gaussian = la.function_space(x[:6])
    assert_close(gaussian.mean, la.model(x[:6]).detach())
    assert gaussian.covariance.shape == (6, 3, 3)
    assert_close(gaussian.covariance, brute_force_covariance(la, x[:6]))
    assert not gaussian.covariance.requires_grad


@pytest.mark.parametrize(("structure", "subset"), STRUCTURES)
def test_function_space_is_the_law_of_the_linearised_draws(structure, subset):
    """predict(linear=True) draws f(x; mean) + J (theta_s - mean): the same Gaussian.

    With S draws the empirical covariance entry (i, j) has standard deviation
    sqrt((S_ii S_jj + S_ij^2) / (S - 1)); every entry must lie within 5 of them (45
    entries per case, 6 cases: a false alarm has probability below 1e-4).
    """
    la, x = fitted(structure, subset)
    draws = la.predict(x[:5], num_samples=4000, generator=torch.Generator().manual_seed(1))
    exact = la.function_space(x[:5])
    centred = draws - exact.mean
    empirical = torch.einsum("sbi,sbj->bij", centred, centred) / draws.shape[0]
    diag = exact.covariance.diagonal(dim1=-2, dim2=-1)
    sd = ((diag.unsqueeze(-1) * diag.unsqueeze(-2) + exact.covariance.square()) / 3999).sqrt()
    assert bool(((empirical - exact.covariance).abs() <= 5 * sd).all())


def test_chunking_does_not_change_the_result():
    la, x = fitted("kron")
    whole = la.function_space(x[:7])
    for chunk_size in (1, 3, 100):
        part = la.function_space(x[:7], chunk_size=chunk_size)
        assert_close(part.covariance, whole.covariance, rtol=1e-12, atol=1e-14)
    gen = lambda: torch.Generator().manual_seed(5)  # noqa: E731
    a = la.predictive(x[:7], generator=gen())
    b = la.predictive(x[:7], generator=gen(), chunk_size=2)
    for left, right in zip(a, b, strict=True):
        assert_close(left, right, rtol=1e-12, atol=1e-14)


def test_automatic_chunks_fit_the_budget(monkeypatch):
    monkeypatch.setattr(_output_jacobians, "_CHUNK_BYTES", 3 * 3 * 83 * 8 * 2)  # two inputs
    chunks = list(
        _output_jacobians.input_chunks(5, 3, 83, torch.float64, torch.device("cpu"), None)
    )
    assert chunks == [slice(0, 2), slice(2, 4), slice(4, 5)]
    la, x = fitted("dense")
    assert_close(la.function_space(x[:5]).covariance, brute_force_covariance(la, x[:5]))


def test_temperature_scales_the_covariance_and_zero_is_the_map():
    la, x = fitted("dense", temperature=1.0)
    one = la.function_space(x[:4]).covariance
    la.temperature = 3.0
    assert_close(la.function_space(x[:4]).covariance, 3.0 * one)
    la.temperature = 0.0
    zero = la.predictive(x[:4])
    assert_close(zero.probs, la.model(x[:4]).softmax(-1).detach())
    assert_close(zero.epistemic, torch.zeros(4))


# --------------------------------------------------------------------------- probit


def gauss_hermite_sigmoid(mean, variance, points=200):
    """E[sigmoid(f)], f ~ N(mean, variance), by Gauss-Hermite quadrature (error < 1e-12)."""
    nodes, weights = np.polynomial.hermite_e.hermegauss(points)
    weights = weights / weights.sum()
    f = mean[..., None] + np.sqrt(variance)[..., None] * nodes
    return (weights / (1 + np.exp(-f))).sum(-1)


def test_probit_is_its_formula():
    gen = torch.Generator().manual_seed(0)
    mean, variance = torch.randn(5, 4, generator=gen), torch.rand(5, 4, generator=gen) * 3
    expected = (mean / torch.sqrt(1 + math.pi / 8 * variance)).softmax(-1)
    assert_close(predictive.probit(mean, variance).softmax(-1), expected, rtol=1e-14)
    assert_close(predictive.probit(mean, torch.zeros(5, 4)), mean, rtol=0, atol=0)


def test_probit_approximates_the_logistic_gaussian_integral():
    """Two classes, the second logit fixed: sigmoid(mu / sqrt(1 + pi v / 8)).

    Its largest error over mu in [-10, 10], v in [0, 400] is 0.016 (quadrature), so
    0.02 bounds it.
    """
    mean = torch.linspace(-6, 6, 25).repeat_interleave(6)
    variance = torch.tensor([0.0, 0.1, 1.0, 4.0, 25.0, 100.0]).repeat(25)
    logits = torch.stack([mean, torch.zeros_like(mean)], -1)
    variances = torch.stack([variance, torch.zeros_like(variance)], -1)
    probit = predictive.probit(logits, variances).softmax(-1)[:, 0]
    exact = torch.from_numpy(gauss_hermite_sigmoid(mean.numpy(), variance.numpy()))
    assert float((probit - exact).abs().max()) < 0.02
    assert_close(probit[variance == 0], torch.sigmoid(mean[variance == 0]))


class PadZero(nn.Module):
    """Append a constant 0 logit: a binary classifier with one logit."""

    def forward(self, z):
        return torch.cat([z, torch.zeros_like(z)], -1)


def test_probit_and_mc_on_a_one_logit_classifier():
    """Laplace's probit and its "mc" both approach E[sigmoid(f)] of the function space.

    "mc" averages S = 20000 softmax draws: standard deviation below 0.5/sqrt(S), so within
    5 of them (0.018) of the quadrature; probit within its bound 0.02.
    """
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1), PadZero())
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40, 2, generator=gen)
    y = (x[:, 0] > 0).long()
    la = Laplace(model, num_data=40, likelihood="classification", structure="dense")
    la = la.fit(loader(x, y))
    x_test = 3 * torch.randn(8, 2, generator=gen)
    gaussian = la.function_space(x_test)
    assert_close(gaussian.covariance[:, 1], torch.zeros(8, 2), rtol=0, atol=0)
    mean, variance = gaussian.mean[:, 0], gaussian.covariance[:, 0, 0]
    exact = torch.from_numpy(gauss_hermite_sigmoid(mean.numpy(), variance.numpy()))
    assert float(variance.max()) > 0.5  # wide enough for the approximations to matter
    probit = la.predictive(x_test).probs[:, 0]
    assert_close(probit, torch.sigmoid(mean / torch.sqrt(1 + math.pi / 8 * variance)))
    assert float((probit - exact).abs().max()) < 0.02
    mc = la.predictive(
        x_test, link_approx="mc", num_samples=20000, generator=torch.Generator().manual_seed(1)
    )
    assert float((mc.probs[:, 0] - exact).abs().max()) < 5 * 0.5 / math.sqrt(20000)


# --------------------------------------------------------------------------- Laplace bridge


def bridge_by_hand(mean, covariance, normalize=False):
    """The Dirichlet parameters, element by element (Hobbhahn et al. 2022, eq. 6)."""
    k = len(mean)
    ones = [1.0] * k
    sums = [sum(covariance[i][j] for j in range(k)) for i in range(k)]
    total = sum(sums)
    mu = [mean[i] - sums[i] * sum(mean) / total for i in range(k)]
    var = [covariance[i][i] - sums[i] ** 2 / total for i in range(k)]
    if normalize:
        scale = sum(var) / k / math.sqrt(k / 2)
        mu = [m / math.sqrt(scale) for m in mu]
        var = [v / scale for v in var]
    inverse = sum(math.exp(-m) for m in mu)
    return [(ones[i] - 2 / k + math.exp(mu[i]) / k**2 * inverse) / var[i] for i in range(k)]


@pytest.mark.parametrize("normalize", [False, True])
def test_laplace_bridge_is_its_formula(normalize):
    gen = torch.Generator().manual_seed(2)
    mean = torch.randn(4, 3, generator=gen)
    root = torch.randn(4, 3, 3, generator=gen)
    covariance = root @ root.mT + 0.1 * torch.eye(3)
    log_alpha = predictive.laplace_bridge(mean, covariance, normalize=normalize)
    for b in range(4):
        alpha = torch.tensor(bridge_by_hand(mean[b].tolist(), covariance[b].tolist(), normalize))
        assert_close(log_alpha[b].exp(), alpha)
        dirichlet = torch.distributions.Dirichlet(alpha)
        assert_close(log_alpha[b].softmax(-1), dirichlet.mean)


def test_laplace_bridge_sees_no_shift_of_the_logits():
    """With row sums of Sigma constant, conditioning removes a shift of the mean."""
    mean = torch.tensor([[1.0, -0.5, 0.2, 0.0]])
    covariance = 0.7 * torch.eye(4).unsqueeze(0) + 0.2
    shifted = predictive.laplace_bridge(mean + 3.0, covariance)
    assert_close(shifted, predictive.laplace_bridge(mean, covariance))


def test_laplace_bridge_of_zero_variance_stays_finite():
    """A class whose conditioned variance is 0 (the formula's limit) takes all the mass;
    with no variance at all, alpha is proportional to the bracket of the formula."""
    mean = torch.tensor([[0.3, -0.2, 0.1]])
    covariance = torch.diag(torch.tensor([1.0, 1.0, 0.0])).unsqueeze(0)
    probs = predictive.laplace_bridge(mean, covariance).softmax(-1)
    assert_close(probs, torch.tensor([[0.0, 0.0, 1.0]]))
    log_alpha = predictive.laplace_bridge(mean, torch.zeros(1, 3, 3))
    bracket = 1 / 3 + mean.exp() / 9 * (-mean).exp().sum()
    assert_close(log_alpha.softmax(-1), bracket / bracket.sum())


@pytest.mark.parametrize("link", ["probit", "bridge", "bridge_norm", "mc"])
def test_classification_predictive_fields(link):
    la, x = fitted("kron")
    gen = lambda: torch.Generator().manual_seed(4)  # noqa: E731
    prediction = la.predictive(x[:6], link_approx=link, num_samples=300, generator=gen())
    gaussian = la.function_space(x[:6])
    mean, covariance = gaussian
    if link == "probit":
        expected = predictive.probit(mean, covariance.diagonal(dim1=-2, dim2=-1))
        assert_close(prediction.log_probs, expected.log_softmax(-1))
    elif link != "mc":
        expected = predictive.laplace_bridge(mean, covariance, normalize=link == "bridge_norm")
        assert_close(prediction.log_probs, expected.log_softmax(-1))
    assert_close(prediction.probs, prediction.log_probs.exp())
    assert_close(prediction.probs.sum(-1), torch.ones(6))
    probs, log_probs = prediction.probs, prediction.log_probs
    assert_close(prediction.total, -(probs * log_probs).sum(-1))
    assert bool((prediction.aleatoric >= 0).all() & (prediction.epistemic >= 0).all())
    if link == "mc":
        assert_close(prediction.total, prediction.aleatoric + prediction.epistemic)


def test_mc_link_converges_to_the_closed_forms_neighbourhood():
    """Three classes: probit's error has no stated bound here, so only a loose agreement
    (0.05) with the Monte Carlo average of S = 20000 draws (its sd <= 0.5 / sqrt(S), 5 sd
    = 0.018) is asserted: a guard against gross errors in either path."""
    la, x = fitted("dense")
    mc = la.predictive(
        x[:6], link_approx="mc", num_samples=20000, generator=torch.Generator().manual_seed(8)
    )
    probit = la.predictive(x[:6], num_samples=1)
    assert float((mc.probs - probit.probs).abs().max()) < 0.05


# --------------------------------------------------------------------------- regression


def blr_data(n=30, d=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=gen)
    y = x @ torch.linspace(-1.0, 1.0, d) + 0.3 + NOISE * torch.randn(n, generator=gen)
    return x, y.unsqueeze(-1)


def test_regression_predictive_is_the_conjugate_posterior_predictive():
    """Dense Laplace of BLR at the exact MAP: N(phi^T m, T phi^T Lambda^-1 phi + s^2)."""
    x, y = blr_data()
    prior = 2.0
    phi = torch.cat([x, torch.ones(len(x), 1)], 1)
    precision = prior * torch.eye(4) + phi.T @ phi / NOISE**2
    posterior_mean = torch.linalg.solve(precision, phi.T @ y.squeeze(-1) / NOISE**2)
    model = nn.Linear(3, 1)
    with torch.no_grad():
        model.weight.copy_(posterior_mean[:3].unsqueeze(0))
        model.bias.copy_(posterior_mean[3:])
    x_test = torch.randn(7, 3, generator=torch.Generator().manual_seed(9))
    phi_test = torch.cat([x_test, torch.ones(7, 1)], 1)
    epistemic = ((phi_test @ torch.linalg.inv(precision)) * phi_test).sum(-1, keepdim=True)
    for temperature in (1.0, 0.5):
        la = Laplace(
            model,
            num_data=len(x),
            likelihood="regression",
            noise_std=NOISE,
            structure="dense",
            prior_precision=prior,
            temperature=temperature,
        ).fit(loader(x, y, batch_size=8))
        prediction = la.predictive(x_test)
        assert isinstance(prediction, predictive.RegressionPrediction)
        assert_close(prediction.mean, (phi_test @ posterior_mean).unsqueeze(-1), 1e-10, 1e-10)
        assert_close(prediction.epistemic, temperature * epistemic, 1e-10, 1e-10)
        assert_close(prediction.aleatoric, torch.full((7, 1), NOISE**2), 1e-10, 1e-10)
        assert_close(prediction.total, temperature * epistemic + NOISE**2, 1e-10, 1e-10)
    # the EKF after one pass is the same conjugate posterior, and inherits the predictive
    start = nn.Linear(3, 1)
    with torch.no_grad():
        start.weight.zero_()
        start.bias.zero_()
    ekf = ExtendedKalmanFilter(
        start, likelihood="regression", noise_std=NOISE, structure="dense", prior_precision=prior
    )
    for batch in loader(x, y, batch_size=8):
        ekf.update(batch)
    prediction = ekf.predictive(x_test)
    assert_close(prediction.mean, (phi_test @ posterior_mean).unsqueeze(-1), 1e-10, 1e-10)
    assert_close(prediction.epistemic, epistemic, 1e-10, 1e-10)


def test_regression_with_several_outputs_reads_the_diagonal():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 2))
    x = torch.randn(20, 3)
    y = torch.randn(20, 2)
    la = Laplace(model, num_data=20, likelihood="regression", noise_std=0.3, structure="kron")
    la = la.fit(loader(x, y, batch_size=10))
    prediction = la.predictive(x[:5])
    gaussian = la.function_space(x[:5])
    assert prediction.mean.shape == prediction.epistemic.shape == (5, 2)
    assert_close(prediction.epistemic, gaussian.covariance.diagonal(dim1=-2, dim2=-1))
    assert_close(prediction.aleatoric, torch.full((5, 2), 0.09))
    assert_close(prediction.total, prediction.epistemic + 0.09)


# --------------------------------------------------------------------------- defaults


def test_laplace_and_ekf_predict_linearised_by_default_swag_samples():
    assert Laplace.default_linear is True
    assert ExtendedKalmanFilter.default_linear is True
    assert SWAG.default_linear is False
    la, x = fitted("diag")
    gen = lambda: torch.Generator().manual_seed(6)  # noqa: E731
    default = la.predict(x[:4], num_samples=5, generator=gen())
    assert_close(default, la.predict(x[:4], num_samples=5, linear=True, generator=gen()))
    sampled = la.predict(x[:4], num_samples=5, linear=False, generator=gen())
    assert float((default - sampled).abs().max()) > 1e-6  # a nonlinear network
    model = net()
    swag = SWAG(model, rank=0)
    for _ in range(3):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * torch.randn_like(p))
        swag.record()
    assert_close(
        swag.predict(x[:4], num_samples=5, generator=gen()),
        swag.predict(x[:4], num_samples=5, linear=False, generator=gen()),
    )


# --------------------------------------------------------------------------- refusals


def test_refusals():
    la, x = fitted("diag")
    with pytest.raises(
        ValueError,
        match=re.escape(
            "Invalid link_approx: 'logit' (expected one of 'probit', 'bridge', 'bridge_norm', 'mc')"
        ),
    ):
        la.predictive(x, link_approx="logit")
    with pytest.raises(
        ValueError, match=re.escape("Invalid num_samples: 0 (expected an integer >= 1)")
    ):
        la.predictive(x, num_samples=0)
    with pytest.raises(
        ValueError, match=re.escape("Invalid chunk_size: 0 (expected None or an integer >= 1)")
    ):
        la.function_space(x, chunk_size=0)
    with pytest.raises(
        ValueError, match=re.escape("Invalid chunk_size: 0 (expected None or an integer >= 1)")
    ):
        la.predictive(x, chunk_size=0)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "Invalid x: shape (4,) gives outputs of shape (3,) (expected a batch of inputs, "
            "the batch first in both)"
        ),
    ):
        la.function_space(x[0])
    unfitted = Laplace(net(), num_data=10, likelihood="classification")
    with pytest.raises(RuntimeError, match="not fitted yet"):
        unfitted.predictive(x)
    with pytest.raises(RuntimeError, match="not fitted yet"):
        unfitted.function_space(x)


def test_refuses_a_callable_likelihood():
    x, y = class_data()

    def log_likelihood(output, target):
        return -torch.nn.functional.cross_entropy(output, target, reduction="none")

    la = Laplace(net(), num_data=len(x), likelihood=log_likelihood).fit(loader(x, y))
    with pytest.raises(
        ValueError,
        match=re.escape(
            "Invalid likelihood: a callable (expected 'classification' or 'regression' for "
            "predictive(); for a callable likelihood use function_space(x), the Gaussian "
            "over the outputs, or the draws of predict(x))"
        ),
    ):
        la.predictive(x)
    assert la.function_space(x[:2]).covariance.shape == (2, 3, 3)


def test_refuses_classification_outputs_that_are_not_logits():
    """Fitted on (batch, 4) inputs; a model whose output has lost its classes is refused.

    (batch, positions, 4) inputs give (batch, positions, 3) logits: predicted per
    position since issue #37 (tests/test_laplace_sequence.py).
    """
    la, x = fitted("diag")
    la.model.append(nn.Flatten(0))  # (2, 3) logits -> (6,): not (batch, classes)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "Invalid x: shape (2, 4) gives outputs of shape (6,) (expected a batch of "
            "inputs, the batch first in both)"
        ),
    ):
        la.predictive(x[:2])
    la.model[-1] = nn.Linear(3, 1)  # (2, 1), then (2,): one number per input
    la.model.append(nn.Flatten(0))
    with pytest.raises(
        ValueError,
        match=re.escape(
            "Invalid model output: shape (2,) (expected (batch, classes) or (batch, "
            "*positions, classes) logits for likelihood='classification')"
        ),
    ):
        la.predictive(x[:2])


def test_refuses_a_jacobian_that_cannot_fit(monkeypatch):
    la, x = fitted("diag")
    monkeypatch.setattr(_output_jacobians, "available_bytes", lambda device: 1000)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "Invalid x: one input's Jacobian (3 outputs x 83 treated parameters, "
            "torch.float64) needs about 5.57e-06 GiB with its copies, but cpu has 9.31e-07 "
            "GiB free (expected a Jacobian that fits: treat fewer weights, e.g. "
            "subset='last_layer', or use predict(x, linear=True), which samples with one "
            "jvp per draw)"
        ),
    ):
        la.predictive(x)


def test_probit_and_bridge_refusals():
    mean = torch.zeros(2, 3)
    with pytest.raises(
        TypeError,
        match=re.escape("Invalid mean: list (expected a torch.Tensor [B, ..., K] of logit means)"),
    ):
        predictive.probit([0.0, 1.0], torch.zeros(2))
    with pytest.raises(
        ValueError,
        match=re.escape("Invalid variance: shape (2, 2) (expected (2, 3), from the mean's (2, 3))"),
    ):
        predictive.probit(mean, torch.zeros(2, 2))
    with pytest.raises(
        ValueError,
        match=re.escape("Invalid variance: negative variances or NaN (expected variances >= 0)"),
    ):
        predictive.probit(mean, -torch.ones(2, 3))
    with pytest.raises(
        ValueError,
        match=re.escape("Invalid variance: negative variances or NaN (expected variances >= 0)"),
    ):
        predictive.probit(mean, torch.full((2, 3), math.nan))
    with pytest.raises(
        ValueError,
        match=re.escape(
            "Invalid covariance: shape (3,) (expected a non-empty tensor [B, ..., K, K] of "
            "the logits' covariances)"
        ),
    ):
        predictive.laplace_bridge(mean, torch.zeros(3))
    with pytest.raises(
        ValueError,
        match=re.escape(
            "Invalid covariance: shape (2, 3, 2) (expected (2, 3, 3), from the mean's (2, 3))"
        ),
    ):
        predictive.laplace_bridge(mean, torch.zeros(2, 3, 2))
    with pytest.raises(
        ValueError,
        match=re.escape("Invalid covariance: negative variances or NaN (expected variances >= 0)"),
    ):
        predictive.laplace_bridge(mean, -torch.eye(3).expand(2, 3, 3))
    with pytest.raises(
        ValueError,
        match=re.escape(
            "Invalid mean: 1 class(es) (expected K >= 2 logits for the Laplace bridge)"
        ),
    ):
        predictive.laplace_bridge(torch.zeros(2, 1), torch.ones(2, 1, 1))
    with pytest.raises(TypeError, match=re.escape("Invalid normalize: 1 (expected True or False)")):
        predictive.laplace_bridge(mean, torch.eye(3).expand(2, 3, 3), normalize=1)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "Invalid mean: shape () (expected a non-empty tensor [B, ..., K] of logit means)"
        ),
    ):
        predictive.probit(torch.tensor(1.0), torch.tensor(1.0))
    with pytest.raises(
        TypeError,
        match=re.escape(
            "Invalid variance: float (expected a torch.Tensor [B, ..., K] of variances)"
        ),
    ):
        predictive.probit(mean, 1.0)
    with pytest.raises(
        TypeError, match=re.escape("Invalid mean: dtype torch.int64 (expected a floating tensor)")
    ):
        predictive.probit(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3))
