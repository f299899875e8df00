"""The input checks and reductions that every predictive summary shares.

:mod:`~samplers_as_optim.predictive` and its regression half
(``_predictive_regression``) read their inputs through these, so that a refusal reads the
same wherever it comes from.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from .core.validation import check_choice

__all__ = ["REDUCTIONS", "Reduction", "apply_reduction", "check_tensor", "compute_dtype"]

Reduction = Literal["mean", "sum", "none"]
REDUCTIONS: tuple[str, ...] = ("mean", "sum", "none")


def check_tensor(name: str, value: object, *, min_dim: int, layout: str) -> Tensor:
    """``value`` if it is a non-empty floating tensor of at least ``min_dim`` dimensions.

    Raises:
        TypeError: not a tensor, or not a floating one.
        ValueError: fewer dimensions than ``min_dim``, or no elements.
    """
    if not isinstance(value, Tensor):
        raise TypeError(
            f"Invalid {name}: {type(value).__name__} (expected a torch.Tensor {layout})"
        )
    if not value.is_floating_point():
        raise TypeError(f"Invalid {name}: dtype {value.dtype} (expected a floating tensor)")
    if value.dim() < min_dim or value.numel() == 0:
        raise ValueError(
            f"Invalid {name}: shape {tuple(value.shape)} (expected a non-empty tensor {layout})"
        )
    return value


def apply_reduction(values: Tensor, reduction: str) -> Tensor:
    """The mean, the sum, or the values themselves (``reduction`` "none")."""
    check_choice("reduction", reduction, REDUCTIONS)
    if reduction == "mean":
        return values.mean()
    if reduction == "sum":
        return values.sum()
    return values


def compute_dtype(tensor: Tensor) -> Tensor:
    """Half precision is averaged in float32; float32 and float64 are kept."""
    return tensor if tensor.dtype in (torch.float32, torch.float64) else tensor.float()
