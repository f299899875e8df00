"""The parameters a Gaussian approximation treats, and their flat-vector view.

Laplace and variational inference treat exactly the parameters of a model that have
``requires_grad=True`` when the wrapper is built (so freezing the rest, LoRA-style, gives
a posterior over a subset). Dense covariances need those parameters as one flat vector;
the order is that of ``model.named_parameters()``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = ["Treated"]


@dataclass(frozen=True)
class Treated:
    """Names and shapes of the treated parameters, in ``named_parameters()`` order."""

    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]

    @classmethod
    def of(cls, model: nn.Module) -> Treated:
        """The parameters of ``model`` with ``requires_grad=True``; ValueError if none."""
        if not isinstance(model, nn.Module):
            raise TypeError(f"Invalid model: {type(model).__name__} (expected a torch.nn.Module)")
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError(
                f"Invalid model: {type(model).__name__} (expected at least one parameter with "
                "requires_grad=True: only those are treated)"
            )
        return cls(tuple(n for n, _ in named), tuple(p.shape for _, p in named))

    @property
    def sizes(self) -> tuple[int, ...]:
        """Number of elements of each treated parameter."""
        return tuple(shape.numel() for shape in self.shapes)

    @property
    def numel(self) -> int:
        """Total number of treated scalars, P."""
        return sum(self.sizes)

    def current(self, model: nn.Module) -> dict[str, Tensor]:
        """Detached copies of the treated parameters' current values."""
        params = dict(model.named_parameters())
        return {name: params[name].detach().clone() for name in self.names}

    def flatten(self, tensors: Mapping[str, Tensor], batch_dims: int = 0) -> Tensor:
        """Concatenate ``tensors[name]`` (with ``batch_dims`` leading dims) into ``(..., P)``."""
        parts = []
        for name, shape in zip(self.names, self.shapes, strict=True):
            tensor = tensors[name]
            lead = tensor.shape[:batch_dims]
            if tensor.shape[batch_dims:] != shape:
                raise ValueError(
                    f"Invalid parameters: {name!r} has shape {tuple(tensor.shape)} (expected "
                    f"{tuple(shape)}, after {batch_dims} leading sample dimension(s))"
                )
            parts.append(tensor.reshape(*lead, -1))
        return torch.cat(parts, dim=-1)

    def unflatten(self, flat: Tensor) -> dict[str, Tensor]:
        """Split ``(..., P)`` back into a dict name -> ``(..., *shape)`` (views)."""
        lead = flat.shape[:-1]
        pieces = torch.split(flat, list(self.sizes), dim=-1)
        return {
            name: piece.reshape(*lead, *shape)
            for name, shape, piece in zip(self.names, self.shapes, pieces, strict=True)
        }
