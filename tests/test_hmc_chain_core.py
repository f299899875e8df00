"""HMC shares the SG-MCMC samplers' chain core (``samplers_as_optim.core.chain``).

Its momentum noise keys are kept in each parameter's state (``state["noise_key"]``, a 0-d
int64 tensor on the CPU), as the SG-MCMC samplers keep theirs, so that a state saved by an
HMC built from ``model.parameters()`` continues bit for bit in one built from
``model.named_parameters()``, and the reverse (the keys of a name and of a position
differ: without the stored keys the two would draw other momenta). A state without keys
(a checkpoint written before HMC stored them) still loads and keys the momenta by the
loading optimizer's names or positions, as HMC always did; a step that raises records no
key; a saved key or chain state that is not valid is refused before anything changes.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from samplers_as_optim import HMC
from samplers_as_optim.core.chain import ChainOptimizer
from samplers_as_optim.core.streams import key_to_int64, parameter_key
from samplers_as_optim.sgmcmc.optimizer import SamplerOptimizer

N = 40
STEPS_BEFORE, STEPS_AFTER = 4, 5


def _data(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(N, 3, generator=generator).to(dtype)
    y = (torch.rand(N, generator=generator) < 0.5).to(dtype)
    return x, y


def _model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).to(dtype)


def _hmc(model: nn.Module, named: bool, seed: int = 0, **options) -> HMC:
    params = model.named_parameters() if named else model.parameters()
    return HMC(params, lr=0.05, num_steps=3, num_data=N, seed=seed, **options)


def _step(opt: HMC, model: nn.Module, how: str, dtype: torch.dtype) -> torch.Tensor:
    x, y = _data(dtype)
    if how == "closure":

        def closure():
            opt.zero_grad()
            loss = nn.functional.binary_cross_entropy_with_logits(model(x).squeeze(-1), y)
            loss.backward()
            return loss

        return opt.step(closure).clone()
    names = [name for name, _ in model.named_parameters()]

    def loss_fn(params):  # a dict by name (named optimizer) or a tuple in order
        values = params if isinstance(params, dict) else dict(zip(names, params, strict=True))
        logits = torch.func.functional_call(model, values, (x,)).squeeze(-1)
        return nn.functional.binary_cross_entropy_with_logits(logits, y)

    return opt.step(loss_fn=loss_fn).clone()


def _run(opt: HMC, model: nn.Module, steps: int, how: str, dtype: torch.dtype) -> list:
    out = []
    for _ in range(steps):
        loss = _step(opt, model, how, dtype)
        out.append((loss, [p.detach().clone() for p in model.parameters()]))
    return out


def _assert_same(a: list, b: list) -> None:
    assert len(a) == len(b)
    for (loss_a, params_a), (loss_b, params_b) in zip(a, b, strict=True):
        assert torch.equal(loss_a, loss_b)
        for p, q in zip(params_a, params_b, strict=True):
            assert torch.equal(p, q)


def _saved_chain(named: bool, how: str, dtype: torch.dtype, **options):
    """A chain run STEPS_BEFORE steps: its saved state and values, and its next steps."""
    model = _model(dtype)
    opt = _hmc(model, named, **options)
    _run(opt, model, STEPS_BEFORE, how, dtype)
    saved = copy.deepcopy(opt.state_dict())
    values = copy.deepcopy(model.state_dict())
    reference = _run(opt, model, STEPS_AFTER, how, dtype)
    return saved, values, reference


def _resume(saved, values, named: bool, how: str, dtype: torch.dtype, **options) -> list:
    model = _model(dtype)
    model.load_state_dict(values)
    opt = _hmc(model, named, seed=12345, **options)  # the loaded state overrides the seed
    opt.load_state_dict(copy.deepcopy(saved))
    return _run(opt, model, STEPS_AFTER, how, dtype)


def _without_keys(saved):
    """The state as HMC wrote it before it stored the noise keys."""
    saved = copy.deepcopy(saved)
    for param_id in [k for k in saved["state"] if k != "hmc"]:
        saved["state"][param_id].pop("noise_key", None)
        if not saved["state"][param_id]:
            del saved["state"][param_id]
    return saved


def test_hmc_is_a_chain_optimizer_like_the_samplers() -> None:
    assert issubclass(HMC, ChainOptimizer)
    assert issubclass(SamplerOptimizer, ChainOptimizer)
    for name in ("seed", "steps_taken", "_noise_keys", "_record_noise_keys", "_stream"):
        assert getattr(HMC, name) is getattr(ChainOptimizer, name), name


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("named", [False, True])
def test_the_state_holds_each_parameters_key(named: bool, dtype: torch.dtype) -> None:
    """After a step, each sampled parameter's state holds its key: 0-d int64 on the CPU."""
    model = _model(dtype)
    opt = _hmc(model, named)
    assert not any(isinstance(k, torch.Tensor) for k in opt.state)  # none before a step
    _run(opt, model, 1, "closure", dtype)
    for index, (name, p) in enumerate(model.named_parameters()):
        key = opt.state[p]["noise_key"]
        assert key.dtype == torch.int64 and key.dim() == 0 and key.device.type == "cpu"
        expected = parameter_key(name if named else index)
        assert int(key) == key_to_int64(expected)
    # a loaded state keeps the keys' dtype (torch casts the rest to the parameter's)
    other = _hmc(_model(dtype), named)
    other.load_state_dict(copy.deepcopy(opt.state_dict()))
    for p, q in zip(model.parameters(), other.param_groups[0]["params"], strict=True):
        assert other.state[q]["noise_key"].dtype == torch.int64
        assert torch.equal(other.state[q]["noise_key"], opt.state[p]["noise_key"])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("how", ["closure", "loss_fn"])
@pytest.mark.parametrize("saved_named", [False, True])
def test_named_and_unnamed_resume_each_other_bit_for_bit(saved_named, how, dtype) -> None:
    """parameters() -> named_parameters() and the reverse: the same chain continues."""
    options = {"jitter": 0.2, "target_accept": 0.7, "mass": "adapt"}
    saved, values, reference = _saved_chain(saved_named, how, dtype, **options)
    for named in (saved_named, not saved_named):
        _assert_same(_resume(saved, values, named, how, dtype, **options), reference)


def test_the_stored_keys_are_what_makes_the_cross_resume_exact() -> None:
    """Without them a named optimizer keys a positional chain's momenta by name: others.

    (The reverse needs no keys: torch's ``load_state_dict`` gives an unnamed optimizer
    the saved groups' ``param_names``.)
    """
    dtype = torch.float64
    saved, values, reference = _saved_chain(False, "closure", dtype)
    resumed = _resume(_without_keys(saved), values, True, "closure", dtype)
    assert any(
        not torch.equal(p, q)
        for (_, ps), (_, qs) in zip(resumed, reference, strict=True)
        for p, q in zip(ps, qs, strict=True)
    )


@pytest.mark.parametrize("how", ["closure", "loss_fn"])
@pytest.mark.parametrize("named", [False, True])
def test_a_state_without_keys_loads_and_continues_as_before(named, how) -> None:
    """An older HMC checkpoint (no keys) keys the momenta by names or positions, as it did."""
    dtype = torch.float64
    options = {"target_accept": 0.8, "jitter": 0.1}
    saved, values, reference = _saved_chain(named, how, dtype, **options)
    old = _without_keys(saved)
    assert all(k == "hmc" for k in old["state"])  # nothing per parameter: no mass either
    _assert_same(_resume(old, values, named, how, dtype, **options), reference)
    # and it goes on storing them from its next step
    model = _model(dtype)
    model.load_state_dict(values)
    opt = _hmc(model, named, **options)
    opt.load_state_dict(old)
    _run(opt, model, 1, how, dtype)
    assert all("noise_key" in opt.state[p] for p in model.parameters())


def test_a_failed_first_step_records_no_key() -> None:
    """A step that raises changes nothing, the keys included; the retry is the same step."""
    dtype = torch.float64
    model = _model(dtype)
    opt = _hmc(model, named=True)
    reference = _run(opt, model, 2, "closure", dtype)

    model = _model(dtype)
    opt = _hmc(model, named=True)
    x, y = _data(dtype)
    calls = [0]

    def failing():
        calls[0] += 1
        opt.zero_grad()
        loss = nn.functional.binary_cross_entropy_with_logits(model(x).squeeze(-1), y)
        loss.backward()
        if calls[0] == 3:  # inside the trajectory, after the momenta were drawn
            raise RuntimeError("the closure failed")
        return loss

    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(RuntimeError, match="the closure failed"):
        opt.step(failing)
    assert opt.state_dict()["state"].keys() == before["state"].keys() == {"hmc"}
    assert not any(isinstance(k, torch.Tensor) for k in opt.state)
    _assert_same(_run(opt, model, 2, "closure", dtype), reference)


def test_invalid_saved_keys_and_chain_state_are_refused_before_loading() -> None:
    dtype = torch.float64
    saved, _, _ = _saved_chain(False, "closure", dtype)
    model = _model(dtype)
    opt = _hmc(model, named=False)
    bad = copy.deepcopy(saved)
    bad["state"][0]["noise_key"] = torch.tensor(1.5)
    with pytest.raises(ValueError, match=r"Invalid state_dict: 'noise_key' of parameter 0 is "):
        opt.load_state_dict(bad)
    bad = copy.deepcopy(saved)
    bad["param_groups"][0]["seed"] = -1
    with pytest.raises(ValueError, match=r"Invalid seed in param group 0: -1"):
        opt.load_state_dict(bad)
    bad = copy.deepcopy(saved)
    bad["param_groups"][0]["step"] = 2.5
    with pytest.raises(TypeError, match=r"Invalid step in param group 0: 2.5"):
        opt.load_state_dict(bad)
    assert opt.steps_taken == 0 and not opt.diagnostics  # nothing was loaded


def test_a_group_added_later_continues_the_chain() -> None:
    """A group added after some steps starts at the step counter and the seed (shared)."""
    model = _model(torch.float64)
    first, *rest = list(model.parameters())
    opt = HMC([first], lr=0.05, num_steps=2, num_data=N, seed=7)
    x, y = _data(torch.float64)

    def closure():
        opt.zero_grad()
        loss = nn.functional.binary_cross_entropy_with_logits(model(x).squeeze(-1), y)
        loss.backward()
        return loss

    opt.step(closure)
    opt.add_param_group({"params": rest})
    assert opt.param_groups[1]["step"] == opt.steps_taken == 1
    assert opt.param_groups[1]["seed"] == opt.seed == 7
    opt.step(closure)
    assert [g["step"] for g in opt.param_groups] == [2, 2]
    assert int(opt.state[first]["noise_key"]) == key_to_int64(parameter_key(0))
