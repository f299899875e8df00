"""The temperature monitor (``diagnostics.TemperatureMonitor``) under steps that are scaled
or never happen (issue #34).

``torch.amp.GradScaler`` hands the sampler scaled gradients and the scale, and skips a
step whose gradients overflowed; ``nonfinite="skip"`` skips a step with a non-finite
gradient on the device; ``nonfinite="raise"`` refuses it. The monitor reads what the
chain does: a scaled gradient as the unscaled one, a skipped step not at all, a refused
step not at all.

The chains are Gaussian targets ``N(0, I)`` (``U = |theta|^2 / 2``, the gradient of the
mean loss ``theta / N``); the hot chain is SGLD at ``lr * lam / N = 1``, whose
configurational temperature is ``T / (1 - 1/2) = 2 T``.
"""

import math
import pickle
import warnings

import pytest
import torch

import samplers_as_optim as sao
from samplers_as_optim import diagnostics
from samplers_as_optim.names import set_member_dims
from samplers_as_optim.sgmcmc.temperature.coordinates import coordinate_subsets

N = 100
SIZE = 2_000


def gaussian_chain(cls=sao.SGHMC, *, seed=0, **kwargs):
    torch.manual_seed(seed)
    param = torch.nn.Parameter(torch.randn(SIZE))
    kwargs.setdefault("lr", 1.0)
    if cls is sao.SGHMC:
        kwargs.setdefault("momentum", 0.9)
    return param, cls([param], num_data=N, seed=1, **kwargs)


def loss_of(param):
    return param.square().sum() / (2 * N)


def run(optimizer, param, steps, *, scaler=None, unscale_first=False, inject=None):
    """``steps`` steps; ``inject(step, param)`` may spoil the gradient (after backward)."""
    for step in range(steps):
        optimizer.zero_grad()
        loss = loss_of(param)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        if inject is not None:
            inject(step, param)
        if scaler is None:
            optimizer.step()
            continue
        if unscale_first:
            scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()


def hot_warnings(caught):
    return [str(w.message) for w in caught if w.category is diagnostics.ChainTemperatureWarning]


def monitored(cls=sao.SGHMC, *, every=50, steps=200, coordinates=4096, **options):
    """A chain's monitor history, its hot warnings and its final position."""
    chain_options = {k: options.pop(k) for k in ("weight_decay", "nonfinite", "lr") if k in options}
    param, optimizer = gaussian_chain(cls, **chain_options)
    monitor = diagnostics.TemperatureMonitor(optimizer, every=every, coordinates=coordinates)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(optimizer, param, steps, **options)
    return monitor.history, hot_warnings(caught), param.detach().clone()


@pytest.mark.parametrize(
    ("cls", "options"),
    [
        (sao.SGHMC, {}),
        (sao.SGHMC, {"unscale_first": True}),
        (sao.SGHMC, {"weight_decay": 0.01}),
        (sao.SGHMC, {"coordinates": 300}),
        (sao.SGLD, {"lr": 2.0}),  # the general path (no lean rule), its spread too
        (sao.SGNHT, {"lr": 0.5}),
    ],
)
def test_a_grad_scaler_chain_reads_as_the_unscaled_chain(cls, options):
    """SGHMC under ``GradScaler(init_scale=2**10)`` is the unscaled chain bit for bit; so
    are its readings (the configurational one read 2**10 times too hot, and warned)."""
    options = dict(options)
    unscale_first = options.pop("unscale_first", False)
    plain, plain_warned, plain_end = monitored(cls, **options)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    scaled, scaled_warned, scaled_end = monitored(
        cls, scaler=scaler, unscale_first=unscale_first, **options
    )
    assert torch.equal(plain_end, scaled_end)
    assert len(plain) == 4
    assert scaled == plain
    assert scaled_warned == plain_warned
    if "weight_decay" not in options:  # started from its target: never hot
        assert plain_warned == []


def spoil(steps, value=float("inf"), positions=(3,)):
    """An ``inject`` that writes ``value`` into the gradient at ``steps``."""

    def inject(step, param):
        if step in steps:
            with torch.no_grad():
                param.grad[list(positions)] = value

    return inject


def test_a_grad_scaler_overflow_step_is_left_out_of_the_window():
    """The overflow's step is skipped by the sampler (``found_inf``): the window counts
    the others only, and reads what the same chain reads with that step skipped by
    ``nonfinite="skip"`` (no scaler)."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    scaled, scaled_warned, scaled_end = monitored(
        scaler=scaler, inject=spoil({70}), every=50, steps=150
    )
    assert scaler.get_scale() == 2.0**9  # the overflow was seen, and halved the scale
    skipped, skipped_warned, skipped_end = monitored(
        nonfinite="skip", inject=spoil({70}), every=50, steps=150
    )
    assert torch.equal(scaled_end, skipped_end)
    assert [steps for steps, _ in scaled] == [50, 100, 150]
    assert [report.steps for _, (report,) in scaled] == [50, 49, 50]
    (report,) = scaled[1][1]
    assert report.kinetic.low < report.kinetic.value < report.kinetic.high
    assert report.configurational.low < report.configurational.value < report.configurational.high
    assert scaled == skipped
    assert scaled_warned == skipped_warned == []


def subset_positions(coordinates):
    (subset,) = coordinate_subsets([(SIZE,)], coordinates)
    return set(subset.positions())


@pytest.mark.parametrize(
    ("spoiled", "value", "positions", "coordinates"),
    [
        (65, float("nan"), range(SIZE), 4096),  # inside a window
        (60, float("nan"), (5,), 4096),  # the first step of a window (the spread's)
        (65, float("inf"), (0,), 400),  # outside the coordinates read
    ],
)
def test_a_skipped_step_leaves_a_hot_window_finite_and_hot(spoiled, value, positions, coordinates):
    """``nonfinite="skip"``: the step with a non-finite gradient is a no-op of the chain
    and no step of the monitor's window, which stays finite and is flagged hot."""
    if coordinates != 4096:
        assert not set(positions) & subset_positions(coordinates)
    history, warned, _ = monitored(
        sao.SGLD,
        lr=float(N),
        nonfinite="skip",
        inject=spoil({spoiled}, value, positions),
        every=30,
        steps=120,
        coordinates=coordinates,
    )
    reports = [report for _, (report,) in history]
    assert [report.steps for report in reports] == [30, 30, 29, 30]
    for report in reports:
        estimate = report.configurational
        assert estimate is not None and estimate.hot
        assert 1.5 < estimate.value < 2.5  # 2 T
    assert len(warned) == 1


def test_a_skipped_first_step_of_the_first_window_leaves_it_without_a_band():
    """The terms' spread is measured at a window's first step; skipped in the first
    window, there is none yet: the estimate is given without a band and says why, and the
    next window measures it again."""
    history, warned, _ = monitored(
        sao.SGLD,
        lr=float(N),
        nonfinite="skip",
        inject=spoil({0}, float("nan")),
        every=30,
        steps=60,
    )
    (first,), (second,) = (reports for _, reports in history)
    assert first.steps == 29
    estimate = first.configurational
    assert estimate is not None and 1.0 < estimate.value < 2.5
    assert (estimate.low, estimate.high) == (-float("inf"), float("inf"))
    assert "spread" in first.note
    assert second.steps == 30 and second.configurational.hot
    assert second.note == "no momentum to read"
    assert len(warned) == 1


def test_every_step_of_a_window_skipped_reads_no_estimate():
    history, warned, _ = monitored(
        nonfinite="skip", inject=spoil(set(range(10, 20)), float("nan")), every=10, steps=30
    )
    reports = [report for _, (report,) in history]
    assert [report.steps for report in reports] == [10, 0, 10]
    assert reports[1].kinetic is None and reports[1].configurational is None
    assert "every step of the window was skipped" in reports[1].note
    assert not reports[1].hot and warned == []


def test_a_skipped_step_is_left_out_for_every_stacked_member():
    """A ParallelEnsemble's stack: a NaN in one member's gradient skips the step for all
    (the sampler's flag is over every gradient), and every member's report leaves it out."""
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(3, SIZE))
    set_member_dims(param, 1)
    optimizer = sao.SGHMC([param], lr=1.0, momentum=0.9, num_data=N, seed=1, nonfinite="skip")
    monitor = diagnostics.TemperatureMonitor(optimizer, every=20, warn=False)
    run(optimizer, param, 60, inject=spoil({25}, float("nan"), positions=(1,)))
    for _, reports in monitor.history:
        assert [r.member for r in reports] == [0, 1, 2]
    assert [[r.steps for r in reports] for _, reports in monitor.history] == [
        [20] * 3,
        [19] * 3,
        [20] * 3,
    ]
    for _, reports in monitor.history:
        for report in reports:
            assert math.isfinite(report.kinetic.value) and not report.hot
            assert math.isfinite(report.configurational.value)


@pytest.mark.parametrize("positions", [range(SIZE), (0,)])
def test_a_refused_step_leaves_the_window_as_it_was(positions):
    """``nonfinite="raise"``: the refused step changes nothing, in the chain or in the
    monitor's window (whose step pre-hook had read it already)."""
    histories = []
    for refuse in (False, True):
        param, optimizer = gaussian_chain(nonfinite="raise")
        monitor = diagnostics.TemperatureMonitor(optimizer, every=10, warn=False, coordinates=64)
        for step in range(30):
            if refuse and step in (4, 10):  # inside a window, and the first step of one
                optimizer.zero_grad()
                loss_of(param).backward()
                with torch.no_grad():
                    param.grad[list(positions)] = float("nan")
                with pytest.raises(FloatingPointError, match="non-finite gradient"):
                    optimizer.step()
            optimizer.zero_grad()
            loss_of(param).backward()
            optimizer.step()
        histories.append((monitor.history, param.detach().clone()))
    (plain, plain_end), (refused, refused_end) = histories
    assert torch.equal(plain_end, refused_end)
    assert [report.steps for _, (report,) in refused] == [10, 10, 10]
    assert refused == plain


def test_a_skipped_step_reads_nothing_to_the_host(monkeypatch):
    """Under a GradScaler and ``nonfinite="skip"`` the monitor still reads to the host
    only at a window's end."""
    param, optimizer = gaussian_chain(nonfinite="skip")
    monitor = diagnostics.TemperatureMonitor(optimizer, every=5, warn=False)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    reads = {"tolist": 0, "item": 0}

    def counted(name, function):
        def wrapper(self, *args, **kwargs):
            reads[name] += 1
            return function(self, *args, **kwargs)

        return wrapper

    monkeypatch.setattr(torch.Tensor, "tolist", counted("tolist", torch.Tensor.tolist))
    monkeypatch.setattr(torch.Tensor, "item", counted("item", torch.Tensor.item))
    run(optimizer, param, 4, scaler=scaler, inject=spoil({1}))
    assert reads == {"tolist": 0, "item": 0} and monitor.history == []
    run(optimizer, param, 1, scaler=scaler)
    assert reads["tolist"] > 0
    ((steps, (report,)),) = monitor.history
    assert steps == 5 and report.steps == 4


def test_the_monitor_stays_public_in_diagnostics():
    from samplers_as_optim.sgmcmc.temperature import monitor as temperature_monitor

    assert diagnostics.TemperatureMonitor is temperature_monitor.TemperatureMonitor
    assert diagnostics.ChainTemperatureWarning is temperature_monitor.ChainTemperatureWarning
    assert {"TemperatureMonitor", "ChainTemperatureWarning"} <= set(diagnostics.__all__)
    warning = pickle.loads(pickle.dumps(diagnostics.ChainTemperatureWarning("hot")))
    assert isinstance(warning, diagnostics.ChainTemperatureWarning)
    assert isinstance(warning, UserWarning) and str(warning) == "hot"
