"""A last layer over many classes: the GLM predictive without the Jacobian (issue #37, item 3).

The model: a frozen random body (64 inputs -> 128 features, tanh) and a last
``nn.Linear(128, C)``; ``Laplace(subset="last_layer", curvature="ef")`` fitted on
``--train`` synthetic examples (random inputs and labels: the cost does not depend on
the fit's quality), float32, one thread. Then ``la.predictive(x)`` (probit, the default,
with its ``num_samples=100`` function-space draws for the uncertainty split) on a batch
of B inputs, for:

* ``identity``: this library's last-layer route (J = I ⊗ φᵀ, the covariance kept
  factored; ``gaussian/linearised/_last_layer``), ``"kron"`` and ``"lowrank"``
  (``rank`` 20);
* ``jacobian``: the same objects forced through today's general route (the C x P
  Jacobian by ``jacrev``, the C x C covariance, an ``eigh`` per input for the draws);
* ``laplace-torch``: laplace-torch 0.3's ``KronLLLaplace`` (``backend=CurvlinopsEF``,
  its default prior) and ``la(x, pred_type="glm", link_approx="probit")``, which returns
  the probabilities only (no draws), run in the Python of ``--laplace-torch`` (a
  virtual environment where it is installed; skipped with the reason when it cannot be
  imported). laplace-torch has no last-layer low-rank Laplace.

The empirical Fisher, not the GGN, because the GGN *fits* do not scale to 3,100 classes
here: KFAC backpropagates C factor columns per example (540 s for 256 examples on this
machine) and the low-rank products form each example's C x C output-Hessian factor
(74 GB for a batch of 64). The predictive does not depend on which curvature was fitted.

Measured per (implementation, structure, C, B), each group in its own subprocess with
glibc's ``MALLOC_MMAP_THRESHOLD_=131072`` (large blocks are mapped and unmapped, so the
resident set falls back when they are freed):

* ``fit s``: ``Laplace(...).fit`` (laplace-torch: ``la.fit``);
* ``predictive s``: the median of ``--repeat`` calls after one warm-up (the Jacobian
  routes and laplace-torch: one call, no warm-up: minutes each at 1,000 classes);
* ``peak MB``: the largest growth of the process's resident set during one call, from
  the kernel's high-water mark (``VmHWM`` of ``/proc/self/status``, reset through
  ``/proc/self/clear_refs`` before the call) minus the resident set before it: every
  allocation (torch's included), not only Python's as ``tracemalloc`` would see.

Where a route cannot run (the Jacobian routes at 3,100 classes), the table gives the
memory its Jacobian alone would need, computed: :math:`B_c\\cdot C\\cdot P` numbers,
P = C(d + 1), for today's route per input (B_c = 1, times 3 for its copies) and for
laplace-torch's whole batch (B_c = B).

Run: ``python benchmarks/bench_many_classes.py`` (about 15 minutes on one core;
``--quick`` about 3); the markdown table is printed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

INPUTS, FEATURES = 64, 128
_MMAP = {"MALLOC_MMAP_THRESHOLD_": "131072"}


# ------------------------------------------------------------------ the measurement
def _status(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def measure(fn: Callable[[], object], repeat: int, warmup: bool) -> tuple[float, float]:
    """(median seconds of ``repeat`` calls, after a warm-up call if ``warmup``, peak MB)."""
    if warmup:
        fn()
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # reset VmHWM to the current resident set
    before = _status("VmRSS")
    start = time.perf_counter()
    fn()
    times = [time.perf_counter() - start]
    peak = _status("VmHWM") - before
    for _ in range(repeat - 1):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), peak / 2**20


def model_and_data(classes: int, train: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    body = nn.Sequential(nn.Linear(INPUTS, FEATURES), nn.Tanh())
    for param in body.parameters():
        param.requires_grad_(False)
    model = nn.Sequential(body, nn.Linear(FEATURES, classes)).eval()
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(train, INPUTS, generator=generator)
    return model, x, torch.randint(0, classes, (train,), generator=generator)


def inputs(batch: int) -> torch.Tensor:
    return torch.randn(batch, INPUTS, generator=torch.Generator().manual_seed(2))


# ------------------------------------------------------------------ the workers
def ours(job: dict[str, Any]) -> list[dict[str, Any]]:
    from samplers_as_optim import Laplace
    from samplers_as_optim.gaussian.linearised import function_space

    model, x, y = model_and_data(job["classes"], job["train"])
    rank = {"rank": job["rank"]} if job["structure"] == "lowrank" else {}
    la = Laplace(
        model,
        num_data=len(x),
        likelihood="classification",
        structure=job["structure"],
        curvature="ef",
        subset="last_layer",
        **rank,
    )
    start = time.perf_counter()
    la.fit(DataLoader(TensorDataset(x, y), batch_size=64), progress=False)
    fit = time.perf_counter() - start
    if job["route"] == "jacobian":
        function_space.find_head = lambda *args: None  # today's route, for this process
    rows = []
    for batch in job["batches"]:
        test = inputs(batch)
        seconds, peak = measure(
            lambda test=test: la.predictive(test), job["repeat"], job["route"] == "identity"
        )
        rows.append({"fit": fit, "seconds": seconds, "peak": peak, "batch": batch})
    return rows


def laplace_torch(job: dict[str, Any]) -> list[dict[str, Any]]:
    from laplace import Laplace as LaplaceTorch
    from laplace.curvature import CurvlinopsEF

    model, x, y = model_and_data(job["classes"], job["train"])
    la = LaplaceTorch(
        model,
        "classification",
        subset_of_weights="last_layer",
        hessian_structure="kron",
        backend=CurvlinopsEF,
    )
    start = time.perf_counter()
    la.fit(DataLoader(TensorDataset(x, y), batch_size=64), progress_bar=False)
    fit = time.perf_counter() - start
    rows = []
    for batch in job["batches"]:
        test = inputs(batch)

        def call(test: torch.Tensor = test) -> object:
            with torch.no_grad():
                return la(test, pred_type="glm", link_approx="probit")

        seconds, peak = measure(call, job["repeat"], False)
        rows.append({"fit": fit, "seconds": seconds, "peak": peak, "batch": batch})
    return rows


def worker(job: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    rows = laplace_torch(job) if job["library"] == "laplace-torch" else ours(job)
    print("ROWS " + json.dumps(rows))


# ------------------------------------------------------------------ the orchestration
def run(job: dict[str, Any], python: str) -> list[dict[str, Any]] | str:
    """One worker subprocess; its rows, or why it gave none."""
    env = {**os.environ, **_MMAP, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    command = [python, str(Path(__file__).resolve()), "--worker", json.dumps(job)]
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    for line in done.stdout.splitlines():
        if line.startswith("ROWS "):
            return list(json.loads(line[5:]))
    tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
    return f"failed: {tail[:120]}"


def jacobian_gib(classes: int, batch: int, copies: int) -> float:
    """GiB of ``copies`` float32 Jacobians of ``batch`` inputs, C x C(d + 1) each."""
    return copies * batch * classes * classes * (FEATURES + 1) * 4 / 2**30


def importable(python: str) -> str | None:
    """None if laplace-torch imports in ``python``, else the reason."""
    if not Path(python).exists():
        return f"{python} does not exist"
    check = subprocess.run(
        [python, "-c", "import laplace, laplace.curvature; print(laplace.__file__)"],
        capture_output=True,
        text=True,
        check=False,
    )
    if check.returncode:
        return (check.stderr.strip().splitlines() or ["import failed"])[-1]
    return None


def plan(args: argparse.Namespace) -> list[dict[str, Any]]:
    base = {"train": args.train, "rank": args.rank, "repeat": args.repeat}
    jobs = []
    for structure in ("kron", "lowrank"):
        for classes in (*args.small, args.classes):
            batches = args.batches if classes == args.classes else [args.small_batch]
            jobs.append(
                {
                    **base,
                    "library": "ours",
                    "route": "identity",
                    "structure": structure,
                    "classes": classes,
                    "batches": batches,
                }
            )
            if classes != args.classes:
                jobs.append(
                    {
                        **base,
                        "library": "ours",
                        "route": "jacobian",
                        "structure": structure,
                        "classes": classes,
                        "batches": [args.small_batch],
                    }
                )
    for classes in args.small:
        jobs.append(
            {
                **base,
                "library": "laplace-torch",
                "route": "jacobian",
                "structure": "kron",
                "classes": classes,
                "batches": [args.small_batch],
            }
        )
    return jobs


def table(args: argparse.Namespace) -> str:
    reason = importable(args.laplace_torch)
    if reason is not None:
        print(f"laplace-torch skipped: {reason}", flush=True)
    lines = [
        "| implementation | structure | C | B | fit s | predictive s | peak MB |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for job in plan(args):
        name = "this library, identity" if job["route"] == "identity" else "this library, Jacobian"
        python = sys.executable
        if job["library"] == "laplace-torch":
            if reason is not None:
                continue
            name, python = "laplace-torch 0.3", args.laplace_torch
        result = run(job, python)
        print(job["library"], job["route"], job["structure"], job["classes"], result, flush=True)
        if isinstance(result, str):
            lines.append(f"| {name} | {job['structure']} | {job['classes']} | - | {result} | | |")
            continue
        for row in result:
            lines.append(
                f"| {name} | {job['structure']} | {job['classes']} | {row['batch']} | "
                f"{row['fit']:.1f} | {row['seconds']:.3f} | {row['peak']:.0f} |"
            )
    for batch in args.batches:
        ours_gib = jacobian_gib(args.classes, 1, 3)
        theirs_gib = jacobian_gib(args.classes, batch, 1)
        lines.append(
            f"| this library, Jacobian | kron/lowrank | {args.classes} | {batch} | | not run | "
            f"{ours_gib * 1024:.0f} (computed: 3 Jacobians of one input) |"
        )
        lines.append(
            f"| laplace-torch 0.3 | kron | {args.classes} | {batch} | | not run | "
            f"{theirs_gib * 1024:.0f} (computed: the batch's Jacobian) |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--classes", type=int, default=3100)
    parser.add_argument("--batches", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--small", type=int, nargs="+", default=[250, 500, 1000])
    parser.add_argument("--small-batch", type=int, default=4)
    parser.add_argument("--train", type=int, default=256)
    parser.add_argument("--rank", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--laplace-torch", default="/tmp/ltenv/bin/python")
    parser.add_argument("--quick", action="store_true", help="C = 1000, smalls 125 and 250")
    args = parser.parse_args()
    if args.worker is not None:
        worker(json.loads(args.worker))
        return
    if args.quick:
        args.classes, args.small, args.repeat = 1000, [125, 250], 1
    print(table(args))


if __name__ == "__main__":
    main()
