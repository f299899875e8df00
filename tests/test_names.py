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


@pytest.mark.parametrize("sampler", ["SGLD", "SGHMC", "SGNHT", "PSGLD", "AdamWSGHMC"])
@pytest.mark.parametrize("how", ["named_parameters", "stamped"])
def test_two_parameters_of_one_name_are_refused_before_anything_changes(sampler, how):
    """Two modules' ``named_parameters()`` in one optimizer: two parameters named "weight".

    Keyed by one name, their noise would be the same draw, a silently correlated chain;
    the step refuses them before it moves anything, and named apart they step.
    """
    import samplers_as_optim

    first, second = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    with torch.no_grad():
        second.load_state_dict(first.state_dict())
    if how == "named_parameters":
        groups = [{"params": list(m.named_parameters())} for m in (first, second)]
    else:
        name_parameters(first), name_parameters(second)
        groups = [{"params": list(m.parameters())} for m in (first, second)]
    cls = getattr(samplers_as_optim, sampler)
    opt = cls(groups, lr=1e-3, num_data=10, weight_decay=0.0, seed=0)
    before = [p.detach().clone() for m in (first, second) for p in m.parameters()]
    for m in (first, second):
        for p in m.parameters():
            p.grad = torch.full_like(p, 0.3)  # the same gradient: only the noise differs
    with pytest.raises(ValueError) as info:
        opt.step()
    assert str(info.value).startswith(
        "Invalid params: parameter 0 ('weight') in param group 0 and parameter 0 ('weight') "
        "in param group 1 have the same noise key (expected distinct names"
    )
    after = [p.detach() for m in (first, second) for p in m.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert opt.state_dict()["state"] == {}
    apart = [
        {"params": list(m.named_parameters(prefix=prefix))}
        for m, prefix in ((first, "first"), (second, "second"))
    ]
    opt = cls(apart, lr=1e-3, num_data=10, weight_decay=0.0, seed=0)
    opt.step()
    assert not torch.equal(first.weight, second.weight)
