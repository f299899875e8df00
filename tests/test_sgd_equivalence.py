"""At temperature 0, SGLD and SGHMC are torch.optim.SGD bit for bit (DESIGN §4).

Property tests over random shapes, dtypes, hyperparameters, param groups, foreach on/off,
gradients that are sometimes missing, and step counts. Every comparison is ``torch.equal``
on parameters after every step.
"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from samplers_as_optim import SGHMC, SGLD

SHAPES = st.lists(
    st.lists(st.integers(1, 5), min_size=0, max_size=3).map(tuple), min_size=1, max_size=4
)
LR = st.floats(1e-4, 1.0)
WEIGHT_DECAY = st.one_of(st.just(0.0), st.floats(0.0, 0.1))


@st.composite
def sgd_settings(draw, *, with_momentum: bool):
    """One random SGD configuration: hyperparameters, groups, steps and the grad pattern."""
    shapes = draw(SHAPES)
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    num_groups = draw(st.integers(1, min(2, len(shapes))))
    groups = []
    for _ in range(num_groups):
        group = {"lr": draw(LR), "weight_decay": draw(WEIGHT_DECAY)}
        if with_momentum:
            momentum = draw(st.floats(0.0, 0.99))
            dampening = draw(st.one_of(st.just(0.0), st.floats(0.0, 0.5)))
            nesterov = momentum > 0 and dampening == 0 and draw(st.booleans())
            group.update(momentum=momentum, dampening=dampening, nesterov=nesterov)
        groups.append(group)
    return {
        "shapes": shapes,
        "dtype": dtype,
        "groups": groups,
        "maximize": draw(st.booleans()),
        "foreach": draw(st.sampled_from([None, False, True])),
        "steps": draw(st.integers(1, 6)),
        "seed": draw(st.integers(0, 2**32 - 1)),
        "drop_grad": draw(st.floats(0.0, 0.4)),
    }


def run_pair(settings, sampler_cls, sampler_kwargs, device):
    """Run torch.optim.SGD and the sampler side by side on identical params and grads."""
    generator = torch.Generator().manual_seed(settings["seed"])
    dtype = settings["dtype"]

    def make_params():
        torch.manual_seed(settings["seed"])
        return [
            torch.nn.Parameter(torch.randn(shape, dtype=dtype, device=device))
            for shape in settings["shapes"]
        ]

    reference, ours = make_params(), make_params()
    num_groups = len(settings["groups"])

    def param_groups(params):
        return [
            {"params": params[index::num_groups], **group}
            for index, group in enumerate(settings["groups"])
        ]

    sgd = torch.optim.SGD(
        param_groups(reference), maximize=settings["maximize"], foreach=settings["foreach"]
    )
    sampler = sampler_cls(
        param_groups(ours),
        num_data=100,
        temperature=0.0,
        maximize=settings["maximize"],
        foreach=settings["foreach"],
        **sampler_kwargs,
    )
    for _ in range(settings["steps"]):
        for p_ref, p_ours in zip(reference, ours, strict=True):
            if torch.rand((), generator=generator) < settings["drop_grad"]:
                p_ref.grad = p_ours.grad = None
            else:
                grad = torch.randn(p_ref.shape, generator=generator, dtype=dtype).to(device)
                p_ref.grad, p_ours.grad = grad.clone(), grad.clone()
        sgd.step()
        sampler.step()
        for p_ref, p_ours in zip(reference, ours, strict=True):
            assert torch.equal(p_ref, p_ours)
    return sgd, sampler


@given(sgd_settings(with_momentum=False))
def test_sgld_at_zero_temperature_is_sgd(device, settings):
    run_pair(settings, SGLD, {}, device)


@given(sgd_settings(with_momentum=True))
def test_sghmc_at_zero_temperature_is_sgd_with_momentum(device, settings):
    sgd, sampler = run_pair(settings, SGHMC, {}, device)
    # the momentum buffers agree too, so a later step at temperature 0 cannot drift
    for sgd_group, group in zip(sgd.param_groups, sampler.param_groups, strict=True):
        for ref, ours in zip(sgd_group["params"], group["params"], strict=True):
            assert sgd.state[ref].keys() == sampler.state[ours].keys()
            if "momentum_buffer" in sgd.state[ref]:
                buffers = sgd.state[ref]["momentum_buffer"], sampler.state[ours]["momentum_buffer"]
                assert torch.equal(*buffers)


@pytest.mark.parametrize("foreach", [False, True])
def test_tensor_learning_rate_matches_sgd(device, foreach):
    torch.manual_seed(0)
    start = torch.randn(7, device=device)
    ref, ours = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    lr = torch.tensor(0.05)
    sgd = torch.optim.SGD([ref], lr=lr, momentum=0.9, foreach=foreach)
    sampler = SGHMC([ours], lr=lr, momentum=0.9, num_data=10, temperature=0.0, foreach=foreach)
    for _ in range(5):
        grad = torch.randn(7, device=device)
        ref.grad, ours.grad = grad.clone(), grad.clone()
        sgd.step()
        sampler.step()
    assert torch.equal(ref, ours)


def test_sghmc_buffers_equal_sgd_buffers(device):
    """Switching to SGD mid-run continues identically: the buffers are SGD's."""
    torch.manual_seed(1)
    start = torch.randn(3, 4, device=device)
    ref, ours = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    sgd = torch.optim.SGD([ref], lr=0.1, momentum=0.8, dampening=0.1)
    sampler = SGHMC([ours], lr=0.1, momentum=0.8, dampening=0.1, num_data=5, temperature=0)
    for _ in range(4):
        grad = torch.randn(3, 4, device=device)
        ref.grad, ours.grad = grad.clone(), grad.clone()
        sgd.step()
        sampler.step()
        assert torch.equal(
            sgd.state[ref]["momentum_buffer"], sampler.state[ours]["momentum_buffer"]
        )
