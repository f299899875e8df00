"""HMC.step(loss_fn=...): the functional transition, eager and compiled.

The functional path must be the same Markov chain as the closure path: the same random
numbers (momenta, uniforms, jitter), the same leapfrog and test, so the same accept
decisions and the same states up to rounding (the gradients come from ``torch.func.grad``
instead of ``backward()``, and a tensor step size rounds ``theta + eps * r`` where the
closure path's float step uses ``add_(alpha=eps)``). Invariance of the target is checked
on the functional path too, in ``test_hmc.py`` (``path="loss_fn"``).
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from torch import Tensor

from samplers_as_optim import HMC, ParallelEnsemble
from samplers_as_optim.names import name_parameters

N = 40


def _data(dtype=torch.float64) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(N, 3, generator=generator, dtype=dtype)
    y = (torch.rand(N, generator=generator) < 0.5).to(dtype)
    return x, y


def _losses(w: Tensor, b: Tensor, x: Tensor, y: Tensor) -> Tensor:
    """Mean logistic loss: a scalar for w [3], b []; one per member for w [K, 3], b [K]."""
    logits = w @ x.T + (b[:, None] if b.dim() else b)
    return torch.nn.functional.binary_cross_entropy_with_logits(
        logits, y.expand_as(logits), reduction="none"
    ).mean(-1)


def _params(k: int | None = None, dtype=torch.float64) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(1)
    shape = (3,) if k is None else (k, 3)
    w = torch.randn(shape, generator=generator, dtype=dtype) * 0.1
    b = torch.zeros(() if k is None else (k,), dtype=dtype)
    return [torch.nn.Parameter(w), torch.nn.Parameter(b)]


def _closure(opt: HMC, params: list[torch.nn.Parameter], x: Tensor, y: Tensor):
    def closure() -> Tensor:
        opt.zero_grad()
        losses = _losses(*params, x, y)
        losses.sum().backward()
        return losses

    return closure


def _loss_fn(x: Tensor, y: Tensor):
    def loss_fn(params) -> Tensor:
        return _losses(*params, x, y)

    return loss_fn


CONFIGS = {
    "one chain": ({}, None),
    "param groups": ({"groups": True}, None),
    "ensemble": ({}, 3),
    "mass tensors": ({"mass": "tensors"}, None),
    "warm-up": ({"jitter": 0.3, "target_accept": 0.7, "mass": "adapt"}, 3),
    "temperature": ({"temperature": 0.5, "jitter": 0.2}, None),
}


def _optimizer(params, options: dict, **extra) -> HMC:
    options = dict(options)
    groups = options.pop("groups", False)
    if options.get("mass") == "tensors":
        options["mass"] = [torch.full_like(p, 2.0) for p in params]
    spec = (
        [{"params": [params[0]], "lr": 0.02, "weight_decay": 0.1}, {"params": [params[1]]}]
        if groups
        else params
    )
    return HMC(spec, lr=0.05, num_steps=4, num_data=N, seed=5, **options, **extra)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_loss_fn_is_the_closure_chain(config: str) -> None:
    """Same decisions step by step, same states up to rounding, in float64."""
    options, k = CONFIGS[config]
    x, y = _data()
    runs = []
    for path in ("closure", "loss_fn"):
        params = _params(k)
        opt = _optimizer(params, options)
        closure, loss_fn = _closure(opt, params, x, y), _loss_fn(x, y)
        decisions, losses = [], []
        for t in range(12):
            if t == 8 and opt.warming_up:
                opt.end_warmup()
            loss = opt.step(closure) if path == "closure" else opt.step(loss_fn=loss_fn)
            decisions.append(opt.diagnostics["accepted"].clone())
            losses.append(loss.clone())
        runs.append((params, decisions, losses, opt.diagnostics))
    (p1, d1, l1, diag1), (p2, d2, l2, diag2) = runs
    assert any(bool(d.any()) for d in d1)  # the chain moves
    for a, b in zip(d1, d2, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(l1, l2, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    for a, b in zip(p1, p2, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-11, atol=1e-12)
    assert set(diag1) == set(diag2)
    for key in diag1:
        torch.testing.assert_close(diag1[key], diag2[key], rtol=1e-9, atol=1e-9)


def test_loss_fn_receives_names_or_a_tuple() -> None:
    model = torch.nn.Linear(3, 1).double()
    x, y = _data()
    seen = []

    def loss_fn(params):
        seen.append(params)
        out = torch.func.functional_call(model, params, (x,)).squeeze(-1)
        return torch.nn.functional.binary_cross_entropy_with_logits(out, y)

    HMC(model.named_parameters(), lr=0.01, num_steps=2, num_data=N, seed=0).step(loss_fn=loss_fn)
    assert isinstance(seen[-1], dict) and list(seen[-1]) == ["weight", "bias"]
    name_parameters(model)  # names written on the tensors reach loss_fn too
    HMC(model.parameters(), lr=0.01, num_steps=2, num_data=N, seed=0).step(loss_fn=loss_fn)
    assert isinstance(seen[-1], dict) and list(seen[-1]) == ["weight", "bias"]
    w, b = _params()
    tuples = []

    def plain(params):
        tuples.append(params)
        return _losses(*params, x, y)

    HMC([w, b], lr=0.01, num_steps=2, num_data=N, seed=0).step(loss_fn=plain)
    assert all(isinstance(t, tuple) and len(t) == 2 for t in tuples)


def test_loss_fn_with_a_parallel_ensemble() -> None:
    """functional_call on the ensemble: one chain per member, as with the closure."""
    x, y = _data(torch.float32)
    torch.manual_seed(0)
    models = [torch.nn.Linear(3, 1) for _ in range(4)]
    results = []
    for path in ("closure", "loss_fn"):
        ensemble = ParallelEnsemble.from_modules(models)
        opt = HMC(ensemble.named_parameters(), lr=0.5, num_steps=3, num_data=N, seed=2)

        def losses_of(out: Tensor) -> Tensor:
            return torch.nn.functional.binary_cross_entropy_with_logits(
                out.squeeze(-1), y.expand(out.shape[0], -1), reduction="none"
            ).mean(1)

        def closure(opt=opt, ensemble=ensemble) -> Tensor:
            opt.zero_grad()
            losses = losses_of(ensemble(x))
            losses.sum().backward()
            return losses

        def loss_fn(params, ensemble=ensemble) -> Tensor:
            return losses_of(torch.func.functional_call(ensemble, params, (x,)))

        for _ in range(6):
            opt.step(closure) if path == "closure" else opt.step(loss_fn=loss_fn)
        results.append(([p.detach().clone() for p in ensemble.parameters()], opt.diagnostics))
    (a, da), (b, db) = results
    assert da["accepted"].shape == (4,)
    assert torch.equal(da["num_accepted"], db["num_accepted"])
    for pa, pb in zip(a, b, strict=True):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)


def test_loss_fn_rejected_step_restores_everything_bit_for_bit() -> None:
    x, y = _data()
    params = _params()
    opt = HMC(params, lr=1e-3, num_steps=5, num_data=N, seed=1)
    loss_fn = _loss_fn(x, y)
    for _ in range(3):
        loss_before = opt.step(loss_fn=loss_fn).clone()  # the loss at the current state
    before = [p.detach().clone() for p in params]
    grads = [p.grad.clone() for p in params]
    for group in opt.param_groups:
        group["lr"] = 1e4  # the trajectory explodes: certainly rejected
    loss = opt.step(loss_fn=loss_fn)
    assert not bool(opt.diagnostics["accepted"]) and bool(opt.diagnostics["divergent"])
    for p, p0, g0 in zip(params, before, grads, strict=True):
        assert torch.equal(p, p0)
        assert torch.equal(p.grad, g0)
    assert torch.equal(loss, loss_before)


def test_loss_fn_exact_resume() -> None:
    """A functional chain saved mid warm-up continues bit for bit from its state_dict."""
    x, y = _data()
    options = {"jitter": 0.3, "target_accept": 0.75, "mass": "adapt"}
    params = _params(k=3)
    opt = _optimizer(params, options)
    loss_fn = _loss_fn(x, y)
    for _ in range(5):
        opt.step(loss_fn=loss_fn)
    saved, values = copy.deepcopy(opt.state_dict()), [p.detach().clone() for p in params]
    reference = [opt.step(loss_fn=loss_fn).clone() for _ in range(6)]
    other_params = [torch.nn.Parameter(v.clone()) for v in values]
    other = _optimizer(other_params, options)
    other.load_state_dict(saved)
    resumed = [other.step(loss_fn=loss_fn).clone() for _ in range(6)]
    for a, b in zip(reference, resumed, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(params, other_params, strict=True):
        assert torch.equal(a, b)


def test_loss_fn_errors() -> None:
    x, y = _data()
    params = _params()
    opt = HMC(params, lr=0.01, num_steps=2, num_data=N, seed=0)
    with pytest.raises(ValueError, match="needs a closure or a loss_fn, not neither"):
        opt.step()
    with pytest.raises(ValueError, match="not both"):
        opt.step(_closure(opt, params, x, y), loss_fn=_loss_fn(x, y))
    with pytest.raises(ValueError, match=r"Invalid loss returned by loss_fn: \(2, 40\)"):
        opt.step(loss_fn=lambda ps: ps[0][:2, None] * x[:, 0])
    with pytest.raises(ValueError, match="Invalid loss returned by loss_fn: float"):
        opt.step(loss_fn=lambda ps: 1.0)
    with pytest.raises(ValueError, match=r"shape \(3,\) \(one loss per member\) but a parameter"):
        opt.step(loss_fn=lambda ps: ps[0] * 2)
    calls = [0]

    def changing(ps: Any) -> Tensor:  # a scalar at the start, then one loss per "member"
        calls[0] += 1
        value = ps[0].sum()
        return value if calls[0] == 1 else value * torch.ones(5, dtype=value.dtype)

    with pytest.raises(ValueError, match=r"shape \(5,\) \(expected a scalar"):
        opt.step(loss_fn=changing)
    with pytest.raises(TypeError, match="Invalid compile: 'yes' \\(expected True or False\\)"):
        HMC(params, lr=0.01, num_steps=2, num_data=N, compile="yes")


@pytest.mark.slow
def test_compiled_transition() -> None:
    """compile=True: the eager functional chain up to fused roundings, compiled once.

    Over several transitions the two chains make the same decisions (rounding differences
    grow along a chain, so states are compared after one transition from the same state:
    within 1e-5 relative, about 170 float32 rounding units over 4 leapfrog steps).
    Jitter and dual averaging change the step size at every transition: it is a tensor
    input of the graph, so the transition compiles once (twice at most, where
    torch.compile recompiles after specialising the first call's inputs), not per step.
    """
    torch._dynamo.reset()
    x, y = _data(torch.float32)
    options = {"jitter": 0.3, "target_accept": 0.7}
    loss_fn = _loss_fn(x, y)
    runs = []
    for compiled in (False, True):
        params = _params(dtype=torch.float32)
        opt = _optimizer(params, options, compile=compiled)
        before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        decisions = []
        for t in range(10):
            if t == 6:
                opt.end_warmup()
            opt.step(loss_fn=loss_fn)
            decisions.append(bool(opt.diagnostics["accepted"]))
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"] - before
        runs.append((params, opt, decisions, graphs))
    (p1, eager, d1, _), (p2, compiled, d2, graphs) = runs
    assert 1 <= graphs <= 2
    assert d1 == d2 and any(d1)
    # one transition each from the compiled chain's state
    with torch.no_grad():
        for a, b in zip(p1, p2, strict=True):
            a.copy_(b)
    eager.load_state_dict(compiled.state_dict())
    eager.step(loss_fn=loss_fn)
    compiled.step(loss_fn=loss_fn)
    assert bool(eager.diagnostics["accepted"]) == bool(compiled.diagnostics["accepted"])
    for a, b in zip(p1, p2, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        eager.diagnostics["energy_error"], compiled.diagnostics["energy_error"], rtol=0, atol=1e-3
    )


@pytest.mark.slow
def test_compiled_ensemble_chains() -> None:
    """compile=True with a ParallelEnsemble: K chains, the eager functional decisions."""
    x, y = _data(torch.float32)
    torch.manual_seed(0)
    models = [torch.nn.Linear(3, 1) for _ in range(4)]
    runs = []
    for compiled in (False, True):
        ensemble = ParallelEnsemble.from_modules(models)
        opt = HMC(
            ensemble.named_parameters(), lr=0.5, num_steps=3, num_data=N, seed=2, compile=compiled
        )

        def loss_fn(params, ensemble=ensemble) -> Tensor:
            out = torch.func.functional_call(ensemble, params, (x,)).squeeze(-1)
            return torch.nn.functional.binary_cross_entropy_with_logits(
                out, y.expand(out.shape[0], -1), reduction="none"
            ).mean(1)

        decisions = []
        for _ in range(6):
            opt.step(loss_fn=loss_fn)
            decisions.append(opt.diagnostics["accepted"].clone())
        runs.append(decisions)
    eager, compiled_run = runs
    assert all(d.shape == (4,) for d in compiled_run)
    for a, b in zip(eager, compiled_run, strict=True):
        assert torch.equal(a, b)


def test_warmup_with_a_loss_fn_is_the_closure_warmup() -> None:
    """Stan's windowed warm-up (step size and mass) from a loss function: same chain."""
    x, y = _data()
    options = {"jitter": 0.2, "target_accept": 0.75, "mass": "adapt"}
    runs = []
    for path in ("closure", "loss_fn"):
        params = _params(k=3)
        opt = _optimizer(params, options)
        if path == "closure":
            opt.warmup(_closure(opt, params, x, y), 40)
        else:
            opt.warmup(num_steps=40, loss_fn=_loss_fn(x, y))
        assert not opt.warming_up
        runs.append((params, opt))
    (p1, o1), (p2, o2) = runs
    # the states differ by roundings (~1e-12 after a step); over 40 transitions the
    # trajectories, the mass (a variance of a window's few draws) and dual averaging amplify
    # them to ~1e-8 (measured 3e-8 at most), far from the O(0.1) of a different decision
    torch.testing.assert_close(
        o1.diagnostics["step_size"], o2.diagnostics["step_size"], rtol=1e-6, atol=0
    )
    for a, b in zip(p1, p2, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(o1.state[a]["mass"], o2.state[b]["mass"], rtol=1e-6, atol=0)


def test_warmup_errors() -> None:
    x, y = _data()
    params = _params()
    opt = HMC(params, lr=0.01, num_steps=2, num_data=N, seed=0, target_accept=0.8)
    with pytest.raises(TypeError, match="Invalid num_steps: None"):
        opt.warmup(loss_fn=_loss_fn(x, y))
    with pytest.raises(ValueError, match=r"HMC\.warmup needs a closure or a loss_fn, not neither"):
        opt.warmup(num_steps=5)
    with pytest.raises(ValueError, match="not both"):
        opt.warmup(_closure(opt, params, x, y), 5, loss_fn=_loss_fn(x, y))
    assert opt.warming_up and opt.steps_taken == 0  # nothing ran


def test_loss_fn_that_updates_batchnorm_statistics_gets_a_clear_error() -> None:
    """Train-mode BatchNorm writes its running statistics in place: not a pure function.

    The error says so and how to fix it; copies of the buffers (the fix it names) work.
    """
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))
    x = torch.randn(16, 4)
    opt = HMC(model.named_parameters(), lr=0.01, num_steps=2, num_data=16, seed=0)

    def impure(params):
        return torch.func.functional_call(model, params, (x,)).pow(2).mean()

    with pytest.raises(ValueError, match="modifies a tensor in place that it does not create"):
        opt.step(loss_fn=impure)

    def pure(params):
        buffers = {k: b.clone() for k, b in model.named_buffers()}
        return torch.func.functional_call(model, {**params, **buffers}, (x,)).pow(2).mean()

    running_mean = model[1].running_mean.clone()
    opt.step(loss_fn=pure)
    assert opt.steps_taken == 1
    assert torch.equal(model[1].running_mean, running_mean)  # the model's own stay put


def test_compile_with_a_closure_warns_once_and_runs_eagerly() -> None:
    x, y = _data()
    params = _params()
    opt = HMC(params, lr=0.01, num_steps=2, num_data=N, seed=0, compile=True)
    closure = _closure(opt, params, x, y)
    with pytest.warns(UserWarning, match=r"compiles step\(loss_fn=\.\.\.\) only"):
        opt.step(closure)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step(closure)  # said once
    assert opt.steps_taken == 2


@pytest.mark.parametrize("named", [True, False])
def test_frozen_parameters_stay_put_with_a_loss_fn_as_with_a_closure(named: bool) -> None:
    """A parameter with requires_grad=False is not sampled by either path (the closure's
    backward() gives it no gradient); loss_fn still receives it, as a constant."""
    x, y = _data()
    runs = []
    for path in ("closure", "loss_fn"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
        model = model.double()
        model[0].requires_grad_(False)
        frozen = model[0].weight.detach().clone()
        spec = model.named_parameters() if named else model.parameters()
        opt = HMC(spec, lr=0.05, num_steps=3, num_data=N, seed=4)

        def closure(model=model, opt=opt) -> Tensor:
            opt.zero_grad()
            out = model(x).squeeze(-1)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(out, y)
            loss.backward()
            return loss

        def loss_fn(params, model=model) -> Tensor:
            if not named:  # a tuple in the optimizer's order: every parameter
                assert len(params) == 4
                params = dict(zip([n for n, _ in model.named_parameters()], params, strict=True))
            out = torch.func.functional_call(model, params, (x,)).squeeze(-1)
            return torch.nn.functional.binary_cross_entropy_with_logits(out, y)

        for _ in range(5):
            opt.step(closure) if path == "closure" else opt.step(loss_fn=loss_fn)
        assert torch.equal(model[0].weight, frozen)
        assert opt.diagnostics["num_accepted"] > 0
        runs.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*runs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- failed steps, resume
class Interrupt(BaseException):
    """A KeyboardInterrupt-like BaseException."""


def _assert_same(a, b, where: str = "") -> None:
    """Nested dicts, lists and tensors equal bit for bit."""
    if isinstance(a, Tensor):
        assert isinstance(b, Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (where, set(a), set(b))
        for key in a:
            _assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def _snapshot(opt: HMC, params) -> tuple:
    return (
        [p.detach().clone() for p in params],
        [None if p.grad is None else p.grad.clone() for p in params],
        copy.deepcopy(opt.state_dict()),
        copy.deepcopy(opt.diagnostics),
    )


def _failing_loss_fn(loss_fn, how: str, at: int = 3):
    calls = [0]

    def failing(params):
        calls[0] += 1
        loss = loss_fn(params)
        if calls[0] != at:
            return loss
        if how == "shape":
            return loss.expand(2, *loss.shape)
        if how == "exception":
            raise RuntimeError("the loss failed")
        raise Interrupt

    return failing


@pytest.mark.parametrize("k", [None, 3])
@pytest.mark.parametrize("done", [0, 2])
@pytest.mark.parametrize(
    ("how", "error", "match"),
    [
        ("shape", ValueError, r"Invalid loss returned by loss_fn: (shape )?\(2,"),
        ("exception", RuntimeError, "the loss failed"),
        ("interrupt", Interrupt, None),
    ],
)
def test_failed_loss_fn_step_leaves_everything_as_before(how, error, match, done, k) -> None:
    """As with a closure (test_hmc.py): a loss_fn failing mid-trajectory changes nothing,
    not even on the chain's first step (which creates the adaptation state), and the
    chain then continues as one that never failed."""
    x, y = _data()
    options = {"jitter": 0.2, "target_accept": 0.7, "mass": "adapt"}
    params, twin_params = _params(k), _params(k)
    opt, twin = _optimizer(params, options), _optimizer(twin_params, options)
    loss_fn = _loss_fn(x, y)
    for _ in range(done):
        opt.step(loss_fn=loss_fn)
        twin.step(loss_fn=loss_fn)
    before = _snapshot(opt, params)
    with pytest.raises(error, match=match):
        opt.step(loss_fn=_failing_loss_fn(loss_fn, how))
    _assert_same(_snapshot(opt, params), before)
    for _ in range(3):
        assert torch.equal(opt.step(loss_fn=loss_fn), twin.step(loss_fn=loss_fn))
        _assert_same(_snapshot(opt, params), _snapshot(twin, twin_params))


@pytest.mark.parametrize(("done", "at"), [(0, 1), (0, 2), (2, 2)])
@pytest.mark.parametrize("how", ["in place", "under no_grad", "through the module"])
def test_loss_fn_writing_into_its_parameters_is_refused(how: str, done: int, at: int) -> None:
    """A loss_fn that writes into its parameters in place is refused by name, with the
    parameters and the state as before: whether autograd sees the write (it refuses one
    into a leaf that requires grad, or into a captured tensor) or not (under no_grad, the
    write went through and would corrupt the chain silently); at the start of a chain
    (call 1 of its first step) or in a trajectory."""
    x, y = _data()
    params = _params()
    opt = HMC(params, lr=0.05, num_steps=3, num_data=N, seed=0, target_accept=0.8)
    loss_fn = _loss_fn(x, y)
    for _ in range(done):
        opt.step(loss_fn=loss_fn)
    before = _snapshot(opt, params)
    calls = [0]

    def writes(ps):
        calls[0] += 1
        if calls[0] == at:
            if how == "in place":
                ps[0].clamp_(-0.01, 0.01)
            elif how == "under no_grad":
                with torch.no_grad():
                    ps[0].mul_(0.5)
            else:
                with torch.no_grad():
                    params[0].mul_(0.5)
        return loss_fn(ps)

    match = (
        "modifies a tensor in place that it does not create.* a parameter written through"
        if how == "through the module"
        else r"Invalid loss_fn: it writes in place into the parameters it receives"
    )
    with pytest.raises(ValueError, match=match):
        opt.step(loss_fn=writes)
    _assert_same(_snapshot(opt, params), before)


@pytest.mark.parametrize("how", ["state_dict", "deepcopy"])
@pytest.mark.parametrize("path", ["closure", "loss_fn"])
def test_single_chain_resumes_bit_for_bit(path: str, how: str) -> None:
    """Eager paths: a single chain (whose start U and grad U are cached between steps)
    continues bit for bit after a save, from the state_dict or a deep copy."""
    x, y = _data()
    options = {"jitter": 0.3, "target_accept": 0.75, "weight_decay": 0.1}
    params = _params()
    opt = _optimizer(params, options)
    loss_fn = _loss_fn(x, y)

    def run(o, ps, steps):
        closure = _closure(o, ps, x, y)
        out = []
        for _ in range(steps):
            loss = o.step(closure) if path == "closure" else o.step(loss_fn=loss_fn)
            out.append((loss.clone(), [p.detach().clone() for p in ps], dict(o.diagnostics)))
        return out

    run(opt, params, 4)
    if how == "state_dict":
        saved, values = copy.deepcopy(opt.state_dict()), [p.detach().clone() for p in params]
    else:
        other_params, other = copy.deepcopy((params, opt))
    reference = run(opt, params, 6)
    if how == "state_dict":
        other_params = [torch.nn.Parameter(v.clone()) for v in values]
        other = _optimizer(other_params, options)
        other.load_state_dict(saved)
    resumed = run(other, other_params, 6)
    assert any(bool(d["accepted"]) for _, _, d in reference)
    _assert_same(reference, resumed)


def _compile_closure_optimizer(params, **extra) -> HMC:
    """compile=True with a closure: eager transitions, but the state carries the start."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return HMC(params, lr=0.05, num_steps=3, num_data=N, seed=6, compile=True, **extra)


def test_carried_start_is_used_only_at_the_parameters_it_was_made_at() -> None:
    """With compile=True the state_dict carries the next step's start (loss, gradients
    and a digest of the parameters). The first step after loading evaluates its target's
    start (which target the carried one is of is not saved) and uses the carried bits
    instead where they were made at the same parameters and agree with that evaluation up
    to rounding; elsewhere (other parameters, another target) its own evaluation."""
    x, y = _data()
    params = _params()
    opt = _compile_closure_optimizer(params)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):
            opt.step(_closure(opt, params, x, y))
    saved = copy.deepcopy(opt.state_dict())
    assert set(saved["state"]["hmc"]["start"]) == {"params", "loss", "gradients", "fingerprint"}
    assert (
        "start" not in HMC(_params(), lr=0.05, num_steps=3, num_data=N).state_dict()["state"]["hmc"]
    )  # only with compile=True
    without = copy.deepcopy(saved)
    del without["state"]["hmc"]["start"]
    rounded, wrong = copy.deepcopy(saved), copy.deepcopy(saved)
    loss = saved["state"]["hmc"]["start"]["loss"]
    rounded["state"]["hmc"]["start"]["loss"] = loss * (1 + 2**-45)  # 128 ulps off
    wrong["state"]["hmc"]["start"]["loss"] = loss * 1.01  # another target's

    def resumed_step(state: dict, shift: float) -> tuple:
        other_params = [torch.nn.Parameter(p.detach() + shift) for p in params]
        other = _compile_closure_optimizer(other_params)
        other.load_state_dict(copy.deepcopy(state))
        calls = [0]
        closure = _closure(other, other_params, x, y)

        def counted(closure=closure, calls=calls):
            calls[0] += 1
            return closure()

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loss = other.step(counted)
        assert calls[0] == 4  # the start's evaluation and 3 leapfrog steps
        return loss, [p.detach().clone() for p in other_params], other.diagnostics

    for shift in (0.0, 1e-3):
        plain = resumed_step(without, shift)
        energy_error = plain[2]["energy_error"]
        # the carried start, off by rounding: used at its parameters, not at others
        used = resumed_step(rounded, shift)[2]["energy_error"]
        assert torch.equal(used, energy_error) == (shift != 0.0)
        # a carried start that does not agree with the evaluation: never used
        _assert_same([resumed_step(wrong, shift)], [plain])
    bad = copy.deepcopy(saved)
    bad["state"]["hmc"]["start"] = {"params": [0], "loss": 1.0}
    with pytest.raises(ValueError, match=r"Invalid state_dict: its 'hmc' entry's 'start' is"):
        _compile_closure_optimizer(_params()).load_state_dict(bad)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["state_dict", "deepcopy"])
def test_compiled_chain_resumes_bit_for_bit(how: str) -> None:
    """compile=True: a chain saved and resumed equals the uninterrupted one bit for bit,
    over several accepted transitions. The compiled graph's gradient at an accepted point
    differs from an eager evaluation there in the last place (for this small tanh network
    it does), so the start of the next step is carried in the state, not evaluated again."""
    torch._dynamo.reset()
    x, y = _data(torch.float32)
    generator = torch.Generator().manual_seed(1)
    params = [
        torch.nn.Parameter(torch.randn(3, 4, generator=generator)),
        torch.nn.Parameter(torch.randn(4, generator=generator)),
    ]

    def loss_fn(ps) -> Tensor:
        w, v = ps
        return torch.nn.functional.binary_cross_entropy_with_logits(torch.tanh(x @ w) @ v, y)

    def make(ps) -> HMC:
        return HMC(ps, lr=0.05, num_steps=2, num_data=N, seed=0, compile=True)

    def run(o, ps, steps):
        out = []
        for _ in range(steps):
            loss = o.step(loss_fn=loss_fn).clone()
            out.append((loss, [p.detach().clone() for p in ps], [p.grad.clone() for p in ps]))
            out.append(dict(o.diagnostics))
        return out

    opt = make(params)
    run(opt, params, 2)
    if how == "state_dict":
        saved, values = copy.deepcopy(opt.state_dict()), [p.detach().clone() for p in params]
    else:
        other_params, other = copy.deepcopy((params, opt))
    reference = run(opt, params, 4)
    if how == "state_dict":
        other_params = [torch.nn.Parameter(v.clone()) for v in values]
        other = make(other_params)
        other.load_state_dict(saved)
    resumed = run(other, other_params, 4)
    assert sum(bool(d["accepted"]) for d in reference[1::2]) >= 3
    _assert_same(reference, resumed)
