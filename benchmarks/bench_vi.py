r"""Gaussian VI out of the box on a 31-parameter Bayesian logistic regression.

Usage:
    python benchmarks/bench_vi.py [--seeds 5] [--quick]      # the table (about 10 minutes)
    python benchmarks/bench_vi.py --make-reference [--nuts]  # recompute the reference

The problem (issue 10, item 5): scikit-learn's ``load_breast_cancer`` (N = 569, 30
features), features standardised (float64 mean and unbiased sd), an intercept, logistic
likelihood, prior N(0, 1) on all 31 coefficients (``prior_std=1.0``, ``num_data=569``).
The model is ``nn.Linear(30, 1)`` trained in float32, its treated parameters in
``named_parameters()`` order: the 30 weights, then the bias.

**Reference** (``--make-reference``, about 75 s, written to
``tests/data/breast_cancer_reference.json``, 4 KB). The posterior: a long
Metropolis-corrected HMC run, exact up to Monte Carlo error. The potential is
:math:`U(\theta) = \sum_i [\log(1 + e^{f_i}) - y_i f_i] + |\theta|^2/2`,
:math:`f_i = \phi_i^\top\theta`; sampling runs in the whitened coordinates
:math:`\theta = \hat\theta + Cz`, :math:`\hat\theta` the MAP (Newton), :math:`CC^\top` the
inverse Hessian there (a dense mass matrix; condition number 85 before whitening), with
64 chains started from N(0, I) in z, 6 leapfrog steps of a step size drawn uniformly in
[0.4, 0.6] per iteration and chain, 1000 warm-up iterations and 20000 kept, thinned by 5
(256000 draws; acceptance 0.87, R-hat <= 1.0006, ESS >= 295000). Stored: the mean and
sd, and their Monte Carlo standard errors (ESS of the package's ``diagnostics.ess``,
``method="mean"``, of θ and of :math:`(\theta - \bar\theta)^2`; the sd's by the delta
method): <= 0.0018 sd on the means, <= 0.25% on the sds. ``--nuts`` checks it against
Pyro's NUTS (4 chains x 2000 draws after 1000 warm-up, dense mass matrix, about 2.5
minutes): means within 0.035 sd (NUTS's own Monte Carlo error: 0.012 sd per
coefficient), sd ratios 0.981-1.018. Also stored: the exact optima of the VI objective
over all Gaussians (``full_vi_*``: sds 0.959-1.001 of the posterior's, means within 0.025
sd, objective 0.09749) and over diagonal ones (``mean_field_vi_*``: sds 0.434-0.709 of
the posterior's, the known mean-field shrinkage, means within 0.21 sd, objective
0.11856), by quadrature (:func:`gaussian_vi_optimum`).

**Runs**, each over ``--seeds`` seeds (seed s: ``torch.manual_seed(s)`` before the model
is built; the minibatch order and the draws follow the global RNG): the wrappers with
every default (``FullCovarianceVI(model, num_data=569, prior_std=1.0)``), Adam, one draw
per step, ``loss = F.binary_cross_entropy_with_logits(vi(x).squeeze(-1), y) +
vi.kl_loss()``, full batch or minibatches of 32 reshuffled each epoch (the README
recipe), cosine annealing to 0 over the run unless "constant". Columns: sd ratios q /
posterior (min / median / max over the 31 coefficients), the largest mean error in
posterior sds, the same against the family's exact optimum, and the final objective
(mean NLL + KL/N from 4096 fresh draws, closed-form KL; the optimum's is the floor). The
worst over seeds, the median sd ratio's median. The criterion of issue 10: every sd
ratio in [0.8, 1.25], every mean within 0.25 sd (for mean-field, of its optimum).
Measured (5 seeds, one shared CPU core)::

    run (wrapper defaults, Adam lr)       steps  sd / posterior     mean  sd / optimum  mean  obj.
    full, 1e-2 cosine, full batch          4000  0.893/0.973/1.030 0.069  0.902-1.030 0.067 0.09766
    mean-field, 1e-2 cosine, full batch    4000  0.415/0.589/0.738 0.172  0.917-1.098 0.118 0.11864
    README mean-field, 1e-2 cos, batch 32  7200  0.403/0.588/0.759 0.206  0.898-1.140 0.130 0.11870
    full, 1e-2 constant, full batch        4000  0.766/0.936/1.063 0.182  0.783-1.073 0.188 0.10285
    full, 1e-3 constant, full batch       20000  0.917/0.980/1.018 0.063  0.937-1.023 0.057 0.09780
    README full, 1e-2 cosine, batch 32     7200  0.734/0.924/1.016 0.063  0.755-1.016 0.069 0.09937
    full, 1e-1 cosine, full batch          4000  0.798/0.962/1.033 0.068  0.801-1.043 0.064 0.09815
    full stl=True, 1e-2 cos, full batch    4000  0.768/0.890/0.987 1.308  0.799-0.988 1.301 0.11024
    full stl=True, 5e-2 cos, full batch    4000  FloatingPointError (the guard) at steps 208-320

So: with the defaults and an annealed learning rate the full-covariance fit meets the
criterion with room (in 12 seeds of the first row: 0.892-1.030, means within 0.113 sd),
and mean-field VI reaches its own optimum, in full batch and with the README's
minibatches. A constant lr 1e-2 leaves the last iterate noisy (one sd at 0.77); a
constant 1e-3 converges but needs 20000 steps. Minibatches of 32 slow the full
covariance (0.73 after 400 epochs; 0.84 after 800). Stick-the-landing from the default
init_std 1e-3 hardly moves the mean (1.3 sd off after 4000 steps: its entropy-gradient
noise, of sd T/(N σ) on the mean, swamps the data gradient) and at lr 5e-2 drives L to
singular, which the guard now reports; the closed form (the default) survives lr 1e-1.

Before the fix (``FullCovarianceVI`` of the previous commit: ``L = tril(M) +
diag(exp(s))``, stick-the-landing, same defaults and Adam 1e-2 cosine, seed 0): loss -inf
at step 2, then NaN, in float32; in float64, objective -5e67, sd ratios 0.0013-3.3,
means 3.0 sd off (at a constant 1e-3: objective -2e45, sd ratios 0.0011-0.77).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from samplers_as_optim import diagnostics
from samplers_as_optim.gaussian.vi import FullCovarianceVI, MeanFieldVI

REFERENCE = Path(__file__).resolve().parents[1] / "tests" / "data" / "breast_cancer_reference.json"
PRIOR_STD = 1.0
BATCH = 32


def breast_cancer(dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """Standardised features ``[569, 30]`` and labels ``[569]`` (0./1.), in ``dtype``."""
    from sklearn.datasets import load_breast_cancer

    data = load_breast_cancer()
    x = torch.tensor(data.data, dtype=torch.float64)
    x = (x - x.mean(0)) / x.std(0)
    return x.to(dtype), torch.tensor(data.target, dtype=dtype)


def load_reference(path: Path = REFERENCE) -> dict[str, Tensor]:
    """The stored reference: name -> float64 tensor (``mean``, ``sd``, ...)."""
    stored = json.loads(path.read_text())
    return {
        key: torch.tensor(value, dtype=torch.float64) for key, value in stored["values"].items()
    }


# ----------------------------------------------------------------------------- reference
def make_reference(*, chains: int = 64, warmup: int = 1000, draws: int = 20000, thin: int = 5):
    """The long HMC run described in the module docstring; returns the JSON payload."""
    x, y = breast_cancer(torch.float64)
    phi = torch.cat([x, torch.ones(len(x), 1, dtype=torch.float64)], dim=1)
    size = phi.shape[1]

    def potential(theta: Tensor) -> Tensor:
        logits = theta @ phi.T
        nll = (F.softplus(logits) - y * logits).sum(-1)
        return nll + 0.5 * theta.square().sum(-1) / PRIOR_STD**2

    def gradient(theta: Tensor) -> Tensor:
        return (torch.sigmoid(theta @ phi.T) - y) @ phi + theta / PRIOR_STD**2

    def hessian(theta: Tensor) -> Tensor:
        p = torch.sigmoid(phi @ theta)
        eye = torch.eye(size, dtype=torch.float64)
        return phi.T @ (phi * (p * (1 - p))[:, None]) + eye / PRIOR_STD**2

    mode = torch.zeros(size, dtype=torch.float64)
    for _ in range(30):  # Newton on a strictly convex potential
        mode = mode - torch.linalg.solve(hessian(mode), gradient(mode))
    scale = torch.linalg.cholesky(torch.linalg.inv(hessian(mode)))

    generator = torch.Generator().manual_seed(0)
    z = torch.randn(chains, size, generator=generator, dtype=torch.float64)
    kept = torch.empty(draws // thin, chains, size, dtype=torch.float64)
    accepted = 0.0
    steps = 6
    for iteration in range(warmup + draws):
        eps = 0.4 + 0.2 * torch.rand(chains, 1, generator=generator, dtype=torch.float64)
        momentum = torch.randn(chains, size, generator=generator, dtype=torch.float64)
        theta = mode + z @ scale.T
        new_z = z
        new_momentum = momentum - 0.5 * eps * (gradient(theta) @ scale)
        for step in range(steps):
            new_z = new_z + eps * new_momentum
            force = gradient(mode + new_z @ scale.T) @ scale
            new_momentum = new_momentum - (eps if step < steps - 1 else 0.5 * eps) * force
        log_accept = (
            potential(theta)
            + 0.5 * momentum.square().sum(-1)
            - potential(mode + new_z @ scale.T)
            - 0.5 * new_momentum.square().sum(-1)
        )
        accept = torch.rand(chains, generator=generator, dtype=torch.float64).log() < log_accept
        z = torch.where(accept[:, None], new_z, z)
        if iteration >= warmup:
            accepted += float(accept.double().mean())
            if (iteration - warmup) % thin == thin - 1:
                kept[(iteration - warmup) // thin] = mode + z @ scale.T

    samples = kept.transpose(0, 1)  # [chains, draws, P]
    flat = samples.reshape(-1, size)
    mean = flat.mean(0)
    covariance = torch.cov(flat.T)
    sd = covariance.diagonal().sqrt()
    ess_mean = diagnostics.ess(samples, method="mean")
    squares = (samples - mean).square()
    ess_square = diagnostics.ess(squares, method="mean")
    mean_mcse = sd / ess_mean.sqrt()
    sd_mcse = squares.reshape(-1, size).std(0) / ess_square.sqrt() / (2 * sd)
    rhat = diagnostics.rhat(samples)
    full_mean, full_sd, full_objective = gaussian_vi_optimum(mean_field=False)
    field_mean, field_sd, field_objective = gaussian_vi_optimum(mean_field=True)
    return {
        "problem": (
            "sklearn load_breast_cancer, features standardised (float64 mean, unbiased sd), "
            "logistic regression, prior N(0, 1) on 30 weights then the intercept, N = 569"
        ),
        "method": (
            f"HMC whitened by the Laplace covariance at the MAP: {chains} chains, {warmup} "
            f"warm-up + {draws} iterations thinned by {thin}, {steps} leapfrog steps of "
            f"U[0.4, 0.6], seed 0 (benchmarks/bench_vi.py --make-reference)"
        ),
        "acceptance": round(accepted / draws, 4),
        "max_rhat": round(float(rhat.max()), 5),
        "min_ess_mean": round(float(ess_mean.min()), 1),
        "optima": (
            "full_vi_* and mean_field_vi_*: the exact minimisers of the VI objective over "
            "all Gaussians and over diagonal ones (Gauss-Hermite quadrature + L-BFGS, "
            "benchmarks/bench_vi.py gaussian_vi_optimum)"
        ),
        "full_vi_objective": round(full_objective, 8),
        "mean_field_vi_objective": round(field_objective, 8),
        "values": {
            "mean": _rounded(mean),
            "sd": _rounded(sd),
            "mean_mcse": _rounded(mean_mcse),
            "sd_mcse": _rounded(sd_mcse),
            "full_vi_mean": _rounded(full_mean),
            "full_vi_sd": _rounded(full_sd),
            "mean_field_vi_mean": _rounded(field_mean),
            "mean_field_vi_sd": _rounded(field_sd),
        },
    }


def _rounded(values: Tensor) -> list[float]:
    return [float(f"{v:.6g}") for v in values.tolist()]


def gaussian_vi_optimum(*, mean_field: bool, nodes: int = 80) -> tuple[Tensor, Tensor, float]:
    r"""The exact minimiser of the VI objective over Gaussians (full or mean-field), float64.

    For logistic regression the expected NLL depends on q only through the logits
    :math:`f_i = \phi_i^\top\theta \sim \mathcal N(\phi_i^\top\mu, |L^\top\phi_i|^2)`, so
    the objective (mean NLL + KL(q‖p)/N, DESIGN's at T = 1) is a deterministic function of
    (μ, L): each :math:`\mathbb E[\log(1 + e^{f_i})]` by Gauss-Hermite quadrature (80
    nodes), :math:`\mathrm{KL} = \tfrac12(|\mu|^2 + \mathrm{tr}\,LL^\top)/\sigma_p^2 -
    \sum\log L_{ii} + P\log\sigma_p - P/2`. L-BFGS (strong Wolfe) minimises it over μ, log
    diag(L) and (full) the strictly-lower entries of L.

    Returns:
        The optimum's mean and marginal sds (flat, weights then bias) and its objective.
    """
    import numpy as np

    x, y = breast_cancer(torch.float64)
    phi = torch.cat([x, torch.ones(len(x), 1, dtype=torch.float64)], dim=1)
    num_data, size = phi.shape
    points, weights = np.polynomial.hermite_e.hermegauss(nodes)
    points = torch.tensor(points)
    weights = torch.tensor(weights) / math.sqrt(2 * math.pi)
    mean = torch.zeros(size, dtype=torch.float64, requires_grad=True)
    log_diagonal = torch.full((size,), -1.0, dtype=torch.float64, requires_grad=True)
    lower = torch.zeros(size, size, dtype=torch.float64, requires_grad=True)
    params = [mean, log_diagonal] if mean_field else [mean, log_diagonal, lower]

    def scale() -> Tensor:
        diagonal = torch.diag(log_diagonal.exp())
        return diagonal if mean_field else diagonal + torch.tril(lower, -1)

    def objective() -> Tensor:
        factor = scale()
        logits_mean = phi @ mean
        logits_sd = (phi @ factor).square().sum(1).sqrt()
        logits = logits_mean[:, None] + logits_sd[:, None] * points
        nll = (F.softplus(logits) * weights).sum(1) - y * logits_mean
        kl = (
            0.5 * (mean.square().sum() + factor.square().sum()) / PRIOR_STD**2
            - log_diagonal.sum()
            + size * math.log(PRIOR_STD)
            - 0.5 * size
        )
        return nll.mean() + kl / num_data

    optimizer = torch.optim.LBFGS(
        params,
        max_iter=5000,
        tolerance_grad=1e-12,
        tolerance_change=1e-15,
        history_size=50,
        line_search_fn="strong_wolfe",
    )

    def closure() -> Tensor:
        optimizer.zero_grad()
        value = objective()
        value.backward()
        return value

    for _ in range(5):
        optimizer.step(closure)
    closure()
    largest = max(float(p.grad.abs().max()) for p in params)
    if largest > 1e-8:
        raise RuntimeError(f"L-BFGS did not converge: largest gradient {largest:.3g}")
    factor = scale().detach()
    with torch.no_grad():
        value = float(objective())
    return mean.detach(), factor.square().sum(1).sqrt(), value


def nuts_check(reference: dict[str, Tensor], *, seed: int = 0) -> str:
    """Pyro NUTS, 4 chains x 2000 draws: its mean errors and sd ratios against the HMC."""
    import pyro
    import pyro.distributions as dist
    from pyro.infer import MCMC, NUTS

    x, y = breast_cancer(torch.float64)
    zeros = torch.zeros(x.shape[1] + 1, dtype=torch.float64)

    def model() -> None:
        theta = pyro.sample("theta", dist.Normal(zeros, PRIOR_STD).to_event(1))
        logits = x @ theta[:-1] + theta[-1]
        pyro.sample("y", dist.Bernoulli(logits=logits).to_event(1), obs=y)

    chains = []
    for chain in range(4):
        pyro.set_rng_seed(seed * 100 + chain)
        kernel = NUTS(model, full_mass=True)
        mcmc = MCMC(kernel, num_samples=2000, warmup_steps=1000, disable_progbar=True)
        mcmc.run()
        chains.append(mcmc.get_samples()["theta"])
    draws = torch.stack(chains)  # [chains, draws, P]
    flat = draws.reshape(-1, draws.shape[-1])
    error = ((flat.mean(0) - reference["mean"]) / reference["sd"]).abs()
    ratio = flat.std(0) / reference["sd"]
    ess = diagnostics.ess(draws, method="mean")
    # the NUTS estimate's own Monte Carlo error, in posterior sds: 1 / sqrt(ESS)
    return (
        f"NUTS 4 x 2000 vs the HMC reference: max |mean error| {float(error.max()):.3f} sd "
        f"(its own MC error {float((1 / ess.sqrt()).max()):.3f} sd), sd ratios "
        f"{float(ratio.min()):.3f} to {float(ratio.max()):.3f}, min ESS {float(ess.min()):.0f}"
    )


# ----------------------------------------------------------------------------- VI runs
@dataclass(frozen=True)
class Run:
    """One training configuration: the wrapper's defaults unless ``stl`` is given."""

    name: str
    family: type[nn.Module]
    lr: float
    steps: int
    batch_size: int | None = None  # None: full batch
    cosine: bool = True  # CosineAnnealingLR to 0 over the run; False: constant lr
    stl: bool | None = None  # None: the default


def train(run: Run, seed: int) -> nn.Module:
    """Train ``run`` from ``torch.manual_seed(seed)`` (model init, batches and draws)."""
    x, y = breast_cancer()
    torch.manual_seed(seed)
    extra = {} if run.stl is None else {"stl": run.stl}
    vi = run.family(nn.Linear(30, 1), num_data=len(x), prior_std=PRIOR_STD, **extra)
    optimizer = torch.optim.Adam(vi.parameters(), lr=run.lr)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, run.steps)
    order = iter(())
    for step in range(run.steps):
        if run.batch_size is None:
            xb, yb = x, y
        else:
            index = next(order, None)
            if index is None:  # a fresh permutation each epoch, the last batch short
                order = iter(torch.randperm(len(x)).split(run.batch_size))
                index = next(order)
            xb, yb = x[index], y[index]
        optimizer.zero_grad()
        try:
            loss = F.binary_cross_entropy_with_logits(vi(xb).squeeze(-1), yb) + vi.kl_loss()
        except FloatingPointError as error:
            raise FloatingPointError(f"at step {step + 1}: {error}") from error
        loss.backward()
        optimizer.step()
        if run.cosine:
            schedule.step()
    return vi


def moments(vi: nn.Module) -> tuple[Tensor, Tensor]:
    """Flat mean and marginal sd of q, float64, in the reference's order (weights, bias)."""
    mean = torch.cat([vi.mean["weight"].reshape(-1), vi.mean["bias"]])
    sd = torch.cat([vi.std["weight"].reshape(-1), vi.std["bias"]])
    return mean.double(), sd.double()


@torch.no_grad()
def objective(vi: nn.Module, draws: int = 4096) -> float:
    """Mean NLL + KL(q || p) / N: the NLL over fresh draws, the KL in closed form."""
    x, y = breast_cancer()
    logits = vi(x, num_samples=draws, generator=torch.Generator().manual_seed(12345))
    logits = logits.squeeze(-1)
    nll = F.binary_cross_entropy_with_logits(logits, y.expand_as(logits))
    stl = vi.stl
    vi.stl = False
    try:
        kl = vi.kl_loss()
    finally:
        vi.stl = stl
    return float(nll + kl)


def score(vi: nn.Module, reference: dict[str, Tensor]) -> dict[str, float]:
    """Figures of one trained wrapper: against the posterior and its family's optimum."""
    mean, sd = moments(vi)
    prefix = "mean_field_vi" if isinstance(vi, MeanFieldVI) else "full_vi"
    ratio = sd / reference["sd"]
    optimum_ratio = sd / reference[f"{prefix}_sd"]
    return {
        "sd_min": float(ratio.min()),
        "sd_median": float(ratio.median()),
        "sd_max": float(ratio.max()),
        "mean_error": float(((mean - reference["mean"]) / reference["sd"]).abs().max()),
        "opt_sd_min": float(optimum_ratio.min()),
        "opt_sd_max": float(optimum_ratio.max()),
        "opt_mean_error": float(
            ((mean - reference[f"{prefix}_mean"]) / reference["sd"]).abs().max()
        ),
        "objective": objective(vi),
    }


def runs(quick: bool) -> list[Run]:
    """The configurations of the module docstring (``--quick``: the first four)."""
    epochs = 400  # README recipe: minibatches of 32, 18 steps per epoch
    steps = epochs * math.ceil(569 / BATCH)
    full, mean_field = FullCovarianceVI, MeanFieldVI
    table = [
        Run("full, 1e-2 cosine, full batch", full, 1e-2, 4000),
        Run("mean-field, 1e-2 cosine, full batch", mean_field, 1e-2, 4000),
        Run("README mean-field, 1e-2 cos, batch 32", mean_field, 1e-2, steps, BATCH),
        Run("full, 1e-2 constant, full batch", full, 1e-2, 4000, cosine=False),
        Run("full, 1e-3 constant, full batch", full, 1e-3, 20000, cosine=False),
        Run("README full, 1e-2 cosine, batch 32", full, 1e-2, steps, BATCH),
        Run("full, 1e-1 cosine, full batch", full, 1e-1, 4000),
        Run("full stl=True, 1e-2 cos, full batch", full, 1e-2, 4000, stl=True),
        Run("full stl=True, 5e-2 cos, full batch", full, 5e-2, 4000, stl=True),
    ]
    return table[:4] if quick else table


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--make-reference", action="store_true", help="recompute the reference")
    parser.add_argument("--nuts", action="store_true", help="with --make-reference: check by NUTS")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="the first four runs only")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.make_reference:
        start = time.perf_counter()
        payload = make_reference()
        REFERENCE.parent.mkdir(parents=True, exist_ok=True)
        REFERENCE.write_text(json.dumps(payload, indent=1) + "\n")
        print(f"wrote {REFERENCE} in {time.perf_counter() - start:.0f} s")
        if args.nuts:
            print(nuts_check(load_reference()))
        return
    reference = load_reference()
    stored = json.loads(REFERENCE.read_text())
    print(
        f"exact optima: objective {stored['full_vi_objective']:.5f} (full), "
        f"{stored['mean_field_vi_objective']:.5f} (mean-field); {args.seeds} seeds, worst "
        "over seeds (median for the median sd ratio)"
    )
    print(
        f"{'run (wrapper defaults, Adam lr)':37s}{'steps':>6s}  {'sd / posterior':17s} "
        f"{'mean':>5s}  {'sd / optimum':11s} {'mean':>5s}  obj."
    )
    for run in runs(args.quick):
        results, failures = [], []
        for seed in range(args.seeds):
            try:
                results.append(score(train(run, seed), reference))
            except FloatingPointError as error:
                failures.append(f"seed {seed}, {str(error)[:90]}...")
        line = f"{run.name:37s}{run.steps:6d}  "
        if results:
            low = min(r["sd_min"] for r in results)
            median = sorted(r["sd_median"] for r in results)[len(results) // 2]
            high = max(r["sd_max"] for r in results)
            line += (
                f"{low:.3f}/{median:.3f}/{high:.3f} "
                f"{max(r['mean_error'] for r in results):5.3f}  "
                f"{min(r['opt_sd_min'] for r in results):.3f}-"
                f"{max(r['opt_sd_max'] for r in results):.3f} "
                f"{max(r['opt_mean_error'] for r in results):5.3f} "
                f"{max(r['objective'] for r in results):.5f}"
            )
        print(line, flush=True)
        for failure in failures:
            print(f"    FloatingPointError, {failure}")


if __name__ == "__main__":
    main()
