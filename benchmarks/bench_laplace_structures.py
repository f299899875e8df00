"""Laplace structures side by side on one model where dense fits: time, memory, test NLL.

The model: a 64-32-10 tanh MLP on scikit-learn's digits (1,257 training and 540 test
images, scaled to [0, 1], a stratified 70/30 split), P = 2,410 weights, trained for 300
full-batch Adam steps (lr 1e-2) on the mean loss of docs/design.md with the prior
N(0, 1) (``prior_precision`` 1 = ``num_data * weight_decay``). Then for each structure
(``"diag"``, ``"kron"``, ``"dense"``, ``"lowrank"`` with several ``rank``):

* fit: the seconds of ``Laplace(...).fit`` (GGN, one thread), the passes over the data;
* memory: the bytes of every tensor the fitted object keeps (its precision, its factors
  and the curvature stored for the evidence), each storage counted once;
* the prior: ``optimize_prior_precision()`` (the evidence, a scalar prior, 100 Adam
  steps) and the test NLL and accuracy of the GLM predictive, ``predictive(x,
  link_approx="probit")``, at T = 1 and that prior; for reference the MAP's test NLL.

Run: ``python benchmarks/bench_laplace_structures.py`` (about a minute on one core);
``--ranks 10 50 200`` chooses the low ranks, ``--dtype float64`` the precision.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from samplers_as_optim import Laplace


def digits(dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        x / 16.0, y, test_size=0.3, random_state=0, stratify=y
    )
    return (
        torch.as_tensor(x_train, dtype=dtype),
        torch.as_tensor(y_train),
        torch.as_tensor(x_test, dtype=dtype),
        torch.as_tensor(y_test),
    )


def trained(x: Tensor, y: Tensor, dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10)).to(dtype)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(300):
        optimizer.zero_grad()
        penalty = 0.5 * sum(p.square().sum() for p in model.parameters())
        loss = nn.functional.cross_entropy(model(x), y) + penalty / x.shape[0]
        loss.backward()
        optimizer.step()
    return model.eval()


def stored_bytes(value: Any, seen: set[int] | None = None, storages: set[int] | None = None) -> int:
    """Bytes of the distinct tensor storages reachable from ``value``'s attributes."""
    seen = set() if seen is None else seen
    storages = set() if storages is None else storages
    if id(value) in seen or isinstance(value, (nn.Module, str, bytes, int, float, type)):
        return 0
    seen.add(id(value))
    if isinstance(value, Tensor):
        pointer = value.untyped_storage().data_ptr()
        if pointer in storages:
            return 0
        storages.add(pointer)
        return value.untyped_storage().nbytes()
    if isinstance(value, dict):
        items = list(value.values())
    elif isinstance(value, (list, tuple)):
        items = list(value)
    elif dataclasses.is_dataclass(value):
        items = [getattr(value, field.name) for field in dataclasses.fields(value)]
    elif hasattr(value, "__dict__"):
        items = list(vars(value).values())
    else:
        return 0
    return sum(stored_bytes(item, seen, storages) for item in items)


def row(name: str, la: Laplace, loader: DataLoader, x_test: Tensor, y_test: Tensor) -> dict:
    start = time.perf_counter()
    la.fit(loader, progress=False)
    seconds = time.perf_counter() - start
    curvature = la._terms.curvature if la._terms is not None else None
    memory = stored_bytes([la._precision, la._cholesky, curvature])
    la.optimize_prior_precision(num_steps=100, progress=False)
    prediction = la.predictive(x_test, link_approx="probit")
    nll = -float(prediction.log_probs[torch.arange(len(y_test)), y_test].mean())
    accuracy = float((prediction.probs.argmax(-1) == y_test).double().mean())
    precision = la.precision
    rank = getattr(precision, "rank", None)
    passes = getattr(curvature, "passes", 1)
    return {
        "structure": name,
        "k": "" if rank is None else str(rank),
        "passes": passes,
        "fit_s": seconds,
        "memory": memory,
        "prior": float(la.prior_precision),
        "nll": nll,
        "accuracy": accuracy,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[10, 50, 200])
    parser.add_argument("--fractions", type=float, nargs="*", default=[0.9])
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    x, y, x_test, y_test = digits(dtype)
    model = trained(x, y, dtype)
    loader = DataLoader(TensorDataset(x, y), batch_size=256)
    with torch.no_grad():
        map_nll = float(nn.functional.cross_entropy(model(x_test), y_test))
    size = sum(p.numel() for p in model.parameters())
    configs: list[tuple[str, dict[str, Any]]] = [
        ("diag", {"structure": "diag"}),
        ("kron", {"structure": "kron"}),
        ("dense", {"structure": "dense"}),
    ]
    configs += [(f"lowrank k={k}", {"structure": "lowrank", "rank": k}) for k in args.ranks]
    configs += [(f"lowrank f={f}", {"structure": "lowrank", "rank": f}) for f in args.fractions]
    rows = []
    for name, options in configs:
        la = Laplace(model, num_data=len(y), likelihood="classification", **options)
        rows.append(row(name, la, loader, x_test, y_test))
    print(
        f"digits MLP 64-32-10 (P = {size}, {len(y)} training / {len(y_test)} test images, "
        f"{args.dtype}, GGN, one thread); MAP test NLL {map_nll:.3f}\n"
    )
    print(
        "| structure | k | passes | fit (s) | memory (bytes) | tuned prior | test NLL | accuracy |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['structure']} | {r['k']} | {r['passes']} | {r['fit_s']:.2f} | "
            f"{r['memory']:,} | {r['prior']:.3g} | {r['nll']:.3f} | {r['accuracy']:.3f} |"
        )


if __name__ == "__main__":
    main()
