"""Exact laws of the discretised samplers on a Gaussian target, for the statistical tests.

With ``N * L(theta) = (theta - m)^T P (theta - m) / 2`` the gradient is linear, so every
sampler here is a linear Gaussian Markov chain. In the eigenbasis of P the coordinates
decouple: for an eigenvalue ``lam`` the state of one mode is ``x`` (SGLD) or ``(x, b)``
(SGHMC, and SGNHT at a frozen thermostat) with ``z' = M z + B xi``. Its mean and
covariance after any number of steps, and at stationarity, are exact; the position
covariance of the whole chain is ``V diag(var_x) V^T``.

Under a learning-rate schedule each step has its own ``M`` and ``B``, and a change of lr
at T > 0 first rescales the buffer, ``b <- sqrt(lr_old / lr_new) b`` (linear too), so the
law through any schedule is exact as well (:func:`schedule_moments`).
"""

import numpy as np


def correlated_gaussian(dim, seed=0):
    """A mean and a covariance of condition number 10 in a random rotation."""
    rng = np.random.default_rng(seed)
    rotation, _ = np.linalg.qr(rng.normal(size=(dim, dim)))
    covariance = rotation @ np.diag(np.geomspace(0.3, 3.0, dim)) @ rotation.T
    return rng.normal(size=dim), covariance


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


def rescale_mode(state_size, lr_old, lr_new):
    """The linear map of a mode's state when lr changes at T > 0: x kept, b rescaled."""
    if state_size == 1:  # SGLD keeps no buffer
        return np.eye(1)
    return np.diag([1.0, np.sqrt(lr_old / lr_new)])


def schedule_moments(precision, mode, lrs, *, start_offset=None, stationary=False, **hyper):
    """Exact moments of the chain after each step of a learning-rate schedule.

    Step k runs at ``lrs[k]``; before it, when the rate differs from the last step's, the
    buffer is rescaled (:func:`rescale_mode`), as the samplers do at T > 0. A step of lr
    0 is skipped (no time passes), as the samplers skip it at T > 0.

    Args:
        precision: P, the Hessian of N * L.
        mode: ``sgld_mode`` or ``sghmc_mode`` (or a frozen-thermostat variant).
        lrs: the learning rate of each step.
        start_offset: theta_0 - m, with the buffer at 0 (the samplers' start).
        stationary: start instead from the stationary law at ``lrs[0]``.
        **hyper: the mode's other hyperparameters; ``rescale=False`` gives the chain
            without the rescaling (the samplers before it).

    Returns:
        ``(means, position_covariances, buffer_covariances)``, one entry per step: the
        mean of theta - m, the covariance of theta and that of the buffer b (zeros for
        SGLD), each in the original coordinates.
    """
    rescale = hyper.pop("rescale", True)
    eigenvalues, vectors = np.linalg.eigh(precision)
    dim = len(eigenvalues)
    start = np.zeros(dim) if start_offset is None else vectors.T @ start_offset
    steps = len(lrs)
    mean_x = np.zeros((steps, dim))
    var_x, var_b = np.zeros((steps, dim)), np.zeros((steps, dim))
    for j, lam in enumerate(eigenvalues):
        transition, noise = mode(lam, lr=lrs[0], **hyper)
        size = transition.shape[0]
        mean = np.zeros(size)
        if stationary:
            cov = stationary_covariance(transition, noise)
        else:
            mean[0], cov = start[j], np.zeros((size, size))
        previous = None
        for k, lr in enumerate(lrs):
            if lr != 0:
                if rescale and previous is not None and lr != previous:
                    scale = rescale_mode(size, previous, lr)
                    mean, cov = scale @ mean, scale @ cov @ scale.T
                transition, noise = mode(lam, lr=lr, **hyper)
                mean = transition @ mean
                cov = transition @ cov @ transition.T + np.outer(noise, noise)
                previous = lr
            mean_x[k, j], var_x[k, j] = mean[0], cov[0, 0]
            var_b[k, j] = cov[-1, -1] if size > 1 else 0.0
    means = mean_x @ vectors.T
    position = np.einsum("ij,kj,lj->kil", vectors, var_x, vectors)
    buffer = np.einsum("ij,kj,lj->kil", vectors, var_b, vectors)
    return means, position, buffer
