"""Regression with sampled observation noise, on scikit-learn's diabetes data (20 splits).

The workflow of the guide's "Regression" page on a standard benchmark protocol: a
50-unit ReLU MLP, 20 random 90/10 splits, inputs and targets standardised with the
training split's statistics, test RMSE and log-likelihood per test point reported in
the **original units** of the target (a disease-progression score, standard deviation
about 77; ``predictive.regression_scores(..., target_std=s)``), mean ± standard error
over the splits, and each method's difference from the MAP on the same split (paired:
the splits' own spread, which dominates the standard errors, cancels). Every method uses
the same prior, written once by ``prior_param_groups``: N(0, 1/fan_in) on every weight,
N(0, 1) on every bias, and the observation noise σ a parameter (``GaussianLikelihood``,
Gamma(1, 1) prior on σ⁻², in the loss) that each method fits, samples or tunes with the
weights.

* **MAP**: Adam (L2 weight decay = the prior, from ``prior_param_groups``) on the
  weights and log σ, full batch, to convergence; the predictive N(f(x; θ*), σ*²).
* **Laplace (evidence)**: dense GGN ``Laplace`` around the MAP's network, its prior
  precision (one per tensor) and σ tuned by the evidence
  (``optimize_prior_precision(method="marglik", prior_structure="layerwise")``), the
  exact GLM predictive ``la.predictive(x)``.
* **SGHMC**: one full-batch chain over (θ, log σ) from the MAP, lr 1e-2, momentum 0.9
  (SGD units: ε = √(lr/N)), T = 1; burn-in, then one sample every ``THIN`` steps; the
  Gaussian mixture over (f(x; θ_s), σ_s) (``predictive.gaussian_regression``).
* **AdamW twin**: ``AdamWSGHMC`` over (θ, log σ), lr 1e-3, ``weight_decay=0`` and the
  prior in the loss (``prior_loss``: AdamW's decoupled decay is not this prior), from the
  MAP's initialisation rather than the MAP (at the MAP the full-batch gradient vanishes,
  and with it the Adam second moment that the twin freezes as its preconditioner: it
  then took steps of 1/ε and diverged), burn-in as long as the MAP's training.
* **Deep ensemble**: ``ParallelEnsemble`` of K MAP networks from K initialisations,
  each with its own σ (a ``ParallelEnsemble`` of the ``GaussianLikelihood``, passed to
  ``ensemble.loss``), trained as the MAP; the mixture over members.

Full mode: 20 splits, MAP and ensemble 2000 Adam steps (lr 1e-2, cosine), SGHMC 1000
burn-in steps from the MAP and the AdamW twin 2000 from the MAP's initialisation, then
50 samples × 40 steps, K = 5, 100 evidence steps. Quick mode (``--quick``): 2 splits,
600 Adam steps, burn-in 400 / 600, 10 samples × 20 steps, K = 3, 30 evidence steps.
``--seed`` shifts the splits, initialisations and noise.

Full mode (seed 0, 20 splits; the table and its reading are on the guide's "Regression"
page): test RMSE 56.04 ± 1.25 for the MAP, 55.66 ± 1.25 for SGHMC; log-likelihood per
point -5.473 ± 0.031 for the MAP, -5.448 (Laplace), -5.445 (SGHMC), -5.441 (AdamW twin),
-5.474 (deep ensemble); paired with the MAP on each split the three Bayesian predictives
gain 0.025-0.032 ± 0.008-0.009 nats per point.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
from common import example_arguments, figure_title, mlp, print_table, warm_up
from torch import Tensor, nn

from samplers_as_optim import (
    SGHMC,
    AdamWSGHMC,
    GaussianLikelihood,
    Laplace,
    ParallelEnsemble,
    predictive,
    prior_loss,
    prior_param_groups,
)
from samplers_as_optim.core.progress import progress_bar

METHODS = ("MAP", "Laplace (evidence)", "SGHMC", "AdamW twin", "Deep ensemble")
HIDDEN = 50
THIN = 40


def settings(quick: bool) -> dict[str, int]:
    if quick:
        return dict(
            splits=2, map_steps=600, burn_in=400, samples=10, thin=20, members=3, evidence=30
        )
    return dict(
        splits=20, map_steps=2000, burn_in=1000, samples=50, thin=THIN, members=5, evidence=100
    )


def diabetes_split(split: int) -> tuple[Tensor, Tensor, Tensor, Tensor, float]:
    """One random 90/10 split, standardised by the training part.

    Returns ``x_train, y_train [n, 1], x_test, y_test, target_std`` (float32).
    """
    from sklearn.datasets import load_diabetes

    x, y = load_diabetes(return_X_y=True)
    x = torch.as_tensor(x, dtype=torch.float32)
    y = torch.as_tensor(y, dtype=torch.float32).unsqueeze(1)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(split))
    n_train = round(0.9 * len(x))
    train, test = order[:n_train], order[n_train:]
    x_mean, x_std = x[train].mean(0), x[train].std(0)
    y_mean, y_std = y[train].mean(), y[train].std()
    x = (x - x_mean) / x_std
    y = (y - y_mean) / y_std
    return x[train], y[train], x[test], y[test], float(y_std)


def network(inputs: int, seed: int) -> nn.Module:
    return mlp(inputs, (HIDDEN,), 1, seed=seed)


def fit_map(
    net: nn.Module, likelihood: nn.Module, x: Tensor, y: Tensor, steps: int, loss_fn: Any = None
) -> None:
    """Adam, full batch, on the mean loss with the prior as L2 weight decay."""
    both = nn.ModuleDict({"net": net, "likelihood": likelihood})
    optimizer = torch.optim.Adam(prior_param_groups(both, num_data=len(x)), lr=1e-2)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
    for _ in range(steps):
        optimizer.zero_grad()
        outputs = net(x)
        loss = likelihood(outputs, y) if loss_fn is None else loss_fn(outputs, y)
        loss.backward()
        optimizer.step()
        schedule.step()


def chain(
    net: nn.Module,
    likelihood: GaussianLikelihood,
    x: Tensor,
    y: Tensor,
    x_test: Tensor,
    config: dict[str, int],
    *,
    adamw: bool,
    burn_in: int,
    seed: int,
) -> tuple[Tensor, Tensor]:
    """One full-batch chain over (θ, log σ); test means ``[S, B, 1]`` and σ ``[S]``."""
    both = nn.ModuleDict({"net": net, "likelihood": likelihood})
    num_data = len(x)
    optimizer: torch.optim.Optimizer
    if adamw:
        optimizer = AdamWSGHMC(
            both.named_parameters(),
            lr=1e-3,
            weight_decay=0.0,
            num_data=num_data,
            preconditioner_warmup=burn_in // 2,
            seed=seed,
        )
    else:
        groups = prior_param_groups(both, num_data=num_data)
        optimizer = SGHMC(groups, lr=1e-2, momentum=0.9, num_data=num_data, seed=seed)
    means, stds = [], []
    total = burn_in + config["samples"] * config["thin"]
    for step in range(1, total + 1):
        optimizer.zero_grad()
        loss = likelihood(net(x), y)
        if adamw:
            loss = loss + prior_loss(net, num_data=num_data)
        loss.backward()
        optimizer.step()
        if step > burn_in and (step - burn_in) % config["thin"] == 0:
            with torch.no_grad():
                means.append(net(x_test))
                stds.append(likelihood.noise_std.detach().clone())
    return torch.stack(means), torch.stack(stds)


def one_split(split: int, config: dict[str, int], seed: int) -> dict[str, dict[str, float]]:
    x, y, x_test, y_test, target_std = diabetes_split(seed * 1000 + split)
    num_data, inputs = x.shape
    init = seed * 1000 + split
    rows: dict[str, dict[str, float]] = {}

    def score(name: str, means: Tensor, variances: Tensor | float, start: float) -> None:
        scores = predictive.regression_scores(means, variances, y_test, target_std=target_std)
        rows[name] = dict(
            rmse=float(scores.rmse),
            ll=float(scores.log_likelihood),
            seconds=time.perf_counter() - start,
        )

    # MAP over (θ, log σ)
    start = time.perf_counter()
    net = network(inputs, init)
    likelihood = GaussianLikelihood(num_data=num_data)
    fit_map(net, likelihood, x, y, config["map_steps"])
    with torch.no_grad():
        map_means, map_std = net(x_test).unsqueeze(0), likelihood.noise_std
    score("MAP", map_means, map_std.square().item(), start)
    map_state = {k: v.clone() for k, v in net.state_dict().items()}
    map_log_std = likelihood.log_noise_std.detach().clone()
    rows["MAP"]["sigma"] = float(map_std)

    # Laplace: evidence-tuned prior precision (one per tensor) and noise, GLM predictive
    start = time.perf_counter()
    la = Laplace(
        net,
        num_data=num_data,
        likelihood="regression",
        noise_std=float(map_std),  # the MAP's σ, then tuned by the evidence
        structure="dense",
        prior_precision=1.0,
    )
    la.fit([(x, y)])
    la.optimize_prior_precision(
        method="marglik",
        prior_structure="layerwise",
        num_steps=config["evidence"],
        progress=False,
    )
    prediction = la.predictive(x_test)
    score("Laplace (evidence)", prediction.mean.unsqueeze(0), prediction.total, start)

    # SGHMC from the MAP; the AdamW twin from the MAP's initialisation (at the MAP the
    # full-batch gradient vanishes, and with it the Adam preconditioner it would freeze)
    for name, adamw in (("SGHMC", False), ("AdamW twin", True)):
        start = time.perf_counter()
        if adamw:
            net = network(inputs, init)
            likelihood = GaussianLikelihood(num_data=num_data)
        else:
            net.load_state_dict(map_state)
            with torch.no_grad():
                likelihood.log_noise_std.copy_(map_log_std)
        burn_in = config["map_steps"] if adamw else config["burn_in"]
        means, stds = chain(
            net, likelihood, x, y, x_test, config, adamw=adamw, burn_in=burn_in, seed=init
        )
        score(name, means, predictive.gaussian_regression(means, stds).aleatoric, start)
        rows[name]["sigma"] = float(stds.mean())

    # Deep ensemble: K MAP networks, each with its own σ
    start = time.perf_counter()
    torch.manual_seed(init)
    members = config["members"]
    ensemble = ParallelEnsemble(lambda: network(inputs, int(torch.randint(2**31, ()))), members)
    noise = ParallelEnsemble(GaussianLikelihood(num_data=num_data), members)
    fit_map(
        ensemble, noise, x, y, config["map_steps"], loss_fn=lambda o, t: ensemble.loss(noise, o, t)
    )
    with torch.no_grad():
        means, stds = ensemble(x_test), noise.module.log_noise_std.exp()
    score("Deep ensemble", means, predictive.gaussian_regression(means, stds).aleatoric, start)
    return rows


def run(*, quick: bool, seed: int) -> dict[str, Any]:
    config = settings(quick)
    warm_up()
    per_split = []
    for split in progress_bar(range(config["splits"]), None, "splits"):
        rows = one_split(split, config, seed)
        per_split.append(rows)
        print(
            f"split {split + 1}/{config['splits']} (RMSE, log-lik): "
            + ", ".join(
                f"{method} {rows[method]['rmse']:.2f} {rows[method]['ll']:.4f}"
                for method in METHODS
            ),
            flush=True,
        )
    summary: dict[str, dict[str, float]] = {}

    def mean_and_error(values: Tensor) -> tuple[float, float]:
        error = values.std() / math.sqrt(len(values)) if len(values) > 1 else math.nan
        return float(values.mean()), float(error)

    for method in METHODS:
        for key in ("rmse", "ll", "seconds"):
            values = torch.tensor([rows[method][key] for rows in per_split], dtype=torch.float64)
            entry = summary.setdefault(method, {})
            entry[key], entry[key + "_se"] = mean_and_error(values)
            # paired with the MAP on the same split: the splits' spread cancels
            difference = values - torch.tensor(
                [rows["MAP"][key] for rows in per_split], dtype=torch.float64
            )
            entry[key + "_vs_map"], entry[key + "_vs_map_se"] = mean_and_error(difference)
    return dict(config=config, per_split=per_split, summary=summary)


def table(results: dict[str, Any]) -> str:
    rows = []
    for method in METHODS:
        entry = results["summary"][method]
        rows.append(
            {
                "method": method,
                "test RMSE": f"{entry['rmse']:.2f} ± {entry['rmse_se']:.2f}",
                "test log-lik / point": f"{entry['ll']:.3f} ± {entry['ll_se']:.3f}",
                "RMSE - MAP's": f"{entry['rmse_vs_map']:+.2f} ± {entry['rmse_vs_map_se']:.2f}",
                "log-lik - MAP's": f"{entry['ll_vs_map']:+.3f} ± {entry['ll_vs_map_se']:.3f}",
                "s / split": f"{entry['seconds']:.1f}",
            }
        )
    splits = results["config"]["splits"]
    title = f"diabetes, {splits} random 90/10 splits, original units (mean ± s.e. over splits)"
    columns = (
        "method",
        "test RMSE",
        "test log-lik / point",
        "RMSE - MAP's",
        "log-lik - MAP's",
        "s / split",
    )
    return print_table(rows, columns, title=title)


def plot(results: dict[str, Any], path: Any) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = results["summary"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    positions = range(len(METHODS))
    for axis, key, label in ((axes[0], "rmse", "test RMSE"), (axes[1], "ll", "test log-lik")):
        values = [summary[m][key] for m in METHODS]
        errors = [summary[m][key + "_se"] for m in METHODS]
        axis.errorbar(values, positions, xerr=errors, fmt="o", capsize=3)
        axis.set_yticks(list(positions), METHODS)
        axis.set_xlabel(label + " (original units)")
        axis.invert_yaxis()
    axes[1].set_yticklabels([])
    fig.suptitle(figure_title("Diabetes regression: mean ± s.e. over random splits"))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    torch.set_num_threads(1)
    quick, seed, path = example_arguments(
        argv, __doc__, quick="3 splits, short runs", figure="regression.png"
    )
    results = run(quick=quick, seed=seed)
    results["table"] = table(results)
    plot(results, path)
    results["figure"] = str(path)
    print(f"figure: {path}")
    return results


if __name__ == "__main__":
    main()
