"""The regression example in quick mode: diabetes, MAP / Laplace / SGHMC / AdamW twin / ensemble.

Runs ``examples/regression.py --quick`` once (seed 0) and checks that the table and the
figure are written and that each method beats the constant predictor by a margin: the
training mean with the targets' standard deviation (about 77) has RMSE ≈ 77 and
log-likelihood ≈ -log(77·√(2πe)) ≈ -5.76 per point; every method was seen at RMSE
46-56 and log-likelihood -5.45 to -5.28 per point in quick and full mode.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_regression_example_quick(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLES))
    regression = importlib.import_module("regression")
    figure = tmp_path / "regression.png"
    results = regression.main(["--quick", "--seed", "0", "--output", str(figure)])
    printed = capsys.readouterr().out
    assert "quick mode" in printed
    assert "test RMSE" in printed and "test log-lik / point" in printed
    for method in regression.METHODS:
        assert method in printed
    assert figure.read_bytes().startswith(PNG)
    summary = results["summary"]
    assert results["config"]["splits"] == len(results["per_split"]) >= 2
    for method in regression.METHODS:
        assert summary[method]["rmse"] < 65.0, method  # constant predictor: ~77
        assert summary[method]["ll"] > -5.6, method  # constant predictor: ~-5.76
    # the GLM predictive's mean is the MAP network's output: the same RMSE, split by split
    for rows in results["per_split"]:
        assert rows["Laplace (evidence)"]["rmse"] == pytest.approx(rows["MAP"]["rmse"], rel=1e-5)
        # the sampled noise stays near the MAP's (standardised units)
        for method in ("SGHMC", "AdamW twin"):
            assert 0.5 < rows[method]["sigma"] / rows["MAP"]["sigma"] < 2.0, method
