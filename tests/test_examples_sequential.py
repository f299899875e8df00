"""The continual-learning and Pyro logistic-regression examples, run in quick mode.

Each test runs the example's ``main(["--quick", ...])`` once (seed 0), checks that the
figure is written and the table printed, and asserts the qualitative result the example
demonstrates. The thresholds come from running quick and full mode over several seeds
(continual learning: quick and full, seeds 0-5; logistic regression: quick seeds 0-4,
full seeds 0-2); each comment gives the range observed over those seeds, so a margin is
a statement about that spread, not a value tuned to seed 0.
"""

from __future__ import annotations

import importlib
import math
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.fixture
def examples(monkeypatch):
    """Import an example module by name, with ``examples/`` on the path (for ``common``)."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    return importlib.import_module


@pytest.mark.slow
def test_continual_learning_laplace_prior_reduces_forgetting(examples, tmp_path, capsys):
    example = examples("continual_learning")
    figure = tmp_path / "continual.png"
    results = example.main(["--quick", "--seed", "0", "--output", str(figure)])

    assert figure.stat().st_size > 10_000
    printed = capsys.readouterr().out
    for word in ("method", "avg test loss", "SGD", "Laplace", "Offline"):
        assert word in printed

    loss = results["loss"]
    tasks = results["tasks"]
    for method in example.METHODS:
        assert loss[method].shape == (tasks, tasks)
        # tested on every task seen so far, and only on those
        seen = ~loss[method].isnan()
        assert torch.equal(seen, torch.ones(tasks, tasks, dtype=torch.bool).tril())
    rows = {row["method"]: row for row in results["rows"]}

    # Episode 1 is the same training for SGD and Laplace (same seed, N(0, σ²) prior).
    assert loss["Laplace"][0, 0] == loss["SGD"][0, 0]

    # Plain SGD forgets: its loss on task 1 at the end is many times its loss after
    # episode 1 (x26 to x44 in quick mode, x43 to x81 in full mode).
    assert loss["SGD"][-1, 0] > 10 * loss["SGD"][0, 0]

    # With the previous posterior as the prior, the earlier tasks keep a lower loss:
    # Laplace / SGD on tasks 1..T-1 after the last episode was 0.42-0.67 in quick mode
    # (0.24-0.39 in full mode).
    earlier = "loss, tasks 1..T-1"
    assert rows["Laplace"][earlier] < 0.8 * rows["SGD"][earlier]
    # ... and a higher average accuracy: +0.14 to +0.21 in quick mode (+0.25 to +0.41 full).
    assert rows["Laplace"]["avg accuracy"] > rows["SGD"]["avg accuracy"] + 0.08

    # The offline model, which sees all tasks so far, is best by far (avg loss 0.10-0.14
    # against Laplace's 1.29-1.68; accuracy >= 0.959).
    assert rows["Offline"]["avg test loss"] < 0.25 * rows["Laplace"]["avg test loss"]
    assert rows["Offline"]["avg accuracy"] > 0.9
    assert rows["Offline"]["avg accuracy"] > rows["Laplace"]["avg accuracy"]


@pytest.mark.slow
def test_pyro_logistic_regression_samplers_match_nuts(examples, tmp_path, capsys):
    example = examples("logistic_regression")
    figure = tmp_path / "logistic.png"
    results = example.main(["--quick", "--seed", "0", "--output", str(figure)])

    assert figure.stat().st_size > 10_000
    printed = capsys.readouterr().out
    for word in ("KSD", "energy distance", "NUTS", "SGHMC", "VI", "prior"):
        assert word in printed

    rows = {row["method"]: row for row in results["rows"]}
    full, minibatch, parallel = (
        "SGHMC (full batch)",
        "SGHMC (batch 32)",
        "parallel SGHMC (batch 32)",
    )
    mean_field, full_cov = "mean-field VI (batch 32)", "full-cov. VI (batch 32)"
    samples = results["samples"]
    for name, values in samples.items():
        assert values.shape == (results["settings"]["samples"], 8), name
        assert bool(values.isfinite().all()), name
    for row in rows.values():
        assert math.isfinite(row["KSD"]) and math.isfinite(row["energy distance"])

    # NUTS is a usable reference: its two chains agree (R-hat max 1.001-1.010, bulk-ESS
    # of the pooled chains >= 640 of 1000 draws, over seeds 0-4).
    assert results["nuts_rhat"].max() < 1.05
    assert results["nuts_ess"].min() > 300

    # The prior is the "knows nothing" baseline: energy distance ~16, KSD ~115-122.
    prior = rows["prior"]
    assert prior["energy distance"] > 5.0
    # Every sampler is far closer to NUTS than that. NUTS's own second chain scores
    # -0.004 to 0.003 (the U-statistic's noise floor); full-batch SGHMC -0.001 to 0.006;
    # minibatch SGHMC 0.006 to 0.028; parallel SGHMC -0.002 to 0.011; VI 0.015 to 0.040.
    assert rows[full]["energy distance"] < 0.02
    assert rows[minibatch]["energy distance"] < 0.06
    assert rows[parallel]["energy distance"] < 0.04
    for name in (full, minibatch, parallel, mean_field, full_cov):
        assert rows[name]["energy distance"] < 0.01 * prior["energy distance"], name
        # KSD: 0.69-2.6 for every method against the prior's > 100
        assert rows[name]["KSD"] < 0.05 * prior["KSD"], name

    # Mean-field VI underestimates the marginal variances (geometric-mean ratio to NUTS
    # 0.62-0.71); full-covariance VI does not (0.92-1.03), the gap being 0.24-0.33.
    assert rows[mean_field]["variance ratio"] < 0.85
    assert 0.8 < rows[full_cov]["variance ratio"] < 1.2
    assert rows[mean_field]["variance ratio"] < rows[full_cov]["variance ratio"] - 0.1
    # The SGHMC chains sample at about the right spread (0.91-1.12 over seeds).
    for name in (full, minibatch, parallel):
        assert 0.8 < rows[name]["variance ratio"] < 1.3, name
