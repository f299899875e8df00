"""``capturable=True``: a step a CUDA graph can capture, and a replay continues the chain.

A CUDA graph replays the kernels it recorded, with the arguments they had, on the
memory they had, and none of the step's Python. So a step is capturable when, once warm,
(1) it reads nothing back to the host, (2) every step launches the same operations with
the same non-tensor arguments, none of them a draw from a torch generator (whose seed a
replay would not move), and (3) it updates the state in place, the same tensors at every
step. Each is checked here on the CPU, with the law the chain samples, its exact resume
and its refusals; ``test_graph_replay_continues_the_eager_chain`` captures a real graph
where a GPU is present. The noise (``core/counter_normal``) is checked against a
reference written with Python integers, and for the properties a chain relies on.
"""

from __future__ import annotations

import copy
import io
import math

import numpy as np
import pytest
import torch
from linear_chains import correlated_gaussian, position_moments, sghmc_mode, sgld_mode
from test_stationary import assert_moments
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from samplers_as_optim import BAOA, PSGLD, SGHMC, SGLD, SGNHT, AdamWSGHMC
from samplers_as_optim.core import counter_normal
from samplers_as_optim.core.counter_normal import CounterLayout, counter_normal_, mix_step
from samplers_as_optim.core.keyed_normal import _splitmix64, derive_seed
from samplers_as_optim.sgmcmc.step.plan import GroupPlan, place_step_counter

CAPTURABLE = {"SGLD": (SGLD, {}), "SGHMC": (SGHMC, {"momentum": 0.9}), "BAOA": (BAOA, {})}
CAPTURABLE["SGNHT"] = (SGNHT, {"momentum": 0.9})
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

_MASK = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15


def reference_normal(seed: int, key: int, step: int, position: int, bits: int) -> float:
    """The stream's number, from its definition, in Python integers and floats."""
    base = _splitmix64(derive_seed(seed, counter_normal.DOMAIN, key) ^ _splitmix64(step))
    word = _splitmix64((base + position * _GAMMA) & _MASK)
    high, low = word >> (64 - bits), word & ((1 << bits) - 1)
    radius = math.sqrt(-2.0 * math.log((high + 0.5) * 2.0**-bits))
    return radius * math.cos(2.0 * math.pi * low * 2.0**-bits)


def draw(keys, numels, step, *, dtype=torch.float64, offsets=None, seed=11):
    layout = CounterLayout(seed, keys, numels, offsets=offsets, device=torch.device("cpu"))
    out = torch.empty(layout.total, dtype=dtype)
    counter_normal_(out, layout, torch.tensor(step))
    return list(out.split(numels))


# ---------------------------------------------------------------------- the stream


def test_the_step_hash_is_splitmix64():
    for step in (0, 1, 2**40 + 3, 2**63 - 1):
        word = int(mix_step(torch.tensor(step)))
        assert word & _MASK == _splitmix64(step)


@pytest.mark.parametrize("dtype, bits", [(torch.float64, 32), (torch.float32, 24)])
def test_the_numbers_are_the_reference_numbers(dtype, bits):
    keys, numels, offsets = [5, 2**64 - 1, 9], [3, 0, 4], [0, 0, 10]
    drawn = draw(keys, numels, 17, dtype=dtype, offsets=offsets)
    for key, numel, offset, noise in zip(keys, numels, offsets, drawn, strict=True):
        expected = [reference_normal(11, key, 17, offset + p, bits) for p in range(numel)]
        tolerance = 1e-12 if dtype == torch.float64 else 2e-6
        np.testing.assert_allclose(noise.tolist(), expected, rtol=tolerance, atol=tolerance)


def test_a_tensors_noise_depends_on_nothing_but_its_key_step_and_position(monkeypatch):
    alone = draw([7], [1000], 3)[0]
    among = draw([1, 7, 2], [13, 1000, 5], 3)[1]
    assert torch.equal(alone, among)
    whole = draw([7], [1000], 3)[0]
    part = draw([7], [300], 3, offsets=[400])[0]  # a share: elements 400..699
    assert torch.equal(part, whole[400:700])
    monkeypatch.setattr(counter_normal, "CHUNK", 7)  # chunks cut through the tensors
    assert torch.equal(draw([1, 7, 2], [13, 1000, 5], 3)[1], alone)
    assert not torch.equal(draw([7], [1000], 4)[0], alone)
    assert not torch.equal(draw([8], [1000], 3)[0], alone)
    assert not torch.equal(draw([7], [1000], 3, seed=12)[0], alone)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_numbers_are_independent_standard_normals(dtype):
    n = 2**18
    a, b = draw([3, 4], [n, n], 0, dtype=dtype)
    later = draw([3], [n], 1, dtype=dtype)[0]
    x = a.double()
    z = 5.0  # standard errors: 1 - 6e-7 each way
    assert abs(x.mean()) < z * math.sqrt(1 / n)
    assert abs(x.var() - 1) < z * math.sqrt(2 / n)
    assert abs(x.pow(3).mean()) < z * math.sqrt(15 / n)
    assert abs(x.pow(4).mean() - 3) < z * math.sqrt(96 / n)
    tail = (x.abs() > 3).double().mean()
    p = math.erfc(3 / math.sqrt(2))
    assert abs(tail - p) < z * math.sqrt(p * (1 - p) / n)
    for other in (b.double(), later.double(), x.roll(1)):  # keys, steps, neighbours
        assert abs((x * other).mean()) < z * math.sqrt(1 / n)


def test_the_compiled_draw_is_the_eager_draw():
    """Bit for bit, with a tail past the last full vector (fused, Inductor got it wrong)."""
    layout = CounterLayout(3, [1, 2, 3, 4], [8192, 128, 1280, 10], device=torch.device("cpu"))
    step = torch.tensor(5)
    eager = counter_normal_(torch.empty(layout.total), layout, step)
    torch._dynamo.reset()
    compiled = torch.compile(counter_normal_, fullgraph=True)(
        torch.empty(layout.total), layout, step
    )
    torch._dynamo.reset()
    assert torch.equal(compiled, eager)


# ---------------------------------------------------------------------- the optimizer


def make(name, *, seed=3, device="cpu", **options):
    cls, hyper = CAPTURABLE[name]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).to(device)
    options = {"capturable": True, "nonfinite": "skip", **options}
    opt = cls(model.parameters(), lr=1e-3, num_data=100, seed=seed, **hyper, **options)
    return model, opt


def iterate(model, opt, steps, *, seed=0):
    generator = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    for _ in range(steps):
        x = torch.randn(16, 4, generator=generator).to(device)
        opt.zero_grad(set_to_none=False)
        model(x).pow(2).mean().backward()
        opt.step()


class HostReads(TorchFunctionMode):
    """Raises at any read of a tensor's value into Python."""

    READS = frozenset({"item", "__bool__", "__float__", "__int__", "__index__", "tolist"})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.READS:
            raise AssertionError(f"the step read a value back: {func.__name__}")
        return func(*args, **(kwargs or {}))


def describe(value):
    """A launch's argument: a tensor (or generator) by kind, anything else by value."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, tuple(value.shape))
    if isinstance(value, torch.Generator):
        return "generator"
    if isinstance(value, list | tuple):
        return tuple(map(describe, value))
    return repr(value)


class Launches(TorchDispatchMode):
    """The operations a step runs, with their non-tensor arguments."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func).startswith("profiler."):  # (torch.optim's record_function)
            return func(*args, **(kwargs or {}))
        described = describe([*args, *(kwargs or {}).values()])
        self.ops.append((str(func), described, "generator" in repr(described)))
        return func(*args, **(kwargs or {}))


def reachable(opt):
    """Every tensor the optimizer keeps (groups and state), by identity, and the rest."""
    tensors, plain = [], []
    for group in opt.param_groups:
        for name, value in group.items():
            if name != "params":
                (tensors if isinstance(value, torch.Tensor) else plain).append((name, value))
    for param, state in opt.state.items():
        for name, value in state.items():
            entry = (id(param), name, value)
            (tensors if isinstance(value, torch.Tensor) else plain).append(entry)
    return [(t[:-1], id(t[-1]), t[-1].data_ptr()) for t in tensors], plain


def assert_warm_steps_capturable(opt):
    kept = reachable(opt)
    logs = []
    for _ in range(3):
        with HostReads(), Launches() as launches:
            opt.step()
        logs.append(launches.ops)
    assert logs[0] == logs[1] == logs[2]
    assert not any(uses_generator for *_, uses_generator in logs[0])
    assert reachable(opt) == kept  # the same tensors, written in place


@pytest.mark.parametrize("foreach", [None, True], ids=["default", "foreach"])
@pytest.mark.parametrize("name", sorted(CAPTURABLE))
def test_a_warm_step_reads_nothing_and_repeats_its_launches_in_place(name, foreach):
    model, opt = make(name, foreach=foreach)
    iterate(model, opt, 3)  # warm: the state, the plan, the keys
    assert_warm_steps_capturable(opt)
    assert opt.param_groups[0]["step"].tolist() == 6


def test_a_bfloat16_models_step_through_its_masters_is_capturable():
    model, opt = make("SGHMC")
    model.to(torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        opt.zero_grad(set_to_none=False)
        batch = torch.randn(16, 4, generator=generator, dtype=torch.bfloat16)
        model(batch).float().pow(2).mean().backward()
        opt.step()
    assert all(state["master_param"].dtype == torch.float32 for state in opt.state.values())
    assert_warm_steps_capturable(opt)


def test_the_default_step_is_not_capturable_and_the_check_says_so():
    """The checks above fail on the default step: its noise seeds a generator per step."""
    model, opt = make("SGHMC", capturable=False)
    iterate(model, opt, 3)
    kept = reachable(opt)
    with Launches() as launches:
        opt.step()
    assert any(uses_generator for *_, uses_generator in launches.ops)
    assert reachable(opt) != kept  # the step counter, a Python int, moved


def test_a_held_state_dict_keeps_the_counters_it_was_taken_at():
    model, opt = make("SGHMC")
    iterate(model, opt, 3)
    held = opt.state_dict()
    iterate(model, opt, 2)
    assert int(held["param_groups"][0]["step"]) == 3
    assert int(opt.state_dict()["param_groups"][0]["step"]) == 5


def test_the_counters_follow_the_parameters_device():
    """A counter (and the skip count) loaded or left on another device is moved."""
    param = nn.Parameter(torch.zeros(3, device="meta"))
    group = {"params": [param], "step": torch.tensor(4), "skipped_steps": torch.tensor(1)}
    place_step_counter(group, capturable=True)
    assert group["step"].device.type == group["skipped_steps"].device.type == "meta"
    moved = {"params": [param], "step": torch.tensor(4), "seed": 0, "lr": 0.1, "temperature": 1.0}
    assert not GroupPlan(moved, ()).holds(moved)  # (its counter is not on the parameters')
    placed = {**moved, "step": group["step"]}
    assert GroupPlan(placed, ()).holds(placed)


def test_the_counter_is_a_device_tensor_advanced_in_place():
    model, opt = make("SGHMC")
    assert opt.param_groups[0]["step"] == 0  # an int until the first step plans the group
    iterate(model, opt, 1)
    counter = opt.param_groups[0]["step"]
    assert counter.dtype == torch.int64 and counter.dim() == 0
    iterate(model, opt, 4)
    assert opt.param_groups[0]["step"] is counter and int(counter) == 5
    assert opt.steps_taken == 5


def test_a_state_dict_resumes_the_chain_bit_for_bit():
    model, opt = make("SGHMC")
    iterate(model, opt, 5)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
    iterate(model, opt, 5, seed=1)
    buffer.seek(0)
    saved = torch.load(buffer)
    resumed_model, resumed = make("SGHMC", seed=99)  # the seed comes from the state
    resumed_model.load_state_dict(saved["model"])
    resumed.load_state_dict(saved["opt"])
    iterate(resumed_model, resumed, 5, seed=1)
    for p, q in zip(model.parameters(), resumed_model.parameters(), strict=True):
        assert torch.equal(p, q)
    assert int(resumed.param_groups[0]["step"]) == 10


def test_a_state_moves_between_capturable_and_not():
    """``capturable`` is the optimizer's, as ``nonfinite``: a state loads either way."""
    model, opt = make("SGHMC")
    iterate(model, opt, 4)
    plain_model, plain = make("SGHMC", capturable=False, nonfinite="raise")
    plain.load_state_dict(opt.state_dict())
    iterate(plain_model, plain, 1)
    assert plain.param_groups[0]["step"] == 5 and type(plain.param_groups[0]["step"]) is int
    model, opt = make("SGHMC")
    opt.load_state_dict(plain.state_dict())
    iterate(model, opt, 1)
    assert isinstance(opt.param_groups[0]["step"], torch.Tensor)
    assert int(opt.param_groups[0]["step"]) == 6


@pytest.mark.parametrize("cls", [SGHMC, PSGLD, AdamWSGHMC])
def test_a_compiled_step_leaves_the_optimizer_as_it_was(cls):
    """``torch.compile`` writes ``capturable=True`` into every group it traces; ignored."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = cls(model.parameters(), lr=1e-3, num_data=10, seed=1, nonfinite="skip")
    model(torch.randn(3, 4)).sum().backward()
    torch._dynamo.reset()
    torch.compile(opt.step, backend="eager")()  # (TorchDynamo's doing, whatever the backend)
    torch._dynamo.reset()
    opt.step()  # eager, after it: neither refused nor switched to the capturable stream
    assert type(opt.param_groups[0]["step"]) is int and opt.param_groups[0]["step"] == 2
    assert not opt._capturable


def test_a_deep_copy_continues_the_same_chain():
    model, opt = make("SGLD")
    iterate(model, opt, 2)
    twin_model, twin = copy.deepcopy((model, opt))
    iterate(model, opt, 3, seed=5)
    iterate(twin_model, twin, 3, seed=5)
    for p, q in zip(model.parameters(), twin_model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_at_temperature_zero_it_is_sgd_bit_for_bit():
    model, opt = make("SGHMC", temperature=0.0)
    twin = copy.deepcopy(model)
    sgd = torch.optim.SGD(twin.parameters(), lr=1e-3, momentum=0.9)
    iterate(model, opt, 5)
    iterate(twin, sgd, 5)
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)


def test_a_non_finite_gradient_skips_the_step_on_the_device():
    model, opt = make("SGHMC")
    iterate(model, opt, 2)
    before = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad.fill_(math.nan)
    opt.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    assert int(opt.param_groups[0]["skipped_steps"]) == 1
    assert int(opt.param_groups[0]["step"]) == 3


@pytest.mark.parametrize(
    "options, message",
    [
        (
            {"nonfinite": "raise"},
            "Invalid capturable in param group 0: True with "
            "nonfinite='raise' (expected nonfinite='skip': refusing a step reads",
        ),
        (
            {"fused": True},
            "Invalid capturable in param group 0: True with fused=True "
            "(expected fused=None or False",
        ),
        ({"capturable": 1}, "Invalid capturable: 1 (expected"),
        (
            {"temperature": torch.tensor(1.0)},
            "Invalid capturable in param group 0: True with a tensor temperature (tensor(1.); "
            "expected a Python number: a tensor hyperparameter is checked at every step",
        ),
    ],
)
def test_what_a_capturable_step_cannot_take_is_refused(options, message):
    with pytest.raises((ValueError, TypeError)) as error:
        make("SGHMC", **options)
    assert str(error.value).startswith(message)


def test_a_group_on_two_devices_is_refused():
    params = [nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2, device="meta"))]
    with pytest.raises(ValueError, match=r"True with parameters on cpu, meta \(expected one"):
        SGLD(params, lr=1e-3, num_data=10, capturable=True, nonfinite="skip")


@pytest.mark.parametrize("step", [torch.tensor(-1), torch.tensor(2.0), torch.tensor([1, 2])])
def test_an_invalid_counter_is_refused_when_the_group_is_planned(step):
    model, opt = make("SGHMC")
    iterate(model, opt, 1)
    opt.param_groups[0]["step"] = step
    with pytest.raises(ValueError, match=r"Invalid step in param group 0: tensor\("):
        opt.step()


@pytest.mark.parametrize("cls", [PSGLD, AdamWSGHMC])
def test_samplers_with_host_counts_refuse_it(cls):
    with pytest.raises(ValueError) as error:
        cls([nn.Parameter(torch.zeros(2))], num_data=10, capturable=True, nonfinite="skip")
    assert str(error.value).startswith(
        f"Invalid capturable: True (expected False: {cls.__name__} counts its steps in Python"
    )


# ---------------------------------------------------------------------- the law


D, N, K = 10, 100, 20_000
MEAN, SIGMA = correlated_gaussian(D)
PRECISION = np.linalg.inv(SIGMA)
START = np.full(D, 2.0)


@pytest.mark.slow
@pytest.mark.parametrize(
    "cls, mode, hyper, steps",
    [(SGLD, sgld_mode, {"lr": 1.0}, 1600), (SGHMC, sghmc_mode, {"lr": 1.0, "momentum": 0.9}, 400)],
    ids=["sgld", "sghmc"],
)
def test_the_capturable_chain_has_the_exact_law(cls, mode, hyper, steps):
    """As ``test_stationary``: K chains of a linear chain, against its exact law."""
    theta = nn.Parameter(torch.tensor(MEAN + START, dtype=torch.float32).repeat(K, 1))
    precision = torch.tensor(PRECISION, dtype=torch.float32)
    mean = torch.tensor(MEAN, dtype=torch.float32)
    opt = cls([theta], num_data=N, seed=5, capturable=True, nonfinite="skip", **hyper)
    for _ in range(steps):
        theta.grad = (theta.detach() - mean) @ precision / N
        opt.step()
    offset, covariance, _ = position_moments(
        PRECISION, mode, start_offset=START, steps=steps, num_data=N, temperature=1.0, **hyper
    )
    assert_moments(theta.detach().double().numpy(), offset, covariance)


# ---------------------------------------------------------------------- compiled, captured


def test_compiled_it_is_one_graph_for_every_step():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model, opt = make("SGHMC")
    iterate(model, opt, 1)
    explained = torch._dynamo.explain(opt.step)()
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    torch._dynamo.reset()
    counters.clear()
    step = torch.compile(opt.step)
    generator = torch.Generator().manual_seed(0)
    for i in range(6):
        opt.zero_grad(set_to_none=False)
        model(torch.randn(16, 4, generator=generator)).pow(2).mean().backward()
        step()
        if i == 1:
            graphs = counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == graphs
    torch._dynamo.reset()


def test_a_compiled_iteration_continues_the_eager_chain():
    """Forward, backward and step compiled as one function: the eager chain, rounded.

    (Fused by Inductor, the draw's last elements went wrong: 0.02 after one step here.)
    """
    (model, opt), (twin, twin_opt) = make("SGHMC"), make("SGHMC")
    generator = torch.Generator().manual_seed(0)

    def iteration(m, o, x):
        o.zero_grad(set_to_none=False)
        m(x).pow(2).mean().backward()
        o.step()

    torch._dynamo.reset()
    compiled = torch.compile(iteration)
    for _ in range(4):
        x = torch.randn(16, 4, generator=generator)
        iteration(model, opt, x)
        compiled(twin, twin_opt, x)
    torch._dynamo.reset()
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        # a few float32 roundings that compiling reorders, grown over 4 steps
        torch.testing.assert_close(p, q, rtol=0, atol=1e-5)


@CUDA
@pytest.mark.parametrize("name", ["SGHMC", "SGLD"])
def test_graph_replay_continues_the_eager_chain(name):
    """Capture forward, backward and step; each replay is the next eager step."""
    model, opt = make(name, device="cuda")
    eager_model, eager = copy.deepcopy((model, opt))
    x = torch.randn(128, 4, device="cuda")
    static = x.clone()

    def loss(m, batch):
        return m(batch).pow(2).mean()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up on a side stream, as torch's recipe does
        for _ in range(3):
            opt.zero_grad(set_to_none=False)
            loss(model, static).backward()
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=False)
    with torch.cuda.graph(graph):
        loss(model, static).backward()
        opt.step()
    for _ in range(5):
        graph.replay()
    for _ in range(3 + 1 + 5):  # warm-up, the captured step (it ran once), the replays
        eager.zero_grad(set_to_none=False)
        loss(eager_model, x).backward()
        eager.step()
    torch.cuda.synchronize()
    assert int(opt.param_groups[0]["step"]) == int(eager.param_groups[0]["step"]) == 9
    for p, q in zip(model.parameters(), eager_model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@CUDA
def test_reduce_overhead_compile_continues_the_chain():
    model, opt = make("SGHMC", device="cuda")
    eager_model, eager = copy.deepcopy((model, opt))
    x = torch.randn(128, 4, device="cuda")

    def train_step(m, o):
        o.zero_grad(set_to_none=False)
        m(x).pow(2).mean().backward()
        o.step()

    compiled = torch.compile(train_step, mode="reduce-overhead")
    for _ in range(8):
        compiled(model, opt)
        train_step(eager_model, eager)
    torch.cuda.synchronize()
    assert int(opt.param_groups[0]["step"]) == 8
    for p, q in zip(model.parameters(), eager_model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
