"""ParallelEnsemble vs a Python loop over K separate models: time and peak memory per step.

One training step = zero_grad, forward, loss, backward, optimizer step. The loop is what
a user writes without this library: K ``nn.Module``s, each with its own optimizer
(``torch.optim.SGD``, or ``SGHMC`` for the sampler rows), stepped one after the other.
The ensemble is ``ParallelEnsemble.from_modules`` of the same K modules (same initial
weights, same batch), one optimizer over ``ensemble.parameters()``, and
``ensemble.loss(F.cross_entropy, ensemble(x), y).backward()``. The ``backward(chunk=c)``
rows instead call ``ensemble.backward(F.cross_entropy, x, targets=y, chunk_size=c)``:
forward and backward c members at a time, trading speed for activation memory.

Time: per-step medians over repeats, loop and ensemble interleaved in each repeat so a
change of machine load hits both; ``torch.set_num_threads(1)``.

Peak memory, measured two ways, in fresh subprocesses per (configuration, optimizer,
method), so nothing one measurement allocates is seen by another:

* mem (tensors): torch's profiler (``profile_memory=True``) records every op's own
  allocations and frees; their running sum, in time order, over building the models and
  optimizers and training ``--steps`` steps, peaks at the most bytes ever held in
  tensors: parameters, gradients, optimizer state and activations together. This sees
  exactly torch's CPU allocator, which ``tracemalloc`` cannot (torch does not allocate
  through Python's allocator). Deterministic.
* rss (process): the growth of the peak resident set (``VmHWM``, which is what
  ``resource.getrusage(RUSAGE_SELF).ru_maxrss`` reports) over building and training. The
  kernel's peak is first reset to the current RSS by writing 5 to
  ``/proc/self/clear_refs``, after torch is imported and one small instance of the same
  method has run, so neither import-time peaks nor lazily loaded code are charged. It
  includes the Python objects of K modules and K optimizers and the C allocator's
  slack (glibc keeps freed blocks), at page granularity; the median of ``--memory-runs``
  processes is shown.

Run: ``python benchmarks/bench_ensemble.py`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from samplers_as_optim import SGHMC
from samplers_as_optim.samples.ensemble import ParallelEnsemble

torch.set_num_threads(1)

NUM_DATA = 10_000
CONFIGS = [
    # (label, members, layer sizes, batch, speed target (loop time / ensemble time >=),
    #  chunk sizes of extra ensemble.backward(..., chunk_size=c) rows)
    ("64 x MLP 64-16-16-10, batch 32", 64, (64, 16, 16, 10), 32, 10.0, ()),
    ("8 x MLP 64-128-128-10, batch 128", 8, (64, 128, 128, 10), 128, 1.0, (4, 2)),
]
OPTIMIZERS: dict[str, Callable[[object], torch.optim.Optimizer]] = {
    "SGD": lambda params: torch.optim.SGD(params, lr=1e-2),
    "SGHMC": lambda params: SGHMC(params, lr=1e-2, momentum=0.9, num_data=NUM_DATA, seed=0),
}
MEMORY_TARGET = 1.2


def mlp(sizes: tuple[int, ...]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for fan_in, fan_out in itertools.pairwise(sizes):
        layers += [nn.Linear(fan_in, fan_out), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def data(sizes: tuple[int, ...], batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(batch, sizes[0], generator=generator)
    y = torch.randint(0, sizes[-1], (batch,), generator=generator)
    return x, y


class Loop:
    """K separate models, each with its own optimizer, stepped in a Python loop."""

    def __init__(self, models: list[nn.Module], optimizer: str) -> None:
        self.models = models
        self.optimizers = [OPTIMIZERS[optimizer](model.parameters()) for model in models]

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        for model, optimizer in zip(self.models, self.optimizers, strict=True):
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()


class Ensemble:
    """One ParallelEnsemble, one optimizer over its stacked parameters."""

    def __init__(
        self, ensemble: ParallelEnsemble, optimizer: str, chunk_size: int | None = None
    ) -> None:
        self.ensemble = ensemble
        self.optimizer = OPTIMIZERS[optimizer](ensemble.parameters())
        self.chunk_size = chunk_size

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.optimizer.zero_grad()
        if self.chunk_size is None:
            self.ensemble.loss(F.cross_entropy, self.ensemble(x), y).backward()
        else:
            self.ensemble.backward(F.cross_entropy, x, targets=y, chunk_size=self.chunk_size)
        self.optimizer.step()


def method_names(chunks: tuple[int, ...]) -> list[str]:
    return ["loop", "ensemble", *(f"backward(chunk={c})" for c in chunks)]


def chunk_of(method: str) -> int | None:
    return int(method.split("=")[1].rstrip(")")) if "chunk=" in method else None


def runner_for(method: str, models: list[nn.Module], optimizer: str):
    if method == "loop":
        return Loop(models, optimizer)
    return Ensemble(ParallelEnsemble.from_modules(models), optimizer, chunk_of(method))


def build(method: str, members: int, sizes: tuple[int, ...], optimizer: str):
    """Build from scratch (for memory: everything allocated here is counted)."""
    torch.manual_seed(0)
    if method == "loop":
        return Loop([mlp(sizes) for _ in range(members)], optimizer)
    ensemble = ParallelEnsemble(lambda: mlp(sizes), members)
    return Ensemble(ensemble, optimizer, chunk_of(method))


# ---------------------------------------------------------------------- time
def time_config(members, sizes, batch, optimizer, methods, repeats, steps) -> dict[str, float]:
    torch.manual_seed(0)
    models = [mlp(sizes) for _ in range(members)]
    runners = {method: runner_for(method, models, optimizer) for method in methods}
    x, y = data(sizes, batch)
    for runner in runners.values():
        for _ in range(3):
            runner.step(x, y)
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(repeats):
        for name, runner in runners.items():
            start = time.perf_counter()
            for _ in range(steps):
                runner.step(x, y)
            times[name].append((time.perf_counter() - start) / steps)
    return {name: statistics.median(values) for name, values in times.items()}


# ---------------------------------------------------------------------- memory
def _tensor_peak(run: Callable[[], object]) -> int:
    """Peak bytes held in tensors allocated during ``run``, from torch's profiler.

    Every op's own allocations and frees (``self_cpu_memory_usage``), in time order;
    tensors allocated before ``run`` are not seen, so ``run`` builds everything it uses.
    """
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        kept = run()
    del kept
    current = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        current += event.self_cpu_memory_usage
        peak = max(peak, current)
    return peak


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as file:
        for line in file:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak_rss() -> bool:
    """Restart the kernel's peak RSS from the current RSS (Linux >= 4.0); True if it did."""
    for _ in range(5):
        try:
            with open("/proc/self/clear_refs", "w") as file:
                file.write("5")
        except OSError:
            return False
        if _status_kib("VmHWM") <= _status_kib("VmRSS"):
            return True
    return False


def memory_child(config: int, optimizer: str, method: str, steps: int, what: str) -> dict:
    _, members, sizes, batch, _, _ = CONFIGS[config]
    x, y = data(sizes, batch)
    warm = build(method, 2, sizes, optimizer)  # load lazily initialised code paths
    for _ in range(3):
        warm.step(x, y)
    del warm
    gc.collect()

    def build_and_train():
        runner = build(method, members, sizes, optimizer)
        for _ in range(steps):
            runner.step(x, y)
        return runner

    if what == "tensors":
        return {"tensor_bytes": _tensor_peak(build_and_train)}
    if not _reset_peak_rss():
        return {"rss_kib": -1}
    before = _status_kib("VmHWM")
    runner = build_and_train()  # kept alive until measured
    grown = _status_kib("VmHWM") - before
    del runner
    return {"rss_kib": grown}


# glibc raises its mmap threshold each time a large block is freed, after which blocks
# that size come from the heap and stay resident when freed: the "rss*" column fixes the
# threshold at glibc's default (128 KiB), which also turns that adjustment off.
FIXED_THRESHOLD = {"MALLOC_MMAP_THRESHOLD_": "131072"}


def _child(config, optimizer, method, steps, what, env=None) -> dict:
    command = [sys.executable, __file__, "--memory-child", str(config), optimizer, method, what]
    command += ["--steps", str(steps)]
    environment = None if env is None else {**os.environ, **env}
    output = subprocess.run(
        command, check=True, capture_output=True, text=True, env=environment
    ).stdout
    return json.loads(output.strip().splitlines()[-1])


def measure_memory(config: int, optimizer: str, method: str, steps: int, runs: int) -> dict:
    """Tensor peak (deterministic, one process); RSS growth, median of ``runs`` processes."""
    rss = [_child(config, optimizer, method, steps, "rss")["rss_kib"] for _ in range(runs)]
    fixed = [
        _child(config, optimizer, method, steps, "rss", FIXED_THRESHOLD)["rss_kib"]
        for _ in range(runs)
    ]
    return {
        **_child(config, optimizer, method, steps, "tensors"),
        "rss_kib": statistics.median(rss),
        "rss_fixed_kib": statistics.median(fixed),
    }


# ---------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15, help="timing repeats")
    parser.add_argument("--steps", type=int, default=20, help="steps per timing repeat")
    parser.add_argument("--memory-runs", type=int, default=3, help="processes per memory row")
    parser.add_argument("--quick", action="store_true", help="a smoke run: few repeats")
    parser.add_argument(
        "--memory-child", nargs=4, metavar=("CONFIG", "OPTIMIZER", "METHOD", "WHAT")
    )
    args = parser.parse_args()
    if args.memory_child:
        config, optimizer, method, what = args.memory_child
        print(json.dumps(memory_child(int(config), optimizer, method, args.steps, what)))
        return
    repeats, steps, runs = (3, 3, 1) if args.quick else (args.repeats, args.steps, args.memory_runs)
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}; time: median of "
        f"{repeats} repeats x {steps} steps; memory: {steps} steps, median of {runs} runs\n"
    )
    header = (
        f"{'configuration':33} {'optim':5} {'method':18} {'loop ms':>7} {'ens ms':>6} "
        f"{'speedup':>7} {'target':>6} | {'mem loop':>8} {'mem ens':>7} {'ratio':>5} | "
        f"{'rss loop':>8} {'rss ens':>7} {'ratio':>5} | {'rss*':>5}"
    )
    print(header)
    print("-" * len(header))
    for index, (label, members, sizes, batch, target, chunks) in enumerate(CONFIGS):
        for optimizer in OPTIMIZERS:
            methods = method_names(chunks)
            times = time_config(members, sizes, batch, optimizer, methods, repeats, steps)
            memory = {m: measure_memory(index, optimizer, m, steps, runs) for m in methods}
            loop = memory["loop"]
            for method in methods[1:]:
                ens = memory[method]
                rss_ratio = _ratio(ens["rss_kib"], loop["rss_kib"])
                fixed_ratio = _ratio(ens["rss_fixed_kib"], loop["rss_fixed_kib"])
                print(
                    f"{label:33} {optimizer:5} {method:18} {times['loop'] * 1e3:7.2f} "
                    f"{times[method] * 1e3:6.2f} {times['loop'] / times[method]:6.1f}x "
                    f"{target:5.0f}x | {loop['tensor_bytes'] / 1024:6.0f}Ki "
                    f"{ens['tensor_bytes'] / 1024:5.0f}Ki "
                    f"{ens['tensor_bytes'] / loop['tensor_bytes']:5.2f} | "
                    f"{loop['rss_kib']:6.0f}Ki {ens['rss_kib']:5.0f}Ki {rss_ratio:5.2f} | "
                    f"{fixed_ratio:5.2f}"
                )
    print(
        f"\nTargets: speedup >= target; memory ratio <= {MEMORY_TARGET}.\n"
        "mem: peak bytes held in tensors while building and training (torch profiler).\n"
        "rss: growth of the peak resident set of a fresh process over the same, median\n"
        "of runs; rss*: its ratio with glibc's mmap threshold fixed "
        "(MALLOC_MMAP_THRESHOLD_=131072)."
    )


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if numerator >= 0 and denominator > 0 else float("nan")


if __name__ == "__main__":
    main()
