r"""The fit of ``structure="lowrank"``: top eigenpairs of the curvature, matrix-free.

The curvature of the treated parameters over the n examples of a loader, scaled to N,

.. math::

    C = \frac Nn\sum_{i=1}^n J_i^\top V_iV_i^\top J_i,

(:math:`V_iV_i^\top = H_i`, the GGN; :math:`V_i = \nabla_f\ell_i`, the empirical Fisher;
:func:`~samplers_as_optim.gaussian.likelihoods.factor_blocks`, one block per position for
outputs with positions, the block-diagonal V never formed) is applied to a
block of b vectors at once, :math:`CX`, one pass over the loader per block: per batch, b
forward-mode products :math:`J X` (``vmap`` of ``torch.func.jvp``), the output-space
product with :math:`V_iV_i^\top`, and b reverse-mode products (``vmap`` of one ``vjp``)
— the products of :mod:`samplers_as_optim.curvature`, vectorised over the block.

**The eigensolver** (:func:`top_eigenpairs`) is a block Krylov method with
Rayleigh-Ritz and thick restarts (block Lanczos with full reorthogonalisation; Golub &
Van Loan 2013, §10.3; Musco & Musco 2015): an orthonormal basis Q of the Krylov space
and CQ are kept; after each pass the Ritz pairs :math:`(\theta_i, v_i)` of
:math:`Q^\top CQ` (no further product needed) are formed, and the next block is the
residuals :math:`Cv_i - \theta_iv_i` of the top b Ritz vectors, orthogonalised twice
against Q (their span is the next Krylov block). When the basis would outgrow
``4 b`` vectors it restarts from the top Ritz vectors (whose products are exact linear
combinations of CQ, so no pass is lost). It stops when the k wanted pairs have residuals
:math:`\lVert Cv_i - \theta_iv_i\rVert \le \sqrt{\varepsilon}\,\theta_1` (ε the dtype's
machine epsilon; then each eigenvalue is within :math:`\lVert r\rVert^2/\text{gap}` and
:math:`\theta_1\sqrt\varepsilon` of an exact one), when the basis spans all P directions
(exact), or after ``_MAX_PASSES`` passes (a ``RuntimeWarning`` then names the residual;
the precision is still exact for the pairs found). The first block's product shares the
first pass with the exact diagonal and the log-likelihood; the start is random from a
generator seeded 0, so a fit is reproducible and leaves torch's global RNG alone.

**k**: ``rank`` an integer, or a fraction f in (0, 1) of the trace: the smallest k with
:math:`\sum_{i\le k}\theta_i \ge f\,\mathrm{tr}(C)`, :math:`\mathrm{tr}(C)` exact from
the diagonal pass; Ritz values sum to at most the true top-k sum (Ky Fan), so a k found
from converged Ritz values is the one of the exact spectrum.

References:
    Golub & Van Loan (2013), Matrix Computations, 4th ed., §10.3 (block Lanczos).
    Musco & Musco (2015), Randomized block Krylov methods for stronger and faster
    approximate singular value decomposition. NeurIPS.
    Stathopoulos & Saad (1998), Restarting techniques for the (Jacobi-)Davidson
    symmetric eigenvalue methods (thick restart).
"""

from __future__ import annotations

import math
import numbers
import operator
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch
from torch import Tensor, nn
from torch.func import functional_call, jvp, vjp, vmap

from ...core.progress import progress_bar
from .._data_checks import check_finite_curvature, checked_forward
from .._per_example_curvature import diag_curvature
from .._weight_gaussian import batches_on
from .._wide_linalg import wide_dtype
from ..flat import Treated
from ..likelihoods import Classification, Likelihood, factor_blocks
from ._evidence import DataSums, FitTerms
from ._lowrank import LowRankCurvature

__all__ = ["DEFAULT_RANK", "Eigenpairs", "block_product", "check_rank", "fit_lowrank"]

#: eigenpairs kept by ``structure="lowrank"`` when ``rank`` is None (SWAG's default rank)
DEFAULT_RANK = 20
#: the most passes over the data a low-rank fit makes (the first included)
_MAX_PASSES = 40
#: extra Ritz vectors carried beside the k wanted (at least this many, or k / 2)
_OVERSAMPLE = 10
#: bytes of the vectorised products held at once (as the dense path's chunks)
_CHUNK_BYTES = 2**27


def check_rank(rank: Any, structure: str, size: int) -> int | float | None:
    """``rank``: None, eigenpairs in [1, P] or a fraction in (0, 1); lowrank only.

    Returns None for the other structures, and ``min(P, DEFAULT_RANK)`` for None.

    Raises:
        TypeError: not a number (a bool included).
        ValueError: given with another structure, or outside the forms above.
    """
    if rank is None:
        return min(size, DEFAULT_RANK) if structure == "lowrank" else None
    if structure != "lowrank":
        raise ValueError(f"Invalid rank: {rank!r} (expected None unless structure='lowrank')")
    expected = (
        f"an integer in [1, {size}], the eigenpairs kept of the {size} treated parameters' "
        "curvature, or a fraction in (0, 1) of its trace"
    )
    if isinstance(rank, bool):
        raise TypeError(f"Invalid rank: {rank!r} (expected {expected})")
    if isinstance(rank, numbers.Integral):
        number = operator.index(rank)
        if not 1 <= number <= size:
            raise ValueError(f"Invalid rank: {rank!r} (expected {expected})")
        return number
    if isinstance(rank, numbers.Real):
        fraction = float(rank)
        if not 0.0 < fraction < 1.0:
            raise ValueError(f"Invalid rank: {rank!r} (expected {expected})")
        return fraction
    raise TypeError(f"Invalid rank: {rank!r} (expected {expected})")


def _output_product(
    likelihood: Likelihood, kind: str, output: Tensor, targets: Tensor
) -> Callable[[Tensor], Tensor]:
    r"""``u`` (the output's shape) :math:`\mapsto V V^\top u`, position by position, vmap-safe.

    The softmax GGN in closed form, :math:`p\odot(u - p^\top u)` per position (O(C), not
    the O(C²) of its factor: a language model's vocabulary); otherwise the factor's blocks
    :func:`~samplers_as_optim.gaussian.likelihoods.factor_blocks`, computed once.
    """
    if kind == "ggn" and isinstance(likelihood, Classification):
        probs = output.detach().softmax(dim=-1)
        mask = likelihood.position_mask(output, targets)
        weight = probs if mask is None else probs * mask.unsqueeze(-1).to(probs.dtype)

        def softmax_product(u: Tensor) -> Tensor:
            u = u.reshape(probs.shape).to(probs.dtype)
            return weight * (u - (probs * u).sum(-1, keepdim=True))

        return softmax_product
    blocks = factor_blocks(likelihood, kind, output, targets)  # (B, T, O_t, K): V per position

    def factor_product(u: Tensor) -> Tensor:
        u = u.reshape(blocks.shape[:3])
        return torch.einsum("btok,btk->bto", blocks, torch.einsum("btok,bto->btk", blocks, u))

    return factor_product


def block_product(
    model: nn.Module,
    treated: Treated,
    likelihood: Likelihood,
    kind: str,
    inputs: Tensor,
    targets: Tensor,
    block: Tensor,
) -> Tensor:
    r"""The batch's curvature times each row of ``block``: :math:`\sum_i J_i^\top V_iV_i^\top J_ix`.

    ``block`` is ``(b, P)`` (any float dtype; the products run in the parameters'
    dtype); the result has its dtype. The batch is checked as every curvature pass
    checks it (:func:`~samplers_as_optim.gaussian._data_checks.checked_forward`). Run
    the model in eval mode.
    """
    current = dict(model.named_parameters())
    params = {name: current[name].detach() for name in treated.names}
    dtype = params[treated.names[0]].dtype
    with torch.no_grad():
        output = checked_forward(model, inputs, targets, likelihood)
    output_product = _output_product(likelihood, kind, output, targets)

    def forward(p: dict[str, Tensor]) -> Tensor:
        return cast(Tensor, functional_call(model, p, (inputs,)))

    def tangent(vector: dict[str, Tensor]) -> Tensor:
        return cast(Tensor, jvp(forward, (params,), (vector,))[1])

    with torch.no_grad():
        _, pullback = vjp(forward, params)  # type: ignore[misc]

        def apply(vector: dict[str, Tensor]) -> dict[str, Tensor]:
            hu = output_product(tangent(vector))
            return cast(dict[str, Tensor], pullback(hu.reshape(output.shape))[0])

        per_vector = (output.numel() + treated.numel) * output.element_size()
        chunk = max(1, _CHUNK_BYTES // max(per_vector, 1))
        vectors = treated.unflatten(block.to(dtype))
        result = vmap(apply, chunk_size=chunk)(vectors)
    return treated.flatten(result, batch_dims=1).to(block.dtype)


@dataclass
class Eigenpairs:
    """The top eigenpairs found by :func:`top_eigenpairs`.

    Attributes:
        values: ``(k,)`` Ritz values, descending, clipped at 0.
        vectors: ``(k, P)`` orthonormal Ritz vectors (rows).
        residuals: ``(k,)`` their residual norms.
        products: the block products made after the start's (passes over the data).
        converged: every wanted pair met the tolerance (or the basis spanned everything).
    """

    values: Tensor
    vectors: Tensor
    residuals: Tensor
    products: int
    converged: bool


def _orthonormal_rows(candidates: Tensor, basis: Tensor, generator: torch.Generator) -> Tensor:
    """``candidates`` orthonormalised against ``basis`` and each other (both as rows).

    Two projections against the basis (classical Gram-Schmidt, twice), then a QR; a row
    that this reduces below ``sqrt(eps)`` of its norm (it lay in the span) is replaced by
    a random one and the step repeated.
    """
    tol = torch.finfo(candidates.dtype).eps ** 0.5
    tiny = torch.finfo(candidates.dtype).tiny
    rows = candidates
    for _ in range(8):
        before = rows.norm(dim=1).clamp(min=tiny)
        for _ in range(2):
            if basis.shape[0]:
                rows = rows - (rows @ basis.T) @ basis
        q: Tensor
        q, r = torch.linalg.qr(rows.T)
        weak = r.diagonal().abs() <= tol * before
        if not bool(weak.any()):
            return q.T
        fresh = torch.randn(
            int(weak.sum()),
            rows.shape[1],
            generator=generator,
            dtype=rows.dtype,
            device=rows.device,
        )
        rows = torch.cat([q.T[~weak], fresh])
    raise RuntimeError("the low-rank eigensolver could not extend its basis")  # pragma: no cover


def _wanted(values: Tensor, rank: int | float, trace: float) -> int | None:
    """k: ``rank``, or the fewest leading values holding its fraction of ``trace`` (or None)."""
    if isinstance(rank, int):
        return rank
    if trace <= 0:
        return 1
    reached = (values.clamp(min=0.0).cumsum(0) >= rank * trace).nonzero()
    return int(reached[0, 0]) + 1 if reached.numel() else None


def _ritz(basis: Tensor, products: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Ritz values (descending), vectors and their products from Q and CQ (rows)."""
    projected = basis @ products.T
    values, coefficients = torch.linalg.eigh(0.5 * (projected + projected.T))
    values, coefficients = values.flip(0), coefficients.flip(1)
    return values, coefficients.T @ basis, coefficients.T @ products


def _block_width(size: int, count: int, wanted: int | None) -> int:
    """b: the k wanted plus oversampling (while a fraction is unmet, the basis so far)."""
    k = wanted if wanted is not None else count
    return min(size, k + max(_OVERSAMPLE, k // 2))


def top_eigenpairs(
    product: Callable[[Tensor], Tensor],
    start: Tensor,
    start_product: Tensor,
    rank: int | float,
    trace: float,
    generator: torch.Generator,
    max_products: int,
) -> Eigenpairs:
    r"""The top eigenpairs of a symmetric PSD operator by block Krylov with restarts.

    See the module docstring. ``product`` maps ``(b, P)`` rows to their products;
    ``start`` ``(b, P)`` are orthonormal rows whose products are ``start_product``;
    ``rank`` is k or a fraction of ``trace``; at most ``max_products`` more products.
    """
    size = start.shape[1]
    tol = torch.finfo(start.dtype).eps ** 0.5
    basis, products, made = start, start_product, 0
    while True:
        values, vectors, applied = _ritz(basis, products)
        residual_rows = applied - values.unsqueeze(-1) * vectors
        residuals = residual_rows.norm(dim=1)
        count = basis.shape[0]
        wanted = _wanted(values, rank, trace)
        top = float(values[0].clamp(min=0.0))
        converged = count == size or (
            wanted is not None and bool((residuals[:wanted] <= tol * top).all())
        )
        if converged or made >= max_products:
            k = min(count, wanted if wanted is not None else count)
            # copies: slices would keep the whole basis's storage alive
            values, vectors = values[:k].clamp(min=0.0), vectors[:k].clone()
            return Eigenpairs(values, vectors, residuals[:k].clone(), made, converged)
        width = _block_width(size, count, wanted)
        if count + width > 4 * width:  # thick restart from the top 2b Ritz pairs
            count = 2 * width
            basis, products = vectors[:count], applied[:count]
        else:
            basis, products = vectors, applied
        candidates = residual_rows[: min(width, size - count)]
        missing = min(width, size - count) - candidates.shape[0]
        if missing > 0:
            extra = torch.randn(
                missing, size, generator=generator, dtype=start.dtype, device=start.device
            )
            candidates = torch.cat([candidates, extra])
        fresh = _orthonormal_rows(candidates, basis, generator)
        basis = torch.cat([basis, fresh])
        products = torch.cat([products, product(fresh)])
        made += 1


class _Passes:
    """Passes over a loader that must yield the same n examples each time."""

    def __init__(
        self,
        model: nn.Module,
        treated: Treated,
        likelihood: Likelihood,
        kind: str,
        loader: Iterable[Any],
        progress: bool | None,
    ) -> None:
        if isinstance(loader, Iterator):
            raise TypeError(
                f"Invalid loader: {type(loader).__name__}, an iterator (expected a loader that "
                "can be iterated again, e.g. a DataLoader or a list of batches: "
                "structure='lowrank' passes over the data several times)"
            )
        self.model, self.treated, self.likelihood, self.kind = model, treated, likelihood, kind
        self.loader, self.progress = loader, progress
        self.device = dict(model.named_parameters())[treated.names[0]].device
        self.seen = 0
        self.scale = 1.0
        self.count = 0

    def batches(self) -> Iterator[tuple[Tensor, Tensor]]:
        """One pass's batches on the device (a bar per pass where ``progress`` asks)."""
        self.count += 1
        label = "Laplace.fit" if self.count == 1 else f"Laplace.fit (pass {self.count})"
        return batches_on(progress_bar(self.loader, self.progress, label), self.device)

    def product(self, block: Tensor) -> Tensor:
        """One pass: :math:`CX` for the rows X of ``block``, scaled to N examples."""
        total = torch.zeros_like(block)
        seen = 0
        for inputs, targets in self.batches():
            part = block_product(
                self.model, self.treated, self.likelihood, self.kind, inputs, targets, block
            )
            total += part
            seen += inputs.shape[0]
        if seen != self.seen:
            raise ValueError(
                f"Invalid loader: pass {self.count} yielded {seen} examples, the first "
                f"{self.seen} (expected the same examples in every pass, in any order: "
                "structure='lowrank' passes over the data several times)"
            )
        total = self.scale * total
        check_finite_curvature([total], total.dtype)
        return total


class _LowRankLaplace(Protocol):
    """What the fit reads of a ``Laplace(structure="lowrank")``."""

    model: nn.Module
    treated: Treated
    likelihood: Likelihood
    curvature: str
    num_data: int
    rank: int | float | None

    @property
    def noise_std(self) -> float | None: ...


def fit_lowrank(la: _LowRankLaplace, loader: Iterable[Any], progress: bool | None) -> FitTerms:
    """Fit :class:`~._lowrank.LowRankCurvature` over ``loader`` (run the model in eval mode).

    The first pass sums the exact diagonal, the data term and the start block's
    product; each later pass one block product (:func:`top_eigenpairs`).

    Raises:
        TypeError: ``loader`` is an iterator (it cannot be passed over again).
        ValueError: as ``Laplace.fit``; a later pass that sees another number of
            examples than the first.
    """
    model, treated, likelihood, kind = la.model, la.treated, la.likelihood, la.curvature
    rank = la.rank
    assert rank is not None
    passes = _Passes(model, treated, likelihood, kind, loader, progress)
    ref = dict(model.named_parameters())[treated.names[0]]
    wide = wide_dtype(ref.dtype)
    size = treated.numel
    generator = torch.Generator(device=ref.device).manual_seed(0)
    width = _block_width(size, 0, rank if isinstance(rank, int) else DEFAULT_RANK)
    noise = torch.randn(width, size, generator=generator, dtype=wide, device=ref.device)
    start = _orthonormal_rows(noise, noise.new_zeros(0, size), generator)
    diagonal = {name: torch.zeros_like(value) for name, value in treated.current(model).items()}
    start_product = torch.zeros_like(start)
    data = DataSums()
    for inputs, targets in passes.batches():
        part = diag_curvature(model, treated, inputs, targets, likelihood, kind)
        for name in treated.names:
            diagonal[name] += part[name]
        start_product += block_product(model, treated, likelihood, kind, inputs, targets, start)
        data.add(model, likelihood, inputs, targets)
    passes.scale = scale = data.scale(la.num_data)
    passes.seen = data.seen
    exact = scale * treated.flatten(diagonal).to(wide)
    start_product = scale * start_product
    check_finite_curvature([exact, start_product], ref.dtype)
    trace = float(exact.sum())
    pairs = top_eigenpairs(
        passes.product, start, start_product, rank, trace, generator, _MAX_PASSES - 1
    )
    if not pairs.converged:
        warnings.warn(_not_converged(pairs, rank), RuntimeWarning, stacklevel=4)
    rest = exact - pairs.vectors.square().T @ pairs.values
    curvature = LowRankCurvature(
        eigenvalues=pairs.values,
        eigenvectors=pairs.vectors,
        diagonal=rest.clamp(min=0.0),
        trace=exact.sum(),
        residuals=pairs.residuals,
        passes=1 + pairs.products,
    )
    return data.terms(curvature, scale, la.noise_std, kind)


def _not_converged(pairs: Eigenpairs, rank: int | float) -> str:
    top = float(pairs.values[0]) if pairs.values.numel() else 0.0
    worst = float(pairs.residuals.max()) if pairs.residuals.numel() else 0.0
    wanted = f"rank={rank!r}" if isinstance(rank, int) else f"the fraction rank={rank!r}"
    return (
        f"Laplace.fit(structure='lowrank'): the top {pairs.values.numel()} eigenpairs of "
        f"the curvature ({wanted}) did not converge in {1 + pairs.products} passes over "
        f"the data (largest residual {worst:.3g}, {worst / top if top else math.inf:.3g} of "
        "the largest eigenvalue); the precision is exact for these Ritz pairs but they are "
        "not the top eigenpairs to round-off"
    )
