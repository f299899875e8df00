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

__all__ = [
    "CallableLikelihood",
    "Classification",
    "Likelihood",
    "Regression",
    "check_noise_argument",
    "check_noise_std",
    "make_likelihood",
]


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
    """Categorical likelihood with softmax link: ``nll = cross_entropy(logits, target)``."""

    name = "classification"

    def _check(self, output: Tensor) -> None:
        if output.dim() != 2:
            raise ValueError(
                f"Invalid model output: shape {tuple(output.shape)} (expected (batch, "
                "classes) logits for likelihood='classification')"
            )

    def nll(self, output: Tensor, target: Tensor) -> Tensor:
        """Softmax cross-entropy per example (targets: class indices or probabilities).

        Class indices of any integer dtype are read as int64 (torch's cross-entropy takes
        int64 and uint8 only); :meth:`check_targets` validates them.
        """
        self._check(output)
        if not (target.is_floating_point() or target.dtype in (torch.int64, torch.uint8)):
            target = target.long()
        return F.cross_entropy(output, target, reduction="none")

    def target_flag(self, output: Tensor, target: Tensor) -> Tensor | None:
        """Class indices of an integer dtype in ``[0, classes)``, or probabilities.

        Probabilities are floating targets of the output's shape ``(batch, classes)``
        (not checked further); anything else must be ``(batch,)`` integers (not bool),
        whose range is the flag.

        Raises:
            ValueError: naming the targets' dtype or shape and what is expected.
        """
        self._check(output)
        batch, classes = output.shape
        if target.is_floating_point() and target.shape == output.shape:
            return None
        expected = (
            f"expected class indices of an integer dtype, shape ({batch},), in [0, "
            f"{classes}), or class probabilities of the output's shape {tuple(output.shape)}"
        )
        if target.is_floating_point() or target.is_complex() or target.dtype == torch.bool:
            raise ValueError(
                f"Invalid targets: dtype {target.dtype} of shape {tuple(target.shape)} ({expected})"
            )
        if target.shape != (batch,):
            raise ValueError(f"Invalid targets: shape {tuple(target.shape)} ({expected})")
        return ((target >= 0) & (target < classes)).all()

    def _refuse_values(self, output: Tensor, target: Tensor) -> None:
        batch, classes = output.shape
        example = int(((target < 0) | (target >= classes)).nonzero()[0, 0])
        raise ValueError(
            f"Invalid targets: class index {int(target[example])} in example {example} of "
            f"{batch} (expected 0 <= targets < {classes}, the number of model outputs)"
        )

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
