"""Sampler overhead against torch.optim.SGD and against the posteriors library.

Prints, for an MLP of about 1.9M parameters at batch 128 (torch.set_num_threads(1),
medians over interleaved rounds):

(a) ``SGHMC.step()`` time / (``SGD.step()`` time + time to draw as many standard normals
    with ``torch.randn``), the noise drawn in the step (``overlap_noise=False``): the
    random numbers are the floor on CPU. Target <= 1.15. SGD runs with foreach=True (its
    fastest CPU path here); the samplers at their CPU default (chunked single-tensor path)
    and with foreach=True. SGLD and SGNHT likewise.
(b) a full training iteration (forward, backward, step) with SGHMC / the same with
    ``torch.optim.SGD(momentum=0.9, foreach=True)``: with the noise drawn on a worker
    thread during the forward and backward passes (``overlap_noise=True``, the default;
    target <= 1.10) and without. Also ``SGHMC.step()`` / ``SGD.step()`` timed inside those
    iterations, when the overlapped draw is ready (target <= 1.5).
(c) the same full iteration against posteriors' ``sgmcmc.sghmc`` (in place). Target: ours
    faster.

Run: ``python benchmarks/bench_samplers.py [--rounds 7] [--repeat 10]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
from timing import interleaved, median_ratio, setup_threads
from torch import nn
from torch.func import functional_call

from samplers_as_optim import SGHMC, SGLD, SGNHT

NUM_DATA = 60_000
BATCH = 128


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)
    )


def batch():
    generator = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, 784, generator=generator), torch.randint(
        0, 10, (BATCH,), generator=generator
    )


def step_only(rounds: int, repeat: int) -> None:
    model = mlp()
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    x, y = batch()
    nn.functional.cross_entropy(model(x), y).backward()
    grads = [p.grad.clone() for p in params]

    def with_grads(opt):
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        return opt

    sgd = with_grads(torch.optim.SGD(params, lr=1e-4, momentum=0.9, foreach=True))
    # the samplers at their CPU default (foreach=None: the chunked single-tensor path) and
    # with foreach=True (whole tensors, what an accelerator uses)
    samplers = {}
    for foreach in (None, True):
        tag = "" if foreach is None else "[foreach]"
        common = {"num_data": NUM_DATA, "foreach": foreach, "seed": 0, "overlap_noise": False}
        samplers[f"SGHMC{tag}"] = SGHMC(params, lr=1e-4, momentum=0.9, **common)
        samplers[f"SGLD{tag}"] = SGLD(params, lr=1e-4, **common)
        samplers[f"SGNHT{tag}"] = SGNHT(params, lr=1e-4, momentum=0.9, **common)
    generator = torch.Generator().manual_seed(0)

    def draw():
        return [torch.randn(p.shape, generator=generator) for p in params]

    contenders = {"SGD.step": sgd.step, "randn": draw}
    contenders.update({f"{name}.step": opt.step for name, opt in samplers.items()})
    medians, per_round = interleaved(contenders, rounds=rounds, repeat=repeat)
    print(f"(a) step only, {numel / 1e6:.2f}M parameters; SGD with foreach=True")
    for name in contenders:
        print(f"    {name:<20} {medians[name] * 1e3:8.2f} ms")
    for name in samplers:
        ratio = median_ratio(per_round, f"{name}.step", "SGD.step", "randn")
        target = "  (target <= 1.15)" if name == "SGHMC" else ""
        print(f"    {name + '.step':<20} / (SGD.step + randn) = {ratio:.3f}{target}")


def full_iteration(rounds: int, repeat: int) -> None:
    x, y = batch()
    ours_model, serial_model, sgd_model, post_model = mlp(), mlp(), mlp(), mlp()
    common = {"lr": 1e-4, "momentum": 0.9, "num_data": NUM_DATA, "foreach": True, "seed": 0}
    ours = SGHMC(ours_model.parameters(), **common)  # overlap_noise=True, the default
    serial = SGHMC(serial_model.parameters(), **common, overlap_noise=False)
    sgd = torch.optim.SGD(sgd_model.parameters(), lr=1e-4, momentum=0.9, foreach=True)
    step_times: dict[str, list[float]] = {"ours": [], "sgd": []}

    def iteration(model, opt, name=None):
        def run():
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            start = time.perf_counter()
            opt.step()
            if name is not None:
                step_times[name].append(time.perf_counter() - start)

        return run

    contenders = {
        "ours": iteration(ours_model, ours, "ours"),
        "ours, serial": iteration(serial_model, serial),
        "sgd": iteration(sgd_model, sgd, "sgd"),
    }
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import posteriors
    except ImportError:
        posteriors = None
    if posteriors is not None:

        def log_posterior(params, batch):
            inputs, targets = batch
            logits = functional_call(post_model, params, (inputs,))
            log_lik = -nn.functional.cross_entropy(logits, targets) * NUM_DATA
            return log_lik, logits

        # posteriors' SGHMC with the friction of momentum 0.9 at this step: alpha = (1 - mu) / lr
        # (any value: only time is measured); temperature 1.
        transform = posteriors.sgmcmc.sghmc.build(
            log_posterior, lr=1e-4, alpha=1e3, temperature=1.0
        )
        state = transform.init({k: v.detach() for k, v in post_model.named_parameters()})

        def posteriors_iteration():
            transform.update(state, (x, y), inplace=True)

        contenders["posteriors"] = posteriors_iteration
    medians, per_round = interleaved(contenders, rounds=rounds, repeat=repeat)
    print(f"(b, c) full iteration (forward, backward, step), batch {BATCH}")
    for name, value in medians.items():
        print(f"    {name:<11} {value * 1e3:8.2f} ms")
    print(
        "(b) SGHMC / SGD(momentum=0.9, foreach=True) = "
        f"{median_ratio(per_round, 'ours', 'sgd'):.3f}  (target <= 1.10; noise overlapped)"
    )
    print(
        "    SGHMC(overlap_noise=False) / SGD = "
        f"{median_ratio(per_round, 'ours, serial', 'sgd'):.3f}"
    )
    step_ratio = statistics.median(step_times["ours"]) / statistics.median(step_times["sgd"])
    print(f"    SGHMC.step / SGD.step inside the iteration = {step_ratio:.3f}  (target <= 1.5)")
    if posteriors is not None:
        ratio = median_ratio(per_round, "ours", "posteriors")
        print(f"(c) SGHMC / posteriors.sgmcmc.sghmc = {ratio:.3f}  (target < 1: ours faster)")
    else:
        print("(c) posteriors is not installed: pip install '.[bench]'")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    setup_threads(args.threads)
    print(
        f"torch {torch.__version__}, {args.threads} thread(s), "
        f"{args.rounds} rounds x {args.repeat} calls"
    )
    step_only(args.rounds, args.repeat)
    full_iteration(args.rounds, args.repeat)


if __name__ == "__main__":
    main()
