"""HMC on a Bayesian logistic regression against a long NUTS run (Pyro).

The reference (``tests/data/logreg_nuts_reference.json``, made once by
``tests/data/make_logreg_nuts_reference.py``) holds the posterior mean, standard
deviation and the Monte Carlo standard error of the mean of each coefficient. Here 16
parallel HMC chains (one ``[16, 6]`` parameter, one loss per chain) warm up with dual
averaging, then draw 250 transitions each. Each posterior mean must agree within
Z_MAX = 4.5 combined standard errors (ours from the bulk ESS of our draws, the
reference's stored); each standard deviation within 4.5 standard errors of an sd
estimate, sd / sqrt(2 ESS) (normal approximation), of both runs combined.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from sklearn.datasets import load_breast_cancer

from samplers_as_optim import HMC, diagnostics

REFERENCE = Path(__file__).parent / "data" / "logreg_nuts_reference.json"
FEATURES = (1, 4, 8, 20, 26)  # as in the reference's generator
Z_MAX = 4.5


def problem() -> tuple[torch.Tensor, torch.Tensor]:
    data = load_breast_cancer()
    x = np.asarray(data.data, dtype=np.float64)[:, FEATURES]
    x = (x - x.mean(0)) / x.std(0, ddof=1)
    x = np.concatenate([x, np.ones((x.shape[0], 1))], axis=1)
    return torch.from_numpy(x), torch.from_numpy(np.asarray(data.target, dtype=np.float64))


@pytest.mark.slow
def test_logistic_regression_matches_nuts() -> None:
    reference = json.loads(REFERENCE.read_text())
    x, y = problem()
    n, d = x.shape
    chains, warmup, draws = 16, 150, 250
    w = torch.nn.Parameter(torch.zeros(chains, d, dtype=torch.float64))
    # prior N(0, 1) on every coefficient: weight_decay = 1 / (N sigma^2)
    opt = HMC(
        [w],
        lr=0.5,
        num_steps=6,
        num_data=n,
        weight_decay=1.0 / n,
        seed=0,
        jitter=0.2,
        target_accept=0.8,
    )

    def closure() -> torch.Tensor:
        opt.zero_grad()
        logits = w @ x.T
        losses = torch.nn.functional.binary_cross_entropy_with_logits(
            logits, y.expand_as(logits), reduction="none"
        ).mean(-1)
        losses.sum().backward()
        return losses

    opt.warmup(closure, warmup)
    samples = torch.empty(chains, draws, d, dtype=torch.float64)
    accept = 0.0
    for t in range(draws):
        opt.step(closure)
        samples[:, t] = w.detach()
        accept += float(opt.diagnostics["accept_prob"].mean()) / draws
    assert accept > 0.6
    assert int(opt.diagnostics["divergences"].sum()) == 0
    assert float(diagnostics.rhat(samples).max()) < 1.05

    ess = diagnostics.ess(samples)
    mean, sd = samples.reshape(-1, d).mean(0), samples.reshape(-1, d).std(0)
    ref_mean = torch.tensor(reference["mean"], dtype=torch.float64)
    ref_sd = torch.tensor(reference["sd"], dtype=torch.float64)
    ref_mcse = torch.tensor(reference["mcse_mean"], dtype=torch.float64)
    ref_ess = (ref_sd / ref_mcse) ** 2
    z_mean = (mean - ref_mean) / torch.sqrt(sd**2 / ess + ref_mcse**2)
    z_sd = (sd - ref_sd) / torch.sqrt(sd**2 / (2 * ess) + ref_sd**2 / (2 * ref_ess))
    assert z_mean.abs().max() < Z_MAX, (mean, ref_mean, z_mean)
    assert z_sd.abs().max() < Z_MAX, (sd, ref_sd, z_sd)
    assert math.isclose(float(ess.min()), float(ess.min()))  # finite
