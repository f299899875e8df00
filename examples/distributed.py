"""SGHMC on several processes with torch.distributed: DDP, ZeRO, and parallel chains.

Run it with torchrun (NCCL when each process has a GPU of its own, gloo on the CPU
otherwise, chosen automatically)::

    torchrun --standalone --nproc-per-node 2 examples/distributed.py --quick

An MLP on scikit-learn's digits. Each rank takes its own half of every global batch, as
with SGD under DDP; DDP averages the two halves' mean gradients, which is the mean
gradient of the global batch, so ``num_data`` stays the training-set size. Two chains:

* **DDP**: ``SGHMC(model.parameters(), seed=None)`` after ``torch.manual_seed(100 +
  rank)``, the usual per-rank seeding: at its first step the sampler takes rank 0's
  seed, so the replicas draw the same noise and stay identical;
* **ZeRO**: ``ZeroRedundancyOptimizer(optimizer_class=SGHMC)``, each rank updating its
  share of the parameters; ``name_parameters(model)`` lets each parameter's noise follow
  its name, so the shares draw the numbers the whole model would;
* **FSDP2**: ``fully_shard(model)``, each rank holding half the rows of every parameter
  (DTensors): a sampler draws each rank's rows of the whole parameter's noise;
* **parallel chains**: ``ParallelEnsemble(..., process_group=WORLD)`` with 8 members,
  each rank holding 8/R of them; every member sees every batch. The model average and
  R-hat gather all 8 chains with ``ensemble.all_gather``.

Each is checked against the same chain run in one process on the same global batches
(every rank computes that reference too), with the gradient formed as DDP forms it: each
half's mean-loss gradient divided by the number of ranks, then summed. The noise is the
same, so with 2 ranks the chains are equal bit for bit (with more, the all-reduce's
summation order differs from the reference's and the chains agree to rounding, which a
chain amplifies over a long run). SGLD and SGHMC run under FSDP2 (``Shard(0)``
placements); SGNHT's per-tensor thermostat does not yet. Rank 0 collects the DDP chain's
samples and prints the Bayesian model average's test accuracy and NLL.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import digits, example_arguments, mlp

from samplers_as_optim import (
    SGHMC,
    ParallelEnsemble,
    SampleCollector,
    call_stacked,
    diagnostics,
    name_parameters,
    predictive,
)

LR, MOMENTUM, BATCH = 0.05, 0.9, 64


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def train(model, opt, batches, *, collector=None) -> torch.Tensor:
    for x, y in batches:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if collector is not None:
            collector.step()
    return flat(model)


def train_as_one_process(model, opt, batches, world: int) -> torch.Tensor:
    """The 1-process chain on the global batches, each gradient formed as DDP forms it."""
    for x, y in batches:
        total = [torch.zeros_like(p) for p in model.parameters()]
        for rank in range(world):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[rank::world]), y[rank::world]).backward()
            for accumulated, p in zip(total, model.parameters(), strict=True):
                accumulated.add_(p.grad / world)
        for accumulated, p in zip(total, model.parameters(), strict=True):
            p.grad = accumulated
        opt.step()
    return flat(model)


def main(argv: list[str] | None = None) -> int:
    quick, seed, _ = example_arguments(
        argv, __doc__, quick="a few epochs (CI)", figure="distributed.png"
    )
    # NCCL needs a GPU of its own for each process on a machine; with fewer GPUs than
    # local processes (2 ranks, 1 GPU) the ranks run on the CPU over gloo
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    own_gpu = torch.cuda.is_available() and torch.cuda.device_count() >= local_world
    backend = "nccl" if own_gpu else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if own_gpu:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    torch.set_num_threads(1)
    try:
        x_train, y_train, x_test, y_test = (t.to(device) for t in digits(seed=seed))
        num_data = len(x_train)
        generator = torch.Generator().manual_seed(seed)
        steps = 60 if quick else 600
        order = [
            torch.randint(0, num_data, (BATCH * world,), generator=generator) for _ in range(steps)
        ]
        whole = [(x_train[i], y_train[i]) for i in order]  # the global batches
        mine = [(x[rank::world], y[rank::world]) for x, y in whole]  # this rank's half
        sghmc = {"lr": LR, "momentum": MOMENTUM, "num_data": num_data}

        # DDP: per-rank global seeds, seed=None
        model = mlp(seed=seed).to(device)
        ddp = DistributedDataParallel(model)
        torch.manual_seed(100 + rank)
        opt = SGHMC(name_parameters(model).parameters(), **sghmc)
        collector = SampleCollector(model, num_samples=10, burn_in=steps // 2, thin=steps // 20)
        replica = train(ddp, opt, mine, collector=collector)
        replicas = [torch.empty_like(replica) for _ in range(world)]
        dist.all_gather(replicas, replica)

        # the 1-process reference with the chain's seed, on the whole global batches,
        # computed on every rank (its first step is a collective too)
        reference_model = mlp(seed=seed).to(device)
        reference = SGHMC(reference_model.named_parameters(), **sghmc, seed=opt.seed)
        expected = train_as_one_process(reference_model, reference, whole, world)
        ddp_error = float((replica - expected).abs().max())
        spread = max(float((other - replica).abs().max()) for other in replicas)

        # ZeRO: named parameters, each rank updating its share
        model = name_parameters(mlp(seed=seed).to(device))
        ddp = DistributedDataParallel(model)
        zero = ZeroRedundancyOptimizer(
            model.parameters(), optimizer_class=SGHMC, **sghmc, seed=opt.seed
        )
        zero_error = float((train(ddp, zero, mine) - expected).abs().max())

        # FSDP2: every parameter sharded by rows over the ranks
        fsdp_model = mlp(seed=seed).to(device)
        # the mesh on the ranks' device: without one, fully_shard takes a GPU whenever
        # one is visible, also for a CPU (gloo) run
        fully_shard(fsdp_model, mesh=init_device_mesh(device.type, (world,)))
        train(fsdp_model, SGHMC(fsdp_model.named_parameters(), **sghmc, seed=opt.seed), mine)
        sharded = torch.cat([p.full_tensor().detach().flatten() for p in fsdp_model.parameters()])
        fsdp_error = float((sharded - expected).abs().max())

        # parallel chains: 8 members split over the ranks, against 8 in one process
        members, sample_count = 8, 6

        def run_chains(group):
            ensemble = ParallelEnsemble(mlp(seed=seed), members, seed=seed, process_group=group).to(
                device
            )
            chains_opt = SGHMC(ensemble.parameters(), **sghmc, seed=opt.seed)
            chains_collector = SampleCollector(
                ensemble,
                num_samples=sample_count,
                burn_in=steps // 2,
                thin=steps // (2 * sample_count),
            )
            for x, y in whole:  # every member sees every global batch
                chains_opt.zero_grad()
                ensemble.loss(nn.functional.cross_entropy, ensemble(x), y).backward()
                chains_opt.step()
                chains_collector.step()
            samples = chains_collector.samples
            return ensemble, {name: ensemble.all_gather(t, dim=1) for name, t in samples.items()}

        split, split_samples = run_chains(dist.group.WORLD)
        _, one_samples = run_chains(None)  # the 1-process chains, on every rank
        chains_error = max(
            float((split_samples[n] - one_samples[n]).abs().max()) for n in one_samples
        )

        tolerance = 0.0 if world == 2 else 1e-4
        ok = (
            ddp_error <= tolerance
            and zero_error <= tolerance
            and fsdp_error <= tolerance
            and spread == 0.0
            and chains_error <= tolerance
        )
        if rank == 0:
            template = mlp(seed=seed).to(device).eval()  # the architecture; samples replace all
            bma = predictive.classification(call_stacked(template, collector.samples, x_test))
            accuracy = float(predictive.accuracy(bma.probs, y_test))
            nll = float(predictive.nll(bma.log_probs, y_test))
            print(f"{world} ranks ({backend}), {steps} steps, batch {BATCH} per rank")
            print(
                f"DDP:  replicas differ by {spread:.1e}; max |theta - 1-process| = {ddp_error:.1e}"
            )
            print(
                f"ZeRO: shares of {[len(g['params']) for g in zero.optim.param_groups]} params "
                f"on rank 0; max |theta - 1-process| = {zero_error:.1e}"
            )
            print(
                f"BMA of the DDP chain's {collector.count} samples: accuracy {accuracy:.3f}, "
                f"NLL {nll:.3f}"
            )
            draws = {n: t.flatten(0, 1) for n, t in split_samples.items()}  # S x K draws
            chains_bma = predictive.classification(call_stacked(template, draws, x_test))
            per_chain = torch.stack(
                [
                    call_stacked(template, {n: t[:, k] for n, t in split_samples.items()}, x_test)
                    for k in range(members)
                ]
            ).softmax(-1)  # [chains, draws, B, C]
            rhat = diagnostics.function_space(per_chain)
            print(f"FSDP2: max |theta - 1-process| = {fsdp_error:.1e}")
            print(
                f"Parallel chains: members {split.member_indices} of {members} on rank 0; "
                f"max |sample - 1-process| = {chains_error:.1e}"
            )
            print(
                f"BMA of {members} chains x {sample_count} samples: accuracy "
                f"{float(predictive.accuracy(chains_bma.probs, y_test)):.3f}, NLL "
                f"{float(predictive.nll(chains_bma.log_probs, y_test)):.3f}"
            )
            print(f"function-space {rhat.summary}")
            print("matches the 1-process run" if ok else "DOES NOT match the 1-process run")
        return 0 if ok else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
