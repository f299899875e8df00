"""Laplace: exactness on conjugate Bayesian linear regression, structure, sampling, predict.

Exactness tests run in float64 on Bayesian linear regression (BLR), where the GGN with a
Gaussian likelihood is the exact Hessian, so the Laplace approximation IS the conjugate
posterior: precision Lambda = prior * I + Phi^T Phi / s^2 and mean Lambda^-1 Phi^T y / s^2
(Phi = [x, 1], weight entries first, then the bias, as in named_parameters()).
"""

import inspect
import math
import re

import pytest
import torch
from torch import nn
from torch.func import functional_call, jacrev
from torch.utils.data import DataLoader, TensorDataset

from samplers_as_optim.gaussian import _memory
from samplers_as_optim.gaussian.kfac import KronPrecision
from samplers_as_optim.gaussian.laplace import Laplace
from samplers_as_optim.samples.stacked import call_stacked

DT = torch.float64
NOISE = 0.5
PRIOR = 2.0


pytestmark = pytest.mark.usefixtures("float64_default")


def blr_data(n=40, d=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=gen)
    y = x @ torch.linspace(-1.0, 1.0, d) + 0.3 + NOISE * torch.randn(n, generator=gen)
    return x, y.unsqueeze(-1)


def conjugate(datasets, d=3, prior=PRIOR):
    """Exact posterior precision and mean of BLR on the union of ``datasets``."""
    precision = prior * torch.eye(d + 1)
    rhs = torch.zeros(d + 1)
    for x, y in datasets:
        phi = torch.cat([x, torch.ones(x.shape[0], 1)], dim=1)
        precision = precision + phi.T @ phi / NOISE**2
        rhs = rhs + phi.T @ y.squeeze(-1) / NOISE**2
    return precision, torch.linalg.solve(precision, rhs)


def train_map(model, x, y, num_data, penalty):
    """Minimise the mean loss of DESIGN §1: mean NLL + penalty(model) / num_data (L-BFGS)."""
    optimizer = torch.optim.LBFGS(
        model.parameters(),
        lr=1.0,
        max_iter=500,
        tolerance_grad=1e-13,
        tolerance_change=0,
        line_search_fn="strong_wolfe",
    )

    def closure():
        optimizer.zero_grad()
        nll = 0.5 * ((model(x) - y) ** 2).mean() / NOISE**2
        loss = nll + penalty(model) / num_data
        loss.backward()
        return loss

    for _ in range(3):
        optimizer.step(closure)
    return model


def weight_decay_penalty(prior):
    # -log N(0, 1/prior) up to a constant: the prior of prior_precision = num_data * weight_decay.
    return lambda model: 0.5 * prior * sum(p.square().sum() for p in model.parameters())


def flat(model_or_dict, names=("weight", "bias")):
    items = (
        dict(model_or_dict.named_parameters())
        if isinstance(model_or_dict, nn.Module)
        else model_or_dict
    )
    return torch.cat([items[n].detach().reshape(-1) for n in names])


def loader(x, y, batch_size=7):
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


def assert_close(a, b, rtol=1e-6, atol=0.0):
    torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


def mlp(outputs=3, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, outputs))


def class_data(n=30, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=gen), torch.randint(0, 3, (n,), generator=gen)


# ---------------------------------------------------------------------------- exactness
def test_dense_ggn_is_conjugate_posterior():
    """Trained with weight_decay-equivalent penalty, the dense GGN Laplace is exact (1e-6)."""
    x, y = blr_data()
    n = x.shape[0]
    torch.manual_seed(0)
    model = train_map(nn.Linear(3, 1), x, y, n, weight_decay_penalty(PRIOR))
    la = Laplace(
        model,
        num_data=n,
        likelihood="regression",
        noise_std=NOISE,
        structure="dense",
        prior_precision=PRIOR,
    ).fit(loader(x, y))
    precision, mean = conjugate([(x, y)])
    assert_close(la.precision, precision, rtol=1e-10)
    assert_close(flat(la.mean), mean, rtol=1e-6)
    assert_close(la.covariance, torch.linalg.inv(precision), rtol=1e-6)


@pytest.mark.parametrize("curvature", ["ggn", "ef"])
@pytest.mark.parametrize("likelihood", ["classification", "regression"])
def test_diagonal_equals_diagonal_of_dense(curvature, likelihood):
    model = mlp(outputs=3 if likelihood == "classification" else 2)
    x, y = class_data()
    if likelihood == "regression":
        y = torch.randn(x.shape[0], 2, generator=torch.Generator().manual_seed(3))
    kwargs = {
        "num_data": 100,
        "likelihood": likelihood,
        "curvature": curvature,
        "prior_precision": 0.7,
    }
    diag = Laplace(model, structure="diag", **kwargs).fit(loader(x, y))
    dense = Laplace(model, structure="dense", **kwargs).fit(loader(x, y))
    names = tuple(n for n, _ in model.named_parameters())
    diagonal = flat(diag.precision, names)
    assert_close(diagonal, torch.diagonal(dense.precision), rtol=1e-10)
    # not vacuous: the data term dominates the prior somewhere
    assert float(diagonal.max()) > 10 * 0.7


@pytest.mark.parametrize("structure", ["diag", "dense"])
@pytest.mark.parametrize("curvature", ["ggn", "ef"])
def test_zero_curvature_leaves_the_prior(structure, curvature):
    """Inputs of zero and no bias: no information, the posterior is the prior (finite)."""
    model = nn.Linear(3, 1, bias=False)
    x, y = torch.zeros(10, 3), torch.randn(10, 1)
    la = Laplace(
        model,
        num_data=1000,
        likelihood="regression",
        structure=structure,
        curvature=curvature,
        prior_precision=PRIOR,
    ).fit(loader(x, y))
    expected = torch.full((3,), 1.0 / PRIOR)
    covariance = la.covariance
    variances = (
        torch.diagonal(covariance) if structure == "dense" else flat(covariance, ("weight",))
    )
    assert_close(variances, expected)
    samples = la.sample(5, generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(samples["weight"]).all()
    log_prob = la.log_prob(model)
    assert torch.isfinite(log_prob)
    reference = (
        torch.distributions.Normal(model.weight.detach(), PRIOR**-0.5)
        .log_prob(model.weight.detach())
        .sum()
    )
    assert_close(log_prob.detach(), reference)


@pytest.mark.parametrize("structure", ["diag", "dense"])
def test_setting_the_temperature_after_fit_equals_refitting(structure):
    x, y = class_data()
    model = mlp()
    kwargs = {"num_data": 50, "likelihood": "classification", "structure": structure}
    swept = Laplace(model, **kwargs).fit(loader(x, y))
    swept.temperature = 0.3
    refit = Laplace(model, temperature=0.3, **kwargs).fit(loader(x, y))
    generator = lambda: torch.Generator().manual_seed(3)  # noqa: E731
    a, b = swept.sample(4, generator=generator()), refit.sample(4, generator=generator())
    assert all(torch.equal(a[name], b[name]) for name in a)
    with pytest.raises(
        ValueError, match=re.escape("Invalid temperature: nan (expected a finite number >= 0)")
    ):
        swept.temperature = math.nan
    assert swept.temperature == 0.3


@pytest.mark.parametrize("structure", ["diag", "dense"])
def test_covariance_scales_with_temperature(structure):
    x, y = class_data()
    model = mlp()
    kwargs = {"num_data": 50, "likelihood": "classification", "structure": structure}
    cold = Laplace(model, temperature=1.0, **kwargs).fit(loader(x, y))
    hot = Laplace(model, temperature=2.5, **kwargs).fit(loader(x, y))
    zero = Laplace(model, temperature=0.0, **kwargs).fit(loader(x, y))
    names = tuple(cold.mean)
    if structure == "dense":
        assert_close(hot.covariance, 2.5 * cold.covariance, rtol=1e-12)
    else:
        assert_close(flat(hot.covariance, names), 2.5 * flat(cold.covariance, names), rtol=1e-12)
    assert_close(
        flat(hot.precision, names) if structure == "diag" else hot.precision,
        flat(cold.precision, names) if structure == "diag" else cold.precision,
    )
    # one generator seed couples the draws: theta_T - mean = sqrt(T) (theta_1 - mean)
    mean = flat(cold.mean, names)
    draw_cold = cold.sample(4, generator=torch.Generator().manual_seed(9))
    draw_hot = hot.sample(4, generator=torch.Generator().manual_seed(9))
    draw_zero = zero.sample(4, generator=torch.Generator().manual_seed(9))
    stacked = lambda d: torch.cat([d[n].reshape(4, -1) for n in names], 1)  # noqa: E731
    assert_close(stacked(draw_hot) - mean, math.sqrt(2.5) * (stacked(draw_cold) - mean), rtol=1e-10)
    assert_close(stacked(draw_zero), mean.expand(4, -1), rtol=0, atol=0)


def test_num_data_scales_the_mean_curvature():
    """Lambda = prior + (N / n) * sum over the n seen examples; batch size does not matter."""
    x, y = class_data(n=30)
    model = mlp()
    kwargs = {"likelihood": "classification", "prior_precision": 0.5}
    a = Laplace(model, num_data=30, **kwargs).fit(loader(x, y, batch_size=4))
    b = Laplace(model, num_data=30, **kwargs).fit(loader(x, y, batch_size=30))
    half = Laplace(model, num_data=30, **kwargs).fit(loader(x[:15], y[:15]))
    once = Laplace(model, num_data=15, **kwargs).fit(loader(x[:15], y[:15]))
    names = tuple(a.mean)
    assert_close(flat(a.precision, names), flat(b.precision, names), rtol=1e-12)
    assert_close(
        flat(half.precision, names) - 0.5, 2 * (flat(once.precision, names) - 0.5), rtol=1e-12
    )


def test_prior_precision_is_num_data_times_weight_decay():
    """SGD with weight_decay wd on the mean loss has the MAP of prior_precision = N * wd."""
    x, y = blr_data()
    n, wd = x.shape[0], 0.05
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=wd)
    for _ in range(3000):
        optimizer.zero_grad()
        (0.5 * ((model(x) - y) ** 2).mean() / NOISE**2).backward()
        optimizer.step()
    la = Laplace(
        model,
        num_data=n,
        likelihood="regression",
        noise_std=NOISE,
        structure="dense",
        prior_precision=n * wd,
    ).fit(loader(x, y))
    precision, mean = conjugate([(x, y)], prior=n * wd)
    assert_close(flat(la.mean), mean, rtol=1e-6)
    assert_close(la.precision, precision, rtol=1e-10)


def test_continual_learning_posterior_is_next_prior():
    """Task 2 trained on mean NLL - la1.log_prob / N2, fitted with prior_precision=la1.precision,
    is the exact posterior given both tasks (BLR, dense); diagonal chaining adds up too."""
    (x1, y1), (x2, y2) = blr_data(seed=1), blr_data(n=25, seed=2)
    n1, n2 = x1.shape[0], x2.shape[0]
    torch.manual_seed(0)
    model = train_map(nn.Linear(3, 1), x1, y1, n1, weight_decay_penalty(PRIOR))
    kwargs = {"likelihood": "regression", "noise_std": NOISE, "structure": "dense"}
    la1 = Laplace(model, num_data=n1, prior_precision=PRIOR, **kwargs).fit(loader(x1, y1))
    model = train_map(model, x2, y2, n2, lambda m: -la1.log_prob(m))
    la2 = Laplace(model, num_data=n2, prior_precision=la1.precision, **kwargs).fit(loader(x2, y2))
    precision, mean = conjugate([(x1, y1), (x2, y2)])
    assert_close(flat(la2.mean), mean, rtol=1e-6)
    assert_close(la2.precision, precision, rtol=1e-10)

    diag1 = Laplace(model, num_data=n1, likelihood="regression", noise_std=NOISE).fit(
        loader(x1, y1)
    )
    diag2 = Laplace(
        model,
        num_data=n2,
        likelihood="regression",
        noise_std=NOISE,
        prior_precision=diag1.precision,
    ).fit(loader(x2, y2))
    alone = Laplace(model, num_data=n2, likelihood="regression", noise_std=NOISE).fit(
        loader(x2, y2)
    )
    # prior 1 each: diag2 = diag1 + (alone - 1)
    assert_close(
        flat(diag2.precision), flat(diag1.precision) + flat(alone.precision) - 1.0, rtol=1e-12
    )
    # a diagonal posterior can also be the prior of a dense one
    dense = Laplace(model, num_data=n2, prior_precision=diag1.precision, **kwargs).fit(
        loader(x2, y2)
    )
    assert_close(torch.diagonal(dense.precision), flat(diag2.precision), rtol=1e-12)


# ---------------------------------------------------------------------------- the Gaussian
@pytest.mark.parametrize("structure", ["diag", "dense"])
def test_samples_are_the_stated_transform_of_the_noise(structure):
    """theta = mean + sqrt(T) * Lambda^{-1/2} xi, xi the generator's torch.randn draws."""
    x, y = class_data()
    model = mlp()
    la = Laplace(
        model, num_data=40, likelihood="classification", structure=structure, temperature=0.3
    )
    la.fit(loader(x, y))
    names = tuple(la.mean)
    draws = la.sample(6, generator=torch.Generator().manual_seed(5))
    assert set(draws) == set(names)
    assert all(draws[n].shape == (6, *la.mean[n].shape) for n in names)
    delta = torch.cat([draws[n].reshape(6, -1) for n in names], 1) - flat(la.mean, names)
    xi = torch.randn(6, delta.shape[1], generator=torch.Generator().manual_seed(5))
    if structure == "diag":
        whitened = delta * flat(la.precision, names).sqrt() / math.sqrt(0.3)
    else:
        whitened = delta @ torch.linalg.cholesky(la.precision) / math.sqrt(0.3)
    assert_close(whitened, xi, rtol=1e-9, atol=1e-9)


def test_sample_moments_dense():
    """Empirical covariance of 4000 dense draws within 5 Monte Carlo standard errors."""
    x, y = blr_data()
    model = nn.Linear(3, 1)
    la = Laplace(model, num_data=40, likelihood="regression", noise_std=NOISE, structure="dense")
    la.fit(loader(x, y))
    n = 4000
    draws = la.sample(n, generator=torch.Generator().manual_seed(11))
    theta = torch.cat([draws["weight"].reshape(n, -1), draws["bias"]], 1)
    sigma = la.covariance
    centred = theta - flat(la.mean)
    empirical = centred.T @ centred / n
    # Var of a sample second moment of a Gaussian: (S_ij^2 + S_ii S_jj) / n
    stderr = ((sigma.square() + torch.outer(sigma.diagonal(), sigma.diagonal())) / n).sqrt()
    assert ((empirical - sigma).abs() < 5 * stderr).all()
    mean_err = centred.mean(0).abs() / (sigma.diagonal() / n).sqrt()
    assert (mean_err < 5).all()


@pytest.mark.parametrize("structure", ["diag", "dense"])
def test_penalty_is_the_temperature_one_quadratic(structure):
    x, y = class_data()
    model = mlp()
    la = Laplace(
        model, num_data=40, likelihood="classification", structure=structure, temperature=0.7
    ).fit(loader(x, y))
    names = tuple(la.mean)
    draws = la.sample(3, generator=torch.Generator().manual_seed(4))
    delta = torch.cat([draws[n].reshape(3, -1) for n in names], 1) - flat(la.mean, names)
    precision = la.precision if structure == "dense" else torch.diag(flat(la.precision, names))
    expected = 0.5 * torch.einsum("sp,pq,sq->s", delta, precision, delta)
    assert_close(la.penalty(draws), expected, rtol=1e-10)
    # the same as -T * log_prob up to a constant, and zero at the mean
    constant = la.penalty(draws) + 0.7 * la.log_prob(draws)
    assert_close(constant, constant[0].expand(3), rtol=1e-10)
    assert float(la.penalty(la.mean)) == 0.0


@pytest.mark.parametrize("structure", ["diag", "dense"])
def test_log_prob_matches_torch_distributions(structure):
    x, y = class_data()
    model = mlp()
    la = Laplace(
        model, num_data=40, likelihood="classification", structure=structure, temperature=0.7
    )
    la.fit(loader(x, y))
    names = tuple(la.mean)
    mean = flat(la.mean, names)
    if structure == "dense":
        reference = torch.distributions.MultivariateNormal(mean, covariance_matrix=la.covariance)
    else:
        reference = torch.distributions.Independent(
            torch.distributions.Normal(mean, flat(la.covariance, names).sqrt()), 1
        )
    draws = la.sample(5, generator=torch.Generator().manual_seed(2))
    stacked = torch.cat([draws[n].reshape(5, -1) for n in names], 1)
    assert_close(la.log_prob(draws), reference.log_prob(stacked), rtol=1e-9)
    single = {n: draws[n][0] for n in names}
    assert_close(la.log_prob(single), reference.log_prob(stacked[0]), rtol=1e-9)
    # differentiable in a module's parameters: the gradient is -Lambda (theta - mean) / T
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(single[name])
    value = la.log_prob(model)
    grads = torch.autograd.grad(value, list(model.parameters()))
    delta = stacked[0] - mean
    precision = la.precision if structure == "dense" else torch.diag(flat(la.precision, names))
    assert_close(torch.cat([g.reshape(-1) for g in grads]), -(precision @ delta) / 0.7, rtol=1e-9)


# ---------------------------------------------------------------------------- subsets, predict
def test_subset_posterior_lora_style():
    x, y = class_data()
    model = mlp()
    full_diag = Laplace(model, num_data=40, likelihood="classification").fit(loader(x, y))
    full_dense = Laplace(model, num_data=40, likelihood="classification", structure="dense").fit(
        loader(x, y)
    )
    model[0].weight.requires_grad_(False)
    model[0].bias.requires_grad_(False)
    la = Laplace(model, num_data=40, likelihood="classification").fit(loader(x, y))
    dense = Laplace(model, num_data=40, likelihood="classification", structure="dense").fit(
        loader(x, y)
    )
    assert set(la.mean) == {"2.weight", "2.bias"}
    for name in la.mean:
        assert_close(la.precision[name], full_diag.precision[name], rtol=1e-12)
    offset = sum(p.numel() for p in model[0].parameters())
    assert_close(dense.precision, full_dense.precision[offset:, offset:], rtol=1e-12)
    draws = la.sample(3, generator=torch.Generator().manual_seed(0))
    assert set(draws) == {"2.weight", "2.bias"}
    for linear in (False, True):
        out = la.predict(
            x[:4], num_samples=3, linear=linear, generator=torch.Generator().manual_seed(0)
        )
        assert out.shape == (3, 4, 3)


def test_predict_mc_is_call_stacked_of_samples(device):
    x, y = class_data()
    model = mlp().to(device)
    x, y = x.to(device), y.to(device)
    la = Laplace(model, num_data=40, likelihood="classification").fit(loader(x, y))
    gen = lambda: torch.Generator(device=device).manual_seed(3)  # noqa: E731
    out = la.predict(x[:5], num_samples=7, linear=False, generator=gen())
    expected = call_stacked(model, la.sample(7, generator=gen()), x[:5])
    assert out.shape == (7, 5, 3)
    assert_close(out, expected, rtol=1e-12)
    assert_close(
        la.predict(x[:5], num_samples=7, linear=False, generator=gen(), chunk_size=2),
        expected,
        rtol=1e-12,
    )


def test_linearised_predict_is_first_order_taylor():
    """f(mean) + J (theta_s - mean) with J from jacrev; equal to MC for a linear model."""
    x, y = class_data()
    model = mlp()
    la = Laplace(model, num_data=40, likelihood="classification").fit(loader(x, y))
    gen = lambda: torch.Generator().manual_seed(4)  # noqa: E731
    out = la.predict(x[:3], num_samples=5, linear=True, generator=gen(), chunk_size=2)
    draws = la.sample(5, generator=gen())
    names = tuple(la.mean)
    jac = jacrev(lambda p: functional_call(model, p, (x[:3],)))(la.mean)
    jac = torch.cat([jac[n].reshape(3, 3, -1) for n in names], -1)
    delta = torch.cat([draws[n].reshape(5, -1) for n in names], 1) - flat(la.mean, names)
    expected = model(x[:3]).detach() + torch.einsum("bcp,sp->sbc", jac, delta)
    assert_close(out, expected, rtol=1e-10, atol=1e-12)

    xr, yr = blr_data()
    linear_model = nn.Linear(3, 1)
    la = Laplace(linear_model, num_data=40, likelihood="regression", structure="dense").fit(
        loader(xr, yr)
    )
    lin = la.predict(xr[:4], num_samples=6, linear=True, generator=gen())
    mc = la.predict(xr[:4], num_samples=6, linear=False, generator=gen())
    assert_close(lin, mc, rtol=1e-10, atol=1e-12)


def test_fit_restores_training_mode_and_uses_eval():
    x, y = class_data()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Dropout(0.5), nn.Tanh(), nn.Linear(6, 3))
    model.train()
    a = Laplace(model, num_data=40, likelihood="classification").fit(loader(x, y))
    b = Laplace(model, num_data=40, likelihood="classification").fit(loader(x, y))
    assert model.training
    for name in a.mean:
        assert_close(a.precision[name], b.precision[name], rtol=0, atol=0)


# ---------------------------------------------------------------------------- errors
def build(**kwargs):
    kwargs.setdefault("num_data", 10)
    kwargs.setdefault("likelihood", "classification")
    model = kwargs.pop("model", None) or mlp()
    return Laplace(model, **kwargs)


CONSTRUCTION_ERRORS = [
    ({"num_data": 0}, ValueError, "Invalid num_data: 0 (expected a positive integer"),
    ({"num_data": 1.5}, TypeError, "Invalid num_data: 1.5 (expected a positive integer"),
    (
        {"likelihood": "poisson"},
        ValueError,
        "Invalid likelihood: 'poisson' (expected 'classification', 'regression' or a callable",
    ),
    ({"likelihood": 3}, ValueError, "Invalid likelihood: 3 (expected"),
    (
        {"noise_std": 0.5},
        ValueError,
        "Invalid noise_std: 0.5 (expected None: it applies only to likelihood='regression')",
    ),
    (
        {"likelihood": lambda f, t: f.sum(-1), "noise_std": 0.5},
        ValueError,
        "Invalid noise_std: 0.5 (expected None",
    ),
    (
        {"likelihood": "regression", "noise_std": -1.0},
        ValueError,
        "Invalid noise_std: -1.0 (expected a finite number > 0)",
    ),
    (
        {"likelihood": "regression", "noise_std": math.nan},
        ValueError,
        "Invalid noise_std: nan (expected a finite number > 0)",
    ),
    (
        {"curvature": "hessian"},
        ValueError,
        "Invalid curvature: 'hessian' (expected one of 'ggn', 'ef')",
    ),
    (
        {"structure": "blocks"},
        ValueError,
        "Invalid structure: 'blocks' (expected one of 'diag', 'dense', 'kron', 'lowrank')",
    ),
    (
        {
            "structure": "kron",
            "prior_precision": {
                "0.weight": torch.ones(6, 4),
                "0.bias": 2.0,
                "2.weight": 1.0,
                "2.bias": 1.0,
            },
        },
        ValueError,
        "Invalid prior_precision: more than one value for '0.weight' and '0.bias' (expected "
        "one number per layer with structure='kron': a layer's weight and bias share one "
        "Kronecker factor pair, so one prior; a per-weight prior is refused)",
    ),
    (
        {"structure": "kron", "prior_precision": torch.linspace(1, 2, 51)},
        ValueError,
        "Invalid prior_precision: more than one value for '0.weight' and '0.bias'",
    ),
    (
        {"structure": "kron", "prior_precision": torch.eye(51)},
        ValueError,
        "Invalid prior_precision: tensor of shape (51, 51) (expected a number, one value per "
        "treated tensor (4,), one per weight (51,), a dict of per-parameter precisions)",
    ),
    (
        {"subset": "first_layer"},
        ValueError,
        "Invalid subset: 'first_layer' (expected None, 'last_layer' or a list of parameter names)",
    ),
    (
        {"subset": 3},
        TypeError,
        "Invalid subset: 3 (expected None, 'last_layer' or a list of parameter names)",
    ),
    (
        {"subset": []},
        ValueError,
        "Invalid subset: [] (expected at least one parameter name)",
    ),
    (
        {"subset": ["2.weight", "head.bias"]},
        ValueError,
        "Invalid subset: unknown parameter names ['head.bias'] (expected names from "
        "model.named_parameters(): ['0.weight', '0.bias', '2.weight', '2.bias'])",
    ),
    (
        {"prior_precision": 0.0},
        ValueError,
        "Invalid prior_precision: 0.0 (expected a finite number > 0)",
    ),
    (
        {"prior_precision": math.nan},
        ValueError,
        "Invalid prior_precision: nan (expected a finite number > 0)",
    ),
    (
        {"prior_precision": math.inf},
        ValueError,
        "Invalid prior_precision: inf (expected a finite number > 0)",
    ),
    (
        {"prior_precision": "1"},
        TypeError,
        "Invalid prior_precision: '1' (expected a finite number > 0)",
    ),
    (
        {"prior_precision": {"0.weight": torch.ones(6, 4)}},
        ValueError,
        "Invalid prior_precision: dict without ['0.bias', '2.weight', '2.bias'] (expected a positive precision tensor for every treated parameter)",
    ),
    (
        {
            "prior_precision": {
                "0.weight": torch.ones(6, 4),
                "0.bias": torch.zeros(6),
                "2.weight": torch.ones(3, 6),
                "2.bias": torch.ones(3),
            }
        },
        ValueError,
        "Invalid prior_precision: entry '0.bias' of shape (6,) (expected finite values > 0 of shape (6,), or one number)",
    ),
    (
        {"prior_precision": torch.eye(51)},
        ValueError,
        "Invalid prior_precision: tensor of shape (51, 51) (expected a number, one value per "
        "treated tensor (4,), one per weight (51,), a dict of per-parameter precisions)",
    ),
    (
        {"prior_precision": -torch.eye(51), "structure": "dense"},
        ValueError,
        "Invalid prior_precision: a (51, 51) matrix that is not symmetric positive definite",
    ),
    (
        {"temperature": -1.0},
        ValueError,
        "Invalid temperature: -1.0 (expected a finite number >= 0)",
    ),
    (
        {"temperature": math.nan},
        ValueError,
        "Invalid temperature: nan (expected a finite number >= 0)",
    ),
]


@pytest.mark.parametrize(("kwargs", "error", "message"), CONSTRUCTION_ERRORS)
def test_construction_errors(kwargs, error, message):
    with pytest.raises(error, match=re.escape(message)):
        build(**kwargs)


def test_model_errors():
    frozen = mlp().requires_grad_(False)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "Invalid model: Sequential (expected at least one parameter with requires_grad=True"
        ),
    ):
        build(model=frozen)
    with pytest.raises(
        TypeError, match=re.escape("Invalid model: function (expected a torch.nn.Module)")
    ):
        Laplace(lambda x: x, num_data=1, likelihood="classification")


def test_dense_that_cannot_fit_is_refused_with_its_size(monkeypatch):
    monkeypatch.setattr(_memory, "available_bytes", lambda device: 2**10)
    message = (
        "Invalid structure: 'dense' (a 51 x 51 torch.float64 matrix over the 51 treated "
        "parameters needs about 7.75e-05 GiB with its factorisation, but cpu has 9.54e-07 GiB "
        "free; use structure='diag', or set requires_grad=False on the parameters the "
        "posterior should not treat)"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        build(structure="dense")
    monkeypatch.setattr(_memory, "available_bytes", lambda device: 2**40)
    build(structure="dense")  # fits
    assert _memory.dense_bytes(51, torch.float64) == 3 * 51 * 51 * 8
    assert _memory.dense_bytes(51, torch.float64, 4) == 4 * 51 * 51 * 8


def test_use_errors():
    x, y = class_data()
    la = build()
    for call in (
        lambda: la.sample(2),
        lambda: la.predict(x),
        lambda: la.log_prob(mlp()),
        lambda: la.precision,
    ):
        with pytest.raises(
            RuntimeError, match=re.escape("Laplace is not fitted yet: call fit(loader) first")
        ):
            call()
    with pytest.raises(
        TypeError, match=re.escape("Invalid batch: Tensor (expected a pair (inputs, targets)")
    ):
        la.fit([x])
    with pytest.raises(ValueError, match=re.escape("Invalid loader: it yielded no examples")):
        la.fit([])
    la.fit(loader(x, y))
    with pytest.raises(ValueError, match=re.escape("Invalid n: 0 (expected an integer >= 1)")):
        la.sample(0)
    with pytest.raises(TypeError, match=re.escape("Invalid n: 2.0 (expected an integer >= 1)")):
        la.sample(2.0)
    with pytest.raises(TypeError, match=re.escape("Invalid n: True (expected an integer >= 1)")):
        la.sample(True)
    with pytest.raises(
        ValueError, match=re.escape("Invalid num_samples: -3 (expected an integer >= 1)")
    ):
        la.predict(x, num_samples=-3)
    with pytest.raises(
        ValueError, match=re.escape("Invalid chunk_size: 0 (expected None or an integer >= 1)")
    ):
        la.predict(x, linear=True, chunk_size=0)
    with pytest.raises(  # the sampled path says the same (one validator)
        ValueError, match=re.escape("Invalid chunk_size: 0 (expected None or an integer >= 1)")
    ):
        la.predict(x, linear=False, chunk_size=0)
    with pytest.raises(
        TypeError, match=re.escape("Invalid linear: 'yes' (expected True or False)")
    ):
        la.predict(x, linear="yes")
    with pytest.raises(
        KeyError,
        match=re.escape("Invalid params: missing ['2.bias'] (expected every treated name)"),
    ):
        la.log_prob({k: v for k, v in la.mean.items() if k != "2.bias"})
    bad = {k: v.expand(2, 2, *v.shape) for k, v in la.mean.items()}
    with pytest.raises(
        ValueError,
        match=re.escape(
            "Invalid params: '0.weight' has shape (2, 2, 6, 4) (expected (6, 4), optionally with one leading sample dimension)"
        ),
    ):
        la.log_prob(bad)
    mixed = dict(la.mean, **{"2.bias": torch.zeros(5)})
    with pytest.raises(
        ValueError,
        match=re.escape(
            "Invalid parameters: '2.bias' has shape (5,) (expected (3,), after 0 leading sample dimension(s))"
        ),
    ):
        la.log_prob(mixed)
    zero = build(temperature=0.0).fit(loader(x, y))
    with pytest.raises(
        ValueError,
        match=re.escape(
            "Invalid temperature: 0.0 (expected > 0 for log_prob: at temperature 0 the posterior is a point mass)"
        ),
    ):
        zero.log_prob(zero.mean)


def test_fitted_precision_not_positive_definite():
    """More parameters than examples and a negligible prior: a singular dense precision."""
    x, y = torch.randn(2, 10), torch.randn(2, 1)
    la = Laplace(
        nn.Linear(10, 1),
        num_data=2,
        likelihood="regression",
        structure="dense",
        prior_precision=1e-300,
    )
    with pytest.raises(
        ValueError,
        match=re.escape(
            "Invalid precision: the fitted dense precision is not positive definite in torch.float64"
        ),
    ):
        la.fit(loader(x, y))


class Gain(nn.Module):
    """Multiplies by a buffer (not a parameter, so no subset covers it): ``inf`` makes the
    model output non-finite for finite data, ``1e200`` overflows the curvature (its square
    in float64) while the output stays finite."""

    def __init__(self):
        super().__init__()
        self.register_buffer("gain", torch.tensor(1.0))

    def forward(self, x):
        return x * self.gain


def gained_mlp(outputs=2):
    """Linear layers (fast paths, Kronecker blocks) and a LayerNorm (the generic path, and
    the diagonal part of ``"kron"``)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Tanh(), Gain(), nn.Linear(6, outputs))


def fitted_state(la):
    """Every tensor a fit leaves behind, through the public API (cloned)."""
    tensors = list(la.mean.values())
    precision = la.precision
    if isinstance(precision, dict):
        tensors += list(precision.values())
    elif isinstance(precision, KronPrecision):
        for block in precision.blocks:
            tensors += [block.g_eigenvalues, block.g_eigenvectors]
            tensors += [block.a_eigenvalues, block.a_eigenvectors]
        tensors += list(precision.diagonal.values())
    else:
        tensors.append(precision)
    covariance = la.covariance
    tensors += list(covariance.values()) if isinstance(covariance, dict) else [covariance]
    tensors += list(la.sample(3, generator=torch.Generator().manual_seed(0)).values())
    return [tensor.detach().clone() for tensor in tensors]


def batch_message(part, kind):
    return (
        f"Invalid batch: {part} contain 1 non-finite value, the first ({kind}) in example 3 "
        "of 7 (expected finite inputs and targets: drop or impute those examples)"
    )


NON_FINITE = [
    ("inputs", math.nan, batch_message("inputs", "nan")),
    ("inputs", math.inf, batch_message("inputs", "inf")),
    ("inputs", -math.inf, batch_message("inputs", "-inf")),
    ("targets", math.nan, batch_message("targets", "nan")),
    ("targets", -math.inf, batch_message("targets", "-inf")),
    ("probabilities", math.nan, batch_message("targets", "nan")),
    ("output", math.inf, "Invalid model output: "),
    (
        "curvature",
        1e200,
        "Invalid curvature: the summed curvature holds NaN or inf in torch.float64 although "
        "every batch's inputs, targets and model outputs are finite (expected finite sums: it "
        "overflowed, so rescale the inputs or fit in float64, or the likelihood's output "
        "gradient or Hessian is not finite)",
    ),
]


@pytest.mark.parametrize(
    "subset", [None, "last_layer", ["1.weight", "1.bias"]], ids=["all", "last_layer", "names"]
)
@pytest.mark.parametrize("structure", ["diag", "dense", "kron"])
@pytest.mark.parametrize(
    ("where", "value", "message"),
    NON_FINITE,
    ids=[f"{where}-{value}" for where, value, _ in NON_FINITE],
)
def test_non_finite_data_is_refused_and_the_fit_kept(where, value, message, structure, subset):
    """NaN or inf in a batch's inputs or targets (regression targets, classification
    probabilities: curvatures that do not even depend on them), a non-finite model output
    or an overflowing curvature: every structure and subset refuses the fit with the same
    ValueError (before: a NaN diagonal precision and NaN samples, an eigh _LinAlgError
    for "kron", "not positive definite" for "dense", or a silent fit), and leaves a fresh
    Laplace unfitted and a fitted one bit for bit as it was."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(20, 4, generator=gen)
    classification = where == "probabilities"
    if classification:
        y = torch.randn(20, 2, generator=gen).softmax(-1)
    else:
        y = torch.randn(20, 2, generator=gen)
    bad_x, bad_y = x.clone(), y.clone()
    if where == "inputs":
        bad_x[10, 2] = value  # example 3 of the second batch of 7
    elif where in ("targets", "probabilities"):
        bad_y[10, 1] = value
    model = gained_mlp()
    kwargs = {
        "num_data": 20,
        "likelihood": "classification" if classification else "regression",
        "structure": structure,
        "subset": subset,
    }
    fresh = Laplace(model, **kwargs)
    fitted = Laplace(model, **kwargs).fit(loader(x, y))
    before = fitted_state(fitted)
    if where in ("output", "curvature"):
        model[3].gain.fill_(value)
    model.train()
    for la in (fresh, fitted):
        with pytest.raises(ValueError, match=re.escape(message)):
            la.fit(loader(bad_x, bad_y))
        assert model.training
    with pytest.raises(RuntimeError, match=re.escape("Laplace is not fitted yet")):
        fresh.mean  # noqa: B018
    after = fitted_state(fitted)
    assert len(after) == len(before)
    for old, new in zip(before, after, strict=True):
        assert old.dtype == new.dtype and torch.equal(old, new)


def test_every_argument_is_documented():
    for function in (Laplace, Laplace.fit, Laplace.sample, Laplace.predict, Laplace.log_prob):
        doc = inspect.getdoc(function)
        target = function.__init__ if isinstance(function, type) else function
        for name in inspect.signature(target).parameters:
            if name != "self":
                assert f"{name}:" in doc, (function, name)


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_diagonal_matches_posteriors():
    """Same numbers as posteriors' diag_fisher / diag_ggn (installed with the bench extra)."""
    posteriors_laplace = pytest.importorskip("posteriors.laplace")
    x, y = class_data(n=16)
    model = mlp()
    params = {name: p.detach().clone() for name, p in model.named_parameters()}

    def log_lik(p, batch):
        logits = functional_call(model, p, (batch[0],))
        return -torch.nn.functional.cross_entropy(logits, batch[1], reduction="none"), logits

    def forward(p, batch):
        logits = functional_call(model, p, (batch[0],))
        return logits, logits

    def outer(logits, batch):
        return -torch.nn.functional.cross_entropy(logits, batch[1], reduction="sum")

    transforms = {
        "ef": posteriors_laplace.diag_fisher.build(log_lik, per_sample=True),
        "ggn": posteriors_laplace.diag_ggn.build(forward, outer),
    }
    for curvature, transform in transforms.items():
        state, _ = transform.update(transform.init(params), (x, y))
        la = Laplace(
            model,
            num_data=16,
            likelihood="classification",
            curvature=curvature,
            prior_precision=1e-3,
        ).fit(loader(x, y, batch_size=5))
        for name in params:
            assert_close(la.precision[name] - 1e-3, state.prec_diag[name], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("structure", ["diag", "dense"])
def test_fit_under_no_grad_and_vector_outputs(structure):
    """fit inside torch.no_grad() gives the same precision; a (batch,) regression output works."""
    x, y = blr_data()
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1), nn.Flatten(0))
    kwargs = {
        "num_data": 40,
        "likelihood": "regression",
        "noise_std": NOISE,
        "structure": structure,
    }
    plain = Laplace(model, **kwargs).fit(loader(x, y.squeeze(-1)))
    with torch.no_grad():
        quiet = Laplace(model, **kwargs).fit(loader(x, y.squeeze(-1)))
    names = tuple(plain.mean)
    if structure == "diag":
        assert_close(flat(quiet.precision, names), flat(plain.precision, names), rtol=1e-12)
    else:
        assert_close(quiet.precision, plain.precision, rtol=1e-12)
    assert plain.predict(x[:2], num_samples=3, linear=True).shape == (3, 2)


def test_outputs_feed_the_predictive_helpers():
    """predict's (S, B, ...) layout is what samplers_as_optim.predictive consumes."""
    predictive = pytest.importorskip("samplers_as_optim.predictive")
    x, y = class_data()
    la = Laplace(mlp(), num_data=40, likelihood="classification").fit(loader(x, y))
    for linear in (False, True):
        out = predictive.classification(la.predict(x[:4], 8, linear=linear))
        assert out.probs.shape == (4, 3) and bool((out.epistemic >= 0).all())
    xr, yr = blr_data()
    la = Laplace(nn.Linear(3, 1), num_data=40, likelihood="regression", noise_std=NOISE)
    la.fit(loader(xr, yr))
    gaussian = predictive.regression(la.predict(xr[:4], 8), la.noise_std**2)
    assert gaussian.mean.shape == (4, 1)
    torch.testing.assert_close(gaussian.aleatoric, torch.full((4, 1), NOISE**2))
