"""The law PSGLD samples at temperature > 0, as full variances (not interquartile ranges).

Prints the figures of ``samplers_as_optim/sgmcmc/psgld.py``'s docstring and of the
samplers guide:

(a) N(0, 1), full-batch gradients, N = 1, T = 1, lr 0.01, 10,000 chains started at the
    target, two seeds: the variance of the final states, the interquartile sd, and the
    fraction beyond 3 sd (0.27% for the target), for alpha in {0.5, 0.99, 0.999} with and
    without Li et al.'s correction.
(b) N(0, diag(0.1², 1, 10²)), lr 1e-3, N = 1000, 4,000 elements per coordinate started at
    the target, 6,000 steps: each coordinate's final variance over the target's, with the
    defaults and with alpha = 0.999.
(c) the same Gaussian with the preconditioner frozen after K adaptive steps (the update
    written out here, since PSGLD has no such option): what a warm-up alone gives.

Run: ``python benchmarks/bench_psgld_law.py`` (about two minutes on one core).
"""

from __future__ import annotations

import numpy as np
import torch

from samplers_as_optim import PSGLD

SIGMA = torch.tensor([0.1, 1.0, 10.0])


def standard_normal(alpha: float, correction: bool, steps: int, seed: int) -> str:
    generator = torch.Generator().manual_seed(seed)
    theta = torch.nn.Parameter(torch.randn(10_000, generator=generator, dtype=torch.float64))
    opt = PSGLD([theta], lr=0.01, alpha=alpha, num_data=1, correction=correction, seed=seed)
    for _ in range(steps):
        theta.grad = theta.detach().clone()
        opt.step()
    x = theta.detach().numpy()
    q1, q3 = np.quantile(x, [0.25, 0.75])
    beyond = float(np.mean(np.abs(x) > 3))
    return f"var {x.var():7.3f}  interquartile sd {(q3 - q1) / 1.349:.3f}  beyond 3 sd {beyond:.4f}"


def three_scales(**kwargs: float) -> list[float]:
    num_data, steps = 1000, 6000
    torch.manual_seed(0)
    theta = (torch.randn(4000, 3) * SIGMA).requires_grad_()
    opt = PSGLD([theta], lr=1e-3, num_data=num_data, seed=1, **kwargs)
    for _ in range(steps):
        theta.grad = theta.detach() / (num_data * SIGMA**2)
        opt.step()
    return [round(v, 3) for v in (theta.detach().var(0) / SIGMA**2).tolist()]


def frozen_after(warmup: int, alpha: float = 0.99, eps: float = 1e-8) -> list[float]:
    """PSGLD's update on the three-scale Gaussian, V frozen after ``warmup`` steps."""
    num_data, lr, steps = 1000, 1e-3, 6000
    generator = torch.Generator().manual_seed(0)
    theta = torch.randn(4000, 3, generator=generator) * SIGMA
    square_avg = torch.zeros(4000, 3)
    precondition = torch.zeros(4000, 3)
    for step in range(steps):
        grad = theta / (num_data * SIGMA**2)
        if step < warmup:
            square_avg = alpha * square_avg + (1 - alpha) * grad**2
            precondition = 1 / (square_avg.sqrt() + eps)
        noise = torch.randn(4000, 3, generator=generator)
        theta = theta - lr * precondition * grad + (2 * lr * precondition / num_data).sqrt() * noise
    return [round(v, 3) for v in (theta.var(0) / SIGMA**2).tolist()]


def main() -> None:
    torch.set_num_threads(1)
    print("(a) N(0, 1), full batch, lr 0.01, 10,000 chains (target: var 1, beyond 3 sd 0.0027)")
    for alpha, steps in ((0.5, 1500), (0.99, 1500), (0.999, 6000)):
        for correction in (False, True):
            for seed in (0, 1):
                line = standard_normal(alpha, correction, steps, seed)
                print(f"  alpha={alpha} correction={correction!s:5} seed={seed}: {line}")
    print("(b) N(0, diag(0.1^2, 1, 10^2)): final variance / target's, per coordinate")
    print(f"  defaults:     {three_scales()}")
    print(f"  alpha=0.999:  {three_scales(alpha=0.999)}")
    print("(c) the same, V frozen after K adaptive steps (alpha 0.99)")
    for warmup in (30, 100, 300, 1000):
        print(f"  K={warmup:<5} {frozen_after(warmup)}")


if __name__ == "__main__":
    main()
