r"""Factorisations of half-precision matrices, computed in float32.

torch has no ``eigh``, Cholesky or triangular solve for ``float16``/``bfloat16`` on the
CPU, and their round-off (about 1e-3 and 1e-2 relative) would ruin a factorisation
anyway. So a Laplace fitted on a half-precision model factors its curvature in float32:
the Kronecker factors' eigendecompositions are computed there and stored back in the
model's dtype (as a ``"diag"`` fit keeps everything in it); a dense precision keeps its
Cholesky factor in float32, and every product with it (sampling, log-density,
covariance, function-space variances) runs in float32 and returns the model's dtype.
For float32 and float64 every function here is the plain torch call.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "cholesky_ex",
    "eigh",
    "eigvalsh",
    "factor_sum",
    "solve_triangular",
    "wide_dtype",
]

_NARROW = (torch.float16, torch.bfloat16)


def wide_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a factorisation runs in: float32 for half precision, else ``dtype``."""
    return torch.float32 if dtype in _NARROW else dtype


def eigh(matrix: Tensor) -> tuple[Tensor, Tensor]:
    """``torch.linalg.eigh`` computed in :func:`wide_dtype`, returned in ``matrix``'s dtype."""
    wide = wide_dtype(matrix.dtype)
    values, vectors = torch.linalg.eigh(matrix.to(wide))
    return values.to(matrix.dtype), vectors.to(matrix.dtype)


def eigvalsh(matrix: Tensor) -> Tensor:
    """``torch.linalg.eigvalsh`` in :func:`wide_dtype`, returned in ``matrix``'s dtype."""
    values: Tensor = torch.linalg.eigvalsh(matrix.to(wide_dtype(matrix.dtype)))
    return values.to(matrix.dtype)


def cholesky_ex(matrix: Tensor) -> tuple[Tensor, Tensor]:
    """``torch.linalg.cholesky_ex`` in :func:`wide_dtype`: the factor stays in that dtype."""
    factor, info = torch.linalg.cholesky_ex(matrix.to(wide_dtype(matrix.dtype)))
    return factor, info


def factor_sum(
    matrix: Tensor, scale: Tensor | float, curvature: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """``matrix + scale * curvature`` and its Cholesky factor, summed and factored wide.

    Returns:
        The sum in ``curvature``'s dtype, its factor in :func:`wide_dtype` and
        ``cholesky_ex``'s ``info`` (0 where the sum is positive definite).
    """
    wide = wide_dtype(curvature.dtype)
    total = matrix.to(wide) + scale * curvature.to(wide)
    factor, info = torch.linalg.cholesky_ex(total)
    return total.to(curvature.dtype), factor, info


def solve_triangular(factor: Tensor, rhs: Tensor, *, upper: bool) -> Tensor:
    """``torch.linalg.solve_triangular`` in ``factor``'s dtype, returned in ``rhs``'s."""
    solved: Tensor = torch.linalg.solve_triangular(factor, rhs.to(factor.dtype), upper=upper)
    return solved.to(rhs.dtype)
