"""Noise for parameters sharded with FSDP2 (``fully_shard``): DTensors sharded on dim 0.

Under FSDP2 each rank holds rows ``[r0, r1)`` of every parameter (``Shard(0)``): the
contiguous elements ``[r0 * row, r1 * row)`` of the flattened parameter. A sampler draws
that part of the whole parameter's noise (``NoiseStream.draw`` with a layout) and wraps
it as a DTensor of the same placement, so a sharded run draws the numbers of a
1-process run. Other placements (sharding on another dimension, several mesh
dimensions) are refused with a clear error.
"""

from __future__ import annotations

import math
from typing import Any, cast

from torch import Tensor

__all__ = ["full_tensor", "is_dtensor", "local_layout", "local_tensor", "wrap_like"]

try:  # torch.distributed may be missing from a build
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
except ImportError:  # pragma: no cover - builds without torch.distributed
    DTensor = None  # type: ignore[assignment,misc]


def is_dtensor(tensor: Any) -> bool:
    """Whether ``tensor`` is a ``torch.distributed.tensor.DTensor`` (e.g. under FSDP2)."""
    return DTensor is not None and isinstance(tensor, DTensor)


def full_tensor(tensor: Tensor) -> Tensor:
    """A DTensor's whole value, on every rank (``full_tensor()``), else ``tensor`` itself."""
    return cast("DTensor", tensor).full_tensor() if is_dtensor(tensor) else tensor


def local_tensor(tensor: Tensor) -> Tensor:
    """A DTensor's local tensor (``to_local()``, its storage), else ``tensor`` itself."""
    return cast("DTensor", tensor).to_local() if is_dtensor(tensor) else tensor


def local_layout(param: Tensor) -> tuple[Tensor, tuple[int, int]]:
    """This rank's local tensor of a DTensor parameter and its ``(offset, total)``.

    Raises:
        NotImplementedError: a placement other than ``Shard(0)`` or ``Replicate()`` on
            a 1-dimensional mesh.
    """
    dtensor = cast("DTensor", param)
    placements = tuple(dtensor.placements)
    if len(placements) != 1 or not (
        isinstance(placements[0], Replicate)
        or (isinstance(placements[0], Shard) and placements[0].dim == 0)
    ):
        raise NotImplementedError(
            f"The samplers draw noise for DTensor parameters sharded on dim 0 or replicated "
            f"on a 1-dimensional mesh (FSDP2's fully_shard default); got placements "
            f"{placements}"
        )
    local = dtensor.to_local()
    _, offsets = compute_local_shape_and_global_offset(param.shape, dtensor.device_mesh, placements)
    row = math.prod(param.shape[1:]) if param.dim() else 1
    offset = offsets[0] * row if param.dim() and local.numel() else 0
    return local, (offset, param.numel())


def wrap_like(local: Tensor, param: Tensor) -> Tensor:
    """``local`` as a DTensor with ``param``'s mesh, placements, shape and stride."""
    return DTensor.from_local(
        local,
        cast("DTensor", param).device_mesh,
        cast("DTensor", param).placements,
        run_check=False,
        shape=param.shape,
        stride=param.stride(),
    )
