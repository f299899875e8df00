"""``AdamWSGHMC`` refuses ``prior_param_groups``' groups (issue #36).

Those groups put the prior N(0, v) in an L2 ``weight_decay`` = 1/(N v), coupled to the
gradient; the twin's decay is decoupled (AdamW's), where the same number is the prior
N(0, 1/(N λ a)) that depends on the preconditioner a. The twin refuses them, at
construction and in ``add_param_group``, naming the group and what to do instead; every
optimizer with an L2 decay still takes them.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from samplers_as_optim import (
    HMC,
    SGHMC,
    AdamWSGHMC,
    GaussianLikelihood,
    prior_loss,
    prior_param_groups,
)
from samplers_as_optim.priors import PRIOR_GROUP_KEY

N = 64


def model_and_data():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 1))
    return model, torch.randn(N, 3), torch.randn(N, 1)


def message(index):
    return (
        f"Invalid weight_decay in param group {index}: {{decay}}, the L2 prior of "
        "prior_param_groups (expected a group without its 'l2_prior' marker: AdamWSGHMC's "
        "weight_decay is AdamW's decoupled decay, the prior N(0, 1/(N weight_decay a)) with "
        "a the preconditioner, not prior_param_groups' N(0, v); give AdamWSGHMC "
        "prior_param_groups(model, num_data=N, decoupled=True) and add prior_loss(model, "
        "num_data=N) to the loss)"
    )


def test_the_groups_are_marked_and_the_marker_is_documented():
    model, _, _ = model_and_data()
    groups = prior_param_groups(model, num_data=N)
    assert all(group[PRIOR_GROUP_KEY] is True for group in groups)
    assert PRIOR_GROUP_KEY == "l2_prior"


def test_the_twin_refuses_them_at_construction():
    model, _, _ = model_and_data()
    groups = prior_param_groups(model, num_data=N)
    before = [dict(group) for group in groups]
    decay = groups[0]["weight_decay"]
    with pytest.raises(ValueError) as info:
        AdamWSGHMC(groups, lr=1e-3, num_data=N, seed=0)
    assert str(info.value) == message(0).format(decay=decay)
    # at temperature 0 (AdamW) as well: the decay is decoupled there too
    with pytest.raises(ValueError, match=re.escape("Invalid weight_decay in param group 0: ")):
        AdamWSGHMC(groups, lr=1e-3, num_data=N, temperature=0.0, seed=0)
    assert [dict(group) for group in groups] == before  # the refusal changed nothing


def test_the_twin_refuses_one_added_and_is_unchanged():
    model, x, y = model_and_data()
    first, second = model[0], model[2]
    twin = AdamWSGHMC(first.named_parameters(), lr=1e-3, weight_decay=0.0, num_data=N, seed=0)
    groups_before = [{k: v for k, v in g.items() if k != "params"} for g in twin.param_groups]
    params_before = [list(g["params"]) for g in twin.param_groups]
    group = prior_param_groups(second, num_data=N)[0]
    with pytest.raises(ValueError) as info:
        twin.add_param_group(group)
    assert str(info.value) == message(1).format(decay=group["weight_decay"])
    assert [list(g["params"]) for g in twin.param_groups] == params_before
    assert [{k: v for k, v in g.items() if k != "params"} for g in twin.param_groups] == (
        groups_before
    )
    # the twin still steps as before
    nn.functional.mse_loss(model(x), y).backward()
    twin.step()


def test_a_group_whose_prior_is_in_its_loss_is_taken():
    """λ = 0 (the likelihood's σ, whose prior is in its own loss) has no decay to misread."""
    likelihood = GaussianLikelihood(num_data=N)
    (group,) = prior_param_groups(likelihood, num_data=N)
    assert group["weight_decay"] == 0.0 and group[PRIOR_GROUP_KEY] is True
    AdamWSGHMC([group], lr=1e-3, num_data=N, seed=0)


def test_the_recommended_twin_recipe_is_taken():
    model, x, y = model_and_data()
    twin = AdamWSGHMC(model.named_parameters(), lr=1e-3, weight_decay=0.0, num_data=N, seed=0)
    twin.zero_grad()
    (nn.functional.mse_loss(model(x), y) + prior_loss(model, num_data=N)).backward()
    twin.step()


@pytest.mark.parametrize(
    "make",
    [
        lambda groups: SGHMC(groups, lr=1e-3, num_data=N, seed=0),
        lambda groups: torch.optim.SGD(groups, lr=1e-3),
        lambda groups: torch.optim.Adam(groups, lr=1e-3),
    ],
    ids=["SGHMC", "SGD", "Adam"],
)
def test_optimizers_with_an_l2_decay_still_take_them(make):
    model, x, y = model_and_data()
    groups = prior_param_groups(model, num_data=N)
    optimizer = make(groups)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [
        g["weight_decay"] for g in groups
    ]
    # the marker changes nothing in the step: a chain from a copy without it is the same
    copy, _, _ = model_and_data()
    reference = make(
        [
            {k: v for k, v in g.items() if k != PRIOR_GROUP_KEY}
            for g in prior_param_groups(copy, num_data=N)
        ]
    )
    for net, opt in ((model, optimizer), (copy, reference)):
        for _ in range(3):
            opt.zero_grad()
            nn.functional.mse_loss(net(x), y).backward()
            opt.step()
    for a, b in zip(model.parameters(), copy.parameters(), strict=True):
        assert torch.equal(a, b)
    # and a state_dict round trip keeps the groups
    optimizer.load_state_dict(optimizer.state_dict())
    assert all(g[PRIOR_GROUP_KEY] is True for g in optimizer.param_groups)


def test_hmc_still_takes_them():
    model, _, _ = model_and_data()
    HMC(prior_param_groups(model, num_data=N), lr=1e-4, num_steps=5, num_data=N, seed=0)


def test_a_refused_group_leaves_the_callers_dict_as_it_was() -> None:
    """A group refused by add_param_group after some steps keeps no 'step' or 'seed'."""
    model = torch.nn.Linear(3, 1)
    opt = SGHMC([model.weight], lr=1e-3, num_data=10, seed=0)
    model.weight.grad = torch.ones_like(model.weight)
    opt.step()
    group = {"params": [model.bias], "lr": -1.0}
    with pytest.raises(ValueError, match=r"Invalid lr in param group 1: -1\.0"):
        opt.add_param_group(group)
    assert set(group) == {"params", "lr"} and len(opt.param_groups) == 1
    accepted = {"params": [model.bias]}
    opt.add_param_group(accepted)
    assert accepted["step"] == opt.steps_taken == 1 and accepted["seed"] == 0
