"""The low-rank Laplace against laplace-torch's, where both compute the same curvature.

laplace-torch 0.3's ``LowRankLaplace`` takes the top-k eigenpairs of the true Hessian
(asdfghjkl's power iteration) and keeps Λ = U diag(s) Uᵀ + Λ₀ (no diagonal for the rest
of the spectrum); ours takes them from the GGN (block Lanczos) and adds the diagonal D of
the rest. Where the model is linear in its weights (multinomial logistic regression,
here on scikit-learn's digits: 64 pixels → 10 classes, P = 650, float64) the Hessian *is*
the GGN, so the eigenpairs are the same quantity: both are compared with the exact ones
(``eigh`` of the dense GGN), and the GLM predictive's variances with the dense
Laplace's, at k = 20 and prior precision 1.

Run with a Python that has laplace-torch 0.3 and its old backend (it is not a dependency
of this library): ``python -m venv --system-site-packages /tmp/ltenv && /tmp/ltenv/bin/pip
install --no-deps laplace-torch==0.3 asdfghjkl==0.1a2 torchmetrics lightning-utilities
unfoldNd`` (plus the ``asdl`` package of asdfghjkl 0.1a5 copied beside it, which
laplace-torch's ``curvature/__init__`` imports), then ``/tmp/ltenv/bin/python
benchmarks/bench_lowrank_vs_laplace_torch.py``.
"""

from __future__ import annotations

import time

import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from samplers_as_optim import Laplace

K = 20


def main() -> None:
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    x, y = load_digits(return_X_y=True)
    x, y = torch.tensor(x / 16.0), torch.tensor(y)
    x_train, y_train, x_test = x[:1200], y[:1200], x[1200:]
    n = len(x_train)
    torch.manual_seed(0)
    model = nn.Linear(64, 10)
    opt = torch.optim.LBFGS(model.parameters(), max_iter=500, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        prior = 0.5 * sum(p.square().sum() for p in model.parameters()) / n
        loss = nn.functional.cross_entropy(model(x_train), y_train) + prior
        loss.backward()
        return loss

    opt.step(closure)
    loader = DataLoader(TensorDataset(x_train, y_train), batch_size=200)
    common = {"num_data": n, "likelihood": "classification", "prior_precision": 1.0}
    dense = Laplace(model, structure="dense", **common).fit(loader)
    exact = torch.linalg.eigvalsh(dense.precision - torch.eye(650)).flip(0)[:K]
    start = time.perf_counter()
    ours = Laplace(model, structure="lowrank", rank=K, **common).fit(loader)
    ours_s = time.perf_counter() - start
    ours_values = ours.precision.eigenvalues  # (the curvature's top k, scaled to N)
    rows = [("exact (eigh of the dense GGN)", exact, None, None)]
    dense_var = dense.function_space(x_test).covariance.diagonal(dim1=-2, dim2=-1)
    ours_var = ours.function_space(x_test).covariance.diagonal(dim1=-2, dim2=-1)
    rows.append(("ours (GGN, block Lanczos, + diagonal)", ours_values, ours_s, ours_var))
    try:
        from laplace import Laplace as TorchLaplace
        from laplace.curvature.asdfghjkl import AsdfghjklHessian
    except ImportError as error:
        print(f"laplace-torch not importable here ({error}): only ours is reported")
    else:
        whole = DataLoader(TensorDataset(x_train, y_train), batch_size=n)
        for label, data in (("batches of 200", loader), ("one batch", whole)):
            theirs = TorchLaplace(
                model,
                "classification",
                subset_of_weights="all",
                hessian_structure="lowrank",
                backend=AsdfghjklHessian,
                backend_kwargs={"low_rank": K},
                prior_precision=1.0,
            )
            start = time.perf_counter()
            theirs.fit(data)
            theirs_s = time.perf_counter() - start
            (_, values), _ = theirs.posterior_precision
            _, their_var = theirs._glm_predictive_distribution(x_test)
            rows.append(
                (
                    f"laplace-torch 0.3 (Hessian, power iteration; {label})",
                    values.sort(descending=True).values,
                    theirs_s,
                    their_var.diagonal(dim1=-2, dim2=-1),
                )
            )
    print(f"digits logistic regression, P = 650, k = {K}, prior precision 1, float64\n")
    for name, values, _, _ in rows:
        print(f"{name}: the first five eigenvalues {[round(float(v), 2) for v in values[:5]]}")
    print()
    print(
        "| implementation | fit s | top eigenvalue rel. error (max over k) | "
        "GLM variance rel. error vs dense (median) |"
    )
    print("|---|---|---|---|")
    for name, values, seconds, variances in rows:
        count = min(len(values), K)
        error = float(((values[:count] - exact[:count]).abs() / exact[:count]).max())
        var_error = (
            float(((variances - dense_var).abs() / dense_var).median())
            if variances is not None
            else float("nan")
        )
        fit = "" if seconds is None else f"{seconds:.2f}"
        print(f"| {name} ({count} pairs) | {fit} | {error:.1e} | {var_error:.1e} |")


if __name__ == "__main__":
    main()
