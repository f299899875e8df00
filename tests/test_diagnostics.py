"""Tests for samplers_as_optim.diagnostics (and the rank helpers in _ranks).

arviz-stats is the reference implementation: every statistic must equal it to 1e-6
(relative) on float64 input, on data chosen to reach every branch: fast and slow mixing
(the direct-lag stages and the FFT fallback), antithetic chains, ties, odd draw counts,
heavy tails, NaN, infinities and constant quantities. Known-distribution tests check the
statistics mean what they should (AR(1) ESS, shifted and rescaled chains).
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import scipy.stats
import torch
from arviz_stats.base import array_stats  # test-only reference (arviz-stats >= 0.8)
from hypothesis import given, settings
from hypothesis import strategies as st

from samplers_as_optim import diagnostics
from samplers_as_optim.samples import ranks as _ranks
from samplers_as_optim.samples import rhat_ess

RHAT_METHODS = {"rank": "rank", "bulk": "z_scale", "folded": "folded", "split": "split"}
TOL = 1e-6


@pytest.fixture(params=[True, False], ids=["numpy-sort", "torch-sort"])
def sort_backend(request, monkeypatch):
    """Run a test with NumPy's vectorised sorts and with torch.sort (both must agree)."""
    monkeypatch.setattr(_ranks, "USE_NUMPY", request.param and _ranks._np is not None)
    return request.param


def ar1(rng, chains, draws, phis, *, dtype=np.float64):
    """Stationary AR(1) chains [chains, draws, len(phis)], unit marginal variance."""
    phis = np.asarray(phis, dtype=np.float64)
    noise = rng.standard_normal((chains, draws, phis.size))
    x = np.empty_like(noise)
    x[:, 0] = noise[:, 0]
    scale = np.sqrt(1 - phis**2)
    for t in range(1, draws):
        x[:, t] = phis * x[:, t - 1] + scale * noise[:, t]
    return x.astype(dtype)


def reference_rhat(x, method):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return array_stats.rhat(x, chain_axis=0, draw_axis=1, method=RHAT_METHODS[method])


def reference_ess(x, method, prob=0.05):
    kwargs = {"prob": prob} if method == "tail" else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return array_stats.ess(x, chain_axis=0, draw_axis=1, method=method, **kwargs)


def reference_nested(x, ids, method):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return array_stats.rhat_nested(
            x, np.asarray(ids), chain_axis=0, draw_axis=1, method=RHAT_METHODS[method]
        )


def assert_matches(ours, reference, *, rtol=TOL):
    ours = ours.double().numpy().reshape(np.shape(reference))
    reference = np.asarray(reference, dtype=np.float64)
    np.testing.assert_array_equal(np.isnan(ours), np.isnan(reference))
    # A quantity constant within every chain has W = 0: we return inf, ArviZ returns inf
    # or a rounding-noise value ~1e15 depending on how its variance rounds.
    huge = (ours > 1e10) & (reference > 1e10)
    keep = ~np.isnan(ours) & ~huge
    np.testing.assert_allclose(ours[keep], reference[keep], rtol=rtol, atol=0)


def datasets():
    rng = np.random.default_rng(20240601)
    # Quantities that mix at very different speeds in one call, so the adaptive lag
    # stages (4, 8, 16 lags, then FFT) each keep a different subset.
    phis = [-0.6, -0.2, 0.0, 0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 0.97, 0.995]
    mixed_speeds = ar1(rng, 4, 300, phis)
    shifted = rng.standard_normal((4, 200, 6)) + np.arange(4).reshape(4, 1, 1) * 0.25
    scaled = rng.standard_normal((4, 200, 6)) * np.array([1.0, 1.0, 1.0, 2.5]).reshape(4, 1, 1)
    ties = rng.integers(0, 5, size=(4, 80, 6)).astype(np.float64)
    heavy = rng.standard_cauchy((4, 150, 6))
    odd = rng.standard_normal((3, 101, 5))
    antithetic = np.cumprod(-np.ones((4, 120, 3)), axis=1) + 0.2 * rng.standard_normal((4, 120, 3))
    shortest = rng.standard_normal((2, 4, 5))
    # Short, slowly mixing chains: Geyer's loop often stops at its length bound.
    short_walks = 0.3 * rng.standard_normal((4, 12, 60)).cumsum(axis=1) + rng.standard_normal(
        (4, 12, 60)
    )
    matrix_shaped = rng.standard_normal((4, 60, 2, 3))
    return {
        "mixed_speeds": mixed_speeds,
        "shifted": shifted,
        "scaled": scaled,
        "ties": ties,
        "heavy": heavy,
        "odd": odd,
        "antithetic": antithetic,
        "shortest": shortest,
        "short_walks": short_walks,
        "matrix_shaped": matrix_shaped,
    }


DATASETS = datasets()


# --------------------------------------------------------------------------- vs arviz


@pytest.mark.parametrize("name", sorted(DATASETS))
@pytest.mark.parametrize("method", sorted(RHAT_METHODS))
def test_rhat_matches_arviz(name, method, sort_backend):
    x = DATASETS[name]
    ours = diagnostics.rhat(torch.from_numpy(x), method=method)
    assert ours.shape == x.shape[2:]
    assert ours.dtype == torch.float64
    assert_matches(ours, reference_rhat(x, method))


@pytest.mark.parametrize("name", sorted(DATASETS))
@pytest.mark.parametrize("method", ["bulk", "tail", "mean"])
def test_ess_matches_arviz(name, method, sort_backend):
    x = DATASETS[name]
    ours = diagnostics.ess(torch.from_numpy(x), method=method)
    assert ours.shape == x.shape[2:]
    assert_matches(ours, reference_ess(x, method))


@pytest.mark.parametrize("prob", [0.01, 0.1, 0.3])
def test_tail_ess_matches_arviz_for_other_probabilities(prob):
    x = DATASETS["mixed_speeds"]
    ours = diagnostics.ess(torch.from_numpy(x), method="tail", prob=prob)
    assert_matches(ours, reference_ess(x, "tail", prob))


@pytest.mark.parametrize("method", sorted(RHAT_METHODS))
@pytest.mark.parametrize(
    "superchains, ids",
    [
        (4, [0, 0, 1, 1, 2, 2, 3, 3]),
        (2, [0, 0, 0, 0, 1, 1, 1, 1]),
        ([7, 3, 7, 3, 5, 9, 5, 9], None),  # unordered, arbitrary ids
        (8, list(range(8))),  # one chain per superchain
    ],
)
def test_nested_rhat_matches_arviz(method, superchains, ids, sort_backend):
    rng = np.random.default_rng(7)
    x = ar1(rng, 8, 40, [0.0, 0.5, 0.9, 0.99])
    x[:4] += 0.3  # some superchain structure to detect
    if ids is None:
        ids = np.unique(superchains, return_inverse=True)[1]
    ours = diagnostics.nested_rhat(torch.from_numpy(x), superchains, method=method)
    assert_matches(ours, reference_nested(x, ids, method))


def test_nested_rhat_accepts_tensor_ids():
    x = torch.from_numpy(DATASETS["shifted"])
    ids = torch.tensor([1, 0, 1, 0])
    expected = reference_nested(x.numpy(), [1, 0, 1, 0], "rank")
    assert_matches(diagnostics.nested_rhat(x, ids), expected)


def test_diagnose_equals_separate_calls_and_arviz(sort_backend):
    x = torch.from_numpy(DATASETS["mixed_speeds"])
    result = diagnostics.diagnose(x)
    assert isinstance(result, diagnostics.Diagnostics)
    torch.testing.assert_close(result.rhat, diagnostics.rhat(x), rtol=0, atol=0)
    torch.testing.assert_close(result.ess_bulk, diagnostics.ess(x), rtol=0, atol=0)
    torch.testing.assert_close(result.ess_tail, diagnostics.ess(x, method="tail"), rtol=0, atol=0)
    assert_matches(result.rhat, reference_rhat(x.numpy(), "rank"))
    assert_matches(result.ess_bulk, reference_ess(x.numpy(), "bulk"))
    assert_matches(result.ess_tail, reference_ess(x.numpy(), "tail"))


def test_diagnose_with_odd_draws_uses_unsplit_quantiles():
    x = DATASETS["odd"]
    result = diagnostics.diagnose(torch.from_numpy(x), prob=0.1)
    assert_matches(result.ess_tail, reference_ess(x, "tail", 0.1))


@pytest.mark.parametrize("chunk_size", [1, 4, 1000])
def test_chunking_does_not_change_results(chunk_size):
    x = torch.from_numpy(DATASETS["mixed_speeds"])
    whole = diagnostics.diagnose(x)
    chunked = diagnostics.diagnose(x, chunk_size=chunk_size)
    for ours, reference in zip(chunked, whole, strict=True):  # batched reductions: ~1e-15
        torch.testing.assert_close(ours, reference, rtol=1e-12, atol=0)


def test_float32_samples_match_arviz_on_float32():
    rng = np.random.default_rng(3)
    x = ar1(rng, 4, 400, np.linspace(-0.3, 0.95, 40), dtype=np.float32)
    result = diagnostics.diagnose(torch.from_numpy(x))
    assert result.rhat.dtype == torch.float32
    assert_matches(result.rhat, reference_rhat(x, "rank"), rtol=1e-5)
    assert_matches(result.ess_bulk, reference_ess(x, "bulk"), rtol=1e-4)
    assert_matches(result.ess_tail, reference_ess(x, "tail"), rtol=1e-4)


def test_integer_samples_are_ranked_like_arviz():
    x = np.random.default_rng(5).integers(-3, 3, size=(4, 50, 4))
    ours = diagnostics.rhat(torch.from_numpy(x))
    assert ours.dtype == torch.float64
    assert_matches(ours, reference_rhat(x.astype(np.float64), "rank"))


# --------------------------------------------------------------------------- semantics


def test_nan_draws_give_nan_only_for_their_quantity(sort_backend):
    x = DATASETS["shifted"].copy()
    x[2, 17, 1] = np.nan
    samples = torch.from_numpy(x)
    for method in RHAT_METHODS:
        ours = diagnostics.rhat(samples, method=method)
        assert torch.isnan(ours[1]) and not torch.isnan(ours[[0, 2, 3, 4, 5]]).any()
        assert_matches(ours, reference_rhat(x, method))
    for method in ("bulk", "tail", "mean"):
        assert_matches(diagnostics.ess(samples, method=method), reference_ess(x, method))


def test_nan_in_dropped_middle_draw_still_gives_nan():
    x = DATASETS["odd"].copy()
    x[1, 50, 0] = np.nan  # the middle draw of 101, which split chains drop
    assert torch.isnan(diagnostics.rhat(torch.from_numpy(x))[0])
    assert torch.isnan(diagnostics.ess(torch.from_numpy(x), method="tail")[0])


def test_constant_and_infinite_quantities_match_arviz(sort_backend):
    rng = np.random.default_rng(11)
    x = rng.standard_normal((4, 60, 5))
    x[:, :, 0] = 2.5  # constant: R-hat NaN, ESS = number of draws
    x[:, :, 1] = np.arange(4).reshape(4, 1)  # constant within chains: R-hat inf
    x[1, 5, 2] = np.inf
    x[2, 9, 2] = -np.inf
    # Equally many -1 and +1 in every chain: the median is 0, so every folded draw is 1 and
    # folded R-hat is NaN while bulk R-hat is not; rank R-hat must then be the bulk value.
    x[:, :, 3] = rng.permuted(
        np.repeat([[-1.0, 1.0]], 30, axis=0).reshape(1, 60).repeat(4, 0), axis=1
    )
    samples = torch.from_numpy(x)
    for method in RHAT_METHODS:
        assert_matches(diagnostics.rhat(samples, method=method), reference_rhat(x, method))
    for method in ("bulk", "tail", "mean"):
        assert_matches(diagnostics.ess(samples, method=method), reference_ess(x, method))
    assert math.isnan(diagnostics.rhat(samples)[0])
    assert diagnostics.ess(samples)[0] == 4 * 60
    assert math.isnan(diagnostics.rhat(samples, method="folded")[3])
    assert diagnostics.rhat(samples)[3] == diagnostics.rhat(samples, method="bulk")[3]


def test_iid_chains_converge_and_separated_chains_do_not():
    g = torch.Generator().manual_seed(0)
    iid = torch.randn(4, 1000, 500, generator=g)
    r = diagnostics.rhat(iid)
    assert (r < 1.02).all()
    assert (r < 1.01).float().mean() > 0.9
    shifted = iid + torch.tensor([0.0, 0.0, 0.0, 0.5]).view(4, 1, 1)
    assert (diagnostics.rhat(shifted) > 1.01).all()


def test_folded_rhat_detects_a_chain_with_the_wrong_scale():
    """Vehtari et al. (2021), Section 1.2: same location, one chain with a third of the
    variance. Bulk R-hat misses it, folded (and hence rank) R-hat catches it."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 1000, 200, generator=g)
    x[0] *= math.sqrt(1 / 3)
    assert diagnostics.rhat(x, method="bulk").median() < 1.01
    assert (diagnostics.rhat(x, method="folded") > 1.01).float().mean() > 0.95
    assert (diagnostics.rhat(x) > 1.01).float().mean() > 0.95


@pytest.mark.parametrize("phi", [0.0, 0.5, 0.9])
def test_ess_of_ar1_matches_theory(phi):
    """The ESS of a stationary AR(1) chain is S (1 - phi) / (1 + phi)."""
    rng = np.random.default_rng(int(100 * phi))
    x = ar1(rng, 4, 1000, np.full(100, phi))
    expected = 4000 * (1 - phi) / (1 + phi)
    for method in ("mean", "bulk"):
        mean_ess = diagnostics.ess(torch.from_numpy(x), method=method).mean().item()
        assert mean_ess == pytest.approx(expected, rel=0.06)


def test_nested_rhat_for_many_short_chains():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(256, 8, 20, generator=g)  # 256 chains of 8 draws
    assert (diagnostics.nested_rhat(x, 16) < 1.01).all()
    offsets = torch.randn(16, generator=g).repeat_interleave(16).view(256, 1, 1)
    assert (diagnostics.nested_rhat(x + offsets, 16) > 1.1).all()


# --------------------------------------------------------------------------- summaries


def test_summary_hand_computed():
    values = torch.tensor([1.0, 1.004, 1.02, 1.07, 1.3, math.inf, math.nan])
    s = diagnostics.summary(values)
    assert (s.count, s.num_nan) == (6, 1)
    assert s.max == math.inf
    assert s.count_above == {1.01: 4, 1.05: 3, 1.1: 2}
    assert s.fraction_above == {1.01: 4 / 6, 1.05: 3 / 6, 1.1: 2 / 6}
    with np.errstate(invalid="ignore"):  # NumPy interpolates inf - inf = nan
        expected = np.nan_to_num(np.quantile(values[:6].numpy(), [0.5, 0.9, 0.99]), nan=np.inf)
    assert list(s.quantiles) == [0.5, 0.9, 0.99]
    assert list(s.quantiles.values()) == pytest.approx(list(expected))
    assert s.quantiles[0.99] == math.inf
    text = str(s)
    assert "6 quantities (1 NaN)" in text and "> 1.01: 66.67% (4)" in text


def test_summary_pools_dicts_and_custom_levels():
    s = diagnostics.summary(
        {"a": torch.tensor([[1.0, 1.2]]), "b": torch.tensor(1.03)},
        thresholds=(1.02,),
        quantiles=(0.5,),
    )
    assert s.count == 3 and s.count_above == {1.02: 2}
    assert s.quantiles == {0.5: pytest.approx(1.03)}


def test_summary_of_nothing_is_nan():
    s = diagnostics.summary(torch.tensor([math.nan]))
    assert s.count == 0 and s.num_nan == 1 and math.isnan(s.max)
    assert all(math.isnan(v) for v in s.fraction_above.values())


def test_weight_space_per_parameter():
    g = torch.Generator().manual_seed(3)
    stacked = {
        "layer.weight": torch.randn(4, 100, 3, 2, generator=g),
        "layer.bias": torch.randn(4, 100, 3, generator=g),
        "scale": torch.randn(4, 100, generator=g),
    }
    stacked["layer.bias"][0, :, 1] += 3.0  # one unconverged weight
    result = diagnostics.weight_space(stacked)
    for name, tensor in stacked.items():
        torch.testing.assert_close(result.rhat[name], diagnostics.rhat(tensor), rtol=0, atol=0)
        assert result.per_parameter[name].count == tensor[0, 0].numel()
    assert result.rhat["scale"].shape == torch.Size([])
    assert result.summary.count == 6 + 3 + 1
    assert result.summary.count_above[1.1] == 1
    assert result.per_parameter["layer.bias"].count_above[1.1] == 1


def test_function_space_takes_worst_output_per_input():
    g = torch.Generator().manual_seed(4)
    probs = torch.randn(4, 200, 6, 3, generator=g).softmax(dim=-1)
    probs[0, :, 2] = torch.tensor([0.9, 0.05, 0.05])  # input 2: one chain stuck, constant
    probs[:, :, 4, 1] = 0.25  # input 4: a constant output gives NaN, ignored by the max
    result = diagnostics.function_space(probs)
    r = diagnostics.rhat(probs)
    torch.testing.assert_close(result.rhat, r, rtol=0, atol=0, equal_nan=True)
    assert torch.isnan(r[4, 1])
    expected = torch.stack([row[~row.isnan()].max() for row in r])
    torch.testing.assert_close(result.per_input, expected, rtol=0, atol=0)
    assert result.per_input[2] > 1.1
    assert result.summary.count == 6 and result.summary.count_above[1.1] == 1


def test_function_space_for_scalar_predictions():
    g = torch.Generator().manual_seed(5)
    means = torch.randn(4, 100, 7, generator=g)
    result = diagnostics.function_space(means)
    torch.testing.assert_close(result.per_input, diagnostics.rhat(means), rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu():  # pragma: no cover - runs where a GPU is available
    x = torch.from_numpy(DATASETS["mixed_speeds"])
    on_cpu = diagnostics.diagnose(x)
    on_gpu = diagnostics.diagnose(x.cuda())
    for ours, reference in zip(on_gpu, on_cpu, strict=True):
        assert ours.device.type == "cuda"
        torch.testing.assert_close(ours.cpu(), reference, rtol=1e-12, atol=0)


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: diagnostics.rhat([[1.0]]), TypeError, r"Invalid samples: list \(expected a"),
        (lambda: diagnostics.rhat(torch.zeros(5)), ValueError, r"shape \(5,\) \(expected at"),
        (
            lambda: diagnostics.rhat(torch.zeros(2, 8, dtype=torch.complex64)),
            TypeError,
            r"dtype torch.complex64 \(expected real numbers\)",
        ),
        (
            lambda: diagnostics.rhat(torch.zeros(1, 8)),
            ValueError,
            r"Invalid samples: 1 chain\(s\) \(expected at least 2 for R-hat",
        ),
        (
            lambda: diagnostics.ess(torch.zeros(1, 3)),
            ValueError,
            r"Invalid samples: 3 draws per chain \(expected at least 4",
        ),
        (
            lambda: diagnostics.rhat(torch.zeros(2, 8), method="z_scale"),
            ValueError,
            r"Invalid method: 'z_scale' \(expected one of 'rank', 'bulk', 'folded', 'split'\)",
        ),
        (
            lambda: diagnostics.ess(torch.zeros(2, 8), method="quantile"),
            ValueError,
            r"Invalid method: 'quantile' \(expected one of 'bulk', 'tail', 'mean'\)",
        ),
        (
            lambda: diagnostics.ess(torch.zeros(2, 8), method="tail", prob=1.0),
            ValueError,
            r"Invalid prob: 1.0 \(expected a number in \(0, 1\)\)",
        ),
        (
            lambda: diagnostics.ess(torch.zeros(2, 8), method="tail", prob="5%"),
            TypeError,
            r"Invalid prob: '5%' \(expected a number in \(0, 1\)\)",
        ),
        (
            lambda: diagnostics.nested_rhat(torch.zeros(1, 8), 1),
            ValueError,
            r"Invalid samples: 1 chain\(s\) \(expected at least 2 for nested R-hat",
        ),
        (
            lambda: diagnostics.diagnose(torch.zeros(2, 8), prob=math.nan),
            ValueError,
            r"Invalid prob: nan",
        ),
        (
            lambda: diagnostics.rhat(torch.zeros(2, 8), chunk_size=0),
            ValueError,
            r"Invalid chunk_size: 0 \(expected None or an integer >= 1\)",
        ),
        (
            lambda: diagnostics.rhat(torch.zeros(2, 8), chunk_size=True),
            TypeError,
            r"Invalid chunk_size: True \(expected None or an integer >= 1\)",
        ),
        (
            lambda: diagnostics.nested_rhat(torch.zeros(6, 8), 4),
            ValueError,
            r"Invalid superchains: 4 \(expected a divisor of the number of chains, 6, that is",
        ),
        (
            lambda: diagnostics.nested_rhat(torch.zeros(6, 8), 1),
            ValueError,
            r"Invalid superchains: 1 \(expected a divisor",
        ),
        (
            lambda: diagnostics.nested_rhat(torch.zeros(4, 8), True),
            TypeError,
            r"Invalid superchains: True \(expected a number of superchains",
        ),
        (
            lambda: diagnostics.nested_rhat(torch.zeros(4, 8), [0, 0, 1]),
            ValueError,
            r"Invalid superchains: \[0, 0, 1\] \(expected 4 integer ids, one per chain\)",
        ),
        (
            lambda: diagnostics.nested_rhat(torch.zeros(4, 8), [0.0, 0.0, 1.0, 1.0]),
            ValueError,
            r"expected 4 integer ids",
        ),
        (
            lambda: diagnostics.nested_rhat(torch.zeros(4, 8), [0, 0, 0, 1]),
            ValueError,
            r"\(expected at least 2 superchains, each with the same number of chains\)",
        ),
        (
            lambda: diagnostics.nested_rhat(torch.zeros(4, 8), [3, 3, 3, 3]),
            ValueError,
            r"expected at least 2 superchains",
        ),
        (
            lambda: diagnostics.nested_rhat(torch.zeros(4, 8), "abcd"),
            TypeError,
            r"Invalid superchains: 'abcd' \(expected a number of superchains or one integer",
        ),
        (
            lambda: diagnostics.summary([1.0, 1.2]),
            TypeError,
            r"Invalid rhat_values: list \(expected a tensor or a dict of tensors\)",
        ),
        (
            lambda: diagnostics.summary(torch.ones(3), thresholds=(math.inf,)),
            ValueError,
            r"Invalid threshold: inf \(expected a finite number\)",
        ),
        (
            lambda: diagnostics.summary(torch.ones(3), quantiles=(1.0,)),
            ValueError,
            r"Invalid quantile: 1.0 \(expected a number in \(0, 1\)\)",
        ),
        (
            lambda: diagnostics.weight_space([torch.zeros(2, 8)]),
            TypeError,
            r"Invalid stacked: list \(expected a dict of tensors",
        ),
        (
            lambda: diagnostics.weight_space({}),
            ValueError,
            r"Invalid stacked: \{\} \(expected at least one parameter\)",
        ),
        (
            lambda: diagnostics.weight_space({"a": torch.zeros(2, 8), "b": torch.zeros(2, 9)}),
            ValueError,
            r"leading shapes \{'a': \(2, 8\), 'b': \(2, 9\)\} \(expected every tensor to share",
        ),
        (
            lambda: diagnostics.weight_space({"w": torch.zeros(1, 8, 3)}),
            ValueError,
            r"Invalid stacked\['w'\]: 1 chain\(s\)",
        ),
        (
            lambda: diagnostics.function_space(torch.zeros(2, 8)),
            ValueError,
            r"Invalid predictions: shape \(2, 8\) \(expected \[chains, draws, B, \*outputs\]",
        ),
        (
            lambda: diagnostics.function_space(np.zeros((2, 8, 3))),
            TypeError,
            r"Invalid predictions: ndarray",
        ),
    ],
)
def test_errors(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_one_chain_is_enough_for_ess():
    x = torch.from_numpy(DATASETS["mixed_speeds"][:1])
    assert_matches(diagnostics.ess(x), reference_ess(x.numpy(), "bulk"))


# --------------------------------------------------------------------------- _ranks


def test_packed_sort_handles_special_values():
    y = torch.tensor(
        [[0.0, -0.0, math.inf, -math.inf, 1e-45, -1e-45, 3.4e38, -3.4e38, 1.0, 1.0]]
    ).repeat(3, 1)
    y[1] = y[1].flip(0)
    values, order = _ranks.sort_rows(y)
    torch.testing.assert_close(values, torch.sort(y, dim=-1).values, rtol=0, atol=0)
    torch.testing.assert_close(y.gather(1, order), values, rtol=0, atol=0)
    assert sorted(order[0].tolist()) == list(range(10))


@settings(max_examples=60, deadline=None)
@given(
    data=st.lists(st.integers(-4, 4), min_size=2, max_size=40),
    scale=st.sampled_from([1.0, 0.1, 1e-30, 1e30]),
    use_numpy=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_normal_scores_equal_scipy_ranks(data, scale, use_numpy, dtype):
    """Blom scores of average ranks, ties included, for both sort backends."""
    previous = _ranks.USE_NUMPY
    _ranks.USE_NUMPY = use_numpy and _ranks._np is not None
    try:
        y = torch.tensor([data, data[::-1]], dtype=dtype) * scale
        scores, values = _ranks.normal_scores(y, dtype=torch.float64)
    finally:
        _ranks.USE_NUMPY = previous
    # the reference in float64 whatever y's dtype (newer SciPy keeps float32 through
    # rankdata and ppf, a reference that is then only float32-accurate)
    ranks = scipy.stats.rankdata(y.numpy(), axis=-1).astype(np.float64)
    expected = scipy.stats.norm.ppf((ranks - 0.375) / (len(data) + 0.25))
    np.testing.assert_allclose(scores.numpy(), expected, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(values.numpy(), np.sort(y.numpy(), axis=-1))
    average = _ranks.average_ranks(values)
    np.testing.assert_array_equal(average.numpy(), np.sort(ranks, axis=-1))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_linear_quantile_reproduces_numpy_bit_for_bit(dtype):
    rng = np.random.default_rng(9)
    x = np.sort(rng.standard_normal((200, 37)).astype(dtype), axis=-1)
    for prob in (0.05, 0.3, 0.5, 0.95, 0.999):
        ours = rhat_ess.linear_quantile(torch.from_numpy(x), prob).numpy()
        np.testing.assert_array_equal(ours, np.quantile(x, prob, axis=-1))
