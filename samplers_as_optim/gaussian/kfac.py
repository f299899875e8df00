r"""Kronecker-factored curvature (KFAC) of ``nn.Linear`` and ``nn.Conv2d`` layers.

For a layer :math:`z = \tilde W \tilde a` with :math:`\tilde W = [W, b]` (out x (in+1))
and the input augmented with a 1, :math:`\tilde a = [a; 1]` (Martens & Grosse 2015, §3:
the bias lives inside the Kronecker factor), the per-example pseudo-gradients of the
curvature (see :mod:`._curvature`) are :math:`g_{ik}\tilde a_i^\top` with
:math:`g_{ik} = \partial(f_i\cdot v_{ik})/\partial z_i`, so the layer's block of
:math:`\sum_i C_i` is, in the row-major order of :math:`\mathrm{vec}(\tilde W)`,

.. math::

    \sum_i \Big(\sum_k g_{ik}g_{ik}^\top\Big)\otimes\tilde a_i\tilde a_i^\top
    \;\approx\; \underbrace{\sum_{i,k} g_{ik}g_{ik}^\top}_{G}\;\otimes\;
    \underbrace{\frac1n\sum_i\tilde a_i\tilde a_i^\top}_{A},

the K-FAC "expectation of a product ≈ product of expectations" (Martens & Grosse 2015,
eq. 1-2; Ritter, Botev & Barber 2018 for the Laplace approximation). It is exact when
the sum has one term (n = 1), or when :math:`\sum_k g_{ik}g_{ik}^\top` does not depend on
i (a linear-Gaussian last layer). ``"ggn"`` uses the K columns of the output-Hessian
factor, ``"ef"`` the one column :math:`\nabla_f\ell_i` (one per output position).

**Weight sharing: KFAC-expand.** A convolution, and a Linear layer applied to inputs
with more than a batch dimension (a transformer's ``(batch, sequence, features)``),
shares its weight over the layer's T positions. This module implements **KFAC-expand**
(Eschenhagen et al. 2023, §3, "the expand setting"; for convolutions Grosse & Martens
2016): the positions are treated as extra examples,

.. math::

    G = \sum_{i}\sum_{c}\sum_{t=1}^{T} g_{ict}g_{ict}^\top, \qquad
    A = \frac{1}{nT}\sum_{i}\sum_{t=1}^{T}\tilde u_{it}\tilde u_{it}^\top,

with :math:`u_{it}` the layer's input at position t (a convolution's unfolded patch) and
:math:`g_{ict} = \partial(f_i\cdot v_{ic})/\partial z_{it}` for every column c of the
likelihood's factor. For a model output with positions, ``(batch, *positions,
classes)``, the factor is block diagonal with one block per output position s
(:mod:`~samplers_as_optim.gaussian.likelihoods`), c = (s, k): then where the network
after the layer acts on each position alone (:math:`g_{i(s,k)t} = 0` for s ≠ t) this is
exactly the KFAC of the same data with the positions flattened into the batch, the
setting in which Eschenhagen et al. show KFAC-expand exact for deep linear networks; a
network that mixes positions (attention) keeps its cross-position terms in G through
:math:`g_{i(s,k)t}`, s ≠ t, and the expand approximation drops only the products of
different positions t ≠ t' of the layer. With ``ignore_index`` the ignored positions'
columns are zero, and A averages over the rows of the kept positions only (for a Linear
layer whose input is laid out like the targets, ``(batch, *positions, in)``; another
layer keeps the rows of every example with a kept position), so padding changes
nothing. (KFAC-reduce, which sums the positions before the outer products, is not
implemented.) Memory: :math:`O(\sum_\ell d_\text{in}^2 + d_\text{out}^2)`.

**The damped inverse by eigendecomposition** (Martens & Grosse 2015, App. B; George et
al. 2018). With :math:`G = Q_G\,\mathrm{diag}(\lambda_G)Q_G^\top` and :math:`A =
Q_A\,\mathrm{diag}(\lambda_A)Q_A^\top`, the layer's posterior precision
:math:`\Lambda = \delta I + s\,G\otimes A` (δ the prior precision, s = N/n) is
exactly :math:`(Q_G\otimes Q_A)\,\mathrm{diag}(D)\,(Q_G\otimes Q_A)^\top` with
:math:`D_{ab} = \delta + s\,\lambda_{G,a}\lambda_{A,b}`. So, with :math:`\Delta` the
out x (in+1) deviation from the mean,

* :math:`\mathrm{vec}(\Delta)^\top\Lambda\,\mathrm{vec}(\Delta) = \sum_{ab} D_{ab}
  (Q_G^\top\Delta Q_A)_{ab}^2`, :math:`\log\det\Lambda = \sum_{ab}\log D_{ab}`;
* a draw is :math:`\Delta = \sqrt T\,Q_G\,(Z \oslash \sqrt D)\,Q_A^\top`, Z standard
  normal (a square root of :math:`T\Lambda^{-1}`, no approximation);
* the marginal variances are :math:`T\,(Q_G\circ Q_G)\,D^{-1}(Q_A\circ Q_A)^\top`.

Treated parameters outside such layers (normalisation layers, embeddings, a layer
called twice, shared weights) get a diagonal block, computed as ``structure="diag"``.

References:
    Martens & Grosse (2015), Optimizing neural networks with Kronecker-factored
    approximate curvature. ICML.
    Grosse & Martens (2016), A Kronecker-factored approximate Fisher matrix for
    convolution layers. ICML.
    Ritter, Botev & Barber (2018), A scalable Laplace approximation for neural networks.
    ICLR.
    George et al. (2018), Fast approximate natural gradient descent in a
    Kronecker-factored eigenbasis. NeurIPS.
    Eschenhagen et al. (2023), Kronecker-factored approximate curvature for modern
    neural network architectures. NeurIPS.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ._data_checks import check_finite_curvature, checked_forward
from ._per_example_curvature import (
    capture_layer_io,
    diag_curvature,
    fast_layers,
    layer_grad_chunks,
    recorded_input,
    unfold_input,
)
from ._wide_linalg import eigh
from .flat import Treated
from .likelihoods import Likelihood, factor_blocks

__all__ = ["KronBlock", "KronCurvature", "KronPrecision", "decompose_curvature", "kron_curvature"]


@dataclass
class KronSums:
    """Running sums of one layer's factors over a pass: G, the sum of A, and its rows."""

    weight: str | None
    bias: str | None
    g: Tensor
    a: Tensor
    rows: int


def _input_rows(module: nn.Module, inp: Tensor) -> Tensor:
    """The layer's inputs as rows (n*T, in): unfolded patches for a convolution."""
    if isinstance(module, nn.Conv2d):
        unfolded = unfold_input(module, inp)  # (B, C*kh*kw, L)
        return unfolded.transpose(1, 2).reshape(-1, unfolded.shape[1])
    return inp.detach().reshape(-1, inp.shape[-1])


def _augmented_gram(rows: Tensor, with_weight: bool, with_bias: bool) -> Tensor:
    r""":math:`\sum \tilde u\tilde u^\top` for :math:`\tilde u = [u; 1]` without forming it."""
    count = rows.shape[0]
    if not with_bias:
        return rows.T @ rows
    if not with_weight:
        return rows.new_full((1, 1), float(count))
    width = rows.shape[1]
    gram = rows.new_empty(width + 1, width + 1)
    torch.mm(rows.T, rows, out=gram[:width, :width])
    sums = rows.sum(0)
    gram[:width, width] = sums
    gram[width, :width] = sums
    gram[width, width] = count
    return gram


def _output_grads(module: nn.Module, grad: Tensor) -> Tensor:
    """(K, B, out, ...) or (K, B, ..., out) output gradients as rows (K*B*T, out)."""
    if isinstance(module, nn.Conv2d):
        k, batch, channels = grad.shape[:3]
        return grad.reshape(k, batch, channels, -1).transpose(2, 3).reshape(-1, channels)
    return grad.reshape(-1, grad.shape[-1])


def _kept_rows(module: nn.Module, inp: Tensor, mask: Tensor, count: int) -> Tensor:
    """Which of a layer's ``count`` input rows :math:`A` averages, given the targets' mask.

    ``mask`` is ``(B, *positions)``, False where the target is ignored. A Linear layer
    whose input is laid out like the targets, ``(B, *positions, in)``, keeps the rows of
    the kept positions; any other layer keeps the rows of the examples with at least one
    kept position (rows are example-major).
    """
    if isinstance(module, nn.Linear) and inp.shape[:-1] == mask.shape:
        return mask.reshape(-1)
    examples = mask.reshape(mask.shape[0], -1).any(-1)
    return examples.repeat_interleave(count // mask.shape[0])


def _kron_usable(module: nn.Module, calls: list[tuple[object, int, Tensor]], batch: int) -> bool:
    inp = recorded_input(calls, batch)
    if inp is None:
        return False
    return inp.dim() == 4 if isinstance(module, nn.Conv2d) else inp.dim() >= 2


def kron_layers(model: nn.Module, treated: Treated) -> dict[nn.Module, dict[str, str]]:
    """The Linear/Conv2d layers whose treated parameters get a Kronecker block."""
    return fast_layers(model, treated.names)


def kron_curvature(
    model: nn.Module,
    treated: Treated,
    layers: dict[nn.Module, dict[str, str]],
    x: Tensor,
    target: Tensor,
    likelihood: Likelihood,
    kind: str,
) -> tuple[list[KronSums], dict[str, Tensor]]:
    r"""One batch's KFAC sums for ``layers`` and the diagonal for the other treated names.

    Returns:
        For each layer (in the order of ``layers``), :math:`\sum g g^\top` (out x out),
        :math:`\sum\tilde u\tilde u^\top` and the number of rows (examples x positions) in
        it; and name -> summed diagonal curvature for the treated parameters outside
        ``layers``.

    Raises:
        ValueError: a layer is called more than once per forward, or on an input without
            the batch first (its Kronecker factors would be wrong); the batch's inputs,
            targets or model outputs hold NaN or inf, or the likelihood refuses its targets.
    """
    batch = x.shape[0]
    with capture_layer_io(layers) as records, torch.set_grad_enabled(bool(layers)):
        output = checked_forward(model, x, target, likelihood)
    blocks = factor_blocks(likelihood, kind, output.detach(), target)
    names = {module: name for name, module in model.named_modules()}
    for module in layers:
        if not _kron_usable(module, records.get(module, []), batch):
            calls = len(records.get(module, []))
            raise ValueError(
                f"Invalid model for structure='kron': layer {names[module]!r} "
                f"({type(module).__name__}) ran {calls} time(s) in one forward (expected "
                "exactly once, on an input with the batch first, unchanged in place)"
            )
    outputs = [records[module][0][2] for module in layers]
    mask = likelihood.position_mask(output, target)
    # G summed over the factor's columns, a chunk at a time (one chunk without positions);
    # no layer (a subset of, say, normalisation weights only): nothing to differentiate.
    g_sums: list[Tensor] = []
    for grads in layer_grad_chunks(output, blocks, outputs):
        for index, (module, grad) in enumerate(zip(layers, grads, strict=True)):
            rows_g = _output_grads(module, grad.detach())
            if index == len(g_sums):
                g_sums.append(rows_g.T @ rows_g)
            else:
                g_sums[index] = g_sums[index] + rows_g.T @ rows_g
    sums = []
    for (module, entries), g_sum in zip(layers.items(), g_sums, strict=True):
        rows_a = _input_rows(module, records[module][0][0])
        if mask is not None:
            rows_a = rows_a[_kept_rows(module, records[module][0][0], mask, rows_a.shape[0])]
        sums.append(
            KronSums(
                entries.get("weight"),
                entries.get("bias"),
                g_sum,
                _augmented_gram(rows_a, "weight" in entries, "bias" in entries),
                rows_a.shape[0],
            )
        )
    del records, output
    covered = {name for entries in layers.values() for name in entries.values()}
    rest = [name for name in treated.names if name not in covered]
    diag: dict[str, Tensor] = {}
    if rest:
        shapes = dict(zip(treated.names, treated.shapes, strict=True))
        sub = Treated(tuple(rest), tuple(shapes[name] for name in rest))
        diag = diag_curvature(model, sub, x, target, likelihood, kind)
    return sums, diag


@dataclass
class KronBlock:
    r"""One layer's precision over :math:`\tilde W = [W, b]`, by its eigendecomposition.

    :math:`\delta I + (Q_G\otimes Q_A)\mathrm{diag}(s\lambda_G\otimes\lambda_A)
    (Q_G\otimes Q_A)^\top`.

    Attributes:
        weight: the weight's parameter name (None if the weight is not treated).
        bias: the bias's parameter name (None if absent or not treated).
        out_features: rows of :math:`\tilde W`.
        in_features: columns of the weight part (0 without weight).
        g_eigenvalues, g_eigenvectors: eigendecomposition of :math:`sG`.
        a_eigenvalues, a_eigenvectors: eigendecomposition of A.
        prior: δ, the layer's prior precision (one number for its weight and bias).
    """

    weight: str | None
    bias: str | None
    out_features: int
    in_features: int
    g_eigenvalues: Tensor
    g_eigenvectors: Tensor
    a_eigenvalues: Tensor
    a_eigenvectors: Tensor
    prior: float

    @property
    def eigenvalues(self) -> Tensor:
        """D: (out, in[+1]) eigenvalues of the block's precision."""
        return self.prior + torch.outer(self.g_eigenvalues, self.a_eigenvalues)

    def matrix(self, params: Mapping[str, Tensor], batch_dims: int) -> Tensor:
        r""":math:`\tilde W` (..., out, in[+1]) from a dict of (optionally stacked) tensors."""
        parts = []
        if self.weight is not None:
            weight = params[self.weight]
            lead = weight.shape[:batch_dims]
            parts.append(weight.reshape(*lead, self.out_features, self.in_features))
        if self.bias is not None:
            parts.append(params[self.bias].unsqueeze(-1))
        return torch.cat(parts, dim=-1)

    def split(self, matrix: Tensor, shapes: Mapping[str, torch.Size]) -> dict[str, Tensor]:
        r"""The inverse of :meth:`matrix`: name -> ``(..., *shape)``."""
        lead = matrix.shape[:-2]
        out = {}
        if self.weight is not None:
            out[self.weight] = matrix[..., : self.in_features].reshape(*lead, *shapes[self.weight])
        if self.bias is not None:
            out[self.bias] = matrix[..., -1]
        return out

    def dense(self) -> Tensor:
        """The block's precision as a dense matrix over row-major vec(W~)."""
        q = torch.kron(self.g_eigenvectors, self.a_eigenvectors)
        return (q * self.eigenvalues.reshape(-1)) @ q.T


class KronPrecision:
    r"""A KFAC posterior precision: Kronecker blocks per layer and a diagonal for the rest.

    Returned by ``Laplace(..., structure="kron").precision``. It never forms the P x P
    matrix unless :meth:`dense` is asked for.

    Attributes:
        blocks: one :class:`KronBlock` per Linear/Conv2d layer.
        diagonal: name -> the precision diagonal of every treated parameter outside them.
    """

    def __init__(self, treated: Treated, blocks: list[KronBlock], diagonal: dict[str, Tensor]):
        self.treated = treated
        self.blocks = blocks
        self.diagonal = diagonal
        self._shapes = dict(zip(treated.names, treated.shapes, strict=True))

    def quadratic(self, delta: Mapping[str, Tensor], batch_dims: int) -> Tensor:
        r""":math:`\delta^\top\Lambda\delta` per sample for a dict of deviations."""
        total: Tensor | float = 0.0
        for block in self.blocks:
            rotated = (
                block.g_eigenvectors.T @ block.matrix(delta, batch_dims) @ block.a_eigenvectors
            )
            total = total + (rotated.square() * block.eigenvalues).sum((-2, -1))
        for name, diag in self.diagonal.items():
            value = delta[name]
            total = total + (value.square() * diag).reshape(*value.shape[:batch_dims], -1).sum(-1)
        assert isinstance(total, Tensor)
        return total

    def logdet(self) -> Tensor:
        r""":math:`\log\det\Lambda`."""
        parts = [block.eigenvalues.log().sum() for block in self.blocks]
        parts += [diag.log().sum() for diag in self.diagonal.values()]
        return torch.stack(parts).sum()

    def inverse_sqrt(self, noise: dict[str, Tensor]) -> dict[str, Tensor]:
        r""":math:`\Lambda^{-1/2}`-type transform of standard-normal draws (name -> (n, ...))."""
        out: dict[str, Tensor] = {}
        for block in self.blocks:
            z = block.matrix(noise, 1) * block.eigenvalues.rsqrt()
            out.update(block.split(block.g_eigenvectors @ z @ block.a_eigenvectors.T, self._shapes))
        for name, diag in self.diagonal.items():
            out[name] = noise[name] * diag.rsqrt()
        return out

    def variances(self) -> dict[str, Tensor]:
        r"""The diagonal of :math:`\Lambda^{-1}`: name -> tensor of the parameter's shape."""
        out: dict[str, Tensor] = {}
        for block in self.blocks:
            variance = (
                block.g_eigenvectors.square()
                @ block.eigenvalues.reciprocal()
                @ block.a_eigenvectors.square().T
            )
            out.update(block.split(variance, self._shapes))
        for name, diag in self.diagonal.items():
            out[name] = diag.reciprocal()
        return {name: out[name] for name in self.treated.names}

    def dense(self) -> Tensor:
        """The (P, P) precision in the flat order of the treated parameters (for tests)."""
        size = self.treated.numel
        reference = next(iter(self.blocks)).g_eigenvalues if self.blocks else None
        if reference is None:
            reference = next(iter(self.diagonal.values()))
        matrix = torch.zeros(size, size, dtype=reference.dtype, device=reference.device)
        offsets = dict(
            zip(
                self.treated.names,
                torch.tensor((0, *self.treated.sizes)).cumsum(0).tolist(),
                strict=False,
            )
        )
        for block in self.blocks:
            index = torch.arange(
                block.out_features * (block.in_features + (block.bias is not None))
            )
            grid = index.reshape(block.out_features, -1)
            positions = torch.empty_like(grid)
            if block.weight is not None:
                positions[:, : block.in_features] = offsets[block.weight] + torch.arange(
                    block.out_features * block.in_features
                ).reshape(block.out_features, block.in_features)
            if block.bias is not None:
                positions[:, -1] = offsets[block.bias] + torch.arange(block.out_features)
            flat = positions.reshape(-1).to(matrix.device)
            matrix[flat.unsqueeze(1), flat.unsqueeze(0)] = block.dense()
        for name, diag in self.diagonal.items():
            start = offsets[name]
            span = torch.arange(start, start + diag.numel(), device=matrix.device)
            matrix[span, span] = diag.reshape(-1)
        return matrix


@dataclass
class KronCurvature:
    r"""A pass's KFAC curvature without the prior, kept so the prior can change later.

    The blocks hold the factor eigendecompositions of :math:`sG` and :math:`A` with
    ``prior`` 0.0; ``diagonal`` is the summed diagonal curvature (times s) of the treated
    parameters outside the layers. :meth:`precision` adds a prior (one number per
    block) and scales the curvature (the regression noise, see
    :mod:`samplers_as_optim.gaussian.laplace._evidence`) without a new eigendecomposition.
    """

    treated: Treated
    blocks: list[KronBlock]
    diagonal: dict[str, Tensor]

    def precision(
        self,
        block_priors: list[float],
        diagonal_prior: Mapping[str, Tensor],
        curvature_scale: float = 1.0,
    ) -> KronPrecision:
        r""":math:`\Lambda` with prior :math:`\delta_\ell` per block, curvature times c.

        Block ℓ's eigenvalues become :math:`\delta_\ell + c\,\lambda_G\otimes\lambda_A`
        (c scales :math:`\lambda_G`); a diagonal parameter's precision is
        ``diagonal_prior[name] + c * diagonal[name]``.
        """
        blocks = [
            KronBlock(
                block.weight,
                block.bias,
                block.out_features,
                block.in_features,
                block.g_eigenvalues * curvature_scale,
                block.g_eigenvectors,
                block.a_eigenvalues,
                block.a_eigenvectors,
                float(prior),
            )
            for block, prior in zip(self.blocks, block_priors, strict=True)
        ]
        diagonal = {
            name: diagonal_prior[name] + curvature_scale * value
            for name, value in self.diagonal.items()
        }
        return KronPrecision(self.treated, blocks, diagonal)

    def logdet(
        self, block_priors: Tensor, diagonal_prior: Mapping[str, Tensor], curvature_scale: Tensor
    ) -> Tensor:
        r""":math:`\log\det\Lambda` of :meth:`precision`, differentiable in its arguments.

        .. math::

            \log\det\Lambda = \sum_\ell\sum_{ab}\log(\delta_\ell + c\,\lambda_{G,a}
            \lambda_{A,b}) + \sum_j \log(\delta_j + c\,d_j),

        exact for any positive per-block priors :math:`\delta_\ell` (a tensor, one per
        block) and curvature scale c (a 0-d tensor).
        """
        parts = [
            torch.log(
                block_priors[index]
                + curvature_scale * torch.outer(block.g_eigenvalues, block.a_eigenvalues)
            ).sum()
            for index, block in enumerate(self.blocks)
        ]
        parts += [
            torch.log(diagonal_prior[name] + curvature_scale * value).sum()
            for name, value in self.diagonal.items()
        ]
        return torch.stack(parts).sum()


def decompose_curvature(
    treated: Treated,
    sums: list[KronSums],
    diag: dict[str, Tensor],
    scale: float,
    shapes: Mapping[str, torch.Size],
) -> KronCurvature:
    """Eigendecompose the summed factors: G scaled by ``scale``, A the mean over rows.

    Raises:
        ValueError: a factor or the diagonal is not finite (overflow; see
            ``_data_checks.check_finite_curvature``), before any
            eigendecomposition fails on it.
    """
    factors = [
        (0.5 * (item.g + item.g.T) * scale, 0.5 * (item.a + item.a.T) / max(item.rows, 1))
        for item in sums
    ]
    diagonal = {name: scale * value for name, value in diag.items()}
    parts = [factor for pair in factors for factor in pair] + list(diagonal.values())
    if parts:
        check_finite_curvature(parts, parts[0].dtype)
    blocks = []
    for item, (g, a) in zip(sums, factors, strict=True):
        g_values, g_vectors = eigh(g)  # in float32 for a half-precision model
        a_values, a_vectors = eigh(a)
        out_features = g.shape[0]
        in_features = (
            math.prod(shapes[item.weight]) // out_features if item.weight is not None else 0
        )
        blocks.append(
            KronBlock(
                item.weight,
                item.bias,
                out_features,
                in_features,
                g_values.clamp(min=0.0),
                g_vectors,
                a_values.clamp(min=0.0),
                a_vectors,
                0.0,
            )
        )
    return KronCurvature(treated, blocks, diagonal)


def build_precision(
    treated: Treated,
    sums: list[KronSums],
    diag: dict[str, Tensor],
    scale: float,
    prior: float,
    shapes: Mapping[str, torch.Size],
) -> KronPrecision:
    """:func:`decompose_curvature`, then the precision for one prior on every weight."""
    curvature = decompose_curvature(treated, sums, diag, scale, shapes)
    priors = {name: torch.full_like(value, prior) for name, value in curvature.diagonal.items()}
    return curvature.precision([prior] * len(curvature.blocks), priors)
