"""The injected noise is exactly the documented scale times the chain's xi.

Two optimizers share one seed, one starting state and the same gradients; one runs at
temperature T, the other at 0 (optax's coupled-key variance test, made exact): their
difference must be the documented scale times the standard-normal draw that
``NoiseStream(seed)`` gives for that step and parameter.
"""

import copy
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from samplers_as_optim import SGHMC, SGLD
from samplers_as_optim.core.streams import NoiseStream, parameter_key
from samplers_as_optim.sgmcmc import (
    sghmc_direction,
    sghmc_noise_scale,
    sgld_direction,
    sgld_noise_scale,
    sgnht_direction,
    sgnht_initial_state,
)

DTYPE = torch.float64  # the differences are checked to 1e-12, far below float32's rounding


def xi(seed, like, step, first_index=0):
    """The noise the optimizer draws for ``like``, its parameters from ``first_index`` on."""
    keys = [parameter_key(first_index + i) for i in range(len(like))]
    return NoiseStream(seed).standard_normal(like, keys, step=step)


def coupled(cls, temperature, *, seed=3, lr=0.01, num_data=50, **kwargs):
    torch.manual_seed(0)
    params = [
        torch.nn.Parameter(torch.randn(4, 3, dtype=DTYPE)),
        torch.nn.Parameter(torch.randn(5, dtype=DTYPE)),
    ]
    opt = cls(params, lr=lr, num_data=num_data, temperature=temperature, seed=seed, **kwargs)
    return params, opt


def set_grads(params, step):
    generator = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator, dtype=DTYPE)


@pytest.mark.parametrize("temperature", [0.25, 1.0, 3.0])
def test_sgld_noise_is_sqrt_2_lr_T_over_N_times_xi(temperature):
    lr, num_data = 0.01, 50
    hot, hot_opt = coupled(SGLD, temperature)
    cold, cold_opt = coupled(SGLD, 0.0)
    set_grads(hot, 0), set_grads(cold, 0)
    hot_opt.step(), cold_opt.step()
    scale = sgld_noise_scale(lr, temperature, num_data)
    assert scale == pytest.approx(math.sqrt(2 * lr * temperature / num_data))
    for h, c, noise in zip(hot, cold, xi(3, hot, step=0), strict=True):
        torch.testing.assert_close(h - c, scale * noise, rtol=0, atol=1e-12)


@pytest.mark.parametrize("momentum", [0.5, 0.9, 0.99])
def test_sghmc_noise_enters_the_buffer_with_the_documented_scale(momentum):
    lr, num_data, temperature = 0.01, 50, 2.0
    hot, hot_opt = coupled(SGHMC, temperature, momentum=momentum)
    cold, cold_opt = coupled(SGHMC, 0.0, momentum=momentum)
    scale = sghmc_noise_scale(lr, momentum, temperature, num_data)
    assert scale == pytest.approx(math.sqrt(2 * (1 - momentum) * temperature / (num_data * lr)))
    # step 0: the buffer starts at g + scale * xi; in parameter units the noise is -lr * scale * xi
    set_grads(hot, 0), set_grads(cold, 0)
    hot_opt.step(), cold_opt.step()
    for h, c, noise in zip(hot, cold, xi(3, hot, step=0), strict=True):
        torch.testing.assert_close(h - c, -lr * scale * noise, rtol=0, atol=1e-12)
        torch.testing.assert_close(
            hot_opt.state[h]["momentum_buffer"] - cold_opt.state[c]["momentum_buffer"],
            scale * noise,
            rtol=0,
            atol=1e-12,
        )
    # step 1 from a common state: give the cold chain the hot chain's params and buffers
    # (deep copy: like torch's, state_dict() returns the live buffers)
    hot_state = copy.deepcopy(hot_opt.state_dict())
    cold_opt.load_state_dict({**hot_state, "param_groups": cold_opt.state_dict()["param_groups"]})
    with torch.no_grad():
        for h, c in zip(hot, cold, strict=True):
            c.copy_(h)
    set_grads(hot, 1), set_grads(cold, 1)
    hot_opt.step(), cold_opt.step()
    for h, c, noise in zip(hot, cold, xi(3, hot, step=1), strict=True):
        torch.testing.assert_close(
            hot_opt.state[h]["momentum_buffer"] - cold_opt.state[c]["momentum_buffer"],
            scale * noise,
            rtol=0,
            atol=1e-12,
        )


def test_sghmc_without_momentum_is_sgld_for_one_seed():
    sgld_params, sgld = coupled(SGLD, 1.5)
    sghmc_params, sghmc = coupled(SGHMC, 1.5, momentum=0.0)
    for step in range(5):
        set_grads(sgld_params, step), set_grads(sghmc_params, step)
        sgld.step(), sghmc.step()
    for a, b in zip(sgld_params, sghmc_params, strict=True):
        assert torch.equal(a, b)
    # no buffer is kept without momentum, as in SGD; only the keys the noise was drawn with
    assert all(state.keys() == {"noise_key"} for state in sghmc.state.values())


def test_sgnht_noise_enters_the_buffer_with_sghmcs_scale():
    """SGNHT has no temperature 0: couple the kernel with and without its noise."""
    torch.manual_seed(0)
    param = torch.randn(6, 2, dtype=DTYPE)
    grad = torch.randn(6, 2, dtype=DTYPE)
    noise = torch.randn(6, 2, dtype=DTYPE)
    kwargs = dict(
        lr=0.02,
        momentum=0.8,
        temperature=1.3,
        num_data=40,
        weight_decay=0.0,
        maximize=False,
        foreach=False,
        inplace=False,
    )
    outputs = []
    for n in (noise, torch.zeros_like(noise)):
        buffer, thermostat = sgnht_initial_state(param, 0.8)
        buffer = buffer + 0.5  # a non-trivial previous momentum
        outputs.append(sgnht_direction([param], [grad], [buffer], [thermostat], [n], **kwargs))
    scale = sghmc_noise_scale(0.02, 0.8, 1.3, 40)
    torch.testing.assert_close(
        outputs[0][1][0] - outputs[1][1][0], scale * noise, rtol=0, atol=1e-12
    )


# ---------------------------------------------------------------- kernel properties
SHAPES = st.lists(st.integers(1, 4), min_size=0, max_size=3).map(tuple)


@st.composite
def kernel_inputs(draw):
    shape = draw(SHAPES)
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    tensors = [torch.randn(shape, generator=generator, dtype=dtype) for _ in range(4)]
    hyper = {
        "lr": draw(st.floats(1e-4, 0.5)),
        "temperature": draw(st.floats(0.01, 5.0)),
        "num_data": draw(st.integers(1, 10_000)),
        "weight_decay": draw(st.sampled_from([0.0, 0.01])),
        "maximize": draw(st.booleans()),
        "foreach": draw(st.booleans()),
    }
    return tensors, hyper


def tolerance(dtype, *values):
    eps = torch.finfo(dtype).eps
    return 8 * eps * max(1.0, *(float(v.abs().max()) if v.numel() else 0.0 for v in values))


@given(kernel_inputs())
def test_sgld_kernel_noise_term_is_linear_in_xi(inputs):
    (param, grad, noise, _), hyper = inputs
    with_noise = sgld_direction([param], [grad], [noise], **hyper)[0]
    without = sgld_direction([param], [grad], [torch.zeros_like(noise)], **hyper)[0]
    c = math.sqrt(2 * hyper["temperature"] / (hyper["num_data"] * hyper["lr"]))
    assert with_noise.shape == param.shape and with_noise.dtype == param.dtype
    torch.testing.assert_close(
        with_noise - without, -c * noise, rtol=0, atol=tolerance(param.dtype, c * noise, with_noise)
    )
    # temperature 0 is deterministic and is the plain (decayed, signed) gradient
    cold = sgld_direction([param], [grad], None, **{**hyper, "temperature": 0.0})[0]
    expected = (-grad if hyper["maximize"] else grad) + hyper["weight_decay"] * param
    torch.testing.assert_close(cold, expected, rtol=0, atol=tolerance(param.dtype, expected))


@given(kernel_inputs(), st.floats(0.0, 0.99), st.booleans())
def test_sghmc_kernel_noise_term_and_purity(inputs, momentum, first_step):
    (param, grad, noise, buffer), hyper = inputs
    before = [t.clone() for t in (param, grad, noise, buffer)]
    buffers = [None] if first_step else [buffer]
    kwargs = dict(momentum=momentum, dampening=0.0, nesterov=False, inplace=False, **hyper)
    d_noise, _b_noise = sghmc_direction([param], [grad], buffers, [noise], **kwargs)
    d_zero, _b_zero = sghmc_direction([param], [grad], buffers, [torch.zeros_like(noise)], **kwargs)
    # inplace=False never touches its inputs
    for original, now in zip(before, (param, grad, noise, buffer), strict=True):
        assert torch.equal(original, now)
    scale = sghmc_noise_scale(hyper["lr"], momentum, hyper["temperature"], hyper["num_data"])
    if momentum == 0:
        scale = -math.sqrt(2 * hyper["temperature"] / (hyper["num_data"] * hyper["lr"]))  # SGLD's
    assert d_noise[0].shape == param.shape and d_noise[0].dtype == param.dtype
    torch.testing.assert_close(
        d_noise[0] - d_zero[0],
        scale * noise,
        rtol=0,
        atol=tolerance(param.dtype, scale * noise, d_noise[0]),
    )


@given(kernel_inputs(), st.floats(0.0, 0.99))
def test_sghmc_kernel_at_zero_temperature_ignores_nothing_and_adds_nothing(inputs, momentum):
    (param, grad, _, buffer), hyper = inputs
    kwargs = dict(
        momentum=momentum,
        dampening=0.0,
        nesterov=False,
        inplace=False,
        **{**hyper, "temperature": 0.0},
    )
    first = sghmc_direction([param], [grad], [buffer], None, **kwargs)
    second = sghmc_direction([param], [grad], [buffer], None, **kwargs)
    assert torch.equal(first[0][0], second[0][0])
    with pytest.raises(ValueError, match="noise must be given exactly when temperature > 0"):
        sghmc_direction([param], [grad], [buffer], [grad], **kwargs)


def test_inplace_kernels_update_the_given_buffers():
    param, grad, noise = torch.randn(3), torch.randn(3), torch.randn(3)
    buffer = torch.randn(3)
    directions, buffers = sghmc_direction(
        [param],
        [grad],
        [buffer],
        [noise],
        lr=0.1,
        momentum=0.9,
        temperature=1.0,
        num_data=10,
        weight_decay=0.0,
        dampening=0.0,
        nesterov=False,
        maximize=False,
        foreach=False,
    )
    assert buffers[0] is buffer and directions[0] is buffer
