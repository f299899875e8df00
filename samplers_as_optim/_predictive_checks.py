"""The input checks and reductions that every predictive summary shares.

:mod:`~samplers_as_optim.predictive` and its regression half
(``_predictive_regression``) read their inputs through these, so that a refusal reads the
same wherever it comes from: floating tensors, logits, probabilities, log-probabilities,
class targets, the means and (co)variances of Gaussian logits, and two predictive
distributions of one shape.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from .core.validation import check_choice

__all__ = [
    "REDUCTIONS",
    "Reduction",
    "apply_reduction",
    "check_gaussian_logits",
    "check_log_probs",
    "check_logits",
    "check_probs",
    "check_same_shape",
    "check_scores",
    "check_targets",
    "check_tensor",
    "compute_dtype",
]

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


def check_logits(logits: object) -> Tensor:
    """``logits`` laid out ``[samples, batch, ..., classes]`` (a 2-D tensor is ambiguous)."""
    logits = check_tensor("logits", logits, min_dim=2, layout="[samples, ..., classes] of logits")
    if logits.dim() == 2:
        raise ValueError(
            f"Invalid logits: shape {tuple(logits.shape)} (expected [samples, batch, ..., "
            "classes]: a 2-D tensor is ambiguous; for one model's logits [B, C] use "
            "logits.unsqueeze(0), for S samples of one input [S, C] use logits.unsqueeze(1))"
        )
    return logits


def check_probs(name: str, probs: object) -> Tensor:
    """``probs`` ``[B, ..., K]``, every value in [0, 1]."""
    probs = check_tensor(name, probs, min_dim=1, layout="[B, ..., K] of probabilities")
    if bool(((probs < 0) | (probs > 1) | probs.isnan()).any()):
        raise ValueError(
            f"Invalid {name}: values outside [0, 1] (expected probabilities, e.g. "
            "ClassificationPrediction.probs; apply softmax to logits)"
        )
    return probs


def check_log_probs(log_probs: object) -> Tensor:
    """``log_probs`` ``[B, ..., K]``, every value <= 0."""
    log_probs = check_tensor(
        "log_probs", log_probs, min_dim=1, layout="[B, ..., K] of log-probabilities"
    )
    if bool((log_probs > 0).any() | log_probs.isnan().any()):
        raise ValueError(
            "Invalid log_probs: values above 0 or NaN (expected log-probabilities, e.g. "
            "ClassificationPrediction.log_probs)"
        )
    return log_probs


def check_targets(targets: object, probs: Tensor) -> Tensor:
    """Integer class indices ``[B, ...]`` for ``probs`` ``[B, ..., K]``, as int64 there."""
    if not isinstance(targets, Tensor) or targets.is_floating_point() or targets.is_complex():
        raise TypeError(
            f"Invalid targets: {targets!r} (expected an integer tensor of class indices)"
        )
    if targets.shape != probs.shape[:-1]:
        raise ValueError(
            f"Invalid targets: shape {tuple(targets.shape)} (expected {tuple(probs.shape[:-1])},"
            " the predictions' shape without the class dimension)"
        )
    classes = probs.shape[-1]
    if bool(((targets < 0) | (targets >= classes)).any()):
        raise ValueError(
            f"Invalid targets: values outside [0, {classes}) (expected class indices for "
            f"{classes} classes)"
        )
    return targets.to(device=probs.device, dtype=torch.long)


def check_same_shape(first: Tensor, second: Tensor, names: tuple[str, str]) -> None:
    """Refuse ``second`` unless it has ``first``'s shape (``names``: theirs)."""
    if first.shape != second.shape:
        raise ValueError(
            f"Invalid {names[1]}: shape {tuple(second.shape)} (expected the shape of "
            f"{names[0]}, {tuple(first.shape)})"
        )


def check_scores(in_scores: object, out_scores: object) -> Tensor:
    """Both sets of scores, flattened and pooled (in-distribution first), without NaN."""
    in_scores = check_tensor("in_scores", in_scores, min_dim=0, layout="of scores")
    out_scores = check_tensor("out_scores", out_scores, min_dim=0, layout="of scores")
    dtype = torch.promote_types(in_scores.dtype, out_scores.dtype)
    pooled = torch.cat([in_scores.reshape(-1).to(dtype), out_scores.reshape(-1).to(dtype)])
    if bool(pooled.isnan().any()):
        raise ValueError("Invalid scores: NaN values (expected comparable, non-NaN scores)")
    return pooled


def check_gaussian_logits(mean: object, spread: object, name: str, extra: int) -> Tensor:
    """``mean`` [B, ..., K] and a ``spread`` of its shape (+ K when ``extra`` is 1)."""
    mean = check_tensor("mean", mean, min_dim=1, layout="[B, ..., K] of logit means")
    layout = "[B, ..., K, K] of the logits' covariances" if extra else "[B, ..., K] of variances"
    spread = check_tensor(name, spread, min_dim=1 + extra, layout=layout)
    expected = (*mean.shape, mean.shape[-1]) if extra else tuple(mean.shape)
    if tuple(spread.shape) != expected:
        raise ValueError(
            f"Invalid {name}: shape {tuple(spread.shape)} (expected {expected}, from the "
            f"mean's {tuple(mean.shape)})"
        )
    diagonal = spread.diagonal(dim1=-2, dim2=-1) if extra else spread
    if bool((diagonal < 0).any() | spread.isnan().any()):
        raise ValueError(f"Invalid {name}: negative variances or NaN (expected variances >= 0)")
    return spread


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
