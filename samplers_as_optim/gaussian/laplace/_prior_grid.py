r"""A grid of scalar prior precisions scored by the GLM predictive, the Jacobians reused.

For one prior precision δ on every treated weight, the fitted precision is
:math:`\Lambda(\delta) = \delta I + cC`, with C the curvature :meth:`Laplace.fit
<samplers_as_optim.gaussian.laplace.Laplace.fit>` kept without the prior and c its scale
at the current regression noise (:func:`._evidence.curvature_scale`). C has an
eigenbasis that does not depend on δ, :math:`C = U\mathrm{diag}(e)U^\top`:

* ``"diag"``: U = I, e the curvature diagonal;
* ``"dense"``: one ``eigh`` of the (P, P) curvature, in float64 (float32 loses the small
  eigenvalues, which dominate the variances at a small δ), e clipped at 0 (round-off);
* ``"kron"``: per layer :math:`U = Q_G\otimes Q_A`, :math:`e = \lambda_G\otimes\lambda_A`
  (:mod:`~samplers_as_optim.gaussian.kfac`), U = I with the diagonal curvature for the
  other treated tensors.

So the function-space covariance of the linearised network (Immer, Korzepa & Bauer 2021,
eq. 7; :mod:`~samplers_as_optim.gaussian.linearised.function_space`) is, for every δ,

.. math::

    \Sigma_f(\delta) = T\,R\,\mathrm{diag}\Big(\frac{1}{\delta + c\,e}\Big)R^\top,
    \qquad R = J(x)\,U,

and R (the Jacobian J, O reverse passes per input, and its rotation) is computed once
per validation chunk; each δ then costs the marginal variances
:math:`T\,(R\circ R)(\delta + ce)^{-1}`, one matrix product for the whole grid (probit
and regression, whose predictive needs only the variances), or the full O x O covariance
:math:`T(R\,\mathrm{diag}\,w)R^\top` (the Laplace bridge and Monte Carlo).

A low-rank curvature (``"lowrank"``, :mod:`._lowrank`) has no eigenbasis common to
every δ (its diagonal part :math:`\delta + cD` is not a multiple of I), so R = J and
each δ builds its precision :math:`\Lambda(\delta) = \delta I + c(D + U\mathrm{diag}(s)
U^\top)` from the stored pairs (O(kP) and one k x k eigendecomposition) and applies its
square root W, :math:`\Sigma_f(\delta) = T(JW)(JW)^\top`: O(kP) per output row and δ,
still without a pass over the training data or a new Jacobian.

The score of δ is the validation negative log-likelihood of the GLM predictive
(Daxberger et al. 2021, §2; laplace-torch's ``gridsearch`` scores
``pred_type="glm", link_approx="probit"`` by default), summed over the examples:

* regression: :math:`\sum_{i,o}\tfrac12\log(2\pi v_{io}) + (y_{io}-\bar f_{io})^2/(2v_{io})`,
  :math:`v = \mathrm{diag}\,\Sigma_f + \sigma^2`, the exact Gaussian predictive;
* classification: :math:`-\sum_i\log p_{i,y_i}` with p the closed form of
  ``link_approx`` (``"probit"``: :math:`\mathrm{softmax}(\bar f/\sqrt{1 + \tfrac\pi8
  \mathrm{diag}\,\Sigma_f})`; ``"bridge"``/``"bridge_norm"``: the Laplace bridge's mean),
  cross-entropy with soft targets;
* ``link_approx="mc"`` (any likelihood, a callable one included):
  :math:`-\sum_i\log\frac1S\sum_s p(y_i\mid f_{is})` with
  :math:`f_{\cdot s} = \bar f + \mathrm{root}(\Sigma_f(\delta))\,\xi_s`; the standard
  normal :math:`\xi` of batch b come from a generator seeded with b, the same for every δ
  (common random numbers), drawn as
  :func:`~samplers_as_optim.gaussian.linearised.glm_predictive.draw` draws them, so they are those
  of ``Laplace.predictive(x, link_approx="mc", generator=torch.Generator().manual_seed(b))``.

These equal, up to round-off, the scores of setting ``prior_precision`` to each δ and
calling :meth:`~samplers_as_optim.Laplace.predictive` (which refits the precision and
recomputes the Jacobians for every δ), which is what the tests check.

References:
    Immer, Korzepa & Bauer (2021), Improving predictions of Bayesian neural nets via
    local linearization, eq. 7.
    Daxberger et al. (2021), Laplace Redux — effortless Bayesian deep learning, §2 and §4.
    MacKay (1992), The evidence framework applied to classification networks.
    Hobbhahn, Kristiadi & Hennig (2022), Fast predictive uncertainty for classification
    with Bayesian deep networks.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import cast

import torch
from torch import Tensor, nn
from torch.func import functional_call

from ... import predictive
from .._data_checks import check_batch
from .._wide_linalg import eigh
from ..flat import Treated
from ..kfac import KronCurvature
from ..likelihoods import Likelihood, Regression
from ..linearised.output_jacobians import input_chunks, output_jacobians
from ._evidence import FitTerms, curvature_scale
from ._lowrank import LowRankCurvature

__all__ = ["CurvatureBasis", "batch_scores"]


class CurvatureBasis:
    r"""U and c·e of the fitted curvature :math:`cC = U\mathrm{diag}(ce)U^\top`.

    A low-rank curvature has none: there :meth:`rotate` is J and each δ builds its
    precision (module docstring).

    Attributes:
        eigenvalues: ``(P,)`` c·e, in the order of the columns of :meth:`rotate` (empty
            for a low-rank curvature).
    """

    def __init__(self, terms: FitTerms, treated: Treated, noise_std: float | None) -> None:
        scale = float(curvature_scale(terms, noise_std))
        curvature = terms.curvature
        self.treated = treated
        self._scale = scale
        self._kron: KronCurvature | None = None
        self._vectors: Tensor | None = None
        self._lowrank: LowRankCurvature | None = None
        if isinstance(curvature, LowRankCurvature):
            self._lowrank = curvature
            self.eigenvalues = curvature.diagonal.new_zeros(0)
        elif isinstance(curvature, KronCurvature):
            self._kron = curvature
            parts = [
                torch.outer(block.g_eigenvalues, block.a_eigenvalues).reshape(-1)
                for block in curvature.blocks
            ]
            parts += [value.reshape(-1) for value in curvature.diagonal.values()]
            self.eigenvalues = scale * torch.cat(parts)
        elif isinstance(curvature, dict):
            self.eigenvalues = scale * treated.flatten(curvature)
        else:
            # in float64 (where the device has it): a float32 eigh loses the small
            # eigenvalues that dominate the variances at a small prior precision
            wide = torch.float32 if curvature.device.type == "mps" else torch.float64
            values, vectors = torch.linalg.eigh(curvature.to(wide))
            self._vectors = vectors.to(curvature.dtype)
            self.eigenvalues = (scale * values.clamp(min=0.0)).to(curvature.dtype)

    def rotate(self, jacobians: dict[str, Tensor]) -> Tensor:
        """R = J U: ``(C, O, P)`` from the Jacobians name -> ``(C, O, *shape)``."""
        if self._kron is not None:
            first = jacobians[self.treated.names[0]]
            lead = first.shape[:2]
            parts = [
                (
                    block.g_eigenvectors.T @ block.matrix(jacobians, 2) @ block.a_eigenvectors
                ).reshape(*lead, -1)
                for block in self._kron.blocks
            ]
            parts += [jacobians[name].reshape(*lead, -1) for name in self._kron.diagonal]
            return torch.cat(parts, dim=-1)
        flat = self.treated.flatten(jacobians, batch_dims=2)
        return flat if self._vectors is None else flat @ self._vectors

    def _factors(self, rotated: Tensor, grid: Tensor) -> Iterator[Tensor]:
        r"""Low-rank: per δ, :math:`JW_\delta` (:meth:`~._lowrank.LowRankPrecision.factor`)."""
        assert self._lowrank is not None
        size, lowrank = self.treated.numel, self._lowrank
        for value in grid:
            precision = lowrank.precision(value.expand(size), self._scale, rotated.dtype)
            yield precision.factor(rotated)

    def covariances(self, rotated: Tensor, grid: Tensor) -> Iterator[Tensor]:
        r"""Per δ of ``grid`` in turn, :math:`J\Lambda(\delta)^{-1}J^\top` ``(C, O, O)``.

        :math:`R\,\mathrm{diag}(\delta + ce)^{-1}R^\top` in the eigenbasis; low-rank
        :math:`(JW_\delta)(JW_\delta)^\top`.
        """
        if self._lowrank is None:
            weights = (grid.unsqueeze(1) + self.eigenvalues.unsqueeze(0)).reciprocal()
            return ((rotated * weight) @ rotated.mT for weight in weights)
        return (factor @ factor.mT for factor in self._factors(rotated, grid))

    def variances(self, rotated: Tensor, grid: Tensor) -> Tensor:
        r""":math:`\mathrm{diag}(J\Lambda(\delta)^{-1}J^\top)` per δ: ``(G, C·O)``.

        In the eigenbasis one product for the whole grid,
        :math:`(R\circ R)(\delta + ce)^{-1}`; low-rank: the rows of :math:`JW_\delta`.
        """
        if self._lowrank is None:
            weights = (grid.unsqueeze(1) + self.eigenvalues.unsqueeze(0)).reciprocal()
            squares = rotated.square().reshape(-1, rotated.shape[-1])
            return (squares @ weights.T).T
        return torch.stack(
            [factor.square().sum(-1).reshape(-1) for factor in self._factors(rotated, grid)]
        )


def _regression_nll(mean: Tensor, variance: Tensor, targets: Tensor) -> Tensor:
    r""":math:`\sum_{i,o}\tfrac12\log(2\pi v) + (y-\bar f)^2/(2v)` per δ: ``(G,)``."""
    residual = (targets - mean).reshape(1, mean.shape[0], -1)
    variance = variance.reshape(-1, *residual.shape[1:])
    return 0.5 * (torch.log(2 * math.pi * variance) + residual.square() / variance).sum((1, 2))


def _monte_carlo_nll(
    likelihood: Likelihood, mean: Tensor, covariance: Tensor, noise: Tensor, targets: Tensor
) -> Tensor:
    r""":math:`-\sum_i\log\frac1S\sum_s p(y_i\mid\bar f_i + \mathrm{root}_i\,\xi_{is})`."""
    values, vectors = eigh(covariance)  # in float32 for half precision
    root = vectors * values.clamp(min=0.0).sqrt().unsqueeze(-2)
    steps = torch.einsum("bij,sbj->sbi", root, noise)
    count = noise.shape[0]
    draws = mean + steps.reshape(count, *mean.shape)
    # every draw of every input as one batch of S·C examples
    repeated = targets.expand(count, *targets.shape).reshape(-1, *targets.shape[1:])
    nll = likelihood.nll(draws.reshape(-1, *mean.shape[1:]), repeated).reshape(count, -1)
    return -(torch.logsumexp(-nll, dim=0) - math.log(count)).sum()


def batch_scores(
    model: nn.Module,
    mean_params: dict[str, Tensor],
    basis: CurvatureBasis,
    likelihood: Likelihood,
    grid: Tensor,
    temperature: float,
    inputs: Tensor,
    targets: Tensor,
    link_approx: str,
    num_samples: int,
    generator: torch.Generator | None,
) -> Tensor:
    """One validation batch's negative log-likelihood for every δ of ``grid``: ``(G,)``.

    The model runs as it is (call it in eval mode). For ``link_approx="mc"`` the batch's
    ``(S, B, O)`` standard normal draws come from ``generator`` (S = ``num_samples``),
    one set for every δ; the other approximations draw nothing.
    """
    full = link_approx == "mc" or (likelihood.name == "classification" and link_approx != "probit")
    with torch.no_grad():
        center = cast(Tensor, functional_call(model, mean_params, (inputs,)))
        if center.dim() < 1 or center.shape[0] != inputs.shape[0]:
            raise ValueError(
                f"Invalid val_loader: inputs of shape {tuple(inputs.shape)} give outputs of "
                f"shape {tuple(center.shape)} (expected a batch of inputs, the batch first "
                "in both)"
            )
        check_batch(inputs, targets, center, likelihood)  # before any Jacobian
        batch, outputs = center.shape[0], center[0].numel()
        noise = None
        if link_approx == "mc":
            noise = torch.randn(
                num_samples,
                batch,
                outputs,
                generator=generator,
                dtype=center.dtype,
                device=center.device,
            )
        total = center.new_zeros(grid.shape[0])
        chunks = input_chunks(
            batch, outputs, basis.treated.numel, center.dtype, center.device, None
        )
        for part in chunks:
            rotated = basis.rotate(output_jacobians(model, mean_params, inputs[part]))
            if not bool(rotated.isfinite().all()):
                raise ValueError(
                    "Invalid model: its Jacobian at the validation inputs holds NaN or inf "
                    "(expected a network differentiable at every validation input)"
                )
            mean, target = center[part], targets[part]
            if full:
                total += _full_covariance_nll(
                    likelihood,
                    mean,
                    basis.covariances(rotated, grid),
                    temperature,
                    target,
                    link_approx,
                    None if noise is None else noise[:, part],
                )
                continue
            variances = temperature * basis.variances(rotated, grid).reshape(-1, *mean.shape)
            if isinstance(likelihood, Regression):
                total += _regression_nll(mean, variances + likelihood.noise_std**2, target)
            else:
                for index, variance in enumerate(variances):
                    logits = predictive.probit(mean, variance)
                    total[index] += likelihood.nll(logits.log_softmax(-1), target).sum()
    return total


def _full_covariance_nll(
    likelihood: Likelihood,
    mean: Tensor,
    covariances: Iterable[Tensor],
    temperature: float,
    targets: Tensor,
    link_approx: str,
    noise: Tensor | None,
) -> Tensor:
    r"""Per δ, :math:`\Sigma_f = T J\Lambda(\delta)^{-1}J^\top`, through the bridge or MC."""
    scores = []
    for part in covariances:
        covariance = temperature * part
        if link_approx == "mc":
            assert noise is not None
            scores.append(_monte_carlo_nll(likelihood, mean, covariance, noise, targets))
        else:
            logits = predictive.laplace_bridge(
                mean, covariance, normalize=link_approx == "bridge_norm"
            )
            scores.append(likelihood.nll(logits.log_softmax(-1), targets).sum())
    return torch.stack(scores)
