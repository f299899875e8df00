"""The law PSGLD samples at temperature > 0, as full variances (not interquartile ranges).

Prints the figures of ``samplers_as_optim/sgmcmc/psgld.py``'s docstring and of the
samplers guide. "Li et al." is PSGLD with its elementwise preconditioner following
RMSprop's V at every step (``preconditioner="elementwise", preconditioner_warmup=None``,
the default before 0.2); "defaults" pools V (Adafactor's factored estimate) and freezes
it after 1,000 steps (``samplers_as_optim/sgmcmc/sampling_preconditioner.py``).

(a) N(0, 1), full-batch gradients, N = 1, T = 1, lr 0.01, 10,000 chains started at the
    target, two seeds: the variance of the final states, the interquartile sd, and the
    fraction beyond 3 sd (0.27% for the target), for alpha in {0.5, 0.99, 0.999}: Li et
    al.'s with and without their correction, and the defaults.
(b) N(0, diag(0.1², 1, 10²)), lr 1e-3, N = 1000, 4,000 elements per coordinate started at
    the target, 6,000 steps: each coordinate's final variance over the target's, with the
    defaults, with Li et al.'s, and at alpha = 0.999.
(c) the same Gaussian with the preconditioner frozen after K steps: what freezing alone
    gives (elementwise) and what pooling adds (factored).

Run: ``python benchmarks/bench_psgld_law.py`` (about three minutes on one core).
"""

from __future__ import annotations

import numpy as np
import torch

from samplers_as_optim import PSGLD

SIGMA = torch.tensor([0.1, 1.0, 10.0])


LI_ET_AL = {"preconditioner": "elementwise", "preconditioner_warmup": None}


def standard_normal(alpha: float, steps: int, seed: int, **kwargs: object) -> str:
    generator = torch.Generator().manual_seed(seed)
    theta = torch.nn.Parameter(torch.randn(10_000, generator=generator, dtype=torch.float64))
    opt = PSGLD([theta], lr=0.01, alpha=alpha, num_data=1, seed=seed, **kwargs)
    for _ in range(steps):
        theta.grad = theta.detach().clone()
        opt.step()
    x = theta.detach().numpy()
    q1, q3 = np.quantile(x, [0.25, 0.75])
    beyond = float(np.mean(np.abs(x) > 3))
    return f"var {x.var():7.3f}  interquartile sd {(q3 - q1) / 1.349:.3f}  beyond 3 sd {beyond:.4f}"


def three_scales(**kwargs: object) -> list[float]:
    num_data, steps = 1000, 6000
    torch.manual_seed(0)
    theta = (torch.randn(4000, 3) * SIGMA).requires_grad_()
    opt = PSGLD([theta], lr=1e-3, num_data=num_data, seed=1, **kwargs)
    for _ in range(steps):
        theta.grad = theta.detach() / (num_data * SIGMA**2)
        opt.step()
    return [round(v, 3) for v in (theta.detach().var(0) / SIGMA**2).tolist()]


def main() -> None:
    torch.set_num_threads(1)
    print("(a) N(0, 1), full batch, lr 0.01, 10,000 chains (target: var 1, beyond 3 sd 0.0027)")
    for alpha, steps in ((0.5, 1500), (0.99, 1500), (0.999, 6000)):
        runs = {
            "Li et al.": dict(LI_ET_AL),
            "Li et al. + correction": {**LI_ET_AL, "correction": True},
            "defaults": {},
        }
        for label, kwargs in runs.items():
            for seed in (0, 1):
                line = standard_normal(alpha, steps, seed, **kwargs)
                print(f"  alpha={alpha} {label:23} seed={seed}: {line}")
    print("(b) N(0, diag(0.1^2, 1, 10^2)): final variance / target's, per coordinate")
    print(f"  defaults:                {three_scales()}")
    print(f"  defaults, alpha=0.999:   {three_scales(alpha=0.999)}")
    print(f"  Li et al.:               {three_scales(**LI_ET_AL)}")
    print(f"  Li et al., alpha=0.999:  {three_scales(alpha=0.999, **LI_ET_AL)}")
    print(f"  factored, never frozen:  {three_scales(preconditioner_warmup=None)}")
    print("(c) the same, the preconditioner frozen after K steps (alpha 0.99)")
    for warmup in (30, 100, 300, 1000):
        elementwise = three_scales(preconditioner="elementwise", preconditioner_warmup=warmup)
        factored = three_scales(preconditioner_warmup=warmup)
        print(f"  K={warmup:<5} elementwise {elementwise}  factored {factored}")


if __name__ == "__main__":
    main()
