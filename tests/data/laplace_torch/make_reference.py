"""Write ``reference.json``: laplace-torch 0.3's log marginal likelihood on fixed networks.

Run with laplace-torch installed (it does not need to sit beside this package; the
reference was made in a side virtual environment with laplace-torch 0.3, torch 2.14.1
(CPU), curvlinops-for-pytorch 3.0.1, its default backend ``CurvlinopsGGN``):

    python tests/data/laplace_torch/make_reference.py

It builds small float64 networks (a classification MLP 4-8-3 and a regression MLP 2-8-1,
tanh, each with and without biases), trains each for a few Adam steps (the evidence
formula holds at any weights, the MAP is not needed), fits laplace-torch's ``diag``,
``full`` and ``kron`` Laplace on one full batch (laplace-torch sums Kronecker factors
batch by batch, which is KFAC over the whole data only for one batch; this package
accumulates the factors over the pass, equal for any batching) and records
``log_marginal_likelihood(prior_precision, sigma_noise)`` at scalar and layerwise
(one per parameter tensor) prior precisions and, for regression, two noise scales.
KFAC cases use the networks without biases: laplace-torch gives a bias its own block
(the G factor alone) while this package puts it inside the layer's Kronecker factor.
``tests/test_laplace_evidence.py`` loads the same weights and data and compares.
"""

from __future__ import annotations

import json
from pathlib import Path

import laplace
import torch
from laplace import Laplace
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

HERE = Path(__file__).parent
torch.set_default_dtype(torch.float64)


def network(task: str, bias: bool) -> nn.Module:
    d_in, d_out = (4, 3) if task == "classification" else (2, 1)
    return nn.Sequential(nn.Linear(d_in, 8, bias=bias), nn.Tanh(), nn.Linear(8, d_out, bias=bias))


def data(task: str) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0 if task == "classification" else 1)
    if task == "classification":
        x = torch.randn(60, 4, generator=generator)
        y = (x[:, 0] + x[:, 1] > 0).long() + (x[:, 2] > 1).long()
        return x, y
    x = torch.randn(50, 2, generator=generator)
    y = torch.sin(2 * x[:, :1]) + 0.3 * x[:, 1:] + 0.2 * torch.randn(50, 1, generator=generator)
    return x, y


def train(model: nn.Module, task: str, x: torch.Tensor, y: torch.Tensor) -> None:
    optimizer = torch.optim.Adam(model.parameters(), lr=0.02)
    loss_fn = nn.CrossEntropyLoss() if task == "classification" else nn.MSELoss()
    for _ in range(200):
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()


def main() -> None:
    cases = []
    for task in ("classification", "regression"):
        x, y = data(task)
        for bias in (True, False):
            torch.manual_seed(3 if bias else 4)
            model = network(task, bias)
            train(model, task, x, y)
            count = len(list(model.parameters()))
            layerwise = [0.3, 3.0, 1.5, 0.7][:count] if bias else [0.3, 3.0]
            priors = [0.5, 2.0, layerwise]
            noises = [None] if task == "classification" else [0.7, 1.3]
            structures = ("diag", "full") if bias else ("diag", "full", "kron")
            for structure in structures:
                la = Laplace(
                    model,
                    task,
                    subset_of_weights="all",
                    hessian_structure=structure,
                    sigma_noise=1.0,
                )
                la.fit(DataLoader(TensorDataset(x, y), batch_size=len(x)))
                values = []
                for prior in priors:
                    for noise in noises:
                        prior_t = torch.as_tensor(prior, dtype=torch.float64)
                        noise_t = None if noise is None else torch.tensor(noise)
                        value = la.log_marginal_likelihood(prior_t, noise_t)
                        values.append({"prior": prior, "noise": noise, "value": float(value)})
                cases.append(
                    {
                        "task": task,
                        "bias": bias,
                        "structure": structure,
                        "state": {k: v.tolist() for k, v in model.state_dict().items()},
                        "values": values,
                    }
                )
    out = {
        "made_with": {
            "laplace-torch": getattr(laplace, "__version__", "0.3"),
            "torch": torch.__version__,
        },
        "data": {
            task: {"x": data(task)[0].tolist(), "y": data(task)[1].tolist()}
            for task in ("classification", "regression")
        },
        "cases": cases,
    }
    (HERE / "reference.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main()
