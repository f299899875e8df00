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
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from ..core.validation import check_positive

__all__ = ["CallableLikelihood", "Classification", "Likelihood", "Regression", "make_likelihood"]


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


class Classification(Likelihood):
    """Categorical likelihood with softmax link: ``nll = cross_entropy(logits, target)``."""

    name = "classification"

    def _check(self, output: Tensor) -> None:
        if output.dim() != 2:
            raise ValueError(
                f"Invalid model output: shape {tuple(output.shape)} (expected (batch, "
                "classes) logits for likelihood='classification')"
            )

    def nll(self, output: Tensor, target: Tensor) -> Tensor:
        """Softmax cross-entropy per example (targets: class indices or probabilities)."""
        self._check(output)
        return F.cross_entropy(output, target, reduction="none")

    def hessian_factor(self, output: Tensor, target: Tensor) -> Tensor:
        """Columns ``sqrt(p_c) (e_c - p)``: ``V V^T = diag(p) - p p^T``."""
        self._check(output)
        probs = output.detach().softmax(dim=-1)
        eye = torch.eye(probs.shape[-1], dtype=probs.dtype, device=probs.device)
        return (eye - probs.unsqueeze(-1)) * probs.sqrt().unsqueeze(-2)


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


def make_likelihood(
    likelihood: str | Callable[[Tensor, Tensor], Tensor], noise_std: float | None
) -> Likelihood:
    """Build a :class:`Likelihood` from the public ``likelihood`` and ``noise_std`` arguments."""
    if isinstance(likelihood, str):
        if likelihood == "classification":
            if noise_std is not None:
                raise ValueError(
                    f"Invalid noise_std: {noise_std!r} (expected None: it applies only to "
                    "likelihood='regression')"
                )
            return Classification()
        if likelihood == "regression":
            return Regression(1.0 if noise_std is None else check_positive("noise_std", noise_std))
    elif callable(likelihood):
        if noise_std is not None:
            raise ValueError(
                f"Invalid noise_std: {noise_std!r} (expected None: it applies only to "
                "likelihood='regression')"
            )
        return CallableLikelihood(likelihood)
    raise ValueError(
        f"Invalid likelihood: {likelihood!r} (expected 'classification', 'regression' or a "
        "callable log_likelihood(output, target) returning one value per example)"
    )
