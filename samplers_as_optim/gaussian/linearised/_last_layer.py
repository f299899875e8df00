r"""The function-space Gaussian of a last layer by the Kronecker identity, no Jacobian.

When the treated weights are exactly one ``nn.Linear``'s weight (and optionally its
bias), called once, whose output is the model's output, the output of each input (each
position of it, for ``(B, *positions, C)`` outputs) is
:math:`f = \tilde W\tilde\phi` with :math:`\tilde W = [W, b]` (C x d') and
:math:`\tilde\phi = [\phi; 1]` the layer's input (augmented by 1 when the bias is
treated, d' = d + 1; d' = d otherwise). Its Jacobian is :math:`J = I_C\otimes
\tilde\phi^\top` in the row-major order of :math:`\mathrm{vec}(\tilde W)` (a C x Cd'
matrix that is never formed), so :math:`\Sigma_f = T\,J\Lambda^{-1}J^\top` follows from
the structure of the precision and :math:`\tilde\phi` alone (Immer, Korzepa & Bauer
2021, eq. 7; the identity is laplace-torch issue #138's
:math:`(\tilde\phi^\top V\tilde\phi)\,U` for a single Kronecker product):

* ``"kron"`` (:mod:`~samplers_as_optim.gaussian.kfac`): :math:`\Lambda = (Q_G\otimes
  Q_A)\,\mathrm{diag}(D)\,(Q_G\otimes Q_A)^\top`, :math:`D_{ab} = \delta + \lambda_{G,a}
  \lambda_{A,b}` (the prior makes Λ⁻¹ no single Kronecker product), and
  :math:`J(Q_G\otimes Q_A) = Q_G\otimes\psi^\top` with :math:`\psi = Q_A^\top
  \tilde\phi`, so

  .. math::

      \Sigma_f = T\,Q_G\,\mathrm{diag}(w)\,Q_G^\top,\qquad
      w_a = \sum_b \psi_b^2 / D_{ab};

  :math:`Q_G\,\mathrm{diag}(\sqrt{Tw})` is a square root (the draws need no
  eigendecomposition per input);
* ``"lowrank"`` (:meth:`~.function_space.FlatPrecision.woodbury`: :math:`\Lambda^{-1} =
  \mathrm{diag}(r) - Z^\top Z`, Z k x P): with the P-vectors read as C x d' matrices,
  :math:`J\,\mathrm{diag}(r)J^\top = \mathrm{diag}(v)`, :math:`v_c = \sum_j r_{cj}
  \tilde\phi_j^2`, and :math:`L = JZ^\top` (C x k) is :math:`L_{ci} = \sum_j Z_{icj}
  \tilde\phi_j`, so :math:`\Sigma_f = T(\mathrm{diag}(v) - LL^\top)`. A square root is
  :math:`\mathrm{diag}(\sqrt v)(I - KK^\top)^{1/2}`, :math:`K = \mathrm{diag}(v)^{-1/2}L`,
  with :math:`(I - KK^\top)^{1/2} = I + K\,U\mathrm{diag}(g(\mu))U^\top K^\top` from the
  k x k eigendecomposition :math:`K^\top K = U\mathrm{diag}(\mu)U^\top` and
  :math:`g(\mu) = (\sqrt{1-\mu} - 1)/\mu = -1/(1 + \sqrt{1-\mu})` (its square is
  :math:`I - KK^\top` since :math:`2g + \mu g^2 = -1`);
* ``"diag"``: :math:`\Sigma_f = T\,\mathrm{diag}(v)`, :math:`r = 1/\Lambda_{jj}`.

Cost per input (per position), C outputs, d' features, rank k, S draws; one forward of
the network for the batch instead of C reverse passes and a C x Cd' Jacobian
(:math:`C^2 d'` numbers; today's route of
:mod:`~samplers_as_optim.gaussian.linearised.function_space`, then an O(C³) ``eigh`` per
input for the draws):

============  ==================  ======================  =================  ==============
structure     diag Σ_f, Σ_f 1     draws                   full Σ_f            memory
============  ==================  ======================  =================  ==============
``"kron"``    O(C d' + C²)        O(S C²)                 O(C³)              O(C) (+ C² once)
``"lowrank"`` O(C d' k)           O(C k² + k³ + S C k)    O(C² k)            O(C k)
``"diag"``    O(C d')             O(S C)                  O(C²)              O(C)
============  ==================  ======================  =================  ==============

KFAC cannot avoid C² time: each diagonal entry :math:`\sum_a Q_{G,ca}^2 w_a` reads a row
of :math:`Q_G` (one ``(B, C) x (C, C)`` matrix product for the batch; :math:`Q_G` is
held once, not per input). The full covariance is only formed when asked for
(:meth:`OutputCovariance.dense`).

References:
    Immer, Korzepa & Bauer (2021), Improving predictions of Bayesian neural nets via
    local linearization, eq. 7. Daxberger et al. (2021), Laplace Redux, §3.1 (last layer)
    and §3.2 (KFAC, low rank). Martens & Grosse (2015), App. B (the eigenbasis).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, cast

import torch
from torch import Tensor, nn
from torch.func import functional_call

from .._wide_linalg import wide_dtype
from ..flat import Treated
from ..kfac import KronPrecision

__all__ = [
    "Head",
    "HeadInput",
    "OutputCovariance",
    "find_head",
    "head_covariance",
    "head_features",
]


@dataclass(frozen=True)
class Head:
    """The ``nn.Linear`` whose weight (and bias) are the treated parameters."""

    module: nn.Linear
    weight: str
    bias: str | None


def find_head(model: nn.Module, treated: Treated) -> Head | None:
    """The Linear layer the treated names are exactly (weight, optionally bias), or None.

    None for any other subset, a subclass with its own ``forward``, or a weight or bias
    shared with another module (tied weights: the input would depend on them).
    """
    first, *rest = treated.names
    prefix, _, leaf = first.rpartition(".")
    if leaf != "weight":
        return None
    try:
        module = model.get_submodule(prefix)
    except AttributeError:
        return None
    if not isinstance(module, nn.Linear) or type(module).forward is not nn.Linear.forward:
        return None
    bias = f"{prefix}.bias" if prefix else "bias"
    if rest not in ([], [bias]):
        return None
    owned = [module.weight] + ([module.bias] if rest else [])
    everywhere = [id(param) for _, param in model.named_parameters(remove_duplicate=False)]
    if any(everywhere.count(id(param)) != 1 for param in owned):
        return None
    return Head(module, first, bias if rest else None)


class HeadInput(NamedTuple):
    r"""A batch's input :math:`\tilde\phi` ``(B, *positions, d')`` to the head."""

    head: Head
    features: Tensor


def head_features(
    model: nn.Module, head: Head, mean: dict[str, Tensor], x: Tensor
) -> tuple[Tensor, HeadInput | None]:
    r"""The model's output at ``mean`` and the head's input :math:`\tilde\phi`, one forward.

    :math:`\tilde\phi` is ``(B, *positions, d')`` (with the 1 appended when the bias is
    treated), or None when the identity does not hold: the head ran other than once, on
    other than one positional input, or the model's output is not the head's output
    (the very tensor, unchanged in place since, shaped ``(B, *positions, C)``).
    """
    calls: list[tuple[tuple[Any, ...], Any, int]] = []

    def record(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        calls.append((args, output, getattr(output, "_version", -1)))

    handle = head.module.register_forward_hook(record)
    try:
        center = cast(Tensor, functional_call(model, mean, (x,)))
    finally:
        handle.remove()
    if (
        not isinstance(center, Tensor)
        or center.dim() < 2
        or len(calls) != 1
        or len(calls[0][0]) != 1
        or calls[0][1] is not center
        or center._version != calls[0][2]  # changed in place after the head
    ):
        return center, None
    features = calls[0][0][0]
    if not isinstance(features, Tensor) or features.shape[:-1] != center.shape[:-1]:
        return center, None
    if head.bias is not None:
        features = torch.cat([features, features.new_ones(*features.shape[:-1], 1)], dim=-1)
    return center, HeadInput(head, features)


class OutputCovariance:
    r"""Each input's (or position's) :math:`\Sigma_f` ``(*lead, C, C)``, kept factored.

    What the GLM predictive reads of it: the diagonal (probit, regression), the row sums
    :math:`\Sigma_f\mathbf 1` (the Laplace bridge), draws through a square root (Monte
    Carlo and the uncertainty split), or the matrix itself.
    """

    def diagonal(self) -> Tensor:
        r""":math:`\mathrm{diag}\,\Sigma_f`, ``(*lead, C)``."""
        raise NotImplementedError

    def row_sums(self) -> Tensor:
        r""":math:`\Sigma_f\mathbf 1`, ``(*lead, C)``."""
        raise NotImplementedError

    def dense(self) -> Tensor:
        r""":math:`\Sigma_f`, ``(*lead, C, C)``."""
        raise NotImplementedError

    def steps(self, noise: Tensor) -> Tensor:
        r""":math:`R\xi` for ``(S, *lead, C)`` standard normal ξ, :math:`RR^\top = \Sigma_f`."""
        raise NotImplementedError


class _Rotated(OutputCovariance):
    r"""KFAC: :math:`Q\,\mathrm{diag}(w)\,Q^\top` with one Q for every row."""

    def __init__(self, basis: Tensor, weights: Tensor, dtype: torch.dtype) -> None:
        self.basis, self.weights, self.dtype = basis, weights, dtype

    def diagonal(self) -> Tensor:
        return (self.weights @ self.basis.square().T).to(self.dtype)

    def row_sums(self) -> Tensor:
        return ((self.weights * self.basis.sum(0)) @ self.basis.T).to(self.dtype)

    def dense(self) -> Tensor:
        return ((self.basis * self.weights.unsqueeze(-2)) @ self.basis.T).to(self.dtype)

    def steps(self, noise: Tensor) -> Tensor:
        scaled = noise.to(self.basis.dtype) * self.weights.sqrt()
        return (scaled @ self.basis.T).to(self.dtype)


class _DiagonalMinusLowRank(OutputCovariance):
    r""":math:`\mathrm{diag}(v) - LL^\top` per row, L ``(*lead, C, k)`` (k = 0: diagonal)."""

    def __init__(self, variances: Tensor, low: Tensor | None, dtype: torch.dtype) -> None:
        self.variances, self.low, self.dtype = variances, low, dtype

    def diagonal(self) -> Tensor:
        if self.low is None:
            return self.variances.to(self.dtype)
        return (self.variances - self.low.square().sum(-1)).clamp(min=0.0).to(self.dtype)

    def row_sums(self) -> Tensor:
        if self.low is None:
            return self.variances.to(self.dtype)
        shared = (self.low @ self.low.sum(-2).unsqueeze(-1)).squeeze(-1)
        return (self.variances - shared).to(self.dtype)

    def dense(self) -> Tensor:
        matrix = torch.diag_embed(self.variances)
        if self.low is not None:
            matrix = matrix - self.low @ self.low.mT
        return matrix.to(self.dtype)

    def steps(self, noise: Tensor) -> Tensor:
        root = self.variances.sqrt()
        wide = noise.to(root.dtype)
        if self.low is None:
            return (wide * root).to(self.dtype)
        safe = torch.where(root > 0, root, 1.0).unsqueeze(-1)
        scaled = torch.where(root.unsqueeze(-1) > 0, self.low / safe, 0.0)  # K
        mu: Tensor
        vectors: Tensor
        mu, vectors = torch.linalg.eigh(scaled.mT @ scaled)
        shrink = -1.0 / (1.0 + (1.0 - mu.clamp(0.0, 1.0)).sqrt())  # g(mu)
        inner = (vectors * shrink.unsqueeze(-2)) @ vectors.mT  # U g U^T, (*lead, k, k)
        back = scaled @ inner  # K U g U^T, (*lead, C, k)
        # one (S, C) x (C, k) product per row: the rows as the batch of a bmm
        rows = wide.reshape(wide.shape[0], -1, wide.shape[-1]).transpose(0, 1)  # (N, S, C)
        flat_scaled = scaled.reshape(-1, *scaled.shape[-2:])
        flat_back = back.reshape(-1, *back.shape[-2:])
        correction = ((rows @ flat_scaled) @ flat_back.mT).transpose(0, 1).reshape(wide.shape)
        return ((wide + correction) * root).to(self.dtype)


def _as_matrix(flat: Tensor, head: Head, classes: int) -> Tensor:
    r"""``(..., P)`` in the treated order (weight, then bias) as ``(..., C, d')``."""
    lead = flat.shape[:-1]
    if head.bias is None:
        return flat.reshape(*lead, classes, -1)
    weight = flat[..., :-classes].reshape(*lead, classes, -1)
    return torch.cat([weight, flat[..., -classes:].unsqueeze(-1)], dim=-1)


def head_covariance(
    inputs: HeadInput, treated: Treated, precision: Any, temperature: float
) -> OutputCovariance | None:
    r""":math:`T J\Lambda^{-1}J^\top` of every row of ``features`` (module docstring).

    ``precision``: a dict of diagonals, a
    :class:`~samplers_as_optim.gaussian.kfac.KronPrecision` with the head's block only,
    or the pair ``(r, Z)`` with :math:`\Lambda^{-1} = \mathrm{diag}(r) - Z^\top Z`
    (:meth:`~.function_space.FlatPrecision.woodbury`); anything else (a dense matrix)
    gives None.
    """
    head, features = inputs
    classes = head.module.out_features
    dtype = features.dtype
    wide = wide_dtype(dtype)
    phi = features.to(wide)
    if isinstance(precision, KronPrecision):
        if len(precision.blocks) != 1 or precision.diagonal:
            return None
        block = precision.blocks[0]
        if block.weight != head.weight or block.bias != head.bias:
            return None
        psi = phi @ block.a_eigenvectors.to(wide)
        weights = psi.square() @ block.eigenvalues.to(wide).reciprocal().T
        return _Rotated(block.g_eigenvectors.to(wide), temperature * weights, dtype)
    if isinstance(precision, dict):
        inverse = _as_matrix(treated.flatten(precision).to(wide).reciprocal(), head, classes)
        variances = phi.square() @ inverse.mT
        return _DiagonalMinusLowRank(temperature * variances, None, dtype)
    if not isinstance(precision, tuple):
        return None
    inverse = _as_matrix(precision[0].to(wide), head, classes)  # r as (C, d')
    low = _as_matrix(precision[1].to(wide), head, classes)  # Z as (k, C, d')
    variances = phi.square() @ inverse.mT
    rank = low.shape[0]
    flat_low = (low.reshape(rank * classes, -1) @ phi.reshape(-1, phi.shape[-1]).T).reshape(
        rank, classes, -1
    )
    low_rows = flat_low.permute(2, 1, 0).reshape(*phi.shape[:-1], classes, rank)
    return _DiagonalMinusLowRank(temperature * variances, temperature**0.5 * low_rows, dtype)
