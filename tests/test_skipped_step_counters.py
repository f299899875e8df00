"""A skipped step takes back the host counts it advanced (issue #34, item 13).

PSGLD and AdamWSGHMC keep RMSprop's and AdamW's per-parameter step count on the host
(``StateField.host``), which the bias correction and the preconditioner's warm-up read. A
step skipped on the device (``nonfinite="skip"``, or a ``GradScaler``'s ``found_inf``)
changes no parameter and no buffer, and puts these counts back, as torch's fused Adam
takes its count back (``state_steps -= found_inf``): a run with a skipped step is, bit
for bit, the run without it, whose chain counter (the noise index, which a skipped step
consumes, as documented) is advanced by one where the skipped step was. At temperature 0
the step is torch's own optimizer's, and under a ``GradScaler`` an overflow leaves it as
the scaler leaves ``torch.optim.AdamW``/``RMSprop``, which it does not step. Unfused here;
the fused step is checked in ``tests/test_fused_adaptive.py`` and
``tests/test_fused_amp.py``.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from samplers_as_optim import PSGLD, AdamWSGHMC

SHAPES = [(4, 3), (5,)]
SCALE = 2.0**8
#: the preconditioner freezes at the third step (index 2)
CASES = {
    PSGLD: {"lr": 1e-3, "num_data": 100, "seed": 1, "preconditioner_warmup": 3},
    AdamWSGHMC: {"lr": 1e-3, "num_data": 100, "seed": 1, "preconditioner_warmup": 3},
}
BOTH = pytest.mark.parametrize("cls", list(CASES), ids=lambda c: c.__name__)


def gradients(steps: int, seed: int = 0) -> list[list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=generator) for s in SHAPES] for _ in range(steps)]


def poisoned(grads: list[torch.Tensor], value: float) -> list[torch.Tensor]:
    bad = [g.clone() for g in grads]
    bad[0][1, 2] = value
    return bad


def parameters(dtype: torch.dtype = torch.float32) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(5)
    return [torch.nn.Parameter(torch.randn(s, generator=generator).to(dtype)) for s in SHAPES]


def with_skip(cls, grads, at, *, verdict, **kwargs):
    """The chain with a step at ``at`` skipped: by ``nonfinite="skip"`` (a NaN) or by a
    GradScaler's ``found_inf`` (an infinity, with ``nonfinite="raise"``)."""
    params = parameters(kwargs.pop("dtype", torch.float32))
    scaler = None
    if verdict == "scaler":
        opt = cls(params, **kwargs)
        scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
        scaler.scale(torch.ones(()))  # (creates its scale; the gradients are set here)
    else:
        opt = cls(params, nonfinite="skip", **kwargs)
    bad = poisoned(grads[at], math.nan if scaler is None else math.inf)
    for step in [*grads[:at], bad, *grads[at:]]:
        for p, g in zip(params, step, strict=True):
            p.grad = g.to(p.dtype) if scaler is None else (g * scaler.get_scale()).to(p.dtype)
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
    assert int(opt.param_groups[0]["skipped_steps"]) == 1
    return params, opt


def without_skip(cls, grads, at, **kwargs):
    """The chain that never saw the skipped step; its noise index moves on as a skip's does."""
    params = parameters(kwargs.pop("dtype", torch.float32))
    opt = cls(params, **kwargs)
    for k, step in enumerate(grads):
        if k == at:
            opt.param_groups[0]["step"] += 1  # the noise index the skipped step consumed
        for p, g in zip(params, step, strict=True):
            p.grad = g.to(p.dtype)
        opt.step()
    return params, opt


def assert_same_chain(a, b):
    (params_a, opt_a), (params_b, opt_b) = a, b
    assert opt_a.param_groups[0]["step"] == opt_b.param_groups[0]["step"]
    for p, q in zip(params_a, params_b, strict=True):
        assert torch.equal(p, q)
        state_a, state_b = opt_a.state[p], opt_b.state[q]
        assert state_a.keys() == state_b.keys()
        for name, value in state_a.items():
            other = state_b[name]
            assert value.dtype == other.dtype and torch.equal(value, other), name


@pytest.mark.parametrize("verdict", ["skip", "scaler"])
@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("at", [0, 1, 2, 4], ids=["first", "warm-up", "freeze", "frozen"])
@BOTH
def test_a_skipped_step_is_the_run_without_it(cls, at, foreach, verdict):
    """Parameters, buffers, the step counts, the freeze mark and the frozen
    preconditioner: the step counts no longer run one ahead after a skip (AdamW's bias
    correction and the warm-up read them), and a skip at the freezing step freezes at the
    next one, from its own gradients."""
    grads = gradients(6)
    kwargs = {**CASES[cls], "foreach": foreach}
    assert_same_chain(
        with_skip(cls, grads, at, verdict=verdict, **kwargs), without_skip(cls, grads, at, **kwargs)
    )


@pytest.mark.parametrize("at", [0, 2], ids=["first", "freeze"])
@BOTH
def test_a_skipped_step_of_a_bfloat16_parameter_is_the_run_without_it(cls, at):
    """A skipped first step at T > 0 created the float32 master, which is taken back
    with the counts; the next step creates it from the parameter, as without the skip."""
    grads = gradients(4)
    kwargs = {**CASES[cls], "dtype": torch.bfloat16}
    assert_same_chain(
        with_skip(cls, grads, at, verdict="skip", **dict(kwargs)),
        without_skip(cls, grads, at, **dict(kwargs)),
    )


def test_a_skipped_step_at_a_new_lr_keeps_the_momentum_and_its_rate():
    """AdamWSGHMC's momentum is kept in lr's units: a skipped step at a new lr neither
    re-expresses it nor records the new rate (both or neither: the record is put back),
    so a later lr re-expresses it once, from its old rate, as without the skip."""
    grads = gradients(4)
    kwargs = {**CASES[AdamWSGHMC], "nonfinite": "skip"}
    rates = [1e-3, 4e-3, 2e-3, 2e-3]

    def chain(schedule, bump):
        params = parameters()
        opt = AdamWSGHMC(params, **kwargs)
        for k, (lr, step) in enumerate(schedule):
            opt.param_groups[0]["lr"] = lr
            if bump and k == 1:
                opt.param_groups[0]["step"] += 1
            for p, g in zip(params, step, strict=True):
                p.grad = g.clone()
            opt.step()
        return params, opt

    bad = poisoned(grads[1], math.nan)
    skipped = chain(list(zip(rates, [grads[0], bad, *grads[2:]], strict=True)), False)
    kept = chain([(rates[0], grads[0]), *zip(rates[2:], grads[2:], strict=True)], True)
    assert_same_chain(skipped, kept)


@pytest.mark.parametrize("when", ["next-step", "state_dict", "deepcopy"])
@BOTH
def test_a_verdict_left_on_the_device_is_put_back_by_the_next_call(cls, when, monkeypatch):
    """Off the CPU the verdict is read by the next ``step()``, ``state_dict()`` or copy
    (copied to the host without waiting): until then the counts run one ahead, then they
    are put back and the chain is the run without the skipped step. (On the CPU, where
    reading it costs no synchronisation, it is read at once: here the device path is
    forced.)"""
    from samplers_as_optim.sgmcmc.step import skipped_host as _skipped_host

    monkeypatch.setattr(_skipped_host, "known_on_host", lambda device: False)
    grads = gradients(5)
    params = parameters()
    opt = cls(params, nonfinite="skip", **CASES[cls])
    for k, step in enumerate([*grads[:2], poisoned(grads[2], math.nan)]):
        for p, g in zip(params, step, strict=True):
            p.grad = g.clone()
        opt.step()
        if k < 2:
            assert float(opt.state[params[0]]["step"]) == k + 1
    assert float(opt.state[params[0]]["step"]) == 3  # the skip, not read back yet
    assert float(opt.state[params[0]]["preconditioner_step"]) == 3
    if when == "state_dict":
        saved = opt.state_dict()["state"][0]
        assert float(saved["step"]) == 2 and float(saved["preconditioner_step"]) == 0
        assert "preconditioner" not in saved
    if when == "deepcopy":
        copy.deepcopy(opt)
        assert float(opt.state[params[0]]["step"]) == 2
    for step in grads[2:]:
        for p, g in zip(params, step, strict=True):
            p.grad = g.clone()
        opt.step()
    assert_same_chain((params, opt), without_skip(cls, grads, 2, **CASES[cls]))


def test_temperature_zero_under_a_scaler_is_adamw_under_it_overflow_included():
    """torch's non-fused AdamW has no ``_step_supports_amp_scaling``: the scaler unscales
    its gradients, reads ``found_inf`` and does not step it on an overflow. AdamWSGHMC
    at T = 0 is handed the scale and the verdict instead, and takes torch's own AdamW
    step unless it is skipped, on the device, its step count included."""
    _compare_with_torch_under_a_scaler(AdamWSGHMC, torch.optim.AdamW, {"weight_decay": 0.1})


def test_temperature_zero_under_a_scaler_is_rmsprop_under_it_overflow_included():
    _compare_with_torch_under_a_scaler(PSGLD, torch.optim.RMSprop, {"alpha": 0.9})


def _compare_with_torch_under_a_scaler(cls, reference, kwargs):
    ours, theirs = parameters(), parameters()
    opt = cls(ours, lr=1e-2, num_data=100, temperature=0.0, **kwargs)
    torch_opt = reference(theirs, lr=1e-2, **kwargs)
    scalers = [torch.amp.GradScaler("cpu", init_scale=SCALE) for _ in range(2)]
    for scaler in scalers:
        scaler.scale(torch.ones(()))
    for k, step in enumerate(gradients(6)):
        for params, optimizer, scaler in ((ours, opt, scalers[0]), (theirs, torch_opt, scalers[1])):
            for p, g in zip(params, step, strict=True):
                p.grad = g * scaler.get_scale()
            if k in (0, 3):  # an overflow, at the first step and later
                params[1].grad[2] = math.inf
            scaler.step(optimizer)
            scaler.update()
    assert scalers[0].get_scale() == scalers[1].get_scale() == SCALE / 4
    for p, q in zip(ours, theirs, strict=True):
        assert torch.equal(p, q)
        for name, value in torch_opt.state[q].items():
            assert torch.equal(opt.state[p][name], value), name


@BOTH
def test_temperature_zero_skip_is_torchs_optimizer_without_the_step(cls):
    reference = torch.optim.AdamW if cls is AdamWSGHMC else torch.optim.RMSprop
    ours, theirs = parameters(), parameters()
    opt = cls(ours, lr=1e-2, num_data=100, temperature=0.0, nonfinite="skip")
    torch_opt = reference(theirs, lr=1e-2)
    grads = gradients(4)
    for k, step in enumerate(grads):
        if k == 2:
            for p, g in zip(ours, poisoned(step, math.nan), strict=True):
                p.grad = g
            opt.step()
        for params, optimizer in ((ours, opt), (theirs, torch_opt)):
            for p, g in zip(params, step, strict=True):
                p.grad = g.clone()
            optimizer.step()
    for p, q in zip(ours, theirs, strict=True):
        assert torch.equal(p, q)
        for name, value in torch_opt.state[q].items():
            assert torch.equal(opt.state[p][name], value), name
