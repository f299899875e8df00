"""StepSizeWarmup's restart: a chain whose lr is past its stability limit starts again.

The target is the Gaussian of ``test_step_size_warmup`` (d = 400, precisions of N L from
1 to 10, N = 100), on which SGHMC's step is stable while lr * lambda_max / N < 2 (1 + mu)
= 3.8, i.e. lr < 38: from lr 400 the chain diverges within a few steps, and a window's
Robbins-Monro step (at most a factor e^0.5) cannot catch it.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_step_size_warmup import D, N, _steps, assert_quiet_at_the_law, checkpointed

from samplers_as_optim import SGHMC, SGLD, StepSizeWarmup
from samplers_as_optim.sgmcmc.temperature.restart import DivergenceWatch


def _watched(values: list[float]) -> list[bool]:
    watch = DivergenceWatch()
    return [watch.observe(v) for v in values]


def test_the_watch_sees_geometric_growth_and_nothing_else() -> None:
    # the regression benchmark at 10x the guide's lr: 27-, 46- and 44-fold
    assert _watched([0.026, 0.69, 32.0, 1400.0]) == [False, False, False, True]
    # growth by 5 a step (1.2x past the limit): caught once 1000x the level before
    grown = _watched([1.0 * 5**k for k in range(8)])
    assert grown.index(True) == 5  # 5^5 = 3125 >= 1000, after 5 steps of growth
    # thermalising from rest: s ~ t^3 (ratios 8, 3.4, 2.4, ...), never
    assert not any(_watched([float(t**3) for t in range(1, 200)]))
    # a stable oscillation's zero crossing: a run of growth back to its earlier peak
    assert not any(_watched([1.0, 0.5, 1e-4, 1e-2, 0.2, 1.0, 0.4, 1e-3, 0.05, 0.9]))
    # descending from an initialisation: shrinking
    assert not any(_watched([100.0 * 0.9**t for t in range(100)]))
    # not finite: diverged
    assert _watched([1.0, math.inf]) == [False, True]
    assert _watched([1.0, math.nan]) == [False, True]
    # resumed from its state, the same verdicts
    watch = DivergenceWatch()
    for value in (0.026, 0.69, 32.0):
        watch.observe(value)
    assert DivergenceWatch.from_state(watch.state()).observe(1400.0)


def test_from_ten_times_past_the_stability_limit_the_chain_restarts_and_samples() -> None:
    theta = torch.nn.Parameter(torch.zeros(D))
    opt = SGHMC([theta], lr=400.0, momentum=0.9, num_data=N, seed=2)
    warmup = StepSizeWarmup(opt, steps=1500, every=10)
    _steps(opt, theta, 1500)
    assert warmup.done
    # 400 -> 40, early, from the start (theta = 0); 40 is just past the limit (its
    # stiffest mode grows by 1.5 a step, not a divergence the watch calls): the windows'
    # adaptation takes it below 38
    assert [lrs[0] for _, lrs in warmup.restarts] == pytest.approx([40.0])
    assert all(step < 20 for step, _ in warmup.restarts)
    assert opt.param_groups[0]["lr"] < 38.0
    assert_quiet_at_the_law(opt, theta, quiet=1000, sampled=4000)


def test_without_restarts_the_same_chain_diverges() -> None:
    theta = torch.nn.Parameter(torch.zeros(D))
    opt = SGHMC([theta], lr=400.0, momentum=0.9, num_data=N, seed=2)
    warmup = StepSizeWarmup(opt, steps=1500, every=10, max_restarts=0)
    with pytest.raises(FloatingPointError):
        _steps(opt, theta, 1500)
    assert warmup.restarts == []


def test_a_stable_chain_of_one_coordinate_never_restarts() -> None:
    """One coordinate is the noisiest gradient norm there is: no false restart."""
    theta = torch.nn.Parameter(torch.zeros(1))
    opt = SGHMC([theta], lr=20.0, momentum=0.9, num_data=N, seed=5)
    warmup = StepSizeWarmup(opt, steps=3000, every=10)
    for _ in range(3000):
        opt.zero_grad()
        (5.0 * theta.square().sum() / N).backward()
        opt.step()
    assert warmup.restarts == []


def test_after_the_last_restart_the_warm_up_stops_intervening() -> None:
    theta = torch.nn.Parameter(torch.zeros(D))
    opt = SGHMC([theta], lr=40000.0, momentum=0.9, num_data=N, seed=2)
    warmup = StepSizeWarmup(opt, steps=1500, every=10, max_restarts=1)
    with pytest.raises(FloatingPointError):  # 4000 is still far past the limit
        _steps(opt, theta, 1500)
    assert len(warmup.restarts) == 1


@pytest.mark.parametrize("split", [2, 9, 137])  # before the restart (at step 4) and after
def test_a_checkpoint_resumes_the_restarts_exactly(split: int) -> None:
    lrs, theta, warmup = checkpointed(None, lr=400.0)
    assert len(warmup.restarts) == 1 and warmup.restarts[0][0] < 9
    resumed_lrs, resumed, resumed_warmup = checkpointed(split, lr=400.0)
    assert resumed_warmup.restarts == warmup.restarts
    assert resumed_lrs == lrs
    assert torch.equal(resumed, theta)


def test_a_state_saved_before_restarts_existed_still_loads() -> None:
    theta = torch.nn.Parameter(torch.zeros(D))
    opt = SGLD([theta], lr=1.0, num_data=N, seed=4)
    warmup = StepSizeWarmup(opt, steps=100, every=10)
    _steps(opt, theta, 25)
    state = warmup.state_dict()
    for name in ("restarts", "windows", "watch", "cap", "snapshot"):
        del state[name]
    resumed = StepSizeWarmup(opt, steps=100, every=10)
    warmup.remove()
    resumed.load_state_dict(state)
    _steps(opt, theta, 75)
    assert resumed.done and len(resumed.history) == 10


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (-1, ValueError, r"Invalid max_restarts: -1 \(expected"),
        (1.5, TypeError, r"Invalid max_restarts: 1\.5 \(expected"),
        ("2", TypeError, r"Invalid max_restarts: '2' \(expected"),
    ],
)
def test_bad_max_restarts_is_refused(value: object, error: type, match: str) -> None:
    opt = SGLD([torch.nn.Parameter(torch.zeros(3))], lr=1.0, num_data=N)
    with pytest.raises(error, match=match):
        StepSizeWarmup(opt, steps=100, max_restarts=value)  # type: ignore[arg-type]
    assert not opt._optimizer_step_pre_hooks
