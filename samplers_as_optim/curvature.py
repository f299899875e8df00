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
form. Arguments are checked, and a NaN or infinite vector, targets that do not fit the
output, or a product or solution that is not finite are refused with a message naming the
argument (and, for :func:`conjugate_gradient`, the iteration): no NaN is returned.

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
from itertools import chain
from typing import TypeVar, cast

import torch
from torch import Tensor, nn
from torch.func import functional_call, jvp, vjp

from .core.validation import check_nonnegative, check_positive_int
from .gaussian.curvature_vectors import (
    AnyVector,
    breakdown_error,
    check_rhs,
    conform_vector,
    describe_nonfinite,
    describe_nonfinite_vector,
    kind_of,
    scale_by_power_of_two,
    vector_axpy,
    vector_dot,
    vector_exponent,
    vector_tensors,
)
from .gaussian.flat import Treated
from .gaussian.likelihoods import Classification, Likelihood, Regression, make_likelihood

__all__ = ["conjugate_gradient", "fisher_vector_product", "ggn_vector_product"]

Vector = TypeVar("Vector", Tensor, dict[str, Tensor])
LikelihoodArg = str | Callable[[Tensor, Tensor], Tensor] | Likelihood


# ---------------------------------------------------------------------------- products
def _as_params(
    model: nn.Module, v: Tensor | Mapping[str, Tensor]
) -> tuple[Treated, dict[str, Tensor], dict[str, Tensor], bool]:
    """(treated, current params, tangent dict, whether v was flat); v checked."""
    treated = Treated.of(model)
    current = dict(model.named_parameters())
    params = {name: current[name].detach() for name in treated.names}
    if isinstance(v, Tensor):
        _check_real_v(v, None)
        if v.shape != (treated.numel,):
            raise ValueError(
                f"Invalid v: shape {tuple(v.shape)} (expected ({treated.numel},): the "
                "flat vector of the treated parameters, or a dict name -> tensor)"
            )
        _check_finite_v(v, None)
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
        value = v[name]
        if not isinstance(value, Tensor):
            raise TypeError(
                f"Invalid v: {name!r} is {kind_of(value)} (expected a tensor of shape "
                f"{tuple(shape)}, like the parameter: numbers are not broadcast)"
            )
        _check_real_v(value, name)
        if value.shape != shape:
            raise ValueError(
                f"Invalid v: {name!r} has shape {tuple(value.shape)} (expected {tuple(shape)})"
            )
        _check_finite_v(value, name)
        tangent[name] = value.to(params[name])
    return treated, params, tangent, False


def _check_real_v(value: Tensor, name: str | None) -> None:
    if value.is_complex() or value.dtype == torch.bool:
        subject = f"{name!r} has dtype" if name is not None else "dtype"
        raise TypeError(
            f"Invalid v: {subject} {value.dtype} (expected a real tensor: it is converted to "
            "the parameters' dtype)"
        )


def _check_finite_v(value: Tensor, name: str | None) -> None:
    kinds = describe_nonfinite(value)
    if kinds:
        subject = f"{name!r} has non-finite values" if name is not None else "non-finite values"
        raise ValueError(f"Invalid v: {subject} ({kinds}) (expected finite numbers)")


def _check_targets(like: Likelihood, out: Tensor, targets: object) -> None:
    """Targets for the built-in likelihoods (a callable's targets are its own business).

    Run on the first model output, before the likelihood sees it: the GGN of these
    likelihoods does not read the targets, so a wrong batch would otherwise pass unnoticed.
    An output the likelihood refuses is left to its own message.
    """
    if isinstance(like, Classification):
        if out.dim() < 2:
            return
        lead, classes, ignore = tuple(out.shape[:-1]), out.shape[-1], like.ignore_index
        allowed = "" if ignore is None else f" (or ignore_index {ignore})"
        expected = (
            f"class indices of shape {lead} in [0, {classes}){allowed} or class probabilities "
            f"of shape {tuple(out.shape)}, for the model output of shape {tuple(out.shape)}"
        )
        if not isinstance(targets, Tensor) or targets.dtype == torch.bool or targets.is_complex():
            what = (
                f"dtype {targets.dtype}" if isinstance(targets, Tensor) else type(targets).__name__
            )
            raise TypeError(f"Invalid targets: {what} (expected {expected})")
        if targets.is_floating_point():
            if targets.shape != out.shape:
                raise ValueError(
                    f"Invalid targets: probabilities of shape {tuple(targets.shape)} (expected "
                    f"{expected})"
                )
        else:
            if targets.shape != lead:
                raise ValueError(
                    f"Invalid targets: class indices of shape {tuple(targets.shape)} (expected "
                    f"{expected})"
                )
            bad = (targets < 0) | (targets >= classes)
            if ignore is not None:
                bad = bad & (targets != ignore)
            if bool(bad.any()):
                hint = "; there is no ignore_index: leave such examples out"
                raise ValueError(
                    f"Invalid targets: class indices outside [0, {classes}) (expected "
                    f"{expected}{hint if ignore is None else ''})"
                )
    elif isinstance(like, Regression):
        if not isinstance(targets, Tensor) or targets.dtype == torch.bool or targets.is_complex():
            what = (
                f"dtype {targets.dtype}" if isinstance(targets, Tensor) else type(targets).__name__
            )
            raise TypeError(
                f"Invalid targets: {what} (expected a real tensor of the model output's shape "
                f"{tuple(out.shape)} for likelihood='regression')"
            )
    else:
        return
    kinds = describe_nonfinite(targets)
    if kinds:
        raise ValueError(f"Invalid targets: non-finite values ({kinds}) (expected finite numbers)")


def _output_fn(
    model: nn.Module, inputs: Tensor, like: Likelihood, targets: Tensor
) -> Callable[[dict[str, Tensor]], Tensor]:
    checked = False

    def output(p: dict[str, Tensor]) -> Tensor:
        nonlocal checked
        out = functional_call(model, p, (inputs,))
        if not isinstance(out, Tensor):
            raise TypeError(
                f"Invalid model output: {type(out).__name__} (expected a tensor with the "
                "batch as its first dimension)"
            )
        if out.dim() == 0:
            raise ValueError(
                "Invalid model output: a 0-dim tensor (expected a tensor with the batch as its "
                "first dimension)"
            )
        if not checked:
            _check_targets(like, out, targets)
            checked = True
        return out

    return output


def _result(
    function: str,
    treated: Treated,
    grads: dict[str, Tensor],
    flat: bool,
    model: nn.Module,
    inputs: object,
    targets: object,
) -> Tensor | dict[str, Tensor]:
    """The product in v's form; a non-finite one is refused, naming its cause."""
    out = {name: grads[name].detach() for name in treated.names}
    if describe_nonfinite_vector(out):
        _explain_nonfinite(function, out, model, inputs, targets)
    return treated.flatten(out) if flat else out


def _explain_nonfinite(
    function: str, out: dict[str, Tensor], model: nn.Module, inputs: object, targets: object
) -> None:
    """Raise for a non-finite product: the first non-finite input, else an overflow."""
    named = chain(
        (("parameter", name, t) for name, t in model.named_parameters()),
        (("buffer", name, t) for name, t in model.named_buffers()),
    )
    for kind, name, tensor in named:
        kinds = describe_nonfinite(tensor.detach())
        if kinds:
            raise ValueError(
                f"Invalid model: {kind} {name!r} has non-finite values ({kinds}) (expected "
                f"finite parameters and buffers: {function} linearizes the model at them)"
            )
    for arg, value in (("inputs", inputs), ("targets", targets)):
        kinds = describe_nonfinite(value) if isinstance(value, Tensor) else ""
        if kinds:
            raise ValueError(
                f"Invalid {arg}: non-finite values ({kinds}) (expected finite numbers)"
            )
    kinds = describe_nonfinite_vector(out)
    dtype = next(iter(out.values())).dtype
    raise ValueError(
        f"Non-finite {function}: the product has {kinds} values although v, the model's "
        f"parameters and buffers, the inputs and the targets are finite (the model output, "
        f"its derivatives or the likelihood's curvature overflow {dtype}, or a callable "
        "likelihood is not finite at these outputs)"
    )


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
        inputs: a batch of inputs (the model's one positional argument).
        targets: the batch's targets: for classification, class indices ``(B,)`` in
            ``[0, C)`` or probabilities ``(B, C)`` (``(B, *positions)`` and ``(B,
            *positions, C)`` for outputs with positions); for regression, a tensor shaped
            like the output (checked, finite, although the GGN of these likelihoods does
            not depend on them); for a callable likelihood, whatever it takes (passed
            through).
        v: a dict name -> tensor for every treated parameter (other names are ignored),
            or the flat (P,) vector; real and finite, converted to the parameters' dtype.
        likelihood: ``"classification"`` (softmax cross-entropy, default),
            ``"regression"`` (Gaussian, standard deviation ``noise_std``) or a callable
            ``log_likelihood(output, target)`` returning one value per example (its output
            Hessian by autograd, negative eigenvalues clipped), as for ``Laplace``; or a
            :class:`~samplers_as_optim.gaussian.likelihoods.Likelihood` object such as a
            fitted ``Laplace``'s ``la.likelihood`` (which carries its ``ignore_index``).
            Outputs ``(B, *positions, K)`` are one observation per position
            (:mod:`~samplers_as_optim.gaussian.likelihoods`):
            :math:`\sum_{i,t}J_{it}^\top H_{it}J_{it}v`.
        noise_std: σ for ``likelihood="regression"`` (default None: 1.0).

    Returns:
        The product, in the form of ``v`` (dict or flat tensor), in the parameters' dtype.

    Raises:
        TypeError: ``v`` (or one of its entries), ``targets`` or the model output has the
            wrong type.
        KeyError: ``v`` lacks a treated name.
        ValueError: a wrong shape or non-finite values in ``v`` or ``targets``, class
            indices out of range, a bad ``likelihood``/``noise_std``, or a non-finite
            product (the message names the non-finite parameter, buffer or input, or says
            that the computation overflowed).
    """
    like = make_likelihood(likelihood, noise_std)
    treated, params, tangent, flat = _as_params(model, v)
    output = _output_fn(model, inputs, like, targets)
    with torch.no_grad():
        out, jv = jvp(output, (params,), (tangent,))[:2]
        u = jv.reshape(out.shape[0], -1)
        hu = like.hessian_product(out.detach(), targets, u)  # V (V^T u), block by block
        pullback = vjp(output, params)[1]
        (grads,) = pullback(hu.reshape(out.shape))
    result = _result("ggn_vector_product", treated, grads, flat, model, inputs, targets)
    return cast(Vector, result)


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
    For outputs ``(B, *positions, K)`` the losses are per position,
    :math:`\sum_{i,t}g_{it}(g_{it}^\top v)`, as ``Laplace``'s ``curvature="ef"``.
    (The true Fisher of these likelihoods is the GGN: :func:`ggn_vector_product`.)

    Args:
        model: the network; its output for ``inputs`` has the batch first.
        inputs: a batch of inputs (the model's one positional argument).
        targets: the batch's targets, as in :func:`ggn_vector_product`.
        v: a dict name -> tensor for every treated parameter (other names are ignored),
            or the flat (P,) vector; real and finite, converted to the parameters' dtype.
        likelihood: as in :func:`ggn_vector_product`.
        noise_std: σ for ``likelihood="regression"`` (default None: 1.0).

    Returns:
        The product, in the form of ``v`` (dict or flat tensor), in the parameters' dtype.

    Raises:
        TypeError, KeyError, ValueError: as :func:`ggn_vector_product`.
    """
    like = make_likelihood(likelihood, noise_std)
    treated, params, tangent, flat = _as_params(model, v)
    output = _output_fn(model, inputs, like, targets)

    def losses(p: dict[str, Tensor]) -> Tensor:  # one per observation (position)
        return like.token_nll(output(p), targets)

    with torch.no_grad():
        gv = jvp(losses, (params,), (tangent,))[1]
        pullback = vjp(losses, params)[1]
        (grads,) = pullback(gv)
    result = _result("fisher_vector_product", treated, grads, flat, model, inputs, targets)
    return cast(Vector, result)


# ---------------------------------------------------------------------------- conjugate gradient
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

    The iteration runs on the correction :math:`x - x_0`, with the residual scaled by a
    power of two to unit size (exact, and undone at the end), so that :math:`r^\top r`
    neither overflows nor underflows however large or small b is; ``matvec`` therefore
    sees vectors of that scale (A must be linear). Every product is checked: a result of
    another structure than b, or with NaN or infinite values, is refused at the iteration
    that produced it, as are a breakdown of the recurrence (a curvature
    :math:`p^\top Ap \le 0`, or a step that overflows) and a solution that overflows
    b's dtype; no NaN is ever returned.

    Args:
        matvec: the product :math:`v\mapsto Av` (A symmetric positive definite), returning
            the structure of v (a tensor of its shape, or a dict with its keys and
            shapes); results are converted to b's dtype.
        b: the right-hand side: a floating-point tensor (any shape) or a non-empty dict of
            them; finite.
        maxiter: at most this many iterations, an integer >= 1 (default None: the number
            of scalars in b).
        tol: relative residual tolerance, a finite number >= 0 (default 1e-6).
        x0: the starting point, finite, with b's structure (default None: zero).

    Returns:
        x, in the form of ``b``.

    Raises:
        TypeError: ``matvec`` is not callable; ``b``, ``x0`` or a product has the wrong
            type or dtype; ``maxiter`` or ``tol`` is not a number.
        ValueError: ``b`` is empty or not finite; ``x0`` or a product has other keys or
            shapes than ``b`` or non-finite values; ``maxiter < 1``, ``tol`` negative or
            NaN; the operator is not positive definite along a search direction, or the
            iteration or its solution overflows.
    """
    if not callable(matvec):
        raise TypeError(
            f"Invalid matvec: {type(matvec).__name__} (expected a callable v -> A v returning "
            "the structure of v)"
        )
    operator = cast(Callable[[AnyVector], object], matvec)
    rhs = check_rhs(b)
    size = sum(t.numel() for t in vector_tensors(rhs))
    maxiter = check_positive_int("maxiter", max(size, 1) if maxiter is None else maxiter)
    tol = check_nonnegative("tol", tol)
    start, r = _initial_residual(operator, rhs, x0)
    # Solve A d = r for the correction d = x - x0 with r scaled by 2^-e_r to unit size.
    e_r = vector_exponent(r)
    r = scale_by_power_of_two(r, -e_r)
    threshold = _stop_threshold(tol, r, rhs, e_r, start is None)
    d = _iterate(operator, rhs, r, threshold, maxiter)
    x = scale_by_power_of_two(d, e_r)
    if start is not None:
        x = vector_axpy(1.0, x, start)
    kinds = describe_nonfinite_vector(x)
    if kinds:
        raise ValueError(
            f"Invalid matvec: the solution x of A x = b overflows b's dtype ({kinds}) "
            "(expected an operator that is not nearly singular at the scale of b: add damping "
            "or a prior, or use float64)"
        )
    return cast(Vector, x)


def _initial_residual(
    operator: Callable[[AnyVector], object], rhs: AnyVector, x0: object
) -> tuple[AnyVector | None, AnyVector]:
    """The checked start x0 (None for zero) and the residual b - A x0 there."""
    if x0 is None:
        return None, rhs
    start = conform_vector(x0, rhs, "x0", "", "")
    product = conform_vector(
        operator(start),
        rhs,
        "matvec",
        " for A x0",
        ": x0 is finite, so the operator produced them",
    )
    r = vector_axpy(-1.0, product, rhs)
    kinds = describe_nonfinite_vector(r)
    if kinds:
        raise ValueError(
            f"Invalid x0: the residual b - A x0 overflows b's dtype ({kinds}) (expected a "
            "starting point at the scale of the solution)"
        )
    return start, r


def _stop_threshold(tol: float, r: AnyVector, rhs: AnyVector, e_r: int, from_zero: bool) -> float:
    """The bound on the scaled residual's r^T r: (tol ||b|| / 2^e_r)^2, 0 for an exact solve.

    ``r`` is the initial residual scaled by 2^-e_r; ``from_zero``: it is b itself (no x0).
    """
    e_b = e_r if from_zero else vector_exponent(rhs)
    unit_b = r if from_zero else scale_by_power_of_two(rhs, -e_b)
    norm_b = math.sqrt(float(vector_dot(unit_b, unit_b)))  # ||b|| / 2^e_b
    if tol == 0 or norm_b == 0:
        return 0.0
    try:
        bound = math.ldexp(tol * norm_b, e_b - e_r)  # tol ||b|| / 2^e_r
    except OverflowError:
        bound = math.inf
    return bound * bound


def _iterate(
    operator: Callable[[AnyVector], object],
    rhs: AnyVector,
    r: AnyVector,
    threshold: float,
    maxiter: int,
) -> AnyVector:
    """The conjugate-gradient iterations on A d = r from d = 0: the correction d."""
    d: AnyVector = (
        torch.zeros_like(r)
        if isinstance(r, Tensor)
        else {k: torch.zeros_like(t) for k, t in r.items()}
    )
    p = r
    rr_t = vector_dot(r, r)
    rr = float(rr_t)
    dtype = ", ".join(sorted({str(t.dtype) for t in vector_tensors(rhs)}))
    for iteration in range(1, maxiter + 1):
        if rr <= threshold:
            break
        ap = conform_vector(
            operator(p),
            rhs,
            "matvec",
            f" for A p at iteration {iteration}",
            ": p is finite, so the operator produced them",
        )
        curvature_t = _curvature(p, ap, iteration, dtype)
        alpha = rr_t / curvature_t
        if not math.isfinite(float(alpha)):
            raise breakdown_error(iteration, "the step r^T r / p^T A p", float(alpha), dtype)
        d = vector_axpy(alpha, p, d)
        r = vector_axpy(-alpha, ap, r)
        rr_new_t = vector_dot(r, r)
        rr_new = float(rr_new_t)
        if not math.isfinite(rr_new):
            raise breakdown_error(iteration, "the residual's r^T r", rr_new, dtype)
        beta = rr_new_t / rr_t
        if not math.isfinite(float(beta)):
            raise breakdown_error(iteration, "the ratio r_new^T r_new / r^T r", float(beta), dtype)
        p = vector_axpy(beta, p, r)
        rr_t, rr = rr_new_t, rr_new
    return d


def _curvature(p: AnyVector, ap: AnyVector, iteration: int, dtype: str) -> Tensor:
    """p^T A p, refused where it is not finite or not positive (not positive definite)."""
    curvature_t = vector_dot(p, ap)
    curvature = float(curvature_t)
    if not math.isfinite(curvature):
        raise breakdown_error(iteration, "p^T A p", curvature, dtype)
    if not (curvature > 0):
        norm_p = float(vector_dot(p, p))
        rayleigh = curvature / norm_p if norm_p > 0 else curvature
        raise ValueError(
            f"Invalid matvec: p^T A p / p^T p = {rayleigh:.3g} <= 0 for the search "
            f"direction p at iteration {iteration} (expected a symmetric positive-definite "
            "operator; add damping or a prior)"
        )
    return curvature_t
