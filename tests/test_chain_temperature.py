"""Kinetic and configurational temperatures (``sgmcmc/temperature/estimates``), the
optimizer's ``temperature_estimates`` and ``diagnostics.TemperatureMonitor``.

The targets are diagonal Gaussians, ``N * L = sum_i lam_i theta_i^2 / 2``, with the
precisions ``lam`` on a grid of ``len(LAMS)`` values, each repeated over many elements of
one parameter. Every sampler is then a linear Gaussian chain per element
(``linear_chains``), whose exact stationary law gives the expected value of each
estimate *for the discretised chain*, step-size bias included (which the lr here makes
visible: up to 10-20% above T for SGLD and SGHMC, none for BAOA), and the exact
standard deviation of a window's average: for a zero-mean Gaussian chain
``Cov(z_t^2, z_{t+k}^2) = 2 ((M^k S)_jj)^2``, summed over the window's lags. Estimates
are compared within z = 4.5 of that. Where the law is known less sharply (SGNHT's
fluctuating thermostat; a gradient-noise chain's configurational terms) the single-step
standard error is used instead (each element's term a Gaussian quadratic, variance
2 E^2), which bounds any window average's whatever the autocorrelation.

The monitor reads, with its default ``coordinates``, a fixed strided subset of the 10,000
elements (``sgmcmc/temperature/coordinates``): every law below is the one of the elements
it reads (``READ``: how many of each precision's), with d the subset's size.
"""

import dataclasses
import inspect
import math
import sys
import warnings

import numpy as np
import pytest
import torch
from linear_chains import sghmc_mode, sgld_mode, spectral_radius, stationary_covariance

import samplers_as_optim as sao
from samplers_as_optim import diagnostics
from samplers_as_optim.names import set_member_dims
from samplers_as_optim.sgmcmc.optimizer import SamplerOptimizer
from samplers_as_optim.sgmcmc.sgld import DEFINITION as SGLD_DEFINITION
from samplers_as_optim.sgmcmc.temperature.coordinates import coordinate_subsets
from samplers_as_optim.sgmcmc.temperature.estimates import (
    TemperatureSums,
    chi2_quantile,
    group_sums,
)
from samplers_as_optim.sgmcmc.temperature.rule import TemperatureRule

Z = 4.5
N = 100
LAMS = np.geomspace(0.5, 3.0, 20)


def baoa_mode(lam, *, lr, num_data, temperature, momentum):
    """BAOA on one mode, state (x, b) (``baoa``'s docstring): v = b + g x,
    b' = mu v + s xi, x' = x - lr (v + b') / 2, with g = lam / N."""
    g = lam / num_data
    s = np.sqrt((1.0 - momentum**2) * temperature / (num_data * lr))
    transition = np.array(
        [
            [1.0 - lr * g * (1.0 + momentum) / 2.0, -lr * (1.0 + momentum) / 2.0],
            [momentum * g, momentum],
        ]
    )
    return transition, np.array([-lr * s / 2.0, s])


def diagonal_target(copies, temperature, seed=0):
    """The precisions, one per element, and a start drawn from the target."""
    lam = torch.tensor(np.repeat(LAMS, copies), dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    start = torch.randn(lam.shape, generator=generator) * (temperature / lam).sqrt()
    return lam, start


def read_counts():
    """How many elements of each precision the monitor reads with its default budget."""
    budget = inspect.signature(diagnostics.TemperatureMonitor).parameters["coordinates"].default
    (subset,) = coordinate_subsets([(len(LAMS) * COPIES,)], budget)
    positions = np.asarray(subset.positions())
    return np.bincount(positions // COPIES, minlength=len(LAMS))


def weighted_mean(values):
    """The mean over the elements read of per-precision values."""
    return float(np.dot(READ, values) / READ.sum())


def single_step_sd(values, extra=None):
    """The single-step sd of the mean, over the elements read, of Gaussian quadratic terms
    with these means (per precision)."""
    values = np.asarray(values)
    variance = 2.0 * values**2 + (0.0 if extra is None else np.asarray(extra))
    return float(np.sqrt(np.dot(READ, variance)) / READ.sum())


def window_variance(transition, cov, index, window):
    """Var of the window average of z_index^2 for one element at stationarity."""
    lagged, total = cov.copy(), 0.0
    for lag in range(window):
        weight = window if lag == 0 else 2 * (window - lag)
        total += weight * 2.0 * lagged[index, index] ** 2
        lagged = transition @ lagged
    return total / window**2


COPIES = 500  # 10,000 elements
READ = read_counts()
BURN, WINDOW = 300, 100


def run_window(
    make, temperature, *, burn=BURN, window=WINDOW, noise_sd=0.0, seed=0, dtype=torch.float32
):
    """Run ``make(param)`` from the target for ``burn`` steps, then a monitor's window
    (``dtype``: the parameter's and its gradient's; the gradient is computed in float32)."""
    lam, start = diagonal_target(COPIES, temperature, seed)
    param = torch.nn.Parameter(start.clone().to(dtype))
    optimizer = make(param)
    generator = torch.Generator().manual_seed(seed + 1)

    def gradient():
        grad = lam * param.detach().float() / N
        if noise_sd:
            grad = grad + noise_sd * torch.randn(lam.shape, generator=generator)
        param.grad = grad.to(dtype)

    for _ in range(burn):
        gradient()
        optimizer.step()
    monitor = diagnostics.TemperatureMonitor(optimizer, every=window, warn=False)
    for _ in range(window):
        gradient()
        optimizer.step()
    (report,) = monitor.history[-1][1]
    return optimizer, report


def check(report, law, temperature):
    """Each estimate of ``report`` within Z sd of ``law[name] = (mean, sd)``."""
    assert report.temperature == temperature
    for name, estimate in (("kin", report.kinetic), ("conf", report.configurational)):
        if name not in law:
            assert estimate is None
            continue
        assert estimate.dof == READ.sum() < len(LAMS) * COPIES  # the subset, not all
        mean, sd = law[name]
        assert abs(estimate.value - mean) < Z * sd, (name, estimate.value, mean, sd)


def exact_law(mode, kinetic_weight=None, *, prior=0.0, sharp=True, **hyper):
    """Expected estimates and their sds (of a WINDOW's average when ``sharp``, else of
    one step) from each grid value's stationary law, and the slowest radius.

    ``kinetic_weight``: w in T_kin = mean(w b^2) (None: no kinetic estimate);
    ``prior``: a prior precision in U beside the likelihood's (the configurational
    term is (lam + prior) x^2).
    """
    conf, kin, conf_var, kin_var, radius = [], [], [], [], 0.0
    for lam in LAMS:
        transition, noise = mode(lam, num_data=N, **hyper)
        cov = stationary_covariance(transition, noise)
        radius = max(radius, spectral_radius(transition))
        conf.append((lam + prior) * cov[0, 0])
        conf_var.append((lam + prior) ** 2 * window_variance(transition, cov, 0, WINDOW))
        if kinetic_weight is not None:
            kin.append(kinetic_weight * cov[1, 1])
            kin_var.append(kinetic_weight**2 * window_variance(transition, cov, 1, WINDOW))

    def summary(means, variances):
        sd = np.sqrt(np.dot(READ, variances)) / READ.sum() if sharp else single_step_sd(means)
        return weighted_mean(means), float(sd)

    law = {"conf": summary(conf, conf_var)}
    if kinetic_weight is not None:
        law["kin"] = summary(kin, kin_var)
    return law, radius


TEMPERATURES = [1.0, 0.3]


@pytest.mark.slow
@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_sgld_configurational_temperature_is_the_exact_laws(temperature):
    lr = 10.0  # h = lr lam / N from 0.05 to 0.3: the exact law reads T/(1 - h/2), 1.08 T
    _, report = run_window(
        lambda p: sao.SGLD([p], lr=lr, num_data=N, temperature=temperature, seed=1), temperature
    )
    law, radius = exact_law(sgld_mode, lr=lr, temperature=temperature)
    assert radius**BURN < 1e-6
    check(report, law, temperature)
    assert report.note == "no momentum to read"
    assert law["conf"][0] > temperature * (1 + Z * law["conf"][1])  # the bias is seen


@pytest.mark.slow
@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("momentum", [0.5, 0.9])
def test_sghmc_both_temperatures_are_the_exact_laws(temperature, momentum):
    """The kinetic reading's factor (1 + mu)/2 is needed: without it 4/3 T at mu = 0.5."""
    lr = 10.0
    _, report = run_window(
        lambda p: sao.SGHMC(
            [p], lr=lr, momentum=momentum, num_data=N, temperature=temperature, seed=1
        ),
        temperature,
    )
    law, radius = exact_law(
        sghmc_mode,
        N * lr * (1.0 + momentum) / 2.0,
        lr=lr,
        temperature=temperature,
        momentum=momentum,
    )
    assert radius**BURN < 1e-6
    check(report, law, temperature)
    # the exact law: the kinetic reading equals the configurational one, above T
    assert law["kin"][0] == pytest.approx(law["conf"][0], rel=1e-9)
    assert law["conf"][0] > temperature * 1.02
    # and the reading without the factor would be outside the tolerance
    unscaled = law["kin"][0] * 2.0 / (1.0 + momentum)
    assert abs(report.kinetic.value - unscaled) > Z * law["kin"][1] * 2.0 / (1.0 + momentum)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_parameters_read_the_same_law(dtype):
    """A half-precision parameter samples through its float32 master copy; the estimates
    read the rounded parameter and its half gradient, summed in float32: the same law as
    in float32 (rounding adds a relative 2^-9 at most to a term, far inside the band)."""
    lr, momentum = 10.0, 0.9
    _, report = run_window(
        lambda p: sao.SGHMC([p], lr=lr, momentum=momentum, num_data=N, seed=1), 1.0, dtype=dtype
    )
    law, _ = exact_law(
        sghmc_mode, N * lr * (1.0 + momentum) / 2.0, lr=lr, temperature=1.0, momentum=momentum
    )
    check(report, law, 1.0)


@pytest.mark.slow
@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_baoa_both_temperatures_are_t_exactly(temperature):
    lr = 10.0
    _, report = run_window(
        lambda p: sao.BAOA([p], lr=lr, momentum=0.5, num_data=N, temperature=temperature, seed=1),
        temperature,
    )
    law, radius = exact_law(baoa_mode, N * lr, lr=lr, temperature=temperature, momentum=0.5)
    assert radius**BURN < 1e-6
    assert law["kin"][0] == pytest.approx(temperature, rel=1e-9)
    assert law["conf"][0] == pytest.approx(temperature, rel=1e-9)
    check(report, law, temperature)
    assert not report.hot and not report.cold


@pytest.mark.slow
@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_sgnht_reads_the_law_at_its_thermostat(temperature):
    """The exact law of SGHMC with friction alpha, the thermostat's value at the end, and
    the weight (2 - alpha)/2; the thermostat moves by ~sqrt(lr T/(N n)) ~ 3e-3 around it,
    so the single-step sd is the tolerance."""
    lr = 10.0
    optimizer, report = run_window(
        lambda p: sao.SGNHT([p], lr=lr, momentum=0.5, num_data=N, temperature=temperature, seed=1),
        temperature,
    )
    (state,) = optimizer.state.values()
    alpha = float(state["thermostat"])
    law, radius = exact_law(
        sghmc_mode,
        N * lr * (1.0 - alpha / 2.0),
        sharp=False,
        lr=lr,
        temperature=temperature,
        momentum=0.5,
        friction=alpha,
    )
    assert radius**BURN < 1e-6
    check(report, law, temperature)


@pytest.mark.slow
def test_coupled_weight_decay_is_the_prior_in_u():
    """SGLD with weight_decay: U = N L + N decay |theta|^2 / 2, a mode of lam + N decay;
    theta dU counts both (without the prior the reading would be ~25% low here)."""
    lr, decay, temperature = 10.0, 0.01, 1.0
    _, report = run_window(
        lambda p: sao.SGLD(
            [p], lr=lr, weight_decay=decay, num_data=N, temperature=temperature, seed=1
        ),
        temperature,
    )
    prior = N * decay
    law, radius = exact_law(
        lambda lam, **kw: sgld_mode(lam + prior, **kw), prior=prior, lr=lr, temperature=temperature
    )
    assert radius**BURN < 1e-6
    check(report, law, temperature)
    likelihood_only, _ = exact_law(
        lambda lam, **kw: sgld_mode(lam + prior, **kw), lr=lr, temperature=temperature
    )
    assert abs(likelihood_only["conf"][0] - law["conf"][0]) > Z * law["conf"][1]


WARMUP = 20


@pytest.mark.slow
@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_psgld_configurational_temperature_at_its_frozen_preconditioner(temperature):
    """Frozen, PSGLD is SGLD at lr / a (a pooled over the vector: one number)."""
    lr = 0.1
    optimizer, report = run_window(
        lambda p: sao.PSGLD(
            [p], lr=lr, num_data=N, temperature=temperature, seed=1, preconditioner_warmup=WARMUP
        ),
        temperature,
    )
    (state,) = optimizer.state.values()
    assert state["preconditioner"].numel() == 1
    a = float(state["preconditioner"].reshape(-1)[0])
    law, radius = exact_law(sgld_mode, lr=lr / a, temperature=temperature)
    assert radius ** (BURN - WARMUP) < 1e-5
    check(report, law, temperature)


def twin_mode(lam, *, num_data, lr, a, beta1, decay, temperature):
    """The twin on one element with the likelihood lam x^2/2 and decoupled decay
    (``adamw_sghmc``), state (x, m): m' = beta1 m + (1-beta1)(lam x / N + sigma sqrt(a)
    xi), x' = (1 - lr decay) x - lr m'/a, sigma = sqrt(2T/(N lr)). Without decay it is
    SGHMC at lr (1 - beta1)/a with momentum beta1 and b = m/(1 - beta1)."""
    g = lam / num_data
    noise = (1 - beta1) * np.sqrt(2.0 * temperature / (num_data * lr)) * np.sqrt(a)
    transition = np.array(
        [[1.0 - lr * decay - lr * (1 - beta1) * g / a, -lr * beta1 / a], [(1 - beta1) * g, beta1]]
    )
    return transition, np.array([-lr * noise / a, noise])


@pytest.mark.slow
@pytest.mark.parametrize(("temperature", "decay"), [(1.0, 0.0), (0.3, 0.0), (1.0, 0.5)])
def test_adamw_sghmc_both_temperatures_at_its_frozen_mass(temperature, decay):
    """r^2/M = N lr m^2/((1-beta1) a) with SGHMC's factor (1 + beta1)/2; with decay the
    prior N(0, 1/(N decay a)) is in U: theta dU = N theta (g + decay a theta)."""
    lr, beta1 = 0.1, 0.9
    optimizer, report = run_window(
        lambda p: sao.AdamWSGHMC(
            [p],
            lr=lr,
            weight_decay=decay,
            num_data=N,
            temperature=temperature,
            seed=1,
            preconditioner_warmup=WARMUP,
        ),
        temperature,
    )
    (state,) = optimizer.state.values()
    a = float(state["preconditioner"].reshape(-1)[0])
    weight = N * lr / ((1 - beta1) * a) * (1 + beta1) / 2
    hyper = dict(lr=lr, a=a, beta1=beta1, decay=decay, temperature=temperature)
    # the configurational terms of U's likelihood and prior: (lam + N decay a) theta^2
    law, radius = exact_law(twin_mode, weight, prior=N * decay * a, **hyper)
    assert radius ** (BURN - WARMUP) < 1e-5
    check(report, law, temperature)
    if decay:
        likelihood_only, _ = exact_law(twin_mode, weight, **hyper)
        assert abs(likelihood_only["conf"][0] - law["conf"][0]) > Z * law["conf"][1]


def noisy_sghmc_law(*, lr, momentum, temperature, noise_sd):
    """SGHMC with additive gradient noise eta ~ N(0, noise_sd^2) on the mean loss's
    gradient: eta enters b as the gradient does, b' = mu b + g x + eta + s xi, so the
    chain stays linear with the extra noise column (-lr, 1) noise_sd. Single-step sds;
    the configurational term N theta (g + eta) has the extra variance N^2 noise_sd^2
    E[theta^2]."""
    conf, kin, extra = [], [], []
    for lam in LAMS:
        transition, noise = sghmc_mode(
            lam, lr=lr, num_data=N, temperature=temperature, momentum=momentum
        )
        column = noise_sd * np.array([-lr, 1.0])
        rhs = (np.outer(noise, noise) + np.outer(column, column)).reshape(-1)
        cov = np.linalg.solve(np.eye(4) - np.kron(transition, transition), rhs).reshape(2, 2)
        conf.append(lam * cov[0, 0])
        extra.append(N**2 * noise_sd**2 * cov[0, 0])
        kin.append(N * lr * (1 + momentum) / 2 * cov[1, 1])
    return {
        "conf": (weighted_mean(conf), single_step_sd(conf, extra)),
        "kin": (weighted_mean(kin), single_step_sd(kin)),
    }


@pytest.mark.slow
def test_a_minibatch_chain_the_exact_law_calls_hot_is_flagged_once_and_full_batch_is_not():
    """The monitor's defaults read d' = 3334 of the 10,000 elements: the kinetic band's
    upper end moves from 1.047 (d = 10,000) to 1.083 and the configurational band's
    half-width grows by sqrt(10,000 / 3334) = 1.73 (from ~0.13 to ~0.23 here); the exact
    law of the minibatch chain, 1.455, stays beyond both (asserted below)."""
    lr, momentum, temperature = 1.0, 0.9, 1.0
    noise_sd = 0.03  # the injected noise's variance is 2 (1 - mu) T / (N lr) = 0.002
    hot_law = noisy_sghmc_law(lr=lr, momentum=momentum, temperature=temperature, noise_sd=noise_sd)
    cold_law = noisy_sghmc_law(lr=lr, momentum=momentum, temperature=temperature, noise_sd=0)
    results = {}
    for name, sd in (("minibatch", noise_sd), ("full batch", 0.0)):
        lam, start = diagonal_target(COPIES, temperature)
        param = torch.nn.Parameter(start.clone())
        optimizer = sao.SGHMC(
            [param], lr=lr, momentum=momentum, num_data=N, temperature=temperature, seed=1
        )
        generator = torch.Generator().manual_seed(7)
        monitor = None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(BURN + 4 * WINDOW):
                if step == BURN:
                    monitor = diagnostics.TemperatureMonitor(optimizer, every=WINDOW)
                param.grad = lam * param.detach() / N + sd * torch.randn(
                    lam.shape, generator=generator
                )
                optimizer.step()
        assert monitor is not None
        results[name] = (
            monitor,
            [w for w in caught if w.category is diagnostics.ChainTemperatureWarning],
        )
    hot_monitor, hot_warnings = results["minibatch"]
    assert len(hot_monitor.history) == 4
    for _, (report,) in hot_monitor.history:
        assert report.kinetic.hot and report.configurational.hot
        for estimate, law in (
            (report.kinetic, hot_law["kin"]),
            (report.configurational, hot_law["conf"]),
        ):
            assert law[0] > estimate.high  # the exact law is hot beyond the band
            assert abs(estimate.value - law[0]) < Z * law[1]
    assert len(hot_warnings) == 1
    message = str(hot_warnings[0].message)
    assert "param group 0: kinetic temperature" in message
    assert "at T=1" in message and "band [" in message and "lower lr" in message
    cold_monitor, cold_warnings = results["full batch"]
    assert cold_warnings == []
    for _, (report,) in cold_monitor.history:
        assert not report.hot and not report.cold
        for estimate, law in (
            (report.kinetic, cold_law["kin"]),
            (report.configurational, cold_law["conf"]),
        ):
            assert estimate.low < law[0] < estimate.high


def small_chain(temperature=1.0, momentum=0.9, seed=0, cls=sao.SGHMC, **kwargs):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    data = torch.randn(32, 6), torch.randn(32, 1)
    if cls is sao.SGHMC:
        kwargs.setdefault("momentum", momentum)
    optimizer = cls(
        model.parameters(), lr=1e-3, num_data=100, temperature=temperature, seed=3, **kwargs
    )

    def step():
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(data[0]), data[1]).backward()
        optimizer.step()

    return model, optimizer, step


@pytest.mark.parametrize("coordinates", [4096, 20])  # the 65 parameters whole; a subset
def test_the_monitor_reads_to_the_host_only_every_every_steps(monkeypatch, coordinates):
    _, optimizer, step = small_chain()
    monitor = diagnostics.TemperatureMonitor(optimizer, every=5, coordinates=coordinates)
    reads = {"tolist": 0, "item": 0, "report": 0}
    tolist, item, report = torch.Tensor.tolist, torch.Tensor.item, TemperatureSums.report

    def counted(name, function):
        def wrapper(self, *args, **kwargs):
            reads[name] += 1
            return function(self, *args, **kwargs)

        return wrapper

    monkeypatch.setattr(torch.Tensor, "tolist", counted("tolist", tolist))
    monkeypatch.setattr(torch.Tensor, "item", counted("item", item))
    monkeypatch.setattr(TemperatureSums, "report", counted("report", report))
    for _ in range(4):
        step()
    assert reads == {"tolist": 0, "item": 0, "report": 0}
    (window,) = monitor._window.values()
    # the first step had no momentum buffer yet
    assert window.read_kinetic == 3 and window.read_conf == 4
    assert all(isinstance(step.sums.conf, torch.Tensor) for step in window.steps)
    step()
    assert reads["report"] == 1 and reads["tolist"] > 0
    assert len(monitor.history) == 1 and monitor.history[0][0] == 5


def test_the_monitor_changes_neither_the_chain_nor_its_state_dict():
    model_a, optimizer_a, step_a = small_chain()
    model_b, optimizer_b, step_b = small_chain()
    monitor = diagnostics.TemperatureMonitor(optimizer_b, every=3, warn=False)
    for _ in range(7):
        step_a()
        step_b()
    assert len(monitor.history) == 2
    for a, b in zip(model_a.parameters(), model_b.parameters(), strict=True):
        assert torch.equal(a, b)
    state_a, state_b = optimizer_a.state_dict(), optimizer_b.state_dict()
    assert state_a["param_groups"] == state_b["param_groups"]
    assert state_a["state"].keys() == state_b["state"].keys()
    for key, entry in state_a["state"].items():
        assert entry.keys() == state_b["state"][key].keys()
        for name, value in entry.items():
            assert torch.equal(value, state_b["state"][key][name])
    monitor.remove()
    step_b()
    assert len(monitor.history) == 2


def test_estimates_now_and_what_a_report_holds():
    _, optimizer, step = small_chain()
    (report,) = optimizer.temperature_estimates()
    assert report.kinetic is None and report.configurational is None  # no step, no grad
    assert report.note == "no momentum to read; no gradient read"
    step()
    optimizer.zero_grad()
    (report,) = optimizer.temperature_estimates(level=0.99)
    assert report.kinetic is not None and report.configurational is None
    assert report.level == 0.99 and report.steps == 1 and report.member is None
    assert report.kinetic.dof == sum(p.numel() for p in optimizer.param_groups[0]["params"])
    assert "group 0 at T=1" in str(report)


def test_sgld_has_no_kinetic_estimate_and_sghmc_without_momentum_neither():
    for cls, kwargs in ((sao.SGLD, {}), (sao.SGHMC, {"momentum": 0.0})):
        _, optimizer, step = small_chain(cls=cls, **kwargs)
        step()
        step()
        (report,) = optimizer.temperature_estimates()
        assert report.kinetic is None and report.configurational is not None
        assert report.note == "no momentum to read"


def test_a_change_of_lr_reads_the_buffer_in_the_units_it_was_written_in():
    """Between a change of lr and the step that re-expresses the buffer, the kinetic
    reading uses the rate recorded beside it (``momentum_lr``), not the group's."""
    _, optimizer, step = small_chain()
    for _ in range(3):
        step()
    (before,) = optimizer.temperature_estimates()
    optimizer.param_groups[0]["lr"] = 4e-3
    (after,) = optimizer.temperature_estimates()
    assert after.kinetic.value == before.kinetic.value


def test_maximize_reads_the_same_configurational_temperature():
    """maximize=True with the negated loss: the same chain, the same reading."""
    readings = []
    for maximize in (False, True):
        model, optimizer, _ = small_chain(maximize=maximize)
        torch.manual_seed(1)
        x, y = torch.randn(32, 6), torch.randn(32, 1)
        loss = torch.nn.functional.mse_loss(model(x), y)
        (-loss if maximize else loss).backward()
        (report,) = optimizer.temperature_estimates()
        readings.append(report.configurational.value)
    assert readings[0] == pytest.approx(readings[1], rel=1e-6)


def test_at_temperature_zero_there_is_nothing_to_test():
    _, optimizer, step = small_chain(temperature=0.0)
    monitor = diagnostics.TemperatureMonitor(optimizer, every=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(4):
            step()
    (report,) = optimizer.temperature_estimates()
    assert report.kinetic is None and report.configurational is None
    assert report.note == "temperature 0: no target to test against"
    assert [r.note for _, (r,) in monitor.history] == [report.note] * 2
    assert not report.hot and not report.cold


def test_stacked_members_are_reported_apart():
    """A ParallelEnsemble's stack: one report per member; one member heated alone."""
    members, size = 3, 4_000
    lam = torch.tensor(np.repeat(LAMS, size // len(LAMS)), dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    param = torch.nn.Parameter(torch.randn(members, size, generator=generator) / lam.sqrt())
    set_member_dims(param, 1)
    optimizer = sao.SGHMC([param], lr=0.5, momentum=0.9, num_data=N, seed=1)
    for _ in range(300):
        param.grad = lam * param.detach() / N
        optimizer.step()
    optimizer.state[param]["momentum_buffer"][1].mul_(1.5)  # member 1 at 2.25 T
    param.grad = lam * param.detach() / N
    reports = optimizer.temperature_estimates()
    assert [r.member for r in reports] == [0, 1, 2]
    assert [r.kinetic.hot for r in reports] == [False, True, False]
    assert [r.configurational.hot for r in reports] == [False, False, False]
    assert {r.kinetic.dof for r in reports} == {size}


def test_chi2_quantile_agrees_with_scipy():
    stats = pytest.importorskip("scipy.stats")
    for dof in (1, 2, 5, 100, 10_000, 2_000_000):
        for probability in (0.0005, 0.025, 0.5, 0.9995):
            assert chi2_quantile(probability, dof) == pytest.approx(
                stats.chi2.ppf(probability, dof), rel=1e-9
            )


def toy_sampler():
    definition = dataclasses.replace(SGLD_DEFINITION, name="Toy", temperature_rule=None)

    class Toy(SamplerOptimizer, definition=definition):
        pass

    return Toy(torch.nn.Linear(2, 1).parameters(), lr=1e-3, num_data=10)


def test_refusals():
    _, optimizer, _ = small_chain()
    with pytest.raises(
        ValueError, match=r"^Invalid level: 1\.0 \(expected a number in \(0, 1\)\)$"
    ):
        optimizer.temperature_estimates(level=1.0)
    toy = toy_sampler()
    message = r"^Invalid optimizer: Toy \(expected a sampler whose definition declares a temperature_rule\)$"
    with pytest.raises(ValueError, match=message):
        toy.temperature_estimates()
    with pytest.raises(ValueError, match=message):
        diagnostics.TemperatureMonitor(toy)
    sgd = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    with pytest.raises(
        TypeError,
        match=r"^Invalid optimizer: SGD \(expected an SG-MCMC sampler, a SamplerOptimizer\)$",
    ):
        diagnostics.TemperatureMonitor(sgd)
    cases = [
        ({"every": 0}, ValueError, r"^Invalid every: 0 \(expected an integer >= 1\)$"),
        ({"stride": 1.5}, TypeError, r"^Invalid stride: 1\.5 \(expected an integer >= 1\)$"),
        ({"level": 0}, ValueError, r"^Invalid level: 0 \(expected a number in \(0, 1\)\)$"),
        ({"warn": "yes"}, TypeError, r"^Invalid warn: 'yes' \(expected True or False\)$"),
    ]
    for kwargs, error, pattern in cases:
        with pytest.raises(error, match=pattern):
            diagnostics.TemperatureMonitor(optimizer, **kwargs)
    # refused before anything changed: no hook was registered
    assert not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_step_post_hooks
    stacked = torch.nn.Parameter(torch.zeros(3, 4))
    set_member_dims(stacked, 1)
    mixed = sao.SGHMC([stacked, torch.nn.Parameter(torch.zeros(4))], lr=0.1, num_data=10)
    with pytest.raises(
        ValueError,
        match=r"^Invalid optimizer: 'param group 0 holding stacked members \[0, 3\]' \(expected "
        r"every parameter of a param group stacked with the same number of members \(0: "
        r"unstacked\), so that members are never mixed\)$",
    ):
        mixed.temperature_estimates()
    with pytest.raises(
        ValueError, match=r"^Invalid probability: 1\.0 \(expected a number in \(0, 1\)\)$"
    ):
        chi2_quantile(1.0, 3)
    with pytest.raises(ValueError, match=r"^Invalid dof: 0 \(expected an integer >= 1\)$"):
        chi2_quantile(0.5, 0)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def test_a_group_of_one_scalar_has_no_configurational_band() -> None:
    """One term has no spread: reported without a band (found with a likelihood's sigma)."""
    sigma = torch.nn.Parameter(torch.zeros(()))
    optimizer = sao.SGHMC([sigma], lr=1e-3, num_data=240, seed=0)
    monitor = diagnostics.TemperatureMonitor(optimizer, every=5)
    for step in range(10):
        optimizer.zero_grad()
        (0.5 * (sigma - 0.1 * step) ** 2).backward()
        optimizer.step()
    (report,) = monitor.report()
    assert report.configurational is not None and report.configurational.dof == 1
    assert report.configurational.low == -math.inf and report.configurational.high == math.inf
    assert not report.configurational.hot and not report.configurational.cold
    monitor.remove()


@pytest.mark.parametrize(
    ("cls", "kwargs"),
    [
        (sao.SGHMC, {"momentum": 0.8, "weight_decay": 0.3, "maximize": True}),
        (sao.BAOA, {"momentum": 0.7}),
    ],
)
@pytest.mark.parametrize("coordinates", [4096, 40, None])
def test_the_common_path_gives_the_general_paths_sums(cls, kwargs, coordinates, monkeypatch):
    """An unstacked SGHMC/BAOA group (a ``plain`` rule) takes a leaner path
    (``_plain_kinetic``, ``_plain_configurational``), the same sums as the general loop to
    rounding, with and without the terms' spread, after an lr change (the buffers'
    recorded rate) too."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(30, 20), torch.nn.Tanh(), torch.nn.Linear(20, 3))
    optimizer = cls(model.parameters(), lr=1e-3, num_data=500, seed=0, **kwargs)
    rule = optimizer.definition.temperature_rule
    assert rule.plain
    x, y = torch.randn(16, 30), torch.randn(16, 3)
    for lr in (1e-3, 3e-3):
        optimizer.param_groups[0]["lr"] = lr
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    group = optimizer.param_groups[0]
    for spread in (False, True):
        lean = group_sums(rule, group, 0, optimizer.state, spread=spread, coordinates=coordinates)
        with monkeypatch.context() as patch:
            patch.setattr(TemperatureRule, "plain", property(lambda self: False))
            general = group_sums(
                rule, group, 0, optimizer.state, spread=spread, coordinates=coordinates
            )
        assert (lean.kinetic_dof, lean.conf_dof) == (general.kinetic_dof, general.conf_dof)
        torch.testing.assert_close(lean.kinetic, general.kinetic, rtol=1e-6, atol=0.0)
        torch.testing.assert_close(lean.conf, general.conf, rtol=1e-5, atol=1e-9)
        if spread:
            torch.testing.assert_close(
                lean.conf_variance, general.conf_variance, rtol=1e-4, atol=0.0
            )
        else:
            assert lean.conf_variance is None and general.conf_variance is None
