"""HMC as the reference: Izmailov et al. (2021)'s study of BNN posteriors at laptop scale.

"What are Bayesian neural network posteriors really like?" runs full-batch HMC (hundreds
of TPU-days) and measures every approximate method against it. Here the same questions
on scikit-learn's digits with a small MLP, on two CPU cores:

* **HMC**: :class:`~samplers_as_optim.HMC` on a
  :class:`~samplers_as_optim.ParallelEnsemble` of ``CHAINS`` chains (one loss per chain,
  one vmapped full-batch forward/backward per leapfrog step), dual-averaging warm-up,
  then ``draws`` transitions each; its Bayesian model average (BMA) over all chains and
  draws is the reference. Reported: acceptance, and function-space R-hat
  (``diagnostics.function_space``) of the predictive probabilities over test inputs
  (weight-space R-hat is meaningless for a BNN: see the Stan-forum thread in the
  references).
* **SGD** (MAP, with the prior as weight decay), **deep ensemble** (``ParallelEnsemble``
  + SGD), **SGLD**, **SGHMC** (parallel chains, predictions of every epoch after
  burn-in), **cyclical SGHMC** (``CyclicalSGMCMC``, samples from the sampling stage of
  each cycle), **mean-field VI** (``MeanFieldVI`` from the MAP) and **Laplace**
  (diagonal GGN, linearised predictive) — each scored by accuracy, NLL, and agreement
  (top-1) and total variation against the HMC BMA (``predictive.agreement``,
  ``predictive.total_variation``).

The claims of the poster checked one by one (each printed with "reproduced" or "not
reproduced"): (a) HMC's BMA beats SGD and the deep ensemble (accuracy and NLL); (b) no
cold posterior needed: HMC at T = 1 is at least as good as at T = 0.1 (NLL); (c) deep
ensembles are closer to HMC than mean-field VI (agreement and TV); (d) SG-MCMC is closest
to HMC (the best of SGLD/SGHMC/cyclical beats every other method on agreement and TV);
(e) HMC is poor under input corruption (Gaussian noise, sd ``NOISE``, on the test
images): its accuracy there is below SGD's and the ensemble's; (f) robust to the prior
scale: HMC's test accuracy varies by less than 0.02 over sigma in {0.1, 0.3, 1, 3}.

Run:
    ``python examples/hmc_reference.py --quick`` (a few seconds: a tiny model and short
    chains, only the mechanics) or without ``--quick`` (full mode, about 6 minutes on one core);
    ``--output`` names the figure (default ``examples/output/hmc_reference.png``).
    The results of full mode are in the README (section "Examples").

Results (full mode, seed 0, one run, 355 s on one core; the table is in the README): HMC
acceptance 0.82, function-space R-hat median 1.025, no test input above 1.1. Reproduced:
(c) the deep ensemble is closer to HMC than mean-field VI (TV 0.031 vs 0.050); (d)
SG-MCMC (cyclical SGHMC: agreement 0.993, TV 0.027) is closest. Partly: (a) HMC has the
best accuracy (0.982) but the 4-member ensemble the lower NLL (0.087 vs 0.095). Not
reproduced: (b) T = 0.1 has lower NLL than T = 1; (e) under noise HMC (0.676) beats SGD
and the ensemble; (f) sigma = 0.1 costs HMC 0.10 accuracy (SGD 0.17), within 0.015 from
0.3 to 3. SGLD (lr 0.02, untuned) underfits.
"""

from __future__ import annotations

import copy
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from common import (
    digits,
    example_arguments,
    figure_title,
    member_minibatches,
    mlp,
    print_table,
    torch_threads,
)
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

from samplers_as_optim import (
    HMC,
    SGHMC,
    SGLD,
    Laplace,
    MeanFieldVI,
    ParallelEnsemble,
    diagnostics,
    predictive,
)

try:  # being added alongside HMC; the study runs without it
    from samplers_as_optim import CyclicalSGMCMC
except ImportError:  # pragma: no cover
    CyclicalSGMCMC = None

NOISE = 0.5  # sd of the Gaussian corruption of test pixels (in [0, 1])
BATCH = 64
PRIORS = (0.1, 0.3, 1.0, 3.0)
METHODS = (
    "HMC",
    "HMC (T=0.1)",
    "SGD",
    "Deep ensemble",
    "SGLD",
    "SGHMC",
    "Cyclical SGHMC",
    "MFVI",
    "Laplace",
)


@dataclass(frozen=True)
class Settings:
    hidden: int
    chains: int
    warmup: int
    draws: int
    num_steps: int
    epochs: int
    burn_in: int
    members: int
    vi_epochs: int
    priors: tuple[float, ...]
    prior: float = 1.0


FULL = Settings(
    hidden=16,
    chains=4,
    warmup=300,
    draws=300,
    num_steps=50,
    epochs=60,
    burn_in=30,
    members=4,
    vi_epochs=60,
    priors=PRIORS,
)
QUICK = Settings(
    hidden=8,
    chains=2,
    warmup=10,
    draws=10,
    num_steps=5,
    epochs=4,
    burn_in=2,
    members=2,
    vi_epochs=3,
    priors=(1.0, 3.0),
)


def member_losses(outputs: Tensor, y: Tensor) -> Tensor:
    """Each member's mean cross-entropy on the full batch: ``[K, N, C]`` -> ``[K]``."""
    k, n, c = outputs.shape
    return (
        F.cross_entropy(outputs.reshape(k * n, c), y.repeat(k), reduction="none").view(k, n).mean(1)
    )


def run_hmc(
    settings: Settings, data: tuple[Tensor, ...], *, prior: float, temperature: float, seed: int
) -> dict[str, Any]:
    """HMC chains; the probabilities of every draw on clean and corrupted test inputs."""
    x, y, x_test, x_noisy = data
    n = len(x)
    ensemble = ParallelEnsemble(
        mlp(hidden=(settings.hidden,), seed=seed), settings.chains, seed=seed
    )
    opt = HMC(
        ensemble.parameters(),
        lr=0.05,
        num_steps=settings.num_steps,
        num_data=n,
        temperature=temperature,
        weight_decay=1 / (n * prior**2),
        seed=seed,
        jitter=0.2,
        target_accept=0.8,
    )

    def closure() -> Tensor:
        opt.zero_grad()
        losses = member_losses(ensemble(x), y)
        losses.sum().backward()
        return losses

    opt.warmup(closure, settings.warmup)
    probs, noisy, accept = [], [], 0.0
    for _ in range(settings.draws):
        opt.step(closure)
        accept += float(opt.diagnostics["accept_prob"].mean()) / settings.draws
        with torch.no_grad():
            probs.append(ensemble(x_test).softmax(-1))
            noisy.append(ensemble(x_noisy).softmax(-1))
    probs_t = torch.stack(probs, 1)  # [chains, draws, B, C]
    rhat = diagnostics.function_space(probs_t).per_input
    return {
        "probs": probs_t.flatten(0, 1),
        "noisy": torch.stack(noisy, 1).flatten(0, 1),
        "accept": accept,
        "rhat_median": float(rhat.nanmedian()),
        "rhat_above_1.1": float((rhat > 1.1).double().mean()),
        "step_size": float(opt.diagnostics["step_size"].mean()),
        "divergences": int(opt.diagnostics["divergences"].sum()),
    }


def run_minibatch(
    settings: Settings, data: tuple[Tensor, ...], *, prior: float, kind: str, seed: int
) -> tuple[dict[str, Tensor], ParallelEnsemble]:
    """SGD ensemble, SGLD, SGHMC or cyclical SGHMC chains on minibatches."""
    x, y, x_test, x_noisy = data
    n = len(x)
    k = settings.members
    ensemble = ParallelEnsemble(mlp(hidden=(settings.hidden,), seed=seed), k, seed=seed)
    wd = 1 / (n * prior**2)
    params = ensemble.parameters()
    if kind == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=wd)
    elif kind == "sgld":
        opt = SGLD(params, lr=0.02, num_data=n, weight_decay=wd, seed=seed)
    else:
        opt = SGHMC(params, lr=0.1, momentum=0.9, num_data=n, weight_decay=wd, seed=seed)
    steps_per_epoch = math.ceil(n / BATCH)
    scheduler = None
    if kind == "cyclical":
        cycles = 4
        scheduler = CyclicalSGMCMC(
            opt,
            cycle_length=settings.epochs * steps_per_epoch // cycles,
            num_cycles=cycles,
            exploration=0.5,
        )
    generator = torch.Generator().manual_seed(seed)
    probs, noisy = [], []
    for epoch in range(settings.epochs):
        sampling = False
        for index in member_minibatches(n, BATCH, k, generator):
            opt.zero_grad()
            outputs = ensemble(x[index], per_member_inputs=True)
            ensemble.loss(F.cross_entropy, outputs, y[index], per_member_targets=True).backward()
            opt.step()
            if scheduler is not None:
                sampling = scheduler.is_sampling
                if scheduler.last_epoch + 1 < scheduler.total_steps:
                    scheduler.step()
        keep = sampling if scheduler is not None else (kind != "sgd" and epoch >= settings.burn_in)
        if keep:
            with torch.no_grad():
                probs.append(ensemble(x_test).softmax(-1))
                noisy.append(ensemble(x_noisy).softmax(-1))
    if not probs:  # SGD: the final members
        with torch.no_grad():
            probs.append(ensemble(x_test).softmax(-1))
            noisy.append(ensemble(x_noisy).softmax(-1))
    return {"probs": torch.cat(probs), "noisy": torch.cat(noisy)}, ensemble


def scores(probs: Tensor, y: Tensor, reference: Tensor | None) -> dict[str, float]:
    """Accuracy and NLL of the BMA of ``[S, B, C]`` probabilities; agreement/TV vs HMC."""
    bma = probs.mean(0)
    out = {
        "accuracy": float(predictive.accuracy(bma, y)),
        "nll": float(predictive.nll(bma.clamp_min(1e-12).log(), y)),
    }
    if reference is not None:
        out["agreement"] = float(predictive.agreement(bma, reference))
        out["tv"] = float(predictive.total_variation(bma, reference))
    return out


def run(quick: bool = False, seed: int = 0) -> dict[str, Any]:
    settings = QUICK if quick else FULL
    with torch_threads(1):
        return _run(settings, seed)


def _run(settings: Settings, seed: int) -> dict[str, Any]:
    x, y, x_test, y_test = digits(seed=seed)
    noise = torch.randn(x_test.shape, generator=torch.Generator().manual_seed(seed + 1))
    x_noisy = x_test + NOISE * noise
    data = (x, y, x_test, x_noisy)
    n = len(x)
    started = time.perf_counter()
    predictions: dict[str, dict[str, Tensor]] = {}
    timings: dict[str, float] = {}

    def timed(name: str, start: float) -> None:
        timings[name] = time.perf_counter() - start
        print(f"  {name}: {timings[name]:.0f} s", file=sys.stderr, flush=True)

    t = time.perf_counter()
    hmc = run_hmc(settings, data, prior=settings.prior, temperature=1.0, seed=seed)
    predictions["HMC"] = hmc
    timed("HMC", t)
    t = time.perf_counter()
    cold = run_hmc(settings, data, prior=settings.prior, temperature=0.1, seed=seed)
    predictions["HMC (T=0.1)"] = cold
    timed("HMC (T=0.1)", t)

    t = time.perf_counter()
    sgd_run, sgd_ensemble = run_minibatch(
        settings, data, prior=settings.prior, kind="sgd", seed=seed
    )
    predictions["Deep ensemble"] = sgd_run
    predictions["SGD"] = {k: v[:1] for k, v in sgd_run.items()}
    timed("Deep ensemble", t)
    for name, kind in (("SGLD", "sgld"), ("SGHMC", "sghmc"), ("Cyclical SGHMC", "cyclical")):
        if kind == "cyclical" and CyclicalSGMCMC is None:
            continue
        t = time.perf_counter()
        predictions[name] = run_minibatch(
            settings, data, prior=settings.prior, kind=kind, seed=seed
        )[0]
        timed(name, t)

    map_model = sgd_ensemble.member(0)
    t = time.perf_counter()
    vi = MeanFieldVI(
        copy.deepcopy(map_model), num_data=n, prior_std=settings.prior, init_std=1e-3, stl=True
    )
    adam = torch.optim.Adam(vi.parameters(), lr=3e-2)
    steps = settings.vi_epochs * math.ceil(n / BATCH)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(adam, steps)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(settings.vi_epochs):
        for index in torch.randperm(n, generator=generator).split(BATCH):
            adam.zero_grad()
            loss = F.cross_entropy(vi(x[index], generator=generator), y[index]) + vi.kl_loss()
            loss.backward()
            adam.step()
            schedule.step()
    with torch.no_grad():
        predictions["MFVI"] = {
            "probs": vi.predict(x_test, 100, generator=torch.Generator().manual_seed(0)).softmax(
                -1
            ),
            "noisy": vi.predict(x_noisy, 100, generator=torch.Generator().manual_seed(0)).softmax(
                -1
            ),
        }
    timed("MFVI", t)

    t = time.perf_counter()
    laplace = Laplace(
        map_model,
        num_data=n,
        likelihood="classification",
        prior_precision=1 / settings.prior**2,
        curvature="ggn",
    )
    laplace.fit(DataLoader(TensorDataset(x, y), batch_size=256))
    with torch.no_grad():
        predictions["Laplace"] = {
            "probs": laplace.predict(
                x_test, 100, linear=True, generator=torch.Generator().manual_seed(0)
            ).softmax(-1),
            "noisy": laplace.predict(
                x_noisy, 100, linear=True, generator=torch.Generator().manual_seed(0)
            ).softmax(-1),
        }
    timed("Laplace", t)

    reference = hmc["probs"].mean(0)
    reference_noisy = hmc["noisy"].mean(0)
    rows = []
    for name in METHODS:
        if name not in predictions:
            continue
        clean = scores(predictions[name]["probs"], y_test, reference)
        noisy = scores(predictions[name]["noisy"], y_test, reference_noisy)
        rows.append(
            {
                "method": name,
                **clean,
                "noisy accuracy": noisy["accuracy"],
                "noisy nll": noisy["nll"],
                "seconds": timings.get(name, timings.get("Deep ensemble", 0.0)),
            }
        )

    # (f): the prior scale, HMC against SGD
    prior_rows = []
    for prior in settings.priors:
        if prior == settings.prior:
            hmc_p, sgd_p = hmc, predictions["SGD"]
        else:
            hmc_p = run_hmc(settings, data, prior=prior, temperature=1.0, seed=seed)
            sgd_full = run_minibatch(settings, data, prior=prior, kind="sgd", seed=seed)[0]
            sgd_p = {k: v[:1] for k, v in sgd_full.items()}
        prior_rows.append(
            {
                "sigma": prior,
                "HMC accuracy": scores(hmc_p["probs"], y_test, None)["accuracy"],
                "HMC nll": scores(hmc_p["probs"], y_test, None)["nll"],
                "SGD accuracy": scores(sgd_p["probs"], y_test, None)["accuracy"],
                "SGD nll": scores(sgd_p["probs"], y_test, None)["nll"],
                "accept": hmc_p["accept"],
                "R-hat median": hmc_p["rhat_median"],
            }
        )

    results = {
        "rows": rows,
        "prior_rows": prior_rows,
        "hmc": {k: v for k, v in hmc.items() if k not in ("probs", "noisy")},
        "hmc_cold": {k: v for k, v in cold.items() if k not in ("probs", "noisy")},
        "cyclical_available": CyclicalSGMCMC is not None,
        "seconds": time.perf_counter() - started,
    }
    results["claims"] = claims(results)
    return results


def claims(results: dict[str, Any]) -> dict[str, bool]:
    """The poster's claims (a)-(f), each True when it reproduces here."""
    by = {row["method"]: row for row in results["rows"]}
    sg = [m for m in ("SGLD", "SGHMC", "Cyclical SGHMC") if m in by]
    others = [m for m in by if m not in sg and not m.startswith("HMC")]
    best_sg_agree = max(by[m]["agreement"] for m in sg)
    best_sg_tv = min(by[m]["tv"] for m in sg)
    accuracies = [row["HMC accuracy"] for row in results["prior_rows"]]
    return {
        "(a) HMC beats SGD and the deep ensemble": all(
            by["HMC"]["accuracy"] >= by[m]["accuracy"] and by["HMC"]["nll"] <= by[m]["nll"]
            for m in ("SGD", "Deep ensemble")
        ),
        "(b) no cold posterior: HMC T=1 NLL <= T=0.1": by["HMC"]["nll"] <= by["HMC (T=0.1)"]["nll"],
        "(c) deep ensemble closer to HMC than MFVI": (
            by["Deep ensemble"]["agreement"] >= by["MFVI"]["agreement"]
            and by["Deep ensemble"]["tv"] <= by["MFVI"]["tv"]
        ),
        "(d) SG-MCMC closest to HMC": all(
            best_sg_agree >= by[m]["agreement"] and best_sg_tv <= by[m]["tv"] for m in others
        ),
        "(e) HMC worse than SGD and ensemble under noise": all(
            by["HMC"]["noisy accuracy"] < by[m]["noisy accuracy"] for m in ("SGD", "Deep ensemble")
        ),
        "(f) HMC robust to the prior scale (accuracy range < 0.02)": max(accuracies)
        - min(accuracies)
        < 0.02,
    }


def tables(results: dict[str, Any]) -> str:
    hmc = results["hmc"]
    text = print_table(
        results["rows"],
        ["method", "accuracy", "nll", "agreement", "tv", "noisy accuracy", "noisy nll", "seconds"],
        title="Test set (digits); agreement and total variation against the HMC BMA",
    )
    text += "\n" + print_table(
        results["prior_rows"],
        ["sigma", "HMC accuracy", "HMC nll", "SGD accuracy", "SGD nll", "accept", "R-hat median"],
        title="Prior scale sigma",
    )
    line = (
        f"HMC: acceptance {hmc['accept']:.3f}, step size {hmc['step_size']:.4g}, "
        f"divergences {hmc['divergences']}, function-space R-hat median "
        f"{hmc['rhat_median']:.3f}, fraction of test inputs above 1.1 {hmc['rhat_above_1.1']:.3f}"
    )
    print(line)
    text += "\n" + line
    if not results["cyclical_available"]:
        print("Cyclical SG-MCMC: CyclicalSGMCMC is missing from samplers_as_optim (skipped)")
    for claim, holds in results["claims"].items():
        verdict = f"{claim}: {'reproduced' if holds else 'not reproduced'}"
        print(verdict)
        text += "\n" + verdict
    return text


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results["rows"] if r["method"] != "HMC"]
    names = [r["method"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    axes[0].barh(names, [r["agreement"] for r in rows], color="tab:blue")
    axes[0].set_xlabel("agreement with the HMC BMA (higher is closer)")
    axes[0].set_xlim(min(r["agreement"] for r in rows) - 0.02, 1.0)
    axes[1].barh(names, [r["tv"] for r in rows], color="tab:orange")
    axes[1].set_xlabel("total variation to the HMC BMA (lower is closer)")
    for ax in axes[:2]:
        ax.invert_yaxis()
    priors = results["prior_rows"]
    sig = [r["sigma"] for r in priors]
    axes[2].plot(sig, [r["HMC accuracy"] for r in priors], "o-", label="HMC")
    axes[2].plot(sig, [r["SGD accuracy"] for r in priors], "s--", label="SGD")
    axes[2].set_xscale("log")
    axes[2].set_xlabel("prior scale sigma")
    axes[2].set_ylabel("test accuracy")
    axes[2].legend()
    fig.suptitle(figure_title("HMC as the reference on digits (MLP, full-batch HMC chains)"))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    quick, seed, figure = example_arguments(
        argv, __doc__, quick="tiny model, short chains (CI)", figure="hmc_reference.png"
    )
    results = run(quick=quick, seed=seed)
    results["table"] = tables(results)
    plot(results, figure)
    print(f"figure: {figure}; {results['seconds']:.0f} s")
    return results


if __name__ == "__main__":
    main()
