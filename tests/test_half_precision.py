"""float16/bfloat16 parameters: the chain's position in a float32 master (``step/half_precision``).

Checked on the CPU, unfused: a half-precision parameter at T > 0 is the float32 chain
(given the same gradients, bit for bit, through the whole-tensor, chunked and prefetched
paths) rounded to nearest; the bfloat16 SGLD chain that used to freeze has its exact
spread; SGHMC's stationary variance on a bfloat16 Gaussian; T = 0 stays
``torch.optim.SGD`` bit for bit; buffers widen when the master appears; a value assigned
from outside wins; exact resume; the refusal of a malformed saved master.
"""

from __future__ import annotations

import copy
import io
import math
import re

import pytest
import torch

from samplers_as_optim import BAOA, PSGLD, SGHMC, SGLD, SGNHT, AdamWSGHMC
from samplers_as_optim.sgmcmc.step.chunked import CHUNK
from samplers_as_optim.sgmcmc.step.group_noise import PREFETCH_MIN_NUMEL

N = 200

CASES = [
    (SGLD, {"lr": 1e-3}),
    (SGHMC, {"lr": 1e-3, "momentum": 0.9}),
    (SGNHT, {"lr": 1e-3, "momentum": 0.9}),
    (PSGLD, {"lr": 1e-3, "preconditioner_warmup": 2, "eps": 1e-3}),  # (float16: its room)
    (BAOA, {"lr": 1e-3, "momentum": 0.9}),
    (AdamWSGHMC, {"lr": 1e-3, "preconditioner_warmup": 2}),
]
IDS = [cls.__name__ for cls, _ in CASES]
HALF = [torch.bfloat16, torch.float16]


def representable(shape: tuple[int, ...], seed: int, dtype: torch.dtype) -> torch.Tensor:
    """Random float32 values that ``dtype`` holds exactly."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator).to(dtype).float()


def half_case(cls, dtype):
    """Every sampler takes both half dtypes (AdamWSGHMC refused float16 before masters)."""


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize(("cls", "kwargs"), CASES, ids=IDS)
def test_a_half_parameter_is_the_float32_chain_rounded(cls, kwargs, dtype):
    """Given the same gradients, the master is the float32 chain bit for bit.

    Shapes cover the small tensors, one updated in chunks (> CHUNK elements, CPU, not
    foreach) and one whose noise is drawn ahead (>= PREFETCH_MIN_NUMEL).
    """
    half_case(cls, dtype)
    shapes = [(7, 3), (CHUNK + 5,), (PREFETCH_MIN_NUMEL,)]
    start = [representable(shape, i, dtype) for i, shape in enumerate(shapes)]
    half = [torch.nn.Parameter(x.to(dtype)) for x in start]
    full = [torch.nn.Parameter(x.clone()) for x in start]
    opt_half = cls(half, num_data=N, seed=7, **kwargs)
    opt_full = cls(full, num_data=N, seed=7, **kwargs)
    for step in range(4):
        for i, (h, f) in enumerate(zip(half, full, strict=True)):
            g = representable(h.shape, 100 * step + i, dtype)
            h.grad, f.grad = g.to(dtype), g.clone()
        opt_half.step()
        opt_full.step()
    for h, f in zip(half, full, strict=True):
        state = opt_half.state[h]
        assert torch.equal(state["master_param"], f.detach())
        assert torch.equal(h.detach(), f.detach().to(dtype))  # rounded to nearest
        for name, value in opt_full.state[f].items():
            if value.is_floating_point() and value.device == f.device and value.dim():
                assert state[name].dtype == torch.float32, name
                assert torch.equal(state[name], value), name


def test_the_bfloat16_sgld_chain_no_longer_freezes():
    """SGLD, lr=1e-4, N=1000, 100 steps from bfloat16 ones, gradient theta - 1.

    The exact chain is Gaussian around 1 with variance 2 lr/N (1 - a^200) / (1 - a^2),
    a = 1 - lr: sd 0.004450. Without the master the spread was 0.00012. The 10^4
    elements are independent chains, so the RMS deviation from 1 estimates the sd with
    relative standard error 1/sqrt(2n) = 0.71%; the tolerance is 5 of those (3.5%).
    (The gradient is evaluated at the rounded parameter, whose error is below half an
    ulp, 0.002 near 1: it pulls each chain towards the mean it already has, 1, and
    changes the spread by far less than the tolerance.)
    """
    lr, n, steps, num_data = 1e-4, 10_000, 100, 1000
    p = torch.nn.Parameter(torch.ones(n, dtype=torch.bfloat16))
    opt = SGLD([p], lr=lr, num_data=num_data, seed=0)
    for _ in range(steps):
        p.grad = (p.detach().float() - 1).to(torch.bfloat16)
        opt.step()
    a = 1 - lr
    exact = math.sqrt(2 * lr / num_data * (1 - a ** (2 * steps)) / (1 - a**2))
    master = opt.state[p]["master_param"]
    spread = float((master.double() - 1).pow(2).mean().sqrt())
    assert abs(spread / exact - 1) < 5 / math.sqrt(2 * n)
    assert torch.equal(p.detach(), master.to(torch.bfloat16))


@pytest.mark.slow
def test_sghmc_samples_a_bfloat16_gaussian_at_its_variance():
    """SGHMC on N(c, s^2), c = 1.5, s = 2^-5, in bfloat16 (ulp 2^-7 = s/4 near c).

    U = N k (theta - c)^2 / 2 with k = 1 / (N s^2); lr = 0.01 makes eps omega = 0.1, where
    the float32 chain's discretisation bias is 0.07% (measured, 8192 chains, 400 steps).
    Each of the 8192 elements is an independent chain, past its mixing time after 400
    steps: the sample variance has relative standard error sqrt(2/n) = 1.56%. Tolerance:
    5 of those plus 1% for the gradient taken at the rounded parameter (rounding error
    variance ulp^2/12 = 0.5% of s^2): 8.8%. A frozen chain stays at c (variance 0).
    """
    num_data, s, c, n = 1000, 2.0**-5, 1.5, 8192
    k = 1 / (num_data * s**2)
    p = torch.nn.Parameter(torch.full((n,), c, dtype=torch.bfloat16))
    opt = SGHMC([p], lr=0.01, momentum=0.9, num_data=num_data, seed=0)
    for _ in range(400):
        p.grad = ((p.detach().float() - c) * k).to(torch.bfloat16)
        opt.step()
    master = opt.state[p]["master_param"].double()
    ratio = float((master - c).pow(2).mean()) / s**2
    assert abs(ratio - 1) < 5 * math.sqrt(2 / n) + 0.01
    assert opt.state[p]["momentum_buffer"].dtype == torch.float32


def bf16_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    return model.to(torch.bfloat16)


def backward(model: torch.nn.Module, step: int) -> None:
    generator = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(16, 5, generator=generator).to(torch.bfloat16)
    y = torch.randint(0, 3, (16,), generator=generator)
    for p in model.parameters():
        p.grad = None
    torch.nn.functional.cross_entropy(model(x).float(), y).backward()


@pytest.mark.parametrize("foreach", [False, True])
def test_at_temperature_zero_bfloat16_is_torch_sgd_bit_for_bit(foreach):
    ours, theirs = bf16_model(), bf16_model()
    opt = SGHMC(ours.parameters(), lr=0.05, momentum=0.9, num_data=N, temperature=0.0,
                foreach=foreach)  # fmt: skip
    sgd = torch.optim.SGD(theirs.parameters(), lr=0.05, momentum=0.9, foreach=foreach)
    for step in range(4):
        for model, o in ((ours, opt), (theirs, sgd)):
            backward(model, step)
            o.step()
    for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert torch.equal(p, q)
        assert "master_param" not in opt.state[p]
        assert opt.state[p]["momentum_buffer"].dtype == torch.bfloat16


def test_buffers_widen_with_the_master_and_the_master_stays_at_temperature_zero():
    model = bf16_model()
    opt = SGHMC(model.parameters(), lr=0.05, momentum=0.9, num_data=N, temperature=0.0, seed=1)
    for step in range(2):
        backward(model, step)
        opt.step()
    before = {p: opt.state[p]["momentum_buffer"].clone() for p in model.parameters()}
    opt.param_groups[0]["temperature"] = 1.0
    backward(model, 2)
    opt.step()
    for p in model.parameters():
        state = opt.state[p]
        assert state["master_param"].dtype == torch.float32
        assert state["momentum_buffer"].dtype == torch.float32
        assert not torch.equal(state["momentum_buffer"], before[p].float())  # it moved on
    opt.param_groups[0]["temperature"] = 0.0
    masters = {p: opt.state[p]["master_param"].clone() for p in model.parameters()}
    backward(model, 3)
    opt.step()
    for p in model.parameters():
        master = opt.state[p]["master_param"]
        assert master.dtype == torch.float32 and not torch.equal(master, masters[p])
        assert torch.equal(p.detach(), master.to(torch.bfloat16))
        assert opt.state[p]["momentum_buffer"].dtype == torch.float32


def assign(param: torch.nn.Parameter, how: str) -> None:
    if how == "no_grad":
        with torch.no_grad():
            param[0] = 5.0
    elif how == "data=":
        value = param.detach().clone()
        value[0] = 5.0
        param.data = value
    else:  # a module's load_state_dict
        module = torch.nn.Module()
        module.w = param
        module.load_state_dict(
            {"w": torch.cat([torch.full((1,), 5.0), param.detach()[1:].float()])}
        )


@pytest.mark.parametrize("how", ["no_grad", "data=", "load_state_dict"])
def test_a_value_assigned_from_outside_wins_element_by_element(how):
    start = representable((6,), 0, torch.bfloat16)
    a, b = (torch.nn.Parameter(start.to(torch.bfloat16)) for _ in range(2))
    opt_a = SGLD([a], lr=1e-3, num_data=N, seed=3)
    opt_b = SGLD([b], lr=1e-3, num_data=N, seed=3)
    for step in range(3):
        g = representable((6,), 10 + step, torch.bfloat16).to(torch.bfloat16)
        a.grad, b.grad = g.clone(), g.clone()
        if step == 2:
            assign(a, how)
        opt_a.step()
        opt_b.step()
    master_a, master_b = opt_a.state[a]["master_param"], opt_b.state[b]["master_param"]
    assert torch.equal(master_a[1:], master_b[1:])  # the master kept its bits there
    assert abs(float(master_a[0]) - 5.0) < 0.05  # re-seeded at 5, then one step
    assert torch.equal(a.detach(), master_a.to(torch.bfloat16))


def test_a_write_through_data_in_place_is_overwritten_by_the_master():
    """``param.data[...] = ...`` bypasses the version counter (documented): not seen."""
    a = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    opt = SGLD([a], lr=1e-3, num_data=N, seed=3)
    a.grad = torch.zeros(4, dtype=torch.bfloat16)
    opt.step()
    a.data[0] = 5.0
    opt.step()
    assert abs(float(a[0]) - 1.0) < 0.05


@pytest.mark.parametrize(("cls", "kwargs"), CASES, ids=IDS)
def test_a_checkpoint_resumes_a_bfloat16_chain_bit_for_bit(cls, kwargs):
    model = bf16_model()
    opt = cls(model.parameters(), num_data=N, seed=11, **kwargs)
    for step in range(3):
        backward(model, step)
        opt.step()
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    twin = bf16_model(seed=99)
    twin.load_state_dict(saved["model"])
    opt2 = cls(twin.parameters(), num_data=N, **kwargs)
    opt2.load_state_dict(saved["opt"])
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        for name, value in opt.state[p].items():
            assert opt2.state[q][name].dtype == value.dtype, name
            assert torch.equal(opt2.state[q][name], value), name
    for step in range(3, 6):
        for m, o in ((model, opt), (twin, opt2)):
            backward(m, step)
            o.step()
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["master_param"], opt2.state[q]["master_param"])


def test_a_malformed_saved_master_is_refused_before_anything_changes():
    p = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    opt = SGLD([p], lr=1e-3, num_data=N, seed=0)
    p.grad = torch.ones(3, dtype=torch.bfloat16)
    opt.step()
    state = copy.deepcopy(opt.state_dict())
    state["state"][0]["master_param"] = torch.zeros(2)
    before = opt.state[p]["master_param"].clone()
    message = (
        "Invalid state_dict: 'master_param' of parameter 0 is a torch.float32 tensor of "
        "shape (2,) (expected a torch.float32 tensor of its parameter's shape (3,))"
    )
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        opt.load_state_dict(state)
    assert torch.equal(opt.state[p]["master_param"], before)


def test_a_master_saved_for_a_parameter_now_float32_is_dropped():
    p = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    opt = SGLD([p], lr=1e-3, num_data=N, seed=0)
    p.grad = torch.ones(3, dtype=torch.bfloat16)
    opt.step()
    q = torch.nn.Parameter(p.detach().float())
    opt2 = SGLD([q], lr=1e-3, num_data=N)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert "master_param" not in opt2.state[q]


def test_a_compiled_step_keeps_the_master():
    """Under torch.compile the master is not compared with the parameter (inductor does
    not round the intermediate cast, and the compare re-seeded every master from its
    rounding: 3.6e-3 off after one step). The compiled chain is the eager one up to the
    roundings compiling fuses (float32 ulps, far below 1e-5 here)."""
    start = representable((50,), 0, torch.bfloat16).to(torch.bfloat16)
    a, b = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    eager = SGHMC([a], lr=1e-3, num_data=100, seed=1, nonfinite="skip")
    compiled = SGHMC([b], lr=1e-3, num_data=100, seed=1, nonfinite="skip")
    step = torch.compile(compiled.step)
    for i in range(4):
        g = representable((50,), 10 + i, torch.bfloat16).to(torch.bfloat16)
        a.grad, b.grad = g.clone(), g.clone()
        eager.step()
        step()
    difference = eager.state[a]["master_param"] - compiled.state[b]["master_param"]
    assert float(difference.abs().max()) < 1e-5
    assert torch.equal(b.detach(), compiled.state[b]["master_param"].to(torch.bfloat16))
