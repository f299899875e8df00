"""``SampleCollector(..., optimizer=sampler)`` warns once when it records a sample while
the sampler's sampling preconditioner is still adapting (issue #36).

PSGLD and AdamWSGHMC follow the optimizer's second moment for ``preconditioner_warmup``
steps and freeze it then; only the frozen chain samples the stated law, so samples taken
before the freeze (a burn-in shorter than the warm-up) are the user's to know about.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from torch import nn

from samplers_as_optim import PSGLD, SGHMC, AdamWSGHMC, SampleCollector

SAMPLERS = {
    "PSGLD": lambda params, warmup: PSGLD(
        params, lr=1e-3, num_data=100, preconditioner_warmup=warmup, seed=0
    ),
    "AdamWSGHMC": lambda params, warmup: AdamWSGHMC(
        params, lr=1e-3, weight_decay=0.0, num_data=100, preconditioner_warmup=warmup, seed=0
    ),
}


def run(model, optimizer, collector, steps):
    """``steps`` steps of a chain on a small regression, the collector after each."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(16, 3, generator=generator)
    y = torch.randn(16, 1, generator=generator)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            optimizer.zero_grad()
            (model(x) - y).square().mean().backward()
            optimizer.step()
            collector.step()
    return [w for w in caught if "SampleCollector" in str(w.message)]


@pytest.mark.parametrize("name", sorted(SAMPLERS))
def test_warns_once_when_sampling_before_the_freeze(name):
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    optimizer = SAMPLERS[name](model.parameters(), 6)
    collector = SampleCollector(model, num_samples=5, burn_in=2, optimizer=optimizer)
    caught = run(model, optimizer, collector, collector.total_steps)
    assert len(caught) == 1  # samples at steps 3, 4 and 5 are before the freeze: one warning
    message = str(caught[0].message)
    assert message == (
        f"SampleCollector recorded a sample at step 3 from {name} while its sampling "
        "preconditioner is still adapting (param group 0: step count 3, preconditioner_"
        "warmup=6; it freezes at step count 6, 3 steps later): the samples before the "
        "freeze are not from the chain's stated law. Raise burn_in to at least 5 (from 2), "
        "or lower preconditioner_warmup."
    )
    assert caught[0].filename == __file__  # points at the user's collector.step()
    assert collector.count == 5  # the samples are recorded all the same


@pytest.mark.parametrize("name", sorted(SAMPLERS))
def test_the_advice_is_right_and_a_frozen_chain_is_quiet(name):
    """burn_in as the warning says: the first sample is at the freeze, and no warning."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    optimizer = SAMPLERS[name](model.parameters(), 6)
    collector = SampleCollector(model, num_samples=4, burn_in=5, optimizer=optimizer)
    assert run(model, optimizer, collector, collector.total_steps) == []
    state = optimizer.state[model.weight]
    assert float(state["preconditioner_step"]) == 6  # it froze at the first sample
    assert collector.count == 4


def test_the_step_count_of_an_optimizer_that_ran_before():
    """An optimizer that took steps before the collector: its count, not the collector's."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    optimizer = PSGLD(model.parameters(), lr=1e-3, num_data=100, preconditioner_warmup=10)
    run(model, optimizer, SampleCollector(model, num_samples=4), 4)  # no optimizer: quiet
    collector = SampleCollector(model, num_samples=3, burn_in=1, thin=2, optimizer=optimizer)
    caught = run(model, optimizer, collector, collector.total_steps)
    assert len(caught) == 1
    assert re.search(
        r"at step 3 from PSGLD .* step count 7, preconditioner_warmup=10; it freezes at step "
        r"count 10, 3 steps later\).* Raise burn_in to at least 4 \(from 1\)",
        str(caught[0].message),
    )


@pytest.mark.parametrize(
    "make",
    [
        lambda params: SGHMC(params, lr=1e-3, num_data=100, seed=0),
        lambda params: torch.optim.Adam(params, lr=1e-3),
        lambda params: PSGLD(params, lr=1e-3, num_data=100, preconditioner_warmup=None),
        lambda params: AdamWSGHMC(
            params, lr=1e-3, weight_decay=0.0, num_data=100, preconditioner_warmup=0
        ),
    ],
    ids=["SGHMC", "Adam", "PSGLD-never-frozen", "AdamWSGHMC-warmup-0"],
)
def test_quiet_without_a_preconditioner_that_freezes_later(make):
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    optimizer = make(model.parameters())
    collector = SampleCollector(model, num_samples=3, optimizer=optimizer)
    assert run(model, optimizer, collector, collector.total_steps) == []


def test_quiet_without_an_optimizer():
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    optimizer = PSGLD(model.parameters(), lr=1e-3, num_data=100, preconditioner_warmup=100)
    collector = SampleCollector(model, num_samples=3)
    assert run(model, optimizer, collector, collector.total_steps) == []


def test_a_loaded_store_watches_the_optimizer_it_is_given(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    optimizer = PSGLD(model.parameters(), lr=1e-3, num_data=100, preconditioner_warmup=50)
    collector = SampleCollector(model, num_samples=3, path=tmp_path / "store")
    state = collector.state_dict()
    resumed = SampleCollector.load(tmp_path / "store", model, optimizer=optimizer)
    resumed.load_state_dict(state)
    assert len(run(model, optimizer, resumed, resumed.total_steps)) == 1


def test_an_optimizer_of_another_type_is_refused(tmp_path):
    model = nn.Linear(3, 1)
    message = "Invalid optimizer: Linear (expected None or the torch.optim.Optimizer"
    with pytest.raises(TypeError, match=re.escape(message)):
        SampleCollector(model, num_samples=3, optimizer=model)
    with pytest.raises(TypeError, match=re.escape("Invalid optimizer: str (expected None")):
        SampleCollector(model, num_samples=3, path=tmp_path / "store", optimizer="sampler")
    assert not (tmp_path / "store").exists()  # the refused collector created nothing
    SampleCollector(model, num_samples=3, path=tmp_path / "store")
    with pytest.raises(TypeError, match=re.escape("Invalid optimizer: str (expected None")):
        SampleCollector.load(tmp_path / "store", model, optimizer="sampler")


def test_a_deep_copy_watches_the_copied_optimizer():
    import copy

    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    optimizer = PSGLD(model.parameters(), lr=1e-3, num_data=100, preconditioner_warmup=50)
    collector = SampleCollector(model, num_samples=3, optimizer=optimizer)
    chain = copy.deepcopy({"model": model, "optimizer": optimizer, "collector": collector})
    assert chain["collector"]._watch.optimizer is chain["optimizer"]
    caught = run(chain["model"], chain["optimizer"], chain["collector"], 3)
    assert len(caught) == 1 and "from PSGLD" in str(caught[0].message)
