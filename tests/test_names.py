"""name_parameters: names on the tensors key the noise as an optimizer's own names do."""

import pytest
import torch

from samplers_as_optim import SGHMC, name_parameters
from samplers_as_optim.names import parameter_name


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))


def one_step(build):
    net = model()
    opt = build(net)
    for p in net.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    return [p.detach() for p in net.parameters()]


def test_stamped_names_key_the_noise_as_named_parameters_do():
    def named(net):
        return SGHMC(net.named_parameters(), lr=0.01, num_data=10, seed=2)

    def stamped_in_reverse(net):  # another order: the names, not the positions, decide
        return SGHMC(list(name_parameters(net).parameters())[::-1], lr=0.01, num_data=10, seed=2)

    def unnamed_in_reverse(net):
        return SGHMC(list(net.parameters())[::-1], lr=0.01, num_data=10, seed=2)

    expected = one_step(named)
    assert all(
        torch.equal(a, b) for a, b in zip(expected, one_step(stamped_in_reverse), strict=True)
    )
    assert not all(
        torch.equal(a, b) for a, b in zip(expected, one_step(unnamed_in_reverse), strict=True)
    )


def test_name_parameters_marks_every_parameter_and_returns_the_module():
    net = model()
    assert name_parameters(net) is net
    assert [parameter_name(p) for p in net.parameters()] == [
        "0.weight",
        "0.bias",
        "2.weight",
        "2.bias",
    ]
    assert parameter_name(torch.zeros(1)) is None


def test_name_parameters_needs_a_module():
    with pytest.raises(TypeError, match=r"Invalid module: 3 \(expected an nn.Module\)"):
        name_parameters(3)
