"""The fused step under ``torch.amp.GradScaler`` and with float16/bfloat16 parameters.

The Optimizer's side of the contract with the kernels (``FusedInput.grad_scales`` and
``FusedInput.masters``, ``sgmcmc/step/grad_scaler`` and ``sgmcmc/step/half_precision``), end to
end through ``step()``. Without CUDA the kernels run on CPU tensors in Triton's
interpreter, as in ``tests/test_fused.py`` (whose header explains the switch); tensors are
small, the interpreter runs each program in Python.
"""

from __future__ import annotations

import re

import pytest
import torch
from triton_interpreter import use_interpreter

CUDA = use_interpreter()
pytest.importorskip("triton")

from samplers_as_optim import BAOA, PSGLD, SGHMC, SGLD, SGNHT, AdamWSGHMC  # noqa: E402
from samplers_as_optim.sgmcmc import fused  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")
N = 100
SCALE = 2.0**10

CASES = [
    (SGLD, {"lr": 1e-3}),
    (SGHMC, {"lr": 1e-3, "momentum": 0.9}),
    (SGNHT, {"lr": 1e-3, "momentum": 0.9}),
    (PSGLD, {"lr": 1e-3, "preconditioner_warmup": 2, "eps": 1e-3}),
    (BAOA, {"lr": 1e-3, "momentum": 0.9}),
    (AdamWSGHMC, {"lr": 1e-3, "preconditioner_warmup": 2}),
]
IDS = [cls.__name__ for cls, _ in CASES]
SHAPES = [(7, 3), (40,)]


@pytest.fixture(autouse=True)
def _fused_on_this_device(monkeypatch):
    """On the CPU, let the fused path run under Triton's interpreter (for tests only)."""
    monkeypatch.setattr(fused, "RUN_ON_CPU_UNDER_INTERPRETER", not CUDA)


def representable(shape: tuple[int, ...], seed: int, dtype: torch.dtype) -> torch.Tensor:
    """Random float32 values that ``dtype`` holds exactly, on the device."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator).to(dtype).float().to(DEVICE)


def parameters(dtype: torch.dtype) -> list[torch.nn.Parameter]:
    return [
        torch.nn.Parameter(representable(shape, i, torch.bfloat16).to(dtype))
        for i, shape in enumerate(SHAPES)
    ]


@pytest.mark.parametrize(("cls", "kwargs"), CASES, ids=IDS)
def test_a_fused_scaled_chain_is_the_unscaled_chain_bit_for_bit(cls, kwargs):
    plain, scaled = parameters(torch.float32), parameters(torch.float32)
    opt_plain = cls(plain, num_data=N, seed=3, fused=True, **kwargs)
    opt_scaled = cls(scaled, num_data=N, seed=3, fused=True, **kwargs)
    scaler = torch.amp.GradScaler(DEVICE.type, init_scale=SCALE)
    scaler.scale(torch.ones((), device=DEVICE))  # (creates its scale; the grads are set here)
    for step in range(4):
        for i, (p, q) in enumerate(zip(plain, scaled, strict=True)):
            g = representable(p.shape, 10 * step + i, torch.bfloat16)
            p.grad, q.grad = g.clone(), g * SCALE
        opt_plain.step()
        scaler.step(opt_scaled)
        scaler.update()
        assert all(torch.equal(q.grad, p.grad * SCALE) for p, q in zip(plain, scaled, strict=True))
    for p, q in zip(plain, scaled, strict=True):
        assert torch.equal(p, q)
        for name, value in opt_plain.state[p].items():
            assert torch.equal(opt_scaled.state[q][name], value), name


@pytest.mark.parametrize("nonfinite", ["raise", "skip"])
@pytest.mark.parametrize(("cls", "kwargs"), CASES, ids=IDS)
def test_a_fused_overflow_halves_the_scale_and_changes_nothing(cls, kwargs, nonfinite):
    params = parameters(torch.float32)
    opt = cls(params, num_data=N, seed=5, fused=True, nonfinite=nonfinite, **kwargs)
    scaler = torch.amp.GradScaler(DEVICE.type, init_scale=SCALE)
    scaler.scale(torch.ones((), device=DEVICE))  # (creates its scale; the grads are set here)

    def iteration(step: int, poison: bool = False) -> None:
        for i, p in enumerate(params):
            p.grad = representable(p.shape, 10 * step + i, torch.bfloat16) * SCALE
        if poison:
            params[0].grad[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()

    for step in range(2):
        iteration(step)
    before = [p.detach().clone() for p in params]
    state = [{k: v.clone() for k, v in opt.state[p].items()} for p in params]
    iteration(2, poison=True)
    assert scaler.get_scale() == SCALE / 2
    for p, old, saved in zip(params, before, state, strict=True):
        assert torch.equal(p.detach(), old)
        assert opt.state[p].keys() == saved.keys()
        for key, value in saved.items():  # the host counts (PSGLD, AdamWSGHMC) included
            assert torch.equal(opt.state[p][key], value), key
    assert int(opt.param_groups[0]["skipped_steps"]) == 1
    iteration(3)  # no deferred refusal raised, the chain goes on
    assert not all(torch.equal(p.detach(), old) for p, old in zip(params, before, strict=True))


def test_fused_adamw_sghmc_at_temperature_zero_is_fused_adamw_under_the_scaler():
    """At temperature 0 the fused step is ``torch.optim.AdamW(fused=True)``'s, which a
    GradScaler hands its scale and verdict as it hands them to the sampler: an overflow
    leaves both alike, step counts included (torch's fused Adam takes its count back,
    the sampler puts back its host count)."""
    ours, theirs = parameters(torch.float32), parameters(torch.float32)
    opt = AdamWSGHMC(ours, lr=1e-2, num_data=N, temperature=0.0, fused=True)
    adamw = torch.optim.AdamW(theirs, lr=1e-2, fused=True)
    scalers = [torch.amp.GradScaler(DEVICE.type, init_scale=SCALE) for _ in range(2)]
    for scaler in scalers:
        scaler.scale(torch.ones((), device=DEVICE))  # (creates its scale)
    for step in range(5):
        for params, optimizer, scaler in ((ours, opt, scalers[0]), (theirs, adamw, scalers[1])):
            for i, p in enumerate(params):
                p.grad = representable(p.shape, 10 * step + i, torch.bfloat16) * scaler.get_scale()
            if step in (0, 2):
                params[1].grad[3] = float("inf")
            scaler.step(optimizer)
            scaler.update()
    assert scalers[0].get_scale() == scalers[1].get_scale() == SCALE / 4
    for p, q in zip(ours, theirs, strict=True):
        assert torch.equal(p, q)
        assert float(opt.state[p]["step"]) == 3
        for name, value in adamw.state[q].items():
            assert torch.equal(opt.state[p][name].to(value.device), value), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(("cls", "kwargs"), CASES, ids=IDS)
def test_a_fused_half_parameter_is_the_fused_float32_chain_rounded(cls, kwargs, dtype):
    half, full = parameters(dtype), parameters(torch.float32)
    opt_half = cls(half, num_data=N, seed=7, fused=True, **kwargs)
    opt_full = cls(full, num_data=N, seed=7, fused=True, **kwargs)
    for step in range(4):
        for i, (h, f) in enumerate(zip(half, full, strict=True)):
            g = representable(h.shape, 100 * step + i, torch.bfloat16)
            h.grad, f.grad = g.to(dtype), g.clone()
        opt_half.step()
        opt_full.step()
    for h, f in zip(half, full, strict=True):
        state = opt_half.state[h]
        assert torch.equal(state["master_param"], f.detach())
        assert torch.equal(h.detach(), f.detach().to(dtype))
        for name, value in opt_full.state[f].items():
            if isinstance(value, torch.Tensor) and value.device == f.device and value.dim():
                assert state[name].dtype == torch.float32, name
                assert torch.equal(state[name], value), name


def test_fused_true_refuses_a_master_that_is_not_float32():
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16, device=DEVICE))
    opt = SGHMC([p], lr=1e-3, num_data=N, seed=0, fused=True)
    opt.state[p]["master_param"] = torch.ones(4, dtype=torch.float64, device=DEVICE)
    p.grad = torch.ones_like(p)
    message = (
        "Invalid fused: True (the state 'master_param' of param group 0, parameter 0 of "
        "shape (4,) is torch.float64, unlike a master copy (torch.float32); use fused=None "
        "to take the fused path only where it can run, or fused=False)"
    )
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        opt.step()
    assert torch.equal(p.detach(), torch.ones(4, dtype=torch.bfloat16, device=DEVICE))


def test_fused_true_refuses_a_buffer_in_half_precision_beside_a_master():
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16, device=DEVICE))
    opt = SGHMC([p], lr=1e-3, num_data=N, seed=0, fused=True)
    opt.state[p]["master_param"] = torch.ones(4, device=DEVICE)
    opt.state[p]["momentum_buffer"] = torch.zeros(4, dtype=torch.bfloat16, device=DEVICE)
    p.grad = torch.ones_like(p)
    message = (
        "Invalid fused: True (the state 'momentum_buffer' of param group 0, parameter 0 of "
        "shape (4,) is torch.bfloat16, unlike its parameter's 'master_param' "
        "(torch.float32); use fused=None to take the fused path only where it can run, or "
        "fused=False)"
    )
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        opt.step()
