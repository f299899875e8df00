"""Quickstart: one line turns an SGD training loop into a posterior sampler.

Data: scikit-learn's handwritten digits (1797 8x8 images, shipped with the package).
The same loop trains an MLP with ``torch.optim.SGD`` and with ``SGHMC``; the only change
is the optimizer's name and ``num_data``. SGD gives one network; SGHMC's iterates after
burn-in are posterior samples, averaged into a Bayesian model average (BMA).

Run: ``python examples/quickstart.py`` (about 20 s on 2 CPU cores).
"""

from __future__ import annotations

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

from samplers_as_optim import SGHMC
from samplers_as_optim.stacked import call_stacked, stack_states

EPOCHS, BURN_IN, BATCH = 60, 20, 64
PRIOR_STD = 1.0


def load():
    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        x / 16.0, y, test_size=0.3, random_state=0, stratify=y
    )
    as_tensor = lambda a, dtype: torch.as_tensor(a, dtype=dtype)  # noqa: E731
    return (
        as_tensor(x_train, torch.float32),
        as_tensor(y_train, torch.long),
        as_tensor(x_test, torch.float32),
        as_tensor(y_test, torch.long),
    )


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


def train(model, opt, x, y, *, on_epoch_end=None):
    generator = torch.Generator().manual_seed(1)
    for epoch in range(EPOCHS):
        for index in torch.randperm(len(x), generator=generator).split(BATCH):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[index]), y[index]).backward()
            opt.step()
        if on_epoch_end is not None:
            on_epoch_end(epoch)


def report(name, log_probs, y):
    accuracy = (log_probs.argmax(-1) == y).float().mean().item()
    nll = nn.functional.nll_loss(log_probs, y).item()
    print(f"{name:<28} accuracy {accuracy:6.2%}   NLL {nll:.3f}")


def main() -> None:
    x_train, y_train, x_test, y_test = load()
    num_data = len(x_train)
    weight_decay = 1.0 / (num_data * PRIOR_STD**2)  # the N(0, PRIOR_STD^2) prior

    # 1. the usual training loop with SGD: one network
    model = mlp()
    sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=weight_decay)
    train(model, sgd, x_train, y_train)
    with torch.no_grad():
        report("SGD (one network)", model(x_test).log_softmax(-1), y_test)

    # 2. the same loop, one line changed: SGHMC samples the posterior
    model = mlp()
    sampler = SGHMC(
        model.parameters(), lr=0.05, momentum=0.9, weight_decay=weight_decay, num_data=num_data
    )
    samples = []

    def collect(epoch):
        if epoch >= BURN_IN:
            samples.append({k: v.detach().clone() for k, v in model.named_parameters()})

    train(model, sampler, x_train, y_train, on_epoch_end=collect)

    # Bayesian model average: the mean of the samples' predictive probabilities
    with torch.no_grad():
        logits = call_stacked(model, stack_states(samples), x_test)  # [S, B, 10]
        log_probs = logits.log_softmax(-1).logsumexp(0) - torch.log(torch.tensor(len(samples)))
    report(f"SGHMC (BMA of {len(samples)} samples)", log_probs, y_test)


if __name__ == "__main__":
    main()
