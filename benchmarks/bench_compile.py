"""``torch.compile(opt.step)`` against the eager step, for torch.optim.SGD and SGHMC.

The benchmark MLP of ``bench_samplers.py`` (1.86M parameters), gradients fixed, only the
optimizer step timed: eager and compiled, for ``torch.optim.SGD(momentum=0.9)`` and for
``SGHMC(momentum=0.9)`` at temperature 1 (compiled with ``nonfinite="skip"``, which makes
the step one graph; the eager SGHMC runs at its defaults, ``nonfinite="raise"``, and with
``nonfinite="skip"``), the noise drawn in the step (``overlap_noise=False``). Then a full
training iteration (forward, backward, step) with the noise drawn ahead (the default),
eager and compiled step. Also prints ``torch._dynamo.explain``'s graph and break counts.

Medians over interleaved rounds (``timing.py``); on CUDA every timed call ends with
``torch.cuda.synchronize()`` over a batch of ``--repeat`` calls.

Run: ``python benchmarks/bench_compile.py [--device cuda] [--rounds 7] [--repeat 20]``.
"""

from __future__ import annotations

import argparse
import warnings

import torch
from bench_samplers import NUM_DATA, batch, mlp
from timing import batched_seconds, interleaved, median_ratio, setup_threads
from torch import nn

from samplers_as_optim import SGHMC


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    setup_threads(args.threads)
    device = torch.device(args.device)
    x, y = (t.to(device) for t in batch())
    common = {"lr": 1e-4, "momentum": 0.9}
    sampler = {"num_data": NUM_DATA, "seed": 0, "overlap_noise": False}

    def build(kind: str):
        model = mlp().to(device)
        nn.functional.cross_entropy(model(x), y).backward()
        params = list(model.parameters())
        if kind == "SGD":
            return torch.optim.SGD(params, **common)
        if kind == "SGHMC skip":
            return SGHMC(params, **common, **sampler, nonfinite="skip")
        return SGHMC(params, **common, **sampler)

    contenders = {
        "SGD eager": build("SGD").step,
        "SGD compiled": torch.compile(build("SGD").step),
        "SGHMC eager": build("SGHMC").step,
        "SGHMC eager, skip": build("SGHMC skip").step,
        "SGHMC compiled": torch.compile(build("SGHMC skip").step),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in ("SGD", "SGHMC skip"):
            explained = torch._dynamo.explain(build(name).step)()
            print(
                f"torch._dynamo.explain({name.split()[0]}.step): "
                f"{explained.graph_count} graph(s), {explained.graph_break_count} break(s)"
            )
        for fn in contenders.values():  # compile (twice: state created, then steady)
            for _ in range(3):
                fn()
    medians, per_round = interleaved(
        contenders,
        rounds=args.rounds,
        repeat=args.repeat,
        timer=lambda fn, repeat: batched_seconds(fn, repeat, device),
    )
    print(f"torch {torch.__version__}, device {device}, {args.threads} thread(s)")
    for name, value in medians.items():
        print(f"    {name:<18} {value * 1e3:8.3f} ms")
    print(
        "SGD compiled / eager   = "
        f"{median_ratio(per_round, 'SGD compiled', 'SGD eager'):.3f}\n"
        "SGHMC compiled / eager = "
        f"{median_ratio(per_round, 'SGHMC compiled', 'SGHMC eager'):.3f}  (target <= 1)\n"
        "SGHMC compiled / SGD compiled = "
        f"{median_ratio(per_round, 'SGHMC compiled', 'SGD compiled'):.3f}"
    )
    full_iteration(args, device)


def full_iteration(args: argparse.Namespace, device: torch.device) -> None:
    """A training iteration, eager and compiled step, the noise drawn ahead (default)."""
    x, y = (t.to(device) for t in batch())

    def iteration(make, compiled: bool):
        model = mlp().to(device)
        opt = make(model.parameters())
        step = torch.compile(opt.step) if compiled else opt.step

        def run() -> None:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            step()

        return run

    common = {"lr": 1e-4, "momentum": 0.9}
    sampler = {"num_data": NUM_DATA, "seed": 0}
    contenders = {
        "SGD eager": iteration(lambda p: torch.optim.SGD(p, **common), False),
        "SGD compiled": iteration(lambda p: torch.optim.SGD(p, **common), True),
        "SGHMC eager": iteration(lambda p: SGHMC(p, **common, **sampler), False),
        "SGHMC compiled": iteration(
            lambda p: SGHMC(p, **common, **sampler, nonfinite="skip"), True
        ),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for fn in contenders.values():
            for _ in range(3):
                fn()
    medians, per_round = interleaved(
        contenders,
        rounds=args.rounds,
        repeat=args.repeat,
        timer=lambda fn, repeat: batched_seconds(fn, repeat, device),
    )
    print("full iteration (forward, backward, step), batch 128, noise drawn ahead")
    for name, value in medians.items():
        print(f"    {name:<18} {value * 1e3:8.3f} ms")
    print(
        "SGHMC compiled / eager = "
        f"{median_ratio(per_round, 'SGHMC compiled', 'SGHMC eager'):.3f}  (target <= 1)\n"
        "SGHMC / SGD, both compiled = "
        f"{median_ratio(per_round, 'SGHMC compiled', 'SGD compiled'):.3f}\n"
        "SGHMC / SGD, both eager = "
        f"{median_ratio(per_round, 'SGHMC eager', 'SGD eager'):.3f}"
    )


if __name__ == "__main__":
    main()
