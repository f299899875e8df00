"""Every predictive path evaluates a sample with the buffers that belong to it.

BatchNorm's running statistics change along a chain. A collected SGHMC sample, by
default, carries the statistics of its own step, so the model average of
``call_stacked(model, collector.samples, x)`` equals evaluating each sample with its own
state (and not with the final statistics, a different and worse model). The same holds
for ``stack_modules`` and for a ParallelEnsemble's collected samples (per member).
Laplace and VI draw parameters around one fitted model, whose buffers are the right
ones: their ``predict`` uses that model's buffers.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call
from torch.testing import assert_close

from samplers_as_optim import SGHMC, Laplace, MeanFieldVI
from samplers_as_optim.samples.collect import SampleCollector
from samplers_as_optim.samples.ensemble import ParallelEnsemble
from samplers_as_optim.samples.stacked import call_stacked, stack_modules


def batchnorm_net():
    return nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 3))


def data(device, n=64):
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(n, 4, generator=generator) * 2.0 + 1.0
    return x.to(device), torch.randint(0, 3, (n,), generator=generator).to(device)


def state(module):
    """The module's parameters and buffers now (copies)."""
    tensors = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    return {name: tensor.detach().clone() for name, tensor in tensors.items()}


def test_collected_samples_are_evaluated_with_their_own_batchnorm_statistics(device):
    torch.manual_seed(0)
    model = batchnorm_net().to(device)
    optimizer = SGHMC(model.parameters(), lr=0.05, num_data=64, seed=0)
    collector = SampleCollector(model, 6, burn_in=10, thin=5, device=device)  # the defaults
    x, y = data(device)
    states = []
    for step in range(collector.total_steps):
        batch = torch.arange(16 * step, 16 * step + 16, device=device) % 64
        optimizer.zero_grad()
        F.cross_entropy(model(x[batch]), y[batch]).backward()
        optimizer.step()
        if collector.step():
            states.append(state(model))
    model.eval()
    with torch.no_grad():
        averaged = call_stacked(model, collector.samples, x)
        own = torch.stack([functional_call(model, s, (x,)) for s in states])
        parameters_only = {
            name: s for name, s in collector.samples.items() if "running" not in name
        }
        final_statistics = call_stacked(model, parameters_only, x)
    assert "1.running_mean" in collector.samples and "1.running_var" in collector.samples
    assert_close(averaged, own)
    # with the final statistics every earlier sample is another model
    assert (final_statistics[:-1] - own[:-1]).abs().max() > 0.1
    assert_close(final_statistics[-1], own[-1])


def test_stacked_modules_carry_their_buffers_by_default(device):
    torch.manual_seed(0)
    models = [batchnorm_net().to(device) for _ in range(3)]
    x, _ = data(device)
    for shift, model in enumerate(models):
        model(x + shift)  # train mode: each model its own running statistics
        model.eval()
    with torch.no_grad():
        out = call_stacked(models[0], stack_modules(models), x)
        for i, model in enumerate(models):
            assert_close(out[i], model(x))


def test_ensemble_samples_carry_each_members_statistics(device):
    ensemble = ParallelEnsemble(batchnorm_net, 3, seed=0).to(device)
    optimizer = SGHMC(ensemble.parameters(), lr=0.05, num_data=64, seed=0)
    collector = SampleCollector(ensemble, 4, burn_in=3, thin=2, device=device)
    x, y = data(device)
    members = []
    for step in range(collector.total_steps):
        batch = torch.arange(16 * step, 16 * step + 16, device=device) % 64
        optimizer.zero_grad()
        ensemble.loss(F.cross_entropy, ensemble(x[batch]), y[batch]).backward()
        optimizer.step()
        if collector.step():
            members.extend(state(member) for member in ensemble.members())
    assert collector.samples["1.running_var"].shape == (4, 3, 16)
    flat = {name: tensor.flatten(0, 1) for name, tensor in collector.samples.items()}
    template = ensemble.member(0).eval()
    with torch.no_grad():
        averaged = call_stacked(template, flat, x)
        own = torch.stack([functional_call(template, s, (x,)) for s in members])
        ensemble.eval()
        assert_close(ensemble(x), own[-3:])  # the ensemble itself: each member's statistics
    assert_close(averaged, own)


def trained_batchnorm_net(device):
    """A BatchNorm network after a few training steps: its statistics are far from (0, 1)."""
    torch.manual_seed(0)
    model = batchnorm_net().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = data(device)
    for _ in range(5):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    model.eval()
    assert model[1].running_mean.abs().max() > 0.5
    return model, x, y


@pytest.mark.parametrize("method", ["laplace", "vi"])
def test_laplace_and_vi_predict_with_the_fitted_models_buffers(device, method):
    model, x, y = trained_batchnorm_net(device)
    if method == "laplace":
        posterior = Laplace(model, num_data=64, likelihood="classification").fit([(x, y)])
    else:
        posterior = MeanFieldVI(model, num_data=64, prior_std=1.0, init_std=0.1)
    with torch.no_grad():
        draws = torch.Generator(device).manual_seed(2)
        options = {"linear": False} if method == "laplace" else {}  # weight draws
        predicted = posterior.predict(x, 5, generator=draws, **options)
        samples = posterior.sample(5, generator=torch.Generator(device).manual_seed(2))
        assert not any("running" in name for name in samples)  # parameters only
        buffers = {name: tensor.clone() for name, tensor in model.named_buffers()}
        expected = torch.stack(
            [
                functional_call(model, {**{n: t[i] for n, t in samples.items()}, **buffers}, (x,))
                for i in range(5)
            ]
        )
        reset = {name: torch.zeros_like(t) for name, t in buffers.items() if "mean" in name}
        with_reset = functional_call(
            model, {**{n: t[0] for n, t in samples.items()}, **reset}, (x,)
        )
    assert_close(predicted, expected)
    assert (with_reset - expected[0]).abs().max() > 0.1  # the buffers matter here
