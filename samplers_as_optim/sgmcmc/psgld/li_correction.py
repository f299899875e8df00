r"""Li et al.'s correction term :math:`\Gamma` of PSGLD's moving elementwise preconditioner.

The derivation and its measured effect are in ``psgld``'s module docstring ("The
correction"): the Hessian's diagonal is estimated by the secant of the last step.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["corrected"]


def corrected(
    ds: list[Tensor],
    gs: list[Tensor],
    avgs: list[Tensor],
    squares: list[Tensor],
    params: list[Tensor],
    previous: tuple[list[Tensor], list[Tensor]],
    index: list[int],
    *,
    alpha: float,
    temperature: float,
    num_data: int,
) -> list[Tensor]:
    r"""``d - (T/N) Gamma`` with the secant estimate of the Hessian's diagonal."""
    out = []
    for position, i in enumerate(index):
        grad, avg = gs[position], avgs[position]
        moved = params[i] - previous[0][i]
        curvature = torch.where(
            moved != 0, (grad - previous[1][i]) / torch.where(moved != 0, moved, 1.0), 0.0
        )
        root = squares[position].sqrt()
        safe_root = torch.where(root > 0, root, 1.0)
        gamma = torch.where(
            root > 0, -(1 - alpha) * grad * curvature / (avg * avg * safe_root), 0.0
        )
        out.append(ds[position].sub(gamma, alpha=temperature / num_data))
    return out
