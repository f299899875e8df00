r"""PSGLD in half precision: the dtype its preconditioner is computed in, and what it refuses.

float16's range is too narrow for RMSprop's preconditioner (``psgld``'s module docstring,
"float16"): at temperature > 0 a float16 parameter's step is computed in float32, and an
``eps`` or a noise scale the dtype cannot hold is refused before anything changes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import Tensor

__all__ = ["check_dtypes", "computed_in", "lift", "psgld_noise_scale"]


def psgld_noise_scale(lr: float, temperature: float, num_data: int) -> float:
    r"""The noise scale :math:`\sqrt{2T/(N\,lr)}` before the preconditioner's :math:`1/\sqrt{a}`."""
    if temperature == 0:
        return 0.0
    return math.sqrt(2.0 * temperature / (num_data * lr))


#: the largest noise scale must fit the parameters' dtype this many times over: room for
#: draws of that many standard deviations before the direction overflows
_NOISE_ROOM = 10.0


def computed_in(dtype: torch.dtype, temperature: float) -> torch.dtype:
    """The dtype the preconditioner of a ``dtype`` parameter is computed in (module doc)."""
    return torch.float32 if temperature > 0 and dtype == torch.float16 else dtype


def lift(tensor: Tensor, upcast: bool) -> Tensor:
    """``tensor`` in float32 where a float16 step is computed in float32, else itself."""
    return tensor.float() if upcast and tensor.dtype == torch.float16 else tensor


def check_dtypes(
    dtypes: Iterable[torch.dtype],
    *,
    eps: float,
    lr: float,
    temperature: float,
    num_data: int,
    where: str = "",
) -> None:
    r"""Raise ``ValueError`` unless PSGLD's step stays finite in the parameters' dtypes.

    Refused: an ``eps`` that rounds to 0 in the dtype the preconditioner is computed in
    (an element whose gradient is 0 would become :math:`0/0`, NaN), and at temperature
    > 0 a largest noise scale :math:`\sqrt{2T/(N\,lr)}/\sqrt{\epsilon}` above the
    dtype's largest number over ``_NOISE_ROOM``. Called before anything changes, by
    :class:`PSGLD`'s step for every param group and by :func:`psgld_direction`.
    """
    for dtype in dtypes:
        if not dtype.is_floating_point:
            continue
        computed = computed_in(dtype, temperature)
        info = torch.finfo(computed)
        # at or below half the smallest subnormal, eps rounds to 0 (ties to even)
        lowest = info.smallest_normal * info.eps / 2
        if not eps > lowest:
            at = ""
            if temperature == 0 and computed_in(dtype, 1.0) != dtype:
                at = (
                    " at temperature 0, where PSGLD is torch.optim.RMSprop, computed in the "
                    "parameters' dtype"
                )
            raise ValueError(
                f"Invalid eps{where}: {eps!r} (expected a value above {lowest:.3g} for "
                f"{dtype} parameters{at}: {computed} rounds {eps!r} to 0, and an element "
                "whose gradient is 0 would become NaN)"
            )
        if temperature > 0 and lr > 0:
            largest = torch.finfo(dtype).max / _NOISE_ROOM
            scale = psgld_noise_scale(lr, temperature, num_data) / math.sqrt(eps)
            if not scale <= largest:
                raise ValueError(
                    f"Invalid temperature{where}: {temperature!r} (expected a value whose "
                    f"largest noise scale sqrt(2 T / (N lr)) / sqrt(eps) = {scale:.3g}, that "
                    f"of an element whose gradient is 0, fits {dtype} with room for "
                    f"{_NOISE_ROOM:g} standard deviations, at most {largest:.3g}; a larger eps "
                    "also lowers it)"
                )
