"""The chain's state goes wherever the optimizer goes, and nothing half-applies.

Copies (``copy.deepcopy``, ``pickle``, ``torch.save`` of the object) continue the same
chain; a state without the chain's random state is refused unless it is a genuine
``torch.optim.SGD`` checkpoint; invalid groups, loaded non-finite buffers and scalars
that overflow the parameters' dtype are refused before anything changes.
"""

import copy
import io
import math
import pickle
import re
import warnings

import pytest
import torch
from samplers_under_test import SAMPLERS

from samplers_as_optim import SGHMC, SGLD, SGNHT


def layers(model):
    """The model's two Linear layers."""
    return model[0], model[2]


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def batches(count, seed=5):
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(16, 4, generator=generator), torch.randint(0, 2, (16,), generator=generator))
        for _ in range(count)
    ]


def train(model, opt, data):
    for x, y in data:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def make_opt(case, model, **kwargs):
    arguments = {"lr": 0.01, "num_data": 500, "seed": None, **case.kwargs, **kwargs}
    return case.cls(model.parameters(), **arguments)


def through_pickle(obj):
    return pickle.loads(pickle.dumps(obj))


def through_torch_save(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


# ---------------------------------------------------------------- copies continue the chain
@pytest.mark.parametrize("case", SAMPLERS, ids=repr)
@pytest.mark.parametrize("copier", [copy.deepcopy, through_pickle, through_torch_save])
def test_a_copied_model_and_optimizer_continue_the_same_chain(case, copier):
    data = batches(12)
    model = make_model()
    opt = make_opt(case, model)
    train(model, opt, data[:6])
    # copy model and optimizer together, so the copy's optimizer holds the copied params
    model_copy, opt_copy = copier((model, opt))
    train(model, opt, data[6:])
    train(model_copy, opt_copy, data[6:])
    for ours, theirs in zip(model.parameters(), model_copy.parameters(), strict=True):
        assert torch.equal(ours, theirs)
    assert opt_copy.steps_taken == opt.steps_taken == 12
    assert opt_copy.seed == opt.seed


# ---------------------------------------------------------------- add_param_group
@pytest.mark.parametrize("case", SAMPLERS, ids=repr)
def test_an_invalid_param_group_is_not_added(case):
    model = make_model()
    first, second = layers(model)
    opt = make_opt(case, first)
    with pytest.raises(ValueError, match=r"Invalid lr in param group 1: nan \(expected a finite"):
        opt.add_param_group({"params": second.parameters(), "lr": math.nan})
    assert len(opt.param_groups) == 1
    train(first, opt, batches(2))  # the optimizer still steps
    assert opt.steps_taken == 2


@pytest.mark.parametrize("case", SAMPLERS, ids=repr)
def test_a_group_added_later_starts_at_the_current_step_with_the_same_seed(case):
    model = make_model()
    first, second = layers(model)
    opt = make_opt(case, first, seed=11)
    train(model, opt, batches(3))
    opt.add_param_group({"params": second.parameters()})
    assert [(g["seed"], g["step"]) for g in opt.param_groups] == [(11, 3), (11, 3)]


def test_a_group_added_with_an_invalid_seed_is_refused_and_not_added():
    model = make_model()
    first, second = layers(model)
    opt = SGHMC(first.parameters(), lr=0.01, num_data=10, seed=1)
    with pytest.raises(ValueError, match=r"Invalid seed in param group 1: -1 \(expected None or"):
        opt.add_param_group({"params": second.parameters(), "seed": -1})
    assert len(opt.param_groups) == 1


# ---------------------------------------------------------------- what may load
def test_a_state_with_sampler_hyperparameters_but_no_chain_state_is_refused():
    model = make_model()
    opt = SGHMC(model.parameters(), lr=0.01, num_data=100, seed=3)
    train(model, opt, batches(4))
    state = opt.state_dict()
    for group in state["param_groups"]:  # what a wrapper that drops extra keys would save
        del group["seed"], group["step"]
    fresh = SGHMC(model.parameters(), lr=0.01, num_data=100, seed=4)
    before = copy.deepcopy(fresh.state_dict())
    with pytest.raises(
        ValueError,
        match=r"Invalid state_dict: its param groups hold num_data, temperature but not the "
        r"chain's random state \('seed' and 'step'\), so loading it would silently restart",
    ):
        fresh.load_state_dict(state)
    assert fresh.state_dict() == before  # nothing changed


def test_a_state_saved_by_the_first_release_still_loads_and_continues():
    data = batches(8)
    model = make_model()
    opt = SGHMC(model.parameters(), lr=0.01, num_data=100, seed=3)
    train(model, opt, data[:4])
    legacy = copy.deepcopy(opt.state_dict())  # torch shares buffers between the two
    for group in legacy["param_groups"]:
        del group["seed"], group["step"]
    legacy["sampler"] = {"seed": 3, "steps": 4}  # the 0.1.0 layout
    twin = copy.deepcopy(model)
    resumed = SGHMC(twin.parameters(), lr=0.01, num_data=100, seed=99)
    resumed.load_state_dict(legacy)
    train(model, opt, data[4:])
    train(twin, resumed, data[4:])
    assert all(
        torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters(), strict=True)
    )


@pytest.mark.parametrize("case", SAMPLERS[1:], ids=repr)
def test_a_loaded_non_finite_buffer_is_refused_before_anything_changes(case):
    model = make_model()
    opt = make_opt(case, model, seed=1)
    train(model, opt, batches(2))
    state = copy.deepcopy(opt.state_dict())
    state["state"][0]["momentum_buffer"][0, 0] = math.nan
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(
        ValueError,
        match=r"Invalid state_dict: 'momentum_buffer' of parameter 0 holds NaN or infinity "
        r"\(expected finite buffers",
    ):
        opt.load_state_dict(state)
    after = opt.state_dict()
    assert torch.equal(after["state"][0]["momentum_buffer"], before["state"][0]["momentum_buffer"])


@pytest.mark.parametrize("bad", [math.nan, -1.0, 0.0, "0.1"])
def test_a_loaded_invalid_momentum_rate_is_refused(bad):
    model = make_model()
    opt = SGHMC(model.parameters(), lr=0.01, num_data=100, seed=1)
    train(model, opt, batches(2))
    state = copy.deepcopy(opt.state_dict())
    assert state["state"][0]["momentum_lr"] == 0.01
    state["state"][0]["momentum_lr"] = bad
    with pytest.raises(
        ValueError,
        match=rf"Invalid state_dict: 'momentum_lr' of parameter 0 is {re.escape(repr(bad))} "
        r"\(expected None or a finite number > 0",
    ):
        opt.load_state_dict(state)


@pytest.mark.parametrize("source", ["sgd", "sghmc"])
def test_an_sgd_or_sghmc_checkpoint_loads_into_sgnht_with_a_fresh_thermostat(source):
    param = torch.nn.Parameter(torch.randn(10))
    if source == "sgd":
        before = torch.optim.SGD([param], lr=1e-2, momentum=0.9)
    else:
        before = SGHMC([param], lr=1e-2, momentum=0.9, num_data=100, seed=1)
    for _ in range(3):
        before.zero_grad()
        param.pow(2).sum().backward()
        before.step()
    buffer = before.state[param]["momentum_buffer"].clone()
    twin = torch.nn.Parameter(param.detach().clone())
    after = SGNHT([param], lr=1e-2, momentum=0.9, num_data=100, seed=1)
    after.load_state_dict(copy.deepcopy(before.state_dict()))
    # what it must equal: SGNHT with the loaded buffer and a fresh thermostat 1 - momentum
    expected = SGNHT([twin], lr=1e-2, momentum=0.9, num_data=100, seed=1)
    expected.param_groups[0]["step"] = after.param_groups[0]["step"]
    expected.state[twin] = {"momentum_buffer": buffer.clone(), "thermostat": torch.tensor(0.1)}
    for p, opt in ((param, after), (twin, expected)):
        opt.zero_grad()
        p.pow(2).sum().backward()
        opt.step()  # failed with "sub(): argument 'other' ... must be Tensor, not NoneType"
    assert after.state[param]["thermostat"].dtype == torch.float32
    assert torch.equal(param, twin)
    assert torch.equal(after.state[param]["thermostat"], expected.state[twin]["thermostat"])


def test_loading_an_unnamed_state_into_a_named_optimizer_warns_that_the_noise_changes():
    """Only for a state without noise keys: one the samplers wrote before storing them.

    A state that holds them continues its chain exactly whatever the naming
    (``tests/test_torch_optim_contract.py``), and loads silently.
    """
    model = make_model()
    unnamed = SGHMC(model.parameters(), lr=0.01, num_data=100, seed=1)
    train(model, unnamed, batches(2))
    named = SGHMC(model.named_parameters(), lr=0.01, num_data=100, seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        named.load_state_dict(copy.deepcopy(unnamed.state_dict()))
    old_layout = copy.deepcopy(unnamed.state_dict())
    for entries in old_layout["state"].values():
        del entries["noise_key"]
    named = SGHMC(model.named_parameters(), lr=0.01, num_data=100, seed=1)
    with pytest.warns(UserWarning, match=r"the noise is now keyed by name, not by position"):
        named.load_state_dict(old_layout)
    # the other way round the names come with the state: exact, and silent
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SGHMC(model.parameters(), lr=0.01, num_data=100).load_state_dict(
            copy.deepcopy(named.state_dict())
        )


# ---------------------------------------------------------------- all or nothing
@pytest.mark.parametrize("cls", [SGHMC, SGNHT])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_temperature_whose_noise_overflows_the_dtype_changes_nothing(cls, dtype):
    param = torch.nn.Parameter(torch.ones(5, dtype=dtype))
    opt = cls([param], lr=1e-3, num_data=10, temperature=1.0, seed=0)
    param.grad = torch.ones_like(param)
    opt.step()  # a momentum buffer exists now
    buffer = opt.state[param]["momentum_buffer"].clone()
    value = param.detach().clone()
    opt.param_groups[0]["temperature"] = 1e300
    with pytest.raises(
        ValueError,
        match=r"Invalid temperature in param group 0: 1e\+300 \(expected a value whose noise "
        rf"scale sqrt\(2 T / \(N lr\)\) = 1.41e\+151 fits {dtype}",
    ):
        opt.step()
    assert torch.equal(opt.state[param]["momentum_buffer"], buffer)
    assert torch.equal(param.detach(), value) and opt.steps_taken == 1


def test_an_lr_that_overflows_the_dtype_changes_nothing():
    param = torch.nn.Parameter(torch.ones(5, dtype=torch.float16))
    opt = SGHMC([param], lr=1e5, num_data=10, temperature=0.0, seed=0)
    param.grad = torch.ones_like(param)
    with pytest.raises(
        ValueError, match=r"Invalid lr in param group 0: 100000.0 \(expected a value that fits "
    ):
        opt.step()
    assert not opt.state[param] and torch.equal(param.detach(), torch.ones(5, dtype=torch.float16))


# ---------------------------------------------------------------- schedulers that cycle momentum
@pytest.mark.parametrize(
    "scheduler, kwargs",
    [
        (torch.optim.lr_scheduler.OneCycleLR, {"max_lr": 0.1, "total_steps": 10}),
        (torch.optim.lr_scheduler.CyclicLR, {"base_lr": 0.01, "max_lr": 0.1}),
    ],
)
def test_sgld_with_a_momentum_cycling_scheduler_fails_when_the_scheduler_is_built(
    scheduler, kwargs
):
    model = make_model()
    opt = SGLD(model.parameters(), lr=0.01, num_data=100, seed=0)
    with pytest.raises(ValueError, match="optimizer must support momentum"):
        scheduler(opt, **kwargs)
    schedule = scheduler(opt, cycle_momentum=False, **kwargs)
    for x, y in batches(3):  # and without cycling momentum it runs
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        schedule.step()
    assert "momentum" not in opt.param_groups[0]


@pytest.mark.parametrize("cls", [SGHMC, SGNHT])
def test_samplers_with_momentum_follow_a_momentum_cycling_scheduler(cls):
    model = make_model()
    opt = cls(model.parameters(), lr=0.01, momentum=0.9, num_data=100, seed=0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=10)
    for x, y in batches(4):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        schedule.step()
    assert 0.85 <= opt.param_groups[0]["momentum"] <= 0.95
