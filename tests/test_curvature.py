"""Curvature (GGN, empirical Fisher): fast path against generic path against brute force.

Everything in float64 so that agreement is to round-off (1e-10 relative). The brute
force builds each example's Jacobian with ``torch.func.jacrev`` and its output Hessian by
hand: C = sum_i J_i^T H_i J_i (GGN) or sum_i g_i g_i^T (EF).
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, jacrev

from samplers_as_optim.gaussian import _per_example_curvature as _curvature
from samplers_as_optim.gaussian._per_example_curvature import dense_curvature, diag_curvature
from samplers_as_optim.gaussian.flat import Treated
from samplers_as_optim.gaussian.likelihoods import CallableLikelihood, Classification, Regression

DT = torch.float64


pytestmark = pytest.mark.usefixtures("float64_default")


def brute_force(model, treated, x, y, kind, likelihood):
    """Dense curvature from per-example Jacobians and explicit output Hessians."""
    params = {name: p.detach() for name, p in model.named_parameters()}
    total = torch.zeros(treated.numel, treated.numel)
    for i in range(x.shape[0]):

        def out(p, i=i):
            return functional_call(model, p, (x[i : i + 1],)).reshape(-1)

        jac = jacrev(out)(params)
        jac = torch.cat([jac[n].reshape(jac[n].shape[0], -1) for n in treated.names], dim=1)
        target = y[i : i + 1]

        def example_nll(z, target=target):
            return likelihood.nll(z.reshape(1, -1), target).sum()

        f = out(params).detach().requires_grad_(True)
        if kind == "ef":
            (g,) = torch.autograd.grad(example_nll(f), f)
            hess = torch.outer(g, g)
        else:
            hess = torch.autograd.functional.hessian(example_nll, f.detach())
        total += jac.T @ hess @ jac
    return total


def mlp(inputs=5, hidden=7, outputs=3, inplace=True):
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(inputs, hidden),
        nn.ReLU(inplace=inplace),
        nn.Linear(hidden, hidden),
        nn.Tanh(),
        nn.Linear(hidden, outputs),
    )


def classification_batch(n=9, inputs=5, classes=3):
    gen = torch.Generator().manual_seed(1)
    return torch.randn(n, inputs, generator=gen), torch.randint(0, classes, (n,), generator=gen)


def regression_batch(n=9, inputs=5, outputs=2):
    gen = torch.Generator().manual_seed(2)
    return torch.randn(n, inputs, generator=gen), torch.randn(n, outputs, generator=gen)


def categorical_log_lik(logits, target):
    return logits.log_softmax(-1).gather(-1, target.unsqueeze(-1)).squeeze(-1)


def gaussian_log_lik(output, target, noise_std=0.7):
    return torch.distributions.Normal(output, noise_std).log_prob(target).sum(-1)


CASES = [
    ("classification", Classification(), classification_batch, 3),
    ("regression", Regression(0.7), regression_batch, 2),
    ("callable-categorical", CallableLikelihood(categorical_log_lik), classification_batch, 3),
    ("callable-gaussian", CallableLikelihood(gaussian_log_lik), regression_batch, 2),
]


def assert_close(a, b, rtol=1e-10):
    scale = max(float(b.abs().max()), 1e-300)
    assert float((a - b).abs().max()) <= rtol * scale, float((a - b).abs().max()) / scale


@pytest.mark.parametrize("kind", ["ggn", "ef"])
@pytest.mark.parametrize(
    ("label", "likelihood", "batch", "outputs"), CASES, ids=[c[0] for c in CASES]
)
def test_dense_and_diagonal_match_brute_force(kind, label, likelihood, batch, outputs):
    model = mlp(outputs=outputs)
    x, y = batch()
    treated = Treated.of(model)
    expected = brute_force(model, treated, x, y, kind, likelihood)
    assert float(expected.abs().max()) > 1e-3  # not vacuous
    assert_close(dense_curvature(model, treated, x, y, likelihood, kind), expected)
    for fast in (True, False):
        diag = diag_curvature(model, treated, x, y, likelihood, kind, fast=fast)
        assert_close(treated.flatten(diag), torch.diagonal(expected))


def test_callable_likelihood_matches_builtin_ggn():
    """The autograd Hessian + eigen-factor of a callable equals the closed-form factor."""
    model = mlp()
    x, y = classification_batch()
    treated = Treated.of(model)
    builtin = diag_curvature(model, treated, x, y, Classification(), "ggn")
    custom = diag_curvature(model, treated, x, y, CallableLikelihood(categorical_log_lik), "ggn")
    assert_close(treated.flatten(custom), treated.flatten(builtin))


def test_fast_path_is_taken_for_linear_layers(monkeypatch):
    """A pure Linear MLP never calls the generic path (else the comparison is vacuous)."""

    def refuse(*args, **kwargs):
        raise AssertionError("generic path used")

    monkeypatch.setattr(_curvature, "_generic_diag", refuse)
    model = mlp()
    x, y = classification_batch()
    treated = Treated.of(model)
    for kind in ("ggn", "ef"):
        diag_curvature(model, treated, x, y, Classification(), kind)


def test_fast_path_is_taken_for_conv_layers(monkeypatch):
    model = conv_net()
    x, y = conv_batch()
    model(x)  # materialise the lazy layer
    treated = Treated.of(model)
    monkeypatch.setattr(
        _curvature, "_generic_diag", lambda *a, **k: (_ for _ in ()).throw(AssertionError)
    )
    diag_curvature(model, treated, x, y, Classification(), "ggn")


def conv_net():
    torch.manual_seed(3)
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1, stride=2),
        nn.Tanh(),
        nn.Conv2d(3, 4, (2, 3), padding=(1, 0), dilation=2, bias=False),
        nn.ReLU(),
        nn.Flatten(),
        nn.LazyLinear(3),
    )


def conv_batch(n=5):
    gen = torch.Generator().manual_seed(4)
    return torch.randn(n, 2, 12, 12, generator=gen), torch.randint(0, 3, (n,), generator=gen)


@pytest.mark.parametrize("kind", ["ggn", "ef"])
@pytest.mark.parametrize("chunk_bytes", [2**27, 1000])
def test_conv_fast_path_equals_generic(kind, chunk_bytes, monkeypatch):
    """Unfold + per-example products, in one chunk or many, equals vmap(vjp)."""
    monkeypatch.setattr(_curvature, "_CHUNK_BYTES", chunk_bytes)
    model = conv_net()
    x, y = conv_batch()
    model(x)
    treated = Treated.of(model)
    fast = diag_curvature(model, treated, x, y, Classification(), kind)
    generic = diag_curvature(model, treated, x, y, Classification(), kind, fast=False)
    for name in treated.names:
        assert_close(fast[name], generic[name])
    assert_close(
        treated.flatten(fast),
        torch.diagonal(brute_force(model, treated, x, y, kind, Classification())),
    )


class Tied(nn.Module):
    """One Linear applied twice (weight sharing), a LayerNorm and an Embedding-free head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.shared = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 3)
        self.scale = nn.Parameter(torch.tensor(1.3))

    def forward(self, x):
        h = torch.tanh(self.shared(x))
        h = self.norm(self.shared(h)) * self.scale
        return self.head(h)


class Sequence(nn.Module):
    """A Linear on (batch, time, features): per-example gradients sum over time."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(6)
        self.proj = nn.Linear(3, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.proj(x)).mean(1))


@pytest.mark.parametrize("kind", ["ggn", "ef"])
def test_fallbacks_shared_layer_norm_and_sequence(kind):
    """Layers called twice, non-Linear modules and 3-d inputs fall back, same numbers."""
    gen = torch.Generator().manual_seed(7)
    for model, x in [
        (Tied(), torch.randn(6, 4, generator=gen)),
        (Sequence(), torch.randn(6, 5, 3, generator=gen)),
    ]:
        y = torch.randint(0, 3, (6,), generator=gen)
        treated = Treated.of(model)
        fast = diag_curvature(model, treated, x, y, Classification(), kind)
        assert not any(value.requires_grad for value in fast.values())
        expected = brute_force(model, treated, x, y, kind, Classification())
        assert_close(treated.flatten(fast), torch.diagonal(expected))


def test_subset_of_parameters():
    """Frozen parameters are skipped; the treated ones get their entries of the full diagonal."""
    model = mlp()
    x, y = classification_batch()
    full = diag_curvature(model, Treated.of(model), x, y, Classification(), "ggn")
    model[0].weight.requires_grad_(False)
    model[2].bias.requires_grad_(False)
    treated = Treated.of(model)
    assert "0.weight" not in treated.names
    subset = diag_curvature(model, treated, x, y, Classification(), "ggn")
    assert set(subset) == set(treated.names)
    for name in treated.names:
        assert_close(subset[name], full[name])


def test_generic_chunks_agree(monkeypatch):
    model = Tied()
    gen = torch.Generator().manual_seed(8)
    x, y = torch.randn(7, 4, generator=gen), torch.randint(0, 3, (7,), generator=gen)
    treated = Treated.of(model)
    one = diag_curvature(model, treated, x, y, Classification(), "ggn", fast=False)
    dense_one = dense_curvature(model, treated, x, y, Classification(), "ggn")
    monkeypatch.setattr(_curvature, "_CHUNK_BYTES", 100)
    many = diag_curvature(model, treated, x, y, Classification(), "ggn", fast=False)
    dense_many = dense_curvature(model, treated, x, y, Classification(), "ggn")
    assert_close(treated.flatten(many), treated.flatten(one))
    assert_close(dense_many, dense_one)


def test_regression_ggn_of_linear_model_is_design_gram():
    """For f = W x + b and Gaussian noise s: GGN = Phi^T Phi / s^2 exactly (Phi = [x, 1])."""
    model = nn.Linear(4, 1)
    x, _ = regression_batch(inputs=4)
    y = torch.randn(x.shape[0], 1)
    treated = Treated.of(model)
    phi = torch.cat([x, torch.ones(x.shape[0], 1)], dim=1)
    dense = dense_curvature(model, treated, x, y, Regression(0.5), "ggn")
    assert_close(dense, phi.T @ phi / 0.25)


def test_errors():
    model = mlp()
    x, y = classification_batch()
    treated = Treated.of(model)
    # (batch, positions, classes) logits are one observation per position: their targets
    # are (batch, positions); a (batch,) output is no logits at all
    with pytest.raises(
        ValueError,
        match=r"Invalid targets: shape \(9,\) \(expected class indices of an integer dtype, "
        r"shape \(9, 1\), in \[0, 3\), or class probabilities of the output's shape \(9, 1, 3\)\)",
    ):
        diag_curvature(
            nn.Sequential(model, nn.Unflatten(1, (1, 3))), treated, x, y, Classification(), "ggn"
        )
    with pytest.raises(
        ValueError,
        match=r"Invalid model output: shape \(27,\) \(expected \(batch, classes\) or "
        r"\(batch, \*positions, classes\) logits",
    ):
        diag_curvature(nn.Sequential(model, nn.Flatten(0)), treated, x, y, Classification(), "ggn")
    with pytest.raises(
        ValueError,
        match=r"Invalid targets: shape \(9,\) \(expected the model output's shape \(9, 3\)",
    ):
        diag_curvature(model, treated, x, y.double(), Regression(1.0), "ggn")
    with pytest.raises(
        ValueError,
        match=r"Invalid likelihood: the callable returned \(\) \(expected a tensor of shape \(9,\)",
    ):
        diag_curvature(
            model, treated, x, y, CallableLikelihood(lambda f, t: F.cross_entropy(f, t)), "ef"
        )

    class DictOut(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(5, 3)

        def forward(self, x):
            return {"logits": self.lin(x)}

    wrapped = DictOut()
    with pytest.raises(TypeError, match="Invalid model output: dict"):
        diag_curvature(wrapped, Treated.of(wrapped), x, y, Classification(), "ggn")


@pytest.mark.parametrize("kind", ["ggn", "ef"])
@pytest.mark.parametrize("frozen", [None, "4.bias", "4.weight"])
def test_single_linear_layer_dense_fast_path(kind, frozen, monkeypatch):
    """Treated = one Linear layer (last-layer Laplace): the Kronecker fast path equals the
    generic path and the brute force, and the generic path is not used."""
    model = mlp()
    for name, param in model.named_parameters():
        param.requires_grad_(name.startswith("4.") and name != frozen)
    x, y = classification_batch()
    treated = Treated.of(model)
    likelihood = Classification()
    expected = brute_force(model, treated, x, y, kind, likelihood)
    generic = dense_curvature(model, treated, x, y, likelihood, kind, fast=False)
    monkeypatch.setattr(
        _curvature, "_per_example_vjp", lambda *a: (_ for _ in ()).throw(AssertionError)
    )
    fast = dense_curvature(model, treated, x, y, likelihood, kind)
    assert_close(generic, expected)
    assert_close(fast, expected)
