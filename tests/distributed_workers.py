"""Worker functions run in 2 gloo processes on 127.0.0.1 by ``test_distributed_seeds.py``.

Each worker initialises the process group, runs one scenario, writes what the test
asserts to ``{out}/rank{r}.pt`` and destroys the process group. They live in a module of
their own so that ``torch.multiprocessing.spawn`` can import them. :func:`join_ranks`
waits for the ranks of any such test (``test_ivon``'s too).
"""

from __future__ import annotations

import os
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from samplers_as_optim import (
    SGHMC,
    SGNHT,
    ParallelEnsemble,
    SampleCollector,
    diagnostics,
    name_parameters,
)

LR, NUM_DATA = 0.01, 256


def join_ranks(context: Any, paths: list[Path], what: str, timeout_s: float = 120) -> None:
    """Wait for spawned ranks: fail past ``timeout_s``, or if a rank died before saving.

    A rank killed by a signal after every rank saved its result (``paths``) is torch's
    teardown, not the test: gloo's "terminate called without an active exception" at a
    rank's exit, seen in clean-clone CI runs of two tests. It warns instead. Killed
    before, the test fails with torch's error.
    """
    import pytest
    import torch.multiprocessing as mp

    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=5):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                pytest.fail(f"{what}: the 2 processes did not finish in {timeout_s} s")
    except mp.ProcessExitedException as error:
        for process in context.processes:  # (the other rank may still be saving)
            process.join(timeout=30)
        if error.signal_name is None or not all(path.exists() for path in paths):
            raise
        warnings.warn(f"{what}: {error} after every rank saved its result", stacklevel=2)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _batches(rank: int, count: int):
    generator = torch.Generator().manual_seed(1000 + rank)  # each rank its own data
    for _ in range(count):
        yield torch.randn(8, 4, generator=generator), torch.randint(0, 2, (8,), generator=generator)


def _train(model, opt, rank, count, offset=0):
    for index, (x, y) in enumerate(_batches(rank, offset + count)):
        if index < offset:
            continue
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _gathered(tensor: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(out, tensor)
    return out


def ddp_with_seed_none(rank: int, out: str) -> dict:
    """The common recipe: a different global seed per rank, the sampler's seed=None."""
    model = DistributedDataParallel(_model())
    torch.manual_seed(100 + rank)  # after the model: seed=None draws from it
    opt = SGHMC(model.parameters(), lr=LR, num_data=NUM_DATA)
    _train(model, opt, rank, 30)
    replicas = _gathered(_flat(model))
    return {"max_difference": float((replicas[0] - replicas[1]).abs().max()), "seed": opt.seed}


def ddp_with_different_seeds(rank: int, out: str) -> dict:
    """Explicit seeds that differ: the first step refuses on every rank."""
    model = DistributedDataParallel(_model())
    opt = SGHMC(model.parameters(), lr=LR, num_data=NUM_DATA, seed=rank)
    try:
        _train(model, opt, rank, 1)
    except ValueError as error:
        return {"error": str(error), "changed": opt.steps_taken}
    return {"error": None}


def _zero(model, seed_offset: int, rank: int):
    torch.manual_seed(seed_offset + rank)  # seed=None draws a different seed per rank
    return ZeroRedundancyOptimizer(
        model.parameters(), optimizer_class=SGHMC, lr=LR, num_data=NUM_DATA
    )


def zero_resume(rank: int, out: str) -> dict:
    """ZeRO over SGHMC: 20 steps straight equal 10, consolidate, save, load fresh, 10."""
    model = DistributedDataParallel(_model())
    opt = _zero(model, 100, rank)
    _train(model, opt, rank, 10)
    opt.consolidate_state_dict(to=0)
    path = os.path.join(out, "checkpoint.pt")
    if rank == 0:
        torch.save({"model": model.module.state_dict(), "opt": opt.state_dict()}, path)
    dist.barrier()
    _train(model, opt, rank, 10, offset=10)
    straight = _flat(model)

    resumed_model = DistributedDataParallel(_model())
    resumed = _zero(resumed_model, 555, rank)
    checkpoint = torch.load(path, weights_only=False)
    resumed_model.module.load_state_dict(checkpoint["model"])
    resumed.load_state_dict(checkpoint["opt"])
    _train(resumed_model, resumed, rank, 10, offset=10)
    groups = checkpoint["opt"]["param_groups"]
    return {
        "equal": bool(torch.equal(straight, _flat(resumed_model))),
        "chain_state": [(group["seed"], group["step"]) for group in groups],
        "replicas_equal": bool(torch.equal(*_gathered(straight))),
    }


def zero_named_equals_one_process(rank: int, out: str) -> dict:
    """Named parameters: 2-rank ZeRO over SGHMC draws the 1-process chain's numbers.

    Every rank trains on the same full batch, so DDP's average of the two identical
    gradients is exact and the runs can agree bit for bit.
    """
    data = list(_batches(0, 15))  # the same batches on every rank

    def train(model, opt):
        for x, y in data:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        return _flat(model)

    # the 1-process reference (run on every rank: its first step is a collective too)
    reference_model = _model()
    reference = SGHMC(reference_model.named_parameters(), lr=LR, num_data=NUM_DATA, seed=5)
    expected = train(reference_model, reference)

    model = name_parameters(_model())
    ddp = DistributedDataParallel(model)
    zero = ZeroRedundancyOptimizer(
        model.parameters(), optimizer_class=SGHMC, lr=LR, num_data=NUM_DATA, seed=5
    )
    sharded = train(ddp, zero)
    shares = [len(group["params"]) for group in zero.optim.param_groups]
    return {"equal": bool(torch.equal(expected, sharded)), "share": shares}


def _member() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def ensemble_across_ranks(rank: int, out: str) -> dict:
    """8 chains split over 2 ranks are the 8 chains of one process."""
    data = list(_batches(0, 12))  # every member sees the same batches, on every rank
    x_test = torch.randn(6, 4, generator=torch.Generator().manual_seed(9))

    def run(ensemble):
        opt = SGHMC(ensemble.parameters(), lr=LR, momentum=0.9, num_data=NUM_DATA, seed=7)
        collector = SampleCollector(ensemble, num_samples=5, burn_in=2, thin=2)
        for x, y in data:
            opt.zero_grad()
            ensemble.loss(torch.nn.functional.cross_entropy, ensemble(x), y).backward()
            opt.step()
            collector.step()
        return collector

    results = {}
    for seed in (3, None):
        torch.manual_seed(11)  # the same global RNG on every rank (seed=None draws from it)
        whole = ParallelEnsemble(_member, 8, seed=seed)  # one process's 8 chains
        whole_samples = run(whole).samples
        torch.manual_seed(11)
        split = ParallelEnsemble(_member, 8, seed=seed, process_group=dist.group.WORLD)
        split_samples = run(split).samples
        a, b = split.member_indices[0], split.member_indices[-1] + 1
        gathered = {name: split.all_gather(t, dim=1) for name, t in split_samples.items()}
        with torch.no_grad():
            logits_equal = torch.equal(split.all_gather(split(x_test)), whole(x_test))
        chains = {name: t.transpose(0, 1) for name, t in gathered.items()}
        whole_chains = {name: t.transpose(0, 1) for name, t in whole_samples.items()}
        rhat = diagnostics.weight_space(chains).rhat
        whole_rhat = diagnostics.weight_space(whole_chains).rhat
        results[str(seed)] = {
            "members": split.member_indices,
            "params_equal": all(
                torch.equal(whole.stacked()[name][a:b], tensor)
                for name, tensor in split.stacked().items()
            ),
            "samples_equal": all(
                torch.equal(gathered[name], whole_samples[name]) for name in gathered
            ),
            "logits_equal": logits_equal,
            "rhat_equal": all(torch.equal(rhat[name], whole_rhat[name]) for name in rhat),
        }
    try:
        ParallelEnsemble(_member, 7, process_group=dist.group.WORLD)
    except ValueError as error:
        results["uneven"] = str(error)
    return results


def fsdp2_equals_one_process(rank: int, out: str) -> dict:
    """FSDP2 (fully_shard, each rank holding half the rows) draws the 1-process chain."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    data = list(_batches(0, 15))  # the same batches on every rank: the averaged
    # gradient is exactly the 1-process one

    def train(model, opt):
        for x, y in data:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()

    reference_model = _model()
    train(
        reference_model, SGHMC(reference_model.named_parameters(), lr=LR, num_data=NUM_DATA, seed=5)
    )
    model = _model()
    # a CPU mesh: on a machine with a GPU, fully_shard would otherwise move the model to
    # it while the batches (and the gloo group) stay on the CPU
    fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
    train(model, SGHMC(model.named_parameters(), lr=LR, num_data=NUM_DATA, seed=5))
    sharded = torch.cat([p.full_tensor().flatten() for p in model.parameters()])
    local_rows = [p.to_local().shape[0] for p in model.parameters()]
    refused = None
    try:
        SGNHT(model.parameters(), lr=LR, num_data=NUM_DATA, seed=5).step()
    except NotImplementedError as error:
        refused = str(error)
    return {
        "equal": bool(torch.equal(_flat(reference_model), sharded)),
        "rows": local_rows,
        "sgnht": refused,
    }


def fsdp2_skip_equals_one_process(rank: int, out: str) -> dict:
    """FSDP2 with ``nonfinite="skip"`` and foreach (CUDA's defaults' kind of step).

    A NaN put into one element of the gradient rank 0 holds skips the step on both ranks
    (the verdict is the whole tensor's, not a shard's), as in the 1-process run.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    data = list(_batches(0, 8))

    def train(model, opt):
        for index, (x, y) in enumerate(data):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            if index == 3:
                grad = next(model.parameters()).grad
                local = grad.to_local() if isinstance(grad, DTensor) else grad
                if rank == 0 or not isinstance(grad, DTensor):
                    local[0, 0] = float("nan")
            opt.step()
        return opt

    options = {"lr": LR, "num_data": NUM_DATA, "seed": 5, "foreach": True, "nonfinite": "skip"}
    reference_model = _model()
    reference = train(reference_model, SGHMC(reference_model.named_parameters(), **options))
    model = _model()
    fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
    sharded = train(model, SGHMC(model.named_parameters(), **options))
    skipped = [int(group["skipped_steps"]) for group in sharded.param_groups]
    return {
        "equal": bool(
            torch.equal(
                _flat(reference_model),
                torch.cat([p.full_tensor().flatten() for p in model.parameters()]),
            )
        ),
        "skipped": skipped,
        "reference_skipped": [int(g["skipped_steps"]) for g in reference.param_groups],
    }


SCENARIOS = {
    "fsdp2_skip_equals_one_process": fsdp2_skip_equals_one_process,
    "fsdp2_equals_one_process": fsdp2_equals_one_process,
    "ensemble_across_ranks": ensemble_across_ranks,
    "zero_named_equals_one_process": zero_named_equals_one_process,
    "ddp_with_seed_none": ddp_with_seed_none,
    "ddp_with_different_seeds": ddp_with_different_seeds,
    "zero_resume": zero_resume,
}


def run(rank: int, scenario: str, port: int, out: str) -> None:
    """Entry point of each spawned process."""
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2
        )
        result = SCENARIOS[scenario](rank, out)
        # neither rank tears the group down while the other is still in a collective
        # (a gloo peer that vanishes mid-collective aborts the other process)
        dist.barrier()
    except Exception:  # reported to the test, which fails with the traceback
        result = {"traceback": traceback.format_exc()}
    # saved before the teardown, so that the test tells a crash in torch's teardown from
    # the scenario's failure (``test_distributed_seeds.spawn``)
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    if dist.is_initialized():
        dist.destroy_process_group()
