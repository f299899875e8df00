r"""The accepted forms of a Laplace prior precision, read into one diagonal (or matrix).

The prior is :math:`\mathcal N(0, \Lambda_0^{-1})` on the P treated scalars, with
:math:`\Lambda_0 = \mathrm{diag}(\delta)` (or, for ``structure="dense"``, any symmetric
positive-definite P x P matrix). :func:`read_prior` turns each accepted form into
:math:`\delta` (P,), keeping autograd, so the evidence is differentiable in it:

* ``"scalar"``: a number, or a tensor with one element: :math:`\delta_j = \delta`;
* ``"layerwise"``: a 1-d tensor with one entry per treated parameter tensor (in the order
  of ``Laplace.subset``), or a dict name -> number (or one-element tensor);
* ``"diag"``: a 1-d tensor of P entries (the flat order of the treated parameters) or a
  dict name -> tensor of the parameter's shape;
* with ``structure="dense"``: a (P, P) matrix (returned as it is).

A 1-d tensor whose length is both the number of treated tensors and P (every tensor a
single number) means the same either way. ``structure="kron"`` keeps one prior precision
per Kronecker block (:class:`~samplers_as_optim.gaussian.kfac.KronBlock`), so it takes
one number per treated tensor, the same number for a layer's weight and bias (they share
one factor pair); a prior that varies inside a block is refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ...core.validation import check_positive
from .._wide_linalg import cholesky_ex
from ..flat import Treated
from ..kfac import kron_layers

__all__ = ["block_priors", "prior_groups", "read_prior"]

Groups = tuple[tuple[str, ...], ...]


def prior_groups(model: nn.Module, treated: Treated, structure: str) -> Groups:
    """The treated names that share one prior: a KFAC layer's weight and bias, else one each.

    For ``structure="kron"`` the Linear/Conv2d layers' groups come first, in the order of
    the Kronecker blocks, then every other treated name alone; otherwise each treated
    name is its own group, in ``treated`` order.
    """
    if structure != "kron":
        return tuple((name,) for name in treated.names)
    layers = kron_layers(model, treated)
    groups = [
        tuple(entries[key] for key in ("weight", "bias") if key in entries)
        for entries in layers.values()
    ]
    covered = {name for group in groups for name in group}
    return tuple(groups) + tuple((name,) for name in treated.names if name not in covered)


def _offsets(treated: Treated) -> dict[str, int]:
    starts = [0, *torch.tensor(treated.sizes).cumsum(0).tolist()]
    return dict(zip(treated.names, starts, strict=False))


def _positive(value: Tensor) -> bool:
    detached = value.detach()
    return bool(torch.all(detached > 0) & detached.isfinite().all())


def _dense_matrix(value: Tensor, size: int) -> Tensor:
    detached = value.detach()
    symmetric = bool(torch.allclose(detached, detached.T))
    if not symmetric or cholesky_ex(detached)[1] != 0:
        raise ValueError(
            f"Invalid prior_precision: a ({size}, {size}) matrix that is not symmetric "
            "positive definite (expected a precision matrix)"
        )
    return value


def _from_mapping(prior: Mapping[Any, Any], treated: Treated, ref: Tensor) -> Tensor:
    missing = [name for name in treated.names if name not in prior]
    if missing:
        raise ValueError(
            f"Invalid prior_precision: dict without {missing} (expected a positive "
            "precision tensor for every treated parameter)"
        )
    parts = []
    for name, shape in zip(treated.names, treated.shapes, strict=True):
        value = torch.as_tensor(prior[name], dtype=ref.dtype, device=ref.device)
        if value.numel() == 1 and value.dim() <= 1:
            value = value.reshape(()).expand(shape)
        if value.shape != shape or not _positive(value):
            raise ValueError(
                f"Invalid prior_precision: entry {name!r} of shape {tuple(value.shape)} "
                f"(expected finite values > 0 of shape {tuple(shape)}, or one number)"
            )
        parts.append(value.reshape(-1))
    return torch.cat(parts)


def _from_tensor(prior: Tensor, treated: Treated, ref: Tensor, structure: str) -> Tensor:
    size, count = treated.numel, len(treated.names)
    value = prior.to(dtype=ref.dtype, device=ref.device)
    if value.dim() == 2 and structure == "dense" and value.shape == (size, size):
        return _dense_matrix(value, size)
    if value.numel() == 1 and value.dim() <= 1:
        flat = value.reshape(()).expand(size)
    elif value.dim() == 1 and value.shape[0] == count:
        flat = torch.cat([value[i].expand(n) for i, n in enumerate(treated.sizes)])
    elif value.dim() == 1 and value.shape[0] == size:
        flat = value
    else:
        matrix = f", or with structure='dense' a ({size}, {size}) positive-definite matrix"
        raise ValueError(
            f"Invalid prior_precision: tensor of shape {tuple(prior.shape)} (expected a "
            f"number, one value per treated tensor ({count},), one per weight ({size},), a "
            f"dict of per-parameter precisions{matrix if structure == 'dense' else ''})"
        )
    if not _positive(flat):
        raise ValueError(
            f"Invalid prior_precision: a tensor of shape {tuple(prior.shape)} with values "
            "<= 0 or not finite (expected finite values > 0)"
        )
    return flat


def read_prior(
    prior: Any, treated: Treated, ref: Tensor, *, structure: str, groups: Groups
) -> tuple[Tensor, str]:
    r"""``(delta, form)``: the prior as a flat (P,) diagonal, or a (P, P) matrix (dense).

    ``form`` is ``"scalar"`` (a number), ``"tensor"`` (a dict or 1-d tensor) or
    ``"matrix"``. Autograd flows from a tensor ``prior`` to ``delta``; the result has
    ``ref``'s dtype and device.

    Raises:
        TypeError: ``prior`` is not a number, tensor or dict.
        ValueError: a value is not finite and > 0, a shape fits no form, a dict lacks a
            treated name, a matrix is not symmetric positive definite, or (``kron``) a
            group of ``groups`` holds more than one value.
    """
    if isinstance(prior, Mapping):
        flat, form = _from_mapping(prior, treated, ref), "tensor"
    elif isinstance(prior, Tensor):
        flat = _from_tensor(prior, treated, ref, structure)
        form = "matrix" if flat.dim() == 2 else "scalar" if prior.numel() == 1 else "tensor"
    else:
        number = check_positive("prior_precision", prior)
        flat = torch.full((treated.numel,), number, dtype=ref.dtype, device=ref.device)
        form = "scalar"
    if structure == "kron" and form == "tensor":
        _check_one_per_group(flat, treated, groups)
    return flat, form


def _check_one_per_group(flat: Tensor, treated: Treated, groups: Groups) -> None:
    pieces = treated.unflatten(flat.detach())
    for group in groups:
        values = torch.cat([pieces[name].reshape(-1) for name in group])
        if not bool(torch.all(values == values[0])):
            which = " and ".join(repr(name) for name in group)
            raise ValueError(
                f"Invalid prior_precision: more than one value for {which} (expected one "
                "number per layer with structure='kron': a layer's weight and bias share "
                "one Kronecker factor pair, so one prior; a per-weight prior is refused)"
            )


def block_priors(flat: Tensor, treated: Treated, groups: Sequence[Sequence[str]]) -> Tensor:
    """One prior per group (its first element in ``flat``), keeping autograd."""
    offsets = _offsets(treated)
    index = torch.tensor([offsets[group[0]] for group in groups], device=flat.device)
    return flat.index_select(0, index)
