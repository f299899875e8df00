"""The CPU chunked update is the whole-tensor update, bit for bit.

On the CPU without foreach, tensors larger than ``CHUNK`` elements are updated chunk by
chunk (kernel on views, each chunk's noise drawn into a scratch chunk from its block's
generator). These tests shrink ``CHUNK`` and the noise's ``BLOCK`` together so that
small tensors take that path, with short last chunks.
"""

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import samplers_as_optim.core.keyed_normal as random_module  # where BLOCK is read
import samplers_as_optim.sgmcmc.step.chunked as chunked_update_module
from samplers_as_optim import SGHMC, SGLD, SGNHT, transforms
from samplers_as_optim.core.streams import NoiseStream, block_bounds

SIZES = [(5,), (64,), (65,), (79,), (80,), (7, 50), (1000,), (3, 4, 17)]


def run(cls, chunk, monkeypatch, *, dtype=torch.float32, steps=4, **kwargs):
    monkeypatch.setattr(chunked_update_module, "CHUNK", chunk)  # chunked above this size
    monkeypatch.setattr(random_module, "BLOCK", 32)  # in blocks of 32: the same noise
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(size, dtype=dtype)) for size in SIZES]
    opt = cls(params, num_data=100, foreach=False, seed=3, **kwargs)
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator, dtype=dtype)
        opt.step()
    return params, opt


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize(
    ("cls", "kwargs"),
    [
        (SGLD, {"lr": 0.01}),
        (SGHMC, {"lr": 0.01, "momentum": 0.9, "weight_decay": 1e-3}),
        (SGHMC, {"lr": 0.01, "momentum": 0.9, "temperature": 0.0, "nesterov": True}),
        (SGHMC, {"lr": 0.01, "momentum": 0.5, "maximize": True}),
    ],
)
def test_chunked_update_equals_whole_tensor_update(cls, kwargs, dtype, monkeypatch):
    whole, whole_opt = run(cls, 10**9, monkeypatch, dtype=dtype, **kwargs)
    chunked, chunked_opt = run(cls, 32, monkeypatch, dtype=dtype, **kwargs)
    for a, b in zip(whole, chunked, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(whole, chunked, strict=True):
        assert whole_opt.state[a].keys() == chunked_opt.state[b].keys()
        for key, value in whole_opt.state[a].items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, chunked_opt.state[b][key])
            else:  # the learning rate recorded with a momentum buffer
                assert value == chunked_opt.state[b][key]


def test_chunked_sghmc_at_zero_temperature_is_sgd(monkeypatch):
    chunked, _ = run(SGHMC, 32, monkeypatch, lr=0.05, momentum=0.9, temperature=0.0, dampening=0.1)
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(size)) for size in SIZES]
    sgd = torch.optim.SGD(params, lr=0.05, momentum=0.9, dampening=0.1, foreach=False)
    generator = torch.Generator().manual_seed(1)
    for _ in range(4):
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator)
        sgd.step()
    assert all(torch.equal(a, b) for a, b in zip(params, chunked, strict=True))


def test_chunked_optimizer_equals_the_transform(monkeypatch):
    """The transform draws whole tensors; the chunked Optimizer draws the same numbers."""
    chunked, _ = run(SGHMC, 32, monkeypatch, lr=0.01, momentum=0.9, steps=3)
    assert random_module.BLOCK == 32
    torch.manual_seed(0)
    params = [torch.randn(size) for size in SIZES]
    tx = transforms.sghmc(0.01, momentum=0.9, num_data=100, seed=3, foreach=False)
    state = tx.init(params)
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        grads = [torch.randn(p.shape, generator=generator) for p in params]
        updates, state = tx.update(grads, state, params=params, inplace=False)
        params = [p + u for p, u in zip(params, updates, strict=True)]
    assert all(torch.equal(a, b) for a, b in zip(params, chunked, strict=True))


def test_sgnht_is_never_chunked(monkeypatch):
    """Its thermostat reduces over a whole tensor; with or without CHUNK the same chain."""
    whole, _ = run(SGNHT, 10**9, monkeypatch, lr=0.01)
    small, _ = run(SGNHT, 32, monkeypatch, lr=0.01)
    assert all(torch.equal(a, b) for a, b in zip(whole, small, strict=True))


@given(st.integers(0, 300_000))
def test_block_bounds_cover_in_order_in_blocks_of_block(numel):
    bounds = block_bounds(numel)
    assert [start for start, _ in bounds] == list(range(0, numel, random_module.BLOCK))
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
    assert all(0 < stop - start <= random_module.BLOCK for start, stop in bounds)
    assert not bounds or bounds[-1][1] == numel


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_a_block_drawn_into_a_scratch_view_equals_the_streams_draw(dtype, monkeypatch):
    """What the chunked path relies on: normal_ on a view of scratch equals randn."""
    monkeypatch.setattr(random_module, "BLOCK", 64)
    like = torch.empty(4099, dtype=dtype)
    stream = NoiseStream(9)
    whole = stream.draw(like, step=2, key=5)
    scratch = torch.empty(64 + 15, dtype=dtype)
    parts = [
        scratch[: b - a]
        .normal_(generator=stream.generator(like.device, step=2, key=5, block=i))
        .clone()
        for i, (a, b) in enumerate(block_bounds(4099))
    ]
    assert torch.equal(whole, torch.cat(parts))


@pytest.mark.parametrize(("start", "stop"), [(0, 2), (2, 5), (1, 3), (4, 5), (0, 5)])
def test_a_share_of_a_tensor_draws_its_part_of_the_whole_tensors_noise(start, stop, monkeypatch):
    """ParallelEnsemble over ranks: rows [start, stop) of a [5, 9] tensor, blocks of 7."""
    monkeypatch.setattr(random_module, "BLOCK", 7)
    stream = NoiseStream(3)
    whole = stream.draw(torch.empty(5, 9), step=2, key=11)
    part = stream.draw(torch.empty(stop - start, 9), step=2, key=11, layout=(start * 9, 45))
    assert torch.equal(part, whole[start:stop])


def test_a_share_outside_its_tensor_is_an_error():
    with pytest.raises(ValueError, match=r"Invalid layout: \(40, 45\) for 18 elements"):
        NoiseStream(3).draw(torch.empty(2, 9), step=0, key=1, layout=(40, 45))


def test_block_bounds_of_an_explicit_size():
    assert block_bounds(10, 4) == [(0, 4), (4, 8), (8, 10)]
