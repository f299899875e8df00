"""The sampler's cost on a CUDA device: the README's GPU figures.

Three comparisons, each side by side in one run (interleaved rounds, medians of
per-round ratios; every timed batch of ``--repeat`` calls ends with
``torch.cuda.synchronize()``):

(a) step only, the 1.86M-parameter MLP of ``bench_samplers.py`` with fixed gradients:
    ``SGHMC.step`` / (``SGD.step`` + ``torch.randn`` of every parameter), the noise drawn
    in the step (``overlap_noise=False``); both optimizers on their CUDA default, foreach.
(b) a full training iteration (zero_grad, forward, backward, step) at batch 128 and at
    batch 4096, and for a 37M-parameter MLP 784-4096-4096-4096-10 at batch 512: SGHMC
    (noise drawn ahead on a side stream, the default; drawn in the step; and with
    ``nonfinite="skip"``) / ``SGD(momentum=0.9)``; with torch >= 2.13 also both steps
    compiled.
(c) ``ParallelEnsemble`` of K MLPs with one SGHMC / a Python loop over K models each with
    its own SGHMC (K = 16, MLP 784-256-256-10, batch 128): time per step.

Run: ``python benchmarks/bench_gpu.py [--rounds 7] [--repeat 50]`` on a machine with CUDA.
"""

from __future__ import annotations

import argparse
import warnings

import torch
import torch.nn.functional as F
from bench_samplers import NUM_DATA, mlp
from timing import batched_seconds, interleaved, median_ratio
from torch import nn

from samplers_as_optim import SGHMC
from samplers_as_optim.core.noise_op import COMPILED_DRAW
from samplers_as_optim.samples.ensemble import ParallelEnsemble

DEVICE = torch.device("cuda")


def timed(contenders, rounds: int, repeat: int):
    """Per-round times of each contender (``timing.interleaved``, a sync per batch)."""
    _, per_round = interleaved(
        contenders,
        rounds=rounds,
        repeat=repeat,
        timer=lambda fn, repeat: batched_seconds(fn, repeat, DEVICE),
    )
    return per_round


def show(per_round) -> None:
    for name, values in per_round.items():
        print(f"    {name:<28} {sorted(values)[len(values) // 2] * 1e3:8.3f} ms")


def data(batch: int):
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 784, generator=generator).to(DEVICE)
    y = torch.randint(0, 10, (batch,), generator=generator).to(DEVICE)
    return x, y


def step_only(rounds: int, repeat: int) -> None:
    model = mlp().to(DEVICE)
    x, y = data(128)
    F.cross_entropy(model(x), y).backward()
    params = list(model.parameters())
    sgd = torch.optim.SGD(params, lr=1e-4, momentum=0.9)
    sampler = {"lr": 1e-4, "momentum": 0.9, "num_data": NUM_DATA, "seed": 0}
    sghmc = SGHMC(params, **sampler, overlap_noise=False)
    skipping = SGHMC(params, **sampler, overlap_noise=False, nonfinite="skip")
    generator = torch.Generator(device=DEVICE).manual_seed(0)

    def draw():
        return [torch.randn(p.shape, generator=generator, device=DEVICE) for p in params]

    per_round = timed(
        {
            "SGD.step": sgd.step,
            "randn": draw,
            "SGHMC.step": sghmc.step,
            "SGHMC.step (skip)": skipping.step,
        },
        rounds,
        repeat,
    )
    print("(a) step only, 1.86M parameters, fixed gradients")
    show(per_round)
    ratio = median_ratio(per_round, "SGHMC.step", "SGD.step", "randn")
    print(f"    SGHMC.step / (SGD.step + randn) = {ratio:.3f}")
    print(f"    SGHMC.step / SGD.step = {median_ratio(per_round, 'SGHMC.step', 'SGD.step'):.3f}")
    ratio = median_ratio(per_round, "SGHMC.step (skip)", "SGD.step", "randn")
    print(f"    SGHMC.step (nonfinite='skip': no sync) / (SGD.step + randn) = {ratio:.3f}")


def wide_mlp() -> nn.Module:
    """MLP 784-4096-4096-4096-10: 37.0M parameters."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(784, 4096),
        nn.ReLU(),
        nn.Linear(4096, 4096),
        nn.ReLU(),
        nn.Linear(4096, 4096),
        nn.ReLU(),
        nn.Linear(4096, 10),
    )


def full_iteration(batch: int, rounds: int, repeat: int, make_model=mlp) -> None:
    x, y = data(batch)

    def iteration(opt_factory, *, compiled=False):
        model = make_model().to(DEVICE)
        opt = opt_factory(model.parameters())
        step = torch.compile(opt.step) if compiled else opt.step

        def run():
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            step()

        return run

    common = {"lr": 1e-4, "momentum": 0.9}
    sampler = {"num_data": NUM_DATA, "seed": 0}
    contenders = {
        "SGD": iteration(lambda p: torch.optim.SGD(p, **common)),
        "SGHMC (noise ahead)": iteration(lambda p: SGHMC(p, **common, **sampler)),
        "SGHMC (noise in step)": iteration(
            lambda p: SGHMC(p, **common, **sampler, overlap_noise=False)
        ),
        "SGHMC (skip, noise ahead)": iteration(
            lambda p: SGHMC(p, **common, **sampler, nonfinite="skip")
        ),
    }
    if COMPILED_DRAW:  # torch >= 2.13: the step compiles to one graph
        contenders["SGD, compiled step"] = iteration(
            lambda p: torch.optim.SGD(p, **common), compiled=True
        )
        contenders["SGHMC, compiled step"] = iteration(
            lambda p: SGHMC(p, **common, **sampler, nonfinite="skip"), compiled=True
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for fn in contenders.values():
            for _ in range(3):
                fn()
    per_round = timed(contenders, rounds, repeat)
    size = sum(p.numel() for p in make_model().parameters()) / 1e6
    print(f"(b) full iteration, {size:.2f}M parameters, batch {batch}")
    show(per_round)
    for name in ("SGHMC (noise ahead)", "SGHMC (noise in step)", "SGHMC (skip, noise ahead)"):
        print(f"    {name} / SGD = {median_ratio(per_round, name, 'SGD'):.3f}")
    if COMPILED_DRAW:
        ratio = median_ratio(per_round, "SGHMC, compiled step", "SGD, compiled step")
        print(f"    SGHMC / SGD, both steps compiled = {ratio:.3f}")


def ensemble_vs_loop(rounds: int, repeat: int, members: int = 16) -> None:
    x, y = data(128)

    def small():
        return nn.Sequential(
            nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)
        ).to(DEVICE)

    torch.manual_seed(0)
    models = [small() for _ in range(members)]
    sampler = {"lr": 1e-3, "momentum": 0.9, "num_data": NUM_DATA, "seed": 0}
    optimizers = [SGHMC(m.parameters(), **sampler) for m in models]

    def loop():
        for model, opt in zip(models, optimizers, strict=True):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()

    ensemble = ParallelEnsemble.from_modules([small() for _ in range(members)])
    ensemble_opt = SGHMC(ensemble.parameters(), **sampler)

    def parallel():
        ensemble_opt.zero_grad()
        ensemble.loss(F.cross_entropy, ensemble(x), y).backward()
        ensemble_opt.step()

    per_round = timed({"loop": loop, "ParallelEnsemble": parallel}, rounds, repeat)
    print(f"(c) {members} x MLP 784-256-256-10, SGHMC, batch 128, one step of all members")
    show(per_round)
    speedup = median_ratio(per_round, "loop", "ParallelEnsemble")
    print(f"    loop / ParallelEnsemble = {speedup:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeat", type=int, default=50)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu.py needs a CUDA device")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    step_only(args.rounds, args.repeat)
    for batch in (128, 4096):
        full_iteration(batch, args.rounds, args.repeat)
    full_iteration(512, args.rounds, max(args.repeat // 5, 5), make_model=wide_mlp)
    ensemble_vs_loop(args.rounds, args.repeat)


if __name__ == "__main__":
    main()
