"""The exact posterior of a conjugate Bayesian linear regression, from minibatch gradients.

Model: y = X w + N(0, sigma_y^2), prior w ~ N(0, sigma_w^2 I), posterior N(mu, Lambda^-1)
with Lambda = X^T X / sigma_y^2 + I / sigma_w^2. The user's loss is the usual mean
minibatch loss and the prior enters as ``weight_decay = 1 / (N sigma_w^2)`` (DESIGN §1),
so this also checks that documented equivalence.

K independent chains run as the rows of one parameter, each with its own minibatches.
Two known biases are accounted for, neither tuned: the step-size bias (exact, from the
full-batch linear chain in ``linear_chains``) and the minibatch-noise inflation. The
latter is bounded: the minibatch gradient noise (covariance C at the posterior mean)
enters exactly where the injected noise does, and the stationary covariance is monotone
and linear in the noise covariance, so S0 <= S <= (1 + kappa) S0 with
kappa = lambda_max(C) / (injected noise variance per step). The hyperparameters keep
kappa near 2%; the test asserts it.
"""

import numpy as np
import pytest
import torch
from linear_chains import covariance_standard_errors, position_moments, sghmc_mode, sgld_mode

from samplers_as_optim import SGHMC, SGLD, SGNHT

pytestmark = pytest.mark.slow

Z = 4.5
NUM_DATA, BATCH, CHAINS = 250, 50, 4000
SIGMA_Y, SIGMA_W = 0.5, 1.0


def dataset():
    rng = np.random.default_rng(1)
    correlation = np.linalg.cholesky(np.array([[1.0, 0.6], [0.6, 1.0]]))
    x = rng.normal(size=(NUM_DATA, 2)) @ correlation.T
    y = x @ np.array([1.0, -0.5]) + SIGMA_Y * rng.normal(size=NUM_DATA)
    return x, y


X, Y = dataset()
PRECISION = X.T @ X / SIGMA_Y**2 + np.eye(2) / SIGMA_W**2
POSTERIOR_MEAN = np.linalg.solve(PRECISION, X.T @ Y / SIGMA_Y**2)


def minibatch_noise_eigenvalue():
    residuals = X @ POSTERIOR_MEAN - Y
    per_example = X * residuals[:, None] / SIGMA_Y**2  # gradients of one example's loss
    return np.linalg.eigvalsh(np.cov(per_example.T, bias=True) / BATCH).max()


# sampler, exact-law mode, hyperparameters, steps (>= 5 slowest relaxation times)
CASES = {
    "sgld": (SGLD, sgld_mode, {"lr": 1.5e-3}, 2500),
    "sghmc": (SGHMC, sghmc_mode, {"lr": 1.2e-5, "momentum": 0.992}, 1400),
    "sgnht": (SGNHT, sghmc_mode, {"lr": 1.2e-5, "momentum": 0.992}, 1400),
}


@pytest.mark.parametrize("name", CASES)
def test_posterior_of_bayesian_linear_regression_from_minibatches(name, device):
    cls, mode, hyper, steps = CASES[name]
    lr = hyper["lr"]
    if name == "sgld":  # noise per step in parameter units vs the gradient noise lr^2 C
        kappa = minibatch_noise_eigenvalue() * lr**2 / (2 * lr / NUM_DATA)
    else:  # noise per step in buffer units vs the gradient noise C
        kappa = minibatch_noise_eigenvalue() / (2 * (1 - hyper["momentum"]) / (NUM_DATA * lr))
    assert kappa <= 0.025

    start_offset = np.array([0.2, 0.2])
    _, exact, slowest = position_moments(
        PRECISION, mode, start_offset=start_offset, num_data=NUM_DATA, temperature=1.0, **hyper
    )
    assert steps >= 5 * slowest
    posterior = np.linalg.inv(PRECISION)
    assert np.abs(exact - posterior).max() <= 0.005 * np.abs(posterior).max()  # step-size bias

    generator = torch.Generator().manual_seed(0)
    x = torch.tensor(X, dtype=torch.float32, device=device)
    y = torch.tensor(Y, dtype=torch.float32, device=device)
    start = torch.tensor(POSTERIOR_MEAN + start_offset, dtype=torch.float32, device=device)
    w = torch.nn.Parameter(start.repeat(CHAINS, 1))
    opt = cls([w], num_data=NUM_DATA, weight_decay=1 / (NUM_DATA * SIGMA_W**2), seed=3, **hyper)
    for _ in range(steps):
        index = torch.randint(0, NUM_DATA, (CHAINS, BATCH), generator=generator).to(device)
        xb, yb = x[index], y[index]
        residuals = torch.einsum("kbp,kp->kb", xb, w.detach()) - yb
        w.grad = torch.einsum("kbp,kb->kp", xb, residuals) / (BATCH * SIGMA_Y**2)
        opt.step()
    samples = w.detach().double().cpu().numpy()

    mean_se = np.sqrt(np.diag(exact) * (1 + kappa) / CHAINS)
    np.testing.assert_array_less(np.abs(samples.mean(0) - POSTERIOR_MEAN), Z * mean_se)
    scale = np.sqrt(np.outer(np.diag(exact), np.diag(exact)))
    allowed = Z * covariance_standard_errors(exact * (1 + kappa), CHAINS) + kappa * scale
    np.testing.assert_array_less(np.abs(np.cov(samples.T) - exact), allowed)
