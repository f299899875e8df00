"""Subset and last-layer Laplace: the closed-form Bayesian linear/logistic model on features.

On a network whose last layer is linear, the last-layer Laplace with the other weights
fixed is a Bayesian generalised linear model on the frozen features phi(x) = body(x):

* regression: the conjugate Bayesian linear regression, precision prior I +
  Phi~^T Phi~ / s^2 (Phi~ = [phi, 1]), mean its solve (the MAP of the last layer);
* classification: multinomial logistic regression, whose Hessian at the MAP is
  prior I + sum_i (diag(p_i) - p_i p_i^T) (x) phi~_i phi~_i^T — here taken from autograd's
  exact Hessian of the negative log posterior in the last layer's weights.

float64; agreement to round-off (1e-10) for precisions, 1e-6 for the trained means
(L-BFGS to a gradient of 1e-13).
"""

import re

import pytest
import torch
from torch import nn
from torch.func import functional_call
from torch.utils.data import DataLoader, TensorDataset

from samplers_as_optim.gaussian.laplace import Laplace

pytestmark = pytest.mark.usefixtures("float64_default")

NOISE, PRIOR = 0.4, 1.5


def assert_close(a, b, rtol=1e-10):
    scale = max(float(b.abs().max()), 1e-300)
    assert float((a - b).abs().max()) <= rtol * scale, float((a - b).abs().max()) / scale


def loader(x, y, batch_size=9):
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


def network(outputs):
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, outputs)
    )


def train_last_layer(model, x, y, nll):
    """MAP of the last layer (features frozen) for prior N(0, 1/PRIOR), by L-BFGS."""
    last = model[-1]
    optimizer = torch.optim.LBFGS(
        last.parameters(),
        lr=1.0,
        max_iter=200,
        tolerance_grad=1e-13,
        tolerance_change=0,
        line_search_fn="strong_wolfe",
    )

    def closure():
        optimizer.zero_grad()
        penalty = 0.5 * PRIOR * sum(p.square().sum() for p in last.parameters())
        loss = nll(model(x), y).sum() + penalty
        loss.backward()
        return loss

    optimizer.step(closure)
    return model


def features(model, x):
    with torch.no_grad():
        phi = model[:-1](x)
    return torch.cat([phi, torch.ones(x.shape[0], 1)], 1)


def test_last_layer_regression_is_bayesian_linear_regression_on_features():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(40, 3, generator=gen)
    y = torch.sin(x.sum(1, keepdim=True)) + NOISE * torch.randn(40, 1, generator=gen)
    model = network(1)
    gaussian_nll = lambda out, t: 0.5 * ((out - t) ** 2).sum(-1) / NOISE**2  # noqa: E731
    model = train_last_layer(model, x, y, gaussian_nll)
    la = Laplace(
        model,
        num_data=40,
        likelihood="regression",
        noise_std=NOISE,
        structure="dense",
        prior_precision=PRIOR,
        subset="last_layer",
    ).fit(loader(x, y))
    assert la.subset == ("4.weight", "4.bias")
    phi = features(model, x)
    precision = PRIOR * torch.eye(6) + phi.T @ phi / NOISE**2
    mean = torch.linalg.solve(precision, phi.T @ y.squeeze(-1) / NOISE**2)
    assert_close(la.precision, precision)
    assert_close(torch.cat([la.mean["4.weight"].reshape(-1), la.mean["4.bias"]]), mean, 1e-6)
    # the predictive: linear in the last layer, so linearised = sampled = phi~ theta_s
    gen_a = torch.Generator().manual_seed(2)
    gen_b = torch.Generator().manual_seed(2)
    lin = la.predict(x[:5], num_samples=4, linear=True, generator=gen_a).detach()
    mc = la.predict(x[:5], num_samples=4, linear=False, generator=gen_b).detach()
    assert_close(lin, mc)
    draws = la.sample(3, generator=torch.Generator().manual_seed(3))
    stacked = torch.cat([draws["4.weight"].reshape(3, -1), draws["4.bias"]], 1)
    assert_close(
        la.predict(x[:5], 3, linear=False, generator=torch.Generator().manual_seed(3))[
            ..., 0
        ].detach(),
        stacked @ phi[:5].T,
    )
    # the frozen body stays at the MAP in every draw
    assert set(draws) == {"4.weight", "4.bias"}


@pytest.mark.parametrize("structure", ["dense", "kron", "diag"])
def test_last_layer_classification_is_laplace_of_logistic_regression_on_features(structure):
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(30, 3, generator=gen)
    y = torch.randint(0, 3, (30,), generator=gen)
    # No training needed: the logits are linear in the last layer, so the GGN is the
    # exact Hessian of the cross-entropy at any weights.
    model = network(3)
    la = Laplace(
        model,
        num_data=30,
        likelihood="classification",
        structure=structure,
        prior_precision=PRIOR,
        subset="last_layer",
    ).fit(loader(x, y))
    last = {n: p.detach() for n, p in model[-1].named_parameters()}
    phi = features(model, x)[:, :-1]

    def neg_log_posterior(weight, bias):
        logits = functional_call(model[-1], {"weight": weight, "bias": bias}, (phi,))
        nll = torch.nn.functional.cross_entropy(logits, y, reduction="sum")
        return nll + 0.5 * PRIOR * (weight.square().sum() + bias.square().sum())

    hessian = torch.autograd.functional.hessian(neg_log_posterior, (last["weight"], last["bias"]))
    expected = torch.cat(
        [
            torch.cat([hessian[0][0].reshape(15, 15), hessian[0][1].reshape(15, 3)], 1),
            torch.cat([hessian[1][0].reshape(3, 15), hessian[1][1].reshape(3, 3)], 1),
        ]
    )
    if structure == "dense":
        assert_close(la.precision, expected)
    elif structure == "diag":
        diag = torch.cat([la.precision["4.weight"].reshape(-1), la.precision["4.bias"]])
        assert_close(diag, torch.diagonal(expected))
    else:
        # KFAC of the last layer in closed form (J = I): G = sum_i H_i, A = mean phi~ phi~^T,
        # in row-major vec([W, b]); not the exact Hessian, but its Kronecker approximation.
        probs = model(x).detach().softmax(-1)
        g = torch.diag(probs.sum(0)) - probs.T @ probs
        phi_t = features(model, x)
        kfac = PRIOR * torch.eye(18) + torch.kron(g, phi_t.T @ phi_t / 30)
        order = [o * 5 + j for o in range(3) for j in range(5)]
        order = torch.tensor([i for o in range(3) for i in (*order[o * 5 : o * 5 + 5], 15 + o)])
        assert_close(la.precision.dense()[order][:, order], kfac)
        # same trace as the exact GGN's diagonal blocks in expectation only: not equal
        assert float((la.precision.dense() - expected).abs().max()) > 1e-3


def test_subset_by_names_equals_the_corresponding_entries():
    gen = torch.Generator().manual_seed(5)
    x, y = torch.randn(20, 3, generator=gen), torch.randint(0, 2, (20,), generator=gen)
    model = network(2)
    kwargs = {"num_data": 20, "likelihood": "classification"}
    full = Laplace(model, structure="dense", **kwargs).fit(loader(x, y))
    sub = Laplace(model, structure="dense", subset=["2.weight", "0.bias"], **kwargs).fit(
        loader(x, y)
    )
    assert sub.treated.names == ("0.bias", "2.weight")  # model order
    index = torch.cat([torch.arange(18, 24), torch.arange(24, 54)])
    assert_close(sub.precision, full.precision[index][:, index])
    diag = Laplace(model, subset=["2.weight", "0.bias"], **kwargs).fit(loader(x, y))
    assert_close(diag.precision["2.weight"], torch.diagonal(full.precision)[24:54].reshape(5, 6))
    draws = sub.sample(2)
    assert set(draws) == {"0.bias", "2.weight"}
    out = sub.predict(x[:3], num_samples=2, linear=True)
    assert out.shape == (2, 3, 2)


def test_last_layer_skips_frozen_modules_and_errors():
    model = network(2)
    model[4].requires_grad_(False)
    la = Laplace(model, num_data=5, likelihood="classification", subset="last_layer")
    assert la.subset == ("2.weight", "2.bias")
    with pytest.raises(
        ValueError,
        match=re.escape(
            "Invalid model: Sequential (expected at least one parameter with requires_grad=True"
        ),
    ):
        Laplace(
            network(2).requires_grad_(False),
            num_data=5,
            likelihood="classification",
            subset="last_layer",
        )
