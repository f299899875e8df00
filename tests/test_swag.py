"""SWAG: running statistics against the stored stream, the sampling rule, a sampler's stream.

The statistics are checked against the same stream kept in memory (float64, 1e-12); the
draws against the stated transform of the generator's normals; the covariance of the
draws is linear in (z1, z2), so its closed form is checked exactly; on SGLD over a
Gaussian the SWAG variance is checked against the chain's exact stationary variance.
"""

import math
import re

import pytest
import torch
from torch import nn

from samplers_as_optim import SGLD, SWAG, predictive
from samplers_as_optim.samples.stacked import call_stacked

pytestmark = pytest.mark.usefixtures("float64_default")


def assert_close(a, b, rtol=1e-12):
    scale = max(float(b.abs().max()), 1e-300)
    assert float((a - b).abs().max()) <= rtol * scale, float((a - b).abs().max()) / scale


def stream(count=12, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [
        {"weight": 3.0 + torch.randn(2, 3, generator=gen), "bias": torch.randn(2, generator=gen)}
        for _ in range(count)
    ]


def flat(params):
    return torch.cat([params["weight"].reshape(-1), params["bias"].reshape(-1)])


def test_running_statistics_equal_the_stored_stream():
    swag = SWAG(nn.Linear(3, 2), rank=5)
    thetas = stream()
    for theta in thetas:
        swag.record(theta)
    stacked = torch.stack([flat(t) for t in thetas])
    assert swag.count == 12
    assert_close(flat(swag.mean), stacked.mean(0))
    assert_close(flat(swag.variance), stacked.var(0, unbiased=False))
    running = stacked.cumsum(0) / torch.arange(1, 13).unsqueeze(-1)
    expected = (stacked - running)[-5:]
    # ring buffer: the 5 most recent deviations, in some cyclic order
    got = swag.deviations
    assert got.shape == (5, 8)
    assert_close(torch.sort(got, dim=0).values, torch.sort(expected, dim=0).values)
    low = expected.T @ expected / 4
    diag = torch.diag(stacked.var(0, unbiased=False))
    assert_close(swag.covariance(), 0.5 * (diag + low))


def test_draws_are_the_stated_transform_and_scale_with_temperature():
    swag = SWAG(nn.Linear(3, 2), rank=4, temperature=0.3)
    for theta in stream():
        swag.record(theta)
    draws = swag.sample(6, generator=torch.Generator().manual_seed(1))
    gen = torch.Generator().manual_seed(1)
    z1, z2 = torch.randn(6, 8, generator=gen), torch.randn(6, 4, generator=gen)
    std = flat(swag.variance).sqrt()
    expected = flat(swag.mean) + math.sqrt(0.3) * (
        std * z1 / math.sqrt(2) + z2 @ swag.deviations / math.sqrt(2 * 3)
    )
    assert_close(torch.cat([draws["weight"].reshape(6, -1), draws["bias"]], 1), expected)
    diagonal = SWAG(nn.Linear(3, 2), rank=0)
    for theta in stream():
        diagonal.record(theta)
    draws = diagonal.sample(3, generator=torch.Generator().manual_seed(2))
    z = torch.randn(3, 8, generator=torch.Generator().manual_seed(2))
    got = torch.cat([draws["weight"].reshape(3, -1), draws["bias"]], 1)
    assert_close(got, flat(diagonal.mean) + std * z)
    assert_close(diagonal.covariance(), torch.diag(std.square()))


def test_sample_covariance_matches_within_monte_carlo_error():
    swag = SWAG(nn.Linear(3, 2), rank=3)
    for theta in stream():
        swag.record(theta)
    n = 4000
    draws = swag.sample(n, generator=torch.Generator().manual_seed(3))
    theta = torch.cat([draws["weight"].reshape(n, -1), draws["bias"]], 1)
    sigma = swag.covariance()
    centred = theta - flat(swag.mean)
    empirical = centred.T @ centred / n
    # Var of a Gaussian second moment: (S_ij^2 + S_ii S_jj) / n; 5 standard errors
    stderr = ((sigma.square() + torch.outer(sigma.diagonal(), sigma.diagonal())) / n).sqrt()
    assert bool(((empirical - sigma).abs() < 5 * stderr).all())


def test_sits_on_sgld_without_storing_samples():
    """SGLD on U = sum_j a_j theta_j^2 / 2 is, per coordinate, the AR(1) chain
    theta <- (1 - h a) theta + sqrt(2h) xi (h = lr / N), whose stationary variance is
    exactly 1 / (a (1 - h a / 2)). With h a = 0.25 and 0.5 (autocorrelation 0.75, 0.5),
    theta^2 has autocorrelation rho^2, so n draws give an ESS of at least
    n (1 - 0.5625) / 1.5625 = 0.28 n for the variance, whose relative standard error is
    sqrt(2 / ESS) (0.03 at n = 8000). We allow 5 standard errors."""
    num_data, h = 10, 0.25
    a = torch.tensor([1.0, 2.0])
    model = nn.Module()
    model.theta = nn.Parameter(torch.zeros(2))
    optimizer = SGLD(model.parameters(), lr=h * num_data, num_data=num_data, seed=0)
    swag = SWAG(model, rank=10)
    n, burn = 8000, 200
    for step in range(n + burn):
        optimizer.zero_grad()
        (0.5 * (a * model.theta.square()).sum() / num_data).backward()
        optimizer.step()
        if step >= burn:
            swag.record()
    exact = 1.0 / (a * (1.0 - h * a / 2.0))
    ess = n * (1 - 0.75**4) / (1 + 0.75**4)
    tolerance = 5 * math.sqrt(2.0 / ess)
    ratio = swag.variance["theta"] / exact
    assert bool(((ratio - 1).abs() < tolerance).all()), ratio
    assert bool((swag.mean["theta"].abs() < 5 * (exact * 7 / n).sqrt()).all())
    # memory: the statistics, never the stream
    assert swag.deviations.shape == (10, 2)
    assert sum(t.numel() for t in swag.state_dict().values() if torch.is_tensor(t)) == 2 + 2 + 20


def test_predictive_paths():
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3))
    gen = torch.Generator().manual_seed(5)
    x, y = torch.randn(32, 3, generator=gen), torch.randint(0, 3, (32,), generator=gen)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    swag = SWAG(model, rank=5)
    for step in range(30):
        optimizer.zero_grad()
        batch = slice(step % 4 * 8, step % 4 * 8 + 8)
        torch.nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
        optimizer.step()
        swag.record()
    out = swag.predict(x[:5], num_samples=7, generator=torch.Generator().manual_seed(6))
    expected = call_stacked(
        model, swag.sample(7, generator=torch.Generator().manual_seed(6)), x[:5]
    )
    assert_close(out, expected)
    linear = swag.predict(x[:5], 7, linear=True, generator=torch.Generator().manual_seed(6))
    assert linear.shape == (7, 5, 3)
    probs = predictive.classification(linear).probs
    assert_close(probs.sum(-1), torch.ones(5))


def test_state_dict_round_trip_continues_exactly():
    thetas = stream(count=15)
    first = SWAG(nn.Linear(3, 2), rank=4)
    for theta in thetas[:9]:
        first.record(theta)
    second = SWAG(nn.Linear(3, 2), rank=4)
    second.load_state_dict(first.state_dict())
    for theta in thetas[9:]:
        first.record(theta)
        second.record(theta)
    assert torch.equal(first.deviations, second.deviations)
    assert torch.equal(flat(first.variance), flat(second.variance))
    other = SWAG(nn.Linear(3, 2), rank=3)
    message = (
        "Invalid state_dict: deviations of shape (4, 8) (expected shape (3, 8): rank=3 x the 8 "
        "treated weights)"
    )
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        other.load_state_dict(first.state_dict())


@pytest.mark.parametrize(("rank", "count"), [(0, 0), (0, 5), (3, 0), (3, 1), (3, 2), (3, 7)])
def test_state_dict_round_trip_at_every_fill_of_the_ring_buffer(rank, count):
    """Every state record() leaves (empty, partly and fully filled buffer) loads back."""
    source = SWAG(nn.Linear(3, 2), rank=rank)
    for theta in stream(count):
        source.record(theta)
    target = SWAG(nn.Linear(3, 2), rank=rank)
    target.load_state_dict(source.state_dict())
    assert_same_state(source.state_dict(), target.state_dict())


def assert_same_state(before, after):
    assert before.keys() == after.keys()
    for key, value in before.items():
        if torch.is_tensor(value):
            assert torch.equal(after[key], value) and after[key].dtype == value.dtype, key
        else:
            assert type(after[key]) is type(value) and after[key] == value, key


def recorded_swag(rank=3, count=5):
    swag = SWAG(nn.Linear(3, 2), rank=rank)
    for theta in stream(count):
        swag.record(theta)
    return swag  # rank 3, count 5: stored 3, next 2; P = 8


def negative_m2(state):
    m2 = state["m2"].clone()
    m2[4] = -1.5
    return m2


INVALID_STATES = [
    # (id, field, new value (or a function of the state), error, message)
    (
        "mean-shape",
        "mean",
        torch.zeros(3),
        ValueError,
        "mean of shape (3,) (expected shape (8,): the 8 treated weights)",
    ),
    (
        "mean-dtype",
        "mean",
        lambda state: state["mean"].float(),
        ValueError,
        "mean of dtype torch.float32 (expected torch.float64, the dtype of the treated parameters)",
    ),
    (
        "mean-not-a-tensor",
        "mean",
        [0.0] * 8,
        TypeError,
        "mean of type list (expected a torch.float64 tensor of shape (8,))",
    ),
    (
        "mean-nan",
        "mean",
        lambda state: state["mean"].index_fill(0, torch.tensor([2]), math.nan),
        ValueError,
        "mean holds NaN or infinity (expected finite values, as record() keeps them)",
    ),
    (
        "m2-shape",
        "m2",
        torch.zeros(2, 4),
        ValueError,
        "m2 of shape (2, 4) (expected shape (8,): the 8 treated weights)",
    ),
    (
        "m2-inf",
        "m2",
        lambda state: state["m2"].index_fill(0, torch.tensor([0]), math.inf),
        ValueError,
        "m2 holds NaN or infinity (expected finite values, as record() keeps them)",
    ),
    (
        "m2-negative",
        "m2",
        negative_m2,
        ValueError,
        "m2 with minimum -1.5 (expected values >= 0: the sums of squared deviations from the mean)",
    ),
    (
        "deviations-shape",
        "deviations",
        torch.zeros(3, 7),
        ValueError,
        "deviations of shape (3, 7) (expected shape (3, 8): rank=3 x the 8 treated weights)",
    ),
    (
        "deviations-dtype",
        "deviations",
        lambda state: state["deviations"].half(),
        ValueError,
        "deviations of dtype torch.float16 (expected torch.float64, the dtype of the treated "
        "parameters)",
    ),
    (
        "deviations-nan",
        "deviations",
        lambda state: state["deviations"] * math.nan,
        ValueError,
        "deviations holds NaN or infinity (expected finite values, as record() keeps them)",
    ),
    ("count-negative", "count", -3, ValueError, "count=-3 (expected an integer >= 0)"),
    ("count-float", "count", 5.0, TypeError, "count=5.0 (expected an integer >= 0)"),
    ("count-bool", "count", True, TypeError, "count=True (expected an integer >= 0)"),
    (
        "stored-above-rank",
        "stored",
        10,
        ValueError,
        "stored=10 (expected 3 = min(count, rank): the deviations kept of count=5 records "
        "with rank=3)",
    ),
    (
        "stored-below",
        "stored",
        2,
        ValueError,
        "stored=2 (expected 3 = min(count, rank): the deviations kept of count=5 records "
        "with rank=3)",
    ),
    ("stored-negative", "stored", -1, ValueError, "stored=-1 (expected an integer >= 0)"),
    (
        "next",
        "next",
        0,
        ValueError,
        "next=0 (expected 2 = count mod rank (0 for rank 0): the ring buffer's next slot after "
        "count=5 records with rank=3)",
    ),
    (
        "names",
        "names",
        ("bias", "weight"),
        ValueError,
        "names=('bias', 'weight') (expected ('weight', 'bias'), this SWAG's treated names)",
    ),
    (
        "names-str",
        "names",
        "weight",
        ValueError,
        "names='weight' (expected ('weight', 'bias'), this SWAG's treated names)",
    ),
]


@pytest.mark.parametrize(
    ("field", "value", "error", "message"),
    [case[1:] for case in INVALID_STATES],
    ids=[case[0] for case in INVALID_STATES],
)
def test_load_state_dict_refuses_an_invalid_field_and_changes_nothing(field, value, error, message):
    """Each field is validated as the constructor validates its arguments; a refused state
    leaves the statistics (and the draws) exactly as they were."""
    swag = recorded_swag()
    before = swag.state_dict()
    draws = swag.sample(3, generator=torch.Generator().manual_seed(0))
    state = swag.state_dict()
    state[field] = value(state) if callable(value) else value
    with pytest.raises(error, match="^" + re.escape("Invalid state_dict: " + message) + "$"):
        swag.load_state_dict(state)
    assert_same_state(before, swag.state_dict())
    again = swag.sample(3, generator=torch.Generator().manual_seed(0))
    assert all(torch.equal(draws[name], again[name]) for name in draws)


def test_load_state_dict_refuses_states_no_record_sequence_produces():
    """Counts of 0 and 1 fix the statistics: zeros before the first record, m2 = 0 after it."""
    swag = recorded_swag()
    before = swag.state_dict()
    empty = SWAG(nn.Linear(3, 2), rank=3).state_dict()
    message = (
        "Invalid state_dict: nonzero mean at count=0 (expected zeros, as before the first record)"
    )
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        swag.load_state_dict({**empty, "mean": torch.ones(8)})
    one = recorded_swag(count=1).state_dict()
    message = (
        "Invalid state_dict: m2 with maximum 2.0 at count=1 (expected zeros: the squared "
        "deviations of at most one record sum to 0)"
    )
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        swag.load_state_dict({**one, "m2": torch.full((8,), 2.0)})
    state = swag.state_dict()
    del state["m2"], state["next"]
    message = (
        "Invalid state_dict: missing field(s) ['m2', 'next'] (expected a state from "
        "SWAG.state_dict)"
    )
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        swag.load_state_dict(state)
    message = "Invalid state_dict: list (expected a mapping from SWAG.state_dict)"
    with pytest.raises(TypeError, match="^" + re.escape(message) + "$"):
        swag.load_state_dict([])
    assert_same_state(before, swag.state_dict())


def test_loaded_state_is_a_copy():
    """Changing the state after loading it does not change the SWAG."""
    source = recorded_swag()
    state = source.state_dict()
    target = SWAG(nn.Linear(3, 2), rank=3)
    target.load_state_dict(state)
    expected = target.state_dict()
    state["mean"].add_(1.0)
    state["deviations"].zero_()
    assert_same_state(expected, target.state_dict())


def test_subset_and_errors():
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    swag = SWAG(model, subset="last_layer")
    assert swag.treated.names == ("2.weight", "2.bias")
    with pytest.raises(
        RuntimeError,
        match=re.escape("SWAG has 0 record(s): call record() after optimizer steps (at least 1"),
    ):
        _ = swag.mean
    swag.record()
    with pytest.raises(RuntimeError, match=re.escape("SWAG has 1 record(s)")):
        swag.sample(2)
    with pytest.raises(KeyError, match=re.escape("Invalid params: missing ['2.bias']")):
        swag.record({"2.weight": torch.zeros(2, 4)})
    with pytest.raises(
        ValueError, match=re.escape("Invalid params: non-finite values at record 2")
    ):
        swag.record({"2.weight": torch.full((2, 4), math.nan), "2.bias": torch.zeros(2)})
    with pytest.raises(ValueError, match=re.escape("Invalid rank: -1 (expected an integer >= 0")):
        SWAG(model, rank=-1)
    with pytest.raises(ValueError, match=re.escape("Invalid temperature: -1.0")):
        SWAG(model, temperature=-1.0)
    with pytest.raises(TypeError, match=re.escape("Invalid linear: 1 (expected True or False)")):
        swag.predict(torch.zeros(1, 3), linear=1)
