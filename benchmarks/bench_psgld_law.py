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
    written out here, since PSGLD has no such option): what a warm-up alone gives, with
    RMSprop's elementwise second moment and with Adafactor's factored one (a row and a
    column average, pooled over many elements, so it remembers little of one element's
    position).

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


def frozen_after(warmup: int, factored: bool = False, alpha: float = 0.99) -> list[float]:
    """PSGLD's update on the three-scale Gaussian, the second moment frozen after ``warmup``."""
    num_data, lr, steps, eps = 1000, 1e-3, 6000, 1e-8
    generator = torch.Generator().manual_seed(0)
    theta = torch.randn(4000, 3, generator=generator) * SIGMA
    square_avg = torch.zeros(4000, 3)
    rows, columns = torch.zeros(4000, 1), torch.zeros(1, 3)
    precondition = torch.zeros(4000, 3)
    for step in range(steps):
        grad = theta / (num_data * SIGMA**2)
        if step < warmup:
            if factored:
                rows = alpha * rows + (1 - alpha) * grad.square().mean(1, keepdim=True)
                columns = alpha * columns + (1 - alpha) * grad.square().mean(0, keepdim=True)
                second_moment = rows * columns / rows.mean()
            else:
                square_avg = alpha * square_avg + (1 - alpha) * grad**2
                second_moment = square_avg
            precondition = 1 / (second_moment.sqrt() + eps)
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
    print("(c) the same, the second moment frozen after K adaptive steps (alpha 0.99)")
    for warmup in (30, 100, 300, 1000, 6000):
        elementwise, factored = frozen_after(warmup), frozen_after(warmup, factored=True)
        print(f"  K={warmup:<5} elementwise {elementwise}  factored {factored}")


if __name__ == "__main__":
    main()
