"""Every error message of the optimizers: bad input names the argument, value and range."""

import math
import re

import numpy as np
import pytest
import torch

from samplers_as_optim import SGHMC, SGLD, SGNHT
from samplers_as_optim.core.validation import check_seed

ALL = [SGLD, SGHMC, SGNHT]
nan, inf = math.nan, math.inf


def params():
    return [torch.nn.Parameter(torch.zeros(3))]


def build(cls, **kwargs):
    kwargs.setdefault("num_data", 10)
    if cls is SGLD:
        kwargs.setdefault("momentum", 0.0)
    return cls(params(), **kwargs)


# (kwargs, exception, message) shared by all three samplers
COMMON_CASES = [
    ({"lr": nan}, ValueError, "Invalid lr: nan (expected a finite number >= 0)"),
    ({"lr": -0.1}, ValueError, "Invalid lr: -0.1 (expected a finite number >= 0)"),
    ({"lr": inf}, ValueError, "Invalid lr: inf (expected a finite number >= 0)"),
    ({"lr": "0.1"}, TypeError, "Invalid lr: '0.1' (expected a finite number >= 0)"),
    (
        {"lr": torch.tensor([0.1, 0.2])},
        ValueError,  # as torch.optim: "Tensor lr must be 1-element"
        "Invalid lr: tensor([0.1000, 0.2000]) (expected a finite number >= 0; Tensor lr must be 1-element)",
    ),
    (
        {"weight_decay": nan},
        ValueError,
        "Invalid weight_decay: nan (expected a finite number >= 0)",
    ),
    (
        {"weight_decay": -1e-4},
        ValueError,
        "Invalid weight_decay: -0.0001 (expected a finite number >= 0)",
    ),
    (
        {"num_data": 0},
        ValueError,
        "Invalid num_data: 0 (expected a positive integer: the number of training examples)",
    ),
    ({"num_data": -5}, ValueError, "Invalid num_data: -5 (expected a positive integer"),
    ({"num_data": 100.0}, TypeError, "Invalid num_data: 100.0 (expected a positive integer"),
    ({"num_data": True}, TypeError, "Invalid num_data: True (expected a positive integer"),
    ({"num_data": None}, TypeError, "Invalid num_data: None (expected a positive integer"),
    ({"maximize": 1}, TypeError, "Invalid maximize: 1 (expected True or False)"),
    ({"foreach": "yes"}, TypeError, "Invalid foreach: 'yes' (expected None, True or False)"),
    (
        {"seed": -1},
        ValueError,
        re.escape("Invalid seed: -1 (expected None or an integer in [0, 2**64))"),
    ),
    ({"seed": 2**64}, ValueError, "Invalid seed: 18446744073709551616"),
    ({"seed": 1.5}, TypeError, "Invalid seed: 1.5"),
    (
        {"differentiable": True},
        ValueError,
        "Invalid differentiable: True (expected False: differentiating through a sampler step is not supported)",
    ),
    (  # CPU parameters, or no fused kernel (SGNHT): the reason, and what to do instead
        {"fused": True},
        ValueError,
        re.compile(
            r"^Invalid fused: True \((param group 0, parameter 0 of shape \([\d, ]*\) is on "
            r"cpu: the fused kernels run on CUDA|SGNHT has no fused kernel yet); use fused=None "
            r"to take the fused path only where it can run, or fused=False\)$"
        ),
    ),
    ({"fused": "yes"}, ValueError, "Invalid fused: 'yes' (expected None, True or False)"),
    ({"dampening": nan}, ValueError, "Invalid dampening: nan (expected a finite number)"),
]


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
@pytest.mark.parametrize(("kwargs", "error", "message"), COMMON_CASES, ids=lambda v: str(v)[:40])
def test_common_argument_errors(cls, kwargs, error, message):
    pattern = message if isinstance(message, re.Pattern) or "\\" in message else re.escape(message)
    with pytest.raises(error, match=pattern):
        build(cls, **kwargs)


@pytest.mark.parametrize("cls", [SGLD, SGHMC], ids=lambda c: c.__name__)
@pytest.mark.parametrize(
    ("value", "message"),
    [
        (nan, "Invalid temperature: nan (expected a finite number >= 0)"),
        (-1.0, "Invalid temperature: -1.0 (expected a finite number >= 0)"),
        (inf, "Invalid temperature: inf (expected a finite number >= 0)"),
    ],
)
def test_temperature_errors(cls, value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        build(cls, temperature=value)


@pytest.mark.parametrize("value", [0.0, 0, -1.0, nan])
def test_sgnht_needs_positive_temperature_and_says_why(value):
    message = (
        f"Invalid temperature: {value!r} (expected a finite number > 0: at temperature 0 "
        "SGNHT's thermostat only grows and the dynamics diverge instead of becoming SGD "
        "(posteriors paper, Appendix C); use SGHMC for temperature=0)"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        build(SGNHT, temperature=value)


def test_num_data_is_required():
    with pytest.raises(TypeError, match="missing 1 required keyword-only argument: 'num_data'"):
        SGHMC(params(), lr=0.1)


def test_num_data_accepts_integer_like_values():
    assert build(SGHMC, num_data=np.int64(7)).param_groups[0]["num_data"] == 7


@pytest.mark.parametrize("cls", [SGHMC, SGNHT], ids=lambda c: c.__name__)
@pytest.mark.parametrize(
    ("value", "error"),
    [
        (1.0, ValueError),
        (-0.1, ValueError),
        (nan, ValueError),
        (1.5, ValueError),
        ("0.9", TypeError),
    ],
)
def test_momentum_must_be_in_0_1(cls, value, error):
    with pytest.raises(
        error, match=re.escape(f"Invalid momentum: {value!r} (expected a number in [0, 1))")
    ):
        build(cls, momentum=value)


def test_sgld_has_no_momentum():
    with pytest.raises(
        ValueError,
        match=re.escape(
            "Invalid momentum: 0.9 (expected 0: SGLD has no momentum; use SGHMC for momentum > 0)"
        ),
    ):
        SGLD(params(), lr=0.1, momentum=0.9, num_data=10)


def test_sgld_nesterov_needs_momentum():
    with pytest.raises(
        ValueError,
        match=re.escape(
            "nesterov=True requires momentum > 0 (as in torch.optim.SGD); use SGHMC for momentum"
        ),
    ):
        SGLD(params(), lr=0.1, nesterov=True, num_data=10, temperature=0.0)


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
def test_nesterov_and_dampening_have_no_sampling_meaning(cls):
    if cls is not SGLD:
        with pytest.raises(
            ValueError,
            match=re.escape("nesterov=True requires temperature=0 (it has no sampling meaning)"),
        ):
            build(cls, nesterov=True, temperature=1.0)
    with pytest.raises(
        ValueError,
        match=re.escape("dampening=0.1 requires temperature=0 (it has no sampling meaning)"),
    ):
        build(cls, dampening=0.1, temperature=1.0)


def test_nesterov_rule_of_sgd_is_kept_at_zero_temperature():
    with pytest.raises(
        ValueError,
        match=re.escape(
            "nesterov=True requires momentum > 0 and dampening=0 (as in torch.optim.SGD)"
        ),
    ):
        SGHMC(
            params(),
            lr=0.1,
            momentum=0.9,
            dampening=0.5,
            nesterov=True,
            num_data=10,
            temperature=0.0,
        )
    # both are fine at temperature 0, as in SGD
    SGHMC(params(), lr=0.1, momentum=0.9, nesterov=True, num_data=10, temperature=0.0)
    SGHMC(params(), lr=0.1, momentum=0.9, dampening=0.5, num_data=10, temperature=0.0)


def test_param_group_errors_name_the_group():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "Invalid temperature in param group 1: -2.0 (expected a finite number >= 0)"
        ),
    ):
        SGHMC(
            [{"params": [model.weight]}, {"params": [model.bias], "temperature": -2.0}],
            lr=0.1,
            num_data=10,
        )
    opt = SGHMC([model.weight], lr=0.1, num_data=10)
    with pytest.raises(
        ValueError,
        match=re.escape("Invalid lr in param group 1: nan (expected a finite number >= 0)"),
    ):
        opt.add_param_group({"params": [model.bias], "lr": nan})


def test_a_schedule_that_sets_an_invalid_value_is_caught_at_step_before_any_change():
    model = torch.nn.Linear(2, 1)
    opt = SGHMC(model.parameters(), lr=0.1, num_data=10, temperature=0.0, nesterov=True)
    model(torch.ones(1, 2)).sum().backward()
    before = [p.detach().clone() for p in model.parameters()]
    opt.param_groups[0]["temperature"] = 1.0  # nesterov is meaningless once sampling starts
    with pytest.raises(
        ValueError,
        match=re.escape(
            "nesterov=True in param group 0 requires temperature=0 (it has no sampling meaning)"
        ),
    ):
        opt.step()
    opt.param_groups[0]["temperature"] = nan
    with pytest.raises(ValueError, match=re.escape("Invalid temperature in param group 0: nan")):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert opt.steps_taken == 0 and not opt.state


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
def test_sparse_gradients_are_a_type_error(cls):
    embedding = torch.nn.Embedding(10, 3, sparse=True)
    opt = cls(embedding.parameters(), lr=0.1, num_data=10)
    embedding(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(
        TypeError,
        match=re.escape(
            f"{cls.__name__} does not support sparse gradients (param group 0, parameter 0 of shape (10, 3)); use a dense embedding (sparse=False)"
        ),
    ):
        opt.step()


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
def test_complex_parameters_are_a_type_error(cls):
    param = torch.nn.Parameter(torch.zeros(2, dtype=torch.complex64))
    opt = cls([param], lr=0.1, num_data=10)
    param.grad = torch.ones(2, dtype=torch.complex64)
    with pytest.raises(
        TypeError,
        match=re.escape(
            f"{cls.__name__} does not support complex parameters (param group 0, parameter 0 of shape (2,)); view them as real with torch.view_as_real"
        ),
    ):
        opt.step()


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
@pytest.mark.parametrize("bad", [nan, inf, -inf])
@pytest.mark.parametrize("foreach", [False, True])
def test_non_finite_gradient_refuses_the_step_and_changes_nothing(cls, bad, foreach):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    opt = cls(
        [{"params": model[0].parameters()}, {"params": model[1].parameters()}],
        lr=0.01,
        num_data=10,
        seed=0,
        foreach=foreach,
    )
    for _ in range(2):  # two good steps: buffers exist
        opt.zero_grad()
        model(torch.randn(5, 3)).pow(2).mean().backward()
        opt.step()
    state_before = {
        k: v.clone() if torch.is_tensor(v) else v  # buffers, and the lr recorded with them
        for p in model.parameters()
        for k, v in opt.state[p].items()
    }
    params_before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    model(torch.randn(5, 3)).pow(2).mean().backward()
    model[1].weight.grad[1, 2] = bad
    message = f"{cls.__name__} refused step 3: non-finite gradient in param group 1, parameter 0 of shape (2, 4); no parameter or buffer was changed"
    with pytest.raises(FloatingPointError, match=re.escape(message)):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(params_before, model.parameters(), strict=True))
    state_after = {k: v for p in model.parameters() for k, v in opt.state[p].items()}
    assert state_before.keys() == state_after.keys()
    for k, before in state_before.items():
        assert (
            torch.equal(before, state_after[k])
            if torch.is_tensor(before)
            else before == state_after[k]
        )
    assert opt.steps_taken == 2


def test_non_finite_message_uses_parameter_names_when_given():
    model = torch.nn.Linear(2, 1)
    opt = SGHMC(model.named_parameters(), lr=0.1, num_data=10)
    model(torch.ones(1, 2)).sum().backward()
    model.bias.grad.fill_(nan)
    with pytest.raises(
        FloatingPointError, match=re.escape("param group 0, parameter 1 'bias' of shape (1,)")
    ):
        opt.step()


def test_huge_but_finite_gradients_are_not_refused():
    """The fast check's norm overflows to inf; the exact check must then let it through."""
    param = torch.nn.Parameter(torch.zeros(4))
    opt = SGHMC([param], lr=1e-30, num_data=10, temperature=0.0)
    param.grad = torch.full((4,), 3e38)
    opt.step()
    assert torch.isfinite(param).all() and opt.steps_taken == 1


def test_check_seed_accepts_none_and_integers():
    assert check_seed(None) is None
    assert check_seed(np.uint64(2**63)) == 2**63
