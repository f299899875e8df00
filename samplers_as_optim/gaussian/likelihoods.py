r"""Per-example likelihoods and the factors of their output Hessians.

A likelihood turns a model output :math:`f_i = f(x_i; \theta)` (flattened to O numbers)
and a target :math:`y_i` into the per-example loss :math:`\ell_i = -\log p(y_i \mid f_i)`.
Curvature needs two things from it:

* the output gradient :math:`\nabla_f \ell_i` (the empirical Fisher is built from it), and
* a factor :math:`V_i \in \mathbb{R}^{O \times K}` with :math:`V_i V_i^\top =
  \nabla^2_f \ell_i`, so that the GGN :math:`\sum_i J_i^\top H_i J_i = \sum_{i,k}
  (J_i^\top v_{ik})(J_i^\top v_{ik})^\top` is a sum of K "pseudo-gradients" per example.

Closed forms: softmax cross-entropy has :math:`H = \mathrm{diag}(p) - p p^\top`, factored
by the C columns :math:`\sqrt{p_c}\,(e_c - p)` (check: :math:`\sum_c p_c (e_c - p)(e_c -
p)^\top = \mathrm{diag}(p) - p p^\top`); the Gaussian with noise scale σ has
:math:`H = I/\sigma^2`, factored by :math:`I/\sigma`. A user's callable log-likelihood gets
its Hessian by O extra backward passes and the factor :math:`Q\,\mathrm{diag}(\sqrt{
\max(\lambda, 0)})` of its eigendecomposition (negative eigenvalues, where the loss is not
convex in the output, are clipped: the GGN is then that of the convex part).

**Outputs with positions** (a language model's ``(batch, sequence, vocabulary)`` logits).
``"classification"`` and ``"regression"`` read an output of shape ``(batch, *positions,
K)`` as one observation per position: :math:`\ell_i = \sum_t \ell_{it}` over the
positions t of example i (flattened, row-major), so :math:`\nabla^2_f\ell_i` is block
diagonal, one K x K block :math:`H_{it}` per position, and its factor is block diagonal
too, :math:`V_i = \mathrm{blockdiag}_t(V_{it})` with T·K columns (T positions):
:math:`J_i^\top H_i J_i = \sum_t J_{it}^\top H_{it} J_{it}` exactly, whatever the model
does across positions (a causal language model mixes them). The empirical Fisher is the
per-position one, :math:`\sum_t\nabla\ell_{it}\nabla\ell_{it}^\top` (T columns
:math:`\nabla_f\ell_{it}`, each zero outside its position): with a model that acts on
each position alone it is the empirical Fisher of the same data with the positions
flattened into the batch. A ``(batch, K)`` output has one position and every formula
reduces to the one above. ``Classification(ignore_index=...)`` (as
``torch.nn.CrossEntropyLoss``'s) drops the positions whose class-index target equals it:
they add nothing to :math:`\ell_i`, its gradient or its Hessian factor (their columns
are zero). A callable likelihood's output is one observation per example, whatever its
shape.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Iterator
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor

from ..core.validation import check_positive

__all__ = [
    "CallableLikelihood",
    "Classification",
    "Likelihood",
    "Regression",
    "block_diagonal",
    "check_ignore_index",
    "check_noise_argument",
    "check_noise_std",
    "curvature_product",
    "factor_blocks",
    "factor_columns",
    "make_likelihood",
]


def block_diagonal(blocks: Tensor) -> Tensor:
    r"""``(B, T, O, K)`` per-position blocks as the ``(B, T*O, T*K)`` block-diagonal factor.

    Row ``t*O + o``, column ``t*K + k`` holds ``blocks[:, t, o, k]``; every other entry
    is zero: the factor of :math:`\sum_t` of per-position terms over the flattened output.
    """
    batch, positions, rows, columns = blocks.shape
    spread = torch.diag_embed(blocks.permute(0, 2, 3, 1))  # (B, O, K, T, T)
    return spread.permute(0, 3, 1, 4, 2).reshape(batch, positions * rows, positions * columns)


def factor_blocks(likelihood: Likelihood, kind: str, output: Tensor, target: Tensor) -> Tensor:
    r"""``(B, T, O_t, K)``: the curvature's factor per position, :math:`V_{it}`.

    ``"ef"``: :math:`\nabla_f\ell_{it}` (K = 1); ``"ggn"``: the Hessian factor. The
    factor of the whole output is their :func:`block_diagonal`.
    """
    if kind == "ef":
        grad = likelihood.output_grad(output, target)
        return grad.reshape(grad.shape[0], likelihood.positions(output), -1, 1)
    return likelihood.position_factor(output, target).to(output.dtype)


def factor_columns(blocks: Tensor, max_columns: int) -> Iterator[Tensor]:
    """The T·K columns of :func:`block_diagonal` ``(blocks)`` as cotangents ``(c, B, T*O_t)``.

    Whole positions at a time, at most ``max_columns`` columns (at least one position's
    K); column ``t*K + k`` is ``blocks[:, t, :, k]`` at position t, zero elsewhere. One
    chunk of all K columns when T = 1.
    """
    batch, positions, rows, width = blocks.shape
    if positions == 1:
        yield blocks[:, 0].permute(2, 0, 1)
        return
    step = max(1, max_columns // width)
    for start in range(0, positions, step):
        span = torch.arange(min(step, positions - start), device=blocks.device)
        part = blocks.new_zeros(len(span), width, batch, positions, rows)
        part[span, :, :, start + span] = blocks[:, start : start + len(span)].permute(1, 3, 0, 2)
        yield part.reshape(-1, batch, positions * rows)


def curvature_product(
    likelihood: Likelihood, kind: str, output: Tensor, target: Tensor, u: Tensor
) -> Tensor:
    r""":math:`V_iV_i^\top u_i` for ``u`` ``(B, O)``, position by position, V unformed.

    The GGN's :math:`H_iu_i` (:meth:`Likelihood.hessian_product`) or the empirical
    Fisher's :math:`\sum_t\nabla_f\ell_{it}(\nabla_f\ell_{it}^\top u_{it})`: what a
    matrix-free product needs, without the T-times-larger block-diagonal factor.
    """
    if kind == "ggn":
        return likelihood.hessian_product(output, target, u)
    grad = likelihood.output_grad(output, target)
    per = grad.reshape(grad.shape[0], likelihood.positions(output), -1)
    return (per * (per * u.reshape(per.shape)).sum(-1, keepdim=True)).reshape(grad.shape)


def check_ignore_index(value: object) -> int | None:
    """``ignore_index``: None, or an integer (any value, as ``torch.nn.CrossEntropyLoss``).

    Raises:
        TypeError: anything else (a bool, a float, a string).
    """
    if value is None:
        return None
    if not isinstance(value, bool):
        try:
            return operator.index(value)  # type: ignore[arg-type]
        except TypeError:
            pass
    raise TypeError(
        f"Invalid ignore_index: {value!r} (expected None or an integer, e.g. -100 as "
        "torch.nn.CrossEntropyLoss uses)"
    )


class Likelihood:
    """Base class: per-example negative log-likelihood of a batch of outputs."""

    name = "likelihood"

    def nll(self, output: Tensor, target: Tensor) -> Tensor:
        """Per-example negative log-likelihood, shape ``(B,)``."""
        raise NotImplementedError

    def output_grad(self, output: Tensor, target: Tensor) -> Tensor:
        """Per-example gradient of the NLL with respect to the output, ``(B, O)``."""
        with torch.enable_grad():
            leaf = output.detach().requires_grad_(True)
            (grad,) = torch.autograd.grad(self.nll(leaf, target).sum(), leaf)
        return grad.reshape(output.shape[0], -1)

    def hessian_factor(self, output: Tensor, target: Tensor) -> Tensor:
        """``V`` of shape ``(B, O, K)`` with ``V[i] @ V[i].T`` the output Hessian of ``nll``."""
        raise NotImplementedError

    def positions(self, output: Tensor) -> int:
        """T, the observations per example: 1 here (the whole output is one observation)."""
        return 1

    def token_nll(self, output: Tensor, target: Tensor) -> Tensor:
        """Per-observation negative log-likelihood, ``(B,)`` here (one per example)."""
        return self.nll(output, target)

    def position_mask(self, output: Tensor, target: Tensor) -> Tensor | None:
        """``(B, *positions)`` booleans, False where a target is ignored; None if none can be."""
        return None

    def position_factor(self, output: Tensor, target: Tensor) -> Tensor:
        """``(B, T, O_t, K)``: the Hessian factor of each of the T positions (here T = 1)."""
        return self.hessian_factor(output, target).unsqueeze(1)

    def hessian_product(self, output: Tensor, target: Tensor, u: Tensor) -> Tensor:
        r""":math:`H_i u_i` for ``u`` of shape ``(B, O)`` (the output flattened): ``(B, O)``.

        Here through the factor, :math:`V_i(V_i^\top u_i)`; likelihoods with positions
        multiply block by block, without forming the block-diagonal factor.
        """
        factor = self.hessian_factor(output, target).to(output.dtype)
        return torch.einsum("bok,bk->bo", factor, torch.einsum("bok,bo->bk", factor, u))

    def target_flag(self, output: Tensor, target: Tensor) -> Tensor | None:
        """What can be checked of ``target`` on the host (raising), the rest as a flag.

        Returns:
            A 0-d boolean tensor on the targets' device, True where the targets pass the
            checks that need their values, or None where there are none; computing it
            does not synchronise, so a caller can fold it into another check's
            synchronisation and call :meth:`check_targets` only when it is False.

        Raises:
            ValueError: targets refused by their dtype or shape.
        """
        return None

    def check_targets(self, output: Tensor, target: Tensor) -> None:
        """Refuse targets this likelihood cannot score against ``output`` (``ValueError``).

        The one validator of every front end that feeds data to a likelihood (a fit's
        pass, a validation grid, training): :meth:`target_flag`, then the message of the
        value that fails it. The base class knows nothing to check (a callable
        likelihood checks its own targets).
        """
        valid = self.target_flag(output, target)
        if valid is not None and not bool(valid):
            self._refuse_values(output, target)

    def _refuse_values(self, output: Tensor, target: Tensor) -> None:
        """Raise the message of the target values that :meth:`target_flag` refused."""


class Classification(Likelihood):
    """Categorical likelihood with softmax link: ``nll = cross_entropy(logits, target)``.

    Logits ``(batch, classes)``, or ``(batch, *positions, classes)`` with one observation
    per position (the module docstring). ``ignore_index`` (default None), as
    ``torch.nn.CrossEntropyLoss``'s: a class-index target equal to it adds nothing; any
    integer is allowed (one in ``[0, classes)`` ignores that class's targets).
    """

    name = "classification"

    def __init__(self, ignore_index: int | None = None) -> None:
        self.ignore_index = check_ignore_index(ignore_index)

    def _check(self, output: Tensor) -> None:
        if output.dim() < 2:
            raise ValueError(
                f"Invalid model output: shape {tuple(output.shape)} (expected (batch, "
                "classes) or (batch, *positions, classes) logits for "
                "likelihood='classification')"
            )

    def positions(self, output: Tensor) -> int:
        """T: the product of the positions' sizes (1 for ``(batch, classes)`` logits)."""
        return math.prod(output.shape[1:-1])

    def nll(self, output: Tensor, target: Tensor) -> Tensor:
        """Softmax cross-entropy per example, summed over positions (ignored ones add 0).

        Targets: class indices or probabilities. Class indices of any integer dtype are
        read as int64 (torch's cross-entropy takes int64 and uint8 only);
        :meth:`check_targets` validates them.
        """
        if output.dim() == 2 and self.ignore_index is None:
            self._check(output)
            return F.cross_entropy(output, self._indices(target), reduction="none")
        return self.token_nll(output, target).reshape(output.shape[0], -1).sum(-1)

    @staticmethod
    def _indices(target: Tensor) -> Tensor:
        if not (target.is_floating_point() or target.dtype in (torch.int64, torch.uint8)):
            return target.long()
        return target

    def token_nll(self, output: Tensor, target: Tensor) -> Tensor:
        """Softmax cross-entropy per position, ``(B, *positions)``; 0 where ignored."""
        self._check(output)
        target = self._indices(target)
        if output.dim() > 2:
            output = output.movedim(-1, 1)
            if target.is_floating_point():
                target = target.movedim(-1, 1)
        if self.ignore_index is None:
            return F.cross_entropy(output, target, reduction="none")
        return F.cross_entropy(output, target, reduction="none", ignore_index=self.ignore_index)

    def position_mask(self, output: Tensor, target: Tensor) -> Tensor | None:
        """``target != ignore_index`` for class indices; None without an ``ignore_index``."""
        if self.ignore_index is None or target.is_floating_point():
            return None
        return target != self.ignore_index

    def target_flag(self, output: Tensor, target: Tensor) -> Tensor | None:
        """Class indices of an integer dtype in ``[0, classes)``, or probabilities.

        Probabilities are floating targets of the output's shape ``(batch, *positions,
        classes)`` (not checked further); anything else must be integers (not bool) of
        shape ``(batch, *positions)``, whose range (or ``ignore_index``) is the flag.

        Raises:
            ValueError: naming the targets' dtype or shape and what is expected.
        """
        self._check(output)
        lead, classes = tuple(output.shape[:-1]), output.shape[-1]
        if target.is_floating_point() and target.shape == output.shape:
            return None
        ignored = "" if self.ignore_index is None else f" or ignore_index {self.ignore_index}"
        expected = (
            f"expected class indices of an integer dtype, shape {lead}, in [0, "
            f"{classes}){ignored}, or class probabilities of the output's shape "
            f"{tuple(output.shape)}"
        )
        if target.is_floating_point() or target.is_complex() or target.dtype == torch.bool:
            raise ValueError(
                f"Invalid targets: dtype {target.dtype} of shape {tuple(target.shape)} ({expected})"
            )
        if target.shape != lead:
            raise ValueError(f"Invalid targets: shape {tuple(target.shape)} ({expected})")
        valid = (target >= 0) & (target < classes)
        if self.ignore_index is not None:
            valid = valid | (target == self.ignore_index)
        return valid.all()

    def _refuse_values(self, output: Tensor, target: Tensor) -> None:
        batch, classes = output.shape[0], output.shape[-1]
        bad = (target < 0) | (target >= classes)
        allowed = ""
        if self.ignore_index is not None:
            bad = bad & (target != self.ignore_index)
            allowed = f", or ignore_index {self.ignore_index}"
        where = [int(index) for index in bad.nonzero()[0]]
        position = f" at position {tuple(where[1:])}" if target.dim() > 1 else ""
        raise ValueError(
            f"Invalid targets: class index {int(target[tuple(where)])} in example {where[0]} "
            f"of {batch}{position} (expected 0 <= targets < {classes}, the number of model "
            f"outputs{allowed})"
        )

    def _probabilities(self, output: Tensor, target: Tensor) -> tuple[Tensor, Tensor | None]:
        self._check(output)
        return output.detach().softmax(dim=-1), self.position_mask(output, target)

    def position_factor(self, output: Tensor, target: Tensor) -> Tensor:
        """Columns ``sqrt(p_c) (e_c - p)`` per position, ``(B, T, C, C)``; 0 where ignored."""
        probs, mask = self._probabilities(output, target)
        eye = torch.eye(probs.shape[-1], dtype=probs.dtype, device=probs.device)
        factor = (eye - probs.unsqueeze(-1)) * probs.sqrt().unsqueeze(-2)
        if mask is not None:
            factor = factor * mask[..., None, None].to(factor.dtype)
        return factor.reshape(output.shape[0], -1, *factor.shape[-2:])

    def hessian_factor(self, output: Tensor, target: Tensor) -> Tensor:
        """Columns ``sqrt(p_c) (e_c - p)``: ``V V^T = diag(p) - p p^T``, per position.

        ``(B, C, C)`` for ``(batch, classes)`` logits; with positions the block-diagonal
        ``(B, T*C, T*C)`` (:func:`block_diagonal`), zero blocks where ignored.
        """
        blocks = self.position_factor(output, target)
        return blocks[:, 0] if output.dim() == 2 else block_diagonal(blocks)

    def hessian_product(self, output: Tensor, target: Tensor, u: Tensor) -> Tensor:
        r""":math:`H_{it}u_{it} = p_{it}\odot(u_{it} - p_{it}^\top u_{it})` per position.

        ``(batch, classes)`` logits without ``ignore_index`` take the factor (as before).
        """
        if output.dim() == 2 and self.ignore_index is None:
            return super().hessian_product(output, target, u)
        probs, mask = self._probabilities(output, target)
        u = u.reshape(probs.shape).to(probs.dtype)
        product = probs * (u - (probs * u).sum(-1, keepdim=True))
        if mask is not None:
            product = product * mask.unsqueeze(-1).to(product.dtype)
        return product.reshape(output.shape[0], -1)


class Regression(Likelihood):
    """Gaussian likelihood ``N(y | f, noise_std**2 I)``."""

    name = "regression"

    def __init__(self, noise_std: float) -> None:
        self.noise_std = noise_std

    @staticmethod
    def _check(output: Tensor, target: Tensor) -> None:
        if target.shape != output.shape:
            raise ValueError(
                f"Invalid targets: shape {tuple(target.shape)} (expected the model output's "
                f"shape {tuple(output.shape)} for likelihood='regression')"
            )

    def target_flag(self, output: Tensor, target: Tensor) -> Tensor | None:
        """Targets shaped like the output (``ValueError`` otherwise); no flag."""
        self._check(output, target)
        return None

    def nll(self, output: Tensor, target: Tensor) -> Tensor:
        """``0.5 * |y - f|^2 / noise_std^2 + (O / 2) log(2 pi noise_std^2)`` per example."""
        self._check(output, target)
        residual = (target - output).reshape(output.shape[0], -1)
        dim = residual.shape[-1]
        variance = self.noise_std**2
        return 0.5 * residual.square().sum(-1) / variance + 0.5 * dim * math.log(
            2 * math.pi * variance
        )

    def hessian_factor(self, output: Tensor, target: Tensor) -> Tensor:
        """``I / noise_std`` for every example."""
        self._check(output, target)
        batch = output.shape[0]
        dim = output[0].numel()
        eye = torch.eye(dim, dtype=output.dtype, device=output.device) / self.noise_std
        return eye.expand(batch, dim, dim)

    def position_factor(self, output: Tensor, target: Tensor) -> Tensor:
        """``I / noise_std`` per position, ``(B, T, O_t, O_t)`` (the whole output if T = 1)."""
        if output.dim() <= 2:
            return super().position_factor(output, target)
        self._check(output, target)
        width = output.shape[-1]
        eye = torch.eye(width, dtype=output.dtype, device=output.device) / self.noise_std
        return eye.expand(output.shape[0], self.positions(output), width, width)

    def positions(self, output: Tensor) -> int:
        """T: the product of ``output.shape[1:-1]`` (1 for ``(batch, outputs)``)."""
        return math.prod(output.shape[1:-1]) if output.dim() > 2 else 1

    def token_nll(self, output: Tensor, target: Tensor) -> Tensor:
        """The Gaussian negative log-likelihood per position, ``(B, *positions)``."""
        if output.dim() <= 2:
            return self.nll(output, target)
        self._check(output, target)
        variance, width = self.noise_std**2, output.shape[-1]
        constant = 0.5 * width * math.log(2 * math.pi * variance)
        return 0.5 * (target - output).square().sum(-1) / variance + constant

    def hessian_product(self, output: Tensor, target: Tensor, u: Tensor) -> Tensor:
        """``u / noise_std**2`` (through the factor for ``(batch, outputs)``, as before)."""
        if output.dim() <= 2:
            return super().hessian_product(output, target, u)
        self._check(output, target)
        return u / self.noise_std**2


class CallableLikelihood(Likelihood):
    """A user's ``log_likelihood(output, target) -> (B,)`` per-example log-likelihoods."""

    name = "callable"

    def __init__(self, log_likelihood: Callable[[Tensor, Tensor], Tensor]) -> None:
        self.log_likelihood = log_likelihood

    def nll(self, output: Tensor, target: Tensor) -> Tensor:
        """Minus the callable's value; checks that it returns one number per example."""
        value = self.log_likelihood(output, target)
        if not isinstance(value, Tensor) or value.shape != output.shape[:1]:
            shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
            raise ValueError(
                f"Invalid likelihood: the callable returned {shape} (expected a tensor of "
                f"shape ({output.shape[0]},): one log-likelihood per example, not reduced)"
            )
        return -value

    def hessian_factor(self, output: Tensor, target: Tensor) -> Tensor:
        """Output Hessian by O backward passes, factored by a clipped eigendecomposition."""
        batch = output.shape[0]
        with torch.enable_grad():
            leaf = output.detach().requires_grad_(True)
            (grad,) = torch.autograd.grad(self.nll(leaf, target).sum(), leaf, create_graph=True)
            grad = grad.reshape(batch, -1)
            dim = grad.shape[-1]
            rows = []
            for index in range(dim):
                (row,) = torch.autograd.grad(
                    grad[:, index].sum(), leaf, retain_graph=True, allow_unused=True
                )
                rows.append(
                    torch.zeros_like(grad) if row is None else row.detach().reshape(batch, -1)
                )
        hessian = torch.stack(rows, dim=1)
        hessian = 0.5 * (hessian + hessian.transpose(1, 2))
        eigenvalues, eigenvectors = torch.linalg.eigh(hessian)
        factor: Tensor = eigenvectors * eigenvalues.clamp(min=0.0).sqrt().unsqueeze(-2)
        return factor


def check_noise_std(likelihood: Likelihood, value: object) -> float | None:
    """A new ``noise_std`` for ``likelihood``: a finite number > 0 for regression, else None.

    None is refused for regression: only the constructor reads None as its default 1.0,
    and a later ``la.noise_std = None`` that kept σ as it was would look like a reset.

    Raises:
        ValueError, TypeError: naming the value and what the likelihood allows.
    """
    if not isinstance(likelihood, Regression):
        if value is not None:
            raise ValueError(
                f"Invalid noise_std: {value!r} (expected None: it applies only to "
                "likelihood='regression')"
            )
        return None
    if value is None:
        raise ValueError(
            "Invalid noise_std: None (expected a finite number > 0 for "
            "likelihood='regression'; None means 1.0 only at construction, so set "
            "noise_std = 1.0 for that)"
        )
    return check_positive("noise_std", value)


def check_noise_argument(
    likelihood: Likelihood, noise_std: float | Tensor | None
) -> float | Tensor | None:
    """A ``noise_std`` argument of the evidence: None for the likelihood's current σ.

    Otherwise (regression only) a finite number > 0 or a one-element tensor of one
    (returned 0-d, differentiable).

    Raises:
        ValueError, TypeError: naming the value and what is allowed.
    """
    if noise_std is None:
        return getattr(likelihood, "noise_std", None)
    if not isinstance(likelihood, Regression):
        check_noise_std(likelihood, noise_std)  # raises: only None applies there
    if not isinstance(noise_std, Tensor):
        return check_positive("noise_std", noise_std)
    detached = noise_std.detach()
    if noise_std.numel() != 1 or not bool(torch.all(detached > 0) & detached.isfinite().all()):
        holding = f" holding {detached.item()!r}" if noise_std.numel() == 1 else ""
        raise ValueError(
            f"Invalid noise_std: a tensor of shape {tuple(noise_std.shape)}{holding} "
            "(expected one finite value > 0)"
        )
    return noise_std.reshape(())


def make_likelihood(
    likelihood: str | Callable[[Tensor, Tensor], Tensor] | Likelihood,
    noise_std: float | None,
    ignore_index: int | None = None,
) -> Likelihood:
    """A :class:`Likelihood` from the public ``likelihood``, ``noise_std``, ``ignore_index``.

    A :class:`Likelihood` object is taken as it is.

    Raises:
        ValueError, TypeError: an unknown likelihood, or ``noise_std`` (``ignore_index``)
            given where it does not apply, or not of its form.
    """
    ignore_index = check_ignore_index(ignore_index)
    if isinstance(likelihood, Likelihood):
        for argument, value in (("noise_std", noise_std), ("ignore_index", ignore_index)):
            if value is not None:
                raise ValueError(
                    f"Invalid {argument}: {value!r} (expected None with a Likelihood object, "
                    "which carries its own)"
                )
        return likelihood
    if isinstance(likelihood, str):
        known = likelihood in ("classification", "regression")
    else:
        known = callable(likelihood)
    if not known:
        raise ValueError(
            f"Invalid likelihood: {likelihood!r} (expected 'classification', 'regression' or "
            "a callable log_likelihood(output, target) returning one value per example)"
        )
    if likelihood == "regression":
        if ignore_index is not None:
            raise ValueError(
                f"Invalid ignore_index: {ignore_index!r} (expected None: it applies only to "
                "likelihood='classification')"
            )
        return Regression(1.0 if noise_std is None else check_positive("noise_std", noise_std))
    if noise_std is not None:
        raise ValueError(
            f"Invalid noise_std: {noise_std!r} (expected None: it applies only to "
            "likelihood='regression')"
        )
    if likelihood == "classification":
        return Classification(ignore_index)
    if ignore_index is not None:
        raise ValueError(
            f"Invalid ignore_index: {ignore_index!r} (expected None: it applies only to "
            "likelihood='classification'; a callable likelihood masks its own targets)"
        )
    return CallableLikelihood(cast(Callable[[Tensor, Tensor], Tensor], likelihood))
