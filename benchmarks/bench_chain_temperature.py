"""The cost of following a chain's temperature (``diagnostics.TemperatureMonitor``).

Prints, for an MLP of about 1.9M parameters at batch 128 (``torch.set_num_threads(1)``,
medians of per-round ratios over interleaved rounds), the time with the monitor over the
time without, minus one:

(a) ``SGHMC.step()`` alone (the gradients fixed, the noise drawn in the step), with a
    monitor reducing every step (``stride=1``) and one step in ``stride``;
(b) a full training iteration (forward, backward, step; the noise drawn on the worker
    thread during the passes, the default), likewise;
(c) the monitor's per-step reduction alone (``group_sums`` without the terms' spread,
    what a step costs between reads) and with the spread (once per window), over
    ``SGHMC.step()``: the differences in (a) and (b) are small beside the noise of a
    shared machine, this ratio of two directly timed calls is steadier.

Both monitors read to the host every ``every=10`` steps (that read is in the timings).
Target: <= 2% of a step with ``stride=1``; where it is not met, the stride that meets
it is printed.

Run: ``python benchmarks/bench_chain_temperature.py [--rounds 9] [--repeat 20]``.
"""

from __future__ import annotations

import argparse

import torch
from timing import interleaved, median_ratio, setup_threads
from torch import nn

from samplers_as_optim import SGHMC, diagnostics
from samplers_as_optim.sgmcmc.chain_temperature import group_sums

NUM_DATA = 60_000
BATCH = 128
STRIDES = (1, 4, 10)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)
    )


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, 784, generator=generator), torch.randint(
        0, 10, (BATCH,), generator=generator
    )


def sampler(params: list[nn.Parameter], **kwargs: object) -> SGHMC:
    return SGHMC(params, lr=1e-4, momentum=0.9, num_data=NUM_DATA, seed=0, **kwargs)  # type: ignore[arg-type]


def step_only(rounds: int, repeat: int) -> dict[str, float]:
    model = mlp()
    params = list(model.parameters())
    x, y = batch()
    nn.functional.cross_entropy(model(x), y).backward()
    optimizers = {"plain": sampler(params, overlap_noise=False)}
    for stride in STRIDES:
        optimizer = sampler(params, overlap_noise=False)
        diagnostics.TemperatureMonitor(optimizer, every=10, stride=stride, warn=False)
        optimizers[f"stride {stride}"] = optimizer
    with torch.no_grad():  # a tiny lr: the parameters barely move over the benchmark
        contenders = {name: optimizer.step for name, optimizer in optimizers.items()}
        _, per_round = interleaved(contenders, rounds=rounds, repeat=repeat)
    return {
        name: median_ratio(per_round, name, "plain") - 1 for name in optimizers if name != "plain"
    }


def iteration(rounds: int, repeat: int) -> dict[str, float]:
    model = mlp()
    params = list(model.parameters())
    x, y = batch()
    optimizers = {"plain": sampler(params)}
    for stride in STRIDES:
        optimizer = sampler(params)
        diagnostics.TemperatureMonitor(optimizer, every=10, stride=stride, warn=False)
        optimizers[f"stride {stride}"] = optimizer

    def train(optimizer: SGHMC):
        def run() -> None:
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()

        return run

    contenders = {name: train(optimizer) for name, optimizer in optimizers.items()}
    _, per_round = interleaved(contenders, rounds=rounds, repeat=repeat)
    return {
        name: median_ratio(per_round, name, "plain") - 1 for name in optimizers if name != "plain"
    }


def reduction(rounds: int, repeat: int) -> dict[str, float]:
    model = mlp()
    params = list(model.parameters())
    x, y = batch()
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer = sampler(params, overlap_noise=False)
    optimizer.step()  # the momentum buffers exist
    group = optimizer.param_groups[0]
    contenders = {
        "step": optimizer.step,
        "means": lambda: group_sums("sghmc", group, 0, optimizer.state, spread=False),
        "with spread": lambda: group_sums("sghmc", group, 0, optimizer.state, spread=True),
    }
    with torch.no_grad():
        _, per_round = interleaved(contenders, rounds=rounds, repeat=repeat)
    return {name: median_ratio(per_round, name, "step") for name in ("means", "with spread")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    setup_threads(1)
    numel = sum(p.numel() for p in mlp().parameters())
    print(f"MLP of {numel:,} parameters, batch {BATCH}, one thread, every=10")
    for title, measure in (("(a) SGHMC.step()", step_only), ("(b) full iteration", iteration)):
        overheads = measure(args.rounds, args.repeat)
        cells = ", ".join(f"{name}: {100 * value:+.1f}%" for name, value in overheads.items())
        print(f"{title}, monitor overhead: {cells}")
        meets = [name for name, value in overheads.items() if value <= 0.02]
        print(f"    <= 2%: {meets[0] if meets else 'none of ' + str(list(overheads))}")
    ratios = reduction(args.rounds, args.repeat)
    cells = ", ".join(f"{name}: {100 * value:.1f}%" for name, value in ratios.items())
    print(f"(c) the per-step reduction / SGHMC.step(): {cells}")
    # a window of ``every`` steps reduces ceil(every / stride) of them, the first with the
    # spread: the cost per step, averaged over the window, in units of a step
    for every in (10, 100):
        costs = {
            stride: (ratios["with spread"] + (-(-every // stride) - 1) * ratios["means"]) / every
            for stride in (1, 2, 4, 10, 20)
        }
        cells = ", ".join(f"stride {k}: {100 * v:.1f}%" for k, v in costs.items())
        print(f"    every={every}, per step: {cells}")


if __name__ == "__main__":
    main()
