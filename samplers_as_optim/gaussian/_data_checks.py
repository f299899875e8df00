r"""Refusing data that would poison a curvature pass, a score or training.

One NaN or ±inf in a batch turns every sum it enters into NaN (a NaN diagonal precision
and NaN samples; a Kronecker factor whose eigendecomposition fails; NaN weights after one
optimiser step), and a target the curvature does not depend on (the GGN of a Gaussian or
softmax likelihood) would pass unseen; a class index out of range fails deep inside
torch. :func:`checked_forward` refuses such a batch (finite inputs, targets and outputs,
then the likelihood's own :meth:`~samplers_as_optim.gaussian.likelihoods.Likelihood.check_targets`);
:func:`check_loader` runs it over a whole loader before training starts;
:func:`check_finite_curvature` refuses what finite data can still overflow, the summed
curvature.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from .likelihoods import Likelihood

__all__ = [
    "check_batch",
    "check_finite_batch",
    "check_finite_curvature",
    "check_loader",
    "checked_forward",
    "split_batch",
]


def _check_output(output: object) -> Tensor:
    if not isinstance(output, Tensor):
        raise TypeError(
            f"Invalid model output: {type(output).__name__} (expected a tensor with the batch "
            "as its first dimension)"
        )
    return output


def _locate_non_finite(tensor: Tensor) -> str:
    """``"2 non-finite values, the first (nan) in example 3 of 8"`` (host syncs)."""
    bad = ~torch.isfinite(tensor)
    count = int(bad.sum())
    first = tensor.reshape(-1)[bad.reshape(-1).nonzero()[0, 0]].item()
    values = "value" if count == 1 else "values"
    where = f"{count} non-finite {values}, the first ({first})"
    if tensor.dim() >= 1:
        example = int(bad.reshape(bad.shape[0], -1).any(1).nonzero()[0, 0])
        where += f" in example {example} of {tensor.shape[0]}"
    return where


def check_finite_batch(
    inputs: object, target: object, output: Tensor, also: Tensor | None = None
) -> bool:
    """Refuse a batch whose inputs, targets or model outputs hold NaN or ±inf.

    Non-floating tensors (class indices, token ids) and non-tensors are not checked.
    Costs one device synchronisation per batch (the entries are located only on failure),
    into which the 0-d boolean ``also`` (another check's flag) is folded.

    Returns:
        True, or False where everything is finite but ``also`` is False.

    Raises:
        ValueError: naming which of the three is not finite, how many values, the first
            one and its example.
    """
    checked = [
        (what, value)
        for what, value in (("inputs", inputs), ("targets", target), ("output", output))
        if isinstance(value, Tensor) and (value.is_floating_point() or value.is_complex())
    ]
    flags = [value.isfinite().all().to(output.device) for _, value in checked]
    flags += [] if also is None else [also.to(output.device)]
    if not flags or bool(torch.stack(flags).all()):
        return True
    for what, value in checked:
        if bool(value.isfinite().all()):
            continue
        if what == "output":
            raise ValueError(
                f"Invalid model output: {_locate_non_finite(value)}, for finite inputs and "
                "targets (expected finite outputs: check the weights for NaN or inf, and the "
                f"forward pass for overflow in {value.dtype})"
            )
        raise ValueError(
            f"Invalid batch: {what} contain {_locate_non_finite(value)} (expected finite "
            "inputs and targets: drop or impute those examples)"
        )
    return False


def check_finite_curvature(parts: Iterable[Tensor], dtype: torch.dtype) -> None:
    """Refuse a summed curvature (or the precision built from it) holding NaN or ±inf.

    Every batch's inputs, targets and outputs passed :func:`check_finite_batch`, so this
    is an overflow of the sums in ``dtype`` or a likelihood whose output gradient or
    Hessian is not finite.

    Raises:
        ValueError: saying so, with the dtype.
    """
    finite = [part.isfinite().all() for part in parts]
    if not finite or bool(torch.stack([flag.to(finite[0].device) for flag in finite]).all()):
        return
    raise ValueError(
        f"Invalid curvature: the summed curvature holds NaN or inf in {dtype} although every "
        "batch's inputs, targets and model outputs are finite (expected finite sums: it "
        "overflowed, so rescale the inputs or fit in float64, or the likelihood's output "
        "gradient or Hessian is not finite)"
    )


def checked_forward(model: nn.Module, x: Tensor, target: Tensor, likelihood: Likelihood) -> Tensor:
    """The model's output for a curvature pass, refused if it or the data are not usable.

    :func:`check_finite_batch`, then ``likelihood.check_targets`` (class indices in
    range, regression targets shaped like the output); every curvature path (diag,
    dense, kron) runs this.
    """
    output = _check_output(model(x))
    check_batch(x, target, output, likelihood)
    return output


def check_batch(inputs: Tensor, target: Tensor, output: Tensor, likelihood: Likelihood) -> None:
    """:func:`check_finite_batch` and ``likelihood.check_targets``, one synchronisation."""
    if not check_finite_batch(inputs, target, output, likelihood.target_flag(output, target)):
        likelihood.check_targets(output, target)


def check_loader(
    model: nn.Module, loader: Iterable[Any], likelihood: Likelihood, device: torch.device
) -> None:
    """Refuse a loader any of whose batches :func:`checked_forward` would refuse.

    One forward per batch, without grad, in eval mode (the model's mode restored), so
    that a bad batch is found before anything is trained on the data; nothing else
    changes.

    Raises:
        ValueError, TypeError: ``Invalid loader: batch b (counting from 0) ...`` with the
            batch check's own message, or a loader that yields no examples.
    """
    training = model.training
    model.eval()
    seen = 0
    try:
        with torch.no_grad():
            for index, batch in enumerate(loader):
                try:
                    inputs, targets = split_batch(batch)
                    inputs, targets = inputs.to(device), targets.to(device)
                    checked_forward(model, inputs, targets, likelihood)
                except (ValueError, TypeError) as error:
                    raise type(error)(
                        f"Invalid loader: batch {index} (counting from 0) is refused: {error}"
                    ) from error
                seen += inputs.shape[0]
    finally:
        model.train(training)
    if seen == 0:
        raise ValueError("Invalid loader: it yielded no examples (expected one pass over data)")


def split_batch(batch: Any) -> tuple[Tensor, Tensor]:
    """``(inputs, targets)`` of one batch (``TypeError`` for anything but a pair)."""
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    raise TypeError(
        f"Invalid batch: {type(batch).__name__} (expected a pair (inputs, targets), as a "
        "DataLoader over a TensorDataset yields)"
    )
