"""``torch.amp.GradScaler`` with every sampler: the ``grad_scale``/``found_inf`` protocol.

``SamplerOptimizer._step_supports_amp_scaling`` makes ``GradScaler.step`` hand over its
scale and its verdict instead of unscaling and synchronising (``sgmcmc/step/grad_scaler``).
Checked on the CPU with an autocast-free float32 model and a power-of-two scale, so that
``g * s / s == g`` exactly: the chain with a scaler is the chain without one, bit for
bit; an injected infinity makes the scaler halve its scale and the step change nothing,
without an error even with ``nonfinite="raise"``; the scaler never unscales ``.grad``.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch

from samplers_as_optim import BAOA, PSGLD, SGHMC, SGLD, SGNHT, AdamWSGHMC

N = 200
SCALE = 2.0**10

CASES = [
    (SGLD, {"lr": 1e-3}),
    (SGHMC, {"lr": 1e-3, "momentum": 0.9}),
    (SGNHT, {"lr": 1e-3, "momentum": 0.9}),
    (PSGLD, {"lr": 1e-3, "preconditioner_warmup": 2}),
    (BAOA, {"lr": 1e-3, "momentum": 0.9}),
    (AdamWSGHMC, {"lr": 1e-3, "preconditioner_warmup": 2}),
]
IDS = [cls.__name__ for cls, _ in CASES]


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(16, 5, generator=generator)
    return x, torch.randint(0, 3, (16,), generator=generator)


def loss_of(model: torch.nn.Module, step: int) -> torch.Tensor:
    x, y = batch(step)
    return torch.nn.functional.cross_entropy(model(x), y)


def state_copy(opt: torch.optim.Optimizer) -> list[dict[str, torch.Tensor]]:
    return [
        {k: v.clone() for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)}
        for group in opt.param_groups
        for p in group["params"]
    ]


def assert_same_state(opt: torch.optim.Optimizer, saved: list[dict[str, torch.Tensor]]) -> None:
    now = state_copy(opt)
    assert [set(s) for s in now] == [set(s) for s in saved]
    for a, b in zip(now, saved, strict=True):
        for key in a:
            assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize(("cls", "kwargs"), CASES, ids=IDS)
def test_a_scaled_chain_is_the_unscaled_chain_bit_for_bit(cls, kwargs):
    plain_model, scaled_model = make_model(), make_model()
    plain = cls(plain_model.parameters(), num_data=N, seed=3, **kwargs)
    scaled = cls(scaled_model.parameters(), num_data=N, seed=3, **kwargs)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    seen = []
    original_step = scaled.step

    def recording_step(*args, **kw):
        seen.append((getattr(scaled, "grad_scale", None), getattr(scaled, "found_inf", None)))
        return original_step(*args, **kw)

    scaled.step = recording_step
    for step in range(6):
        plain.zero_grad()
        loss_of(plain_model, step).backward()
        plain.step()
        scaled.zero_grad()
        scaler.scale(loss_of(scaled_model, step)).backward()
        scaler.step(scaled)
        # GradScaler did not unscale: .grad still holds the scaled gradient
        for p, q in zip(plain_model.parameters(), scaled_model.parameters(), strict=True):
            assert torch.equal(q.grad, p.grad * SCALE)
        scaler.update()
    for p, q in zip(plain_model.parameters(), scaled_model.parameters(), strict=True):
        assert torch.equal(p, q)
    assert_same_state(scaled, state_copy(plain))
    # the scale and the verdict reached every step, and were removed after it
    assert len(seen) == 6
    assert all(float(s) == SCALE and float(f) == 0 for s, f in seen)
    assert not hasattr(scaled, "grad_scale") and not hasattr(scaled, "found_inf")
    assert scaler.get_scale() == SCALE


@pytest.mark.parametrize("nonfinite", ["raise", "skip"])
@pytest.mark.parametrize(("cls", "kwargs"), CASES, ids=IDS)
def test_an_overflow_halves_the_scale_and_changes_nothing(cls, kwargs, nonfinite):
    model = make_model()
    opt = cls(model.parameters(), num_data=N, seed=5, nonfinite=nonfinite, **kwargs)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)

    def iteration(step: int, poison: bool = False) -> None:
        opt.zero_grad()
        scaler.scale(loss_of(model, step)).backward()
        if poison:
            next(model.parameters()).grad[0, 0] = float("inf")
        scaler.step(opt)  # no FloatingPointError, whatever nonfinite says
        scaler.update()

    for step in range(3):
        iteration(step)
    params = [p.detach().clone() for p in model.parameters()]
    state = state_copy(opt)
    step_before = opt.param_groups[0]["step"]
    iteration(3, poison=True)
    assert scaler.get_scale() == SCALE / 2
    for p, q in zip(model.parameters(), params, strict=True):
        assert torch.equal(p, q)
    assert_same_state(opt, state)  # the host counts (PSGLD, AdamWSGHMC) put back too
    # the skipped step counts as nonfinite="skip" counts it: step advanced, one skipped
    assert opt.param_groups[0]["step"] == step_before + 1
    assert int(opt.param_groups[0]["skipped_steps"]) == 1
    for step in range(4, 6):
        iteration(step)
    assert scaler.get_scale() == SCALE / 2
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), params, strict=True))
    assert int(opt.param_groups[0]["skipped_steps"]) == 1


def test_unscale_then_step_is_the_same_chain():
    """After ``scaler.unscale_`` the scaler hands ``grad_scale=None`` and its verdict."""
    plain_model, scaled_model = make_model(), make_model()
    plain = SGHMC(plain_model.parameters(), lr=1e-3, num_data=N, seed=1)
    scaled = SGHMC(scaled_model.parameters(), lr=1e-3, num_data=N, seed=1)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    for step in range(4):
        plain.zero_grad()
        loss_of(plain_model, step).backward()
        plain.step()
        scaled.zero_grad()
        scaler.scale(loss_of(scaled_model, step)).backward()
        scaler.unscale_(scaled)
        torch.nn.utils.clip_grad_norm_(scaled_model.parameters(), 1e6)
        scaler.step(scaled)
        scaler.update()
    for p, q in zip(plain_model.parameters(), scaled_model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_a_bfloat16_model_under_the_scaler_samples_through_its_master():
    model = make_model().to(torch.bfloat16)
    opt = SGHMC(model.parameters(), lr=1e-3, num_data=N, seed=2)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    for step in range(3):
        opt.zero_grad()
        x, y = batch(step)
        loss = torch.nn.functional.cross_entropy(model(x.to(torch.bfloat16)).float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    for p in model.parameters():
        master = opt.state[p]["master_param"]
        assert master.dtype == torch.float32
        assert torch.equal(p.detach(), master.to(torch.bfloat16))


@pytest.mark.parametrize(
    ("name", "value", "shown"),
    [
        ("grad_scale", 2.0, "2.0"),
        ("grad_scale", torch.ones(2), "a torch.float32 tensor of shape (2,)"),
        ("found_inf", torch.zeros(1, dtype=torch.int64), "a torch.int64 tensor of shape (1,)"),
    ],
)
def test_a_malformed_scale_or_verdict_is_refused_before_anything_changes(name, value, shown):
    model = make_model()
    opt = SGHMC(model.parameters(), lr=1e-3, num_data=N, seed=1)
    loss_of(model, 0).backward()
    params = [p.detach().clone() for p in model.parameters()]
    setattr(opt, name, value)
    message = (
        f"Invalid {name}: {shown} (expected None or a 1-element floating tensor, as "
        "torch.amp.GradScaler.step sets it)"
    )
    with pytest.raises(TypeError, match="^" + re.escape(message) + "$"):
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params, strict=True))
    assert opt.param_groups[0]["step"] == 0 and not opt.state


def test_the_scaler_state_round_trips_with_the_chain():
    """A checkpoint taken between scaled steps resumes the same chain."""
    model = make_model()
    opt = SGHMC(model.parameters(), lr=1e-3, num_data=N, seed=4)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)

    def run(m, o, s, steps):
        for step in steps:
            o.zero_grad()
            s.scale(loss_of(m, step)).backward()
            s.step(o)
            s.update()

    run(model, opt, scaler, range(3))
    twin = copy.deepcopy(model)
    opt2 = SGHMC(twin.parameters(), lr=1e-3, num_data=N)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    scaler2 = torch.amp.GradScaler("cpu")
    scaler2.load_state_dict(scaler.state_dict())
    run(model, opt, scaler, range(3, 6))
    run(twin, opt2, scaler2, range(3, 6))
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)
