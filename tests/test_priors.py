"""``samplers_as_optim.priors``: N(0, std²/fan_in) per layer as weight decay, precision or loss."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from samplers_as_optim import (
    SGHMC,
    GaussianLikelihood,
    Laplace,
    ParallelEnsemble,
    prior_loss,
    prior_param_groups,
    prior_precision,
)
from samplers_as_optim.priors import prior_variances

N = 50


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, kernel_size=(3, 2), groups=1),
        nn.LayerNorm([4, 2, 3]),
        nn.Flatten(),
        nn.Linear(24, 7),
        nn.ReLU(),
        nn.Linear(7, 1),
    )


def decays(groups: list[dict]) -> dict[str, float]:
    return {name: group["weight_decay"] for group in groups for name, _ in group["params"]}


def test_weight_decay_is_one_over_n_times_the_variance_of_each_rule():
    std, bias_std, other_std = 2.0, 0.5, 3.0
    groups = prior_param_groups(
        model(), num_data=N, std=std, bias_std=bias_std, other_std=other_std
    )
    expected = {
        "0.weight": 3 * 3 * 2 / (N * std**2),  # fan_in = in_channels * kernel elements
        "0.bias": 1 / (N * bias_std**2),
        "1.weight": 1 / (N * other_std**2),  # LayerNorm: the other rule
        "1.bias": 1 / (N * other_std**2),
        "3.weight": 24 / (N * std**2),
        "3.bias": 1 / (N * bias_std**2),
        "5.weight": 7 / (N * std**2),
        "5.bias": 1 / (N * bias_std**2),
    }
    got = decays(groups)
    assert list(got) != [] and set(got) == set(expected)
    for name, value in expected.items():
        assert got[name] == pytest.approx(value, rel=1e-12), name
    # one group per distinct decay, parameters as (name, tensor) pairs of the model
    assert len(groups) == len({group["weight_decay"] for group in groups})
    parameters = dict(model().named_parameters())
    for group in groups:
        for name, tensor in group["params"]:
            assert tensor.shape == parameters[name].shape


def test_scale_none_and_groups_and_transposed_convolutions():
    net = nn.Sequential(nn.Conv1d(4, 6, 5, groups=2), nn.ConvTranspose2d(6, 8, 3, groups=2))
    got = decays(prior_param_groups(net, num_data=N))
    assert got["0.weight"] == pytest.approx(2 * 5 / N)  # in_channels / groups * kernel
    assert got["1.weight"] == pytest.approx(4 * 9 / N)  # torch.nn.init's fan-in: weight[1]
    for module in net:
        torch_fan_in = nn.init._calculate_fan_in_and_fan_out(module.weight)[0]
        assert got[f"{list(net).index(module)}.weight"] == pytest.approx(torch_fan_in / N)
    flat = decays(prior_param_groups(net, num_data=N, scale="none"))
    assert flat["0.weight"] == pytest.approx(1 / N) and flat["1.weight"] == pytest.approx(1 / N)


def test_frozen_parameters_are_left_out_and_the_likelihood_has_no_decay():
    net = nn.Linear(3, 1)
    net.bias.requires_grad_(False)
    both = nn.ModuleDict({"net": net, "likelihood": GaussianLikelihood(num_data=N)})
    got = decays(prior_param_groups(both, num_data=N))
    assert got == {"net.weight": pytest.approx(3 / N), "likelihood.log_noise_std": 0.0}
    assert set(prior_precision(both)) == {"net.weight"}


def test_a_parallel_ensemble_gets_each_members_prior():
    net = nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 2))
    single = decays(prior_param_groups(net, num_data=N))
    ensemble = ParallelEnsemble(net, 3, seed=0)
    stacked = decays(prior_param_groups(ensemble, num_data=N))
    assert stacked == {f"module.{name}": value for name, value in single.items()}


def test_prior_precision_is_one_over_the_variance_and_laplace_takes_it():
    net = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 1))
    precision = prior_precision(net, std=2.0, bias_std=0.5)
    assert torch.equal(precision["0.weight"], torch.full((5, 3), 3 / 4.0))
    assert torch.equal(precision["2.weight"], torch.full((1, 5), 5 / 4.0))
    assert torch.equal(precision["0.bias"], torch.full((5,), 4.0))
    groups = prior_param_groups(net, num_data=N, std=2.0, bias_std=0.5)
    for name, value in decays(groups).items():  # 1/v = N λ
        assert precision[name].flatten()[0].item() == pytest.approx(N * value, rel=1e-6)
    x, y = torch.randn(20, 3), torch.randn(20, 1)
    la = Laplace(
        net, num_data=20, likelihood="regression", noise_std=1.0, prior_precision=precision
    )
    la.fit([(x, y)])
    assert torch.allclose(la.prior_precision["0.weight"], precision["0.weight"])


def test_a_laplaces_evidence_tuned_precision_is_the_prior_of_the_groups_and_the_loss():
    """``precision=la.prior_precision`` (layerwise): decay = precision / N, in every form."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 1))
    x, y = torch.randn(40, 3), torch.randn(40, 1)
    la = Laplace(net, num_data=40, likelihood="regression", noise_std=1.0, prior_precision=1.0)
    la.fit([(x, y)])
    la.optimize_prior_precision(
        method="marglik", prior_structure="layerwise", num_steps=5, progress=False
    )
    tuned = {name: float(value.flatten()[0]) for name, value in la.prior_precision.items()}
    assert len(set(tuned.values())) == 4  # one per tensor, all moved from 1
    groups = prior_param_groups(net, num_data=N, precision=la.prior_precision)
    assert decays(groups) == pytest.approx({name: value / N for name, value in tuned.items()})
    decoupled = prior_param_groups(net, num_data=N, precision=la.prior_precision, decoupled=True)
    prior_decays = {n: g["prior_weight_decay"] for g in decoupled for n, _ in g["params"]}
    assert prior_decays == pytest.approx(decays(groups))
    back = prior_precision(net, precision=la.prior_precision)
    for name, value in la.prior_precision.items():
        assert torch.allclose(back[name], value)
    loss = prior_loss(net, num_data=N, precision=la.prior_precision)
    loss.backward()
    for name, parameter in net.named_parameters():
        expected = tuned[name] / N * parameter.detach()
        assert torch.allclose(parameter.grad, expected, rtol=1e-6, atol=0), name


def test_precision_a_number_for_every_prior_and_a_mapping_for_the_named_ones():
    both = nn.ModuleDict({"net": nn.Linear(4, 2), "likelihood": GaussianLikelihood(num_data=N)})
    variances = prior_variances(both, precision=8.0)
    assert variances == {"net.weight": 1 / 8, "net.bias": 1 / 8, "likelihood.log_noise_std": None}
    variances = prior_variances(both, precision={"net.weight": torch.full((2, 4), 2.0)})
    assert variances == {"net.weight": 0.5, "net.bias": 1.0, "likelihood.log_noise_std": None}
    assert prior_variances(both, precision=torch.tensor(4.0))["net.bias"] == 0.25


def test_prior_loss_gradient_is_the_weight_decay():
    net = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2))
    both = nn.ModuleDict({"net": net, "likelihood": GaussianLikelihood(num_data=N)})
    loss = prior_loss(both, num_data=N, std=1.5, bias_std=0.7)
    loss.backward()
    groups = prior_param_groups(both, num_data=N, std=1.5, bias_std=0.7)
    for group in groups:
        for name, tensor in group["params"]:
            if group["weight_decay"] == 0:  # σ's prior is the likelihood's own loss
                assert tensor.grad is None
                continue
            expected = group["weight_decay"] * tensor.detach()
            assert torch.allclose(tensor.grad, expected, rtol=1e-6, atol=0), name
    expected_value = sum(
        group["weight_decay"] * tensor.detach().square().sum() / 2
        for group in groups
        for _, tensor in group["params"]
    )
    assert loss.item() == pytest.approx(float(expected_value), rel=1e-6)


def test_prior_loss_of_a_model_whose_only_prior_is_in_a_loss_is_zero():
    value = prior_loss(GaussianLikelihood(num_data=N), num_data=N)
    assert value.item() == 0.0 and value.shape == ()


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: prior_param_groups("net", num_data=N), TypeError, "Invalid model: str"),
        (
            lambda: prior_param_groups(nn.Linear(2, 1), num_data=0),
            ValueError,
            "Invalid num_data: 0",
        ),
        (
            lambda: prior_param_groups(nn.Linear(2, 1), num_data=N, std=0.0),
            ValueError,
            "Invalid std: 0.0 (expected a finite number > 0)",
        ),
        (
            lambda: prior_precision(nn.Linear(2, 1), bias_std=-1.0),
            ValueError,
            "Invalid bias_std: -1.0 (expected a finite number > 0)",
        ),
        (
            lambda: prior_loss(nn.Linear(2, 1), num_data=N, other_std=math.inf),
            ValueError,
            "Invalid other_std: inf (expected a finite number > 0)",
        ),
        (
            lambda: prior_variances(nn.Linear(2, 1), scale="fan_out"),
            ValueError,
            "Invalid scale: 'fan_out' (expected one of 'fan_in', 'none')",
        ),
        (
            lambda: prior_variances(nn.Linear(2, 1), precision={"0.weight": 1.0}),
            ValueError,
            "Invalid precision: key '0.weight' (expected the names of the model's trainable "
            "parameters, as model.named_parameters() gives them: 'weight', 'bias')",
        ),
        (
            lambda: prior_variances(
                GaussianLikelihood(num_data=N), precision={"log_noise_std": 1.0}
            ),
            ValueError,
            "Invalid precision: key 'log_noise_std' (expected a parameter with a prior: its "
            "module declares its prior in its own loss)",
        ),
        (
            lambda: prior_param_groups(
                nn.Linear(2, 1), num_data=N, precision={"weight": torch.tensor([[1.0, 2.0]])}
            ),
            ValueError,
            "Invalid precision['weight']: a tensor of shape (1, 2) whose elements differ "
            "(expected one precision per parameter tensor",
        ),
        (
            lambda: prior_loss(nn.Linear(2, 1), num_data=N, precision={"bias": -1.0}),
            ValueError,
            "Invalid precision['bias']: -1.0 (expected a finite number > 0)",
        ),
        (
            lambda: prior_precision(nn.Linear(2, 1), precision=math.nan),
            ValueError,
            "Invalid precision: nan (expected a finite number > 0)",
        ),
        (
            lambda: prior_variances(nn.Linear(2, 1), precision="strong"),
            TypeError,
            "Invalid precision: 'strong' (expected None, a finite number > 0, or a mapping "
            "of parameter names to numbers or one-valued tensors)",
        ),
        (
            lambda: prior_param_groups(
                nn.ModuleDict({"net": nn.Linear(2, 1), "noise": GaussianLikelihood(num_data=100)}),
                num_data=64,
            ),
            ValueError,
            "Invalid num_data: 64 (expected 100, the num_data of noise (GaussianLikelihood), "
            "whose prior is in its loss over its own num_data",
        ),
        (
            lambda: prior_loss(GaussianLikelihood(num_data=100), num_data=64),
            ValueError,
            "Invalid num_data: 64 (expected 100, the num_data of the model (GaussianLikelihood)",
        ),
        (
            lambda: prior_param_groups(nn.ReLU(), num_data=N),
            ValueError,
            "Invalid model: ReLU without trainable parameters (expected a model with "
            "parameters that require grad)",
        ),
    ],
)
def test_refusals(call, error, message):
    with pytest.raises(error) as info:
        call()
    assert str(info.value).startswith(message)


def _sghmc_stationary(lr: float, decay: float, momentum: float, num_data: int, lags: int):
    """The exact stationary variance of θ and its autocorrelations for SGHMC's linear chain.

    With a zero data term the step is b' = μb + λθ + cξ, θ' = θ − lr b' (docs/design.md,
    SGD units; c² = 2(1−μ)/(N lr) at T = 1): a linear AR(1) in (θ, b), whose stationary
    covariance solves Σ = AΣAᵀ + ggᵀ.
    """
    c = math.sqrt(2 * (1 - momentum) / (num_data * lr))
    a = torch.tensor([[1 - lr * decay, -lr * momentum], [decay, momentum]], dtype=torch.float64)
    g = torch.tensor([[-lr * c], [c]], dtype=torch.float64)
    # vec(Σ) = (I − A⊗A)^{-1} vec(ggᵀ)
    eye = torch.eye(4, dtype=torch.float64)
    sigma = torch.linalg.solve(eye - torch.kron(a, a), (g @ g.T).reshape(4)).reshape(2, 2)
    rho, power = [], torch.eye(2, dtype=torch.float64)
    for _ in range(lags):
        power = power @ a
        rho.append(float((power @ sigma)[0, 0] / sigma[0, 0]))
    return float(sigma[0, 0]), rho


@pytest.mark.slow
def test_a_chain_on_the_prior_alone_has_each_layers_stated_variance():
    """SGHMC with no data term samples N(0, std²/fan_in) per weight tensor, biases apart.

    Each element is an independent linear chain, so the sample variance over E elements x
    D thinned draws has standard error v·√(2(1 + 2Σ_k ρ_k²)/(E·D)) (ρ the exact
    autocorrelations at the thinning lag, from the chain's own recursion); the test allows
    5 standard errors around the exact stationary variance of the discretised chain, which
    is itself within 2% of the prior's (the step's discretisation bias).
    """
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(40, 30), nn.Linear(30, 20))
    num_data, lr, momentum, bias_std = 10, 2e-3, 0.9, 0.3
    groups = prior_param_groups(net, num_data=num_data, bias_std=bias_std)
    optimizer = SGHMC(groups, lr=lr, momentum=momentum, num_data=num_data, seed=0)
    with torch.no_grad():
        for parameter in net.parameters():
            parameter.zero_()
    burn_in, thin, draws = 1000, 50, 120
    samples: dict[str, list[torch.Tensor]] = {name: [] for name, _ in net.named_parameters()}
    for step in range(burn_in + thin * draws):
        for parameter in net.parameters():
            parameter.grad = torch.zeros_like(parameter)  # no data term: the prior alone
        optimizer.step()
        if step >= burn_in and (step - burn_in) % thin == 0:
            for name, parameter in net.named_parameters():
                samples[name].append(parameter.detach().clone())
    stated = {"0.weight": 1 / 40, "0.bias": bias_std**2, "1.weight": 1 / 30, "1.bias": bias_std**2}
    for name, variance in stated.items():
        draws_ = torch.stack(samples[name]).double()
        decay = 1 / (num_data * variance)
        exact, rho = _sghmc_stationary(lr, decay, momentum, num_data, thin * 40)
        assert exact == pytest.approx(variance, rel=0.02)
        rho_thin = rho[thin - 1 :: thin]
        count = draws_.numel()
        se = exact * math.sqrt(2 * (1 + 2 * sum(r * r for r in rho_thin)) / count)
        measured = float(draws_.square().mean())  # the mean is 0 under the prior
        assert abs(measured - exact) < 5 * se, (name, measured, exact, se)
