"""``Laplace.optimize_prior_precision(method="gridsearch")``: the GLM predictive's score.

Every score is checked against an independent computation of the same quantity:

* Bayesian linear regression (float64): the exact Gaussian predictive
  N(x·w*, x Σ(δ) xᵀ + σ²), with Σ(δ) = T (δI + XᵀX/σ²)⁻¹ (dense; KFAC equals it for one
  output) or T diag(δ + diag(XᵀX)/σ²)⁻¹ (diag), written out by hand;
* classification: ``Laplace.predictive`` after setting ``prior_precision`` to each δ
  (a refit of the precision and new Jacobians per δ, where the grid search reuses them);
* ``link_approx="mc"``: the same standard normal draws (batch b from a generator seeded
  with b) put through the function-space Gaussian by hand or by ``predictive``.

The tolerances are round-off (float64, 1e-10 relative), not Monte Carlo error: every
comparison uses the same draws.
"""

from __future__ import annotations

import functools
import math
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from samplers_as_optim.gaussian.laplace import Laplace
from samplers_as_optim.gaussian.laplace._prior_search import grid_scores

DTYPE = torch.float64
GRID = torch.logspace(-2, 4, 13, dtype=DTYPE).tolist()


# ---------------------------------------------------------------- linear regression
def blr(seed: int = 0, n: int = 40, d: int = 5, n_val: int = 30):
    """Training and validation data of y = x·w + 0.5 ε, validation inputs 3x wider."""
    generator = torch.Generator().manual_seed(seed)
    w = torch.randn(d, 1, generator=generator, dtype=DTYPE)
    x = torch.randn(n, d, generator=generator, dtype=DTYPE)
    y = x @ w + 0.5 * torch.randn(n, 1, generator=generator, dtype=DTYPE)
    x_val = 3.0 * torch.randn(n_val, d, generator=generator, dtype=DTYPE)
    y_val = x_val @ w + 0.5 * torch.randn(n_val, 1, generator=generator, dtype=DTYPE)
    return x, y, x_val, y_val


def blr_laplace(x, y, structure, sigma, temperature=1.0):
    """``nn.Linear(d, 1, bias=False)`` at the MAP of the prior N(0, I), fitted."""
    model = nn.Linear(x.shape[1], 1, bias=False).to(DTYPE)
    precision = x.T @ x / sigma**2 + torch.eye(x.shape[1], dtype=DTYPE)
    with torch.no_grad():
        model.weight.copy_(torch.linalg.solve(precision, x.T @ y / sigma**2).T)
    la = Laplace(
        model,
        num_data=x.shape[0],
        likelihood="regression",
        noise_std=sigma,
        structure=structure,
        temperature=temperature,
    )
    return la.fit(DataLoader(TensorDataset(x, y), batch_size=16), progress=False)


def exact_predictive_nll(la, x, y, x_val, y_val, sigma, temperature, structure):
    """Σ_i -log N(y_i | x_i·w*, x_i Σ(δ) x_iᵀ + σ²) for every δ of GRID, by hand."""
    w = la.mean["weight"].reshape(-1, 1)
    gram = x.T @ x / sigma**2
    scores = []
    for delta in GRID:
        if structure == "diag":
            covariance = torch.diag(1.0 / (delta + gram.diagonal()))
        else:
            covariance = torch.linalg.inv(delta * torch.eye(x.shape[1], dtype=DTYPE) + gram)
        variance = temperature * ((x_val @ covariance) * x_val).sum(1) + sigma**2
        residual = (y_val - x_val @ w)[:, 0]
        nll = 0.5 * (torch.log(2 * math.pi * variance) + residual.square() / variance)
        scores.append(nll.sum())
    return torch.stack(scores)


@pytest.mark.parametrize("structure", ["diag", "kron", "dense"])
@pytest.mark.parametrize("temperature", [1.0, 0.3])
def test_regression_grid_equals_the_exact_gaussian_predictive(structure, temperature):
    # seed 3: a data set whose exact minimum is inside the grid for every case (asserted),
    # so that choosing an edge by mistake cannot pass
    x, y, x_val, y_val = blr(seed=3)
    sigma = 0.5
    la = blr_laplace(x, y, structure, sigma, temperature)
    expected = exact_predictive_nll(la, x, y, x_val, y_val, sigma, temperature, structure)
    best = int(expected.argmin())
    assert 0 < best < len(GRID) - 1
    val = DataLoader(TensorDataset(x_val, y_val), batch_size=8)  # several batches
    scores = grid_scores(la, val, GRID, "probit", 1, False)
    torch.testing.assert_close(scores, expected, rtol=1e-10, atol=0.0)
    # any closed-form link_approx is the exact Gaussian for regression
    torch.testing.assert_close(
        grid_scores(la, val, GRID, "bridge", 1, False), expected, rtol=1e-10, atol=0.0
    )
    la.optimize_prior_precision("gridsearch", val_loader=val, grid=GRID, progress=False)
    assert la.prior_precision == GRID[best]
    assert la.noise_std == sigma
    # the posterior was rebuilt at the chosen value
    fresh = blr_laplace(x, y, structure, sigma, temperature)
    fresh.prior_precision = GRID[best]
    left, right = la.precision, fresh.precision
    if structure == "kron":
        left, right = left.dense(), right.dense()
    torch.testing.assert_close(left, right, rtol=0.0, atol=0.0)


def test_regression_scores_at_a_changed_noise():
    """σ set after the fit rescales the stored curvature (GGN: 1/σ²) and the noise term."""
    x, y, x_val, y_val = blr(seed=1)
    la = blr_laplace(x, y, "dense", 1.0)
    la.noise_std = 0.3
    expected = exact_predictive_nll(la, x, y, x_val, y_val, 0.3, 1.0, "dense")
    val = DataLoader(TensorDataset(x_val, y_val), batch_size=30)
    torch.testing.assert_close(
        grid_scores(la, val, GRID, "probit", 1, False), expected, rtol=1e-10, atol=0.0
    )


def test_regression_monte_carlo_uses_the_seeded_draws():
    """``"mc"``: -Σ log (1/S) Σ_s N(y | x·w* + sqrt(v_epi) ξ_s, σ²), ξ from seed b."""
    x, y, x_val, y_val = blr(seed=2)
    sigma, samples = 0.3, 64
    la = blr_laplace(x, y, "dense", sigma)
    w = la.mean["weight"].reshape(-1, 1)
    batches = [(x_val[:20], y_val[:20]), (x_val[20:], y_val[20:])]
    expected = torch.zeros(len(GRID), dtype=DTYPE)
    gram = x.T @ x / sigma**2
    for index, (xb, yb) in enumerate(batches):
        noise = torch.randn(
            samples, xb.shape[0], 1, generator=torch.Generator().manual_seed(index), dtype=DTYPE
        )
        for g, delta in enumerate(GRID):
            covariance = torch.linalg.inv(delta * torch.eye(5, dtype=DTYPE) + gram)
            spread = ((xb @ covariance) * xb).sum(1, keepdim=True).sqrt()
            draws = xb @ w + spread * noise  # (S, B, 1)
            log_p = -0.5 * (math.log(2 * math.pi * sigma**2) + (yb - draws).square() / sigma**2)
            expected[g] -= (log_p[..., 0].logsumexp(0) - math.log(samples)).sum()
    scores = grid_scores(la, batches, GRID, "mc", samples, False)
    torch.testing.assert_close(scores, expected, rtol=1e-10, atol=0.0)
    la.optimize_prior_precision(
        "gridsearch", val_loader=batches, grid=GRID, link_approx="mc", num_samples=samples
    )
    assert la.prior_precision == GRID[int(expected.argmin())]


# ---------------------------------------------------------------- classification
def mlp(seed: int = 0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).to(DTYPE)


def classification(seed: int, n: int):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=generator, dtype=DTYPE)
    return x, torch.randint(0, 3, (n,), generator=generator)


@functools.cache
def trained_weights():
    """A briefly trained MLP's weights (so that the predictive is not uniform)."""
    model = mlp()
    x, y = classification(1, 48)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    for _ in range(100):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def fitted_mlp(structure, likelihood="classification", temperature=1.0):
    """A fitted Laplace of a fresh copy of the trained MLP."""
    model = mlp()
    model.load_state_dict(trained_weights())
    x, y = classification(1, 48)
    la = Laplace(
        model, num_data=48, likelihood=likelihood, structure=structure, temperature=temperature
    )
    return la.fit(DataLoader(TensorDataset(x, y), batch_size=16), progress=False)


def predictive_scores(la, batches, link_approx, num_samples=1):
    """-Σ log p(y | x) from ``la.predictive`` at each δ of GRID (batch b: seed b)."""
    original = la.prior_precision
    scores = []
    for delta in GRID:
        la.prior_precision = delta
        total = torch.zeros((), dtype=DTYPE)
        for index, (xb, yb) in enumerate(batches):
            prediction = la.predictive(
                xb,
                link_approx=link_approx,
                num_samples=num_samples,
                generator=torch.Generator().manual_seed(index),
            )
            total -= prediction.log_probs[torch.arange(len(yb)), yb].sum()
        scores.append(total)
    la.prior_precision = original
    return torch.stack(scores)


def validation(seed: int = 5):
    x_val, y_val = classification(seed, 30)
    return [(x_val[:12], y_val[:12]), (x_val[12:], y_val[12:])]


@pytest.mark.parametrize("structure", ["diag", "kron", "dense"])
def test_classification_probit_equals_the_predictive(structure):
    la = fitted_mlp(structure, temperature=0.7)
    batches = validation()
    expected = predictive_scores(la, batches, "probit")
    scores = grid_scores(la, batches, GRID, "probit", 1, False)
    torch.testing.assert_close(scores, expected, rtol=1e-10, atol=0.0)
    assert len(set(expected.tolist())) == len(GRID)
    la.optimize_prior_precision("gridsearch", val_loader=batches, grid=GRID, progress=False)
    assert la.prior_precision == GRID[int(expected.argmin())]


@pytest.mark.parametrize("link_approx", ["bridge", "bridge_norm"])
@pytest.mark.parametrize("structure", ["diag", "kron"])
def test_classification_bridge_equals_the_predictive(structure, link_approx):
    la = fitted_mlp(structure)
    batches = validation(6)
    expected = predictive_scores(la, batches, link_approx)
    scores = grid_scores(la, batches, GRID, link_approx, 1, False)
    torch.testing.assert_close(scores, expected, rtol=1e-10, atol=0.0)
    la.optimize_prior_precision(
        "gridsearch", val_loader=batches, grid=GRID, link_approx=link_approx, progress=False
    )
    assert la.prior_precision == GRID[int(expected.argmin())]


@pytest.mark.parametrize("structure", ["diag", "dense"])
def test_classification_monte_carlo_uses_the_predictive_draws(structure):
    """``"mc"`` with the draws of ``predictive(..., generator=seed b)``; repeatable."""
    la = fitted_mlp(structure)
    batches = validation(7)
    expected = predictive_scores(la, batches, "mc", num_samples=40)
    scores = grid_scores(la, batches, GRID, "mc", 40, False)
    torch.testing.assert_close(scores, expected, rtol=1e-10, atol=0.0)
    torch.testing.assert_close(grid_scores(la, batches, GRID, "mc", 40, False), scores)
    la.optimize_prior_precision(
        "gridsearch", val_loader=batches, grid=GRID, link_approx="mc", num_samples=40
    )
    assert la.prior_precision == GRID[int(expected.argmin())]


def test_callable_likelihood_takes_monte_carlo_only():
    """A callable log-likelihood (here the softmax's) scores as classification's "mc"."""
    la = fitted_mlp("diag")
    batches = validation(8)
    reference = grid_scores(la, batches, GRID, "mc", 30, False)
    custom = Laplace(
        la.model,
        num_data=48,
        likelihood=lambda f, y: -F.cross_entropy(f, y, reduction="none"),
    ).fit(DataLoader(TensorDataset(*classification(1, 48)), batch_size=16), progress=False)
    torch.testing.assert_close(
        grid_scores(custom, batches, GRID, "mc", 30, False), reference, rtol=1e-10, atol=0.0
    )
    message = (
        "Invalid link_approx: 'probit' (expected 'mc' with a callable likelihood, whose "
        "predictive has no closed form)"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        custom.optimize_prior_precision("gridsearch", val_loader=batches)
    assert custom.prior_precision == 1.0


def test_progress_bar(capsys):
    pytest.importorskip("tqdm")
    la = fitted_mlp("diag")
    la.optimize_prior_precision("gridsearch", val_loader=validation(), progress=True)
    assert "optimize_prior_precision" in capsys.readouterr().err


# ---------------------------------------------------------------- refusals
def _nan_batches():
    x_val, y_val = classification(9, 10)
    x_val[3, 1] = math.nan
    return [(x_val, y_val)]


ERRORS = [
    (
        {"link_approx": "logit"},
        ValueError,
        "Invalid link_approx: 'logit' (expected one of 'probit', 'bridge', 'bridge_norm', 'mc')",
    ),
    (
        {"link_approx": "mc", "num_samples": 0},
        ValueError,
        "Invalid num_samples: 0 (expected an integer >= 1)",
    ),
    ({"num_samples": 2.5}, TypeError, "Invalid num_samples: 2.5 (expected an integer >= 1)"),
    (
        {"val_loader": _nan_batches()},
        ValueError,
        "Invalid batch: inputs contain 1 non-finite value, the first (nan) in example 3 of "
        "10 (expected finite inputs and targets: drop or impute those examples)",
    ),
    (
        {"val_loader": [(classification(9, 1)[0][0], classification(9, 1)[1])]},
        ValueError,
        "Invalid val_loader: inputs of shape (4,) give outputs of shape (3,) (expected a "
        "batch of inputs, the batch first in both)",
    ),
]


@pytest.mark.parametrize(("kwargs", "error", "message"), ERRORS)
def test_refusals_change_nothing(kwargs, error, message):
    la = fitted_mlp("diag")
    la.prior_precision = 0.7
    before = {name: value.clone() for name, value in la.precision.items()}
    arguments = {"val_loader": validation(), "grid": GRID, "progress": False, **kwargs}
    with pytest.raises(error, match=re.escape(message)):
        la.optimize_prior_precision("gridsearch", **arguments)
    assert la.prior_precision == 0.7
    for name, value in la.precision.items():
        assert torch.equal(value, before[name])


def test_regression_targets_of_another_shape_are_refused():
    x, y, x_val, y_val = blr()
    la = blr_laplace(x, y, "diag", 0.3)
    message = (
        "Invalid targets: shape (30,) (expected the model output's shape (30, 1) for "
        "likelihood='regression')"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        la.optimize_prior_precision("gridsearch", val_loader=[(x_val, y_val[:, 0])], grid=GRID)
    assert la.prior_precision == 1.0


class RootOfSquare(nn.Module):
    """|z| as sqrt(z²): finite everywhere, its autograd derivative NaN at z = 0."""

    def forward(self, z):
        return (z * z).sqrt()


def test_a_jacobian_holding_nan_is_refused():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6, bias=False), RootOfSquare(), nn.Linear(6, 3)).to(DTYPE)
    x, y = classification(1, 48)
    la = Laplace(model, num_data=48, likelihood="classification")
    la.fit(DataLoader(TensorDataset(x, y), batch_size=16), progress=False)
    x_val, y_val = classification(2, 10)
    x_val[4] = 0.0  # the first layer's output is 0 there: a finite output, a NaN Jacobian
    message = (
        "Invalid model: its Jacobian at the validation inputs holds NaN or inf (expected a "
        "network differentiable at every validation input)"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        la.optimize_prior_precision("gridsearch", val_loader=[(x_val, y_val)], grid=GRID)
    assert la.prior_precision == 1.0


def test_a_likelihood_giving_nan_is_refused():
    la = fitted_mlp("diag")

    def log_likelihood(f, y):
        value = -F.cross_entropy(f, y, reduction="none")
        return torch.where(y == 1, math.nan, value)

    custom = Laplace(la.model, num_data=48, likelihood=log_likelihood)
    custom.fit(DataLoader(TensorDataset(*classification(1, 48)), batch_size=16), progress=False)
    custom.prior_precision = 0.7
    message = (
        "Invalid val_loader: the validation negative log-likelihood is NaN at prior_precision "
        "0.01 (expected a log-likelihood that is a number for every validation example)"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        custom.optimize_prior_precision(
            "gridsearch", val_loader=validation(), grid=GRID, link_approx="mc", num_samples=4
        )
    assert custom.prior_precision == 0.7
