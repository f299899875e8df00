r"""Curvature-vector products without forming the matrix, and conjugate gradients on them.

For a batch of n examples with outputs :math:`f_i = f(x_i;\theta)` (flattened to O
numbers), per-example losses :math:`\ell_i = -\log p(y_i\mid f_i)`, Jacobians
:math:`J_i = \partial f_i/\partial\theta` and output Hessians :math:`H_i =
\nabla_f^2\ell_i`:

.. math::

    \text{GGN}\,v = \sum_{i=1}^n J_i^\top H_i J_i\, v, \qquad
    \text{EF}\,v = \sum_{i=1}^n \nabla\ell_i\,(\nabla\ell_i^\top v).

:func:`ggn_vector_product` is one forward-mode product :math:`u = Jv` (``torch.func.jvp``
of the batch output), the output-space product :math:`H_i u_i = V_i(V_i^\top u_i)` with the
likelihood's Hessian factor (softmax: :math:`\mathrm{diag}(p)-pp^\top`; Gaussian:
:math:`I/\sigma^2`), and one reverse-mode product :math:`J^\top(Hu)` (``vjp``): the cost
of about two backward passes, memory of one. For the likelihoods here (exponential
families in their natural parameter) the GGN is the Fisher information (Martens 2020,
§9.2), so it is also the Fisher-vector product. :func:`fisher_vector_product` is the
*empirical* Fisher: :math:`G^\top(Gv)` with G the (n, P) matrix of per-example gradients,
computed as ``jvp`` then ``vjp`` of the vector of per-example losses, so G is never
formed either. Both are sums over the batch (not means): the curvature of the batch's
negative log-likelihood :math:`\sum_i\ell_i`; a posterior precision over N examples is
``prior * v + (N / n) * product``.

:func:`conjugate_gradient` solves :math:`Ax = b` for a symmetric positive-definite A given
only :math:`v\mapsto Av` (Hestenes & Stiefel 1952) — with the products above, a
Hessian-free (Martens 2010) Newton or natural-gradient step, or a posterior mean/variance
solve, in memory O(P).

Vectors are dicts name -> tensor shaped like the treated parameters (the parameters of
``model`` with ``requires_grad=True``, as everywhere in this package), or flat tensors of
the P treated scalars in ``model.named_parameters()`` order; the result has the input's
form.

References:
    Schraudolph (2002), Fast curvature matrix-vector products for second-order gradient
    descent. Neural Computation 14(7).
    Martens (2010), Deep learning via Hessian-free optimization. ICML.
    Martens (2020), New insights and perspectives on the natural gradient method. JMLR.
    Hestenes & Stiefel (1952), Methods of conjugate gradients for solving linear systems.
    Duffield et al. (2024), Scalable Bayesian learning with posteriors, §2 ("utilities").
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import TypeVar, cast

import torch
from torch import Tensor, nn
from torch.func import functional_call, jvp, vjp

from ._flat import Treated
from ._likelihoods import make_likelihood
from ._validation import check_positive_int

__all__ = ["conjugate_gradient", "fisher_vector_product", "ggn_vector_product"]

Vector = TypeVar("Vector", Tensor, dict[str, Tensor])
LikelihoodArg = str | Callable[[Tensor, Tensor], Tensor]


def _as_params(
    model: nn.Module, v: Tensor | Mapping[str, Tensor]
) -> tuple[Treated, dict[str, Tensor], dict[str, Tensor], bool]:
    """(treated, current params, tangent dict, whether v was flat)."""
    treated = Treated.of(model)
    current = dict(model.named_parameters())
    params = {name: current[name].detach() for name in treated.names}
    if isinstance(v, Tensor):
        if v.shape != (treated.numel,):
            raise ValueError(
                f"Invalid v: shape {tuple(v.shape)} (expected ({treated.numel},): the "
                "flat vector of the treated parameters, or a dict name -> tensor)"
            )
        return treated, params, treated.unflatten(v.to(params[treated.names[0]])), True
    if not isinstance(v, Mapping):
        raise TypeError(
            f"Invalid v: {type(v).__name__} (expected a flat tensor or a dict name -> tensor "
            "shaped like the treated parameters)"
        )
    missing = [name for name in treated.names if name not in v]
    if missing:
        raise KeyError(f"Invalid v: missing {missing} (expected every treated name)")
    tangent = {}
    for name, shape in zip(treated.names, treated.shapes, strict=True):
        if v[name].shape != shape:
            raise ValueError(
                f"Invalid v: {name!r} has shape {tuple(v[name].shape)} (expected {tuple(shape)})"
            )
        tangent[name] = v[name].to(params[name])
    return treated, params, tangent, False


def _output_fn(model: nn.Module, inputs: Tensor) -> Callable[[dict[str, Tensor]], Tensor]:
    def output(p: dict[str, Tensor]) -> Tensor:
        out = functional_call(model, p, (inputs,))
        if not isinstance(out, Tensor):
            raise TypeError(
                f"Invalid model output: {type(out).__name__} (expected a tensor with the "
                "batch as its first dimension)"
            )
        return out

    return output


def _result(treated: Treated, grads: dict[str, Tensor], flat: bool) -> Tensor | dict[str, Tensor]:
    out = {name: grads[name].detach() for name in treated.names}
    return treated.flatten(out) if flat else out


def ggn_vector_product(
    model: nn.Module,
    inputs: Tensor,
    targets: Tensor,
    v: Vector,
    likelihood: LikelihoodArg = "classification",
    *,
    noise_std: float | None = None,
) -> Vector:
    r"""GGN (= Fisher) times v, summed over the batch: :math:`\sum_i J_i^\top H_i J_i v`.

    One ``jvp`` and one ``vjp`` of the batch output; the GGN is never formed. Runs the
    model in its current mode (use eval mode: examples must not interact).

    Args:
        model: the network; its output for ``inputs`` has the batch first.
        inputs: a batch of inputs.
        targets: the batch's targets (class indices or probabilities for
            classification, tensors shaped like the output for regression).
        v: a dict name -> tensor for every treated parameter, or the flat (P,) vector.
        likelihood: ``"classification"`` (softmax cross-entropy, default),
            ``"regression"`` (Gaussian, standard deviation ``noise_std``) or a callable
            ``log_likelihood(output, target)`` returning one value per example (its output
            Hessian by autograd, negative eigenvalues clipped), as for ``Laplace``.
        noise_std: σ for ``likelihood="regression"`` (default None: 1.0).

    Returns:
        The product, in the form of ``v`` (dict or flat tensor).
    """
    like = make_likelihood(likelihood, noise_std)
    treated, params, tangent, flat = _as_params(model, v)
    output = _output_fn(model, inputs)
    with torch.no_grad():
        out, jv = jvp(output, (params,), (tangent,))[:2]
        factor = like.hessian_factor(out.detach(), targets).to(out.dtype)  # (B, O, K)
        u = jv.reshape(out.shape[0], -1)
        hu = torch.einsum("bok,bk->bo", factor, torch.einsum("bok,bo->bk", factor, u))
        pullback = vjp(output, params)[1]
        (grads,) = pullback(hu.reshape(out.shape))
    return _result(treated, grads, flat)  # type: ignore[return-value]


def fisher_vector_product(
    model: nn.Module,
    inputs: Tensor,
    targets: Tensor,
    v: Vector,
    likelihood: LikelihoodArg = "classification",
    *,
    noise_std: float | None = None,
) -> Vector:
    r"""Empirical Fisher times v, summed over the batch: :math:`\sum_i g_i (g_i^\top v)`.

    :math:`g_i = \nabla_\theta\ell_i`. Computed as :math:`G^\top(Gv)` by a ``jvp`` and a
    ``vjp`` of the vector of per-example losses, so no per-example gradient is formed.
    (The true Fisher of these likelihoods is the GGN: :func:`ggn_vector_product`.)

    Args:
        model: the network; its output for ``inputs`` has the batch first.
        inputs: a batch of inputs.
        targets: the batch's targets.
        v: a dict name -> tensor for every treated parameter, or the flat (P,) vector.
        likelihood: as in :func:`ggn_vector_product`.
        noise_std: σ for ``likelihood="regression"`` (default None: 1.0).

    Returns:
        The product, in the form of ``v`` (dict or flat tensor).
    """
    like = make_likelihood(likelihood, noise_std)
    treated, params, tangent, flat = _as_params(model, v)
    output = _output_fn(model, inputs)

    def losses(p: dict[str, Tensor]) -> Tensor:
        return like.nll(output(p), targets)

    with torch.no_grad():
        gv = jvp(losses, (params,), (tangent,))[1]
        pullback = vjp(losses, params)[1]
        (grads,) = pullback(gv)
    return _result(treated, grads, flat)  # type: ignore[return-value]


def _dot(a: Tensor | dict[str, Tensor], b: Tensor | dict[str, Tensor]) -> Tensor:
    if isinstance(a, Tensor):
        assert isinstance(b, Tensor)
        return torch.dot(a.reshape(-1), b.reshape(-1))
    assert isinstance(b, dict)
    parts = [torch.dot(a[k].reshape(-1), b[k].reshape(-1)) for k in a]
    return torch.stack(parts).sum()


def _axpy(alpha: Tensor | float, x: Vector, y: Vector) -> Vector:
    """``y + alpha * x``."""
    if isinstance(x, Tensor):
        return y + alpha * x
    return {k: y[k] + alpha * x[k] for k in x}


def conjugate_gradient(
    matvec: Callable[[Vector], Vector],
    b: Vector,
    *,
    maxiter: int | None = None,
    tol: float = 1e-6,
    x0: Vector | None = None,
) -> Vector:
    r"""Solve :math:`Ax = b` for symmetric positive-definite A given only :math:`v\mapsto Av`.

    The conjugate gradient method (Hestenes & Stiefel 1952): with :math:`r_0 = b - Ax_0`,
    :math:`p_0 = r_0`, each iteration sets :math:`\alpha = r^\top r / p^\top Ap`,
    :math:`x \leftarrow x + \alpha p`, :math:`r \leftarrow r - \alpha Ap`,
    :math:`p \leftarrow r + (r_\text{new}^\top r_\text{new} / r^\top r)\, p`; it stops when
    :math:`\lVert r\rVert \le` ``tol`` :math:`\cdot\lVert b\rVert` or after ``maxiter``
    products. In exact arithmetic it terminates in at most P iterations. For a
    posterior solve, wrap the curvature product with its damping/prior, e.g.
    ``lambda v: prior * v + (N / n) * ggn_vector_product(model, x, y, v)``.

    Args:
        matvec: the product :math:`v\mapsto Av` (A symmetric positive definite).
        b: the right-hand side: a tensor (any shape) or a dict of tensors.
        maxiter: at most this many iterations (default None: the number of scalars in b).
        tol: relative residual tolerance, a finite number >= 0 (default 1e-6).
        x0: the starting point (default None: zero).

    Returns:
        x, in the form of ``b``.
    """
    if isinstance(b, Mapping):
        b = cast(Vector, dict(b))
        size = sum(t.numel() for t in b.values())
    elif isinstance(b, Tensor):
        size = b.numel()
    else:
        raise TypeError(
            f"Invalid b: {type(b).__name__} (expected a tensor or a dict name -> tensor)"
        )
    if maxiter is None:
        maxiter = max(size, 1)
    maxiter = check_positive_int("maxiter", maxiter)
    if (
        isinstance(tol, bool)
        or not isinstance(tol, (int, float))
        or not (math.isfinite(tol) and tol >= 0)
    ):
        raise ValueError(f"Invalid tol: {tol!r} (expected a finite number >= 0)")
    if x0 is None:
        x: Vector = (
            torch.zeros_like(b)
            if isinstance(b, Tensor)
            else cast(Vector, {k: torch.zeros_like(t) for k, t in b.items()})
        )
        r = b
    else:
        x = x0
        r = _axpy(-1.0, matvec(x0), b)
    p = r
    rr = _dot(r, r)
    threshold = (tol**2) * float(_dot(b, b))
    for _ in range(maxiter):
        if float(rr) <= threshold:
            break
        ap = matvec(p)
        curvature = _dot(p, ap)
        if float(curvature) <= 0:
            raise ValueError(
                f"Invalid matvec: p^T A p = {float(curvature):.3g} <= 0 for a search direction "
                "(expected a symmetric positive-definite operator; add damping or a prior)"
            )
        alpha = rr / curvature
        x = _axpy(alpha, p, x)
        r = _axpy(-alpha, ap, r)
        rr_new = _dot(r, r)
        p = _axpy(rr_new / rr, p, r)
        rr = rr_new
    return x
