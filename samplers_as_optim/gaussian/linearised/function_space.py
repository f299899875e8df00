r"""The linearised network's Gaussian over outputs: :math:`\mathcal N(f(x;\mu), TJ\Sigma J^\top)`.

Linearising the network at the mean, :math:`f_\text{lin}(x;\theta) = f(x;\mu) +
J_\mu(x)(\theta-\mu)`, turns the weight Gaussian :math:`\mathcal N(\mu, T\Lambda^{-1})`
into a Gaussian over each input's O outputs (Immer, Korzepa & Bauer 2021, eq. 7;
Daxberger et al. 2021, §2 "the GLM predictive"):

.. math::

    f(x) \sim \mathcal N\big(f(x;\mu),\; T\,J_\mu(x)\,\Lambda^{-1}J_\mu(x)^\top\big),

exactly, without sampling. The O x O covariance is :math:`T\,MM^\top` with
:math:`M = J S` for a square root :math:`\Lambda^{-1} = SS^\top` of the fitted structure:

* ``"diag"``: :math:`S = \mathrm{diag}(\Lambda)^{-1/2}`, so :math:`M = J \odot
  \Lambda_{jj}^{-1/2}` column by column;
* ``"dense"``: :math:`\Lambda = LL^\top` (Cholesky), :math:`S = L^{-\top}`, so
  :math:`M^\top = L^{-1}J^\top` (one triangular solve);
* ``"kron"``: per Kronecker block :math:`\Lambda = (Q_G\otimes Q_A)\,\mathrm{diag}(D)\,
  (Q_G\otimes Q_A)^\top` (see :mod:`~samplers_as_optim.gaussian.kfac`),
  :math:`S = (Q_G\otimes Q_A)\,\mathrm{diag}(D)^{-1/2}`, so the block's columns of M are
  :math:`(Q_G^\top J_o Q_A)\oslash\sqrt D` for each output's Jacobian :math:`J_o` as an
  out x (in+1) matrix; the diagonal part as for ``"diag"``;
* a :class:`FlatPrecision` (``"lowrank"``, :math:`\Lambda = A + BB^\top` in the units
  of :mod:`~samplers_as_optim.gaussian.laplace._lowrank`): its own square root W,
  :math:`M = JW` (:meth:`FlatPrecision.factor`, O(P·k) per output row).

Cost per input: O reverse passes for J (vectorised, see
:mod:`~samplers_as_optim.gaussian.linearised.output_jacobians`), :math:`O\cdot P` numbers for J and
M, :math:`O^2 P` for :math:`MM^\top` (:math:`O\cdot P` for its diagonal alone), and for
``"dense"`` a triangular solve, :math:`O\cdot P^2`.

**A last layer** (the treated weights are one ``nn.Linear``'s weight, and optionally its
bias, and the model's output is that layer's; ``subset="last_layer"``) with ``"diag"``,
``"kron"`` or ``"lowrank"`` takes no Jacobian: :math:`J = I_C\otimes\tilde\phi^\top` for
the layer's input :math:`\tilde\phi`, read by one forward of the batch, and the C x C
covariance is kept factored (:class:`FactoredGaussian`; the formulas and costs per
structure in :mod:`._last_layer`): memory and time per input grow with C (KFAC's
diagonal and draws with :math:`C^2` time, never :math:`C^2` memory per input), not with
the :math:`C^2(d+1)` numbers of J. :func:`output_gaussian` gives the GLM predictive that
form; :func:`function_space_gaussian` forms the matrix (or, with ``diagonal``, only its
diagonal) from it, except the joint covariance of outputs with positions, which takes
the Jacobian.
"""

from __future__ import annotations

from typing import Any, NamedTuple, cast

import torch
from torch import Tensor, nn
from torch.func import functional_call

from .._wide_linalg import solve_triangular
from ..flat import Treated
from ..kfac import KronPrecision
from ._last_layer import HeadInput, OutputCovariance, find_head, head_covariance, head_features
from .output_jacobians import input_chunks, output_jacobians

__all__ = [
    "FactoredGaussian",
    "FlatPrecision",
    "FunctionSpaceGaussian",
    "HeadInput",
    "OutputCovariance",
    "covariance_factor",
    "function_space_gaussian",
    "last_layer_covariance",
    "last_layer_inputs",
    "output_gaussian",
]


class FactoredGaussian(NamedTuple):
    r"""A last layer's function-space Gaussian with :math:`\Sigma_f` kept factored.

    Attributes:
        mean: ``(B, *positions, C)`` :math:`f(x;\mu)`.
        covariance: each input's (position's) :math:`T J\Lambda^{-1}J^\top`, C x C, as
            an :class:`~._last_layer.OutputCovariance` (its diagonal, row sums, draws).
    """

    mean: Tensor
    covariance: OutputCovariance


class FunctionSpaceGaussian(NamedTuple):
    r"""The Gaussian of each input's outputs under the linearised network.

    Attributes:
        mean: ``(B, *out)`` :math:`f(x;\mu)`, the network at the mean.
        covariance: ``(B, O, O)`` :math:`T J\Lambda^{-1}J^\top` with O the number of
            outputs per input (``out`` flattened, row-major).
    """

    mean: Tensor
    covariance: Tensor


class FlatPrecision:
    r"""A precision over the flat (P,) treated vector that applies its own square root.

    The interface a Gaussian (``_weight_gaussian``) and :func:`covariance_factor` use
    for a structure that is neither a diagonal, a dense matrix nor KFAC: a matrix W with
    :math:`WW^\top = \Lambda^{-1}`, applied to standard normal draws (:meth:`inverse_sqrt`)
    and to Jacobian rows (:meth:`factor`), the quadratic form, the log-determinant and
    the marginal variances. Every argument and result is in the flat order of the
    treated parameters (``named_parameters()``), with any leading dimensions.
    """

    def inverse_sqrt(self, noise: Tensor) -> Tensor:
        r""":math:`Wz` for each row z of ``noise`` ``(..., P)``: covariance :math:`\Lambda^{-1}`."""
        raise NotImplementedError

    def factor(self, rows: Tensor) -> Tensor:
        r""":math:`j^\top W` per row j of ``rows`` ``(..., P)``: :math:`JW` squares to the GLM's.

        :math:`(JW)(JW)^\top = J\Lambda^{-1}J^\top`.
        """
        raise NotImplementedError

    def quadratic(self, delta: Tensor) -> Tensor:
        r""":math:`\delta^\top\Lambda\delta` for each row of ``delta`` ``(..., P)``: ``(...)``."""
        raise NotImplementedError

    def logdet(self) -> Tensor:
        r""":math:`\log\det\Lambda`, 0-d."""
        raise NotImplementedError

    def variances(self) -> Tensor:
        r""":math:`\mathrm{diag}(\Lambda^{-1})`, ``(P,)``."""
        raise NotImplementedError

    def woodbury(self) -> tuple[Tensor, Tensor] | None:
        r"""``(r, Z)`` with :math:`\Lambda^{-1} = \mathrm{diag}(r) - Z^\top Z`, if it has one.

        ``r`` ``(P,)``, ``Z`` ``(k, P)``: what the last-layer predictive
        (:mod:`._last_layer`) reads to avoid the Jacobian; None (the default): no such
        form, the Jacobian route is taken.
        """
        return None


Structure = dict[str, Tensor] | Tensor | KronPrecision | FlatPrecision


def _block_eigenvalues(block: Any) -> Tensor:
    """D of a :class:`~samplers_as_optim.gaussian.kfac.KronBlock` (a property or a method)."""
    values = block.eigenvalues
    return cast(Tensor, values() if callable(values) else values)


def covariance_factor(
    jacobians: dict[str, Tensor],
    treated: Treated,
    precision: dict[str, Tensor] | Tensor | KronPrecision | FlatPrecision,
    cholesky: Tensor | None,
) -> Tensor:
    r"""M with :math:`MM^\top = J\Lambda^{-1}J^\top`: ``(C, O, P)`` from ``(C, O, *shape)``.

    ``precision`` is the fitted structure at temperature 1 (a dict of diagonals, the
    dense matrix with its Cholesky factor ``cholesky``, a ``KronPrecision`` or a
    :class:`FlatPrecision`).
    """
    first = jacobians[treated.names[0]]
    lead = first.shape[:2]
    if isinstance(precision, KronPrecision):
        parts = []
        for block in precision.blocks:
            matrix = block.matrix(jacobians, 2)
            rotated = block.g_eigenvectors.T @ matrix @ block.a_eigenvectors
            parts.append((rotated * _block_eigenvalues(block).rsqrt()).reshape(*lead, -1))
        for name, diagonal in precision.diagonal.items():
            parts.append((jacobians[name] * diagonal.rsqrt()).reshape(*lead, -1))
        return torch.cat(parts, dim=-1)
    flat = treated.flatten(jacobians, batch_dims=2)
    if isinstance(precision, FlatPrecision):
        return precision.factor(flat)
    if isinstance(precision, dict):
        return flat * treated.flatten(precision).rsqrt()
    assert cholesky is not None
    # One solve with C*O right-hand sides (a batched solve would copy L per input).
    rows = flat.reshape(-1, flat.shape[-1])
    solved = solve_triangular(cholesky, rows.T, upper=False)  # in the factor's dtype
    return solved.T.reshape(flat.shape)


def last_layer_inputs(
    model: nn.Module, treated: Treated, mean: dict[str, Tensor], x: Tensor
) -> tuple[Tensor, HeadInput | None]:
    """The outputs at the mean, and the last layer's input where the identity holds.

    The second is None unless the treated weights are one ``nn.Linear``'s whose output
    is the model's (:mod:`._last_layer`); one forward either way.
    """
    head = find_head(model, treated)
    if head is None:
        return cast(Tensor, functional_call(model, mean, (x,))), None
    return head_features(model, head, mean, x)


def last_layer_covariance(
    inputs: HeadInput, treated: Treated, precision: Structure, temperature: float
) -> OutputCovariance | None:
    r"""The factored :math:`T J\Lambda^{-1}J^\top` of a last layer; None for ``"dense"``."""
    structure = precision.woodbury() if isinstance(precision, FlatPrecision) else precision
    return head_covariance(inputs, treated, structure, temperature)


def _center_and_rows(
    model: nn.Module,
    treated: Treated,
    mean: dict[str, Tensor],
    precision: Structure,
    temperature: float,
    x: Tensor,
) -> tuple[Tensor, OutputCovariance | None]:
    center, inputs = last_layer_inputs(model, treated, mean, x)
    if center.dim() < 1 or center.shape[0] != x.shape[0]:
        raise ValueError(
            f"Invalid x: shape {tuple(x.shape)} gives outputs of shape "
            f"{tuple(center.shape)} (expected a batch of inputs, the batch first in both)"
        )
    if inputs is None:
        return center, None
    return center, last_layer_covariance(inputs, treated, precision, temperature)


def function_space_gaussian(
    model: nn.Module,
    treated: Treated,
    mean: dict[str, Tensor],
    precision: Structure,
    cholesky: Tensor | None,
    temperature: float,
    x: Tensor,
    chunk_size: int | None,
    per_position: bool = False,
    diagonal: bool = False,
) -> FunctionSpaceGaussian:
    r""":math:`\big(f(x;\mu),\; T J\Lambda^{-1}J^\top\big)` for a batch, chunk by chunk.

    The model runs as it is (call it in eval mode: one input at a time must give the
    same outputs as the batch); the result is detached. ``per_position``, for outputs
    ``(B, *positions, K)`` with positions: only the K x K block of each position, the
    covariance ``(B, *positions, K, K)`` (the diagonal blocks of the joint ``(B, O, O)``,
    in :math:`B\cdot O\cdot K` numbers instead of :math:`B\cdot O^2`). ``diagonal``:
    only the marginal variances, ``(B, *out)`` (:math:`O\cdot P` per input from the
    Jacobian route instead of :math:`O^2P`). A last layer (:mod:`._last_layer`) takes
    the Kronecker identity instead of the Jacobian, except for the joint covariance of
    outputs with positions.

    Raises:
        ValueError: an input without a batch dimension, or one input's Jacobian cannot
            fit in memory.
    """
    with torch.no_grad():
        center, rows = _center_and_rows(model, treated, mean, precision, temperature, x)
        if rows is not None and (diagonal or per_position or center.dim() <= 2):
            return FunctionSpaceGaussian(center, rows.diagonal() if diagonal else rows.dense())
        return _jacobian_gaussian(
            model,
            treated,
            mean,
            (precision, cholesky),
            temperature,
            x,
            chunk_size,
            center,
            per_position,
            diagonal,
        )


def output_gaussian(
    model: nn.Module,
    treated: Treated,
    mean: dict[str, Tensor],
    precision: Structure,
    cholesky: Tensor | None,
    temperature: float,
    x: Tensor,
    chunk_size: int | None,
) -> FunctionSpaceGaussian | FactoredGaussian:
    """What the GLM predictive reads: a last layer's factored Gaussian, else per position.

    :func:`function_space_gaussian` with ``per_position=True`` where the last-layer
    identity (:mod:`._last_layer`) does not apply.
    """
    with torch.no_grad():
        center, rows = _center_and_rows(model, treated, mean, precision, temperature, x)
        if rows is not None:
            return FactoredGaussian(center, rows)
        return _jacobian_gaussian(
            model,
            treated,
            mean,
            (precision, cholesky),
            temperature,
            x,
            chunk_size,
            center,
            True,
            False,
        )


def _jacobian_gaussian(
    model: nn.Module,
    treated: Treated,
    mean: dict[str, Tensor],
    fitted: tuple[Structure, Tensor | None],
    temperature: float,
    x: Tensor,
    chunk_size: int | None,
    center: Tensor,
    per_position: bool,
    diagonal: bool,
) -> FunctionSpaceGaussian:
    """The Jacobian route of :func:`function_space_gaussian`, from the outputs ``center``."""
    batch, outputs = center.shape[0], center[0].numel()
    blocks = per_position and center.dim() > 2 and not diagonal
    width = center.shape[-1]
    if diagonal:
        covariance = center.new_empty(batch, outputs)
    elif blocks:
        covariance = center.new_empty(batch, outputs // width, width, width)
    else:
        covariance = center.new_empty(batch, outputs, outputs)
    chunks = input_chunks(batch, outputs, treated.numel, center.dtype, center.device, chunk_size)
    for part in chunks:
        jacobians = output_jacobians(model, mean, x[part])
        factor = covariance_factor(jacobians, treated, *fitted)
        del jacobians
        if diagonal:
            covariance[part] = temperature * factor.square().sum(-1)
            continue
        if blocks:
            factor = factor.reshape(factor.shape[0], -1, width, factor.shape[-1])
        covariance[part] = temperature * (factor @ factor.mT)
    if diagonal:
        covariance = covariance.reshape(center.shape)
    elif blocks:
        covariance = covariance.reshape(*center.shape, width)
    return FunctionSpaceGaussian(center, covariance)
