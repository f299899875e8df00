"""Extended Kalman filter: exact on linear-Gaussian models, and posteriors' diagonal EKF.

A model linear in its weights with a Gaussian likelihood makes the EKF the Kalman
filter, so after one pass in minibatches the state is the conjugate posterior of
Bayesian linear regression with prior N(theta_0, Lambda_0^{-1}):
Lambda = Lambda_0 + Phi^T Phi / s^2, mean = Lambda^{-1} (Lambda_0 theta_0 + Phi^T y / s^2)
(Phi = [x, 1], weight entries first, then the bias). float64, 1e-8 relative.
"""

import math
import re
import warnings

import pytest
import torch
from torch import nn

from samplers_as_optim import ExtendedKalmanFilter
from samplers_as_optim.samples.stacked import call_stacked

pytestmark = pytest.mark.usefixtures("float64_default")
NOISE, PRIOR = 0.5, 2.0


def assert_close(a, b, rtol=1e-8):
    scale = max(float(b.abs().max()), 1e-300)
    assert float((a - b).abs().max()) <= rtol * scale, float((a - b).abs().max()) / scale


def blr_data(n=40, d=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=gen)
    y = x @ torch.linspace(-1.0, 1.0, d) + 0.3 + NOISE * torch.randn(n, generator=gen)
    return x, y.unsqueeze(-1)


def flat(params):
    return torch.cat([params["weight"].reshape(-1), params["bias"].reshape(-1)])


def batches(x, y, size):
    return [(x[i : i + size], y[i : i + size]) for i in range(0, x.shape[0], size)]


@pytest.mark.parametrize("batch_size", [1, 7, 40])
def test_dense_filter_is_the_conjugate_posterior(batch_size):
    x, y = blr_data()
    torch.manual_seed(1)
    model = nn.Linear(3, 1)  # random weights: the prior mean theta_0
    theta0 = flat(dict(model.named_parameters())).detach().clone()
    ekf = ExtendedKalmanFilter(
        model, likelihood="regression", noise_std=NOISE, structure="dense", prior_precision=PRIOR
    )
    for batch in batches(x, y, batch_size):
        ekf.update(batch)
    phi = torch.cat([x, torch.ones(40, 1)], 1)
    precision = PRIOR * torch.eye(4) + phi.T @ phi / NOISE**2
    mean = torch.linalg.solve(precision, PRIOR * theta0 + phi.T @ y.squeeze(-1) / NOISE**2)
    assert_close(ekf.precision, precision)
    assert_close(flat(ekf.mean), mean)
    assert_close(ekf.covariance, torch.linalg.inv(precision))
    assert torch.equal(flat(dict(model.named_parameters())).detach(), flat(ekf.mean))
    assert ekf.steps == math.ceil(40 / batch_size)


def test_dense_prior_matrix_and_continuation():
    """Two data sets in sequence = one posterior; a dense prior matrix is taken as given."""
    (x1, y1), (x2, y2) = blr_data(seed=1), blr_data(n=25, seed=2)
    model = nn.Linear(3, 1)
    nn.init.zeros_(model.weight), nn.init.zeros_(model.bias)
    gen = torch.Generator().manual_seed(3)
    m = torch.randn(4, 4, generator=gen)
    prior = m @ m.T + torch.eye(4)
    ekf = ExtendedKalmanFilter(
        model, likelihood="regression", noise_std=NOISE, structure="dense", prior_precision=prior
    )
    for batch in batches(x1, y1, 10) + batches(x2, y2, 6):
        ekf.update(batch)
    phi = torch.cat([torch.cat([x1, x2]), torch.ones(65, 1)], 1)
    y = torch.cat([y1, y2]).squeeze(-1)
    precision = prior + phi.T @ phi / NOISE**2
    assert_close(ekf.precision, precision)
    assert_close(flat(ekf.mean), torch.linalg.solve(precision, phi.T @ y / NOISE**2))


def test_diagonal_filter_is_exact_for_orthogonal_features():
    """One-hot inputs, no bias: every batch's curvature is diagonal, so is the posterior."""
    gen = torch.Generator().manual_seed(4)
    index = torch.randint(0, 5, (30,), generator=gen)
    x = torch.nn.functional.one_hot(index, 5).double()
    y = (index.double() * 0.3 - 0.5 + NOISE * torch.randn(30, generator=gen)).unsqueeze(-1)
    model = nn.Linear(5, 1, bias=False)
    nn.init.zeros_(model.weight)
    ekf = ExtendedKalmanFilter(
        model, likelihood="regression", noise_std=NOISE, prior_precision=PRIOR
    )
    for batch in batches(x, y, 4):
        ekf.update(batch)
    counts = x.sum(0)
    precision = PRIOR + counts / NOISE**2
    mean = (x.T @ y.squeeze(-1) / NOISE**2) / precision
    assert_close(ekf.precision["weight"].reshape(-1), precision)
    assert_close(ekf.mean["weight"].reshape(-1), mean)
    assert_close(ekf.covariance["weight"].reshape(-1), 1 / precision)


def test_decay_is_exponentially_weighted_least_squares():
    """Lambda_t = g Lambda_{t-1} + Phi_t^T Phi_t / s^2: after T batches the state is the
    posterior with batch t weighted by g^(T-t) and the prior by g^T."""
    x, y = blr_data(n=30)
    model = nn.Linear(3, 1)
    theta0 = flat(dict(model.named_parameters())).detach().clone()
    gamma = 0.8
    ekf = ExtendedKalmanFilter(
        model,
        likelihood="regression",
        noise_std=NOISE,
        structure="dense",
        prior_precision=PRIOR,
        decay=gamma,
    )
    parts = batches(x, y, 10)
    for batch in parts:
        ekf.update(batch)
    steps = len(parts)
    precision = gamma**steps * PRIOR * torch.eye(4)
    info = gamma**steps * PRIOR * theta0
    for t, (xb, yb) in enumerate(parts, start=1):
        phi = torch.cat([xb, torch.ones(xb.shape[0], 1)], 1)
        precision = precision + gamma ** (steps - t) * phi.T @ phi / NOISE**2
        info = info + gamma ** (steps - t) * phi.T @ yb.squeeze(-1) / NOISE**2
    assert_close(ekf.precision, precision)
    assert_close(flat(ekf.mean), torch.linalg.solve(precision, info))


def test_diagonal_empirical_fisher_matches_posteriors():
    """Nonlinear classifier: our diag EF filter equals posteriors.ekf.diag_fisher with
    lr = batch size (it averages over the batch) and no transition noise."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        diag_fisher = pytest.importorskip("posteriors.ekf.diag_fisher")
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    gen = torch.Generator().manual_seed(6)
    x, y = torch.randn(24, 4, generator=gen), torch.randint(0, 3, (24,), generator=gen)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}

    def log_lik(p, batch):
        logits = torch.func.functional_call(model, p, (batch[0],))
        return -torch.nn.functional.cross_entropy(logits, batch[1], reduction="none"), logits

    transform = diag_fisher.build(log_lik, lr=8.0, per_sample=True, init_sds=PRIOR**-0.5)
    state = transform.init(params)
    ekf = ExtendedKalmanFilter(
        model, likelihood="classification", curvature="ef", prior_precision=PRIOR
    )
    for batch in batches(x, y, 8):
        state, _ = transform.update(state, batch)
        ekf.update(batch)
    for name in params:
        assert_close(ekf.mean[name], state.params[name], rtol=1e-10)
        assert_close(ekf.precision[name], state.sd_diag[name] ** -2, rtol=1e-10)


def test_filter_state_not_the_model_drives_updates_and_sampling():
    x, y = blr_data()
    model = nn.Linear(3, 1)
    ekf = ExtendedKalmanFilter(
        model, likelihood="regression", noise_std=NOISE, structure="dense", temperature=0.5
    )
    ekf.update((x[:20], y[:20]))
    with torch.no_grad():
        model.weight.add_(10.0)  # the user meddles; the filter's state is authoritative
    ekf.update((x[20:], y[20:]))
    assert torch.equal(model.weight.detach(), ekf.mean["weight"])
    phi = torch.cat([x, torch.ones(40, 1)], 1)
    precision = torch.eye(4) + phi.T @ phi / NOISE**2  # prior mean: the initial weights
    assert_close(ekf.precision, precision)
    draws = ekf.sample(3, generator=torch.Generator().manual_seed(0))
    assert draws["weight"].shape == (3, 1, 3)
    assert_close(ekf.covariance, 0.5 * torch.linalg.inv(ekf.precision))
    out = ekf.predict(
        x[:4], num_samples=3, linear=False, generator=torch.Generator().manual_seed(0)
    )
    assert_close(out, call_stacked(model, draws, x[:4]))
    lin = ekf.predict(x[:4], num_samples=3, linear=True, generator=torch.Generator().manual_seed(0))
    assert_close(lin, out)  # linear model: linearised = sampled
    assert torch.isfinite(ekf.log_prob(draws)).all()


def test_update_returns_the_prequential_nll_and_restores_mode():
    x, y = blr_data()
    model = nn.Sequential(nn.Linear(3, 1), nn.Dropout(0.5))
    model.train()
    ekf = ExtendedKalmanFilter(model, likelihood="regression", noise_std=NOISE)
    loss = ekf.update((x[:10], y[:10]))
    with torch.no_grad():
        model.eval()
        expected = (0.5 * (model(x[10:20]) - y[10:20]) ** 2 / NOISE**2).sum() + 10 * math.log(
            2 * math.pi * NOISE**2
        ) / 2
        model.train()
    assert loss.shape == ()
    assert_close(ekf.update((x[10:20], y[10:20])), expected, rtol=1e-12)
    assert model.training


ERRORS = [
    ({"decay": 0.0}, ValueError, "Invalid decay: 0.0 (expected None or a number in (0, 1])"),
    ({"decay": 1.5}, ValueError, "Invalid decay: 1.5 (expected None or a number in (0, 1])"),
    ({"decay": math.nan}, ValueError, "Invalid decay: nan (expected None or a number in (0, 1])"),
    ({"decay": "0.9"}, TypeError, "Invalid decay: '0.9' (expected None or a number in (0, 1])"),
    (
        {"structure": "kron"},
        ValueError,
        "Invalid structure: 'kron' (expected one of 'diag', 'dense')",
    ),
    ({"curvature": "hessian"}, ValueError, "Invalid curvature: 'hessian' (expected one of"),
    (
        {"temperature": -1.0},
        ValueError,
        "Invalid temperature: -1.0 (expected a finite number >= 0)",
    ),
    ({"prior_precision": 0.0}, ValueError, "Invalid prior_precision: 0.0 (expected a finite"),
]


@pytest.mark.parametrize(("kwargs", "error", "message"), ERRORS)
def test_errors(kwargs, error, message):
    with pytest.raises(error, match=re.escape(message)):
        ExtendedKalmanFilter(nn.Linear(2, 1), likelihood="regression", **kwargs)


def test_batch_error():
    ekf = ExtendedKalmanFilter(nn.Linear(2, 1), likelihood="regression")
    with pytest.raises(TypeError, match=re.escape("Invalid batch: Tensor (expected a pair")):
        ekf.update(torch.zeros(3, 2))


def test_singular_dense_precision_is_refused():
    ekf = ExtendedKalmanFilter(
        nn.Linear(10, 1), likelihood="regression", structure="dense", prior_precision=1e-300
    )
    with pytest.raises(
        ValueError,
        match=re.escape("Invalid precision: the filtered dense precision is not positive definite"),
    ):
        ekf.update((torch.randn(2, 10), torch.randn(2, 1)))


# --------------------------------------------------------------- refused (non-finite) updates
HUGE = {torch.float32: 1e20, torch.float64: 1e200}  # finite, but its square overflows
NON_FINITE = "Invalid batch: {part} contain a non-finite value ({kind}) at update 2 (expected "
NON_FINITE += "finite inputs and targets; the filter and the model were left unchanged)"
OVERFLOW = "Invalid batch: its update is non-finite in {dtype} ({what}: "
BAD_BATCHES = {
    # name: (which of x / y, the value put in, the start of the message)
    "y_inf": ("y", math.inf, re.escape(NON_FINITE.format(part="targets", kind="inf"))),
    "y_neg_inf": ("y", -math.inf, re.escape(NON_FINITE.format(part="targets", kind="-inf"))),
    "y_nan": ("y", math.nan, re.escape(NON_FINITE.format(part="targets", kind="nan"))),
    "x_nan": ("x", math.nan, re.escape(NON_FINITE.format(part="inputs", kind="nan"))),
    "x_inf": ("x", math.inf, re.escape(NON_FINITE.format(part="inputs", kind="inf"))),
    "x_neg_inf": ("x", -math.inf, re.escape(NON_FINITE.format(part="inputs", kind="-inf"))),
    "x_huge": ("x", "huge", "new precision"),
    "y_huge": ("y", "huge", "negative log-likelihood"),
}


def make_filter(structure, dtype=torch.float64):
    torch.manual_seed(7)
    model = nn.Linear(3, 2).to(dtype)
    ekf = ExtendedKalmanFilter(
        model, likelihood="regression", noise_std=NOISE, structure=structure, prior_precision=PRIOR
    )
    return model, ekf


def snapshot(ekf):
    """Copies of every piece of the filter's own state (tensors, dicts of tensors, scalars)."""
    state = {}
    for key, value in vars(ekf).items():
        if isinstance(value, torch.Tensor):
            state[key] = value.clone()
        elif isinstance(value, dict) and all(isinstance(v, torch.Tensor) for v in value.values()):
            state[key] = {name: tensor.clone() for name, tensor in value.items()}
        elif isinstance(value, (int, float, str, type(None))):
            state[key] = value
    assert {"_mean", "_precision", "_cholesky", "steps"} <= state.keys()
    return state


def assert_same(state, other):
    assert state.keys() == other.keys()
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, other[key]), key
        elif isinstance(value, dict):
            assert value.keys() == other[key].keys(), key
            assert all(torch.equal(value[n], other[key][n]) for n in value), key
        else:
            assert value == other[key], key


def weights(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def assert_same_weights(model, expected):
    now = dict(model.named_parameters())
    assert now.keys() == expected.keys()
    assert all(torch.equal(now[name].detach(), expected[name]) for name in expected)


def spoil(x, y, bad, dtype):
    which, value, _ = BAD_BATCHES[bad]
    x, y = x.clone(), y.clone()
    (x if which == "x" else y)[1, 0] = HUGE[dtype] if value == "huge" else value
    return x, y


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("bad", list(BAD_BATCHES))
@pytest.mark.parametrize("structure", ["diag", "dense"])
def test_non_finite_update_is_refused_and_changes_nothing(structure, bad, dtype):
    x, y = blr_data(n=12)
    x, y = x.to(dtype), torch.cat([y, -y], 1).to(dtype)
    model, ekf = make_filter(structure, dtype)
    reference_model, reference = make_filter(structure, dtype)  # never sees the bad batch
    ekf.update((x[:6], y[:6]))
    reference.update((x[:6], y[:6]))
    state, params = snapshot(ekf), weights(model)
    message = BAD_BATCHES[bad][2]
    if message in ("new precision", "negative log-likelihood"):
        message = re.escape(OVERFLOW.format(dtype=dtype, what=message)) + r"(inf|nan)\) at update 2"
    with pytest.raises(ValueError, match=message):
        ekf.update(spoil(x[6:], y[6:], bad, dtype))
    assert ekf.steps == 1
    assert_same(snapshot(ekf), state)
    assert_same_weights(model, params)
    # The next good update is exactly the one the untouched filter makes.
    loss = ekf.update((x[6:], y[6:]))
    assert torch.equal(loss, reference.update((x[6:], y[6:])))
    assert ekf.steps == 2
    assert_same(snapshot(ekf), snapshot(reference))
    assert_same_weights(model, weights(reference_model))
    assert torch.isfinite(flat(ekf.mean)).all()


@pytest.mark.parametrize("bad", ["x_nan", "y_inf", "x_huge"])
@pytest.mark.parametrize("structure", ["diag", "dense"])
def test_refused_update_puts_back_weights_the_user_changed(structure, bad):
    """update() writes the mean into the model to take the curvature; refused, it must put
    back what the model held, not leave the filter's mean there."""
    x, y = blr_data(n=12)
    x, y = x.float(), torch.cat([y, -y], 1).float()
    model, ekf = make_filter(structure, torch.float32)
    ekf.update((x[:6], y[:6]))
    with torch.no_grad():
        model.weight.add_(10.0)
    state, params = snapshot(ekf), weights(model)
    with pytest.raises(ValueError, match=re.escape("Invalid batch: ")):
        ekf.update(spoil(x[6:], y[6:], bad, torch.float32))
    assert_same(snapshot(ekf), state)
    assert_same_weights(model, params)


class Broken(nn.Linear):
    """A model whose forward raises once ``broken`` is set."""

    broken = False

    def forward(self, x):
        if self.broken:
            raise RuntimeError("Broken: refused")
        return super().forward(x)


@pytest.mark.parametrize("structure", ["diag", "dense"])
def test_error_inside_the_update_changes_nothing(structure):
    x, y = blr_data(n=12)
    torch.manual_seed(7)
    model = Broken(3, 1)
    ekf = ExtendedKalmanFilter(model, likelihood="regression", structure=structure)
    ekf.update((x[:6], y[:6]))
    with torch.no_grad():
        model.bias.add_(1.0)
    state, params = snapshot(ekf), weights(model)
    model.broken = True
    with pytest.raises(RuntimeError, match="Broken: refused"):  # propagated as it is
        ekf.update((x[6:], y[6:]))
    assert_same(snapshot(ekf), state)
    assert_same_weights(model, params)
    # On a non-finite batch, an error the model raises is reported as the batch's fault.
    with pytest.raises(ValueError, match=re.escape("Invalid batch: inputs contain a non-finite")):
        ekf.update(spoil(x[6:], y[6:], "x_inf", torch.float64))
    assert_same(snapshot(ekf), state)
    assert_same_weights(model, params)
    model.broken = False
    ekf.update((x[6:], y[6:]))
    assert ekf.steps == 2
