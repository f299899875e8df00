"""Exact laws of the discretised samplers on a Gaussian target, for the statistical tests.

With ``N * L(theta) = (theta - m)^T P (theta - m) / 2`` the gradient is linear, so every
sampler here is a linear Gaussian Markov chain. In the eigenbasis of P the coordinates
decouple: for an eigenvalue ``lam`` the state of one mode is ``x`` (SGLD) or ``(x, b)``
(SGHMC, and SGNHT at a frozen thermostat) with ``z' = M z + B xi``. Its mean and
covariance after any number of steps, and at stationarity, are exact; the position
covariance of the whole chain is ``V diag(var_x) V^T``.
"""

import numpy as np


def sgld_mode(lam, *, lr, num_data, temperature):
    h = lr / num_data
    return np.array([[1.0 - h * lam]]), np.array([np.sqrt(2.0 * h * temperature)])


def sghmc_mode(lam, *, lr, num_data, temperature, momentum, friction=None):
    """SGHMC: b' = mu b + lam x / N + s xi, x' = x - lr b'.

    ``friction`` (alpha) replaces ``1 - momentum`` in the buffer's decay only, which is
    SGNHT with its thermostat frozen at alpha; the noise keeps momentum's scale.
    """
    decay = momentum if friction is None else 1.0 - friction
    s = np.sqrt(2.0 * (1.0 - momentum) * temperature / (num_data * lr))
    g = lam / num_data
    transition = np.array([[1.0 - lr * g, -lr * decay], [g, decay]])
    return transition, np.array([-lr * s, s])


def stationary_covariance(transition, noise):
    """Solve S = M S M^T + B B^T."""
    k = transition.shape[0]
    rhs = np.outer(noise, noise).reshape(-1)
    solution = np.linalg.solve(np.eye(k * k) - np.kron(transition, transition), rhs)
    return solution.reshape(k, k)


def moments_after(transition, noise, start, steps):
    """Exact mean and covariance of the mode's state after ``steps`` from ``start``."""
    mean = np.asarray(start, dtype=float)
    cov = np.zeros((len(mean), len(mean)))
    bb = np.outer(noise, noise)
    for _ in range(steps):
        mean = transition @ mean
        cov = transition @ cov @ transition.T + bb
    return mean, cov


def spectral_radius(transition):
    return max(abs(np.linalg.eigvals(transition)))


def position_moments(precision, mode, *, start_offset, steps=None, **hyper):
    """Mean offset and covariance of theta after ``steps`` (None: at stationarity).

    Args:
        precision: P, the Hessian of N * L.
        mode: ``sgld_mode`` or ``sghmc_mode``.
        start_offset: theta_0 - m (buffers start at 0).
        steps: number of steps, or None for the stationary law.
        **hyper: the mode's hyperparameters.

    Returns:
        (mean of theta - m, covariance of theta, slowest relaxation in steps).
    """
    eigenvalues, vectors = np.linalg.eigh(precision)
    start = vectors.T @ start_offset
    means, variances, slowest = [], [], 0.0
    for lam, x0 in zip(eigenvalues, start, strict=True):
        transition, noise = mode(lam, **hyper)
        slowest = max(slowest, 1.0 / (1.0 - spectral_radius(transition)))
        z0 = np.zeros(transition.shape[0])
        z0[0] = x0
        if steps is None:
            mean, cov = np.zeros_like(z0), stationary_covariance(transition, noise)
        else:
            mean, cov = moments_after(transition, noise, z0, steps)
        means.append(mean[0])
        variances.append(cov[0, 0])
    return vectors @ np.array(means), vectors @ np.diag(variances) @ vectors.T, slowest


def covariance_standard_errors(cov, num_samples):
    """Standard error of each entry of a sample covariance of Gaussian draws."""
    diag = np.diag(cov)
    return np.sqrt((cov**2 + np.outer(diag, diag)) / (num_samples - 1))
