"""``torch.compile(opt.step)``: one graph, the eager numbers, and the non-finite policies.

A sampler's step is one graph for TorchDynamo, as ``torch.optim.SGD``'s is, when built
with ``nonfinite="skip"``: the keyed noise draw is one custom op
(``samplers_as_optim.core.noise_op``) and nothing is read back to Python. The compiled step
draws the eager step's noise bit for bit; its arithmetic differs from the eager step's
only by the roundings that compiling reorders or fuses, which is measured against what
compiling ``torch.optim.SGD`` does to SGD's own step (the same model, gradients and
state). With the default ``nonfinite="raise"`` the refusal keeps its guarantee under
compile too (at the price of a graph break).
"""

import copy

import pytest
import torch
from samplers_under_test import SAMPLERS
from torch import nn
from torch._dynamo.utils import counters

from samplers_as_optim import SGHMC
from samplers_as_optim.core.noise_op import COMPILED_DRAW, compiled_draw
from samplers_as_optim.core.streams import NoiseStream

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
one_graph = pytest.mark.skipif(
    not COMPILED_DRAW, reason="one graph needs torch >= 2.13 (see _noise_op)"
)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def make_model(device="cpu"):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 64), nn.Tanh(), nn.Linear(64, 1)).to(device)


def backward(model, generator, scale=1.0):
    x = torch.randn(8, 20, generator=generator).to(next(model.parameters()).device)
    model.zero_grad()
    (model(x).pow(2).mean() * scale).backward()


def sampler(case, params, **kwargs):
    options = {"lr": 1e-2, "num_data": 100, "seed": 3, **case.kwargs, **kwargs}
    return case.cls(params, **options)


@one_graph
@pytest.mark.parametrize("case", SAMPLERS, ids=repr)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_step_is_one_graph_without_a_break(case, temperature):
    if temperature == 0 and not case.sgd_at_zero:
        pytest.skip("SGNHT requires temperature > 0")
    model = make_model()
    opt = sampler(case, model.parameters(), temperature=temperature, nonfinite="skip")
    backward(model, torch.Generator().manual_seed(0))
    explained = torch._dynamo.explain(opt.step)()
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), [
        reason.reason for reason in explained.break_reasons
    ]
    # what torch.optim.SGD gives, for reference
    sgd = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    reference = torch._dynamo.explain(sgd.step)()
    assert (reference.graph_count, reference.graph_break_count) == (1, 0)


def worst_deviation(make, device, *, warm):
    """Largest |compiled - eager| of one step from one state, in rounding units.

    The unit of a parameter element is ``eps * (|theta| + |theta' - theta|)``: the size of
    one rounding of the step's result or of the update itself.
    """
    model = make_model(device)
    opt = make(model.parameters())
    generator = torch.Generator().manual_seed(1)
    for _ in range(warm):
        backward(model, generator)
        opt.step()
    backward(model, generator)
    twin, twin_opt = copy.deepcopy((model, opt))
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        q.grad = p.grad.clone()
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    torch.compile(twin_opt.step)()
    worst = 0.0
    for p, q, old in zip(model.parameters(), twin.parameters(), before, strict=True):
        unit = torch.finfo(p.dtype).eps * (old.abs() + (p.detach() - old).abs())
        worst = max(
            worst,
            ((p.detach() - q.detach()).abs() / unit.clamp_min(torch.finfo(p.dtype).tiny)).max(),
        )
    return float(worst)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", SAMPLERS, ids=repr)
def test_compiled_equals_eager_within_what_compiling_sgd_rounds(case, device):
    sgd = worst_deviation(lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9), device, warm=3)
    ours = worst_deviation(lambda p: sampler(case, p, nonfinite="skip"), device, warm=3)
    # Compiling SGD moves its result by `sgd` units (fusing b = mu b + g and theta - lr b).
    # A sampler's step adds two roundings compiling may fuse the same way (the noise term
    # added to the buffer, and -lr * d rounded before the add; SGNHT's thermostat enters
    # the buffer's one multiply), so three times SGD's deviation bounds it. The noise
    # itself is the eager noise, bit for bit (below).
    assert ours <= 3 * max(sgd, 1.0)


@one_graph
@pytest.mark.parametrize("device", DEVICES)
def test_compiled_sghmc_at_temperature_zero_is_compiled_sgd(device):
    trajectories = []
    for make in (
        lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, weight_decay=1e-3),
        lambda p: SGHMC(
            p,
            lr=1e-2,
            momentum=0.9,
            weight_decay=1e-3,
            num_data=10,
            temperature=0.0,
            nonfinite="skip",
        ),
    ):
        torch._dynamo.reset()
        model = make_model(device)
        step = torch.compile(make(model.parameters()).step)
        generator = torch.Generator().manual_seed(2)
        for _ in range(5):
            backward(model, generator)
            step()
        trajectories.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*trajectories, strict=True))


@one_graph
@pytest.mark.parametrize("device", DEVICES)
def test_the_compiled_draw_is_the_eager_draw(device):
    stream = NoiseStream(2**64 - 5)  # a seed above 2**63 crosses as a negative int64
    like = torch.empty(3, 7, device=device)
    key = 2**63 + 11
    cases = [
        {"shard": None, "layout": None},
        {"shard": 1, "layout": None},
        {"shard": None, "layout": (5, 40)},
    ]
    for options in cases:
        eager = stream.draw(like, step=4, key=key, **options)
        through_op = compiled_draw(like, seed=stream.seed, step=4, key=key, **options)
        compiled = torch.compile(
            lambda t, options=options: stream.draw(t, step=4, key=key, **options),
            fullgraph=True,
        )(like)
        assert torch.equal(eager, through_op)
        assert torch.equal(eager, compiled)


@one_graph
def test_one_compiled_graph_serves_every_step():
    model = make_model()
    opt = SGHMC(model.parameters(), lr=1e-2, momentum=0.9, num_data=100, nonfinite="skip")
    step = torch.compile(opt.step)
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):  # the state is created, then the step counter becomes symbolic
        backward(model, generator)
        step()
    compiled = counters["stats"]["unique_graphs"]
    for _ in range(8):
        backward(model, generator)
        step()
    assert counters["stats"]["unique_graphs"] == compiled <= 3
    assert opt.param_groups[0]["step"] == 11


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("case", SAMPLERS, ids=repr)
def test_skip_makes_a_non_finite_step_a_no_op(case, compiled):
    model = make_model()
    opt = sampler(case, model.parameters(), nonfinite="skip")
    step = torch.compile(opt.step) if compiled else opt.step
    generator = torch.Generator().manual_seed(0)
    for _ in range(2):
        backward(model, generator)
        step()
    params = [p.detach().clone() for p in model.parameters()]
    state = copy.deepcopy(opt.state_dict()["state"])
    backward(model, generator, scale=float("nan"))
    step()
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters(), strict=True))
    for index, entries in opt.state_dict()["state"].items():
        for key, value in entries.items():
            assert torch.equal(value, state[index][key]) if torch.is_tensor(value) else True
    group = opt.param_groups[0]
    assert group["step"] == 3 and int(group["skipped_steps"]) == 1
    backward(model, generator)
    step()
    assert int(group["skipped_steps"]) == 1
    assert not all(torch.equal(a, b) for a, b in zip(params, model.parameters(), strict=True))


@pytest.mark.parametrize("case", SAMPLERS, ids=repr)
def test_skip_without_non_finite_gradients_is_the_default_chain(case):
    chains = []
    for policy in ("raise", "skip"):
        model = make_model()
        opt = sampler(case, model.parameters(), nonfinite=policy)
        generator = torch.Generator().manual_seed(0)
        for _ in range(4):
            backward(model, generator)
            opt.step()
        chains.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*chains, strict=True))


def test_skip_on_the_first_step_leaves_no_momentum():
    """A skipped first step writes zeros: the next step is then the first step's update."""
    model, twin = make_model(), make_model()
    kwargs = {"lr": 1e-2, "momentum": 0.9, "num_data": 100, "seed": 3}
    skipping = SGHMC(model.parameters(), nonfinite="skip", **kwargs)
    fresh = SGHMC(twin.parameters(), **kwargs)
    backward(model, torch.Generator().manual_seed(0), scale=float("inf"))
    skipping.step()
    fresh.param_groups[0]["step"] = 1  # the skipped step consumed step 0's noise
    for net, opt in ((model, skipping), (twin, fresh)):
        backward(net, torch.Generator().manual_seed(1))
        opt.step()
    assert all(
        torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters(), strict=True)
    )


def test_the_default_still_refuses_under_compile():
    model = make_model()
    opt = SGHMC(model.parameters(), lr=1e-2, momentum=0.9, num_data=100)
    step = torch.compile(opt.step)
    generator = torch.Generator().manual_seed(0)
    backward(model, generator)
    step()
    params = [p.detach().clone() for p in model.parameters()]
    backward(model, generator, scale=float("nan"))
    with pytest.raises(FloatingPointError, match="refused step 2: non-finite gradient"):
        step()
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters(), strict=True))


def test_skipped_steps_survive_a_state_dict_round_trip():
    model = make_model()
    opt = SGHMC(model.parameters(), lr=1e-2, momentum=0.9, num_data=100, nonfinite="skip")
    backward(model, torch.Generator().manual_seed(0), scale=float("nan"))
    opt.step()
    twin = SGHMC(make_model().parameters(), lr=1e-2, momentum=0.9, num_data=100)
    twin.load_state_dict(opt.state_dict())
    assert int(twin.param_groups[0]["skipped_steps"]) == 1
    assert copy.deepcopy(opt)._nonfinite == "skip"


@pytest.mark.parametrize("case", SAMPLERS, ids=repr)
def test_nonfinite_must_be_raise_or_skip(case):
    with pytest.raises(
        ValueError, match=r"Invalid nonfinite: 'ignore' \(expected one of 'raise', 'skip'\)"
    ):
        sampler(case, make_model().parameters(), nonfinite="ignore")


@one_graph
def test_noise_drawn_ahead_under_compile_gives_the_same_chain(monkeypatch):
    """overlap_noise under compile: the op hands step + 1's draw to the worker thread."""
    import samplers_as_optim.core.noise_op as noise_op
    import samplers_as_optim.sgmcmc.step.group_noise as group_noise_module

    monkeypatch.setattr(group_noise_module, "PREFETCH_MIN_NUMEL", 1)  # small model: all ahead
    chains = []
    for overlap in (True, False):
        torch._dynamo.reset()
        noise_op._AHEAD.clear()
        model = make_model()
        opt = SGHMC(
            model.parameters(),
            lr=1e-2,
            momentum=0.9,
            num_data=100,
            seed=4,
            nonfinite="skip",
            overlap_noise=overlap,
        )
        step = torch.compile(opt.step)
        generator = torch.Generator().manual_seed(0)
        for index in range(6):
            opt.param_groups[0]["lr"] = 0.0 if index == 3 else 1e-2  # a step without noise
            backward(model, generator)
            step()
        assert bool(noise_op._AHEAD) == overlap  # the next step's draws are pending
        chains.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*chains, strict=True))
