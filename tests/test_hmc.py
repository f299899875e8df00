"""HMC: leapfrog exactness, invariance at T in {0.5, 1, 2}, adaptation, ensembles, resume.

Statistical checks run many independent chains at once (parameters of shape [K, d], one
loss per chain, as a ParallelEnsemble's closure returns them) started from exact draws of
the target. A kernel that leaves the target invariant keeps the K final states exact,
independent draws, so the Monte Carlo error of every moment is that of K i.i.d. samples:
no autocorrelation to estimate and no step-size bias to allow for. Each moment becomes a
z-score (its error over its standard error, the standard error estimated from the K
products themselves); the test asserts max |z| < Z_MAX. With Z_MAX = 4.5 a correct kernel
fails one statistic with probability 7e-6, so < 1e-3 over all of them; the same check
must fail with a deliberately wrong acceptance formula (monkeypatched).
"""

from __future__ import annotations

import copy
import itertools
import math
import pickle

import pytest
import torch
from torch import Tensor

import samplers_as_optim.hmc.dynamics as hmc_dynamics
from samplers_as_optim import HMC, ParallelEnsemble
from samplers_as_optim.core.streams import NoiseStream
from samplers_as_optim.hmc.dynamics import kinetic_energy, leapfrog_

Z_MAX = 4.5
DIM = 10


def correlated_covariance() -> Tensor:
    """A 10-D covariance with correlations up to ~0.9 and variances from 0.1 to 2.4."""
    generator = torch.Generator().manual_seed(3)
    a = torch.randn(DIM, DIM, generator=generator, dtype=torch.float64)
    q, _ = torch.linalg.qr(a)
    eigenvalues = torch.logspace(-1.0, math.log10(3.0), DIM, dtype=torch.float64)
    return q @ torch.diag(eigenvalues) @ q.T


# ---------------------------------------------------------------- targets (N = 1)
class Gaussian:
    """U(x) = x^T P x / 2 with P = inverse covariance; at temperature T: N(0, T Sigma)."""

    def __init__(self) -> None:
        self.cov = correlated_covariance()
        self.precision = torch.linalg.inv(self.cov)

    def loss(self, x: Tensor) -> Tensor:
        return 0.5 * ((x @ self.precision) * x).sum(-1)

    def exact(self, k: int, temperature: float, generator: torch.Generator) -> Tensor:
        chol = torch.linalg.cholesky(self.cov * temperature)
        return torch.randn(k, DIM, generator=generator, dtype=torch.float64) @ chol.T

    def moments(self, temperature: float) -> tuple[Tensor, Tensor]:
        return torch.zeros(DIM, dtype=torch.float64), self.cov * temperature


class Banana:
    """U = x1^2 / (2 a^2) + (x2 - b (x1^2 - a^2))^2 / 2: x1 ~ N(0, T a^2), x2 | x1 ~ N(., T)."""

    a, b = 1.0, 1.0

    def loss(self, x: Tensor) -> Tensor:
        x1, x2 = x[..., 0], x[..., 1]
        return x1**2 / (2 * self.a**2) + (x2 - self.b * (x1**2 - self.a**2)) ** 2 / 2

    def exact(self, k: int, temperature: float, generator: torch.Generator) -> Tensor:
        z = torch.randn(k, 2, generator=generator, dtype=torch.float64) * math.sqrt(temperature)
        x1 = self.a * z[:, 0]
        return torch.stack([x1, self.b * (x1**2 - self.a**2) + z[:, 1]], dim=1)

    def moments(self, temperature: float) -> tuple[Tensor, Tensor]:
        a, b, t = self.a, self.b, temperature
        mean = torch.tensor([0.0, b * a**2 * (t - 1)], dtype=torch.float64)
        cov = torch.diag(torch.tensor([t * a**2, t + 2 * b**2 * t**2 * a**4]))
        return mean, cov.to(torch.float64)


def z_scores(samples: Tensor, mean: Tensor, cov: Tensor) -> Tensor:
    """z of each sample mean and of each centred second moment (about the true mean)."""
    k = samples.shape[0]
    centred = samples - mean
    z_mean = centred.mean(0) / (centred.std(0) / math.sqrt(k))
    rows, cols = torch.triu_indices(cov.shape[0], cov.shape[0])
    products = centred[:, rows] * centred[:, cols]
    z_cov = (products.mean(0) - cov[rows, cols]) / (products.std(0) / math.sqrt(k))
    return torch.cat([z_mean, z_cov])


def run_chains(
    target,
    temperature: float,
    *,
    k: int,
    steps: int,
    lr: float,
    num_steps: int,
    path: str = "closure",
    **options,
) -> Tensor:
    """K chains from exact draws, ``steps`` transitions; the K final states.

    ``path``: ``"closure"`` (``step(closure)``) or ``"loss_fn"`` (``step(loss_fn=...)``).
    """
    generator = torch.Generator().manual_seed(1234)
    x = torch.nn.Parameter(target.exact(k, temperature, generator))
    opt = HMC(
        [x], lr=lr, num_steps=num_steps, num_data=1, temperature=temperature, seed=7, **options
    )

    def closure() -> Tensor:
        opt.zero_grad()
        losses = target.loss(x)
        losses.sum().backward()
        return losses

    for _ in range(steps):
        if path == "closure":
            opt.step(closure)
        else:
            opt.step(loss_fn=lambda params: target.loss(params[0]))
    return x.detach().clone()


# Step sizes large enough that a kernel without a correct test is visibly biased: on the
# Gaussian the stiffest direction has eps * omega = 1.7 (leapfrog is stable below 2).
GAUSSIAN_RUN = {"k": 10_000, "steps": 8, "lr": 0.1 * 1.7**2, "num_steps": 4}
BANANA_RUN = {"k": 10_000, "steps": 8, "lr": 0.5, "num_steps": 4}


def passes(samples: Tensor, target, temperature: float) -> bool:
    """The check: finite draws whose moments are all within Z_MAX standard errors."""
    z = z_scores(samples, *target.moments(temperature))
    return bool(torch.isfinite(samples).all()) and float(z.abs().max()) < Z_MAX


TARGETS = {"gaussian": (Gaussian, GAUSSIAN_RUN), "banana": (Banana, BANANA_RUN)}


@pytest.mark.slow
@pytest.mark.parametrize("path", ["closure", "loss_fn"])
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("name", ["gaussian", "banana"])
def test_invariance(name: str, temperature: float, path: str) -> None:
    """Exact draws stay exact draws: mean and covariance within Monte Carlo error."""
    make, run = TARGETS[name]
    target = make()
    samples = run_chains(target, temperature, **run, jitter=0.2, path=path)
    assert passes(samples, target, temperature), z_scores(samples, *target.moments(temperature))


def _always_accept(energy_change: Tensor, temperature: float) -> Tensor:
    return torch.zeros_like(energy_change)


def _forgets_temperature(energy_change: Tensor, temperature: float) -> Tensor:
    return torch.nan_to_num(torch.clamp(-energy_change, max=0.0), nan=-math.inf)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "wrong", "temperature"),
    [
        *[(name, _always_accept, t) for name in ("gaussian", "banana") for t in (0.5, 1.0, 2.0)],
        ("gaussian", _forgets_temperature, 0.5),
        ("gaussian", _forgets_temperature, 2.0),
        ("banana", _forgets_temperature, 0.5),
    ],
)
@pytest.mark.parametrize("path", ["closure", "loss_fn"])
def test_wrong_acceptance_fails_the_same_check(monkeypatch, name, wrong, temperature, path) -> None:
    """The invariance check has power: a wrong Metropolis formula fails it.

    Always accepting (no test: the leapfrog's step-size bias, or divergent banana chains)
    fails for every T; forgetting T in the test (min(1, exp(-dH)), right only at T = 1)
    fails where its bias exceeds the check's resolution (measured max |z|: Gaussian 7.5 at
    T = 0.5 and 10 at T = 2, banana 5.7 at T = 0.5; at T = 2 on the banana it is ~1,
    below what 10^4 chains resolve, so that case is not claimed).
    """
    monkeypatch.setattr(hmc_dynamics, "metropolis_log_accept", wrong)
    make, run = TARGETS[name]
    target = make()
    samples = run_chains(target, temperature, **run, jitter=0.2, path=path)
    assert not passes(samples, target, temperature)


# ---------------------------------------------------------------- the leapfrog itself
def _banana_gradient(positions: list[Tensor]):
    banana = Banana()

    def potential_gradient():
        x = positions[0].clone()  # the leapfrog then updates positions[0] in place
        x1, x2 = x[0], x[1]
        d = x2 - banana.b * (x1**2 - banana.a**2)
        grad = torch.stack([x1 / banana.a**2 - 2 * banana.b * x1 * d, d])
        return banana.loss(x), [grad]

    return potential_gradient


def _flow(z: Tensor, eps: float, num_steps: int, inverse_mass: Tensor) -> Tensor:
    theta, r = z[:2].clone(), z[2:].clone()
    gradient = _banana_gradient([theta])
    _, grads = gradient()
    leapfrog_(
        [theta],
        [r],
        grads,
        gradient,
        step_sizes=[eps],
        inverse_mass=[inverse_mass],
        num_steps=num_steps,
    )
    return torch.cat([theta, r])


def test_leapfrog_reversible_and_volume_preserving() -> None:
    """Forward, flip the momentum, forward: back to the start; Jacobian determinant 1."""
    z0 = torch.tensor([0.7, -0.3, 0.4, 1.1], dtype=torch.float64)
    inverse_mass = torch.tensor([0.8, 1.3], dtype=torch.float64)
    z1 = _flow(z0, 0.1, 25, inverse_mass)
    flipped = torch.cat([z1[:2], -z1[2:]])
    back = _flow(flipped, 0.1, 25, inverse_mass)
    assert not torch.allclose(z1, z0, atol=1e-2)
    torch.testing.assert_close(back[:2], z0[:2], atol=1e-12, rtol=0)
    torch.testing.assert_close(-back[2:], z0[2:], atol=1e-12, rtol=0)
    jacobian = torch.autograd.functional.jacobian(lambda z: _flow(z, 0.1, 25, inverse_mass), z0)
    assert abs(float(torch.linalg.det(jacobian)) - 1.0) < 1e-10


def test_energy_error_is_second_order() -> None:
    """Over a fixed trajectory length, halving eps divides the energy error by ~4."""
    target = Gaussian()
    errors = []
    for eps, num_steps in [(0.04, 25), (0.02, 50), (0.01, 100)]:
        theta = torch.linspace(-1, 1, DIM, dtype=torch.float64)
        r = torch.linspace(1, -0.5, DIM, dtype=torch.float64)

        def potential_gradient(theta=theta):
            return target.loss(theta), [target.precision @ theta]

        h0 = target.loss(theta) + kinetic_energy([r], [None], None)
        _, grads = potential_gradient()
        potential, _ = leapfrog_(
            [theta],
            [r],
            grads,
            potential_gradient,
            step_sizes=[eps],
            inverse_mass=[None],
            num_steps=num_steps,
        )
        errors.append(abs(float(potential + kinetic_energy([r], [None], None) - h0)))
    for coarse, fine in itertools.pairwise(errors):
        assert 3.6 < coarse / fine < 4.4, errors


# ---------------------------------------------------------------- the optimizer
def _linear_problem(dtype=torch.float64, k: int | None = None):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(40, 3, generator=generator, dtype=dtype)
    y = (torch.rand(40, generator=generator) < 0.5).to(dtype)
    shape = (3,) if k is None else (k, 3)
    w = torch.nn.Parameter(torch.randn(shape, generator=generator, dtype=dtype) * 0.1)
    b = torch.nn.Parameter(torch.zeros(() if k is None else (k,), dtype=dtype))

    def make_closure(opt):
        def closure():
            opt.zero_grad()
            logits = w @ x.T + (b if k is None else b[:, None])
            losses = torch.nn.functional.binary_cross_entropy_with_logits(
                logits, y.expand_as(logits), reduction="none"
            ).mean(-1)
            losses.sum().backward()
            return losses

        return closure

    return [w, b], make_closure


def test_rejected_step_restores_everything_bit_for_bit() -> None:
    params, make_closure = _linear_problem()
    opt = HMC(params, lr=1e-3, num_steps=5, num_data=40, seed=1)
    closure = make_closure(opt)
    for _ in range(3):
        opt.step(closure)
    before = [p.detach().clone() for p in params]
    grads = [p.grad.clone() for p in params]
    loss_before = closure()
    for group in opt.param_groups:
        group["lr"] = 1e4  # the trajectory explodes: certainly rejected
    loss = opt.step(closure)
    assert not bool(opt.diagnostics["accepted"])
    assert bool(opt.diagnostics["divergent"])
    for p, p0, g0 in zip(params, before, grads, strict=True):
        assert torch.equal(p, p0)
        assert torch.equal(p.grad, g0)
    assert torch.equal(loss, loss_before)


def test_ensemble_members_accept_independently() -> None:
    """One member's divergence changes nothing for the others, bit for bit."""
    k = 6
    runs = []
    for blow_up in (False, True):
        params, make_closure = _linear_problem(k=k)
        with torch.no_grad():
            if blow_up:
                params[0][2] += 20.0  # member 2 starts elsewhere
        opt = HMC(params, lr=10.0, num_steps=5, num_data=40, seed=3)
        closure = make_closure(opt)
        decisions = []
        for _ in range(15):
            opt.step(closure)
            decisions.append(opt.diagnostics["accepted"].clone())
        runs.append((torch.stack(decisions), [p.detach().clone() for p in params]))
    (acc_a, params_a), (acc_b, params_b) = runs
    others = [0, 1, 3, 4, 5]
    assert torch.equal(acc_a[:, others], acc_b[:, others])
    for pa, pb in zip(params_a, params_b, strict=True):
        assert torch.equal(pa[others], pb[others])
    assert not torch.equal(acc_a[:, 2], acc_b[:, 2])  # member 2 went its own way
    assert bool((acc_a.any(1) & ~acc_a.all(1)).any())  # some steps split the members


def test_ensemble_decisions_are_uncorrelated() -> None:
    """Across members, accept indicators agree as often as independent coins would."""
    k, steps = 200, 30
    params, make_closure = _linear_problem(k=k)
    opt = HMC(params, lr=10.0, num_steps=3, num_data=40, seed=5)
    closure = make_closure(opt)
    decisions = []
    for _ in range(steps):
        opt.step(closure)
        decisions.append(opt.diagnostics["accepted"].double())
    d = torch.stack(decisions)  # [steps, K]
    p = d.mean()
    assert 0.2 < float(p) < 0.95
    # per step, the fraction of accepting members is Binomial(K, p) / K if independent
    # (and identically distributed after the first steps): its variance is p (1 - p) / K;
    # the observed variance over 30 steps has a relative sd ~ sqrt(2 / 29) = 0.26, so a
    # factor 2.5 is > 5 sd away; fully shared decisions would give p (1 - p).
    observed = d.mean(1).var()
    assert observed < 2.5 * p * (1 - p) / k


def test_parallel_ensemble_closure() -> None:
    """With a ParallelEnsemble the closure returns [K] losses; one vmapped call per step."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    ensemble = ParallelEnsemble(net, num_members=4, seed=0)
    x, y = torch.randn(30, 4), torch.randint(0, 3, (30,))
    opt = HMC(ensemble.parameters(), lr=0.02, num_steps=3, num_data=30, seed=0, weight_decay=1 / 30)
    calls = []

    def closure():
        opt.zero_grad()
        out = ensemble(x)
        calls.append(1)
        losses = torch.func.vmap(torch.nn.functional.cross_entropy, in_dims=(0, None))(out, y)
        losses.sum().backward()
        return losses

    losses = opt.step(closure)
    assert losses.shape == (4,)
    assert len(calls) == 4  # the start, then one per leapfrog step
    opt.step(closure)
    assert len(calls) == 7  # the start comes from the cache
    assert opt.diagnostics["accept_prob"].shape == (4,)


@pytest.mark.slow
def test_dual_averaging_reaches_target() -> None:
    """After warm-up, the mean acceptance at the frozen step size is target +- 0.05.

    A 100-D Gaussian (variances 0.5 to 2), 32 chains adapting one step size from their
    mean acceptance, 300 warm-up transitions; then 100 transitions: the standard error of
    the mean acceptance over 3200 chain-steps is below 0.01.
    """
    d, k = 100, 32
    variances = torch.linspace(0.5, 2.0, d, dtype=torch.float64)
    for goal in (0.65, 0.85):
        generator = torch.Generator().manual_seed(0)
        x = torch.nn.Parameter(torch.randn(k, d, generator=generator, dtype=torch.float64))
        with torch.no_grad():
            x.mul_(variances.sqrt())
        opt = HMC([x], lr=0.01, num_steps=5, num_data=1, seed=2, target_accept=goal)

        def closure(opt=opt, x=x):
            opt.zero_grad()
            losses = 0.5 * (x * x / variances).sum(-1)
            losses.sum().backward()
            return losses

        opt.warmup(closure, 300)
        assert not opt.warming_up
        total = 0.0
        for _ in range(100):
            opt.step(closure)
            total += float(opt.diagnostics["accept_prob"].mean())
        assert abs(total / 100 - goal) < 0.05, (goal, total / 100)


def test_mass_adaptation_learns_the_scales() -> None:
    """mass='adapt': the inverse mass follows the posterior variances (normalised)."""
    k = 32
    scales = torch.tensor([0.1, 1.0, 10.0], dtype=torch.float64)
    x = torch.nn.Parameter(
        torch.randn(k, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * scales
    )
    opt = HMC([x], lr=1e-3, num_steps=8, num_data=1, seed=0, target_accept=0.8, mass="adapt")

    def closure():
        opt.zero_grad()
        losses = 0.5 * ((x / scales) ** 2).sum(-1)
        losses.sum().backward()
        return losses

    opt.warmup(closure, 200)
    inverse = 1 / opt.state[x]["mass"]
    ratio = (inverse / scales**2).log().mean(0)
    # relative variances 1e-2 : 1 : 1e2 recovered within a factor ~2 (~70 draws per window)
    assert (ratio - ratio.mean()).abs().max() < math.log(2.5), ratio
    total = 0.0
    for _ in range(50):
        opt.step(closure)
        total += float(opt.diagnostics["accept_prob"].mean())
    assert total / 50 > 0.6


def _run(opt, closure, steps):
    return [opt.step(closure).clone() for _ in range(steps)]


def _closure_on(opt, params):
    """The logistic-regression closure of ``_linear_problem`` on given (stacked) params."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(40, 3, generator=generator, dtype=torch.float64)
    y = (torch.rand(40, generator=generator) < 0.5).to(torch.float64)
    w, b = params

    def closure():
        opt.zero_grad()
        logits = w @ x.T + b[:, None]
        losses = torch.nn.functional.binary_cross_entropy_with_logits(
            logits, y.expand_as(logits), reduction="none"
        ).mean(-1)
        losses.sum().backward()
        return losses

    return closure


@pytest.mark.parametrize("how", ["state_dict", "deepcopy", "pickle"])
def test_exact_resume(how) -> None:
    """A saved chain (warm-up, jitter, mass adaptation under way) continues bit for bit."""
    options = {
        "lr": 0.05,
        "num_steps": 4,
        "num_data": 40,
        "jitter": 0.3,
        "target_accept": 0.75,
        "mass": "adapt",
    }
    params, _ = _linear_problem(k=3)
    opt = HMC(params, seed=11, **options)
    _run(opt, _closure_on(opt, params), 6)
    if how == "state_dict":
        saved_state = copy.deepcopy(opt.state_dict())
        saved_params = [p.detach().clone() for p in params]
    elif how == "deepcopy":
        saved = copy.deepcopy((params, opt))
    else:
        saved = pickle.dumps((params, opt))

    def finish(o, ps):
        closure = _closure_on(o, ps)
        out = _run(o, closure, 8)
        o.end_warmup()
        return out + _run(o, closure, 4)

    reference = finish(opt, params)
    if how == "state_dict":
        other_params, _ = _linear_problem(k=3)
        with torch.no_grad():
            for p, value in zip(other_params, saved_params, strict=True):
                p.copy_(value)
        other = HMC(other_params, seed=0, **options)
        other.load_state_dict(saved_state)
    else:
        other_params, other = saved if how == "deepcopy" else pickle.loads(saved)
    resumed = finish(other, other_params)
    assert len(reference) == len(resumed) == 12
    for a, b in zip(reference, resumed, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(params, other_params, strict=True):
        assert torch.equal(a, b)
        assert torch.equal(a.grad, b.grad)


def test_state_dict_holds_diagnostics_and_adaptation() -> None:
    params, make_closure = _linear_problem()
    opt = HMC(params, lr=0.05, num_steps=3, num_data=40, seed=0, target_accept=0.8)
    opt.step(make_closure(opt))
    state = opt.state_dict()["state"]["hmc"]
    assert set(state["diagnostics"]) == {
        "accept_prob",
        "accepted",
        "energy_error",
        "divergent",
        "step_size",
        "num_accepted",
        "divergences",
    }
    assert state["warmup"] and state["dual_averaging"]["count"] == 1
    assert opt.state_dict()["param_groups"][0]["step"] == 1


def test_seed_none_draws_once_from_global_rng() -> None:
    params, _ = _linear_problem()
    torch.manual_seed(5)
    a = HMC(params, lr=0.1, num_steps=2, num_data=40)
    torch.manual_seed(5)
    b = HMC(params, lr=0.1, num_steps=2, num_data=40)
    assert a.seed == b.seed == a.param_groups[0]["seed"]
    torch.manual_seed(5)
    torch.randint(0, 2**63 - 1, (), dtype=torch.int64)
    after_one = torch.rand(())
    torch.manual_seed(5)
    HMC(params, lr=0.1, num_steps=2, num_data=40)
    assert torch.equal(torch.rand(()), after_one)


def test_lr_units_one_leapfrog_step_is_half_an_sgd_step(monkeypatch) -> None:
    """From r = 0, one leapfrog step moves theta by -(lr / 2) grad, whatever N."""
    params, make_closure = _linear_problem()
    monkeypatch.setattr(NoiseStream, "draw", lambda self, like, **kw: torch.zeros_like(like))
    monkeypatch.setattr(hmc_dynamics, "metropolis_log_accept", lambda e, t: torch.zeros_like(e))
    opt = HMC(params, lr=0.3, num_steps=1, num_data=40, seed=0)
    closure = make_closure(opt)
    closure()
    expected = [(p - 0.15 * p.grad).detach() for p in params]
    opt.step(closure)
    for p, e in zip(params, expected, strict=True):
        torch.testing.assert_close(p.detach(), e, rtol=0, atol=1e-15)


def test_mass_tensor_per_parameter() -> None:
    params, make_closure = _linear_problem()
    opt = HMC(
        params,
        lr=0.05,
        num_steps=3,
        num_data=40,
        seed=0,
        mass=[torch.full((3,), 2.0, dtype=torch.float64), torch.tensor(0.5)],
    )
    opt.step(make_closure(opt))
    assert torch.equal(opt.state[params[0]]["mass"], torch.full((3,), 2.0, dtype=torch.float64))


# ---------------------------------------------------------------- errors
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"lr": 0.0}, ValueError, r"Invalid lr: 0.0 \(expected a finite number > 0\)"),
        ({"lr": float("nan")}, ValueError, "Invalid lr: nan"),
        ({"num_steps": 0}, ValueError, r"Invalid num_steps: 0 \(expected an integer >= 1\)"),
        ({"num_steps": 2.5}, TypeError, "Invalid num_steps: 2.5"),
        ({"num_data": 0}, ValueError, "Invalid num_data: 0"),
        (
            {"temperature": 0.0},
            ValueError,
            r"Invalid temperature: 0.0 \(expected a finite number > 0: the Metropolis test",
        ),
        ({"weight_decay": -1.0}, ValueError, "Invalid weight_decay: -1.0"),
        ({"seed": -1}, ValueError, "Invalid seed: -1"),
        ({"jitter": 1.0}, ValueError, r"Invalid jitter: 1.0 \(expected a number in \[0, 1\)\)"),
        ({"jitter": "a"}, TypeError, "Invalid jitter: 'a'"),
        (
            {"target_accept": 1.0},
            ValueError,
            r"Invalid target_accept: 1.0 \(expected a number in \(0, 1\)\)",
        ),
        ({"mass": "diag"}, ValueError, "Invalid mass: 'diag'"),
        ({"mass": 3.0}, TypeError, "Invalid mass: 3.0"),
        (
            {"mass": [torch.ones(3)]},
            ValueError,
            r"Invalid mass: 1 tensors \(expected one per parameter, 2\)",
        ),
        ({"mass": [torch.ones(4), torch.ones(())]}, ValueError, r"Invalid mass\[0\]: shape \(4,\)"),
        (
            {"mass": [torch.ones(3), torch.zeros(())]},
            ValueError,
            r"Invalid mass\[1\].*expected finite numbers > 0",
        ),
        ({"mass": [1.0, torch.ones(())]}, TypeError, r"Invalid mass\[0\]: 1.0"),
    ],
)
def test_invalid_arguments(kwargs, error, match) -> None:
    params, _ = _linear_problem()
    arguments = {"lr": 0.1, "num_steps": 3, "num_data": 40, **kwargs}
    with pytest.raises(error, match=match):
        HMC(params, **arguments)


def test_step_errors() -> None:
    params, make_closure = _linear_problem()
    opt = HMC(params, lr=0.1, num_steps=2, num_data=40)
    with pytest.raises(ValueError, match=r"HMC\.step needs a closure"):
        opt.step()
    with pytest.raises(ValueError, match=r"Invalid loss returned by the closure: shape \(2, 2\)"):
        opt.step(lambda: torch.zeros(2, 2))
    with pytest.raises(ValueError, match="no parameter has a gradient after the closure"):
        opt.zero_grad()
        opt.step(lambda: torch.zeros(()))

    def per_member():
        opt.zero_grad()
        losses = make_closure(opt)()
        return losses.expand(5)

    with pytest.raises(ValueError, match=r"one loss per member\) but a parameter has shape \(3,\)"):
        opt.step(per_member)
    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "temperature": 2.0})
    with pytest.raises(
        ValueError,
        match=r"Invalid temperature in param group 1: 2.0 \(expected the value of param group 0",
    ):
        opt.step(make_closure(opt))
    with pytest.raises(ValueError, match=r"Invalid jitter in param group 2: -0\.5"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "jitter": -0.5})


def test_warmup_and_load_errors() -> None:
    params, make_closure = _linear_problem()
    opt = HMC(params, lr=0.1, num_steps=2, num_data=40, seed=0)
    with pytest.raises(ValueError, match=r"HMC\.warmup: the warm-up is over"):
        opt.warmup(make_closure(opt), 5)
    with pytest.raises(ValueError, match="Invalid state_dict: no 'hmc' entry"):
        opt.load_state_dict(torch.optim.SGD(params, lr=0.1).state_dict())


def test_start_is_cached_unless_parameters_change() -> None:
    """The start's gradient is reused from the last step (zero_grad in between or not),
    and evaluated again when the parameters were changed from outside."""
    w = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    calls = []
    opt = HMC([w], lr=0.1, num_steps=3, num_data=10, seed=0)

    def closure():
        calls.append(1)
        opt.zero_grad()
        loss = ((w - 1) ** 2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    opt.zero_grad()
    opt.step(closure)
    assert len(calls) == 1 + 3 + 3
    with torch.no_grad():
        w.add_(5.0)
    loss = opt.step(closure)
    assert len(calls) == 7 + 1 + 3
    torch.testing.assert_close(loss, ((w.detach() - 1) ** 2).sum())


def test_parameters_split_over_processes_are_refused():
    from samplers_as_optim.names import set_parameter_layout

    share = torch.nn.Parameter(torch.zeros(4))
    set_parameter_layout(share, 4, 8)  # the second half of a tensor held by two ranks
    with pytest.raises(NotImplementedError, match="HMC does not support parameters split over"):
        HMC([share], lr=0.1, num_steps=2, num_data=10)
    whole = torch.nn.Parameter(torch.zeros(4))
    set_parameter_layout(whole, 0, 4)  # one rank holding everything: fine
    HMC([whole], lr=0.1, num_steps=2, num_data=10)


def test_foreach_leapfrog_matches_the_per_tensor_update_bit_for_bit() -> None:
    """The grouped foreach updates equal Neal's per-tensor update, op for op, bit for bit:
    two float steps, a tensor step, masses and none (float32, where rounding shows)."""
    generator = torch.Generator().manual_seed(0)
    shapes = [(5,), (2, 3), (4,), (3, 2), (6,)]
    theta0 = [torch.randn(s, generator=generator) for s in shapes]
    r0 = [torch.randn(s, generator=generator) for s in shapes]
    steps = [0.1, 0.1, 0.07, torch.tensor([[0.05], [0.09], [0.11]]), 0.1]
    inverse = [None, torch.rand((2, 3), generator=generator) + 0.5, None, None, None]

    def gradient(thetas):  # a nonlinear gradient, so that each step's rounding matters
        return [torch.sin(t) * 3.0 + t for t in thetas]

    theta, r = [t.clone() for t in theta0], [t.clone() for t in r0]
    leapfrog_(
        theta,
        r,
        gradient(theta),
        lambda: (None, gradient(theta)),
        step_sizes=steps,
        inverse_mass=inverse,
        num_steps=4,
    )
    ref_theta, ref_r = [t.clone() for t in theta0], [t.clone() for t in r0]
    grads = gradient(ref_theta)
    for _ in range(4):
        for pair in (0, 1):
            if pair == 1:
                for t, m, eps, inv in zip(ref_theta, ref_r, steps, inverse, strict=True):
                    if inv is None and not isinstance(eps, Tensor):
                        t.add_(m, alpha=eps)
                    else:
                        t.add_(m * (eps if inv is None else eps * inv))
                grads = gradient(ref_theta)
            for m, g, eps in zip(ref_r, grads, steps, strict=True):
                if isinstance(eps, Tensor):
                    m.sub_(g * (eps / 2))
                else:
                    m.add_(g, alpha=-eps / 2)
    for got, want in zip(theta + r, ref_theta + ref_r, strict=True):
        assert torch.equal(got, want)


def test_zero_grad_resets_like_torch_optim() -> None:
    """HMC's lean zero_grad: None by default, zeros (detached) with set_to_none=False."""
    w, v = (torch.nn.Parameter(torch.ones(3)) for _ in range(2))
    opt = HMC([w, v], lr=0.1, num_steps=2, num_data=10, seed=0)
    w.grad, v.grad = v * 2.0, torch.ones(3)  # a gradient with a graph, as create_graph makes
    assert w.grad is not None and w.grad.grad_fn is not None
    opt.zero_grad(set_to_none=False)
    assert torch.equal(w.grad, torch.zeros(3)) and w.grad.grad_fn is None
    assert not w.grad.requires_grad
    opt.zero_grad()
    assert w.grad is None and v.grad is None


def test_cached_start_follows_a_changed_weight_decay() -> None:
    """The start's (U, grad U) reused from the last step is recomputed when the weight
    decay changes: a continued chain equals a copy that evaluates everything afresh."""
    params, make_closure = _linear_problem()
    opt = HMC(params, lr=1e-2, num_steps=4, num_data=40, seed=3, weight_decay=0.1)
    opt.step(make_closure(opt))
    twin_params, make_twin_closure = _linear_problem()
    with torch.no_grad():
        for p, q in zip(params, twin_params, strict=True):
            q.copy_(p)
    twin = HMC(twin_params, lr=1e-2, num_steps=4, num_data=40, seed=3, weight_decay=0.1)
    twin.load_state_dict(opt.state_dict())  # no cache: its first step evaluates the start
    for o in (opt, twin):
        o.param_groups[0]["weight_decay"] = 3.0
    opt.step(make_closure(opt))
    twin.step(make_twin_closure(twin))
    for p, q in zip(params, twin_params, strict=True):
        assert torch.equal(p, q)
    for key in ("energy_error", "accept_prob"):
        assert torch.equal(opt.diagnostics[key], twin.diagnostics[key])


# ---------------------------------------------------------------- failed steps
class Interrupt(BaseException):
    """A KeyboardInterrupt-like BaseException (not an Exception: no ``except Exception``)."""


def assert_same(a, b, where: str = "") -> None:
    """Nested dicts, lists and tensors equal bit for bit (dtype, shape and values)."""
    if isinstance(a, Tensor):
        assert isinstance(b, Tensor) and a.dtype == b.dtype, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (where, a, b)
        for key in a:
            assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def snapshot(opt: HMC, params) -> tuple:
    """Everything a step may change: values, gradients (or None), state, diagnostics."""
    return (
        [p.detach().clone() for p in params],
        [None if p.grad is None else p.grad.clone() for p in params],
        copy.deepcopy(opt.state_dict()),
        copy.deepcopy(opt.diagnostics),
    )


def failing_closure(opt: HMC, params, make_closure, how: str, at: int = 3):
    """The problem's closure, failing ``how`` at its ``at``-th call (counted from 1)."""
    good = make_closure(opt)
    calls = [0]

    def closure():
        calls[0] += 1
        if calls[0] != at:
            return good()
        if how == "shape":  # the loss's shape changes mid-trajectory
            losses = good().detach()
            return losses.expand(2, *losses.shape)
        if how == "missing gradient":  # a parameter's gradient goes missing
            losses = good()
            params[1].grad = None
            return losses
        if how == "exception":
            good()
            raise RuntimeError("the closure failed")
        good()
        raise Interrupt

    return closure


FAILURES = {
    "shape": (ValueError, r"Invalid loss returned by the closure: shape \(2,"),
    "missing gradient": (ValueError, "had a gradient at the start of the transition but"),
    "exception": (RuntimeError, "the closure failed"),
    "interrupt": (Interrupt, None),
}


@pytest.mark.parametrize("k", [None, 3])
@pytest.mark.parametrize("done", [0, 2])
@pytest.mark.parametrize("how", list(FAILURES))
def test_failed_closure_step_leaves_everything_as_before(how: str, done: int, k) -> None:
    """A closure failing mid-trajectory (at its third call of the step: the second or third
    leapfrog step of four, as the start is cached or evaluated) leaves the
    parameters, their gradients, the state (random counters, adaptation, mass draws) and
    the diagnostics bit for bit as before the step; the chain then continues exactly as
    one that never failed: the retried step draws the same momentum."""
    options = {
        "lr": 0.05,
        "num_steps": 4,
        "num_data": 40,
        "seed": 4,
        "jitter": 0.2,
        "target_accept": 0.7,
        "mass": "adapt",
    }
    params, make_closure = _linear_problem(k=k)
    twin_params, make_twin_closure = _linear_problem(k=k)
    opt, twin = HMC(params, **options), HMC(twin_params, **options)
    closure, twin_closure = make_closure(opt), make_twin_closure(twin)
    for _ in range(done):
        opt.step(closure)
        twin.step(twin_closure)
    before = snapshot(opt, params)
    error, match = FAILURES[how]
    with pytest.raises(error, match=match):
        opt.step(failing_closure(opt, params, make_closure, how))
    assert_same(snapshot(opt, params), before)
    assert opt.steps_taken == done
    for _ in range(3):
        assert torch.equal(opt.step(closure), twin.step(twin_closure))
        assert_same(snapshot(opt, params), snapshot(twin, twin_params))


def test_failed_step_restores_gradients_zeroed_in_place() -> None:
    """A closure that zeroes ``.grad`` in place (``zero_grad(set_to_none=False)``) and then
    fails: the gradient tensors get their values back (the same tensor objects)."""
    params, make_closure = _linear_problem()
    opt = HMC(params, lr=0.05, num_steps=4, num_data=40, seed=2)
    opt.step(make_closure(opt))
    grads = [p.grad for p in params]
    before = snapshot(opt, params)
    calls = [0]

    def closure():
        calls[0] += 1
        opt.zero_grad(set_to_none=False)
        if calls[0] == 2:
            raise Interrupt
        return make_closure(opt)()

    with pytest.raises(Interrupt):
        opt.step(closure)
    assert all(p.grad is g for p, g in zip(params, grads, strict=True))
    assert_same(snapshot(opt, params), before)


# ---------------------------------------------------------------- clear errors
def _counting(closure):
    calls = [0]

    def counted():
        calls[0] += 1
        return closure()

    return counted, calls


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"lr": 1e300},
            r"Invalid lr: 1e\+300 \(expected a value that fits torch\.float32, at most",
        ),
        (
            {"weight_decay": 1e300},
            r"Invalid weight_decay: 1e\+300 \(expected a value that fits torch\.float32",
        ),
        ({"num_data": 10**39}, r"Invalid num_data: 10{39} \(expected a value that fits torch\."),
    ],
)
def test_scalars_that_overflow_the_parameters_dtype_are_refused(kwargs, match) -> None:
    """HMC passes its step (as ``alpha``), weight decay and N to torch as scalars of the
    parameters' dtype: one that overflows float32 is refused by name, at construction, at
    the step after a change (before the closure runs), and in a new param group."""
    match = match.replace("10{39}", str(10**39))
    params, make_closure = _linear_problem(dtype=torch.float32)
    arguments = {"lr": 0.05, "num_steps": 3, "num_data": 40, "seed": 0}
    with pytest.raises(ValueError, match=match):
        HMC(params, **{**arguments, **kwargs})
    HMC(_linear_problem()[0], **{**arguments, **kwargs})  # float64 holds them
    opt = HMC(params, **arguments)
    closure, calls = _counting(make_closure(opt))
    opt.step(closure)
    before, count = snapshot(opt, params), calls[0]
    ((name, value),) = kwargs.items()
    opt.param_groups[0][name] = value
    with pytest.raises(ValueError, match=match.replace(":", " in param group 0:", 1)):
        opt.step(closure)
    assert calls[0] == count  # refused before the closure ran
    opt.param_groups[0][name] = arguments.get(name, 0.0)
    assert_same(snapshot(opt, params), before)
    extra = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match=match.replace(":", " in param group 1:", 1)):
        opt.add_param_group({"params": [extra], name: value})
    assert len(opt.param_groups) == 1


def test_float_leapfrog_step_beyond_the_dtype_is_a_divergence_not_a_crash() -> None:
    """An adapted step multiplier can grow past float32 (where lr alone fits): the float
    step of a single chain then diverges and is rejected, as a tensor step (which rounds
    to infinity) is, instead of torch refusing the ``alpha``."""
    params, make_closure = _linear_problem(dtype=torch.float32)
    opt = HMC(params, lr=0.05, num_steps=2, num_data=40, seed=0, target_accept=0.8)
    closure = make_closure(opt)
    opt.step(closure)
    before = [p.detach().clone() for p in params]
    opt._hmc_state["log_step"] = torch.tensor(100.0, dtype=torch.float64)  # s = e^100
    opt.step(closure)
    assert not bool(opt.diagnostics["accepted"]) and bool(opt.diagnostics["divergent"])
    for p, p0 in zip(params, before, strict=True):
        assert torch.equal(p, p0)


@pytest.mark.parametrize("done", [0, 2])
def test_closure_returning_none_is_refused_with_nothing_changed(done: int) -> None:
    params, make_closure = _linear_problem()
    opt = HMC(params, lr=0.05, num_steps=3, num_data=40, seed=0, target_accept=0.8)
    good = make_closure(opt)
    for _ in range(done):
        opt.step(good)
    before = snapshot(opt, params)

    def forgets_to_return():
        good()  # zero_grad and backward, but no `return loss`

    with pytest.raises(
        TypeError, match=r"Invalid loss returned by the closure: None \(expected the full-batch"
    ):
        opt.step(forgets_to_return)
    assert_same(snapshot(opt, params), before)
    with pytest.raises(TypeError, match="Invalid loss returned by the closure: 'a'"):
        opt.step(lambda: (good(), "a")[1])
    assert_same(snapshot(opt, params), before)


def test_closure_or_loss_fn_that_is_not_callable_is_refused() -> None:
    params, make_closure = _linear_problem()
    opt = HMC(params, lr=0.05, num_steps=3, num_data=40, seed=0, target_accept=0.8)
    opt.step(make_closure(opt))
    before = snapshot(opt, params)
    with pytest.raises(TypeError, match=r"Invalid loss_fn: 3\.0 \(expected a callable: the full"):
        opt.step(loss_fn=3.0)
    with pytest.raises(TypeError, match=r"Invalid closure: 3\.0 \(expected a callable that zero"):
        opt.step(3.0)
    with pytest.raises(TypeError, match=r"Invalid loss_fn: 'loss' \(expected a callable"):
        opt.warmup(num_steps=5, loss_fn="loss")
    assert_same(snapshot(opt, params), before)


def test_warmup_interrupted_by_a_failed_step_leaves_the_state_as_that_step_found_it() -> None:
    """warmup() sets whether a step adds its draw to the mass estimate; a step failing
    inside it leaves that setting (and everything else) as it was before that step."""
    options = {"lr": 0.05, "num_steps": 3, "num_data": 40, "seed": 0, "mass": "adapt"}
    params, make_closure = _linear_problem()
    twin_params, make_twin_closure = _linear_problem()
    opt, twin = HMC(params, **options), HMC(twin_params, **options)
    opt.step(make_closure(opt))
    twin.step(make_twin_closure(twin))
    before = snapshot(opt, params)
    with pytest.raises(Interrupt):  # in the first 15% of the warm-up: no mass draws
        opt.warmup(failing_closure(opt, params, make_closure, "interrupt", at=2), 40)
    assert_same(snapshot(opt, params), before)
    opt.step(make_closure(opt))
    twin.step(make_twin_closure(twin))
    assert_same(snapshot(opt, params), snapshot(twin, twin_params))
