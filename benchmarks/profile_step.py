"""Where a sampler step's time goes: torch.profiler's table for SGD.step and SGHMC.step.

The benchmark MLP (1.86M parameters) with fixed gradients; ``--device cuda`` profiles the
CUDA step (CPU-side dispatch and the kernels). SGHMC with the noise drawn in the step
(``overlap_noise=False``), under both non-finite policies.

Run: ``python benchmarks/profile_step.py [--device cuda] [--steps 20]``.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from bench_samplers import NUM_DATA, batch, mlp
from torch.profiler import ProfilerActivity, profile

from samplers_as_optim import SGHMC


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rows", type=int, default=14)
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = torch.device(args.device)
    model = mlp().to(device)
    x, y = (t.to(device) for t in batch())
    F.cross_entropy(model(x), y).backward()
    common = {"lr": 1e-4, "momentum": 0.9}
    optimizers = {
        "SGD": torch.optim.SGD(model.parameters(), **common),
        "SGHMC raise": SGHMC(
            model.parameters(), **common, num_data=NUM_DATA, seed=0, overlap_noise=False
        ),
        "SGHMC skip": SGHMC(
            model.parameters(),
            **common,
            num_data=NUM_DATA,
            seed=0,
            overlap_noise=False,
            nonfinite="skip",
        ),
    }
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    for name, opt in optimizers.items():
        for _ in range(3):
            opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        with profile(activities=activities) as prof:
            for _ in range(args.steps):
                opt.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
        print(f"== {name}: {args.steps} steps")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
