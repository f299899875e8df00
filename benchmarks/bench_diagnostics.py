"""R-hat and ESS at neural-network scale against arviz-stats.

Times, on one float32 array of 4 chains x 1000 draws x 10^5 quantities (1.6 GB):

(a) ``diagnostics.diagnose``: rank R-hat (bulk and folded), bulk-ESS and tail-ESS in one
    pass, against arviz-stats' ``rhat(method="rank")`` + ``ess(method="bulk")`` +
    ``ess(method="tail", prob=0.05)`` on the same array. Target: ours faster, and < 2 s.
(b) ``diagnostics.rhat`` alone against arviz-stats' rank R-hat.

arviz-stats loops over quantities in Python (about 4 ms per quantity for the three
statistics), so by default it is timed on the first ``--arviz-quantities`` quantities of the
same array and scaled linearly to all of them; ``--arviz-quantities 0`` times it on the whole
array (about 6-7 minutes). Our times are medians over ``--repeat`` calls after one warm-up.
Wall-clock and process CPU times are both printed: on a shared machine the wall time
includes waiting for other processes, while at one thread the CPU time is what the wall time
would be on an idle core.

Run: ``python benchmarks/bench_diagnostics.py [--threads 1] [--phi 0.0] [--repeat 3]``
(``--threads 0`` keeps torch's default thread count; ``--quantities`` shrinks the problem).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
import warnings

import numpy as np
import torch
from timing import setup_threads

from samplers_as_optim import diagnostics


def make_samples(chains: int, draws: int, quantities: int, phi: float) -> torch.Tensor:
    """float32 AR(1) chains with unit marginal variance (phi = 0: independent draws)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.empty(chains, draws, quantities)
    x[:, 0] = torch.randn(chains, quantities, generator=generator)
    scale = math.sqrt(1 - phi**2)
    for t in range(1, draws):
        torch.randn(chains, quantities, generator=generator, out=x[:, t])
        if phi:
            x[:, t].mul_(scale).add_(x[:, t - 1], alpha=phi)
    return x


def timed(fn, repeat: int) -> tuple[float, float]:
    """Median (wall, process CPU) seconds of ``fn`` over ``repeat`` calls after a warm-up."""
    fn()
    wall, cpu = [], []
    for _ in range(repeat):
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return statistics.median(wall), statistics.median(cpu)


def arviz_seconds(x: np.ndarray, which: str) -> tuple[float, float]:
    from arviz_stats.base import array_stats

    def run() -> None:
        array_stats.rhat(x, chain_axis=0, draw_axis=1, method="rank")
        if which == "all":
            array_stats.ess(x, chain_axis=0, draw_axis=1, method="bulk")
            array_stats.ess(x, chain_axis=0, draw_axis=1, method="tail", prob=0.05)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        start, start_cpu = time.perf_counter(), time.process_time()
        run()
        return time.perf_counter() - start, time.process_time() - start_cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chains", type=int, default=4)
    parser.add_argument("--draws", type=int, default=1000)
    parser.add_argument("--quantities", type=int, default=100_000)
    parser.add_argument("--phi", type=float, default=0.0, help="AR(1) autocorrelation")
    parser.add_argument("--threads", type=int, default=1, help="0: torch's default")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--arviz-quantities", type=int, default=1000, help="0: all")
    args = parser.parse_args()

    if args.threads:
        setup_threads(args.threads)
    threads = torch.get_num_threads()
    x = make_samples(args.chains, args.draws, args.quantities, args.phi)
    gigabytes = x.numel() * x.element_size() / 1e9
    print(
        f"samples [{args.chains}, {args.draws}, {args.quantities}] float32 ({gigabytes:.2f} GB), "
        f"AR(1) phi={args.phi}; torch threads: {threads}; load average before: "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )

    ours = {
        "all": timed(lambda: diagnostics.diagnose(x), args.repeat),
        "rhat": timed(lambda: diagnostics.rhat(x), args.repeat),
    }
    subset = min(args.arviz_quantities or args.quantities, args.quantities)
    array = x[:, :, :subset].numpy()
    scale = args.quantities / subset
    theirs = {}
    for which in ("all", "rhat"):
        wall, cpu = arviz_seconds(array, which)
        theirs[which] = (wall * scale, cpu * scale)

    how = "measured" if subset == args.quantities else f"timed on {subset}, scaled x{scale:g}"
    print(f"arviz-stats {how}; ours: median of {args.repeat} after a warm-up")
    print(
        f"{'statistics':34s} {'ours wall':>9s} {'ours cpu':>9s} {'arviz wall':>11s} "
        f"{'arviz cpu':>10s} {'ratio wall':>10s} {'ratio cpu':>9s}  < 2 s"
    )
    labels = {"all": "rank R-hat + bulk-ESS + tail-ESS", "rhat": "rank R-hat"}
    for which, label in labels.items():
        (wall, cpu), (their_wall, their_cpu) = ours[which], theirs[which]
        print(
            f"{label:34s} {wall:9.2f} {cpu:9.2f} {their_wall:11.1f} {their_cpu:10.1f} "
            f"{their_wall / wall:9.1f}x {their_cpu / cpu:8.1f}x  {'yes' if wall < 2 else 'no'}"
        )
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
