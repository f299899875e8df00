"""Variational inference: convergence to the exact answers on Bayesian linear regression,
the defaults on a 31-parameter logistic regression against a long HMC run, the
scale/correlation factor, stick-the-landing, the objective's closed form, the guard
against a degenerate scale, sampling and errors.

BLR (float64): y = [x, 1] theta + noise s, prior N(0, prior_std^2 I), exact posterior
precision Lambda = I / prior_std^2 + Phi^T Phi / s^2. The tempered target has covariance
T Lambda^-1; the best mean-field Gaussian has the exact mean and variances T / diag(Lambda).
"""

import inspect
import json
import math
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from samplers_as_optim.gaussian import _memory
from samplers_as_optim.gaussian.vi import FullCovarianceVI, MeanFieldVI
from samplers_as_optim.samples.stacked import call_stacked

DT = torch.float64
REFERENCE = Path(__file__).parent / "data" / "breast_cancer_reference.json"
NOISE = 0.5
PRIOR_STD = 1.0
BOTH = [MeanFieldVI, FullCovarianceVI]


pytestmark = pytest.mark.usefixtures("float64_default")


def blr(n=40):
    """Correlated inputs so that the mean-field and exact marginal variances differ ~2.6x."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, 2, generator=gen)
    x[:, 1] = 0.8 * x[:, 0] + 0.6 * x[:, 1]
    y = x @ torch.tensor([1.0, -1.0]) + 0.3 + NOISE * torch.randn(n, generator=gen)
    phi = torch.cat([x, torch.ones(n, 1)], dim=1)
    precision = torch.eye(3) / PRIOR_STD**2 + phi.T @ phi / NOISE**2
    mean = torch.linalg.solve(precision, phi.T @ y / NOISE**2)
    return x, y, precision, mean


def nll(output, y):
    """Mean Gaussian NLL over examples (and over draws, for a stacked output)."""
    return 0.5 * ((output.squeeze(-1) - y) ** 2).mean() / NOISE**2


def flat_mean(vi):
    return torch.cat([vi.mean["weight"].reshape(-1), vi.mean["bias"]])


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_full_covariance_vi_reaches_the_exact_posterior(temperature):
    """Adam + stick-the-landing: at q = target the gradient vanishes for every draw, so the
    only error left is Adam's optimisation error. With 16 draws per step (measured: 3e-15
    relative at T = 1, 3e-8 at T = 0.5, after 1800 steps with the lr halved every 300;
    with one draw the scale/correlation parametrisation needs about 6000 steps at lr 1e-2:
    its STL gradient is noisier away from the target, though exactly zero at it)."""
    x, y, precision, mean = blr()
    torch.manual_seed(1)
    vi = FullCovarianceVI(
        nn.Linear(2, 1),
        num_data=40,
        prior_std=PRIOR_STD,
        temperature=temperature,
        init_std=0.1,
        stl=True,
    )
    optimizer = torch.optim.Adam(vi.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=300, gamma=0.5)
    for _ in range(1800):
        optimizer.zero_grad()
        loss = nll(vi(x, num_samples=16), y) + vi.kl_loss()
        loss.backward()
        optimizer.step()
        scheduler.step()
    covariance = temperature * torch.linalg.inv(precision)
    assert float((flat_mean(vi) - mean).abs().max()) < 1e-6
    assert float((vi.covariance - covariance).abs().max()) < 1e-4 * float(covariance.abs().max())


def test_mean_field_vi_reaches_exact_mean_and_mean_field_variances():
    """Mean-field optimum: exact mean, variances 1 / diag(Lambda) (not diag(Lambda^-1)).

    The estimator's noise does not vanish here (q cannot equal the correlated target), so
    the answer is the average of the iterates over the last 500 Adam steps (256 draws each,
    lr 5e-4; the default closed-form KL). Over seeds 2-6 that average was within 0.0067
    mean-field sd of the mean and 1.03% of the variances (with 32 draws: 0.027 and 3.3%);
    the tolerances (0.06 sd, 3%) are 9x and 3x those, and 1/diag(Lambda) and
    diag(Lambda^-1) differ by 2.6x here.
    """
    x, y, precision, mean = blr()
    target_var = 1.0 / torch.diagonal(precision)
    assert float((torch.diagonal(torch.linalg.inv(precision)) / target_var).max()) > 2.5
    torch.manual_seed(2)
    vi = MeanFieldVI(nn.Linear(2, 1), num_data=40, prior_std=PRIOR_STD, init_std=0.1)
    optimizer = torch.optim.Adam(vi.parameters(), lr=0.05)
    mean_sum, var_sum = torch.zeros(3), torch.zeros(3)
    for step in range(1500):
        if step in (500, 1000):
            for group in optimizer.param_groups:
                group["lr"] *= 0.1
        optimizer.zero_grad()
        loss = nll(vi(x, num_samples=256), y) + vi.kl_loss()
        loss.backward()
        optimizer.step()
        if step >= 1000:
            mean_sum += flat_mean(vi)
            var_sum += torch.cat([vi.std["weight"].reshape(-1), vi.std["bias"]]).square()
    assert float(((mean_sum / 500 - mean) / target_var.sqrt()).abs().max()) < 0.06
    assert float(((var_sum / 500 - target_var) / target_var).abs().max()) < 0.03


@pytest.mark.parametrize("cls", BOTH)
def test_stick_the_landing_gradient_vanishes_at_the_target(cls):
    """With no data term and q = prior, STL's gradient is exactly zero for every draw; the
    naive estimator (log q differentiated through its parameters) is not."""
    torch.manual_seed(3)
    vi = cls(nn.Linear(3, 2), num_data=10, prior_std=0.7, init_std=0.7, stl=True)
    with torch.no_grad():
        for param in [vi.loc] if cls is FullCovarianceVI else list(vi.loc):
            param.zero_()
    vi(torch.randn(4, 3), num_samples=3)
    grads = torch.autograd.grad(vi.kl_loss(), _own(vi), retain_graph=True)
    assert all(float(g.abs().max()) < 1e-14 for g in grads)
    # the same draws without stopping the gradient of log q's parameters
    flat = vi._last
    naive = _naive_log_q(vi, flat) + 0.5 * flat.square().sum(-1) / 0.7**2
    naive_grads = torch.autograd.grad(naive.mean(), _own(vi))
    assert max(float(g.abs().max()) for g in naive_grads) > 1e-3


def _own(vi):
    return [p for name, p in vi.named_parameters() if not name.startswith("model.")]


def _naive_log_q(vi, flat):
    if isinstance(vi, MeanFieldVI):
        loc = torch.cat([p.reshape(-1) for p in vi.loc])
        std = torch.cat([p.reshape(-1) for p in vi.log_std]).exp()
        return torch.distributions.Normal(loc, std).log_prob(flat).sum(-1)
    return torch.distributions.MultivariateNormal(vi.loc, scale_tril=vi.scale_tril()).log_prob(flat)


@pytest.mark.parametrize("stl", [True, False])
def test_prior_none_leaves_the_prior_to_the_loss(stl):
    """prior_std=None + the prior written into the loss is the same objective."""
    torch.manual_seed(6)
    model = nn.Linear(3, 2)
    kwargs = {"num_data": 7, "temperature": 0.4, "init_std": 0.3, "stl": stl}
    with_prior = FullCovarianceVI(model, prior_std=0.8, **kwargs)
    without = FullCovarianceVI(model, prior_std=None, **kwargs)
    without.load_state_dict(with_prior.state_dict())
    x = torch.randn(1, 3)
    with_prior(x, num_samples=50, generator=torch.Generator().manual_seed(1))
    without(x, num_samples=50, generator=torch.Generator().manual_seed(1))
    prior = torch.distributions.Normal(0.0, 0.8)
    if stl:
        flat = without._last.detach()
        neg_log_prior = -prior.log_prob(flat).sum(-1).mean()
    else:
        loc, tril = without.loc.detach(), without.scale_tril().detach()
        second_moment = loc.square().sum() + tril.square().sum()
        neg_log_prior = 0.5 * second_moment / 0.64 + 4 * math.log(2 * math.pi * 0.64)
    torch.testing.assert_close(
        with_prior.kl_loss().detach(),
        without.kl_loss().detach() + neg_log_prior / 7,
        rtol=1e-12,
        atol=0,
    )
    if not stl:  # the entropy term alone
        torch.testing.assert_close(
            without.kl_loss().detach(), -0.4 * without.entropy().detach() / 7
        )


@pytest.mark.parametrize("cls", BOTH)
@pytest.mark.parametrize("temperature", [1.0, 0.3])
def test_closed_form_and_stl_estimate_agree(cls, temperature):
    """stl=False equals (E_q[-log p] - T H(q)) / N from torch.distributions (KL/N at T = 1);
    the STL estimate's average over 20000 draws is within 5 Monte Carlo standard errors."""
    torch.manual_seed(4)
    model = nn.Linear(3, 2)
    kwargs = {"num_data": 7, "prior_std": 0.8, "temperature": temperature, "init_std": 0.3}
    exact = cls(model, stl=False, **kwargs)
    with torch.no_grad():
        for param in _own(exact):
            param.add_(0.2 * torch.randn_like(param))
    stl = cls(model, stl=True, **kwargs)
    stl.load_state_dict(exact.state_dict())
    flat_loc = torch.cat([p.reshape(-1) for p in exact.loc]) if cls is MeanFieldVI else exact.loc
    if cls is MeanFieldVI:
        scale_tril = torch.diag(torch.cat([p.reshape(-1) for p in exact.log_std]).exp())
    else:
        scale_tril = exact.scale_tril()
    q = torch.distributions.MultivariateNormal(flat_loc.detach(), scale_tril=scale_tril.detach())
    prior = torch.distributions.MultivariateNormal(torch.zeros(8), 0.64 * torch.eye(8))
    kl = torch.distributions.kl_divergence(q, prior)
    cross_entropy = kl + q.entropy()
    expected = (cross_entropy - temperature * q.entropy()) / 7
    torch.testing.assert_close(exact.kl_loss().detach(), expected, rtol=1e-12, atol=0)
    if temperature == 1.0:
        torch.testing.assert_close(exact.kl_loss().detach() * 7, kl, rtol=1e-12, atol=0)
    stl(torch.randn(1, 3), num_samples=20000, generator=torch.Generator().manual_seed(5))
    flat = stl._last.detach()
    values = (
        0.5 * flat.square().sum(-1) / 0.64
        + 4 * math.log(2 * math.pi * 0.64)
        + temperature * q.log_prob(flat)
    ) / 7
    torch.testing.assert_close(stl.kl_loss().detach(), values.mean(), rtol=1e-10, atol=0)
    stderr = values.std() / math.sqrt(values.numel())
    assert abs(float(values.mean() - expected)) < 5 * float(stderr)


@pytest.mark.parametrize("cls", BOTH)
def test_forward_sample_predict_layout(cls):
    torch.manual_seed(6)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    model[0].bias.requires_grad_(False)
    vi = cls(model, num_data=10, prior_std=1.0, init_std=0.05)
    x = torch.randn(5, 3)
    assert vi(x).shape == (5, 2)
    assert vi(x, num_samples=4).shape == (4, 5, 2)
    draws = vi.sample(6, generator=torch.Generator().manual_seed(7))
    assert set(draws) == {"0.weight", "2.weight", "2.bias"}
    assert draws["0.weight"].shape == (6, 4, 3) and not draws["0.weight"].requires_grad
    again = vi.sample(6, generator=torch.Generator().manual_seed(7))
    assert all(torch.equal(draws[n], again[n]) for n in draws)
    out = vi.predict(x, num_samples=6, generator=torch.Generator().manual_seed(7), chunk_size=4)
    torch.testing.assert_close(out, call_stacked(model, draws, x))
    # draws are the stated transform of the generator's standard normals
    xi = torch.randn(6, 12 + 10, generator=torch.Generator().manual_seed(7))
    theta = torch.cat([draws[n].reshape(6, -1) for n in ("0.weight", "2.weight", "2.bias")], 1)
    loc = torch.cat([vi.mean[n].reshape(-1) for n in ("0.weight", "2.weight", "2.bias")])
    if cls is MeanFieldVI:
        std = torch.cat([vi.std[n].reshape(-1) for n in ("0.weight", "2.weight", "2.bias")])
        torch.testing.assert_close(theta, loc + std * xi)
    else:
        torch.testing.assert_close(theta, loc + xi @ vi.scale_tril().detach().T)
    # the frozen bias is the model's own in every draw; the model's own treated weights get no grads
    vi(x).sum().backward()
    assert model[0].weight.grad is None
    assert all(p.grad is not None for p in _own(vi))


def test_trains_with_any_optimizer_and_device(device):
    """SGD works as well as Adam: the loss goes down; all tensors follow the module's device."""
    x, y, _, _ = blr()
    x, y = x.to(device), y.to(device)
    torch.manual_seed(8)
    vi = MeanFieldVI(nn.Linear(2, 1), num_data=40, prior_std=1.0, init_std=0.01).to(device)
    optimizer = torch.optim.SGD(vi.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for _ in range(100):
        optimizer.zero_grad()
        loss = nll(vi(x), y) + vi.kl_loss()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert sum(losses[-10:]) < 0.5 * sum(losses[:10])


# ------------------------------------------------ breast cancer: the defaults, out of the box
def breast_cancer():
    """scikit-learn's breast cancer as in benchmarks/bench_vi.py: standardised in float64
    (unbiased sd), then float32 like a user's data; and the stored reference."""
    from sklearn.datasets import load_breast_cancer

    data = load_breast_cancer()
    x = torch.tensor(data.data, dtype=torch.float64)
    x = ((x - x.mean(0)) / x.std(0)).float()
    y = torch.tensor(data.target, dtype=torch.float32)
    stored = json.loads(REFERENCE.read_text())["values"]
    reference = {key: torch.tensor(value, dtype=DT) for key, value in stored.items()}
    return x, y, reference


def fit_breast_cancer(cls, steps=4000, lr=1e-2):
    """The wrapper's defaults, Adam at lr cosine-annealed to 0, full batch, one draw/step."""
    x, y, reference = breast_cancer()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 30-feature matmuls: threads only contend on a shared machine
    try:
        torch.manual_seed(0)
        vi = cls(nn.Linear(30, 1, dtype=torch.float32), num_data=len(x), prior_std=1.0)
        optimizer = torch.optim.Adam(vi.parameters(), lr=lr)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
        for _ in range(steps):
            optimizer.zero_grad()
            logits = vi(x).squeeze(-1)
            loss = nn.functional.binary_cross_entropy_with_logits(logits, y) + vi.kl_loss()
            loss.backward()
            optimizer.step()
            schedule.step()
    finally:
        torch.set_num_threads(threads)
    mean = torch.cat([vi.mean["weight"].reshape(-1), vi.mean["bias"]]).to(DT)
    if isinstance(vi, FullCovarianceVI):
        std = vi.covariance.diagonal().sqrt().to(DT)
    else:
        std = torch.cat([vi.std["weight"].reshape(-1), vi.std["bias"]]).to(DT)
    return mean, std, reference


@pytest.mark.slow
def test_full_covariance_defaults_match_a_long_hmc_run_on_breast_cancer():
    """Issue 10, item 5: ``FullCovarianceVI(model, num_data=569, prior_std=1.0)`` and Adam
    at 1e-2 (cosine to 0 over 4000 full-batch steps) reach every posterior sd within
    [0.8, 1.25] and every mean within 0.25 sd of a long HMC run (31 coefficients). Before
    the fix the factor was singular after the first step: loss -inf then NaN in float32
    (objective -5e67, sd ratios 0.0013 to 3.3, means 3.0 sd off in float64).

    Error budget, in the units of the criterion. Reference: Monte Carlo error <= 0.25% of
    each sd, <= 0.0018 sd on the means (a Pyro NUTS run, 4 x 2000, agrees to 0.035 sd and
    0.98-1.02: its own error). Family: the exact best Gaussian (stored, by quadrature)
    has sd ratios 0.959-1.001 and means within 0.025 sd. Optimiser, 12 seeds of this
    configuration: sd / best Gaussian 0.900-1.030, means within 0.114 sd of it
    (per-coordinate seed-to-seed sd <= 0.023 in log sd, <= 0.028 sd on the means); the
    smallest sd ratio to the posterior is 0.902 on average over seeds with seed-to-seed sd
    0.007 (the slowest coordinate is still growing: a bias, not noise). So that ratio,
    0.89-0.92, is > 10 seed sds above 0.8, and the largest mean error (0.02-0.11) is > 5
    per-coordinate seed sds below 0.25: the criterion is the issue's, not tuned; the fixed
    seed makes the run reproducible.
    """
    mean, std, reference = fit_breast_cancer(FullCovarianceVI)
    ratio = std / reference["sd"]
    error = (mean - reference["mean"]) / reference["sd"]
    assert float(ratio.min()) >= 0.8 and float(ratio.max()) <= 1.25, ratio
    assert float(error.abs().max()) <= 0.25, error


@pytest.mark.slow
def test_mean_field_defaults_reach_the_mean_field_optimum_on_breast_cancer():
    """MeanFieldVI's optimum under-states correlated posteriors' sds (here 0.43-0.71 of
    HMC's, means 0.21 sd off: the exact mean-field optimum, stored); the defaults reach
    that optimum: sds within [0.8, 1.25] of it and means within 0.25 posterior sd. 12 seeds
    of this configuration: 0.906-1.100 and 0.128 (seed-to-seed sd <= 0.042 in log sd, <=
    0.031 sd on the means). Before: stick-the-landing from init_std 1e-3 left an sd at
    0.757 of the optimum's."""
    mean, std, reference = fit_breast_cancer(MeanFieldVI)
    ratio = std / reference["mean_field_vi_sd"]
    error = (mean - reference["mean_field_vi_mean"]) / reference["sd"]
    assert float(ratio.min()) >= 0.8 and float(ratio.max()) <= 1.25, ratio
    assert float(error.abs().max()) <= 0.25, error
    assert float((std / reference["sd"]).max()) < 0.8  # the known mean-field shrinkage


@pytest.mark.parametrize("lr", [1e-2, 1e-1])
def test_one_adam_step_from_the_defaults_keeps_the_factor_well_conditioned(lr):
    """The root cause of issue 10, item 5. Adam's first step moves every variational
    parameter by lr (times sign of its gradient). With L = tril(M) + diag(e^s) that made
    |M_ij| = lr ten times L_ii = init_std = 1e-3, and forward substitution amplifies by
    ~(1 + lr / init_std)^P: cond(L) ~ 1e30, log q at the draws -inf. With L = diag(sigma)
    R, R the rows of I + tril(V) normalised, the step changes log sigma by lr and V by lr:
    cond(L) <= e^(2 lr) sqrt(1 + 30 lr^2) cond(I + lr S), |S_ij| <= 1, and
    cond(I + lr S) <= (1 + lr |S|) / (1 - lr |S|) with |S| <= sqrt(465): at most 1.6 for
    lr = 1e-2 (measured 1.2); for lr = 1e-1 this bound is void (measured 6.4).
    """
    x, y, _ = breast_cancer()
    torch.manual_seed(0)
    vi = FullCovarianceVI(nn.Linear(30, 1, dtype=torch.float32), num_data=569, prior_std=1.0)
    assert vi.init_std == 1e-3 and not vi.stl
    optimizer = torch.optim.Adam(vi.parameters(), lr=lr)
    loss = nn.functional.binary_cross_entropy_with_logits(vi(x).squeeze(-1), y) + vi.kl_loss()
    loss.backward()
    optimizer.step()
    condition = float(torch.linalg.cond(vi.scale_tril().detach().to(DT)))
    assert condition < (1.6 if lr == 1e-2 else 10.0), condition
    # the stick-the-landing estimate at fresh draws is finite and the guard is quiet
    vi.stl = True
    vi(x, num_samples=64)
    assert math.isfinite(float(vi.kl_loss().detach()))


def test_scale_factor_parametrisation():
    """L = diag(sigma) R: the rows of R have unit norm, so sigma = exp(log_std) are the
    marginal sds (``vi.std``); any lower-triangular L with a positive diagonal is reached,
    by sigma_i = |L_i.| and V_ij = L_ij / L_ii; log det L and tr(Sigma) are the closed
    forms the objective uses."""
    torch.manual_seed(9)
    vi = FullCovarianceVI(nn.Linear(4, 1), num_data=10, prior_std=1.0)
    target = torch.randn(5, 5).tril(-1) + torch.diag(torch.rand(5) + 0.1)
    rows, cols = torch.tril_indices(5, 5, -1)
    with torch.no_grad():
        vi.log_std.copy_(target.norm(dim=1).log())
        vi.corr_offdiag.copy_((target / target.diagonal()[:, None])[rows, cols])
    torch.testing.assert_close(vi.scale_tril().detach(), target, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(vi.covariance, target @ target.T)
    std = torch.cat([vi.std["weight"].reshape(-1), vi.std["bias"]])
    torch.testing.assert_close(std, vi.covariance.diagonal().sqrt())
    torch.testing.assert_close(
        vi._log_det_scale().detach(), target.diagonal().log().sum(), rtol=1e-12, atol=0
    )
    torch.testing.assert_close(vi._trace_covariance().detach(), target.square().sum())


# ---------------------------------------------------------------------------- errors
CONSTRUCTION_ERRORS = [
    ({"num_data": 0}, ValueError, "Invalid num_data: 0 (expected a positive integer"),
    ({"prior_std": 0.0}, ValueError, "Invalid prior_std: 0.0 (expected a finite number > 0)"),
    ({"prior_std": math.nan}, ValueError, "Invalid prior_std: nan (expected a finite number > 0)"),
    ({"prior_std": "1"}, TypeError, "Invalid prior_std: '1' (expected a finite number > 0)"),
    (
        {"temperature": -0.5},
        ValueError,
        "Invalid temperature: -0.5 (expected a finite number >= 0)",
    ),
    ({"init_std": -1.0}, ValueError, "Invalid init_std: -1.0 (expected a finite number > 0)"),
    ({"stl": 1}, TypeError, "Invalid stl: 1 (expected True or False)"),
]


@pytest.mark.parametrize("cls", BOTH)
@pytest.mark.parametrize(("kwargs", "error", "message"), CONSTRUCTION_ERRORS)
def test_construction_errors(cls, kwargs, error, message):
    arguments = {"num_data": 10, "prior_std": 1.0, **kwargs}
    with pytest.raises(error, match=re.escape(message)):
        cls(nn.Linear(2, 1), **arguments)


@pytest.mark.parametrize("cls", BOTH)
def test_use_errors(cls):
    with pytest.raises(
        ValueError,
        match=re.escape(
            "Invalid model: Linear (expected at least one parameter with requires_grad=True"
        ),
    ):
        cls(nn.Linear(2, 1).requires_grad_(False), num_data=1, prior_std=1.0)
    vi = cls(nn.Linear(2, 1), num_data=10, prior_std=1.0, stl=True)
    with pytest.raises(
        RuntimeError,
        match=re.escape(
            "kl_loss() with stl=True needs the draws of a forward pass: call the wrapper on a batch first"
        ),
    ):
        vi.kl_loss()
    with pytest.raises(
        ValueError, match=re.escape("Invalid num_samples: 0 (expected an integer >= 1)")
    ):
        vi(torch.randn(3, 2), num_samples=0)
    with pytest.raises(TypeError, match=re.escape("Invalid n: 1.5 (expected an integer >= 1)")):
        vi.sample(1.5)
    with pytest.raises(
        ValueError, match=re.escape("Invalid num_samples: -1 (expected an integer >= 1)")
    ):
        vi.predict(torch.randn(3, 2), num_samples=-1)


def test_full_covariance_too_large_is_refused(monkeypatch):
    monkeypatch.setattr(_memory, "available_bytes", lambda device: 100)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "Invalid model: Linear for FullCovarianceVI (a 3 x 3 torch.float64 matrix over the 3 treated parameters needs about 2.01e-07 GiB with its factorisation, but cpu has 9.31e-08 GiB free; use MeanFieldVI, or set requires_grad=False"
        ),
    ):
        FullCovarianceVI(nn.Linear(2, 1), num_data=10, prior_std=1.0)


GUARD = "the variational scale has degenerated: "


@pytest.mark.parametrize("cls", BOTH)
def test_an_underflowed_scale_is_an_error_not_a_silent_collapse(cls):
    """sigma = exp(-800) = 0 in float64: every draw is the mean. The STL estimate's
    standardised draws are then 0 * inf = NaN (not the noise), and the closed form's L has
    a zero diagonal; both refuse, naming what degenerated."""
    x = torch.randn(4, 2)
    for stl in (True, False):
        vi = cls(nn.Linear(2, 1), num_data=10, prior_std=1.0, stl=stl)
        with torch.no_grad():
            for log_std in [vi.log_std] if cls is FullCovarianceVI else list(vi.log_std):
                log_std.fill_(-800.0)
        vi(x)
        if stl:
            what = "the draws of the last forward, standardised by L, differ from their noise by up to nan"
        else:
            what = "the closed-form objective is "
        with pytest.raises(
            FloatingPointError, match=re.escape(f"{cls.__name__}: {GUARD}{what}")
        ) as raised:
            vi.kl_loss()
        assert "; the diagonal of its factor L spans [0, 0] (expected finite and > 0" in str(
            raised.value
        )


def test_a_numerically_singular_factor_is_an_error():
    """V_ij = 1e9 everywhere: L_ii ~ 1e-9 sigma_i against off-diagonal ~ sigma_i, cond(L)
    far beyond 1 / eps, so solving L z = theta - mu does not give back the draw's noise."""
    vi = FullCovarianceVI(nn.Linear(8, 1), num_data=10, prior_std=1.0, stl=True)
    with torch.no_grad():
        vi.log_std.zero_()
        vi.corr_offdiag.fill_(1e9)
    vi(torch.randn(3, 8), num_samples=4)
    message = (
        f"FullCovarianceVI: {GUARD}the draws of the last forward, standardised by L, differ "
        "from their noise by up to "
    )
    with pytest.raises(FloatingPointError, match=re.escape(message)) as raised:
        vi.kl_loss()
    assert "(expected at most 0.1); the diagonal of its factor L spans [" in str(raised.value)
    assert str(raised.value).endswith(
        "(expected finite and > 0, and L numerically invertible): lower the learning rate, or "
        "use stl=False (the default): the stick-the-landing gradient's noise grows like "
        "|L^-1| and can drive L to singular"
    )


HALF = [torch.float16, torch.bfloat16]


def _variational(vi):
    """The variational parameters in a fixed order."""
    if isinstance(vi, FullCovarianceVI):
        return [vi.loc, vi.log_std, vi.corr_offdiag]
    return [*vi.loc, *vi.log_std]


def half_and_reference(cls, dtype, stl=False):
    """A half-precision wrapper beyond toy size (MeanFieldVI: the 20010 weights of
    nn.Linear(2000, 10), where the float16 log-determinant at the default init_std is
    -138 000 and overflows), and a float32 one holding the same variational parameters."""
    torch.manual_seed(0)
    model = nn.Linear(2000, 10) if cls is MeanFieldVI else nn.Linear(40, 4)
    size = {"num_data": 60000 if cls is MeanFieldVI else 100, "prior_std": 1.0, "stl": stl}
    low = cls(model.to(dtype), **size)
    if cls is FullCovarianceVI:
        with torch.no_grad():
            low.corr_offdiag.normal_(0.0, 0.3)
            low.log_std.uniform_(-7.0, -2.0)
    reference = cls(nn.Linear(*model.weight.shape[::-1], dtype=torch.float32), **size)
    with torch.no_grad():
        for mine, theirs in zip(_variational(reference), _variational(low), strict=True):
            mine.copy_(theirs.float())
    return low, reference


@pytest.mark.parametrize("dtype", HALF, ids=["float16", "bfloat16"])
@pytest.mark.parametrize("cls", BOTH)
def test_half_precision_kl_is_the_float32_kl(cls, dtype):
    """Before: MeanFieldVI(nn.Linear(2000, 10).half(), num_data=60000, prior_std=1.0)
    .kl_loss() raised "the variational scale has degenerated" (the float16 sums overflow;
    float32 gives 2.137) and bfloat16 lost the digits of terms that cancel. Now every sum is
    taken in float32: the same value as float32 on the same (cast) parameters, returned in
    float32 so a half NLL can be added to it, and gradients reach the half parameters."""
    low, reference = half_and_reference(cls, dtype)
    kl = low.kl_loss()
    expected = reference.kl_loss()
    assert kl.dtype == torch.float32 and bool(torch.isfinite(kl))
    torch.testing.assert_close(kl, expected, rtol=1e-5, atol=0.0)
    torch.testing.assert_close(low.entropy(), reference.entropy(), rtol=1e-5, atol=0.0)
    if cls is MeanFieldVI:
        # the float32 model itself (parameters not rounded to dtype): 2.137
        torch.manual_seed(0)
        plain = MeanFieldVI(nn.Linear(2000, 10, dtype=torch.float32), num_data=60000, prior_std=1.0)
        assert abs(float(plain.kl_loss().detach()) - 2.137) < 5e-4
        torch.testing.assert_close(kl, plain.kl_loss().detach(), rtol=1e-3, atol=0.0)
    kl.backward()
    expected.backward()
    for mine, theirs in zip(_variational(low), _variational(reference), strict=True):
        assert mine.grad is not None and mine.grad.dtype == dtype
        assert bool(torch.isfinite(mine.grad).all())
        torch.testing.assert_close(mine.grad.float(), theirs.grad, rtol=1e-2, atol=1e-7)
    # the user's loss: a NLL in the model's dtype plus the KL
    for param in _variational(low):
        param.grad = None
    x = torch.randn(8, low.model.in_features, dtype=dtype)
    nll = low(x).square().mean()
    assert nll.dtype == dtype
    loss = nll + low.kl_loss()
    assert loss.dtype == torch.float32 and bool(torch.isfinite(loss))
    loss.backward()
    assert all(
        p.grad is not None and p.grad.dtype == dtype and bool(torch.isfinite(p.grad).all())
        for p in _variational(low)
    )


@pytest.mark.parametrize("dtype", HALF, ids=["float16", "bfloat16"])
def test_half_precision_stick_the_landing_estimate_is_finite(dtype):
    """stl=True at the draws of a forward: before, inf in float16 (the sum of squares and
    the log-determinant overflow) with no error; now within the estimate's noise of the
    float32 closed form (its sd here ~ sqrt(P / 2) / N = 2e-3)."""
    low, reference = half_and_reference(MeanFieldVI, dtype, stl=True)
    low(torch.randn(4, 2000, dtype=dtype))
    estimate = low.kl_loss()
    assert estimate.dtype == torch.float32 and bool(torch.isfinite(estimate))
    reference.stl = False
    assert abs(float(estimate.detach()) - float(reference.kl_loss().detach())) < 0.02
    estimate.backward()
    assert all(p.grad is not None and p.grad.dtype == dtype for p in _variational(low))


@pytest.mark.parametrize("dtype", HALF, ids=["float16", "bfloat16"])
@pytest.mark.parametrize("cls", BOTH)
def test_half_precision_guard_fires_only_for_a_degenerate_scale(cls, dtype):
    """Healthy at the default init_std (above); a scale that underflows to 0 in the
    parameters' dtype (every draw is the mean) or a NaN one still refuses."""
    for fill in (-800.0, math.nan):
        low, _ = half_and_reference(cls, dtype)
        with torch.no_grad():
            if cls is MeanFieldVI:
                low.log_std[0].view(-1)[0] = fill  # one weight of 20010
            else:
                low.log_std.fill_(fill)
        with pytest.raises(FloatingPointError, match=re.escape(f"{cls.__name__}: {GUARD}")):
            low.kl_loss()
    if dtype is torch.float16:
        low, _ = half_and_reference(cls, dtype)
        with torch.no_grad():
            for log_std in [low.log_std] if cls is FullCovarianceVI else list(low.log_std):
                log_std.fill_(-20.0)  # exp(-20) = 2e-9 is 0 in float16
        with pytest.raises(FloatingPointError, match=re.escape("spans [0, 0]")):
            low.kl_loss()


def test_every_argument_is_documented():
    for cls in BOTH:
        for function in (cls, cls.forward, cls.sample, cls.predict):
            doc = inspect.getdoc(function)
            target = function.__init__ if isinstance(function, type) else function
            for name in inspect.signature(target).parameters:
                if name not in ("self", "args", "kwargs"):
                    assert f"{name}:" in doc, (cls, function, name)
