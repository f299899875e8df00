"""The cost of following a chain's temperature (``diagnostics.TemperatureMonitor``).

Prints, for two MLPs (about 1.9M and 5.8M parameters) at batch 128
(``torch.set_num_threads(1)``, medians of per-round ratios over interleaved rounds), the
time with the monitor over the time without, minus one:

(a) ``SGHMC.step()`` alone (the gradients fixed, the noise drawn in the step), with the
    monitor's defaults (every step reduced, ``coordinates=4096``: a fixed subset per
    param group) and, for comparison, reading every coordinate (``coordinates=None``);
(b) a full training iteration (forward, backward, step; the noise drawn on the worker
    thread during the passes, the default), likewise;
(c) the monitor's per-step reduction alone (``group_sums`` without the terms' spread,
    what a step costs between reads, and with the spread, once per window), over
    ``SGHMC.step()``: the differences in (a) and (b) are small beside the noise of a
    shared machine, this ratio of two directly timed calls is steadier.

The monitors read to the host every ``every=10`` steps (that read is in the timings).
Target: <= 2% of a step with the defaults (``stride=1``).

Run: ``python benchmarks/bench_chain_temperature.py [--rounds 9] [--repeat 20]``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import partial

import torch
from timing import interleaved, median_ratio, setup_threads
from torch import nn

from samplers_as_optim import SGHMC, diagnostics
from samplers_as_optim.sgmcmc.temperature.estimates import group_sums

NUM_DATA = 60_000
BATCH = 128
WIDTHS = (1024, 2048)  # 1.9M and 5.8M parameters
#: the monitors compared: the defaults, and every coordinate read
MONITORS = {"default": {}, "all coordinates": {"coordinates": None}}


def mlp(width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(784, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10)
    )


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, 784, generator=generator), torch.randint(
        0, 10, (BATCH,), generator=generator
    )


def sampler(params: list[nn.Parameter], **kwargs: object) -> SGHMC:
    return SGHMC(params, lr=1e-4, momentum=0.9, num_data=NUM_DATA, seed=0, **kwargs)  # type: ignore[arg-type]


def monitored(params: list[nn.Parameter], **kwargs: object) -> dict[str, SGHMC]:
    optimizers = {"plain": sampler(params, **kwargs)}
    for name, options in MONITORS.items():
        optimizer = sampler(params, **kwargs)
        diagnostics.TemperatureMonitor(optimizer, every=10, warn=False, **options)  # type: ignore[arg-type]
        optimizers[name] = optimizer
    return optimizers


def step_only(width: int, rounds: int, repeat: int) -> dict[str, float]:
    model = mlp(width)
    params = list(model.parameters())
    x, y = batch()
    nn.functional.cross_entropy(model(x), y).backward()
    optimizers = monitored(params, overlap_noise=False)
    with torch.no_grad():  # a tiny lr: the parameters barely move over the benchmark
        contenders = {name: optimizer.step for name, optimizer in optimizers.items()}
        _, per_round = interleaved(contenders, rounds=rounds, repeat=repeat)
    return {
        name: median_ratio(per_round, name, "plain") - 1 for name in optimizers if name != "plain"
    }


def iteration(width: int, rounds: int, repeat: int) -> dict[str, float]:
    model = mlp(width)
    params = list(model.parameters())
    x, y = batch()
    optimizers = monitored(params)

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


def reduction(width: int, rounds: int, repeat: int) -> dict[str, float]:
    model = mlp(width)
    params = list(model.parameters())
    x, y = batch()
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer = sampler(params, overlap_noise=False)
    optimizer.step()  # the momentum buffers exist
    group = optimizer.param_groups[0]
    contenders: dict[str, Callable[[], object]] = {"step": optimizer.step}
    for name, coordinates in (("default", 4096), ("all coordinates", None)):
        for spread in (False, True):
            contenders[f"{name}, {'with spread' if spread else 'means'}"] = partial(
                group_sums,
                SGHMC.definition.temperature_rule,
                group,
                0,
                optimizer.state,
                spread=spread,
                coordinates=coordinates,
            )
    with torch.no_grad():
        _, per_round = interleaved(contenders, rounds=rounds, repeat=repeat)
    return {name: median_ratio(per_round, name, "step") for name in contenders if name != "step"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    setup_threads(1)
    for width in WIDTHS:
        numel = sum(p.numel() for p in mlp(width).parameters())
        print(f"MLP of {numel:,} parameters, batch {BATCH}, one thread, every=10, stride=1")
        for title, measure in (("(a) SGHMC.step()", step_only), ("(b) full iteration", iteration)):
            overheads = measure(width, args.rounds, args.repeat)
            cells = ", ".join(f"{name}: {100 * value:+.1f}%" for name, value in overheads.items())
            print(f"  {title}, monitor overhead: {cells}")
        ratios = reduction(width, args.rounds, args.repeat)
        cells = ", ".join(f"{name}: {100 * value:.2f}%" for name, value in ratios.items())
        print(f"  (c) the per-step reduction / SGHMC.step(): {cells}")
        # a window of ``every`` steps reduces every step, the first with the spread
        for name in ("default", "all coordinates"):
            per_step = (ratios[f"{name}, with spread"] + 9 * ratios[f"{name}, means"]) / 10
            verdict = "meets" if per_step <= 0.02 else "misses"
            print(
                f"      {name}, averaged over a window of 10: {100 * per_step:.2f}% ({verdict} 2%)"
            )


if __name__ == "__main__":
    main()
