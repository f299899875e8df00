"""IVON.load_state_dict: a corrupt state is refused before anything changes (issue #34).

Each corruption (a NaN or too negative ``hess``, an infinite ``momentum``, a missing
entry, a negative draw counter, a wrong shape) used to load and fail later, far from its
cause: NaN posteriors, refused steps, a raw ``KeyError``, a size mismatch. Now each is
refused by name, the optimizer left exactly as it was; valid states still load and the
run continues bit for bit.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest
import torch
from torch import nn

from samplers_as_optim import IVON

F64 = torch.float64


def mlp(seed: int = 1) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 1)).to(F64)


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return torch.randn(32, 4, generator=g, dtype=F64), torch.randn(32, generator=g, dtype=F64)


def draw(opt: IVON, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    with opt.sampled_params(train=True):
        opt.zero_grad()
        (model(x).squeeze(-1) - y).square().mean().backward()


def train(opt: IVON, model: nn.Module, steps: int) -> list[torch.Tensor]:
    x, y = data()
    trace = []
    for _ in range(steps):
        draw(opt, model, x, y)
        draw(opt, model, x, y)
        opt.step()
        trace.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    return trace


def make(model: nn.Module, **kwargs: Any) -> IVON:
    settings = {"lr": 0.05, "ess": 32, "beta2": 0.9, "seed": 3, **kwargs}
    return IVON(model.named_parameters(), **settings)


def snapshot(opt: IVON) -> tuple[dict[int, dict[str, torch.Tensor]], list[dict[str, Any]]]:
    """Copies of the optimizer's per-parameter state and its param groups."""
    state = {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
    groups = [
        {
            **{k: copy.deepcopy(v) for k, v in g.items() if k != "params"},
            "ids": list(map(id, g["params"])),
        }
        for g in opt.param_groups
    ]
    return state, groups


def same(a: Any, b: Any) -> bool:
    state_a, groups_a = a
    state_b, groups_b = b
    if groups_a != groups_b or state_a.keys() != state_b.keys():
        return False
    for key, entries in state_a.items():
        other = state_b[key]
        if entries.keys() != other.keys():
            return False
        for name, value in entries.items():
            if value.dtype != other[name].dtype or not torch.equal(value, other[name]):
                return False
    return True


@pytest.fixture
def saved() -> dict[str, Any]:
    """A valid checkpoint after two steps: group 0 holds 0.weight (5, 4), 0.bias, ..."""
    model = mlp()
    opt = make(model)
    train(opt, model, steps=2)
    return opt.state_dict()


@pytest.fixture
def target() -> tuple[nn.Module, IVON]:
    """An optimizer with a state of its own (one step), which a refusal must keep."""
    model = mlp(seed=5)
    opt = make(model, seed=7)
    train(opt, model, steps=1)
    return model, opt


def corrupt(saved: dict[str, Any], how: str) -> dict[str, Any]:
    state_dict = copy.deepcopy(saved)
    entry = state_dict["state"][0]  # parameter 0 of group 0: '0.weight', shape (5, 4)
    if how == "nan hess":
        entry["hess"][1, 2] = float("nan")
    elif how == "negative hess":
        entry["hess"].fill_(-1.0)
    elif how == "inf momentum":
        entry["momentum"][0, 0] = float("inf")
    elif how == "missing momentum":
        del entry["momentum"]
    elif how == "missing hess":
        del entry["hess"]
    elif how == "negative train_draws":
        state_dict["param_groups"][0]["train_draws"] = -1
    elif how == "wrong shape":
        entry["hess"] = entry["hess"][:, :3].clone()
    elif how == "not a tensor":
        entry["momentum"] = 0.0
    elif how == "integer hess":
        entry["hess"] = torch.ones(5, 4, dtype=torch.int64)
    return state_dict


WHERE = re.escape("Invalid state_dict: parameter 0 ('0.weight') of param group 0: ")
REFUSALS = {
    "nan hess": WHERE + r"'hess' holds NaN \(expected finite values with hess \+ weight_decay > 0",
    "negative hess": WHERE + r"'hess' reaches -1 \(expected finite values with hess \+ "
    r"weight_decay > 0, weight_decay = 0\.0001",
    "inf momentum": WHERE + r"'momentum' holds inf \(expected finite values\)",
    "missing momentum": WHERE + r"no 'momentum' \(expected both 'momentum' and 'hess'",
    "missing hess": WHERE + r"no 'hess' \(expected both 'momentum' and 'hess'",
    "negative train_draws": r"Invalid train_draws in param group 0: -1 \(expected an integer >= 0\)",
    "wrong shape": WHERE + r"'hess' of shape \(5, 3\) \(expected a floating-point tensor of "
    r"shape \(5, 4\)",
    "not a tensor": WHERE + r"'momentum' is 0\.0 \(expected a floating-point tensor of shape",
    "integer hess": WHERE + r"'hess' is a torch\.int64 tensor \(expected a floating-point tensor",
}


@pytest.mark.parametrize("how", list(REFUSALS))
def test_a_corrupt_state_is_refused_and_changes_nothing(saved, target, how):
    model, opt = target
    before = snapshot(opt)
    params = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=REFUSALS[how]):
        opt.load_state_dict(corrupt(saved, how))
    assert same(snapshot(opt), before)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params, strict=True))
    opt.load_state_dict(saved)  # the valid one still loads, and the run goes on
    train(opt, model, steps=1)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_state_within_a_step_needs_its_averages(target):
    model = mlp()
    opt = make(model)
    train(opt, model, steps=1)
    x, y = data()
    draw(opt, model, x, y)  # train_draws = 1: the averages are the step's
    saved = opt.state_dict()
    _, other = target
    before = snapshot(other)
    missing = copy.deepcopy(saved)
    del missing["state"][1]["avg_grad"]
    message = (
        re.escape("Invalid state_dict: parameter 1 ('0.bias') of param group 0: no 'avg_grad'")
        + r" \(expected 'avg_grad' and 'avg_nxg' within a step: train_draws = 1"
    )
    with pytest.raises(ValueError, match=message):
        other.load_state_dict(missing)
    nan = copy.deepcopy(saved)
    nan["state"][2]["avg_nxg"][0, 0] = float("nan")
    with pytest.raises(
        ValueError, match=r"parameter 2 \('2.weight'\) of param group 0: 'avg_nxg' holds NaN"
    ):
        other.load_state_dict(nan)
    assert same(snapshot(other), before)
    other.load_state_dict(saved)


def test_valid_states_load_and_continue_bit_for_bit():
    """A negative h above -weight_decay (the update keeps only h + δ positive), a fresh
    optimizer's empty state, and a checkpoint between two draws of a step all load."""
    param = nn.Parameter(torch.zeros(1000))
    opt = IVON([("w", param)], lr=0.1, ess=100, hess_init=0.1, beta2=0.9, weight_decay=0.1, seed=0)
    for _ in range(50):
        with opt.sampled_params(train=True):
            param.grad = None
            (0.01 * param).sum().backward()
        opt.step()
    assert float(opt.state[param]["hess"].min()) < 0
    resumed = IVON([("w", nn.Parameter(param.detach().clone()))], lr=0.1, ess=100)
    resumed.load_state_dict(opt.state_dict())
    assert torch.equal(resumed.std["w"], opt.std["w"])

    empty = [("e", nn.Parameter(torch.zeros(0))), ("w", nn.Parameter(torch.ones(3)))]
    opt = IVON(empty, lr=0.1, ess=10, weight_decay=0.0, seed=0)
    with opt.sampled_params(train=True):
        sum(p.sum() for _, p in empty).backward()
    opt.step()
    IVON(empty, lr=0.1, ess=10, weight_decay=0.0).load_state_dict(opt.state_dict())

    model = mlp()
    fresh = make(model).state_dict()
    assert fresh["state"] == {}
    make(mlp(seed=5)).load_state_dict(fresh)

    opt = make(model)
    train(opt, model, steps=2)
    x, y = data()
    draw(opt, model, x, y)
    saved = copy.deepcopy(opt.state_dict())
    model_state = copy.deepcopy(model.state_dict())
    draw(opt, model, x, y)
    opt.step()
    expected = train(opt, model, steps=2)
    other = mlp(seed=5)
    other.load_state_dict(model_state)
    resumed = make(other, seed=99)
    resumed.load_state_dict(saved)
    draw(resumed, other, x, y)
    resumed.step()
    got = train(resumed, other, steps=2)
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
