"""Side-by-side timing for the benchmarks: interleaved rounds, medians, one thread.

Timings on a shared machine drift; measuring the contenders in alternating rounds and
reporting medians of per-round ratios keeps the comparison fair even when absolute times
move.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def seconds(fn: Callable[[], object], repeat: int) -> float:
    """Median wall time of ``fn`` over ``repeat`` calls (after one warm-up call)."""
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def batched_seconds(
    fn: Callable[[], object], repeat: int, device: torch.device | None = None
) -> float:
    """Mean wall time per call over ``repeat`` back-to-back calls (after one warm-up).

    On a CUDA ``device`` the batch starts and ends with ``torch.cuda.synchronize``, so
    the device's queued work is counted but not each call's launch latency alone.
    """

    def sync() -> None:
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()
    sync()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    sync()
    return (time.perf_counter() - start) / repeat


def interleaved(
    contenders: dict[str, Callable[[], object]],
    *,
    rounds: int,
    repeat: int,
    timer: Callable[[Callable[[], object], int], float] = seconds,
):
    """Time per contender over ``rounds`` alternating rounds of ``repeat`` calls each.

    ``timer(fn, repeat)`` times one round (default :func:`seconds`, the median call).

    Returns:
        ``{name: median over rounds}`` and ``{name: per-round times}``.
    """
    per_round: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(rounds):
        for name, fn in contenders.items():
            per_round[name].append(timer(fn, repeat))
    return {name: statistics.median(v) for name, v in per_round.items()}, per_round


def median_ratio(per_round: dict[str, list[float]], numerator: str, *denominators: str) -> float:
    """Median over rounds of ``numerator / sum(denominators)``, measured in the same round."""
    ratios = [
        n / sum(d)
        for n, *d in zip(
            per_round[numerator], *(per_round[name] for name in denominators), strict=True
        )
    ]
    return statistics.median(ratios)


def setup_threads(threads: int = 1) -> None:
    torch.set_num_threads(threads)
