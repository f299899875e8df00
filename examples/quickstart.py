"""Quickstart: one line turns an SGD training loop into a posterior sampler.

Data: scikit-learn's handwritten digits (1797 8x8 images, shipped with the package).
The same loop trains an MLP with ``torch.optim.SGD`` and with ``SGHMC``; the only change
is the optimizer's name and ``num_data``. SGD gives one network; SGHMC's iterates after
burn-in are posterior samples, averaged into a Bayesian model average (BMA). The
temperature dial runs from the posterior (T = 1) towards SGD (T -> 0).

Run: ``python examples/quickstart.py`` (about 15 s on one CPU core). Output with torch 2.13 on
a CPU (the seeds are fixed; another torch, device or CPU may round differently):

    method                                        accuracy  NLL     ECE
    --------------------------------------------  --------  ------  ------
    SGD (one network)                             0.9778    0.0924  0.0171
    SGHMC T=1 (BMA of 40)                         0.9648    0.1413  0.0370
    SGHMC T=0.1 (BMA of 40)                       0.9796    0.0929  0.0316
    SGHMC T=1, lr 3.8e-02 by warm-up (BMA of 40)  0.9593    0.1611  0.0254

On this small, easy problem the posterior at T = 1 is broad (the cold posterior effect of
the posteriors paper); see ``cold_posterior.py`` for the full study. The last row lets
``StepSizeWarmup`` choose lr over the burn-in: it adapts to about SGD's 0.05, which ran
at its temperature here already, and freezes 0.7 of it (its margin); it is the broad
posterior, not a hot chain, that costs the T = 1 rows their NLL.
"""

from __future__ import annotations

import math

import torch
from common import digits, minibatches, mlp, print_table, torch_threads
from torch import nn

from samplers_as_optim import SGHMC, SampleCollector, StepSizeWarmup, call_stacked, predictive

EPOCHS, BURN_IN, BATCH, PRIOR_STD = 60, 20, 64, 1.0


def train(model, opt, x, y, collector=None):
    generator = torch.Generator().manual_seed(1)
    for _ in range(EPOCHS):
        for index in minibatches(len(x), BATCH, generator):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[index]), y[index]).backward()
            opt.step()
        if collector is not None:
            collector.step()  # one candidate sample per epoch


def evaluate(name, logits, y):
    prediction = predictive.classification(logits)  # [S, B, 10] -> the BMA
    return {
        "method": name,
        "accuracy": predictive.accuracy(prediction.probs, y).item(),
        "NLL": predictive.nll(prediction.log_probs, y).item(),
        "ECE": predictive.ece(prediction.probs, y).item(),
    }


def run() -> list[dict]:
    x_train, y_train, x_test, y_test = digits()
    num_data = len(x_train)
    weight_decay = 1.0 / (num_data * PRIOR_STD**2)  # the N(0, PRIOR_STD^2) prior
    rows = []

    # 1. the usual training loop with SGD: one network
    model = mlp(hidden=(128,))
    sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=weight_decay)
    train(model, sgd, x_train, y_train)
    with torch.no_grad():
        rows.append(evaluate("SGD (one network)", model(x_test)[None], y_test))

    # 2. the same loop, one line changed: SGHMC samples the posterior (T=1), or a
    #    tempered one (T < 1); 3. one more line: StepSizeWarmup sets lr over the burn-in
    #    so that the chain runs at its temperature (SGD's lr heats it with minibatches)
    for temperature, warm_up in ((1.0, False), (0.1, False), (1.0, True)):
        model = mlp(hidden=(128,))
        sampler = SGHMC(
            model.parameters(),
            lr=0.05,
            momentum=0.9,
            weight_decay=weight_decay,
            num_data=num_data,
            temperature=temperature,
            seed=0,
        )
        if warm_up:  # the burn-in's steps: BURN_IN epochs of minibatches
            StepSizeWarmup(sampler, steps=BURN_IN * math.ceil(num_data / BATCH))
        collector = SampleCollector(model, num_samples=EPOCHS - BURN_IN, burn_in=BURN_IN)
        train(model, sampler, x_train, y_train, collector)
        with torch.no_grad():
            logits = call_stacked(model, collector.samples, x_test)  # all samples, one vmap
        warmed = f", lr {sampler.param_groups[0]['lr']:.1e} by warm-up" if warm_up else ""
        name = f"SGHMC T={temperature:g}{warmed} (BMA of {EPOCHS - BURN_IN})"
        rows.append(evaluate(name, logits, y_test))
    return rows


def main() -> list[dict]:
    with torch_threads(1):
        rows = run()
    print_table(rows, ["method", "accuracy", "NLL", "ECE"])
    return rows


if __name__ == "__main__":
    main()
