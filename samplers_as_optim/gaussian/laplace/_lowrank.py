r"""The low-rank-plus-diagonal Laplace precision, exact in O(kP) memory.

``Laplace(..., structure="lowrank")`` keeps the curvature C (the GGN or empirical Fisher of
the treated parameters, scaled to N examples) as its top-k eigenpairs and a diagonal for
the rest of the spectrum (:mod:`._lowrank_fit` computes them):

.. math::

    C \approx D + U\,\mathrm{diag}(s)\,U^\top, \qquad
    D = \max\big(0,\; \mathrm{diag}(C) - \mathrm{diag}(U\,\mathrm{diag}(s)\,U^\top)\big),

U (P x k) orthonormal, s the k largest eigenvalues, :math:`\mathrm{diag}(C)` exact (the
``"diag"`` fit's). With exact eigenpairs :math:`C - U\mathrm{diag}(s)U^\top` is positive
semi-definite, so D is the diagonal of the rest of the spectrum and the clipping removes
round-off only; :math:`\mathrm{tr}(D + U\mathrm{diag}(s)U^\top) = \mathrm{tr}(C)`. The
posterior precision, with :math:`\Lambda_0` diagonal and c the curvature's scale at the
current regression noise (:func:`._evidence.curvature_scale`), is

.. math::

    \Lambda = A + U\,\mathrm{diag}(t)\,U^\top = A^{1/2}(I + BB^\top)A^{1/2},\qquad
    A = \Lambda_0 + cD,\; t = cs,\; B = A^{-1/2}U\,\mathrm{diag}(\sqrt t),

and everything about it follows exactly from one k x k eigendecomposition
:math:`B^\top B = V\mathrm{diag}(\sigma)V^\top`, never forming a P x P matrix:

* :math:`\log\det\Lambda = \sum_j\log a_j + \sum_i\log(1+\sigma_i)` (the matrix
  determinant lemma, :math:`\det(I_P + BB^\top) = \det(I_k + B^\top B)`);
* :math:`\Lambda^{-1} = A^{-1/2}\big(I - BV(I+\Sigma)^{-1}V^\top B^\top\big)A^{-1/2}`
  (Woodbury), so the marginal variances are
  :math:`a_j^{-1}\big(1 - \sum_i (BV)_{ji}^2/(1+\sigma_i)\big)` (held at or above their
  lower bound :math:`1/\Lambda_{jj}`, which only round-off can cross);
* a square root :math:`WW^\top = \Lambda^{-1}`:
  :math:`W = A^{-1/2}\big(I + BV\mathrm{diag}(f(\sigma))V^\top B^\top\big)` with
  :math:`f(\sigma) = ((1+\sigma)^{-1/2} - 1)/\sigma = -1/\big(\sqrt{1+\sigma}\,
  (1 + \sqrt{1+\sigma})\big)`: with :math:`BB^\top = Z\Sigma Z^\top` the bracket is
  :math:`(I - ZZ^\top) + Z(I+\Sigma)^{-1/2}Z^\top = (I + BB^\top)^{-1/2}`, so
  :math:`WW^\top = A^{-1/2}(I+BB^\top)^{-1}A^{-1/2} = \Lambda^{-1}`. A draw is
  :math:`Wz` (z standard normal), the GLM predictive's factor is :math:`JW`, each
  :math:`O(Pk)` per vector;
* :math:`\delta^\top\Lambda\delta = \sum_j a_j\delta_j^2 + \sum_i t_i(u_i^\top\delta)^2`.

A new prior or noise changes A and t only: the evidence (:func:`lowrank_logdet`,
differentiable in both) and the rebuilt posterior need no pass over the data.

References:
    Daxberger et al. (2021), Laplace Redux — effortless Bayesian deep learning, §3.2
    (the low-rank Laplace).
    Golub & Van Loan (2013), Matrix Computations, 4th ed., §2.1.4 (Sherman-Morrison-
    Woodbury) and §6.1 (the determinant lemma).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .._wide_linalg import wide_dtype
from ..linearised.function_space import FlatPrecision

__all__ = ["LowRankCurvature", "LowRankPrecision", "lowrank_logdet"]


@dataclass
class LowRankCurvature:
    r"""What a ``structure="lowrank"`` fit keeps: :math:`C \approx D + U\mathrm{diag}(s)U^\top`.

    Scaled to N examples, at the fit's regression noise; in the model's dtype (float32
    for a half-precision model).

    Attributes:
        eigenvalues: s ``(k,)``, descending, >= 0: the Ritz values of the fit.
        eigenvectors: U as ``(k, P)`` orthonormal rows, in the flat treated order.
        diagonal: D ``(P,)``, :math:`\mathrm{diag}(C) - \mathrm{diag}(U\mathrm{diag}(s)
            U^\top)` clipped at 0.
        trace: :math:`\mathrm{tr}(C)` (0-d), the sum of the exact diagonal.
        residuals: ``(k,)`` :math:`\lVert Cu_i - s_iu_i\rVert` of each pair at the end.
        passes: the passes over the data the fit took (the first included).
    """

    eigenvalues: Tensor
    eigenvectors: Tensor
    diagonal: Tensor
    trace: Tensor
    residuals: Tensor
    passes: int

    @property
    def captured(self) -> float:
        r""":math:`\sum_i s_i / \mathrm{tr}(C)`: the fraction of the trace the k pairs hold."""
        trace = float(self.trace)
        return float(self.eigenvalues.sum()) / trace if trace > 0 else 1.0

    def precision(
        self, prior: Tensor, scale: Tensor | float, dtype: torch.dtype
    ) -> LowRankPrecision:
        r"""The precision :math:`\Lambda_0 + c(D + U\mathrm{diag}(s)U^\top)` (module docstring).

        Args:
            prior: :math:`\Lambda_0`'s flat diagonal ``(P,)``.
            scale: c.
            dtype: the dtype of the results (the model's).
        """
        wide = self.diagonal.dtype
        diagonal = prior.detach().to(wide) + float(scale) * self.diagonal
        precision = LowRankPrecision(
            diagonal, self.eigenvectors, float(scale) * self.eigenvalues, dtype
        )
        precision.captured = self.captured
        return precision

    def rank(self) -> int:
        r"""The number of eigenvalues of :math:`D + U\mathrm{diag}(s)U^\top` above round-off.

        Exactly :math:`\mathrm{nnz}(D) + \mathrm{rank}(\mathrm{diag}(\sqrt s)U_Z)`, Z the
        coordinates where D is 0 (the null space is the vectors on Z that U's rows on Z
        annihilate); "above round-off": larger than ``P * eps`` times the largest of s
        and D.
        """
        size = self.diagonal.shape[0]
        values = torch.cat([self.eigenvalues, self.diagonal])
        top = float(values.max()) if values.numel() else 0.0
        if top <= 0:
            return 0
        threshold = top * size * torch.finfo(values.dtype).eps
        nonzero = self.diagonal > threshold
        rows = self.eigenvectors[:, ~nonzero] * self.eigenvalues.sqrt().unsqueeze(-1)
        gram = torch.linalg.eigvalsh(rows @ rows.T) if rows.numel() else rows.new_zeros(0)
        return int(nonzero.sum()) + int((gram > threshold).sum())


def _root_factor(
    eigenvectors: Tensor, diagonal: Tensor, eigenvalues: Tensor, scale: Tensor | float
) -> Tensor:
    r"""B as rows ``(k, P)``: :math:`\mathrm{diag}(\sqrt{cs})U^\top A^{-1/2}` (grad-safe, s = 0)."""
    root_scale = torch.as_tensor(scale, dtype=diagonal.dtype, device=diagonal.device).sqrt()
    return eigenvectors * diagonal.rsqrt() * (eigenvalues.sqrt() * root_scale).unsqueeze(-1)


def lowrank_logdet(curvature: LowRankCurvature, prior: Tensor, scale: Tensor | float) -> Tensor:
    r""":math:`\log\det(\Lambda_0 + c(D + U\mathrm{diag}(s)U^\top))`, differentiable in both.

    :math:`\sum_j\log a_j + \log\det(I_k + B^\top B)`, the second term by a k x k
    Cholesky factorisation (autograd flows through it to ``prior`` and ``scale``).

    Args:
        curvature: the fit's low-rank curvature.
        prior: :math:`\Lambda_0`'s flat diagonal ``(P,)`` (may require grad).
        scale: c, a number or a 0-d tensor (may require grad).

    Returns:
        A 0-d tensor in ``prior``'s dtype.
    """
    wide = curvature.diagonal.dtype
    diagonal = prior.to(wide) + scale * curvature.diagonal
    rows = _root_factor(curvature.eigenvectors, diagonal, curvature.eigenvalues, scale)
    inner = torch.eye(rows.shape[0], dtype=wide, device=rows.device) + rows @ rows.T
    cholesky: Tensor = torch.linalg.cholesky(inner)
    logdet = diagonal.log().sum() + 2.0 * cholesky.diagonal().log().sum()
    return logdet.to(prior.dtype)


class LowRankPrecision(FlatPrecision):
    r""":math:`\Lambda = A + U\mathrm{diag}(t)U^\top`: a ``structure="lowrank"`` precision.

    Returned by ``Laplace(..., structure="lowrank").precision``; every operation is exact
    through one k x k eigendecomposition (the module docstring), in O(kP) memory.
    Arguments and results are flat ``(..., P)`` tensors in the treated order.

    Attributes:
        diagonal: A ``(P,)``, the prior plus the scaled diagonal remainder.
        eigenvectors: U ``(k, P)`` orthonormal rows.
        eigenvalues: t ``(k,)``, the scaled top eigenvalues of the curvature.
        rank: k.
        captured: the fraction of the curvature's trace the k pairs hold,
            :math:`\sum_i s_i/\mathrm{tr}(C)` (what ``rank=`` a fraction chooses k by).
    """

    def __init__(
        self, diagonal: Tensor, eigenvectors: Tensor, eigenvalues: Tensor, dtype: torch.dtype
    ) -> None:
        wide = wide_dtype(dtype)
        self.diagonal = diagonal.to(wide)
        self.eigenvectors = eigenvectors.to(wide)
        self.eigenvalues = eigenvalues.to(wide)
        self.rank = int(eigenvalues.shape[0])
        self.captured = float("nan")  # (set by the fit's curvature)
        self.dtype = dtype
        self._root_a = self.diagonal.rsqrt()
        self._rows = _root_factor(self.eigenvectors, self.diagonal, self.eigenvalues, 1.0)
        sigma: Tensor
        basis: Tensor
        sigma, basis = torch.linalg.eigh(self._rows @ self._rows.T)
        self._basis = basis
        self._sigma = sigma.clamp(min=0.0)
        root = (1.0 + self._sigma).sqrt()
        # H = V f(sigma) V^T, f(sigma) = ((1 + sigma)^(-1/2) - 1) / sigma, cancellation-free
        self._half = (self._basis * (-1.0 / (root * (1.0 + root)))) @ self._basis.T

    def _apply_root(self, rows: Tensor) -> Tensor:
        r"""Rows of :math:`(I + BHB^\top)x = (I + BB^\top)^{-1/2}x`."""
        return rows + ((rows @ self._rows.T) @ self._half) @ self._rows

    def inverse_sqrt(self, noise: Tensor) -> Tensor:
        r""":math:`Wz = A^{-1/2}(I+BB^\top)^{-1/2}z` per row z: covariance :math:`\Lambda^{-1}`."""
        wide = noise.to(self.diagonal.dtype)
        return (self._apply_root(wide) * self._root_a).to(noise.dtype)

    def factor(self, rows: Tensor) -> Tensor:
        r""":math:`j^\top W = (I + BB^\top)^{-1/2}A^{-1/2}j` for each row j (symmetric bracket)."""
        wide = rows.to(self.diagonal.dtype) * self._root_a
        return self._apply_root(wide).to(rows.dtype)

    def woodbury(self) -> tuple[Tensor, Tensor]:
        r"""``(r, Z)`` with :math:`\Lambda^{-1} = \mathrm{diag}(r) - Z^\top Z` (Woodbury).

        :math:`r = 1/a`, :math:`Z = (I+\Sigma)^{-1/2}V^\top B^\top A^{-1/2}` ``(k, P)``
        (the module docstring's :math:`\Lambda^{-1}`), in the factorisation's dtype.
        """
        rows = (self._basis.T @ self._rows) * (1.0 + self._sigma).rsqrt().unsqueeze(-1)
        return self.diagonal.reciprocal(), rows * self._root_a

    def quadratic(self, delta: Tensor) -> Tensor:
        r""":math:`\sum_j a_j\delta_j^2 + \sum_i t_i(u_i^\top\delta)^2` per row."""
        wide = delta.to(self.diagonal.dtype)
        low = (wide @ self.eigenvectors.T).square() @ self.eigenvalues
        return ((wide.square() * self.diagonal).sum(-1) + low).to(delta.dtype)

    def logdet(self) -> Tensor:
        r""":math:`\sum_j\log a_j + \sum_i\log(1 + \sigma_i)`."""
        value = self.diagonal.log().sum() + torch.log1p(self._sigma).sum()
        return value.to(self.dtype)

    def variances(self) -> Tensor:
        r""":math:`\mathrm{diag}(\Lambda^{-1})` by Woodbury, at least :math:`1/\Lambda_{jj}`."""
        rotated = self._rows.T @ self._basis  # (P, k): BV
        shrink = (rotated.square() / (1.0 + self._sigma)).sum(-1)
        variances = (1.0 - shrink) / self.diagonal
        precision = self.diagonal + self.eigenvectors.square().T @ self.eigenvalues
        return torch.maximum(variances, precision.reciprocal()).to(self.dtype)

    def dense(self) -> Tensor:
        r"""The (P, P) matrix :math:`\Lambda` (for inspection and tests on small models)."""
        matrix = (self.eigenvectors.T * self.eigenvalues) @ self.eigenvectors
        return (matrix + torch.diag(self.diagonal)).to(self.dtype)
