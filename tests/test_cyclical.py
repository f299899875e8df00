"""CyclicalSGMCMC: Zhang et al.'s Eq. (1) step by step, the temperature switch, the samplers
it drives, restarts that do not heat the chain, resume, SampleCollector, every error.
"""

from __future__ import annotations

import copy
import math
import re

import pytest
import torch

from samplers_as_optim import (
    BAOA,
    HMC,
    PSGLD,
    SGHMC,
    SGLD,
    SGNHT,
    CyclicalSGMCMC,
    SampleCollector,
)


def quadratic_step(opt, theta, precision=1.0, num_data=100):
    theta.grad = precision * theta.detach() / num_data
    opt.step()


def test_lr_temperature_and_sampling_follow_eq_1_per_group():
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    opt = SGLD(
        [{"params": [a]}, {"params": [b], "lr": 0.02, "temperature": 0.5}],
        lr=0.1, num_data=10, temperature=1.5, seed=0,
    )  # fmt: skip
    sched = CyclicalSGMCMC(opt, cycle_length=10, num_cycles=2, exploration=0.8)
    assert sched.total_steps == 20
    for k in range(20):
        rho = (k % 10) / 10
        factor = (math.cos(math.pi * rho) + 1) / 2
        sampling = rho >= 0.8
        assert sched.is_sampling is sampling and sched.sampling_at(k) is sampling
        assert sched.cycle == k // 10
        for group, lr0, target in zip(opt.param_groups, (0.1, 0.02), (1.5, 0.5), strict=True):
            assert group["lr"] == pytest.approx(lr0 * factor, rel=1e-15)
            assert group["temperature"] == (target if sampling else 0.0)
        quadratic_step(opt, a)
        sched.step()
    with pytest.raises(
        ValueError,
        match=re.escape(
            "CyclicalSGMCMC stepped 21 times, past its total_steps=20 (cycle_length=10 x "
            "num_cycles=2); build it with more cycles"
        ),
    ):
        sched.step()


@pytest.mark.parametrize(
    ("cls", "kwargs", "sched_kwargs"),
    [
        (SGLD, {}, {}),
        (SGHMC, {"momentum": 0.9}, {}),
        (BAOA, {"momentum": 0.9}, {}),
        (PSGLD, {"alpha": 0.99}, {}),
        (SGNHT, {"momentum": 0.9}, {"exploration_temperature": 0.01}),
        (SGNHT, {"momentum": 0.9}, {"exploration": 0.0}),
    ],
    ids=["sgld", "sghmc", "baoa", "psgld", "sgnht-warm", "sgnht-no-exploration"],
)
def test_drives_every_sampler(cls, kwargs, sched_kwargs):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = cls(model.parameters(), lr=0.01, num_data=100, seed=1, **kwargs)
    sched = CyclicalSGMCMC(opt, cycle_length=8, num_cycles=2, **sched_kwargs)
    temperatures = []
    for _ in range(sched.total_steps):
        opt.zero_grad()
        model(torch.randn(16, 4)).pow(2).mean().backward()
        temperatures.append(opt.param_groups[0]["temperature"])
        opt.step()
        sched.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    explore = sched_kwargs.get("exploration_temperature", 0.0)
    expected = [1.0 if sched.sampling_at(k) else explore for k in range(16)]
    assert temperatures == expected


# ---------------------------------------------------------------- restarts
K = 4000  # chains, the elements of one parameter: N L = x^2 / 2, target N(0, T)


def restart_run(cls, kwargs, exploration, *, cycle_length=200, seed=0):
    """Position sd at the end of cycle 1's sampling stage and its max over cycle 2's start."""
    theta = torch.nn.Parameter(torch.randn(K, generator=torch.Generator().manual_seed(seed)))
    opt = cls([theta], lr=1.0, num_data=100, seed=seed, **kwargs)
    sched = CyclicalSGMCMC(opt, cycle_length=cycle_length, num_cycles=2, exploration=exploration)
    sds = []
    for _ in range(cycle_length + 30):
        quadratic_step(opt, theta)
        sched.step()
        sds.append(theta.detach().std().item())
    return sds[cycle_length - 1], max(sds[cycle_length:])


CASES = [
    (SGHMC, {"momentum": 0.9}, 0.5),
    (BAOA, {"momentum": 0.9}, 0.5),
    (SGNHT, {"momentum": 0.9}, 0.0),  # at T > 0 all along: the sampler rescales itself
]


@pytest.mark.parametrize(("cls", "kwargs", "exploration"), CASES, ids=["sghmc", "baoa", "sgnht"])
def test_a_restart_does_not_heat_the_chain(cls, kwargs, exploration):
    """lr jumps from ~6e-5 (end of a cycle) to 1 (restart): with the physical momentum kept
    the position sd stays within sqrt(2) of the target's 1 (a noiseless damped oscillator
    from a thermal state: E[x^2 + r^2] does not grow), plus Monte Carlo error."""
    end, after = restart_run(cls, kwargs, exploration)
    assert abs(end - 1.0) < 0.1  # sampling the target (sd 1) at the end of cycle 1
    assert after < math.sqrt(2) * 1.1, after


def test_without_the_re_expression_a_restart_at_temperature_zero_overheats(monkeypatch):
    """The check above can fail: without the scheduler's rescaling, SGHMC at T = 0 treats
    the end-of-cycle buffer (~130 times too large in the restart's units) as SGD's."""
    monkeypatch.setattr(SGHMC, "reexpress_state", lambda *a, **k: None)
    _, after = restart_run(SGHMC, {"momentum": 0.9}, 0.5)
    assert after > 10, after


# ---------------------------------------------------------------- resume, collector
def test_optimizer_and_scheduler_state_dicts_resume_the_same_chain():
    def build():
        theta = torch.nn.Parameter(torch.linspace(-1, 1, 6))
        opt = SGHMC([theta], lr=0.5, num_data=100, seed=4)
        return theta, opt, CyclicalSGMCMC(opt, cycle_length=10, num_cycles=3, exploration=0.3)

    theta, opt, sched = build()
    for _ in range(25):
        quadratic_step(opt, theta)
        sched.step()
    straight = theta.detach().clone()

    theta, opt, sched = build()
    for _ in range(13):
        quadratic_step(opt, theta)
        sched.step()
    saved = copy.deepcopy(
        {"theta": theta.detach(), "opt": opt.state_dict(), "sched": sched.state_dict()}
    )
    theta, opt, sched = build()
    with torch.no_grad():
        theta.copy_(saved["theta"])
    opt.load_state_dict(saved["opt"])
    sched.load_state_dict(saved["sched"])
    for _ in range(12):
        quadratic_step(opt, theta)
        sched.step()
    assert torch.equal(theta.detach(), straight)


def test_sample_collector_records_sampling_steps_only():
    theta = torch.nn.Parameter(torch.zeros(3))
    opt = SGLD([theta], lr=0.1, num_data=10, seed=0)
    sched = CyclicalSGMCMC(opt, cycle_length=5, num_cycles=2, exploration=0.6)
    collector = SampleCollector({"theta": theta}, num_samples=4)
    expected = []
    for _ in range(sched.total_steps):
        quadratic_step(opt, theta)
        sampling = sched.is_sampling
        assert collector.step(sampling=sampling) is sampling
        if sampling:
            expected.append(theta.detach().clone())
        sched.step()
    assert collector.count == 4 and collector.steps == 10
    assert torch.equal(collector.samples["theta"], torch.stack(expected))


# ---------------------------------------------------------------- errors
def make_sgld():
    return SGLD([torch.nn.Parameter(torch.zeros(2))], lr=0.1, num_data=10)


INVALID_ARGUMENTS = [
    ("cycle_length", 0, ValueError, "an integer >= 1"),
    ("num_cycles", 1.5, TypeError, "an integer >= 1"),
    ("num_cycles", True, TypeError, "an integer >= 1"),
    ("exploration", 1.0, ValueError, "a number in [0, 1)"),
    ("exploration", 5.0, ValueError, "a number in [0, 1)"),
    ("exploration", math.nan, ValueError, "a finite number >= 0"),
    ("exploration", "0.5", TypeError, "a finite number >= 0"),
    ("exploration_temperature", -1.0, ValueError, "a finite number >= 0"),
    ("exploration_temperature", math.inf, ValueError, "a finite number >= 0"),
]
INVALID_IDS = [f"{name}={value!r}" for name, value, _, _ in INVALID_ARGUMENTS]


def assert_same_state(before, after):
    assert before.keys() == after.keys()
    for key, value in before.items():
        assert type(after[key]) is type(value) and after[key] == value, key


def advance(opt, sched, steps):
    for _ in range(steps):
        quadratic_step(opt, opt.param_groups[0]["params"][0])
        sched.step()


def optimizer_snapshot(opt):
    return copy.deepcopy(opt.state_dict())


@pytest.mark.parametrize(("name", "value", "error", "expected"), INVALID_ARGUMENTS, ids=INVALID_IDS)
def test_invalid_arguments(name, value, error, expected):
    arguments = {"cycle_length": 10, "num_cycles": 2, name: value}
    opt = make_sgld()
    before = optimizer_snapshot(opt)
    message = f"Invalid {name}: {value!r} (expected {expected})"
    with pytest.raises(error, match="^" + re.escape(message) + "$"):
        CyclicalSGMCMC(opt, **arguments)
    assert optimizer_snapshot(opt) == before  # no initial_lr / initial_temperature left behind


@pytest.mark.parametrize(("name", "value", "error", "expected"), INVALID_ARGUMENTS, ids=INVALID_IDS)
def test_load_state_dict_refuses_what_the_constructor_refuses(name, value, error, expected):
    """The same validator, the same words: ``Invalid state_dict: name=value (expected ...)``;
    the scheduler (and its optimizer) unchanged after the refusal."""
    opt = make_sgld()
    sched = CyclicalSGMCMC(opt, cycle_length=10, num_cycles=2, exploration=0.5)
    advance(opt, sched, 7)
    before, opt_before = sched.state_dict(), optimizer_snapshot(opt)
    state = {**copy.deepcopy(before), name: value}
    message = f"Invalid state_dict: {name}={value!r} (expected {expected})"
    with pytest.raises(error, match="^" + re.escape(message) + "$"):
        sched.load_state_dict(state)
    assert_same_state(before, sched.state_dict())
    assert optimizer_snapshot(opt) == opt_before
    assert sched.is_sampling and sched.last_epoch == 7


@pytest.mark.parametrize(
    ("field", "value", "error", "message"),
    [
        (
            "base_temperatures",
            [1.0, 1.0],
            ValueError,
            "Invalid state_dict: base_temperatures=[1.0, 1.0] (expected a list of 1 number(s), "
            "one per param group)",
        ),
        (
            "base_temperatures",
            [-1.0],
            ValueError,
            "Invalid state_dict: base_temperatures[0]=-1.0 (expected a finite number >= 0)",
        ),
        (
            "base_lrs",
            [math.nan],
            ValueError,
            "Invalid state_dict: base_lrs[0]=nan (expected a finite number >= 0)",
        ),
        (
            "base_lrs",
            0.1,
            ValueError,
            "Invalid state_dict: base_lrs=0.1 (expected a list of 1 number(s), one per param "
            "group)",
        ),
        (
            "last_epoch",
            -1,
            ValueError,
            "Invalid state_dict: last_epoch=-1 (expected an integer >= 0)",
        ),
        (
            "last_epoch",
            21,
            ValueError,
            "Invalid state_dict: last_epoch=21 (expected an integer in [0, 20], the steps of "
            "cycle_length=10 x num_cycles=2)",
        ),
        (
            "last_epoch",
            2.5,
            TypeError,
            "Invalid state_dict: last_epoch=2.5 (expected an integer >= 0)",
        ),
        (
            "_sampling",
            False,
            ValueError,
            "Invalid state_dict: _sampling=False (expected True: step 7 of this schedule samples)",
        ),
        (
            "optimizer",
            None,
            ValueError,
            "Invalid state_dict: field 'optimizer' (expected the schedule only, as "
            "CyclicalSGMCMC.state_dict: the scheduler keeps the optimizer it was built with)",
        ),
    ],
    ids=[
        "base_temperatures-length",
        "base_temperatures-negative",
        "base_lrs-nan",
        "base_lrs-not-a-list",
        "last_epoch-negative",
        "last_epoch-past-the-end",
        "last_epoch-float",
        "_sampling-inconsistent",
        "optimizer-entry",
    ],
)
def test_load_state_dict_refuses_inconsistent_fields(field, value, error, message):
    opt = make_sgld()
    sched = CyclicalSGMCMC(opt, cycle_length=10, num_cycles=2, exploration=0.5)
    advance(opt, sched, 7)
    before = sched.state_dict()
    state = {**copy.deepcopy(before), field: value}
    with pytest.raises(error, match="^" + re.escape(message) + "$"):
        sched.load_state_dict(state)
    assert_same_state(before, sched.state_dict())


def test_load_state_dict_refuses_a_missing_field_or_a_non_mapping():
    sched = CyclicalSGMCMC(make_sgld(), cycle_length=10, num_cycles=2)
    before = sched.state_dict()
    state = copy.deepcopy(before)
    del state["exploration"], state["last_epoch"]
    message = (
        "Invalid state_dict: missing field(s) ['exploration', 'last_epoch'] (expected a state "
        "from CyclicalSGMCMC.state_dict)"
    )
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        sched.load_state_dict(state)
    message = "Invalid state_dict: list (expected a mapping from CyclicalSGMCMC.state_dict)"
    with pytest.raises(TypeError, match="^" + re.escape(message) + "$"):
        sched.load_state_dict([])
    assert_same_state(before, sched.state_dict())


def test_load_state_dict_accepts_a_valid_state_of_another_schedule():
    """A valid state replaces the schedule (the state is the checkpoint's, not the build's)."""
    opt = make_sgld()
    source = CyclicalSGMCMC(opt, cycle_length=4, num_cycles=3, exploration=0.0)
    advance(opt, source, 5)
    sched = CyclicalSGMCMC(make_sgld(), cycle_length=10, num_cycles=2, exploration=0.5)
    sched.load_state_dict(source.state_dict())
    assert_same_state(source.state_dict(), sched.state_dict())
    assert sched.total_steps == 12 and sched.is_sampling and sched.cycle == 1


def test_load_state_dict_refuses_a_zero_exploration_temperature_for_sgnht():
    opt = SGNHT([torch.nn.Parameter(torch.zeros(2))], lr=0.1, num_data=10)
    sched = CyclicalSGMCMC(opt, 10, 2, exploration_temperature=0.01)
    before = sched.state_dict()
    message = (
        "Invalid state_dict: exploration_temperature=0.0 (expected a finite number > 0 for "
        "SGNHT: SGNHT needs temperature > 0 (its dynamics diverge at temperature 0) and the "
        "cyclical schedule's exploration stage runs at exploration_temperature, by default 0; "
        "or exploration=0)"
    )
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        sched.load_state_dict({**before, "exploration_temperature": 0.0})
    message = "Invalid state_dict: base_temperatures[0]=0.0 (expected a finite number > 0)"
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        sched.load_state_dict({**before, "base_temperatures": [0.0]})
    assert_same_state(before, sched.state_dict())


def test_a_non_sampler_is_refused():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    before = optimizer_snapshot(opt)
    message = "Invalid optimizer: SGD (expected a sampler: param group 0 has no temperature)"
    with pytest.raises(TypeError, match="^" + re.escape(message) + "$"):
        CyclicalSGMCMC(opt, 10, 2)
    assert optimizer_snapshot(opt) == before


@pytest.mark.parametrize(
    "optimizer", ["x", None, [torch.nn.Parameter(torch.zeros(2))]], ids=["str", "none", "params"]
)
def test_a_non_optimizer_is_refused_first(optimizer):
    """The type of ``optimizer`` is checked before anything reads it (and before the other
    arguments: cycle_length=0 would be refused too)."""
    message = (
        f"Invalid optimizer: {type(optimizer).__name__} (expected a sampler: a "
        "torch.optim.Optimizer whose param groups have a temperature, e.g. SGHMC)"
    )
    for cycle_length in (10, 0):
        with pytest.raises(TypeError, match="^" + re.escape(message) + "$"):
            CyclicalSGMCMC(optimizer, cycle_length, 2)


def test_sgnht_needs_a_positive_exploration_temperature():
    opt = SGNHT([torch.nn.Parameter(torch.zeros(2))], lr=0.1, num_data=10)
    before = optimizer_snapshot(opt)
    message = (
        "Invalid exploration_temperature: None (expected a finite number > 0 for SGNHT: "
        "SGNHT needs temperature > 0 (its dynamics diverge at temperature 0) and the cyclical "
        "schedule's exploration stage runs at exploration_temperature, by default 0; or "
        "exploration=0)"
    )
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        CyclicalSGMCMC(opt, 10, 2)
    assert optimizer_snapshot(opt) == before


def make_hmc():
    theta = torch.nn.Parameter(torch.ones(3))
    opt = HMC([theta], lr=0.1, num_steps=3, num_data=10, seed=0)

    def closure():
        opt.zero_grad()
        loss = 0.5 * theta.square().sum() / 10
        loss.backward()
        return loss

    return theta, opt, closure


@pytest.mark.parametrize("exploration_temperature", [None, 0.0])
def test_hmc_needs_a_positive_exploration_temperature(exploration_temperature):
    """HMC's Metropolis test divides by T: an exploration stage at T = 0 is refused at
    construction, not at the first HMC.step."""
    _, opt, _ = make_hmc()
    before = optimizer_snapshot(opt)
    message = (
        f"Invalid exploration_temperature: {exploration_temperature!r} (expected a finite "
        "number > 0 for HMC: HMC needs temperature > 0 (its Metropolis test divides by T) and "
        "the cyclical schedule's exploration stage runs at exploration_temperature, by "
        "default 0; or exploration=0)"
    )
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        CyclicalSGMCMC(opt, 10, 2, exploration_temperature=exploration_temperature)
    assert optimizer_snapshot(opt) == before


@pytest.mark.parametrize(
    "sched_kwargs", [{"exploration_temperature": 0.05}, {"exploration": 0.0}], ids=["warm", "none"]
)
def test_drives_hmc_at_positive_temperature(sched_kwargs):
    theta, opt, closure = make_hmc()
    sched = CyclicalSGMCMC(opt, cycle_length=4, num_cycles=2, **sched_kwargs)
    explore = sched_kwargs.get("exploration_temperature", 0.0)
    for k in range(sched.total_steps):
        assert opt.param_groups[0]["temperature"] == (1.0 if sched.sampling_at(k) else explore)
        opt.step(closure)
        sched.step()
    assert bool(torch.isfinite(theta).all())


def test_step_takes_no_epoch():
    sched = CyclicalSGMCMC(make_sgld(), 10, 2)
    message = "CyclicalSGMCMC.step() takes no epoch (it counts steps itself)"
    with pytest.raises(TypeError, match="^" + re.escape(message) + "$"):
        sched.step(3)


def test_docstring_example_runs():
    import doctest

    finder, runner = doctest.DocTestFinder(recurse=False), doctest.DocTestRunner()
    tests = finder.find(CyclicalSGMCMC, "CyclicalSGMCMC", globs={})
    assert tests and any(test.examples for test in tests)
    for test in tests:
        runner.run(test)
    assert runner.failures == 0
