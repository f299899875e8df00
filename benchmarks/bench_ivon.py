"""IVON's cost per training iteration against torch.optim.AdamW and ivon-opt 0.1.3.

Prints, for an MLP 784-256-256-10 at batch 128 on the CPU (torch.set_num_threads(1),
medians over interleaved rounds), the time of one full iteration (zero_grad, forward,
backward, step; for IVON inside ``sampled_params(train=True)``, one MC sample) as ratios:

- IVON / AdamW (the CPU default, foreach=False), target <= 1.15; also with the normals
  drawn in the step rather than on the worker thread (``overlap_noise=False``), and
  against AdamW with foreach=True;
- IVON / ivon-opt's IVON (target: below 1).

Run: ``python benchmarks/bench_ivon.py [--rounds 9] [--repeat 20]`` (about a minute).
"""

from __future__ import annotations

import argparse

import torch
from timing import interleaved, median_ratio, setup_threads
from torch import nn

from samplers_as_optim import IVON

NUM_DATA = 60_000
BATCH = 128


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    setup_threads(1)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, 784, generator=generator)
    y = torch.randint(0, 10, (BATCH,), generator=generator)

    def plain(opt: torch.optim.Optimizer, model: nn.Module):
        def iteration() -> None:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()

        return iteration

    def sampled(opt, model: nn.Module):
        def iteration() -> None:
            with opt.sampled_params(train=True):
                opt.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
            opt.step()

        return iteration

    contenders = {}
    model = mlp()
    contenders["AdamW"] = plain(torch.optim.AdamW(model.parameters(), lr=1e-3), model)
    model = mlp()
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    contenders["AdamW[foreach]"] = plain(adamw, model)
    model = mlp()
    contenders["IVON"] = sampled(IVON(model.parameters(), lr=0.1, ess=NUM_DATA, seed=0), model)
    model = mlp()
    serial = IVON(model.parameters(), lr=0.1, ess=NUM_DATA, seed=0, overlap_noise=False)
    contenders["IVON[serial]"] = sampled(serial, model)
    try:
        import ivon
    except ImportError:
        ivon = None
    if ivon is not None:
        model = mlp()
        contenders["ivon-opt"] = sampled(ivon.IVON(model.parameters(), lr=0.1, ess=NUM_DATA), model)

    medians, per_round = interleaved(contenders, rounds=args.rounds, repeat=args.repeat)
    numel = sum(p.numel() for p in mlp().parameters())
    print(f"full iteration, MLP 784-256-256-10 ({numel / 1e3:.0f}k parameters), batch {BATCH}")
    print("one MC sample, torch.set_num_threads(1), medians of interleaved rounds")
    for name, value in medians.items():
        print(f"    {name:<15} {value * 1e3:8.2f} ms")
    print(f"IVON / AdamW               = {median_ratio(per_round, 'IVON', 'AdamW'):.3f}"
          "  (target <= 1.15)")  # fmt: skip
    print(f"IVON[serial] / AdamW       = {median_ratio(per_round, 'IVON[serial]', 'AdamW'):.3f}")
    print(f"IVON / AdamW[foreach]      = {median_ratio(per_round, 'IVON', 'AdamW[foreach]'):.3f}")
    if ivon is not None:
        print(f"IVON / ivon-opt            = {median_ratio(per_round, 'IVON', 'ivon-opt'):.3f}"
              "  (target < 1)")  # fmt: skip
    else:
        print("ivon-opt is not installed: pip install ivon-opt==0.1.3")


if __name__ == "__main__":
    main()
