"""The fused step of PSGLD and AdamWSGHMC (``psgld/triton_kernel``, ``adamw_sghmc/triton_kernel``).

Without CUDA the kernels run on CPU tensors in Triton's interpreter, as in
``tests/test_fused.py`` (whose preamble this repeats): these results were seen through
the interpreter only. Checked: the kernels against the reference updates
(``psgld_direction``, ``adamw_sghmc_direction``) given the noise the kernel drew
(``fused.fused_normal``), over steps that freeze the pooled preconditioner; temperature 0
as ``torch.optim.RMSprop`` and ``torch.optim.AdamW(fused=True)``; a shard stepping as its
slice of the whole; exact resume; ``fused=None``; the refusals; non-finite gradients.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from triton_interpreter import use_interpreter

CUDA = use_interpreter()
pytest.importorskip("triton")

from samplers_as_optim import PSGLD, AdamWSGHMC  # noqa: E402
from samplers_as_optim.core.streams import parameter_key  # noqa: E402
from samplers_as_optim.names import set_member_dims, set_parameter_layout  # noqa: E402
from samplers_as_optim.sgmcmc import fused  # noqa: E402
from samplers_as_optim.sgmcmc.adamw_sghmc import adamw_sghmc_direction  # noqa: E402
from samplers_as_optim.sgmcmc.fused import backend as fused_step_module  # noqa: E402
from samplers_as_optim.sgmcmc.fused import fused_normal  # noqa: E402
from samplers_as_optim.sgmcmc.fused.pooled import compact_layout, layout  # noqa: E402
from samplers_as_optim.sgmcmc.psgld import psgld_direction  # noqa: E402
from samplers_as_optim.sgmcmc.sampling_preconditioner import (  # noqa: E402
    pooled_second_moment,
)

DEVICE = torch.device("cuda" if CUDA else "cpu")
N = 100
SHAPES = {"w": (3, 4, 5), "m": (6, 4), "b": (5,)}


@pytest.fixture(autouse=True)
def _fused_on_this_device(monkeypatch):
    """On the CPU, let the fused path run under Triton's interpreter (for tests only)."""
    monkeypatch.setattr(fused, "RUN_ON_CPU_UNDER_INTERPRETER", not CUDA)


def named(dtype=torch.float64, shapes=None):
    generator = torch.Generator().manual_seed(1)
    return [
        (name, torch.nn.Parameter(torch.randn(shape, generator=generator, dtype=dtype).to(DEVICE)))
        for name, shape in (shapes or SHAPES).items()
    ]


def twins_of(params):
    return [(n, torch.nn.Parameter(p.detach().clone())) for n, p in params]


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


def tolerance(dtype):
    """float64: the kernel computes in float64 as the reference does, in another order.
    float32: the kernel rounds once where the reference rounds each operation (a few
    units in the last place of the step, divided by a preconditioner near sqrt(V))."""
    if dtype == torch.float64:
        return {"rtol": 1e-11, "atol": 1e-12}
    return {"rtol": 2e-5, "atol": 2e-5}


def xi(name, p, seed, step):
    key = parameter_key(name)
    return fused_normal(p.numel(), seed=seed, step=step, key=key, device=DEVICE).to(p.dtype)


# ------------------------------------------------------------------ PSGLD
PSGLD_CASES = {
    "factored-freezes-at-2": {"preconditioner_warmup": 2},
    "decay-maximize": {"weight_decay": 0.1, "maximize": True, "alpha": 0.9},
    "elementwise-moving": {"preconditioner": "elementwise", "preconditioner_warmup": None},
    "elementwise-freezes-at-1": {"preconditioner": "elementwise", "preconditioner_warmup": 1},
    "li-correction": {
        "preconditioner": "elementwise",
        "preconditioner_warmup": None,
        "correction": True,
        "alpha": 0.5,
    },
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("case", PSGLD_CASES)
def test_the_psgld_kernel_is_the_reference_update_given_its_noise(case, dtype):
    """Four steps against ``psgld_direction`` and the step, given the kernel's noise;
    the pooled preconditioner is computed before the kernel and frozen as the reference
    freezes it."""
    kwargs = PSGLD_CASES[case]
    lr, temperature = 0.01, 2.0
    params = named(dtype)
    grads = gradients(params, 4)
    opt = PSGLD(params, lr=lr, num_data=N, temperature=temperature, seed=9, fused=True, **kwargs)
    options = {
        "alpha": kwargs.get("alpha", 0.99),
        "eps": 1e-8,
        "weight_decay": kwargs.get("weight_decay", 0.0),
        "maximize": kwargs.get("maximize", False),
        "preconditioner": kwargs.get("preconditioner", "factored"),
        "preconditioner_warmup": kwargs.get("preconditioner_warmup", 1000),
    }
    reference = {}
    for name, p in params:
        state = {
            "square_avg": [torch.zeros_like(p)],
            "step": [torch.tensor(0.0)],
            "preconditioner": [None],
            "preconditioner_step": [torch.tensor(0.0)],
        }
        previous = None
        if kwargs.get("correction"):
            previous = ([p.detach().clone()], [torch.zeros_like(p)])
        reference[name] = (p.detach().clone(), state, previous)
    for step, step_grads in enumerate(grads):
        for (name, p), g in zip(params, step_grads, strict=True):
            p.grad = g.clone()
            theta, state, previous = reference[name]
            [d], new = psgld_direction(
                [theta],
                [g],
                state["square_avg"],
                [xi(name, p, 9, step).view_as(p)],
                lr=lr,
                temperature=temperature,
                num_data=N,
                foreach=False,
                previous=previous,
                steps=state["step"],
                preconditioners=state["preconditioner"],
                frozen_at=state["preconditioner_step"],
                **options,
            )
            for key in ("step", "preconditioner", "preconditioner_step"):
                state[key] = new[key]
            theta.add_(d.mul(-lr))
        opt.step()
    for name, p in params:
        theta, state, previous = reference[name]
        torch.testing.assert_close(p.detach(), theta, **tolerance(dtype))
        torch.testing.assert_close(opt.state[p]["square_avg"], state["square_avg"][0])
        assert float(opt.state[p]["step"]) == float(state["step"][0]) == 4
        assert float(opt.state[p]["preconditioner_step"]) == float(state["preconditioner_step"][0])
        frozen = state["preconditioner"][0]
        assert (frozen is None) == ("preconditioner" not in opt.state[p])
        if frozen is not None:
            torch.testing.assert_close(opt.state[p]["preconditioner"], frozen, **tolerance(dtype))
        if previous is not None:
            torch.testing.assert_close(opt.state[p]["previous_param"], previous[0][0])
            torch.testing.assert_close(opt.state[p]["previous_grad"], previous[1][0])
    if case == "factored-freezes-at-2":  # frozen at step 2 in its pooled shape
        assert float(opt.state[params[0][1]]["preconditioner_step"]) == 2
        assert opt.state[params[0][1]]["preconditioner"].shape == (1, 4, 5)


RMSPROP_CASES = {
    "plain": {},
    "decay-maximize": {"weight_decay": 0.1, "maximize": True, "alpha": 0.9},
    "momentum": {"momentum": 0.9},
    "centered": {"centered": True, "eps": 1e-3},
    "centered-momentum": {"centered": True, "momentum": 0.5, "eps": 1e-3},
}


@pytest.mark.parametrize("case", RMSPROP_CASES)
def test_psgld_at_temperature_zero_is_rmsprop(case):
    """Equal to ``torch.optim.RMSprop(foreach=False)`` up to rounding: the kernel computes
    in float64 and rounds the state and the step once where RMSprop rounds each operation
    in the parameter's dtype (a few units in the last place, over three steps)."""
    kwargs = RMSPROP_CASES[case]
    for dtype, tol in ((torch.float32, 1e-5), (torch.float64, 1e-12)):
        params = named(dtype)
        twins = twins_of(params)
        grads = gradients(params, 3)
        opt = PSGLD(params, lr=0.01, num_data=N, temperature=0.0, fused=True, **kwargs)
        run(opt, params, grads)
        run(
            torch.optim.RMSprop([p for _, p in twins], lr=0.01, foreach=False, **kwargs),
            twins,
            grads,
        )
        for (_, p), (_, q) in zip(params, twins, strict=True):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=tol, atol=tol)
            assert float(opt.state[p]["step"]) == 3


# ------------------------------------------------------------------ AdamWSGHMC
ADAMW_CASES = {
    "factored-freezes-at-2": {"preconditioner_warmup": 2},
    "maximize-betas": {"maximize": True, "betas": (0.5, 0.9), "weight_decay": 0.1},
    "elementwise-freezes-at-3": {"preconditioner": "elementwise", "preconditioner_warmup": 3},
    "never-frozen": {"preconditioner_warmup": None, "weight_decay": 0.0},
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("case", ADAMW_CASES)
def test_the_adamw_sghmc_kernel_is_the_reference_update_given_its_noise(case, dtype):
    kwargs = ADAMW_CASES[case]
    lr, temperature = 0.01, 1.0
    params = named(dtype)
    grads = gradients(params, 4)
    opt = AdamWSGHMC(
        params, lr=lr, num_data=N, temperature=temperature, seed=9, fused=True, **kwargs
    )
    beta1, beta2 = kwargs.get("betas", (0.9, 0.999))
    options = {
        "beta1": beta1,
        "beta2": beta2,
        "eps": 1e-8,
        "weight_decay": kwargs.get("weight_decay", 0.01),
        "maximize": kwargs.get("maximize", False),
        "preconditioner": kwargs.get("preconditioner", "factored"),
        "preconditioner_warmup": kwargs.get("preconditioner_warmup", 1000),
    }
    reference = {
        name: {
            "param": p.detach().clone(),
            "step": [torch.tensor(0.0)],
            "exp_avg": [torch.zeros_like(p)],
            "exp_avg_sq": [torch.zeros_like(p)],
            "preconditioner": [None],
            "preconditioner_root": [None],
            "preconditioner_step": [torch.tensor(0.0)],
        }
        for name, p in params
    }
    for step, step_grads in enumerate(grads):
        for (name, p), g in zip(params, step_grads, strict=True):
            p.grad = g.clone()
            state = reference[name]
            [d], new = adamw_sghmc_direction(
                [state["param"]],
                [g],
                state["step"],
                state["exp_avg"],
                state["exp_avg_sq"],
                [xi(name, p, 9, step).view_as(p)],
                lr=lr,
                temperature=temperature,
                num_data=N,
                preconditioners=state["preconditioner"],
                roots=state["preconditioner_root"],
                frozen_at=state["preconditioner_step"],
                **options,
            )
            for key in ("step", "preconditioner", "preconditioner_root", "preconditioner_step"):
                state[key] = new[key]
            state["param"].add_(d.mul(-lr))
        opt.step()
    for name, p in params:
        state = reference[name]
        torch.testing.assert_close(p.detach(), state["param"], **tolerance(dtype))
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opt.state[p][key], state[key][0], **tolerance(dtype))
        assert float(opt.state[p]["step"]) == 4
        assert float(opt.state[p]["preconditioner_step"]) == float(state["preconditioner_step"][0])
        for key in ("preconditioner", "preconditioner_root"):
            frozen = state[key][0]
            assert (frozen is None) == (key not in opt.state[p])
            if frozen is not None:
                torch.testing.assert_close(opt.state[p][key], frozen, **tolerance(dtype))


ADAMW_ZERO_CASES = {
    "plain": {},
    "amsgrad-maximize": {"amsgrad": True, "maximize": True, "weight_decay": 0.1},
}


@pytest.mark.parametrize("case", ADAMW_ZERO_CASES)
def test_adamw_sghmc_at_temperature_zero_is_torchs_fused_adamw_bit_for_bit(case):
    """At temperature 0, ``fused=True`` is ``torch.optim.AdamW(fused=True)``: the same
    functional call (torch's fused CPU kernel here, its CUDA kernel on a GPU)."""
    kwargs = ADAMW_ZERO_CASES[case]
    for dtype in (torch.float32, torch.float64):
        params = named(dtype)
        twins = twins_of(params)
        grads = gradients(params, 3)
        opt = AdamWSGHMC(params, lr=0.01, num_data=N, temperature=0.0, fused=True, **kwargs)
        run(opt, params, grads)
        torch_adamw = torch.optim.AdamW([p for _, p in twins], lr=0.01, fused=True, **kwargs)
        run(torch_adamw, twins, grads)
        for (_, p), (_, q) in zip(params, twins, strict=True):
            assert torch.equal(p, q)
            assert torch.equal(opt.state[p]["exp_avg"], torch_adamw.state[q]["exp_avg"])
            assert float(opt.state[p]["step"]) == 3
            assert opt.state[p]["step"].device.type == "cpu"  # a host count, as unfused


# ------------------------------------------------------------------ shards and resume
@pytest.mark.parametrize("cls", [PSGLD, AdamWSGHMC], ids=lambda c: c.__name__)
def test_a_sharded_parameter_steps_as_its_slice_of_the_whole(cls):
    """With the elementwise preconditioner a part of a tensor (``set_parameter_layout``)
    takes exactly the whole tensor's step on its elements: the same noise, bit for bit.
    (A pooled preconditioner pools over the part it holds, fused or not.)"""
    torch.manual_seed(0)
    start, grads = torch.randn(300, device=DEVICE), torch.randn(4, 300, device=DEVICE)
    whole = torch.nn.Parameter(start.clone())
    spans = ((0, 100), (100, 300))
    parts = [torch.nn.Parameter(start[a:b].clone()) for a, b in spans]
    for part, (a, _) in zip(parts, spans, strict=True):
        set_parameter_layout(part, a, 300)
    kwargs = {"lr": 0.01, "num_data": N, "seed": 5, "fused": True}
    kwargs |= {"preconditioner": "elementwise", "preconditioner_warmup": 2}
    one = cls([("w", whole)], **kwargs)
    split = [cls([("w", part)], **kwargs) for part in parts]
    for g in grads:
        whole.grad = g.clone()
        one.step()
        for part, opt, (a, b) in zip(parts, split, spans, strict=True):
            part.grad = g[a:b].clone()
            opt.step()
    assert torch.equal(torch.cat([part.detach() for part in parts]), whole.detach())


@pytest.mark.parametrize("cls", [PSGLD, AdamWSGHMC], ids=lambda c: c.__name__)
def test_resume_is_exact_across_the_freeze(cls):
    """A state_dict round trip and a deep copy before the freeze (step 3): the same
    chain, bit for bit, the frozen preconditioner included."""
    params = named(torch.float32)
    grads = gradients(params, 5)
    kwargs = {"lr": 0.01, "num_data": N, "preconditioner_warmup": 3, "fused": True}
    opt = cls(params, seed=4, **kwargs)
    run(opt, params, grads[:2])
    saved = copy.deepcopy(opt.state_dict())
    copied = copy.deepcopy(opt)
    twins = twins_of(params)
    resumed = cls(twins, seed=0, **kwargs)
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
        assert torch.equal(opt.state[p]["preconditioner"], resumed.state[q]["preconditioner"])
        assert float(resumed.state[q]["preconditioner_step"]) == 3


# ------------------------------------------------------------------ when it is fused
def test_fused_none_takes_the_fused_path_where_it_can_run(monkeypatch):
    assert fused.DEFAULT_ON_CUDA  # (validated on an H100: bash .ci/gpu fused)
    calls = []
    original = fused_step_module.fused_kernel
    monkeypatch.setattr(
        fused_step_module, "fused_kernel", lambda d: calls.append(d.name) or original(d)
    )
    for cls in (PSGLD, AdamWSGHMC):
        params = named(shapes={"w": (3, 4)})
        run(cls(params, lr=0.01, num_data=N), params, gradients(params, 1))
        run(cls(params, lr=0.01, num_data=N, fused=False), params, gradients(params, 1))
        # at T = 0: RMSprop's and AdamW's own default steps, bit for bit
        run(cls(params, lr=0.01, num_data=N, temperature=0.0), params, gradients(params, 1))
    assert calls == ["PSGLD", "AdamWSGHMC"]


def fused_error(reason):
    return (
        f"Invalid fused: True ({reason}; use fused=None to take the fused path only where it "
        "can run, or fused=False)"
    )


@pytest.mark.parametrize("cls", [PSGLD, AdamWSGHMC], ids=lambda c: c.__name__)
def test_fused_true_refusals_name_the_reason(cls, monkeypatch):
    half = torch.nn.Parameter(torch.zeros(2, dtype=torch.float16, device=DEVICE))
    assert cls([half], lr=0.01, num_data=N, temperature=0.0, eps=1e-3, fused=True)._fused is True
    complex_ = torch.nn.Parameter(torch.zeros(2, dtype=torch.complex64, device=DEVICE))
    with pytest.raises(ValueError) as error:
        cls([complex_], lr=0.01, num_data=N, temperature=0.0, eps=1e-3, fused=True)
    assert str(error.value) == fused_error(
        "param group 0, parameter 0 of shape (2,) is torch.complex64: the fused kernels take "
        "float32, float64, float16 and bfloat16 parameters"
    )
    with pytest.raises(ValueError) as error:
        cls([torch.nn.Parameter(torch.zeros(2))], lr=0.01, num_data=N, foreach=True, fused=True)
    assert str(error.value) == fused_error(
        "param group 0 sets foreach=True (fused and foreach exclude each other)"
    )
    if not CUDA:
        monkeypatch.setattr(fused, "RUN_ON_CPU_UNDER_INTERPRETER", False)
        with pytest.raises(ValueError) as error:
            cls([torch.nn.Parameter(torch.zeros(3))], lr=0.01, num_data=N, fused=True)
        assert str(error.value) == fused_error(
            "param group 0, parameter 0 of shape (3,) is on cpu: the fused kernels run on CUDA"
        )
    with pytest.raises(ValueError, match=r"^Invalid fused: 1 \(expected None, True or False\)$"):
        cls([torch.nn.Parameter(torch.zeros(3))], lr=0.01, num_data=N, fused=1)


def test_the_host_counts_do_not_stop_the_fused_path_after_the_first_step():
    """The step counts are 0-d CPU tensors (as torch's RMSprop and AdamW keep them): the
    fused path's checks of the state pass them by, whatever the parameters' dtype."""
    params = named(torch.float64, {"w": (4, 3)})
    opt = AdamWSGHMC(params, lr=0.01, num_data=N, fused=True)
    run(opt, params, gradients(params, 3))
    assert opt.state[params[0][1]]["step"].dtype == torch.float32
    assert float(opt.state[params[0][1]]["step"]) == 3


def test_the_layout_of_the_pooled_preconditioner_is_the_one_pooling_gives():
    """Element i reads the compact entry that broadcasting gives it, for every pooling,
    with leading member dimensions (a ``ParallelEnsemble``'s stack) pooled each alone."""
    cases = [((7,), 0), ((3, 4), 0), ((2, 3, 5), 0), ((4, 1, 6, 2), 0), ((), 0)]
    cases += [((3, 4), 1), ((2, 3, 5), 1), ((2, 3, 4, 5), 2), ((3,), 1)]
    for shape, members in cases:
        square = torch.rand(shape, dtype=torch.float64)
        set_member_dims(square, members)
        for how in ("factored", "elementwise"):
            pooled = pooled_second_moment(square, how, members).contiguous()
            rule = compact_layout(square, pooled)
            if pooled.numel() != square.numel():
                assert rule == layout(square, how)
            i = torch.arange(square.numel())
            inner, row_stride, rows, column_stride, columns = rule
            entry = (i // inner) * rows * columns + (i // row_stride) % rows * columns
            entry = entry + (i // column_stride) % columns
            assert torch.equal(pooled.flatten()[entry], pooled.expand(shape).flatten())
    with pytest.raises(ValueError) as error:
        compact_layout(torch.zeros(3, 4), torch.zeros(5))
    assert str(error.value) == (
        "Invalid preconditioner: a tensor of shape (5,) (expected the pooled shape of a "
        "parameter of shape (3, 4), or that shape)"
    )


# ------------------------------------------------------------------ non-finite gradients
def snapshot(opt, params):
    return copy.deepcopy(opt.state_dict()), [p.detach().clone() for _, p in params]


def assert_same(before, after):
    (state_a, params_a), (state_b, params_b) = before, after
    assert all(torch.equal(a, b) for a, b in zip(params_a, params_b, strict=True))
    assert state_a["param_groups"] == state_b["param_groups"]
    assert state_a["state"].keys() == state_b["state"].keys()
    for key, entries in state_a["state"].items():
        assert entries.keys() == state_b["state"][key].keys()
        for name, value in entries.items():
            assert torch.equal(value, state_b["state"][key][name]), name


@pytest.mark.parametrize("temperature", [1.0, 0.0])
@pytest.mark.parametrize("cls", [PSGLD, AdamWSGHMC], ids=lambda c: c.__name__)
def test_raise_refuses_the_step_at_the_next_call_and_nothing_changed(cls, temperature):
    """The refused step is the one that freezes the preconditioner (warm-up 2): the
    next ``step()`` raises and the optimizer is as before it, its host step counts and
    freeze marks included; the chain then goes on as if that batch had never come."""
    params = named(torch.float32)
    grads = gradients(params, 4)
    twins = twins_of(params)
    kwargs = {"lr": 0.01, "num_data": N, "temperature": temperature, "seed": 2, "fused": True}
    kwargs["preconditioner_warmup"] = 2
    opt = cls(params, **kwargs)
    run(opt, params, grads[:1])
    before = snapshot(opt, params)
    bad = [g.clone() for g in grads[1]]
    bad[2][0] = math.nan
    run(opt, params, [bad])  # no error yet: no host synchronisation
    assert all(torch.equal(a, p) for a, (_, p) in zip(before[1], params, strict=True))
    with pytest.raises(FloatingPointError) as error:
        run(opt, params, grads[2:3])
    assert str(error.value) == (
        f"{cls.__name__} refused step 2: non-finite gradient in param group 0, parameter 2 "
        "'b' of shape (5,); no parameter or buffer was changed (the fused step checks the "
        "gradients on the device, without a host synchronisation: this call, the next "
        "after that step, raises it and changes nothing either)"
    )
    assert_same(before, snapshot(opt, params))
    run(opt, params, grads[2:])
    reference = cls(twins, **kwargs)
    run(reference, twins, grads[:1] + grads[2:])
    assert all(torch.equal(p, q) for (_, p), (_, q) in zip(params, twins, strict=True))


SKIPPED = {"first": (0, 1.0), "freeze": (1, 1.0), "frozen": (3, 1.0), "temperature-0": (1, 0.0)}


@pytest.mark.parametrize("verdict", ["skip", "scaler"])
@pytest.mark.parametrize("case", SKIPPED)
@pytest.mark.parametrize("cls", [PSGLD, AdamWSGHMC], ids=lambda c: c.__name__)
def test_a_skipped_step_is_the_run_without_it(cls, case, verdict):
    """A step skipped by ``nonfinite="skip"`` (a NaN) or by a GradScaler's ``found_inf``
    (an infinity) writes no parameter or buffer and puts back what it advanced on the
    host, as the unfused step does: the step counts, the freeze mark and what it froze.
    The chain is then, bit for bit, the run without that step, whose noise index moves
    on as the skip's does (warm-up 2: the second step freezes). At temperature 0 the
    step is torch's fused RMSprop or AdamW, told of the skip by ``found_inf``."""
    at, temperature = SKIPPED[case]
    kwargs = {"lr": 0.01, "num_data": N, "seed": 2, "fused": True, "temperature": temperature}
    kwargs["preconditioner_warmup"] = 2
    params = named(torch.float32)
    twins = twins_of(params)
    grads = gradients(params, 4)
    bad = [g.clone() for g in grads[at]]
    bad[0][1, 2, 3] = math.nan if verdict == "skip" else math.inf
    scale = 2.0**6
    if verdict == "skip":
        opt = cls(params, nonfinite="skip", **kwargs)
        run(opt, params, [*grads[:at], bad, *grads[at:]])
    else:
        opt = cls(params, **kwargs)
        scaler = torch.amp.GradScaler(DEVICE.type, init_scale=scale)
        scaler.scale(torch.ones((), device=DEVICE))  # (creates its scale)
        for step in [*grads[:at], bad, *grads[at:]]:
            for (_, p), g in zip(params, step, strict=True):
                p.grad = g * scaler.get_scale()
            scaler.step(opt)
            scaler.update()
        assert scaler.get_scale() == scale / 2
    assert int(opt.param_groups[0]["skipped_steps"]) == 1
    reference = cls(twins, **kwargs)
    run(reference, twins, grads[:at])
    reference.param_groups[0]["step"] += 1  # the noise index the skipped step consumed
    run(reference, twins, grads[at:])
    assert opt.param_groups[0]["step"] == reference.param_groups[0]["step"]
    for (_, p), (_, q) in zip(params, twins, strict=True):
        assert torch.equal(p, q)
        assert opt.state[p].keys() == reference.state[q].keys()
        for name, value in reference.state[q].items():
            assert torch.equal(opt.state[p][name], value), name
    if temperature > 0:
        assert float(opt.state[params[0][1]]["preconditioner_step"]) == 2
