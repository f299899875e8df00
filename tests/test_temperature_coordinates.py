"""The coordinates the temperature monitor reads (``sgmcmc/temperature/coordinates``) and
the sums over them (``temperature/estimates.group_sums(coordinates=...)``), checked against
the same sums written out by hand over the stated positions."""

import math

import numpy as np
import pytest
import torch

import samplers_as_optim as sao
from samplers_as_optim import diagnostics
from samplers_as_optim.names import set_member_dims
from samplers_as_optim.sgmcmc.temperature.coordinates import coordinate_subsets
from samplers_as_optim.sgmcmc.temperature.estimates import group_sums

#: the samplers' temperature rules, as their definitions hold them
SGHMC_RULE = sao.SGHMC.definition.temperature_rule
ADAMW_SGHMC_RULE = sao.AdamWSGHMC.definition.temperature_rule

MLP_SHAPES = [(1024, 784), (1024,), (1024, 1024), (1024,), (10, 1024), (10,)]


def test_small_groups_and_none_are_read_whole():
    for budget in (None, 10_000):
        subsets = coordinate_subsets([(30, 40), (40,)], budget)
        assert [(s.offset, s.step, s.count, s.whole) for s in subsets] == [
            (0, 1, 1200, True),
            (0, 1, 40, True),
        ]
    # exactly the budget: whole; one more element: a subset
    assert coordinate_subsets([(1240,)], 1240)[0].whole
    assert not coordinate_subsets([(1241,)], 1240)[0].whole


def test_the_budget_is_shared_in_proportion_and_every_tensor_is_read():
    budget = 4096
    subsets = coordinate_subsets(MLP_SHAPES, budget)
    sizes = [math.prod(shape) for shape in MLP_SHAPES]
    total = sum(sizes)
    counts = [s.count for s in subsets]
    assert all(count >= 1 for count in counts)  # the 10 biases too
    assert sum(counts) <= budget + len(MLP_SHAPES)
    for size, subset in zip(sizes, subsets, strict=True):
        share = budget * size / total
        assert subset.size == size
        # the stride's rounding (and its coprime search) cost at most a few positions
        allocated = max(1, math.floor(share))
        assert allocated >= subset.count >= 0.9 * allocated
        positions = list(subset.positions())
        assert positions[0] >= 0 and positions[-1] < size
        # centred: the slack is split between both ends
        assert abs(positions[0] - (size - 1 - positions[-1])) <= 1


def test_a_matrix_is_read_across_its_rows_and_columns():
    """A stride that divides the row length would read one column; a contiguous slice
    the first rows. The coprime stride meets min(count, columns) columns, and with a
    stride >= the row length a different row at every position."""
    for rows, columns, count in ((1024, 1024, 1000), (512, 64, 4096), (300, 7, 50)):
        (subset,) = coordinate_subsets([(rows, columns)], count)
        positions = np.asarray(subset.positions())
        assert math.gcd(subset.step, columns) == 1
        assert len(np.unique(positions % columns)) == min(subset.count, columns)
        if subset.step >= columns:
            assert len(np.unique(positions // columns)) == subset.count
        else:  # a few positions per row, spread over all rows
            assert np.unique(positions // columns).size >= rows - 1
    # 1024 * 1024 / 1024 would be a stride of 1024: one column; 1025 is coprime
    (subset,) = coordinate_subsets([(1024, 1024)], 1024)
    assert subset.step == 1025


@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "stacked"])
def test_a_read_is_the_stated_positions_and_a_view_where_it_can_be(layout):
    generator = torch.Generator().manual_seed(0)
    members = 3 if layout == "stacked" else 1
    shape = (16, 8, 3, 3)
    tensor = torch.randn((members, *shape) if members > 1 else shape, generator=generator)
    if layout == "channels_last":
        tensor = tensor.to(memory_format=torch.channels_last)
    (subset,) = coordinate_subsets([shape], 100)
    assert not subset.whole
    read = subset.read(tensor, members)
    expected = tensor.reshape(members, -1)[:, list(subset.positions())]
    assert read.shape == ((subset.count,) if members == 1 else (members, subset.count))
    expected = expected.reshape(read.shape)
    assert torch.equal(read, expected)
    if layout != "channels_last":  # a strided view of the tensor itself: nothing copied
        assert read.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr()


def hand_sums(params, grads, buffers, positions, *, num_data, kin_weight, decay):
    """The monitor's sums over ``positions`` (one array per tensor), in float64 numpy."""
    theta = np.concatenate(
        [p.detach().double().numpy().reshape(-1)[i] for p, i in zip(params, positions, strict=True)]
    )
    grad = np.concatenate(
        [g.double().numpy().reshape(-1)[i] for g, i in zip(grads, positions, strict=True)]
    )
    buffer = np.concatenate(
        [b.double().numpy().reshape(-1)[i] for b, i in zip(buffers, positions, strict=True)]
    )
    terms = num_data * theta * (grad + decay * theta)
    return kin_weight * np.mean(buffer**2), terms.mean(), terms.var(), len(theta)


@pytest.mark.parametrize("budget", [None, 64, 400])
def test_group_sums_over_a_subset_are_the_hand_sums_over_its_positions(budget):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(30, 20), torch.nn.Tanh(), torch.nn.Linear(20, 3))
    num_data, lr, momentum, decay = 200, 1e-2, 0.9, 0.01
    optimizer = sao.SGHMC(
        model.parameters(), lr=lr, momentum=momentum, num_data=num_data, weight_decay=decay, seed=0
    )
    x, y = torch.randn(64, 30), torch.randn(64, 3)
    for _ in range(3):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    params = list(model.parameters())
    subsets = coordinate_subsets([p.shape for p in params], budget)
    positions = [np.asarray(s.positions()) for s in subsets]
    sums = group_sums(SGHMC_RULE, optimizer.param_groups[0], 0, optimizer.state, coordinates=budget)
    kin, conf, variance, d = hand_sums(
        params,
        [p.grad for p in params],
        [optimizer.state[p]["momentum_buffer"] for p in params],
        positions,
        num_data=num_data,
        kin_weight=num_data * lr * (1 + momentum) / 2,
        decay=decay,
    )
    n = sum(p.numel() for p in params)
    assert d == (n if budget is None else sum(s.count for s in subsets)) and (
        budget is None or d < n
    )
    assert sums.kinetic_dof == d and sums.conf_dof == d
    assert float(sums.kinetic[0]) / d == pytest.approx(kin, rel=1e-5)
    assert float(sums.conf[0]) == pytest.approx(conf, rel=1e-5)
    assert float(sums.conf_variance[0]) == pytest.approx(variance, rel=1e-4)
    cheap = group_sums(
        SGHMC_RULE, optimizer.param_groups[0], 0, optimizer.state, coordinates=budget, spread=False
    )
    assert float(cheap.conf[0]) == pytest.approx(conf, rel=1e-5)


@pytest.mark.parametrize("preconditioner", ["factored", "elementwise"])
@pytest.mark.parametrize("frozen", [False, True])
def test_the_twins_subset_reads_its_preconditioner_at_the_same_positions(preconditioner, frozen):
    """The twin's r^2/M and decoupled prior need a at the positions read: from the frozen
    one (full shape, or one number for a vector) or from V pooled as the step pools it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.Tanh(), torch.nn.Linear(30, 2))
    optimizer = sao.AdamWSGHMC(
        model.parameters(),
        lr=1e-3,
        weight_decay=0.1,
        num_data=500,
        seed=0,
        preconditioner=preconditioner,
        preconditioner_warmup=2 if frozen else None,
    )
    x, y = torch.randn(64, 40), torch.randn(64, 2)
    for _ in range(4):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    group = optimizer.param_groups[0]
    full = group_sums(ADAMW_SGHMC_RULE, group, 0, optimizer.state, coordinates=None)
    # a budget above the group's size reads it whole (joined: the same sums up to rounding)
    whole = group_sums(ADAMW_SGHMC_RULE, group, 0, optimizer.state, coordinates=10**6)
    assert whole.kinetic_dof == full.kinetic_dof and whole.conf_dof == full.conf_dof
    torch.testing.assert_close(whole.kinetic, full.kinetic, rtol=1e-6, atol=0)
    torch.testing.assert_close(whole.conf, full.conf, rtol=1e-6, atol=0)
    # a subset: compare against the per-element terms gathered at its positions
    params = list(model.parameters())
    budget = 300
    subsets = coordinate_subsets([p.shape for p in params], budget)
    sub = group_sums(ADAMW_SGHMC_RULE, group, 0, optimizer.state, coordinates=budget)
    kin_terms, conf_terms = [], []
    beta1 = group["betas"][0]
    for param, subset in zip(params, subsets, strict=True):
        state = optimizer.state[param]
        single = dict(group, params=[param])
        a = per_element_scale(single, param, state)
        m = state["exp_avg"]
        index = list(subset.positions())
        weight = group["num_data"] * group["lr"] * (1 + beta1) / (2 * (1 - beta1))
        kin_terms.append((weight * m.square() / a).reshape(-1)[index])
        g = param.grad + group["weight_decay"] * a * param.detach()
        conf_terms.append((group["num_data"] * param.detach() * g).reshape(-1)[index])
    kin, conf = torch.cat(kin_terms).double(), torch.cat(conf_terms).double()
    assert sub.kinetic_dof == len(kin) == sum(s.count for s in subsets) < 40 * 30 + 30 + 60 + 2
    assert float(sub.kinetic[0]) / len(kin) == pytest.approx(float(kin.mean()), rel=1e-5)
    assert float(sub.conf[0]) == pytest.approx(float(conf.mean()), rel=1e-5)


def per_element_scale(group, param, state):
    """a at every element, as the step uses it: the frozen one, else V pooled now."""
    from samplers_as_optim.sgmcmc.sampling_preconditioner import pooled_second_moment

    if float(state["preconditioner_step"]) > 0:
        return state["preconditioner"].expand_as(param)
    beta2 = group["betas"][1]
    pooled = pooled_second_moment(state["exp_avg_sq"], group["preconditioner"], 0)
    correction = 1 - beta2 ** float(state["step"])
    return pooled.div(correction).sqrt().add(group["eps"]).expand_as(param)


def test_stacked_members_read_the_same_positions_each_and_report_apart():
    members, size = 3, 5_000
    generator = torch.Generator().manual_seed(0)
    param = torch.nn.Parameter(torch.randn(members, size, generator=generator))
    set_member_dims(param, 1)
    optimizer = sao.SGHMC([param], lr=0.5, momentum=0.9, num_data=100, seed=1)
    for _ in range(3):
        param.grad = param.detach() / 100
        optimizer.step()
    buffer = optimizer.state[param]["momentum_buffer"]
    (subset,) = coordinate_subsets([(size,)], 1000)
    sums = group_sums(SGHMC_RULE, optimizer.param_groups[0], 0, optimizer.state, coordinates=1000)
    index = list(subset.positions())
    expected = buffer[:, index].double().square().sum(1) * 100 * 0.5 * 1.9 / 2
    assert sums.members == members and sums.kinetic_dof == subset.count < 1000 + 1
    torch.testing.assert_close(sums.kinetic, expected, rtol=1e-5, atol=0)


def test_the_monitor_reads_its_default_budget_and_none_reads_all():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(100, 60), torch.nn.Tanh(), torch.nn.Linear(60, 5))
    n = sum(p.numel() for p in model.parameters())
    monitors = {}
    for coordinates in (None, 4096, 1000):
        optimizer = sao.SGHMC(model.parameters(), lr=1e-4, momentum=0.9, num_data=100, seed=0)
        kwargs = {} if coordinates == 4096 else {"coordinates": coordinates}
        monitors[coordinates] = (
            diagnostics.TemperatureMonitor(optimizer, every=2, **kwargs),
            optimizer,
        )
    x, y = torch.randn(16, 100), torch.randn(16, 5)
    for _, optimizer in monitors.values():
        for _ in range(2):
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
    dofs = {k: m.history[-1][1][0].configurational.dof for k, (m, _) in monitors.items()}
    shapes = [p.shape for p in model.parameters()]
    read = {b: sum(s.count for s in coordinate_subsets(shapes, b)) for b in (4096, 1000)}
    assert dofs == {None: n, 4096: read[4096], 1000: read[1000]}
    assert read[1000] <= 1000 + 4 and read[4096] <= 4096 + 4 < n  # 6,365 parameters
    assert monitors[4096][0].coordinates == 4096


def test_coordinates_refusals():
    optimizer = sao.SGHMC(torch.nn.Linear(2, 1).parameters(), lr=0.1, num_data=10)
    expected = r"\(expected None \(every coordinate\) or an integer >= 1\)$"
    cases = [
        (0, ValueError, r"^Invalid coordinates: 0 "),
        (-5, ValueError, r"^Invalid coordinates: -5 "),
        (1.5, TypeError, r"^Invalid coordinates: 1\.5 "),
        (True, TypeError, r"^Invalid coordinates: True "),
        ("all", TypeError, r"^Invalid coordinates: 'all' "),
    ]
    for value, error, start in cases:
        with pytest.raises(error, match=start + expected):
            diagnostics.TemperatureMonitor(optimizer, coordinates=value)
    assert not optimizer._optimizer_step_pre_hooks  # refused before any hook
    assert diagnostics.TemperatureMonitor(optimizer, coordinates=np.int64(7)).coordinates == 7


def test_a_channels_last_model_reads_the_same_coordinates_as_a_contiguous_one():
    """The subset is of logical positions: the memory layout changes how they are read
    (a gather instead of a strided view), not which."""
    sums = []
    for memory_format in (torch.contiguous_format, torch.channels_last):
        torch.manual_seed(0)
        model = torch.nn.Conv2d(8, 16, 3).to(memory_format=memory_format)
        optimizer = sao.SGHMC(model.parameters(), lr=1e-3, momentum=0.9, num_data=100, seed=0)
        x = torch.randn(4, 8, 10, 10).to(memory_format=memory_format)
        for _ in range(2):
            optimizer.zero_grad()
            model(x).square().mean().backward()
            optimizer.step()
        assert model.weight.is_contiguous() == (memory_format is torch.contiguous_format)
        group = optimizer.param_groups[0]
        sums.append(group_sums(SGHMC_RULE, group, 0, optimizer.state, coordinates=200))
    contiguous, channels_last = sums
    assert contiguous.conf_dof == channels_last.conf_dof < 16 * 8 * 9
    torch.testing.assert_close(contiguous.kinetic, channels_last.kinetic, rtol=1e-5, atol=0)
    torch.testing.assert_close(contiguous.conf, channels_last.conf, rtol=1e-5, atol=0)
    torch.testing.assert_close(
        contiguous.conf_variance, channels_last.conf_variance, rtol=1e-4, atol=0
    )
