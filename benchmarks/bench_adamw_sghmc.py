"""AdamWSGHMC: the law it samples (full variances), its speed-up on an ill-conditioned
Gaussian against SGHMC, and its cost per iteration against ``torch.optim.AdamW``.

(a) The law. N(0, diag(0.1², 1, 10²)), lr 1e-3, N = 1000, T = 1, 4,000 elements per
    coordinate started at the target, 6,000 steps: each coordinate's final variance over
    the target's (Monte Carlo sd 0.022), with the defaults (weight decay 1e-2, whose prior
    N(0, 1/(N λ a)) shrinks the slowest coordinate's target by about 9%, and which it does
    not reach in 6,000 steps), without weight decay, and with the preconditioner AdamW's
    own (elementwise) and/or never frozen.
(b) Mixing. N(0, diag(0.01², 1)) started over-dispersed (3 sd): the variance of the slow
    coordinate after k steps, for the twin (lr 0.01, frozen after 100 steps) and for
    SGHMC at its largest stable lr (lr N H = 0.1 on the stiff coordinate): the steps each
    needs to bring it within 10% of the target.
(c) The cost. An MLP 784-512-512-10 on a batch of 128, one thread: the median time of a
    full iteration (forward, backward, step) and of the step alone, over interleaved
    rounds, as ratios to AdamW with the same arguments, for the twin at T = 1 (the noise
    drawn ahead, its default) and at T = 0 (torch's own AdamW step).

Run: ``python benchmarks/bench_adamw_sghmc.py`` (about three minutes on one core);
``--quick`` for (c) only.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from samplers_as_optim import SGHMC, AdamWSGHMC

SIGMA = torch.tensor([0.1, 1.0, 10.0])


def law(**kwargs: object) -> list[float]:
    num_data, steps = 1000, 6000
    torch.manual_seed(0)
    theta = (torch.randn(4000, 3) * SIGMA).requires_grad_()
    opt = AdamWSGHMC([theta], num_data=num_data, seed=1, **kwargs)
    for _ in range(steps):
        theta.grad = theta.detach() / (num_data * SIGMA**2)
        opt.step()
    return [round(v, 3) for v in (theta.detach().var(0) / SIGMA**2).tolist()]


def mixing(cls: type, checkpoints: list[int], **kwargs: object) -> list[float]:
    sigma = torch.tensor([0.01, 1.0], dtype=torch.float64)
    num_data = 100
    generator = torch.Generator().manual_seed(1)
    start = torch.randn(4000, 2, generator=generator, dtype=torch.float64) * 3 * sigma
    theta = start.requires_grad_()
    opt = cls([theta], num_data=num_data, seed=0, **kwargs)
    out = []
    for step in range(1, max(checkpoints) + 1):
        theta.grad = theta.detach() / (num_data * sigma**2)
        opt.step()
        if step in checkpoints:
            out.append(round(float(theta.detach()[:, 1].var()), 3))
    return out


def cost(rounds: int = 15, iterations: int = 10) -> None:
    torch.manual_seed(0)
    x, y = torch.randn(128, 784), torch.randint(0, 10, (128,))

    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)
        )

    makers = {
        "AdamW": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3),
        "twin T=1": lambda m: AdamWSGHMC(
            m.parameters(), lr=1e-3, num_data=60000, seed=0, preconditioner_warmup=10
        ),
        "twin T=0": lambda m: AdamWSGHMC(
            m.parameters(), lr=1e-3, num_data=60000, seed=0, temperature=0.0
        ),
    }
    runs = {name: (m := model(), make(m)) for name, make in makers.items()}
    full: dict[str, list[float]] = {name: [] for name in runs}
    step: dict[str, list[float]] = {name: [] for name in runs}
    for round_ in range(rounds + 2):  # two warm-up rounds (the twin freezes at step 10)
        for name, (m, opt) in runs.items():
            total = stepping = 0.0
            for _ in range(iterations):
                start = time.perf_counter()
                opt.zero_grad()
                nn.functional.cross_entropy(m(x), y).backward()
                middle = time.perf_counter()
                opt.step()
                end = time.perf_counter()
                total += end - start
                stepping += end - middle
            if round_ >= 2:
                full[name].append(total)
                step[name].append(stepping)
    base_full, base_step = statistics.median(full["AdamW"]), statistics.median(step["AdamW"])
    for name in runs:
        print(
            f"  {name:9}  full iteration {statistics.median(full[name]) / base_full:.3f}x  "
            f"step {statistics.median(step[name]) / base_step:.3f}x AdamW's"
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="(c) only")
    quick = parser.parse_args().quick
    torch.set_num_threads(1)
    if not quick:
        print("(a) N(0, diag(0.1^2, 1, 10^2)): final variance / target's, per coordinate")
        print(f"  defaults:                           {law()}")
        print(f"  weight_decay=0:                     {law(weight_decay=0.0)}")
        print(f"  elementwise, frozen:                {law(preconditioner='elementwise')}")
        print(f"  factored, never frozen:             {law(preconditioner_warmup=None)}")
        moving = law(preconditioner="elementwise", preconditioner_warmup=None)
        print(f"  elementwise, never frozen (AdamW's): {moving}")
        print("(b) N(0, diag(0.01^2, 1)) from 3 sd: the slow coordinate's variance (target 1)")
        checkpoints = [250, 500, 1000, 2000, 4000, 8000]
        twin = mixing(AdamWSGHMC, checkpoints, lr=0.01, weight_decay=0.0, preconditioner_warmup=100)
        sghmc = mixing(SGHMC, checkpoints, lr=0.1 * 0.01**2, momentum=0.9)
        print(f"  after {checkpoints} steps")
        print(f"  AdamWSGHMC: {twin}")
        print(f"  SGHMC:      {sghmc}")
    print("(c) cost per iteration, MLP 784-512-512-10, batch 128, one thread (medians)")
    cost()


if __name__ == "__main__":
    main()
