"""The sampling preconditioner's floor: preconditioned chains started at a mode stay sane.

At a mode the full-batch gradient vanishes, and a preconditioner built from it would be
:math:`\\epsilon`: no noise at all (the chain never leaves the mode) or, a hair away,
noise :math:`\\sigma/\\sqrt a` that throws the chain out (issue #36: the twin started at
the MAP scored RMSE 8.7-11.7 where the MAP's was 3-4). With the prior's curvature
:math:`\\lambda` known (PSGLD's coupled ``weight_decay``, the twin's
``prior_weight_decay``), :math:`\\bar V/c \\ge T\\lambda/N`, the stationary second moment's
lower bound, and the chain samples its law from the mode.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from samplers_as_optim import (
    PSGLD,
    AdamWSGHMC,
    GaussianLikelihood,
    prior_loss,
    prior_param_groups,
)
from samplers_as_optim.sgmcmc.sampling_preconditioner import prior_floor

D, N = 200, 100
H = torch.linspace(0.5, 5.0, D)  # the likelihood's curvature of L, per coordinate
PRIOR = 1.0  # the prior's, as a weight decay: N(0, 1 / (N PRIOR))


def _series(opt: torch.optim.Optimizer, theta: torch.Tensor, steps: int, *, in_loss: bool):
    """E-statistic per step: mean_i N (h_i + PRIOR) theta_i^2 / T, 1 under the target."""
    values = []
    for _ in range(steps):
        opt.zero_grad()
        loss = 0.5 * (H * theta.square()).sum()
        if in_loss:
            loss = loss + 0.5 * PRIOR * theta.square().sum()
        loss.backward()
        opt.step()
        values.append(float((N * (H + PRIOR) * theta.detach().square()).mean()))
    return torch.tensor(values, dtype=torch.float64)


def _assert_law(values: torch.Tensor, allowance: float) -> None:
    """Mean 1 within 4 standard errors (20 batch means) and the step-size bias allowed."""
    error = float(values.view(20, -1).mean(1).std()) / math.sqrt(20)
    assert abs(float(values.mean()) - 1) < 4 * error + allowance, float(values.mean())


def test_the_floor_is_the_priors_share_of_the_stationary_second_moment() -> None:
    assert prior_floor(2.0, 0.5, 100) == pytest.approx(0.01)
    assert prior_floor(1.0, 0.0, 100) == 0.0
    assert prior_floor(0.0, 0.5, 100) == 0.0  # temperature 0: the optimizer, no floor


def test_psgld_started_exactly_at_the_mode_samples_its_law() -> None:
    theta = torch.nn.Parameter(torch.zeros(D))  # the mode: every gradient is 0
    opt = PSGLD([theta], lr=1e-3, num_data=N, weight_decay=PRIOR, seed=0)
    values = _series(opt, theta, 1500, in_loss=False)  # warm-up (1000) and after
    assert float(theta.detach().abs().max()) > 0  # it left the mode
    assert float(values.max()) < 10  # never thrown out
    # after the freeze: the law, up to a step-size bias of lr (h + PRIOR) / (2 a) < 1%
    _assert_law(_series(opt, theta, 6000, in_loss=False), 0.01)


def test_the_twin_started_exactly_at_the_mode_samples_its_law() -> None:
    theta = torch.nn.Parameter(torch.zeros(D))
    opt = AdamWSGHMC(
        [theta], lr=1e-3, num_data=N, weight_decay=0.0, prior_weight_decay=PRIOR, seed=1
    )
    values = _series(opt, theta, 1500, in_loss=True)  # the prior in the loss
    assert float(theta.detach().abs().max()) > 0 and float(values.max()) < 10
    _assert_law(_series(opt, theta, 6000, in_loss=True), 0.01)


def test_without_a_prior_the_twin_at_the_mode_does_not_move() -> None:
    """What the floor cures: no scale, no noise (``sampling_preconditioner``)."""
    theta = torch.nn.Parameter(torch.zeros(D))
    opt = AdamWSGHMC([theta], lr=1e-3, num_data=N, weight_decay=0.0, seed=1)
    _series(opt, theta, 20, in_loss=True)
    assert float(theta.detach().abs().max()) == 0


def test_a_hair_from_the_mode_the_floor_keeps_the_first_steps_small() -> None:
    start = 1e-6 * torch.randn(D, generator=torch.Generator().manual_seed(2))
    largest = {}
    for floor in (0.0, PRIOR):
        theta = torch.nn.Parameter(start.clone())
        opt = AdamWSGHMC(
            [theta], lr=1e-3, num_data=N, weight_decay=0.0, prior_weight_decay=floor, seed=3
        )
        largest[floor] = float(_series(opt, theta, 300, in_loss=True).max())
    # without it the first steps throw the chain out: 20 times the target's variance
    # (measured: 19.8); with it the chain never leaves the target's scale (1.25)
    assert largest[0.0] > 10
    assert largest[PRIOR] < 2


def test_temperature_zero_is_still_adamw_bit_for_bit() -> None:
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(5, 3))
    b = torch.nn.Parameter(a.detach().clone())
    twin = AdamWSGHMC([a], lr=1e-2, num_data=N, temperature=0.0, prior_weight_decay=3.0)
    adamw = torch.optim.AdamW([b], lr=1e-2)
    for _ in range(5):
        for p, opt in ((a, twin), (b, adamw)):
            opt.zero_grad()
            (p.square().sum() + p.sum()).backward()
            opt.step()
    assert torch.equal(a, b)


def test_decoupled_prior_groups_carry_the_prior_for_the_floor() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
    groups = prior_param_groups(model, num_data=100, decoupled=True)
    coupled = prior_param_groups(model, num_data=100)
    assert [g["weight_decay"] for g in groups] == [0.0] * len(coupled)
    assert [g["prior_weight_decay"] for g in groups] == [g["weight_decay"] for g in coupled]
    twin = AdamWSGHMC(groups, lr=1e-3, num_data=100)  # accepted: no decoupled decay
    assert [g["prior_weight_decay"] for g in twin.param_groups] == [
        g["weight_decay"] for g in coupled
    ]
    torch.optim.AdamW(prior_param_groups(model, num_data=100, decoupled=True))  # ignored key
    with pytest.raises(TypeError, match=r"Invalid decoupled: 'yes' \(expected True or False\)"):
        prior_param_groups(model, num_data=100, decoupled="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"Invalid prior_weight_decay: -1\.0"):
        AdamWSGHMC(model.parameters(), num_data=100, prior_weight_decay=-1.0)


def test_a_decoupled_decay_at_temperature_above_zero_is_warned_about() -> None:
    param = torch.nn.Parameter(torch.zeros(3))
    with pytest.warns(UserWarning, match=r"weight_decay 0\.25 at temperature 1\.0 is AdamW's"):
        AdamWSGHMC([param], num_data=10, weight_decay=0.25)
    model = torch.nn.Linear(3, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        AdamWSGHMC([param], num_data=10, weight_decay=0.25, temperature=0.0)  # AdamW
        AdamWSGHMC([param], num_data=10, weight_decay=0.0)  # the prior in the loss
        AdamWSGHMC(prior_param_groups(model, num_data=10, decoupled=True), num_data=10)


def _twin_from_the_mode(groups_of, steps: int = 5) -> float:
    """How far the twin moves log σ in ``steps`` steps from a regression's mode."""
    torch.manual_seed(0)
    x = torch.randn(200, 3)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5]]) + 0.3 * torch.randn(200, 1)
    model = torch.nn.ModuleDict(
        {"net": torch.nn.Linear(3, 1), "likelihood": GaussianLikelihood(num_data=200)}
    )
    fit = torch.optim.Adam(prior_param_groups(model, num_data=200), lr=0.05)
    for _ in range(1500):  # to the MAP, where the gradient in log σ vanishes
        fit.zero_grad()
        model["likelihood"](model["net"](x), y).backward()
        fit.step()
    start = float(model["likelihood"].log_noise_std.detach())
    twin = AdamWSGHMC(groups_of(model), lr=1e-3, num_data=200, seed=0)
    for _ in range(steps):
        twin.zero_grad()
        loss = model["likelihood"](model["net"](x), y) + prior_loss(model, num_data=200)
        loss.backward()
        twin.step()
    return abs(float(model["likelihood"].log_noise_std.detach()) - start)


def test_the_twin_from_the_mode_keeps_sigma_where_the_likelihood_holds_it() -> None:
    """GaussianLikelihood's log σ: its Fisher information, 2 per observation, floors it.

    At the MAP the gradient in log σ vanishes: without a floor the twin's first step
    threw log σ by several times its posterior sd, sqrt(1/(2N)) = 0.05 here (its prior
    is in the likelihood's loss, so no prior floors it).
    """
    groups = prior_param_groups(
        torch.nn.ModuleDict({"l": GaussianLikelihood(num_data=9)}), num_data=9, decoupled=True
    )
    assert [g["prior_weight_decay"] for g in groups] == [2.0]  # the Fisher, per datum
    unfloored = _twin_from_the_mode(
        lambda m: [
            {**g, "prior_weight_decay": 0.0} if "likelihood" in g["params"][0][0] else g
            for g in prior_param_groups(m, num_data=200, decoupled=True)
        ]
    )
    floored = _twin_from_the_mode(lambda m: prior_param_groups(m, num_data=200, decoupled=True))
    assert unfloored > 0.2  # four posterior sds and more
    assert floored < 0.05  # within one


@pytest.mark.parametrize("sampler", ["SGLD", "SGHMC", "SGNHT", "BAOA", "PSGLD"])
def test_a_sampler_with_a_coupled_decay_warns_that_it_ignores_a_decoupled_prior(sampler) -> None:
    """The twin's groups given to SGHMC: weight_decay 0, the prior only in an unread key.

    Without ``prior_loss`` in the loss that chain samples no prior at all; each group
    with a prior says so, at the caller's line; the coupled groups, temperature 0, a
    group with its own weight_decay and the twin itself say nothing.
    """
    import samplers_as_optim

    cls = getattr(samplers_as_optim, sampler)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
    decoupled = prior_param_groups(model, num_data=100, decoupled=True)
    with pytest.warns(UserWarning) as caught:
        cls(decoupled, lr=1e-3, num_data=100)
    assert len(caught) == len(decoupled) == 3
    for index, (warning, group) in enumerate(zip(caught, decoupled, strict=True)):
        assert str(warning.message).startswith(
            f"{sampler} ignores prior_weight_decay {group['prior_weight_decay']!r} in param "
            f"group {index}: it is the prior of an optimizer whose weight_decay is decoupled"
        )
        assert warning.filename == __file__
    quiet = [
        lambda: cls(prior_param_groups(model, num_data=100), lr=1e-3, num_data=100),
        lambda: AdamWSGHMC(
            prior_param_groups(model, num_data=100, decoupled=True), lr=1e-3, num_data=100
        ),
        lambda: cls(
            [
                {**g, "weight_decay": 0.5}
                for g in prior_param_groups(model, num_data=100, decoupled=True)
            ],
            lr=1e-3,
            num_data=100,
        ),
    ]
    if sampler != "SGNHT":  # (SGNHT needs a temperature > 0)
        quiet.append(
            lambda: cls(
                prior_param_groups(model, num_data=100, decoupled=True),
                lr=1e-3,
                num_data=100,
                temperature=0.0,
            )
        )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for build in quiet:
            build()
