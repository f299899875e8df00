"""HMC's carried-over start belongs to one target: a new loss function or closure evaluates its own.

A transition starts from the loss and gradient at the current parameters; the last step
computed them at its end, so the next step reuses them -- but only for the same target
(the same loss function or closure object) at unchanged parameters. A step, a run or a
resumed state given another target starts from that target's loss and gradient: its
first transition is, bit for bit, the one a fresh optimizer resumed from ``state_dict()``
makes with that target (issue #34, item 3: it used the previous target's energy, and
rejected nearly every first proposal).
"""

from __future__ import annotations

import copy
import gc
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

from samplers_as_optim import HMC

N = 10
NUM_STEPS = 5
#: the leapfrog step sqrt(lr / N) is 0.3: a Gaussian of unit scale accepts nearly always
OPTIONS: dict[str, Any] = {"lr": 0.09 * N, "num_steps": NUM_STEPS, "num_data": N, "seed": 3}


def _gaussian(center: float, scale: float = 1.0) -> Callable[[Any], Tensor]:
    """The mean loss whose potential N * loss is N(center, scale**2 I)'s, of a tuple or dict."""

    def loss_fn(params: Any) -> Tensor:
        (theta,) = params.values() if isinstance(params, dict) else params
        return 0.5 * ((theta - center) / scale).square().sum() / N

    return loss_fn


TARGET_A = _gaussian(0.0)
TARGETS_B = {"shifted": _gaussian(5.0), "scaled": _gaussian(0.0, 0.5)}


def _closure(opt: HMC, param: Tensor, target: Callable[[Any], Tensor]) -> Callable[[], Tensor]:
    """The closure of ``target``: zero the gradients, the loss, ``backward()``."""

    def closure() -> Tensor:
        opt.zero_grad()
        loss = target((param,))
        loss.backward()
        return loss

    return closure


def _start(**extra: Any) -> tuple[HMC, Tensor]:
    generator = torch.Generator().manual_seed(0)
    param = torch.nn.Parameter(torch.randn(4, generator=generator, dtype=torch.float64))
    with warnings.catch_warnings():  # compile=True with a closure: eager, it says so
        warnings.simplefilter("ignore")
        return HMC([param], **OPTIONS, **extra), param


def _resumed(state: dict[str, Any], values: Tensor, **extra: Any) -> tuple[HMC, Tensor]:
    """A fresh optimizer of a copy of ``values``, loaded from ``state``."""
    param = torch.nn.Parameter(values.clone())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = HMC([param], **OPTIONS, **extra)
    opt.load_state_dict(copy.deepcopy(state))
    return opt, param


def _step(opt: HMC, param: Tensor, target: Callable[[Any], Tensor], how: str) -> Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if how == "loss_fn":
            return opt.step(loss_fn=target)
        return opt.step(_closure(opt, param, target))


def _outcome(opt: HMC, param: Tensor, loss: Tensor) -> tuple[Any, ...]:
    assert param.grad is not None
    return loss, param.detach().clone(), param.grad.clone(), opt.diagnostics


def _assert_same(a: Any, b: Any) -> None:
    if isinstance(a, Tensor):
        assert isinstance(b, Tensor) and a.dtype == b.dtype and torch.equal(a, b), (a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _assert_same(a[key], b[key])
    else:
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)


@pytest.mark.parametrize("how", ["loss_fn", "closure"])
@pytest.mark.parametrize("target", list(TARGETS_B))
@pytest.mark.parametrize("warmup", [False, True], ids=["sampling", "warm-up"])
def test_a_step_with_a_new_target_starts_from_its_loss(how: str, target: str, warmup: bool) -> None:
    """After steps with A, a step with B is the step a fresh optimizer resumed from the
    state makes with B, bit for bit: B's loss and energy at the start, not A's."""
    extra = {"target_accept": 0.8} if warmup else {}
    opt, param = _start(**extra)
    for _ in range(3):
        _step(opt, param, TARGET_A, how)
    fresh, fresh_param = _resumed(opt.state_dict(), param.detach(), **extra)
    b = TARGETS_B[target]
    loss = _step(opt, param, b, how)
    expected = _step(fresh, fresh_param, b, how)
    _assert_same(_outcome(opt, param, loss), _outcome(fresh, fresh_param, expected))
    assert torch.equal(loss, b((param.detach(),)))  # B's loss, whether accepted or not
    if not warmup:  # (from A's start energy: about exp(-6) and below)
        assert float(opt.diagnostics["accept_prob"]) > 0.5


@pytest.mark.parametrize("target", list(TARGETS_B))
@pytest.mark.parametrize("warmup", [False, True], ids=["sampling", "warm-up"])
def test_a_run_with_a_new_target_starts_from_its_loss(target: str, warmup: bool) -> None:
    """After steps with A, run(B, ..., thin=2) is the run of a fresh optimizer resumed from
    the state, bit for bit: the draws, their losses and diagnostics, the optimizer after."""
    extra = {"target_accept": 0.8} if warmup else {}
    opt, param = _start(**extra)
    for _ in range(3):
        opt.step(loss_fn=TARGET_A)
    fresh, fresh_param = _resumed(opt.state_dict(), param.detach(), **extra)
    b = TARGETS_B[target]
    result, expected = opt.run(b, 3, thin=2), fresh.run(b, 3, thin=2)
    _assert_same(tuple(result), tuple(expected))
    _assert_same(
        _outcome(opt, param, result.loss[-1]), _outcome(fresh, fresh_param, expected.loss[-1])
    )
    if not warmup:  # (the warm-up's first step sizes are far too large)
        assert float(result.diagnostics["accept_prob"].mean()) > 0.5


@pytest.mark.parametrize("load", ["load_state_dict", "deepcopy"])
def test_a_carried_start_is_not_used_for_another_target(load: str) -> None:
    """compile=True carries the next step's start in the state: an optimizer resumed from
    it and given another closure starts from that closure's loss, as one resumed without
    the carried start does; given the same target it goes on as the saved one."""
    opt, param = _start(compile=True)
    for _ in range(3):
        _step(opt, param, TARGET_A, "closure")
    state = copy.deepcopy(opt.state_dict())
    assert "start" in state["state"]["hmc"]
    if load == "deepcopy":
        resumed = copy.deepcopy(opt)
        resumed_param = resumed.param_groups[0]["params"][0]
    else:
        resumed, resumed_param = _resumed(state, param.detach(), compile=True)
    without = copy.deepcopy(state)
    del without["state"]["hmc"]["start"]
    fresh, fresh_param = _resumed(without, param.detach(), compile=True)
    b = TARGETS_B["shifted"]
    loss = _step(resumed, resumed_param, b, "closure")
    expected = _step(fresh, fresh_param, b, "closure")
    _assert_same(_outcome(resumed, resumed_param, loss), _outcome(fresh, fresh_param, expected))
    assert float(resumed.diagnostics["accept_prob"]) > 0.5
    # the same target: the resumed chain is the uninterrupted one
    again, again_param = _resumed(state, param.detach(), compile=True)
    loss = _step(again, again_param, TARGET_A, "closure")
    uninterrupted = _step(opt, param, TARGET_A, "closure")
    _assert_same(_outcome(again, again_param, loss), _outcome(opt, param, uninterrupted))


def _counted(target: Callable[[Any], Tensor], calls: list[int]) -> Callable[[Any], Tensor]:
    def counted(params: Any) -> Tensor:
        calls[0] += 1
        return target(params)

    return counted


@pytest.mark.parametrize("how", ["loss_fn", "closure"])
def test_the_same_target_reuses_the_start(how: str) -> None:
    """The same loss function or closure object at unchanged parameters: each step
    evaluates the target num_steps times (the first once more, for its start); another
    target, or going back to the first, evaluates the start once."""
    opt, param = _start()
    calls = [0]
    a = _counted(TARGET_A, calls)
    target: Any = a if how == "loss_fn" else _closure(opt, param, a)

    def step(target: Any) -> None:
        if how == "loss_fn":
            opt.step(loss_fn=target)
        else:
            opt.step(target)

    for count in (1 + NUM_STEPS, NUM_STEPS, NUM_STEPS):
        calls[0] = 0
        step(target)
        assert calls[0] == count
    b = _counted(TARGETS_B["shifted"], calls)
    other: Any = b if how == "loss_fn" else _closure(opt, param, b)
    for each, count in ((other, 1 + NUM_STEPS), (other, NUM_STEPS), (target, 1 + NUM_STEPS)):
        calls[0] = 0
        step(each)
        assert calls[0] == count
    if how == "loss_fn":
        calls[0] = 0
        opt.run(target, 2, thin=2)  # a run after steps with the same target reuses too
        assert calls[0] == 4 * NUM_STEPS


def test_a_bound_method_is_the_same_target() -> None:
    """``obj.loss`` is a new object at each access; the same method of the same object is
    the same target (the start is reused), of another object another one."""

    class Model:
        def __init__(self, center: float) -> None:
            self.loss = _gaussian(center)
            self.calls = 0

        def loss_fn(self, params: Any) -> Tensor:
            self.calls += 1
            return self.loss(params)

    opt, param = _start()
    first, second = Model(0.0), Model(5.0)
    opt.step(loss_fn=first.loss_fn)
    first.calls = 0
    opt.step(loss_fn=first.loss_fn)
    assert first.calls == NUM_STEPS
    loss = opt.step(loss_fn=second.loss_fn)
    assert second.calls == 1 + NUM_STEPS
    assert torch.equal(loss, second.loss((param.detach(),)))


def test_a_new_function_at_a_recycled_address_is_a_new_target() -> None:
    """Functions made and dropped in a loop (CPython often gives the next one the last
    one's address): each step starts from its own function's loss."""
    opt, param = _start()
    for center in (0.0, 3.0, -3.0, 6.0):
        loss = opt.step(loss_fn=_gaussian(center))
        gc.collect()
        assert torch.equal(loss, _gaussian(center)((param.detach(),)))


@pytest.mark.slow
def test_a_compiled_step_with_a_new_target_starts_from_its_loss() -> None:
    """compile=True, step(loss_fn=...): after compiled steps with A (whose state carries
    A's start), a compiled step with B is that of a fresh optimizer resumed from the state."""
    torch._dynamo.reset()
    opt, param = _start(compile=True)
    for _ in range(2):
        opt.step(loss_fn=TARGET_A)
    fresh, fresh_param = _resumed(opt.state_dict(), param.detach(), compile=True)
    b = TARGETS_B["shifted"]
    loss, expected = opt.step(loss_fn=b), fresh.step(loss_fn=b)
    _assert_same(_outcome(opt, param, loss), _outcome(fresh, fresh_param, expected))
    assert float(opt.diagnostics["accept_prob"]) > 0.5
