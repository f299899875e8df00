"""GGN/Fisher-vector products and conjugate gradients against the dense curvature.

float64 throughout: the products must equal the dense matrix (tested against brute-force
Jacobians in test_curvature.py) times v to round-off (1e-10 relative), and CG must reach
the direct solve.
"""

import math
import re

import pytest
import torch
from torch import nn

from samplers_as_optim import curvature
from samplers_as_optim._curvature import dense_curvature
from samplers_as_optim._flat import Treated
from samplers_as_optim._likelihoods import make_likelihood
from samplers_as_optim.curvature import (
    conjugate_gradient,
    fisher_vector_product,
    ggn_vector_product,
)

pytestmark = pytest.mark.usefixtures("float64_default")


def mlp(outputs=3):
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 5), nn.ReLU(), nn.Linear(5, outputs)
    )


def batch(likelihood, n=11, outputs=3):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(n, 4, generator=gen)
    if likelihood == "regression":
        return x, torch.randn(n, outputs, generator=gen)
    if likelihood == "classification":
        return x, torch.randint(0, outputs, (n,), generator=gen)
    return x, torch.randn(n, outputs, generator=gen)


def gaussian_log_lik(output, target):
    return torch.distributions.StudentT(3.0, output, 0.8).log_prob(target).sum(-1)


CASES = [("classification", None), ("regression", 0.7), (gaussian_log_lik, None)]


def assert_close(a, b, rtol=1e-10):
    scale = float(b.abs().max())
    assert float((a - b).abs().max()) <= rtol * scale, float((a - b).abs().max()) / scale


@pytest.mark.parametrize(("likelihood", "noise_std"), CASES, ids=["cls", "reg", "callable"])
@pytest.mark.parametrize("kind", ["ggn", "ef"])
def test_products_equal_dense_matrix_times_vector(likelihood, noise_std, kind):
    model = mlp()
    key = likelihood if isinstance(likelihood, str) else "callable"
    x, y = batch(key)
    treated = Treated.of(model)
    dense = dense_curvature(model, treated, x, y, make_likelihood(likelihood, noise_std), kind)
    assert float(dense.abs().max()) > 1e-2  # not vacuous
    product = ggn_vector_product if kind == "ggn" else fisher_vector_product
    v = torch.randn(treated.numel, generator=torch.Generator().manual_seed(2))
    flat = product(model, x, y, v, likelihood, noise_std=noise_std)
    assert flat.shape == v.shape
    assert_close(flat, dense @ v)
    as_dict = product(model, x, y, treated.unflatten(v), likelihood, noise_std=noise_std)
    assert set(as_dict) == set(treated.names)
    assert_close(treated.flatten(as_dict), dense @ v)


def test_products_on_a_subset_and_a_conv_net():
    """Frozen parameters are not treated; conv layers go through the same jvp/vjp."""
    torch.manual_seed(3)
    model = nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(3 * 4 * 4, 3)
    )
    model[3].weight.requires_grad_(False)
    x = torch.randn(5, 2, 4, 4, generator=torch.Generator().manual_seed(4))
    y = torch.tensor([0, 1, 2, 1, 0])
    treated = Treated.of(model)
    assert treated.names == ("0.weight", "0.bias", "3.bias")
    dense = dense_curvature(model, treated, x, y, make_likelihood("classification", None), "ggn")
    v = torch.randn(treated.numel, generator=torch.Generator().manual_seed(5))
    assert_close(ggn_vector_product(model, x, y, v), dense @ v)


def test_ggn_is_the_hessian_for_a_linear_gaussian_model():
    """Linear model, Gaussian likelihood: the GGN is the exact Hessian of the summed NLL."""
    model = nn.Linear(4, 2)
    x, y = batch("regression", outputs=2)
    params = dict(model.named_parameters())
    names = tuple(params)

    def nll(*flat_params):
        out = torch.func.functional_call(model, dict(zip(names, flat_params, strict=True)), (x,))
        return 0.5 * ((out - y) ** 2).sum() / 0.7**2

    hessian = torch.autograd.functional.hessian(nll, tuple(p.detach() for p in params.values()))
    treated = Treated.of(model)
    v = {n: torch.randn_like(p) for n, p in params.items()}
    expected = {
        n: sum(torch.tensordot(hessian[i][j], v[m], dims=v[m].dim()) for j, m in enumerate(names))
        for i, n in enumerate(names)
    }
    got = ggn_vector_product(model, x, y, v, "regression", noise_std=0.7)
    assert_close(treated.flatten(got), treated.flatten(expected))


def test_conjugate_gradient_solves_the_damped_ggn_system():
    """Hessian-free solve of (prior I + (N/n) GGN) x = b equals the direct solve (1e-8)."""
    model = mlp()
    x, y = batch("classification")
    treated = Treated.of(model)
    dense = dense_curvature(model, treated, x, y, make_likelihood("classification", None), "ggn")
    prior, scale = 0.3, 5.0
    matrix = prior * torch.eye(treated.numel) + scale * dense
    b = torch.randn(treated.numel, generator=torch.Generator().manual_seed(6))
    expected = torch.linalg.solve(matrix, b)

    def matvec(v):
        return prior * v + scale * ggn_vector_product(model, x, y, v)

    solution = conjugate_gradient(matvec, b, tol=1e-12, maxiter=10 * treated.numel)
    assert_close(solution, expected, rtol=1e-8)
    # dict form: same answer
    as_dict = conjugate_gradient(
        lambda v: {
            n: prior * v[n] + scale * w for n, w in ggn_vector_product(model, x, y, v).items()
        },
        treated.unflatten(b),
        tol=1e-12,
        maxiter=10 * treated.numel,
    )
    assert_close(treated.flatten(as_dict), expected, rtol=1e-8)
    # too few iterations leave a residual: the stopping rule is real
    rough = conjugate_gradient(matvec, b, maxiter=3)
    assert float((rough - expected).norm()) > 1e-3 * float(expected.norm())


def test_conjugate_gradient_exact_in_size_steps_and_warm_start():
    gen = torch.Generator().manual_seed(7)
    m = torch.randn(6, 6, generator=gen)
    a = m @ m.T + 0.5 * torch.eye(6)
    b = torch.randn(6, generator=gen)
    expected = torch.linalg.solve(a, b)
    assert_close(conjugate_gradient(lambda v: a @ v, b, tol=0.0), expected, rtol=1e-9)
    started = conjugate_gradient(lambda v: a @ v, b, x0=expected.clone(), maxiter=1)
    assert_close(started, expected, rtol=1e-12)
    zero = conjugate_gradient(lambda v: a @ v, torch.zeros(6))
    assert torch.equal(zero, torch.zeros(6))


def test_errors():
    model = mlp()
    x, y = batch("classification")
    with pytest.raises(
        ValueError,
        match=re.escape("Invalid v: shape (3,) (expected (73,): the flat vector of the treated"),
    ):
        ggn_vector_product(model, x, y, torch.zeros(3))
    with pytest.raises(TypeError, match=re.escape("Invalid v: list (expected a flat tensor")):
        fisher_vector_product(model, x, y, [0.0])
    with pytest.raises(KeyError, match=re.escape("Invalid v: missing ['4.bias']")):
        ggn_vector_product(
            model, x, y, {n: p for n, p in model.named_parameters() if n != "4.bias"}
        )
    bad = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    bad["0.bias"] = torch.zeros(2)
    with pytest.raises(
        ValueError, match=re.escape("Invalid v: '0.bias' has shape (2,) (expected (5,))")
    ):
        ggn_vector_product(model, x, y, bad)
    with pytest.raises(ValueError, match=re.escape("Invalid likelihood: 'poisson'")):
        ggn_vector_product(model, x, y, torch.zeros(73), "poisson")
    with pytest.raises(
        TypeError, match=re.escape("Invalid model output: tuple (expected a tensor")
    ):
        ggn_vector_product(_TupleModel(), x, y, torch.zeros(15))
    eye = lambda v: v  # noqa: E731
    with pytest.raises(
        ValueError, match=re.escape("Invalid maxiter: 0 (expected an integer >= 1)")
    ):
        conjugate_gradient(eye, torch.ones(2), maxiter=0)
    with pytest.raises(
        ValueError, match=re.escape("Invalid tol: nan (expected a finite number >= 0)")
    ):
        conjugate_gradient(eye, torch.ones(2), tol=math.nan)
    with pytest.raises(TypeError, match=re.escape("Invalid b: list (expected a tensor or a dict")):
        conjugate_gradient(eye, [1.0])
    with pytest.raises(
        ValueError,
        match=re.escape("Invalid matvec: p^T A p = -2 <= 0 for a search direction (expected a"),
    ):
        conjugate_gradient(lambda v: -v, torch.ones(2))


class _TupleModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 3)

    def forward(self, x):
        return self.layer(x), x


def test_public_module():
    import samplers_as_optim

    assert samplers_as_optim.curvature is curvature
    assert set(curvature.__all__) == {
        "conjugate_gradient",
        "fisher_vector_product",
        "ggn_vector_product",
    }
