"""Bayesian LoRA cost: a K = 10 adapter ensemble vs one fine-tuning run vs a loop of 10.

The model is a Llama-style causal LM built from a config (random initialisation: cost
does not depend on the weights) with LoRA adapters (``peft``, rank 4) on the last layer's
attention projections, the base frozen. One training step = zero_grad, forward, mean
next-token loss, backward, optimizer step, on one batch of ``B`` windows of ``T`` tokens.

* single: one PEFT model, ``torch.optim.SGD`` (momentum 0.9) on its adapters.
* ensemble: ``ParallelEnsemble(peft_model, 10, subset="trainable")`` (10 stacked copies
  of the adapters, the base shared and run once for all members up to the last layer),
  ``SGHMC`` on the stacked adapters; ``chunk=c`` rows call
  ``ensemble.backward(..., chunk_size=c)`` (c members' activations at a time).
* loop: 10 PEFT models (each its own copy of the base, as 10 separate runs), each stepped
  once with its own SGD.

Memory = the bytes a run holds (distinct storages of parameters, buffers, gradients and
optimizer state) + the peak of the step's own allocations above that (torch profiler on
the CPU, ``max_memory_allocated`` on CUDA). Time: medians of interleaved rounds,
``torch.set_num_threads(1)``. Ratios: memory ensemble / single (target <= 1.5), time
loop / ensemble (target >= 3).

Run: ``python benchmarks/bench_lora.py`` (``--quick`` for a smoke run). Needs the
``llm`` extra (transformers, peft).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import lora_common as lc  # noqa: E402
from timing import interleaved, median_ratio  # noqa: E402

from samplers_as_optim import SGHMC, ParallelEnsemble  # noqa: E402

K = 10
#: (hidden, layers, heads, T, B): the example's model, then wider / deeper ones where, as
#: in a real LLM, the frozen base dominates a step's memory
CONFIGS = [(96, 6, 4, 64, 4), (256, 12, 4, 64, 1), (512, 12, 8, 64, 1)]
QUICK_CONFIGS = [(64, 4, 4, 32, 2)]


def measure(config: tuple[int, int, int, int, int], rounds: int, device: torch.device) -> dict:
    hidden, layers, heads, length, batch = config
    base = lc.tiny_llama(hidden=hidden, layers=layers, heads=heads, length=length, seed=0)
    base = base.to(device).requires_grad_(False)
    layer = layers - 1
    ids = torch.randint(0, lc.VOCAB, (batch, length), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)

    def sgd_run():
        model = lc.with_lora(base, layer, 4)
        optimizer = torch.optim.SGD(lc.adapters(model), lr=1e-2, momentum=0.9)

        def step():
            optimizer.zero_grad()
            lc.next_token_nll(lc.logits_of(model, ids), ids).backward()
            optimizer.step()

        return model, optimizer, step

    def ensemble_run(chunk):
        ensemble = ParallelEnsemble(lc.with_lora(base, layer, 4), K, subset="trainable")
        sampler = SGHMC(lc.adapters(ensemble), lr=1e-2, num_data=10_000, seed=0)

        def step():
            sampler.zero_grad()
            if chunk is None:
                logits = lc.logits_of(ensemble, ids)
                ensemble.loss(lc.next_token_nll, logits, ids).backward()
            else:

                def loss(outputs, targets):
                    return lc.next_token_nll(outputs.logits, targets)

                ensemble.backward(loss, targets=ids, input_ids=ids, chunk_size=chunk)
            sampler.step()

        return ensemble, sampler, step

    rows = {}
    steps = {}
    single_model, single_opt, single_step = sgd_run()
    single_step()
    single = lc.resident_bytes(lc.state_tensors([single_model], single_opt))
    single += lc.transient_peak_bytes(single_step, device)
    steps["single"] = single_step
    for chunk in (None, 2):
        ensemble, sampler, step = ensemble_run(chunk)
        step()
        held = lc.resident_bytes(lc.state_tensors([ensemble], sampler))
        peak = held + lc.transient_peak_bytes(step, device)
        name = "ensemble" if chunk is None else f"ensemble chunk={chunk}"
        rows[name] = {"memory ratio": peak / single, "MB": peak / 2**20}
        steps[name] = step
    loop = [sgd_run() for _ in range(K)]

    def loop_step():
        for _, _, step in loop:
            step()

    steps["loop of 10"] = loop_step
    _, per_round = interleaved(steps, rounds=rounds, repeat=1)
    for name in rows:
        rows[name]["speedup vs loop"] = median_ratio(per_round, "loop of 10", name)
    params = sum(p.numel() for p in base.parameters())
    return {"config": config, "params": params, "single MB": single / 2**20, "rows": rows}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    configs = QUICK_CONFIGS if args.quick else CONFIGS
    results = []
    print(f"K = {K} members, LoRA rank 4 on the last layer's attention; device {device.type}")
    print(
        "| hidden x layers | base params | tokens/step | method | peak MB | memory / single "
        "| speedup vs loop of 10 |"
    )
    print("|---|---|---|---|---|---|---|")
    for config in configs:
        found = measure(config, 2 if args.quick else args.rounds, device)
        hidden, layers, _, length, batch = config
        head = f"| {hidden} x {layers} | {found['params'] / 1e6:.1f} M | {batch} x {length} "
        print(f"{head}| single | {found['single MB']:.1f} | 1 | |")
        for name, row in found["rows"].items():
            print(
                f"{head}| {name} | {row['MB']:.1f} | {row['memory ratio']:.2f} "
                f"| {row['speedup vs loop']:.1f} |"
            )
        results.append(found)
    return results


if __name__ == "__main__":
    main()
