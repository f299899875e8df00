"""BAOA: its exact law on Gaussians (positions without step-size bias), its temperature-0
limit (SGD with lr (1 + mu) / 2), learning-rate changes, and what is BAOA's own.

The generic properties (resume, seeds, groups, transforms, shared errors) run over BAOA
through ``samplers_under_test.SAMPLERS``.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from linear_chains import (
    correlated_gaussian,
    covariance_standard_errors,
    position_moments,
    schedule_moments,
    stationary_covariance,
)

from samplers_as_optim import BAOA, transforms
from samplers_as_optim.sgmcmc.baoa import baoa_direction, baoa_noise_scale


def baoa_mode(lam, *, lr, num_data, temperature, momentum):
    """One eigen-mode of BAOA on N L = lam x^2 / 2, state (x, b), z' = M z + B xi.

    v = b + g, b' = mu v + s xi, x' = x - lr (v + b') / 2 with g = lam x / N.
    """
    g = lam / num_data
    s = baoa_noise_scale(lr, momentum, temperature, num_data)
    half = lr * (1 + momentum) / 2
    transition = np.array([[1.0 - half * g, -half], [momentum * g, momentum]])
    return transition, np.array([-lr * s / 2, s])


# ---------------------------------------------------------------- the exact law
@settings(max_examples=30, deadline=None)
@given(
    h=st.floats(1e-3, 3.9),
    momentum=st.floats(0.0, 0.99),
    temperature=st.floats(0.1, 5.0),
)
def test_the_exact_stationary_position_variance_is_the_targets_at_any_stable_step(
    h, momentum, temperature
):
    """T / lam (U = N L = lam x^2 / 2) for every lr with h = lr lam / N < 4: BAOAB's
    exactness on Gaussians; the step-size bias sits in the momentum, colder than T."""
    lam, num_data = 2.0, 50
    lr = h * num_data / lam
    transition, noise = baoa_mode(
        lam, lr=lr, num_data=num_data, temperature=temperature, momentum=momentum
    )
    assert max(abs(np.linalg.eigvals(transition))) < 1
    covariance = stationary_covariance(transition, noise)
    assert covariance[0, 0] == pytest.approx(temperature / lam, rel=1e-9)
    kinetic = lr * num_data * covariance[1, 1]  # r = -sqrt(N lr) b
    assert kinetic <= temperature * (1 + 1e-9)  # the momentum carries the bias (= T at mu 0)


def test_unstable_beyond_h_four():
    transition, _ = baoa_mode(1.0, lr=4.01, num_data=1, temperature=1.0, momentum=0.5)
    assert max(abs(np.linalg.eigvals(transition))) > 1


Z = 4.5
D, N, K = 10, 100, 20_000
START_OFFSET = np.full(D, 2.0)
MEAN, SIGMA = correlated_gaussian(D)
PRECISION = np.linalg.inv(SIGMA)


def run_chains(hyper, temperature, steps, seed, device, *, lrs=None):
    """K chains of BAOA on N(MEAN, T SIGMA) as the rows of one [K, D] parameter."""
    theta = torch.tensor(MEAN + START_OFFSET, dtype=torch.float32, device=device)
    theta = torch.nn.Parameter(theta.repeat(K, 1))
    precision = torch.tensor(PRECISION, dtype=torch.float32, device=device)
    mean = torch.tensor(MEAN, dtype=torch.float32, device=device)
    opt = BAOA([theta], num_data=N, temperature=temperature, seed=seed, **hyper)
    for step in range(steps):
        if lrs is not None:
            opt.param_groups[0]["lr"] = lrs[step]
        theta.grad = (theta.detach() - mean) @ precision / N
        opt.step()
    return theta.detach().double().cpu().numpy()


def assert_moments(samples, mean_offset, covariance):
    mean_se = np.sqrt(np.diag(covariance) / K)
    np.testing.assert_array_less(np.abs(samples.mean(0) - MEAN - mean_offset), Z * mean_se)
    se = covariance_standard_errors(covariance, K)
    np.testing.assert_array_less(np.abs(np.cov(samples.T) - covariance), Z * se)


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [2.0])
def test_samples_follow_the_exact_law_and_the_target_at_a_large_step(temperature, device):
    """lr = 3: the stiffest mode has h = lr lam_max / N ~ 0.1; SGLD/SGHMC at this step are
    biased by several percent, BAOA's exact stationary law is the target itself."""
    hyper = {"lr": 3.0, "momentum": 0.8}
    steps = 300
    mean_offset, covariance, slowest = position_moments(
        PRECISION,
        baoa_mode,
        start_offset=START_OFFSET,
        steps=steps,
        num_data=N,
        temperature=temperature,
        **hyper,
    )
    assert steps >= 5 * slowest
    _, stationary, _ = position_moments(
        PRECISION, baoa_mode, start_offset=START_OFFSET, num_data=N, temperature=temperature,
        **hyper,
    )  # fmt: skip
    np.testing.assert_allclose(stationary, temperature * SIGMA, atol=1e-9)
    samples = run_chains(hyper, temperature, steps, seed=int(temperature * 4), device=device)
    assert_moments(samples, mean_offset, covariance)


@pytest.mark.slow
def test_through_lr_jumps_the_chain_follows_the_exact_law(device):
    """lr 3 -> 0.3 -> 3 at T > 0: the buffer is re-expressed (b * sqrt(lr_old / lr_new)),
    and the chain follows the exact law of that linear map through the jumps."""
    lrs = [3.0] * 200 + [0.3] * 30 + [3.0] * 30
    hyper = {"momentum": 0.8}
    samples = run_chains({"lr": 3.0, **hyper}, 1.0, len(lrs), seed=7, device=device, lrs=lrs)
    means, covariances, _ = schedule_moments(
        PRECISION, baoa_mode, lrs, start_offset=START_OFFSET, num_data=N, temperature=1.0,
        **hyper,
    )  # fmt: skip
    assert_moments(samples, means[-1], covariances[-1])
    _, unrescaled, _ = schedule_moments(
        PRECISION, baoa_mode, lrs, start_offset=START_OFFSET, num_data=N, temperature=1.0,
        rescale=False, **hyper,
    )  # fmt: skip
    # without the re-expression the jumps would have heated the chain (by 8%, exact laws)
    assert np.trace(unrescaled[-1]) > 1.05 * np.trace(covariances[-1])


# ---------------------------------------------------------------- temperature 0
@settings(max_examples=30, deadline=None)
@given(
    lr=st.floats(1e-3, 0.5),
    momentum=st.floats(0.0, 0.99),
    weight_decay=st.one_of(st.just(0.0), st.floats(0.0, 0.1)),
    maximize=st.booleans(),
    foreach=st.booleans(),
    steps=st.integers(1, 8),
    seed=st.integers(0, 2**16),
)
def test_temperature_zero_is_sgd_with_lr_times_one_plus_momentum_over_two(
    lr, momentum, weight_decay, maximize, foreach, steps, seed
):
    """BAOA at T = 0 is SGD(lr (1 + mu) / 2, mu): the same iterates up to rounding."""
    generator = torch.Generator().manual_seed(seed)
    init = [torch.randn(3, 2, generator=generator, dtype=torch.float64), torch.randn(4).double()]
    ours = [torch.nn.Parameter(p.clone()) for p in init]
    theirs = [torch.nn.Parameter(p.clone()) for p in init]
    hyper = {"momentum": momentum, "weight_decay": weight_decay, "maximize": maximize}
    baoa = BAOA(ours, lr=lr, num_data=10, temperature=0.0, foreach=foreach, **hyper)
    sgd = torch.optim.SGD(theirs, lr=lr * (1 + momentum) / 2, foreach=foreach, **hyper)
    for _ in range(steps):
        for a, b in zip(ours, theirs, strict=True):
            g = torch.randn(a.shape, generator=generator, dtype=a.dtype)
            a.grad, b.grad = g.clone(), g.clone()
        baoa.step()
        sgd.step()
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_the_transform_at_temperature_zero_is_the_same_limit():
    tx = transforms.baoa(0.1, momentum=0.5, num_data=100, temperature=0.0)
    params = [torch.zeros(2, dtype=torch.float64)]
    state = tx.init(params)
    sgd_param = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    sgd = torch.optim.SGD([sgd_param], lr=0.1 * 1.5 / 2, momentum=0.5)
    for step in range(4):
        g = torch.full((2,), float(step + 1), dtype=torch.float64)
        updates, state = tx.update([g.clone()], state, params=params)
        params = [p + u for p, u in zip(params, updates, strict=True)]
        sgd_param.grad = g.clone()
        sgd.step()
    torch.testing.assert_close(params[0], sgd_param.detach(), rtol=1e-14, atol=1e-14)


# ---------------------------------------------------------------- the kernel
@settings(max_examples=30, deadline=None)
@given(lr=st.floats(1e-3, 1.0), momentum=st.floats(0.0, 0.99), foreach=st.booleans())
def test_kernel_update_of_noise_minus_update_of_zero_is_the_stated_scale(lr, momentum, foreach):
    generator = torch.Generator().manual_seed(0)
    params = [torch.randn(3, generator=generator, dtype=torch.float64)]
    grads = [torch.randn(3, generator=generator, dtype=torch.float64)]
    buffers = [torch.randn(3, generator=generator, dtype=torch.float64)]
    noise = [torch.randn(3, generator=generator, dtype=torch.float64)]
    hyper = {"lr": lr, "momentum": momentum, "temperature": 2.0, "num_data": 5}
    hyper |= {"weight_decay": 0.0, "maximize": False, "foreach": foreach, "inplace": False}
    d1, b1 = baoa_direction(params, grads, buffers, noise, **hyper)
    d0, b0 = baoa_direction(params, grads, buffers, [torch.zeros(3).double()], **hyper)
    s = math.sqrt((1 - momentum**2) * 2.0 / (5 * lr))
    torch.testing.assert_close(b1[0] - b0[0], s * noise[0])
    torch.testing.assert_close(d1[0] - d0[0], s * noise[0] / 2)
    velocity = buffers[0] + grads[0]
    torch.testing.assert_close(b0[0], momentum * velocity)
    torch.testing.assert_close(d0[0], (velocity + momentum * velocity) / 2)


def test_kernel_refuses_noise_that_does_not_match_the_temperature():
    with pytest.raises(ValueError, match=r"^noise must be given exactly when temperature > 0$"):
        baoa_direction(
            [torch.zeros(2)], [torch.zeros(2)], [torch.zeros(2)], None, lr=0.1, momentum=0.5,
            temperature=1.0, num_data=1, weight_decay=0.0, maximize=False, foreach=False,
        )  # fmt: skip


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"dampening": 0.5, "temperature": 0.0},
            "dampening=0.5 is not supported by BAOA (accepted for torch.optim.SGD's signature; "
            "at temperature 0 BAOA is SGD with lr * (1 + momentum) / 2: use torch.optim.SGD "
            "for this setting)",
        ),
        (
            {"nesterov": True, "temperature": 0.0},
            "nesterov=True is not supported by BAOA (accepted for torch.optim.SGD's signature; "
            "at temperature 0 BAOA is SGD with lr * (1 + momentum) / 2: use torch.optim.SGD "
            "for this setting)",
        ),
        (
            {"nesterov": True},
            "nesterov=True requires temperature=0 (it has no sampling meaning)",
        ),
        ({"nesterov": 1}, "Invalid nesterov: 1 (expected True or False)"),
        ({"momentum": 1.0}, "Invalid momentum: 1.0 (expected a number in [0, 1))"),
    ],
)
def test_baoa_errors(kwargs, message):
    error = TypeError if message.startswith("Invalid nesterov") else ValueError
    for build in (
        lambda: BAOA([torch.nn.Parameter(torch.zeros(2))], lr=0.1, num_data=10, **kwargs),
        lambda: transforms.baoa(0.1, num_data=10, **kwargs),
    ):
        with pytest.raises(error, match="^" + re.escape(message) + "$"):
            build()


def test_baoa_transform_docstring_runs_and_documents_every_argument():
    import test_transforms

    test_transforms.test_docstring_examples_run(transforms.baoa)
    test_transforms.test_every_argument_is_documented(transforms.baoa)
