"""HMC.run: many transitions per call, the same chain as repeated step(loss_fn=...).

``run(loss_fn, n, thin=k)`` must be ``n * k`` calls of ``step(loss_fn=loss_fn)`` bit for
bit: the kept states, their losses and diagnostics, and the optimizer afterwards (the
parameters, ``.grad``, ``state_dict()``, the next steps). Chunks are made small here
(``run.CHUNK``) so that a few draws cross several chunk boundaries, a partial last chunk
included. The compiled tests compile a transition (the steps) and a loop (the run) once
each: tiny models, two leapfrog steps.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from torch import Tensor

from samplers_as_optim import HMC, ParallelEnsemble, call_stacked, diagnostics
from samplers_as_optim.hmc import run as run_module
from samplers_as_optim.hmc.run import HMCRun

N = 40
_GENERATOR = torch.Generator().manual_seed(0)
X = torch.randn(N, 3, generator=_GENERATOR, dtype=torch.float64)
Y = (torch.rand(N, generator=_GENERATOR) < 0.5).to(torch.float64)


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of 4 transitions (8 compiled): boundaries inside short runs."""
    monkeypatch.setattr(run_module, "CHUNK", 4)


def _losses(w: Tensor, b: Tensor, x: Tensor = X, y: Tensor = Y) -> Tensor:
    """Mean logistic loss: a scalar for w [3], b []; one per member for w [K, 3], b [K]."""
    logits = w @ x.T + (b[:, None] if b.dim() else b)
    return torch.nn.functional.binary_cross_entropy_with_logits(
        logits, y.expand_as(logits), reduction="none"
    ).mean(-1)


def loss_fn(params: Any) -> Tensor:
    """The loss function of a tuple ``(w, b)`` or of a dict ``{"w": ..., "b": ...}``."""
    w, b = (params["w"], params["b"]) if isinstance(params, dict) else params
    return _losses(w, b)


def _params(k: int | None = None, dtype: torch.dtype = torch.float64) -> list[Tensor]:
    generator = torch.Generator().manual_seed(1)
    shape = (3,) if k is None else (k, 3)
    w = torch.randn(shape, generator=generator, dtype=dtype) * 0.1
    b = torch.zeros(() if k is None else (k,), dtype=dtype)
    return [torch.nn.Parameter(w), torch.nn.Parameter(b)]


CONFIGS: dict[str, tuple[dict[str, Any], int | None]] = {
    "one chain, jitter": ({"jitter": 0.3, "weight_decay": 0.05}, None),
    "named": ({"named": True, "jitter": 0.1}, None),
    "param groups": ({"groups": True}, None),
    "mass tensors": ({"mass": "tensors", "temperature": 0.7, "jitter": 0.2}, None),
    "stacked chains": ({"jitter": 0.2}, 3),
    "frozen bias": ({"frozen": True}, None),
}


def _optimizer(params: list[Tensor], options: dict[str, Any], **extra: Any) -> HMC:
    options = dict(options)
    if options.pop("frozen", False):
        params[1].requires_grad_(False)
    groups, named = options.pop("groups", False), options.pop("named", False)
    if options.get("mass") == "tensors":
        options["mass"] = [torch.full_like(p, 2.0) for p in params]
    spec: Any = params
    if groups:
        spec = [{"params": [params[0]], "lr": 6.0, "weight_decay": 0.1}, {"params": [params[1]]}]
    elif named:
        spec = list(zip(("w", "b"), params, strict=True))
    options.setdefault("lr", 4.0)
    return HMC(spec, num_steps=3, num_data=N, seed=5, **options, **extra)


def _steps(opt: HMC, params: list[Tensor], count: int, fn: Any = loss_fn) -> list[tuple]:
    """``count`` steps: after each, the sampled parameters, the loss and the diagnostics."""
    out = []
    for _ in range(count):
        loss = opt.step(loss_fn=fn)
        values = [p.detach().clone() for p in params if p.requires_grad]
        out.append((values, loss.clone(), {k: v.clone() for k, v in opt.diagnostics.items()}))
    return out


def _assert_same(a: Any, b: Any, where: str = "") -> None:
    """Equal bit for bit: tensors (dtype too), and dicts, lists and numbers of them."""
    if isinstance(a, Tensor):
        assert isinstance(b, Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), where
        for key in a:
            _assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for index, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}[{index}]")
    else:
        assert a == b, where


def _assert_run_is_steps(result: HMCRun, steps: list[tuple], thin: int = 1) -> None:
    kept = steps[thin - 1 :: thin]
    assert result.loss.shape[0] == len(kept)
    for index, (values, loss, diag) in enumerate(kept):
        for value, sample in zip(values, result.samples.values(), strict=True):
            _assert_same(sample[index], value, f"draw {index}")
        _assert_same(result.loss[index], loss, f"loss {index}")
        _assert_same({k: v[index] for k, v in result.diagnostics.items()}, diag, f"draw {index}")


def _assert_same_optimizer(
    first: HMC, first_params: list[Tensor], second: HMC, second_params: list[Tensor]
) -> None:
    """The same parameters, gradients and state, and the same next steps."""
    for a, b in zip(first_params, second_params, strict=True):
        _assert_same(a.detach(), b.detach())
        _assert_same(a.grad, b.grad)
    _assert_same(first.state_dict(), second.state_dict())
    _assert_same(_steps(first, first_params, 3), _steps(second, second_params, 3))


@pytest.mark.parametrize("config", list(CONFIGS))
def test_run_is_repeated_steps(config: str) -> None:
    """11 draws (chunks of 4, 4, 3) equal 11 steps, and leave the same optimizer."""
    options, k = CONFIGS[config]
    p1, p2 = _params(k), _params(k)
    o1, o2 = _optimizer(p1, options), _optimizer(p2, options)
    steps = _steps(o1, p1, 11)
    result = o2.run(loss_fn, 11)
    assert any(not bool(d["accepted"].all()) for _, _, d in steps)  # rejections too
    _assert_run_is_steps(result, steps)
    _assert_same_optimizer(o1, p1, o2, p2)
    expected = ["w", "b"] if options.get("named") else ["0", "1"]
    assert list(result.samples) == (expected[:1] if options.get("frozen") else expected)


def test_a_large_model_runs_one_transition_per_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where a chunk's stacked numbers would pass CHUNK_ELEMENTS, fewer transitions per
    chunk (down to one): the same chain."""
    monkeypatch.setattr(run_module, "CHUNK_ELEMENTS", 5)  # 4 elements: 1 transition a chunk
    assert run_module.chunk_capacity(_params()) == 1
    p1, p2 = _params(), _params()
    o1, o2 = _optimizer(p1, {"jitter": 0.3}), _optimizer(p2, {"jitter": 0.3})
    steps = _steps(o1, p1, 5)
    _assert_run_is_steps(o2.run(loss_fn, 5), steps)
    _assert_same_optimizer(o1, p1, o2, p2)


def test_run_with_a_parallel_ensemble_is_repeated_steps() -> None:
    """K = 3 members of a ParallelEnsemble: K chains, [num_draws, K, ...] draws."""
    x, y = X.float(), Y.float()
    torch.manual_seed(0)
    models = [torch.nn.Linear(3, 1) for _ in range(3)]
    runs = []
    for _ in range(2):
        ensemble = ParallelEnsemble.from_modules(models)
        opt = HMC(ensemble.named_parameters(), lr=0.5, num_steps=3, num_data=N, seed=2, jitter=0.3)

        def ensemble_loss(params: dict[str, Tensor], ensemble: Any = ensemble) -> Tensor:
            out = torch.func.functional_call(ensemble, params, (x,)).squeeze(-1)
            return torch.nn.functional.binary_cross_entropy_with_logits(
                out, y.expand_as(out), reduction="none"
            ).mean(1)

        runs.append((ensemble, opt, ensemble_loss))
    (e1, o1, f1), (e2, o2, f2) = runs
    params1, params2 = list(e1.parameters()), list(e2.parameters())
    steps = _steps(o1, params1, 9, f1)
    result = o2.run(f2, 9)
    _assert_run_is_steps(result, steps)
    assert result.samples["module.weight"].shape == (9, 3, 1, 3)
    assert result.diagnostics["accepted"].shape == result.loss.shape == (9, 3)
    assert result.chains()["module.weight"].shape == (3, 9, 1, 3)
    for a, b in zip(params1, params2, strict=True):
        _assert_same(a.detach(), b.detach())
    _assert_same(o1.state_dict(), o2.state_dict())
    # each draw of the K members, through call_stacked with one member's module
    flat = {k.removeprefix("module."): v.flatten(0, 1) for k, v in result.samples.items()}
    out = call_stacked(e2.member(0), flat, x)  # [9 * 3, N, 1]
    weight = result.samples["module.weight"][4, 2]
    torch.testing.assert_close(out[4 * 3 + 2], x @ weight.T + result.samples["module.bias"][4, 2])


@pytest.mark.parametrize("thin", [2, 3])
def test_thinning_keeps_every_thin_th_state(thin: int) -> None:
    """run(5, thin) is 5 * thin steps, every thin-th kept (chunk borders not aligned)."""
    p1, p2 = _params(), _params()
    o1, o2 = _optimizer(p1, {"jitter": 0.3}), _optimizer(p2, {"jitter": 0.3})
    steps = _steps(o1, p1, 5 * thin)
    result = o2.run(loss_fn, 5, thin=thin)
    _assert_run_is_steps(result, steps, thin)
    assert int(result.diagnostics["num_accepted"][-1]) == sum(
        int(d["accepted"]) for _, _, d in steps
    )  # the counts count every transition
    _assert_same_optimizer(o1, p1, o2, p2)


def test_runs_and_steps_continue_each_other_and_resume_from_a_state_dict() -> None:
    """run(6) + step + run(4) + save/load + run(3) is 14 steps, whatever the mix."""
    p1, p2 = _params(), _params()
    o1, o2 = _optimizer(p1, {"jitter": 0.2}), _optimizer(p2, {"jitter": 0.2})
    steps = _steps(o1, p1, 14)
    first = o2.run(loss_fn, 6)
    o2.step(loss_fn=loss_fn)
    second = o2.run(loss_fn, 4)
    p3 = [p.detach().clone().requires_grad_() for p in p2]
    o3 = _optimizer(p3, {"jitter": 0.2})
    o3.load_state_dict(copy.deepcopy(o2.state_dict()))
    third = o3.run(loss_fn, 3)
    _assert_run_is_steps(first, steps[:6])
    _assert_run_is_steps(second, steps[7:11])
    _assert_run_is_steps(third, steps[11:14])


def test_run_after_closure_steps_is_loss_fn_steps() -> None:
    """A run picks the chain up where closure steps left it, as step(loss_fn=...) does."""
    p1, p2 = _params(), _params()
    o1, o2 = _optimizer(p1, {}), _optimizer(p2, {})
    for opt, params in ((o1, p1), (o2, p2)):

        def closure(opt: HMC = opt, params: list[Tensor] = params) -> Tensor:
            opt.zero_grad()
            loss = _losses(*params)
            loss.backward()
            return loss

        for _ in range(3):
            opt.step(closure)
    steps = _steps(o1, p1, 5)
    _assert_run_is_steps(o2.run(loss_fn, 5), steps)


def test_run_during_the_warmup_is_the_adapting_steps() -> None:
    """During the warm-up each transition is a step (adaptation between them); after
    end_warmup() the chunked chain again."""
    options = {"jitter": 0.2, "target_accept": 0.7, "mass": "adapt"}
    p1, p2 = _params(), _params()
    o1, o2 = _optimizer(p1, options), _optimizer(p2, options)
    warm = _steps(o1, p1, 6)
    result = o2.run(loss_fn, 3, thin=2)
    assert o2.warming_up
    _assert_run_is_steps(result, warm, thin=2)
    _assert_same(o1.state_dict(), o2.state_dict())
    o1.end_warmup()
    o2.end_warmup()
    steps = _steps(o1, p1, 7)
    _assert_run_is_steps(o2.run(loss_fn, 7), steps)
    _assert_same_optimizer(o1, p1, o2, p2)


def _snapshot(opt: HMC, params: list[Tensor]) -> tuple:
    grads = [None if p.grad is None else p.grad.clone() for p in params]
    return [p.detach().clone() for p in params], grads, copy.deepcopy(opt.state_dict())


@pytest.mark.parametrize("error", [RuntimeError("boom"), KeyboardInterrupt()])
@pytest.mark.parametrize("when", ["first chunk", "later chunk", "warm-up"])
def test_a_run_that_raises_changes_nothing(error: BaseException, when: str) -> None:
    options = {"jitter": 0.2, "target_accept": 0.7} if when == "warm-up" else {"jitter": 0.2}
    params = _params()
    opt = _optimizer(params, options)
    opt.step(loss_fn=loss_fn)
    before = _snapshot(opt, params)
    calls = {"count": 0}
    fail_at = 5 if when == "first chunk" else 20  # a transition is 3 evaluations

    def failing(p: Any) -> Tensor:
        calls["count"] += 1
        if calls["count"] == fail_at:
            raise error
        return loss_fn(p)

    with pytest.raises(type(error)):
        opt.run(failing, 10)
    assert calls["count"] == fail_at
    _assert_same(_snapshot(opt, params), before)
    # and the chain goes on as if the run had not been tried
    other_params = _params()
    other = _optimizer(other_params, options)
    other.step(loss_fn=loss_fn)
    _assert_same(_steps(opt, params, 4), _steps(other, other_params, 4))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"num_draws": 0}, ValueError, r"Invalid num_draws: 0 \(expected an integer >= 1\)"),
        ({"num_draws": -3}, ValueError, r"Invalid num_draws: -3 \(expected an integer >= 1\)"),
        ({"num_draws": 2.5}, TypeError, r"Invalid num_draws: 2.5 \(expected an integer >= 1\)"),
        ({"num_draws": True}, TypeError, r"Invalid num_draws: True \(expected an integer >= 1\)"),
        ({"num_draws": "4"}, TypeError, r"Invalid num_draws: '4' \(expected an integer >= 1\)"),
        ({"thin": 0}, ValueError, r"Invalid thin: 0 \(expected an integer >= 1\)"),
        ({"thin": False}, TypeError, r"Invalid thin: False \(expected an integer >= 1\)"),
        ({"loss_fn": None}, TypeError, r"Invalid loss_fn: None \(expected a callable"),
        ({"loss_fn": 3.0}, TypeError, r"Invalid loss_fn: 3.0 \(expected a callable"),
        (
            {"loss_fn": lambda: torch.zeros(())},
            TypeError,
            r"Invalid loss_fn: .* does not take one argument, the parameters .*takes no closure",
        ),
        (
            {"loss_fn": lambda params: torch.zeros(2, 2)},
            ValueError,
            r"Invalid loss returned by loss_fn: \(2, 2\)",
        ),
        (
            {"loss_fn": lambda params: torch.zeros(5)},
            ValueError,
            r"Invalid loss returned by loss_fn: shape \(5,\)",
        ),
    ],
)
def test_run_refuses_bad_arguments_and_changes_nothing(kwargs, error, match) -> None:
    params = _params()
    opt = _optimizer(params, {})
    before = _snapshot(opt, params)
    arguments = {"loss_fn": loss_fn, "num_draws": 3, **kwargs}
    with pytest.raises(error, match=match):
        opt.run(arguments.pop("loss_fn"), arguments.pop("num_draws"), **arguments)
    _assert_same(_snapshot(opt, params), before)


def test_the_draws_work_with_the_diagnostics_and_call_stacked() -> None:
    model = torch.nn.Linear(3, 1).double()
    opt = HMC(model.named_parameters(), lr=0.3, num_steps=3, num_data=N, seed=0, jitter=0.2)

    def model_loss(params: dict[str, Tensor]) -> Tensor:
        out = torch.func.functional_call(model, params, (X,)).squeeze(-1)
        return torch.nn.functional.binary_cross_entropy_with_logits(out, Y)

    result = opt.run(model_loss, 40)
    assert list(result.samples) == ["weight", "bias"]
    assert result.samples["weight"].shape == (40, 1, 3) and result.loss.shape == (40,)
    chains = result.chains()
    assert chains["weight"].shape == (1, 40, 1, 3)
    ess = diagnostics.ess(chains["weight"])
    assert ess.shape == (1, 3) and bool((ess > 0).all())
    report = diagnostics.weight_space({k: torch.cat([v, v]) for k, v in chains.items()})
    assert report.rhat["bias"].shape == (1,)
    outputs = call_stacked(model, result.samples, X)  # [40, N, 1]
    index = 17
    expected = X @ result.samples["weight"][index].T + result.samples["bias"][index]
    torch.testing.assert_close(outputs[index], expected)
    losses = torch.nn.functional.binary_cross_entropy_with_logits(
        outputs.squeeze(-1), Y.expand(40, -1), reduction="none"
    ).mean(1)
    torch.testing.assert_close(losses, result.loss)
    assert result.diagnostics["step_size"].dtype == torch.float64
    assert int(result.diagnostics["num_accepted"][-1]) == int(result.diagnostics["accepted"].sum())


def test_a_loop_compile_cannot_capture_falls_back_to_the_compiled_transition(monkeypatch) -> None:
    """Where torch.compile cannot put loss_fn in a loop, run warns once and makes one
    compiled transition per call (here stand-ins for both: no compilation)."""
    from torch._dynamo.exc import UncapturedHigherOrderOpError

    attempts = []

    def uncapturable(loss_fn: Any, device: torch.device) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            attempts.append(1)
            raise UncapturedHigherOrderOpError(
                "while_loop failed\n\nHOP: a reason\nExplanation: why"
            )

        return call

    transitions = []

    def the_transition(loss_fn: Any, device: torch.device) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            transitions.append(1)
            return run_module._functional.transition(*args, **kwargs)

        return call

    monkeypatch.setattr(run_module, "compiled_chunk", uncapturable)
    monkeypatch.setattr(run_module._functional, "compiled_transition", the_transition)

    def fresh_loss(params: Any) -> Tensor:  # a code of its own (the failure is remembered)
        return loss_fn(params)

    p1, p2 = _params(), _params()
    o1, o2 = _optimizer(p1, {"jitter": 0.2}), _optimizer(p2, {"jitter": 0.2}, compile=True)
    steps = _steps(o1, p1, 10)
    with pytest.warns(UserWarning, match=r"cannot capture .*\(HOP: a reason -- why\).*the same"):
        result = o2.run(fresh_loss, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        second = o2.run(fresh_loss, 4)
    assert len(attempts) == 1 and len(transitions) == 10
    _assert_run_is_steps(result, steps[:6])
    _assert_run_is_steps(second, steps[6:])


# ---------------------------------------------------------------------- compiled
def compiled_loss(params: Any) -> Tensor:
    """The compiled tests' loss, float32 (a code of its own: its own compiled graphs)."""
    return _losses(*params, X.float(), Y.float())


@pytest.mark.parametrize("k", [None, 2], ids=["one chain", "2 stacked chains"])
def test_compiled_run_is_repeated_compiled_steps(k: int | None, monkeypatch) -> None:
    """compile=True: the loop of up to 8 transitions per compiled call is the compiled
    transition's chain bit for bit: draws, losses, diagnostics, state, and a resume."""
    monkeypatch.setattr(run_module, "CHUNK", 8)
    options = {"lr": 3.0, "num_steps": 2, "num_data": N, "weight_decay": 0.05, "jitter": 0.3}

    def chain(params: list[Tensor]) -> tuple[list[Tensor], HMC]:
        params = [p.float().detach().requires_grad_() for p in params]
        return params, HMC(params, seed=3, compile=True, **options)

    (p1, o1), (p2, o2) = chain(_params(k)), chain(_params(k))
    steps = _steps(o1, p1, 27, compiled_loss)
    first = o2.run(compiled_loss, 9)  # chunks of 8 and 1
    thinned = o2.run(compiled_loss, 6, thin=3)  # 18 transitions: 8, 8, 2
    assert any(not bool(d["accepted"].all()) for _, _, d in steps)
    _assert_run_is_steps(first, steps[:9])
    _assert_run_is_steps(thinned, steps[9:], thin=3)
    for a, b in zip(p1, p2, strict=True):
        _assert_same(a.detach(), b.detach())
        _assert_same(a.grad, b.grad)
    _assert_same(o1.state_dict(), o2.state_dict())
    # resumed from a state_dict (which carries the compiled start): the same next draws
    _, o3 = chain(p2)
    o3.load_state_dict(o2.state_dict())
    _assert_run_is_steps(o3.run(compiled_loss, 4), _steps(o1, p1, 4, compiled_loss))
