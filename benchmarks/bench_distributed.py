"""Per-step cost of a sampler under DDP, against torch.optim.SGD under DDP (2 gloo ranks).

Spawns 2 processes on 127.0.0.1 (gloo, one torch thread each), wraps the benchmark MLP
of ``bench_samplers.py`` (1.86M parameters, batch 128 per rank) in
``DistributedDataParallel`` and times, interleaved and side by side in the same
processes, a full training iteration (forward, backward with the gradient all-reduce,
step) with ``SGHMC`` (the noise overlapped, the default, and drawn in the step) and with
``torch.optim.SGD(momentum=0.9, foreach=True)``. Prints rank 0's medians and the ratios.

Run: ``python benchmarks/bench_distributed.py [--rounds 7] [--repeat 10]``.
"""

from __future__ import annotations

import argparse
import os
import socket
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from bench_samplers import BATCH, NUM_DATA, mlp
from timing import interleaved, median_ratio
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from samplers_as_optim import SGHMC


def worker(rank: int, port: int, rounds: int, repeat: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        generator = torch.Generator().manual_seed(rank)
        x = torch.randn(BATCH, 784, generator=generator)
        y = torch.randint(0, 10, (BATCH,), generator=generator)
        common = {"lr": 1e-4, "momentum": 0.9, "num_data": NUM_DATA, "foreach": True, "seed": 0}
        models = {name: DistributedDataParallel(mlp()) for name in ("ours", "serial", "sgd")}
        optimizers = {
            "ours": SGHMC(models["ours"].parameters(), **common),
            "serial": SGHMC(models["serial"].parameters(), **common, overlap_noise=False),
            "sgd": torch.optim.SGD(models["sgd"].parameters(), lr=1e-4, momentum=0.9, foreach=True),
        }

        def iteration(name):
            model, opt = models[name], optimizers[name]

            def run():
                opt.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()

            return run

        medians, per_round = interleaved(
            {name: iteration(name) for name in models}, rounds=rounds, repeat=repeat
        )
        if rank == 0:
            torch.save({"medians": medians, "per_round": per_round}, out)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as directory:
        out = os.path.join(directory, "rank0.pt")
        mp.spawn(worker, args=(port, args.rounds, args.repeat, out), nprocs=2, join=True)
        result = torch.load(out)
    medians, per_round = result["medians"], result["per_round"]
    print(
        f"torch {torch.__version__}, 2 gloo ranks x 1 thread, {args.rounds} rounds x "
        f"{args.repeat} iterations, batch {BATCH} per rank"
    )
    for name, value in medians.items():
        print(f"    {name:<7} {value * 1e3:8.2f} ms")
    print(
        f"DDP iteration: SGHMC / SGD = {median_ratio(per_round, 'ours', 'sgd'):.3f} "
        "(noise overlapped)"
    )
    print(
        f"DDP iteration: SGHMC(overlap_noise=False) / SGD = "
        f"{median_ratio(per_round, 'serial', 'sgd'):.3f}"
    )


if __name__ == "__main__":
    main()
