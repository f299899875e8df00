"""Noise drawn on a worker thread during forward/backward is the noise drawn in the step.

``overlap_noise=True`` (the default) prefetches the next step's noise; whatever happens
between steps (schedules, temperature switched on and off, lr 0, a loaded state, a new
param group, a frozen parameter), the chain must be ``torch.equal`` to the one with
``overlap_noise=False``.
"""

import copy

import pytest
import torch
from samplers_under_test import SAMPLERS

import samplers_as_optim.core.keyed_normal as random_module  # where BLOCK is read
import samplers_as_optim.sgmcmc.step.chunked as chunked_update_module
import samplers_as_optim.sgmcmc.step.group_noise as group_noise_module


@pytest.fixture(autouse=True)
def prefetch_small_parameters(monkeypatch):
    """The models here are small: prefetch every parameter, as large ones are."""
    monkeypatch.setattr(group_noise_module, "PREFETCH_MIN_NUMEL", 1)


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 40), torch.nn.Tanh(), torch.nn.Linear(40, 3))


def run(case, overlap, *, foreach, events=False, device="cpu"):
    model = make_model().to(device)
    opt = case.cls(
        model.parameters(),
        lr=0.01,
        num_data=200,
        seed=7,
        foreach=foreach,
        overlap_noise=overlap,
        **case.kwargs,
    )
    generator = torch.Generator().manual_seed(3)
    for step in range(12):
        if events:
            group = opt.param_groups[0]
            if step == 3 and case.sgd_at_zero:
                group["temperature"] = 0.0  # the prefetched noise goes unused
            if step == 5:
                group["temperature"], group["lr"] = 1.0, 0.0  # a step of length zero
            if step == 6:
                group["lr"] = 0.03
            if step == 8:  # a state from elsewhere: the tags no longer match
                opt.load_state_dict(copy.deepcopy(opt.state_dict()))
            model[0].bias.requires_grad_(step != 9)  # frozen for one step
        x = torch.randn(16, 5, generator=generator).to(device)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()], opt


@pytest.mark.parametrize("case", SAMPLERS, ids=repr)
@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("events", [False, True])
def test_overlapped_noise_gives_the_same_chain(case, foreach, events):
    overlapped, opt = run(case, True, foreach=foreach, events=events)
    serial, _ = run(case, False, foreach=foreach, events=events)
    assert all(torch.equal(a, b) for a, b in zip(overlapped, serial, strict=True))
    assert opt._prefetcher is not None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("case", SAMPLERS, ids=repr)
@pytest.mark.parametrize("foreach", [False, True])
def test_noise_drawn_on_a_cuda_side_stream_gives_the_same_chain(case, foreach):
    overlapped, opt = run(case, True, foreach=foreach, events=True, device="cuda")
    serial, _ = run(case, False, foreach=foreach, events=True, device="cuda")
    assert all(torch.equal(a, b) for a, b in zip(overlapped, serial, strict=True))
    assert opt._prefetcher._side_streams  # the draws went to a side stream
    assert all(b.device.type == "cuda" for b in opt._prefetcher._buffers.values())


@pytest.mark.parametrize("case", SAMPLERS[:2], ids=repr)
def test_overlapped_noise_gives_the_same_chain_on_the_chunked_path(case, monkeypatch):
    monkeypatch.setattr(chunked_update_module, "CHUNK", 32)
    monkeypatch.setattr(random_module, "BLOCK", 32)
    overlapped, _ = run(case, True, foreach=False, events=True)
    serial, _ = run(case, False, foreach=False, events=True)
    assert all(torch.equal(a, b) for a, b in zip(overlapped, serial, strict=True))


def test_the_next_steps_noise_is_drawn_ahead_and_used():
    case = SAMPLERS[1]
    model = make_model()
    opt = case.cls(model.parameters(), lr=0.01, num_data=200, seed=7, **case.kwargs)
    model(torch.randn(4, 5)).pow(2).mean().backward()
    opt.step()
    prefetcher = opt._prefetcher
    prefetcher.wait()
    # one parameter-sized buffer per parameter, tagged for step 1
    assert len(prefetcher._buffers) == len(list(model.parameters()))
    taken = []
    original = prefetcher.take
    prefetcher.take = lambda request: taken.append(original(request)) or taken[-1]
    opt.step()
    assert len(taken) == 4 and all(t is not None for t in taken)


def test_no_noise_is_prefetched_at_temperature_zero():
    case = SAMPLERS[1]
    model = make_model()
    opt = case.cls(model.parameters(), lr=0.01, num_data=200, temperature=0.0, **case.kwargs)
    model(torch.randn(4, 5)).pow(2).mean().backward()
    opt.step()
    assert not opt._prefetcher._buffers


def test_overlap_noise_off_keeps_no_buffer():
    case = SAMPLERS[1]
    model = make_model()
    opt = case.cls(model.parameters(), lr=0.01, num_data=200, overlap_noise=False, **case.kwargs)
    model(torch.randn(4, 5)).pow(2).mean().backward()
    opt.step()
    assert opt._prefetcher is None
    assert copy.deepcopy(opt)._prefetcher is None  # the choice survives a copy


@pytest.mark.parametrize("case", SAMPLERS, ids=repr)
def test_overlap_noise_must_be_a_bool(case):
    model = make_model()
    with pytest.raises(TypeError, match=r"Invalid overlap_noise: 1 \(expected True or False\)"):
        case.cls(model.parameters(), lr=0.01, num_data=10, overlap_noise=1, **case.kwargs)


def test_small_parameters_draw_in_the_step(monkeypatch):
    """Handing small draws to the worker costs more than it saves: only large ones go."""
    monkeypatch.setattr(group_noise_module, "PREFETCH_MIN_NUMEL", 200)  # the 40 x 5 weight
    case = SAMPLERS[1]
    model = make_model()
    opt = case.cls(model.parameters(), lr=0.01, num_data=200, seed=7, **case.kwargs)
    model(torch.randn(4, 5)).pow(2).mean().backward()
    opt.step()
    opt._prefetcher.wait()
    assert [tuple(b.shape) for b in opt._prefetcher._buffers.values()] == [(40, 5)]
