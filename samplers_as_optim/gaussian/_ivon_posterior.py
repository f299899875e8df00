"""IVON's posterior as the package's samples: names, means, standard deviations, draws.

q(θ) = N(m, diag(σ²)), σ² = T / (ess (h + weight_decay)) per param group (``ivon``'s
module docstring), keyed by the parameters' names, as ``model.named_parameters()``
gives them: the one sample layout of ``samples/stacked``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from ..names import parameter_name

__all__ = ["draw_samples", "posterior"]


def posterior(
    param_groups: Sequence[dict[str, Any]],
    state: Mapping[Tensor, dict[str, Any]],
    saved: Mapping[int, Tensor],
) -> list[tuple[str, Tensor, Tensor]]:
    """(name, m, σ) of every parameter that requires a gradient, new tensors.

    Args:
        param_groups: the optimizer's param groups.
        state: its per-parameter state (``"hess"``; h₀ = ``hess_init`` where none yet).
        saved: the means of the parameters that hold a draw, by ``id``.

    Raises:
        ValueError: a parameter has no name (from ``named_parameters()`` or
            ``name_parameters``).
    """
    found = []
    for index, group in enumerate(param_groups):
        names = group.get("param_names")
        for position, param in enumerate(group["params"]):
            if not param.requires_grad:
                continue
            name = names[position] if names else parameter_name(param)
            if name is None:
                raise ValueError(
                    f"IVON: parameter {position} of param group {index} has no name, and the "
                    "sample layout is keyed by names (expected an optimizer built from "
                    "model.named_parameters(), or name_parameters(model) first)"
                )
            hess = state.get(param, {}).get("hess")
            if hess is None:
                hess = torch.full_like(param, float(group["hess_init"]))
            precision = (hess.detach() + float(group["weight_decay"])) * float(group["ess"])
            std = (float(group["temperature"]) / precision).sqrt()
            found.append((name, saved.get(id(param), param).detach().clone(), std))
    return found


def draw_samples(
    parts: list[tuple[str, Tensor, Tensor]], n: int, generator: torch.Generator | None
) -> dict[str, Tensor]:
    """Draw n samples m + σ ξ of each (name, m, σ): name -> ``[n, *shape]``."""
    out = {}
    for name, mean, std in parts:
        noise = torch.randn(
            (n, *mean.shape), generator=generator, dtype=mean.dtype, device=mean.device
        )
        out[name] = torch.addcmul(mean.unsqueeze(0), noise, std.unsqueeze(0))
    return out
