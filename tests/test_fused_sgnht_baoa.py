"""SGNHT's and BAOA's fused kernels, and many small tensors in one launch.

As ``tests/test_fused.py``: without CUDA the kernels run on CPU tensors in Triton's
interpreter (``TRITON_INTERPRET=1``, ``fused.RUN_ON_CPU_UNDER_INTERPRETER``); everything
here was checked that way only. What is checked: the kernels against the reference
updates (``sgnht_direction``, ``baoa_direction``) given the noise the kernels drew
(``fused.fused_normal``), several steps, float32 and float64, with the options; the noise
each kernel injects (its moments, its independence, equal to the fused stream); a shard
drawing its slice of the whole; exact resume; BAOA at T = 0 as SGD; the ``fused=True``
refusals; the non-finite policies (nothing changes); the launches shared by small
tensors (the same numbers, bit for bit, as one launch per tensor, in fewer launches);
and that every kernel compiles for a GPU (sm_90) through Triton's compiler on the CPU.
"""

from __future__ import annotations

import copy
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from triton_interpreter import use_interpreter

CUDA = use_interpreter()
pytest.importorskip("triton")

from samplers_as_optim import BAOA, SGHMC, SGLD, SGNHT  # noqa: E402
from samplers_as_optim.core.streams import parameter_key  # noqa: E402
from samplers_as_optim.names import set_parameter_layout  # noqa: E402
from samplers_as_optim.sgmcmc import fused  # noqa: E402
from samplers_as_optim.sgmcmc.baoa import baoa_direction, baoa_noise_scale  # noqa: E402
from samplers_as_optim.sgmcmc.fused import fused_normal  # noqa: E402
from samplers_as_optim.sgmcmc.fused import launch as _fused_launch  # noqa: E402
from samplers_as_optim.sgmcmc.sghmc import sghmc_noise_scale  # noqa: E402
from samplers_as_optim.sgmcmc.sgnht import sgnht_direction, sgnht_initial_state  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")
N = 100
LR, T = 0.05, 2.0


@pytest.fixture(autouse=True)
def _fused_on_this_device(monkeypatch):
    """On the CPU, let the fused path run under Triton's interpreter (for tests only)."""
    monkeypatch.setattr(fused, "RUN_ON_CPU_UNDER_INTERPRETER", not CUDA)


def named(dtype=torch.float32, seed=1, **shapes):
    generator = torch.Generator().manual_seed(seed)
    return [
        (name, torch.nn.Parameter(torch.randn(shape, generator=generator, dtype=dtype).to(DEVICE)))
        for name, shape in shapes.items()
    ]


def gradients(params, steps, seed=2):
    generator = torch.Generator().manual_seed(seed)
    return [
        [torch.randn(p.shape, generator=generator, dtype=p.dtype).to(DEVICE) for _, p in params]
        for _ in range(steps)
    ]


def run(optimizer, params, grads):
    for step in grads:
        for (_, p), g in zip(params, step, strict=True):
            p.grad = g.clone()
        optimizer.step()


def twins_of(params):
    return [(n, torch.nn.Parameter(p.detach().clone())) for n, p in params]


def tolerance(dtype):
    """The kernel computes in float64 and rounds once where the reference rounds each
    operation in the parameter's dtype (and sums the kinetic energy in float32 for a
    float32 parameter): a few units of the last place."""
    return (
        {"rtol": 1e-12, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-6}
    )


def xi(p, name, step, seed, offset=0):
    noise = fused_normal(
        p.numel(), seed=seed, step=step, key=parameter_key(name), offset=offset, device=DEVICE
    )
    return noise.to(p.dtype).view_as(p)


# ------------------------------------------------------------------ against the references
SGNHT_CASES = {
    "symmetric": {"weight_decay": 0.01},
    "ding-maximize": {"kinetic_energy": "ding", "maximize": True, "momentum": 0.5},
    "symmetric-maximize-decay": {"maximize": True, "weight_decay": 0.1, "momentum": 0.0},
}
SHAPES = {"w": (3, 70), "b": (5,), "empty": (0,)}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("case", SGNHT_CASES)
def test_sgnht_is_its_reference_update_given_the_kernels_noise(case, dtype):
    """Four steps, lr changed before the last (the buffer is re-expressed before the
    kernel), against ``sgnht_direction`` given the noise the kernel drew: parameters,
    buffers and thermostats; the empty tensor's thermostat stays as it is."""
    kwargs = SGNHT_CASES[case]
    momentum = kwargs.get("momentum", 0.9)
    params = named(dtype, **SHAPES)
    grads = gradients(params, 4)
    opt = SGNHT(params, lr=LR, num_data=N, temperature=T, seed=9, fused=True, **kwargs)
    reference = {name: p.detach().clone() for name, p in params}
    state = {name: sgnht_initial_state(p.detach(), momentum) for name, p in params}
    lrs = [LR, LR, LR, LR / 4]
    common = {
        "momentum": momentum,
        "temperature": T,
        "num_data": N,
        "weight_decay": kwargs.get("weight_decay", 0.0),
        "maximize": kwargs.get("maximize", False),
        "kinetic_energy": kwargs.get("kinetic_energy", "symmetric"),
        "foreach": False,
    }
    for step, (lr, step_grads) in enumerate(zip(lrs, grads, strict=True)):
        opt.param_groups[0]["lr"] = lr
        for (name, p), g in zip(params, step_grads, strict=True):
            p.grad = g.clone()
            buffer, thermostat = state[name]
            if step and lr != lrs[step - 1]:  # the momentum kept (sghmc.rescale_momentum)
                buffer = buffer * math.sqrt(lrs[step - 1] / lr)
            [d], [buffer], [thermostat] = sgnht_direction(
                [reference[name]], [g], [buffer], [thermostat], [xi(p, name, step, 9)],
                lr=lr, **common,
            )  # fmt: skip
            state[name] = (buffer, thermostat)
            reference[name].add_(d.mul(-lr))
        opt.step()
    for name, p in params:
        torch.testing.assert_close(p.detach(), reference[name], **tolerance(dtype))
        torch.testing.assert_close(
            opt.state[p]["momentum_buffer"], state[name][0], **tolerance(dtype)
        )
        torch.testing.assert_close(opt.state[p]["thermostat"], state[name][1], **tolerance(dtype))
    empty = dict(params)["empty"]
    assert opt.state[empty]["thermostat"].item() == pytest.approx(1 - momentum)
    assert opt.state[dict(params)["w"]]["thermostat"].item() != pytest.approx(1 - momentum)


BAOA_CASES = {
    "plain": {"momentum": 0.9},
    "decay-maximize": {"momentum": 0.5, "weight_decay": 0.1, "maximize": True},
    "momentum-0": {"momentum": 0.0, "weight_decay": 0.01},
}


@pytest.mark.parametrize("temperature", [T, 0.0], ids=["T", "T0"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("case", BAOA_CASES)
def test_baoa_is_its_reference_update_given_the_kernels_noise(case, dtype, temperature):
    kwargs = BAOA_CASES[case]
    params = named(dtype, **SHAPES)
    grads = gradients(params, 3)
    opt = BAOA(params, lr=LR, num_data=N, temperature=temperature, seed=9, fused=True, **kwargs)
    reference = {name: p.detach().clone() for name, p in params}
    buffers = {name: torch.zeros_like(p) for name, p in params}
    common = {
        "lr": LR,
        "momentum": kwargs["momentum"],
        "temperature": temperature,
        "num_data": N,
        "weight_decay": kwargs.get("weight_decay", 0.0),
        "maximize": kwargs.get("maximize", False),
        "foreach": False,
    }
    for step, step_grads in enumerate(grads):
        for (name, p), g in zip(params, step_grads, strict=True):
            p.grad = g.clone()
            noise = [xi(p, name, step, 9)] if temperature > 0 else None
            [d], [buffers[name]] = baoa_direction(
                [reference[name]], [g], [buffers[name]], noise, **common
            )
            reference[name].add_(d.mul(-LR))
        opt.step()
    for name, p in params:
        torch.testing.assert_close(p.detach(), reference[name], **tolerance(dtype))
        torch.testing.assert_close(
            opt.state[p]["momentum_buffer"], buffers[name], **tolerance(dtype)
        )


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_baoa_at_temperature_zero_is_sgd(dtype):
    """BAOA at T = 0 is ``SGD(lr (1 + mu) / 2, mu)`` up to rounding (``baoa`` module
    docstring: the half drifts are two roundings; a few units of the last place over
    four steps)."""
    momentum = 0.8
    params = named(dtype, w=(4, 5), b=(3,))
    twins = twins_of(params)
    grads = gradients(params, 4)
    run(BAOA(params, lr=0.1, momentum=momentum, num_data=N, temperature=0.0, fused=True),
        params, grads)  # fmt: skip
    sgd = torch.optim.SGD(
        [p for _, p in twins], lr=0.1 * (1 + momentum) / 2, momentum=momentum, foreach=False
    )
    run(sgd, twins, grads)
    for (_, p), (_, q) in zip(params, twins, strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), **tolerance(dtype))


# ------------------------------------------------------------------ the noise
def injected_noise(cls, params, steps, **kwargs):
    """What the kernel adds to a zero buffer from a zero gradient, over its scale: xi.

    BAOA with momentum 0 stores b = sigma xi; SGNHT's first step stores b = sigma xi
    (the buffer starts at 0); ``step`` moves the chain to that step first."""
    opt = cls(params, lr=LR, num_data=N, temperature=T, seed=3, fused=True, **kwargs)
    opt.param_groups[0]["step"] = steps
    for _, p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    if cls is BAOA:
        scale = baoa_noise_scale(LR, 0.0, T, N)
    else:
        scale = sghmc_noise_scale(LR, kwargs.get("momentum", 0.9), T, N)
    return {name: opt.state[p]["momentum_buffer"].double().cpu() / scale for name, p in params}


@pytest.mark.parametrize("cls", [BAOA, SGNHT], ids=lambda c: c.__name__)
def test_the_kernels_draw_the_fused_stream_standard_normal_and_independent(cls):
    """The noise the kernels inject is the fused stream's (``fused_normal``, to the
    rounding of dividing by the scale), each tensor with its own key in a shared launch.
    Over n = 20,000 draws a correlation is N(0, 1/n) and the mean N(0, 1/n), the sample
    sd about N(1, 1/(2n)): 5 standard errors each (a false alarm about once in 10^6)."""
    kwargs = {"momentum": 0.0} if cls is BAOA else {}
    shapes = {"a": (100, 200), "b": (20_000,)}
    first = injected_noise(cls, named(torch.float64, **shapes), 0, **kwargs)
    later = injected_noise(cls, named(torch.float64, **shapes), 5, **kwargs)
    for name in shapes:
        stream = fused_normal(20_000, seed=3, step=0, key=parameter_key(name), device=DEVICE)
        torch.testing.assert_close(
            first[name].flatten(), stream.double().cpu(), rtol=1e-12, atol=1e-12
        )
    n = 20_000
    a, b, a_later = first["a"].flatten(), first["b"], later["a"].flatten()
    assert abs(a.mean()) < 5 / math.sqrt(n)
    assert abs(a.std() - 1) < 5 / math.sqrt(2 * n)
    bound = 5 / math.sqrt(n)
    for what, other in {
        "another parameter": b,
        "another step": a_later,
        "next position": a.roll(1),
    }.items():
        r = torch.corrcoef(torch.stack((a, other)))[0, 1]
        assert abs(r) < bound, what


def test_a_baoa_shard_steps_as_its_slice_of_the_whole():
    """Parameters holding parts of one tensor (``set_parameter_layout``) take exactly the
    whole tensor's steps on their elements: the same noise, bit for bit."""
    torch.manual_seed(0)
    start, grads = torch.randn(300, device=DEVICE), torch.randn(3, 300, device=DEVICE)
    whole = torch.nn.Parameter(start.clone())
    parts = [torch.nn.Parameter(start[a:b].clone()) for a, b in ((0, 100), (100, 300))]
    for part, offset in zip(parts, (0, 100), strict=True):
        set_parameter_layout(part, offset, 300)
    one = BAOA([("w", whole)], lr=0.1, num_data=N, seed=5, fused=True)
    split = [BAOA([("w", part)], lr=0.1, num_data=N, seed=5, fused=True) for part in parts]
    for g in grads:
        whole.grad = g.clone()
        one.step()
        for part, opt, (a, b) in zip(parts, split, ((0, 100), (100, 300)), strict=True):
            part.grad = g[a:b].clone()
            opt.step()
    assert torch.equal(torch.cat([part.detach() for part in parts]), whole.detach())


def test_an_sgnht_shard_draws_its_slice_and_thermostats_itself():
    """A shard's first step is the whole's on its elements, bit for bit (the buffer
    starts at 0, the thermostat at 1 - mu); its thermostat then sums its own elements
    (as the unfused step: one thermostat per tensor held), so later steps are the
    reference's on the slice, with the whole's noise at the shard's offset."""
    torch.manual_seed(0)
    start, grads = (
        torch.randn(300, device=DEVICE, dtype=torch.float64),
        torch.randn(3, 300, device=DEVICE, dtype=torch.float64),
    )
    whole = torch.nn.Parameter(start.clone())
    part = torch.nn.Parameter(start[100:].clone())
    set_parameter_layout(part, 100, 300)
    one = SGNHT([("w", whole)], lr=LR, num_data=N, seed=5, fused=True)
    shard = SGNHT([("w", part)], lr=LR, num_data=N, seed=5, fused=True)
    reference = start[100:].clone()
    buffer, thermostat = sgnht_initial_state(reference, 0.9)
    for step, g in enumerate(grads):
        whole.grad, part.grad = g.clone(), g[100:].clone()
        one.step()
        shard.step()
        if step == 0:
            assert torch.equal(part.detach(), whole.detach()[100:])
        [d], [buffer], [thermostat] = sgnht_direction(
            [reference], [g[100:]], [buffer], [thermostat], [xi(whole, "w", step, 5)[100:]],
            lr=LR, momentum=0.9, temperature=1.0, num_data=N, weight_decay=0.0,
            maximize=False, foreach=False,
        )  # fmt: skip
        reference.add_(d.mul(-LR))
    torch.testing.assert_close(part.detach(), reference, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(shard.state[part]["thermostat"], thermostat, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("cls", [SGNHT, BAOA], ids=lambda c: c.__name__)
def test_resume_is_exact(cls):
    """A state_dict round trip and a deep copy: the same chain, bit for bit."""
    params = named(w=(6, 7), b=(3,))
    grads = gradients(params, 4)
    opt = cls(params, lr=0.05, num_data=N, seed=4, fused=True)
    run(opt, params, grads[:2])
    saved = copy.deepcopy(opt.state_dict())
    twins = twins_of(params)
    copied = copy.deepcopy(opt)
    resumed = cls(twins, lr=0.05, num_data=N, seed=0, fused=True)
    resumed.load_state_dict(saved)
    run(opt, params, grads[2:])
    run(resumed, twins, grads[2:])
    copied_params = [
        (n, p) for (n, _), p in zip(params, copied.param_groups[0]["params"], strict=True)
    ]
    run(copied, copied_params, grads[2:])
    for (_, p), (_, q), (_, r) in zip(params, twins, copied_params, strict=True):
        assert torch.equal(p, q)
        assert torch.equal(p, r)
        for name, value in opt.state[p].items():
            assert torch.equal(value, resumed.state[q][name]), name


# ------------------------------------------------------------------ refusals
def fused_error(reason):
    return (
        f"Invalid fused: True ({reason}; use fused=None to take the fused path only where it "
        "can run, or fused=False)"
    )


def test_fused_true_refuses_a_thermostat_in_another_dtype_before_anything_changes():
    """A float64 checkpoint loaded into a float32 model keeps its float64 thermostats
    (``own_dtype``): the kernel takes state in the parameter's dtype, so the step is
    refused, naming the state, with nothing changed."""
    params64 = named(torch.float64, w=(3, 4))
    opt64 = SGNHT(params64, lr=LR, num_data=N, seed=1, fused=True)
    run(opt64, params64, gradients(params64, 1))
    params = named(torch.float32, w=(3, 4))
    opt = SGNHT(params, lr=LR, num_data=N, seed=1, fused=True)
    opt.load_state_dict(opt64.state_dict())
    before = params[0][1].detach().clone()
    params[0][1].grad = torch.ones(3, 4, device=DEVICE)
    with pytest.raises(ValueError) as error:
        opt.step()
    assert str(error.value) == fused_error(
        "the state 'thermostat' of param group 0, parameter 0 'w' of shape (3, 4) is "
        "torch.float64, unlike its parameter (torch.float32)"
    )
    assert torch.equal(params[0][1].detach(), before)
    assert opt.param_groups[0]["step"] == 1


@pytest.mark.parametrize("cls", [SGNHT, BAOA], ids=lambda c: c.__name__)
def test_fused_true_takes_half_precision_and_refuses_other_dtypes(cls):
    for dtype in (torch.float16, torch.bfloat16):  # a float32 master copy (test_fused_amp)
        half = torch.nn.Parameter(torch.zeros(2, dtype=dtype, device=DEVICE))
        assert cls([half], lr=0.1, num_data=N, fused=True)._fused is True
    complex_ = torch.nn.Parameter(torch.zeros(2, dtype=torch.complex64, device=DEVICE))
    with pytest.raises(ValueError) as error:
        cls([complex_], lr=0.1, num_data=N, fused=True)
    assert str(error.value) == fused_error(
        "param group 0, parameter 0 of shape (2,) is torch.complex64: the fused kernels take "
        "float32, float64, float16 and bfloat16 parameters"
    )


# ------------------------------------------------------------------ non-finite gradients
def everything(opt, params):
    tensors = [p.detach().clone() for _, p in params]
    return tensors + [v.clone() for _, p in params for v in opt.state[p].values()]


@pytest.mark.parametrize("cls", [SGNHT, BAOA], ids=lambda c: c.__name__)
def test_skip_leaves_every_bit_and_raise_refuses_at_the_next_call(cls):
    params = named(w=(4, 3), b=(3,))
    grads = gradients(params, 4)
    skipping = cls(twins_of(params), lr=0.1, num_data=N, seed=2, fused=True, nonfinite="skip")
    skipped_params = list(
        zip((n for n, _ in params), skipping.param_groups[0]["params"], strict=True)
    )
    run(skipping, skipped_params, grads[:1])
    bad = [g.clone() for g in grads[1]]
    bad[1][0] = math.nan
    before = everything(skipping, skipped_params)
    run(skipping, skipped_params, [bad])
    after = everything(skipping, skipped_params)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert int(skipping.param_groups[0]["skipped_steps"]) == 1

    opt = cls(params, lr=0.1, num_data=N, seed=2, fused=True)
    run(opt, params, grads[:1])
    before = everything(opt, params)
    run(opt, params, [bad])  # no error yet: no host synchronisation
    assert all(torch.equal(a, b) for a, b in zip(before, everything(opt, params), strict=True))
    with pytest.raises(FloatingPointError) as error:
        run(opt, params, grads[2:3])
    assert str(error.value) == (
        f"{cls.__name__} refused step 2: non-finite gradient in param group 0, parameter 1 'b' "
        "of shape (3,); no parameter or buffer was changed (the fused step checks the gradients "
        "on the device, without a host synchronisation: this call, the next after that step, "
        "raises it and changes nothing either)"
    )
    assert all(torch.equal(a, b) for a, b in zip(before, everything(opt, params), strict=True))
    assert opt.param_groups[0]["step"] == 1
    run(opt, params, grads[2:])
    twins = twins_of(named(w=(4, 3), b=(3,)))
    run(cls(twins, lr=0.1, num_data=N, seed=2, fused=True), twins, grads[:1] + grads[2:])
    assert all(torch.equal(p, q) for (_, p), (_, q) in zip(params, twins, strict=True))


# ------------------------------------------------------------------ many tensors, one launch
def count_launches(monkeypatch):
    calls = []
    original = _fused_launch._run

    def counted(jitted, grid, *args):
        calls.append(grid)
        return original(jitted, grid, *args)

    monkeypatch.setattr(_fused_launch, "_run", counted)
    return calls


MANY = {f"p{i}": (i + 1, 3) for i in range(5)} | {"big": (4, 50)}
SHARDS = {"p1": 1000, "p3": 2**33 + 5}
LAUNCH_CASES = {
    "SGLD": (SGLD, {"weight_decay": 0.01}, 1),
    "SGHMC": (SGHMC, {"momentum": 0.9, "weight_decay": 0.01}, 1),  # (T = 0: torch's fused SGD)
    "SGHMC-T": (SGHMC, {"momentum": 0.5, "maximize": True}, 1),
    "SGNHT": (SGNHT, {"kinetic_energy": "ding"}, 2),
    "BAOA": (BAOA, {"weight_decay": 0.1}, 1),
}


@pytest.mark.parametrize("case", LAUNCH_CASES)
def test_small_tensors_share_launches_with_the_numbers_of_one_launch_each(case, monkeypatch):
    """Six tensors, one of them above ``MULTI_TENSOR_BLOCKS`` blocks (set to 2 blocks of
    64 elements), two of them shards at offsets (one past 2**32), over two steps (the first creates SGHMC's buffer): the same parameters
    and state bit for bit as one launch per tensor, in 2 launches per step instead of 6
    (SGNHT: one more each way, its thermostats')."""
    cls, kwargs, per_step = LAUNCH_CASES[case]
    monkeypatch.setattr(_fused_launch, "block_size", lambda device: 64)
    monkeypatch.setattr(_fused_launch, "MULTI_TENSOR_BLOCKS", 2)
    params = named(torch.float32, **MANY)
    twins = twins_of(params)
    for (name, p), (_, q) in zip(params, twins, strict=True):
        if name in SHARDS:  # shards of larger tensors: their noise from their offsets on
            for tensor in (p, q):
                set_parameter_layout(tensor, SHARDS[name], SHARDS[name] + p.numel() + 7)
    grads = gradients(params, 2)
    calls = count_launches(monkeypatch)
    opt = cls(params, lr=LR, num_data=N, seed=6, fused=True, **kwargs)
    run(opt, params, grads[:1])
    shared = len(calls)
    run(opt, params, grads[1:])
    monkeypatch.setattr(_fused_launch, "MULTI_TENSOR_BLOCKS", 0)
    calls.clear()
    alone = cls(twins, lr=LR, num_data=N, seed=6, fused=True, **kwargs)
    run(alone, twins, grads[:1])
    assert (shared, len(calls)) == (1 + per_step, len(MANY) + per_step - 1)
    run(alone, twins, grads[1:])
    for (_, p), (_, q) in zip(params, twins, strict=True):
        assert torch.equal(p, q)
        for name, value in opt.state[p].items():
            assert torch.equal(value, alone.state[q][name]), name


def test_a_launch_with_tensors_of_two_dtypes_is_one_per_dtype(monkeypatch):
    params = named(torch.float32, a=(3,), b=(4,)) + named(torch.float64, c=(5,), d=(6,))
    twins = twins_of(params)
    grads = gradients(params, 2)
    calls = count_launches(monkeypatch)
    run(SGHMC(params, lr=LR, num_data=N, seed=1, fused=True), params, grads)
    assert len(calls) == 2 * 2
    monkeypatch.setattr(_fused_launch, "MULTI_TENSOR_BLOCKS", 0)
    run(SGHMC(twins, lr=LR, num_data=N, seed=1, fused=True), twins, grads)
    assert all(torch.equal(p, q) for (_, p), (_, q) in zip(params, twins, strict=True))


# ------------------------------------------------------------------ the compiler
COMPILE = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction
    from samplers_as_optim.sgmcmc.baoa import triton_kernel as _baoa_fused
    from samplers_as_optim.sgmcmc.fused import normal as _fused_normal
    from samplers_as_optim.sgmcmc.sghmc import triton_kernel as _sghmc_fused
    from samplers_as_optim.sgmcmc.sgld import triton_kernel as _sgld_fused
    from samplers_as_optim.sgmcmc.sgnht import triton_kernel as _sgnht_fused

    HEAD = {"count": "i32", "programs": "i32", "numel": "i32", "offset": "i64",
            "seed": "u64"}
    FP = {"param": "*fp32", "grad": "*fp32", "buffer": "*fp32", "thermostat": "*fp32",
          "largest": "*fp64", "partials": "*fp64", "master": "*fp32", "grad_scale": "*fp32"}
    FLAGS = ("MAXIMIZE", "DECAY", "NOISE", "FIRST", "NESTEROV", "SYMMETRIC")
    KERNELS = [  # with the mode that launches alone for one of them (the other's code)
        (_sgld_fused._sgld, (True,)), (_sghmc_fused._sghmc, (False, True)),
        (_sgnht_fused._sgnht, (True,)), (_baoa_fused._baoa, (True,)),
    ]
    compiled = 0
    for kernel, modes in KERNELS:
        fn = JITFunction(kernel)
        for multi in modes:
            signature, constants = {}, {"BLOCK": 1024, "MULTI": multi}
            for p in fn.params:
                if p.name == "table":
                    signature[p.name] = "*i64" if multi else "constexpr"
                    if not multi:
                        constants[p.name] = None
                elif p.is_constexpr:
                    signature[p.name] = "constexpr"
                    constants.setdefault(p.name, p.name in FLAGS)
                else:
                    signature[p.name] = HEAD.get(p.name) or FP.get(p.name) or "i64"
            try:
                source = ASTSource(fn, signature, constants)
            except TypeError as error:  # another Triton's compile API
                print("API", error)
                raise SystemExit(0)
            triton.compile(source, target=GPUTarget("cuda", 90, 32))
            compiled += 1
    for kernel, signature in (
        (_sgnht_fused._thermostat, {"table": "*i64", "count": "i32", "thermostat": "*fp32",
                                   "factor_bits": "i64", "cooling_bits": "i64"}),
        (_fused_normal._draw, {"out": "*fp32", "numel": "i32", "offset": "i64",
                               "seed": "u64"}),
    ):
        fn = JITFunction(kernel)
        source = ASTSource(fn, {**signature, "BLOCK": "constexpr"}, {"BLOCK": 1024})
        triton.compile(source, target=GPUTarget("cuda", 90, 32))
        compiled += 1
    print(compiled)
    """
)


def test_every_kernel_compiles_for_a_gpu():
    """Triton's compiler (not its interpreter: a process without ``TRITON_INTERPRET``)
    compiles every kernel of SGLD, SGHMC, SGNHT (both phases), BAOA and the noise, the
    shared launch's code for each and the lone launch's for one, to a cubin for sm_90, on the CPU: the annotations, the table's pointer casts and the
    loops are valid Triton. Nothing is run."""
    environment = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    environment["TRITON_DEFAULT_FP_FUSION"] = "1"
    done = subprocess.run(
        [sys.executable, "-c", COMPILE],
        capture_output=True,
        text=True,
        timeout=300,
        env=environment,
    )
    if done.returncode and "ptxas" in done.stderr and "No such file" in done.stderr:
        pytest.skip("Triton's ptxas is missing")
    assert done.returncode == 0, done.stderr[-3000:]
    if done.stdout.startswith("API"):
        pytest.skip(f"this Triton's compile API differs from 3.9's: {done.stdout.strip()}")
    assert done.stdout.split()[-1] == "7"
