"""Make ``logreg_nuts_reference.json``: a long NUTS run (Pyro) on a small logistic regression.

The problem (shared with ``tests/test_hmc_logreg.py``): scikit-learn's breast-cancer data
(569 examples), five features standardised (float64 mean, unbiased sd) and an intercept,
labels in {0, 1}, prior N(0, 1) on all six coefficients. Run once::

    python tests/data/make_logreg_nuts_reference.py

It writes the posterior mean, standard deviation and the Monte Carlo standard error of
the mean (sd / sqrt(ESS), ESS from Pyro's bulk estimate) per coefficient: about 1 KB.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import pyro
import pyro.distributions as dist
import torch
from pyro.infer import MCMC, NUTS
from pyro.ops.stats import effective_sample_size, split_gelman_rubin
from sklearn.datasets import load_breast_cancer

FEATURES = (1, 4, 8, 20, 26)  # mean texture, smoothness, symmetry; worst radius, concavity
OUT = Path(__file__).with_name("logreg_nuts_reference.json")
CHAINS, WARMUP, SAMPLES = 4, 500, 2500


def problem() -> tuple[torch.Tensor, torch.Tensor]:
    """Design matrix [569, 6] (intercept last) and labels, float64."""
    data = load_breast_cancer()
    x = np.asarray(data.data, dtype=np.float64)[:, FEATURES]
    x = (x - x.mean(0)) / x.std(0, ddof=1)
    x = np.concatenate([x, np.ones((x.shape[0], 1))], axis=1)
    return torch.from_numpy(x), torch.from_numpy(np.asarray(data.target, dtype=np.float64))


def model(x: torch.Tensor, y: torch.Tensor) -> None:
    w = pyro.sample("w", dist.Normal(torch.zeros(x.shape[1], dtype=x.dtype), 1.0).to_event(1))
    pyro.sample("y", dist.Bernoulli(logits=x @ w).to_event(1), obs=y)


def main() -> None:
    torch.set_default_dtype(torch.float64)
    x, y = problem()
    draws = []
    start = time.perf_counter()
    for chain in range(CHAINS):
        pyro.set_rng_seed(chain)
        kernel = NUTS(model, target_accept_prob=0.9, jit_compile=True, ignore_jit_warnings=True)
        mcmc = MCMC(kernel, num_samples=SAMPLES, warmup_steps=WARMUP, disable_progbar=True)
        mcmc.run(x, y)
        draws.append(mcmc.get_samples()["w"])
    w = torch.stack(draws)  # [chains, samples, 6]
    ess = effective_sample_size(w, chain_dim=0, sample_dim=1)
    rhat = split_gelman_rubin(w, chain_dim=0, sample_dim=1)
    flat = w.reshape(-1, w.shape[-1])
    mean, sd = flat.mean(0), flat.std(0)
    reference = {
        "problem": "sklearn load_breast_cancer, features "
        f"{list(FEATURES)} standardised (float64, unbiased sd) + intercept (last), "
        "logistic regression, prior N(0, 1) on all 6 coefficients, N = 569",
        "method": f"Pyro {pyro.__version__} NUTS (target_accept_prob 0.9, jit), {CHAINS} chains x "
        f"{SAMPLES} draws after {WARMUP} warm-up, seeds 0..{CHAINS - 1} "
        "(tests/data/make_logreg_nuts_reference.py)",
        "max_rhat": round(float(rhat.max()), 5),
        "min_ess": round(float(ess.min()), 1),
        "mean": [round(float(v), 6) for v in mean],
        "sd": [round(float(v), 6) for v in sd],
        "mcse_mean": [round(float(v), 6) for v in sd / ess.sqrt()],
    }
    OUT.write_text(json.dumps(reference, indent=1) + "\n")
    print(json.dumps(reference, indent=1), f"{time.perf_counter() - start:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
