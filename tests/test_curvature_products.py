"""GGN/Fisher-vector products and conjugate gradients against the dense curvature.

float64 throughout: the products must equal the dense matrix (tested against brute-force
Jacobians in test_curvature.py) times v to round-off (1e-10 relative), and CG must reach
the direct solve.
"""

import math
import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from samplers_as_optim import curvature
from samplers_as_optim.curvature import (
    conjugate_gradient,
    fisher_vector_product,
    ggn_vector_product,
)
from samplers_as_optim.gaussian._per_example_curvature import dense_curvature
from samplers_as_optim.gaussian.flat import Treated
from samplers_as_optim.gaussian.likelihoods import make_likelihood

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
        match=re.escape(
            "Invalid matvec: p^T A p / p^T p = -1 <= 0 for the search direction p at "
            "iteration 1 (expected a symmetric positive-definite operator"
        ),
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


# ---------------------------------------------------------------------------- hostile inputs
# Each case below failed before the checks: a NaN/inf answer or a silently wrong one, or a
# raw AttributeError/AssertionError/KeyError/RuntimeError instead of a message naming the
# argument.


def spd(n=6, seed=7, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    m = torch.randn(n, n, generator=gen, dtype=torch.float64)
    return (m @ m.T + 0.5 * torch.eye(n, dtype=torch.float64)).to(dtype)


class _Counting:
    """``v -> A v`` that records its calls and returns ``bad(v)`` at call ``at``."""

    def __init__(self, a, at, bad):
        self.a, self.at, self.bad, self.calls = a, at, bad, 0

    def __call__(self, v):
        self.calls += 1
        if isinstance(v, dict):
            out = {"w": self.a @ v["w"]}
            return self.bad(out) if self.calls == self.at else out
        return self.bad(self.a @ v) if self.calls == self.at else self.a @ v


@pytest.mark.parametrize(
    ("b", "message"),
    [
        (torch.tensor([1.0, math.nan, 2.0]), "Invalid b: non-finite values (nan) (expected finite"),
        (torch.tensor([math.inf, 1.0]), "Invalid b: non-finite values (inf) (expected finite"),
        (
            {"w": torch.ones(2), "u": torch.tensor([-math.inf, math.nan])},
            "Invalid b: 'u' has non-finite values (nan and inf) (expected finite",
        ),
    ],
    ids=["nan", "inf", "dict"],
)
def test_conjugate_gradient_refuses_nonfinite_b_up_front(b, message):
    calls = []

    def matvec(v):
        calls.append(v)
        return v

    with pytest.raises(ValueError, match=re.escape(message)):
        conjugate_gradient(matvec, b)
    assert not calls  # refused before any product


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("form", ["tensor", "dict"])
@pytest.mark.parametrize("at", [1, 3])
def test_conjugate_gradient_refuses_a_nonfinite_product_at_its_iteration(value, form, at):
    """A NaN/inf A p raises at the iteration that returned it; NaN never comes back as x."""
    a = spd()
    b = torch.randn(6, generator=torch.Generator().manual_seed(8))
    matvec = _Counting(a, at, lambda out: _poison(out, value))
    kind = "nan" if math.isnan(value) else "inf"
    where = "" if form == "tensor" else " in 'w'"
    message = (
        f"Invalid matvec: it returned non-finite values ({kind}){where} for A p at iteration "
        f"{at} (expected finite numbers: p is finite"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        conjugate_gradient(matvec, b if form == "tensor" else {"w": b}, tol=0.0)
    assert matvec.calls == at


def _poison(out, value):
    if isinstance(out, dict):
        return {k: _poison(t, value) for k, t in out.items()}
    out = out.clone()
    out[2] = value
    return out


def test_conjugate_gradient_checks_x0_and_its_product():
    a = spd()
    b = torch.randn(6, generator=torch.Generator().manual_seed(9))
    with pytest.raises(
        ValueError, match=re.escape("Invalid x0: non-finite values (nan) (expected finite")
    ):
        conjugate_gradient(lambda v: a @ v, b, x0=torch.full((6,), math.nan))
    with pytest.raises(
        ValueError,
        match=re.escape("Invalid matvec: it returned non-finite values (inf) for A x0 (expected"),
    ):
        conjugate_gradient(_Counting(a, 1, lambda out: out * math.inf), b, x0=torch.ones(6))
    with pytest.raises(
        ValueError, match=re.escape("Invalid x0: shape (5,) (expected (6,), the shape of b)")
    ):
        conjugate_gradient(lambda v: a @ v, b, x0=torch.ones(5))
    with pytest.raises(
        ValueError,
        match=re.escape(
            "Invalid x0: a dict whose keys differ from b's (missing ['w']; unexpected ['v'])"
        ),
    ):
        conjugate_gradient(lambda v: {"w": a @ v["w"]}, {"w": b}, x0={"v": b})
    with pytest.raises(TypeError, match=re.escape("Invalid x0: list (expected a tensor of shape")):
        conjugate_gradient(lambda v: a @ v, b, x0=[0.0] * 6)
    # b - A x0 overflows float32 although b, x0 and A x0 are finite
    big = torch.full((3,), 3e38, dtype=torch.float32)
    with pytest.raises(
        ValueError,
        match=re.escape("Invalid x0: the residual b - A x0 overflows b's dtype (inf) (expected"),
    ):
        conjugate_gradient(lambda v: 3e38 * v, big, x0=-torch.ones(3, dtype=torch.float32))


@pytest.mark.parametrize(
    ("matvec", "b", "error", "message"),
    [
        (
            lambda v: None,
            torch.ones(3),
            TypeError,
            "Invalid matvec: it returned None for A p at iteration 1 (expected a tensor of "
            "shape (3,), like b)",
        ),
        (
            lambda v: None,
            {"w": torch.ones(3)},
            TypeError,
            "Invalid matvec: it returned None for A p at iteration 1 (expected a dict with the "
            "keys of b, ['w'])",
        ),
        (
            lambda v: v.reshape(3, 1),  # used to broadcast: a wrong answer, no error
            torch.ones(3),
            ValueError,
            "Invalid matvec: it returned shape (3, 1) for A p at iteration 1 (expected (3,), "
            "the shape of b)",
        ),
        (
            lambda v: v["w"],
            {"w": torch.ones(3)},
            TypeError,
            "Invalid matvec: it returned Tensor for A p at iteration 1 (expected a dict",
        ),
        (
            lambda v: {"w": v},
            torch.ones(3),
            TypeError,
            "Invalid matvec: it returned dict for A p at iteration 1 (expected a tensor",
        ),
        (
            lambda v: {"v": v["w"]},
            {"w": torch.ones(3)},
            ValueError,
            "Invalid matvec: it returned a dict for A p at iteration 1 whose keys differ from "
            "b's (missing ['w']; unexpected ['v']) (expected the keys of b)",
        ),
        (
            lambda v: {**v, "extra": torch.ones(1)},
            {"w": torch.ones(3)},
            ValueError,
            "whose keys differ from b's (unexpected ['extra'])",
        ),
        (
            lambda v: {"w": v["w"][:2], "u": v["u"]},
            {"w": torch.ones(3), "u": torch.ones(1)},
            ValueError,
            "Invalid matvec: it returned 'w' of shape (2,) for A p at iteration 1 (expected "
            "(3,), the shape of b['w'])",
        ),
        (
            lambda v: {"w": 2.0},
            {"w": torch.ones(3)},
            TypeError,
            "Invalid matvec: it returned 'w' as float for A p at iteration 1 (expected a tensor "
            "of shape (3,), like b['w'])",
        ),
        (
            lambda v: v.to(torch.complex128),
            torch.ones(3),
            TypeError,
            "Invalid matvec: it returned dtype torch.complex128 for A p at iteration 1 "
            "(expected a real tensor",
        ),
    ],
    ids=[
        "none",
        "none-dict",
        "shape",
        "tensor-for-dict",
        "dict-for-tensor",
        "keys",
        "extra-key",
        "entry-shape",
        "entry-float",
        "complex",
    ],
)
def test_conjugate_gradient_refuses_a_malformed_product(matvec, b, error, message):
    with pytest.raises(error, match=re.escape(message)):
        conjugate_gradient(matvec, b)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"matvec": 3}, TypeError, "Invalid matvec: int (expected a callable v -> A v"),
        (
            {"b": {}},
            ValueError,
            "Invalid b: an empty dict (expected a tensor or a dict name -> tensor, "
            "floating-point and finite, with at least one entry)",
        ),
        ({"b": {"w": 1.0}}, TypeError, "Invalid b: 'w' is float (expected a tensor or a dict"),
        ({"b": {"w": None}}, TypeError, "Invalid b: 'w' is None (expected a tensor or a dict"),
        (
            {"b": torch.ones(3, dtype=torch.long)},
            TypeError,
            "Invalid b: dtype torch.int64 (expected a tensor or a dict name -> tensor, "
            "floating-point and finite: the solution has b's dtype)",
        ),
        (
            {"b": {"w": torch.ones(3, dtype=torch.complex64)}},
            TypeError,
            "Invalid b: 'w' has dtype torch.complex64 (expected",
        ),
        ({"tol": "1e-6"}, TypeError, "Invalid tol: '1e-6' (expected a finite number >= 0)"),
        ({"tol": True}, TypeError, "Invalid tol: True (expected a finite number >= 0)"),
        ({"tol": -1e-3}, ValueError, "Invalid tol: -0.001 (expected a finite number >= 0)"),
        ({"tol": math.inf}, ValueError, "Invalid tol: inf (expected a finite number >= 0)"),
        ({"maxiter": math.nan}, TypeError, "Invalid maxiter: nan (expected an integer >= 1)"),
        ({"maxiter": True}, TypeError, "Invalid maxiter: True (expected an integer >= 1)"),
    ],
    ids=[
        "matvec",
        "empty",
        "float",
        "none",
        "int",
        "complex",
        "tol-str",
        "tol-bool",
        "tol-negative",
        "tol-inf",
        "maxiter-nan",
        "maxiter-bool",
    ],
)
def test_conjugate_gradient_argument_errors(kwargs, error, message):
    arguments = {"matvec": lambda v: v, "b": torch.ones(3), **kwargs}
    matvec, b = arguments.pop("matvec"), arguments.pop("b")
    with pytest.raises(error, match=re.escape(message)):
        conjugate_gradient(matvec, b, **arguments)


@pytest.mark.parametrize(
    ("dtype", "scale"),
    [
        (torch.float32, 1e25),  # |b|^2 overflowed to inf: "inf <= inf" stopped at x = 0
        (torch.float32, 1e-25),  # |b|^2 underflowed to 0: stopped at x = 0
        (torch.float64, 1e200),
        (torch.float64, 1e-200),
    ],
)
def test_conjugate_gradient_at_extreme_scales_of_b(dtype, scale):
    a = spd(dtype=dtype)
    unit = torch.randn(6, generator=torch.Generator().manual_seed(10), dtype=dtype)
    b = unit * scale
    expected = torch.linalg.solve(a.double(), unit.double()) * scale
    got = conjugate_gradient(lambda v: a @ v, b, tol=0.0)
    assert got.dtype == dtype
    tolerance = 1e-4 if dtype == torch.float32 else 1e-10
    assert float(((got.double() - expected) / expected.abs().max()).abs().max()) < tolerance
    as_dict = conjugate_gradient(lambda v: {"w": a @ v["w"]}, {"w": b}, tol=0.0)
    assert torch.equal(as_dict["w"], got)


@given(st.integers(min_value=-1000, max_value=1000))
def test_conjugate_gradient_is_exactly_scale_equivariant(k):
    """Scaling b by 2^k scales x by 2^k bit for bit, for every k that float64 represents."""
    a = spd(dtype=torch.float64)
    b = torch.randn(6, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    base = conjugate_gradient(lambda v: a @ v, b, tol=1e-10)
    factor = 2.0**k
    scaled = conjugate_gradient(lambda v: a @ v, b * factor, tol=1e-10)
    assert torch.equal(scaled, base * factor)


def test_conjugate_gradient_breakdowns_are_refused():
    f32 = torch.float32
    b = torch.ones(3, dtype=f32)
    # A so small (subnormal) that the step 1 / A overflows float32
    with pytest.raises(
        ValueError,
        match=re.escape(
            "Invalid matvec: conjugate gradient broke down at iteration 1: the step "
            "r^T r / p^T A p = inf is not finite in torch.float32"
        ),
    ):
        conjugate_gradient(lambda v: 1e-39 * v, b)
    # p^T A p overflows although A p is finite
    with pytest.raises(
        ValueError,
        match=re.escape(
            "Invalid matvec: conjugate gradient broke down at iteration 1: p^T A p = inf is not "
            "finite in torch.float32"
        ),
    ):
        conjugate_gradient(lambda v: torch.full_like(v, 3e38), b)
    # every step finite, but the solution A^{-1} b = 1e40 is not a float32
    with pytest.raises(
        ValueError,
        match=re.escape(
            "Invalid matvec: the solution x of A x = b overflows b's dtype (inf) (expected"
        ),
    ):
        conjugate_gradient(lambda v: 1e-30 * v, 1e10 * b)
    # not positive definite: zero curvature
    with pytest.raises(
        ValueError,
        match=re.escape("Invalid matvec: p^T A p / p^T p = 0 <= 0 for the search direction p at"),
    ):
        conjugate_gradient(lambda v: 0.0 * v, b)


def test_conjugate_gradient_converts_products_to_b_dtype():
    """A float32 model's product on a float64 b (torch.dot refused the mix)."""
    a = spd()
    b = torch.randn(6, generator=torch.Generator().manual_seed(12))
    got = conjugate_gradient(lambda v: (a @ v).float(), b, tol=0.0)
    assert got.dtype == torch.float64
    assert_close(got, torch.linalg.solve(a, b), rtol=1e-5)


@pytest.mark.parametrize("product", [ggn_vector_product, fisher_vector_product])
def test_products_refuse_malformed_v(product):
    model = mlp()
    x, y = batch("classification")
    floats = {n: 1.0 for n, _ in model.named_parameters()}
    with pytest.raises(
        TypeError,
        match=re.escape(
            "Invalid v: '0.weight' is float (expected a tensor of shape (5, 4), like the "
            "parameter: numbers are not broadcast)"
        ),
    ):
        product(model, x, y, floats)
    with pytest.raises(TypeError, match=re.escape("Invalid v: '0.weight' is None (expected")):
        product(model, x, y, dict.fromkeys(floats))
    with pytest.raises(
        TypeError,
        match=re.escape(
            "Invalid v: dtype torch.complex128 (expected a real tensor: it is converted to the "
            "parameters' dtype)"
        ),
    ):
        product(model, x, y, torch.zeros(73, dtype=torch.complex128))
    flags = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    flags["4.bias"] = torch.zeros(3, dtype=torch.bool)
    with pytest.raises(TypeError, match=re.escape("Invalid v: '4.bias' has dtype torch.bool")):
        product(model, x, y, flags)
    with pytest.raises(
        ValueError, match=re.escape("Invalid v: non-finite values (nan) (expected finite")
    ):
        product(model, x, y, torch.full((73,), math.nan))
    v = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    v["2.bias"][1] = -math.inf
    with pytest.raises(
        ValueError,
        match=re.escape("Invalid v: '2.bias' has non-finite values (inf) (expected finite"),
    ):
        product(model, x, y, v)
    # integer tensors are numbers of the right shape: converted, as before
    ints = product(model, x, y, torch.zeros(73, dtype=torch.long))
    assert ints.dtype == torch.float64 and not ints.any()


@pytest.mark.parametrize("product", [ggn_vector_product, fisher_vector_product])
@pytest.mark.parametrize(
    ("likelihood", "targets", "error", "message"),
    [
        (
            "classification",
            torch.tensor([0, 1, 2]),  # the GGN ignored it: a batch of 11 passed silently
            ValueError,
            "Invalid targets: class indices of shape (3,) (expected class indices of shape "
            "(11,) in [0, 3) or class probabilities of shape (11, 3), for the model output of "
            "shape (11, 3))",
        ),
        (
            "classification",
            torch.full((11,), 3),
            ValueError,
            "Invalid targets: class indices outside [0, 3) (expected",
        ),
        (
            "classification",
            torch.full((11,), -100),  # cross_entropy's ignore_index: the GGN kept them
            ValueError,
            "Invalid targets: class indices outside [0, 3) (expected",
        ),
        (
            "classification",
            torch.rand(11),
            ValueError,
            "Invalid targets: probabilities of shape (11,) (expected class indices",
        ),
        (
            "classification",
            torch.full((11, 3), math.nan),
            ValueError,
            "Invalid targets: non-finite values (nan) (expected finite numbers)",
        ),
        ("classification", [0] * 11, TypeError, "Invalid targets: list (expected class indices"),
        (
            "classification",
            torch.zeros(11, dtype=torch.bool),
            TypeError,
            "Invalid targets: dtype torch.bool (expected class indices",
        ),
        (
            "regression",
            torch.full((11, 3), math.inf),
            ValueError,
            "Invalid targets: non-finite values (inf) (expected finite numbers)",
        ),
        (
            "regression",
            [[0.0] * 3] * 11,
            TypeError,
            "Invalid targets: list (expected a real tensor of the model output's shape (11, 3) "
            "for likelihood='regression')",
        ),
    ],
    ids=[
        "batch",
        "range",
        "ignore-index",
        "probs-shape",
        "probs-nan",
        "list",
        "bool",
        "reg-inf",
        "reg-list",
    ],
)
def test_products_check_targets(product, likelihood, targets, error, message):
    model = mlp()
    x, _ = batch("classification")
    v = torch.randn(73, generator=torch.Generator().manual_seed(13))
    with pytest.raises(error, match=re.escape(message)):
        product(model, x, targets, v, likelihood)


@pytest.mark.parametrize("product", [ggn_vector_product, fisher_vector_product])
def test_products_refuse_a_nonfinite_result_naming_its_cause(product):
    name = product.__name__
    x, y = batch("regression")
    v = torch.randn(73, generator=torch.Generator().manual_seed(14))
    model = mlp()
    with torch.no_grad():
        model[2].weight[0, 0] = math.nan
    with pytest.raises(
        ValueError,
        match=re.escape(
            "Invalid model: parameter '2.weight' has non-finite values (nan) (expected finite "
            f"parameters and buffers: {name} linearizes the model at them)"
        ),
    ):
        product(model, x, y, v, "regression")
    normed = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)).eval()
    normed[1].running_mean[1] = math.nan
    with pytest.raises(
        ValueError, match=re.escape("Invalid model: buffer '1.running_mean' has non-finite")
    ):
        product(normed, x, y, torch.ones(21), "regression")
    bad_x = x.clone()
    bad_x[3, 1] = math.nan
    with pytest.raises(
        ValueError, match=re.escape("Invalid inputs: non-finite values (nan) (expected finite")
    ):
        product(mlp(), bad_x, y, v, "regression")
    # everything finite, but J^T J v ~ |x|^2 overflows float32
    linear = nn.Linear(4, 3).float()
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"Non-finite {name}: the product has inf values although v, the model's parameters "
            "and buffers, the inputs and the targets are finite (the model output, its "
            "derivatives or the likelihood's curvature overflow torch.float32"
        ),
    ):
        product(
            linear,
            torch.full((2, 4), 1e25, dtype=torch.float32),
            torch.zeros(2, 3, dtype=torch.float32),
            torch.ones(15, dtype=torch.float32),
            "regression",
        )


def test_products_refuse_a_0_dim_output():
    class Total(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(4, 1)

        def forward(self, x):
            return self.layer(x).sum()

    x, _ = batch("regression")
    with pytest.raises(
        ValueError,
        match=re.escape(
            "Invalid model output: a 0-dim tensor (expected a tensor with the batch as its "
            "first dimension)"
        ),
    ):
        ggn_vector_product(Total(), x, torch.tensor(0.0), torch.ones(5), "regression")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_conjugate_gradient_in_half_precision(dtype):
    """r^T r of 70000 unit entries overflowed float16 (stopped at x = 0): float32 sums now."""
    gen = torch.Generator().manual_seed(15)
    n = 70_000
    diagonal = 1.0 + torch.rand(n, generator=gen, dtype=torch.float32)
    b = torch.ones(n, dtype=torch.float32)
    x = conjugate_gradient(lambda v: diagonal.to(dtype) * v, b.to(dtype), tol=1e-2, maxiter=30)
    assert x.dtype == dtype
    expected = b / diagonal
    assert float((x.float() - expected).norm() / expected.norm()) < 2e-2
