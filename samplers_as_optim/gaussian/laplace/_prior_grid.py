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

**Outputs with positions** (``(B, *positions, K)``, classification and regression):
an observation is a position, as for ``predictive``: the bridge reads each position's
K x K block of :math:`\Sigma_f(\delta)` (:math:`R_t\,\mathrm{diag}(w)R_t^\top` from
the rows of R of position t, never the joint :math:`TK\times TK` matrix), and ``"mc"``
draws each block through its own root (ξ of shape ``(S, B, *positions, K)``) and sums
:math:`-\log\frac1S\sum_s p(y_{it}\mid f_{its})` over the positions (an ignored one
adds 0). A callable likelihood reads the whole output as one observation.

**A last layer** (the treated weights one ``nn.Linear``'s whose output is the model's,
``"diag"``, ``"kron"`` or ``"lowrank"``): each δ's precision is built as ``Laplace``
builds it and put through
:func:`~samplers_as_optim.gaussian.linearised.function_space.last_layer_covariance`,
the route ``predictive`` takes (no Jacobian: the layer's inputs are read once per
batch, then O(C d) to O(C d k + C²) per input and δ), so the Monte Carlo scores use
``predictive``'s own draws there too.

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
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from ... import predictive
from .._data_checks import check_batch
from ..flat import Treated
from ..kfac import KronCurvature
from ..likelihoods import Likelihood, Regression
from ..linearised.function_space import (
    HeadInput,
    OutputCovariance,
    last_layer_covariance,
    last_layer_inputs,
)
from ..linearised.glm_predictive import bridge_from_moments, covariance_root
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
        self._curvature = curvature
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

    def precision(self, value: Tensor) -> Any:
        r""":math:`\Lambda(\delta)` as ``Laplace`` builds it for the prior δ (0-d ``value``).

        A dict of diagonals, a ``KronPrecision`` or a ``LowRankPrecision``; None for a
        dense curvature (its last layer takes the Jacobian route).
        """
        curvature, scale = self._curvature, self._scale
        if self._lowrank is not None:
            return self._lowrank.precision(value.expand(self.treated.numel), scale, value.dtype)
        if self._kron is not None:
            priors = {
                name: torch.full_like(part, float(value))
                for name, part in self._kron.diagonal.items()
            }
            return self._kron.precision([float(value)] * len(self._kron.blocks), priors, scale)
        if isinstance(curvature, dict):
            flat = value + scale * self.treated.flatten(curvature)
            return self.treated.unflatten(flat)
        return None

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
        for value in grid:
            yield self.precision(value).factor(rotated)

    def covariances(self, rotated: Tensor, grid: Tensor, width: int) -> Iterator[Tensor]:
        r"""Per δ of ``grid``, the ``width``-square blocks of :math:`J\Lambda(\delta)^{-1}J^\top`.

        ``(C, O / width, width, width)``: :math:`R\,\mathrm{diag}(\delta + ce)^{-1}R^\top`
        in the eigenbasis, low-rank :math:`(JW_\delta)(JW_\delta)^\top`, block by block
        (``width`` = O: the whole O x O matrix).
        """
        blocks = rotated.reshape(rotated.shape[0], -1, width, rotated.shape[-1])
        if self._lowrank is None:
            weights = (grid.unsqueeze(1) + self.eigenvalues.unsqueeze(0)).reciprocal()
            return ((blocks * weight) @ blocks.mT for weight in weights)
        return self._block_products(rotated, grid, blocks.shape[:-1])

    def _block_products(self, rotated: Tensor, grid: Tensor, lead: Any) -> Iterator[Tensor]:
        for factor in self._factors(rotated, grid):
            shaped = factor.reshape(*lead, -1)
            yield shaped @ shaped.mT

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


def _draws_nll(likelihood: Likelihood, draws: Tensor, targets: Tensor) -> Tensor:
    r""":math:`-\sum\log\frac1S\sum_s p(y\mid f_s)` per observation (example or position).

    ``draws`` ``(S, B, *out)``; the observations are those of ``likelihood.token_nll``
    (each position of classification and regression outputs with positions).
    """
    count = draws.shape[0]
    repeated = targets.expand(count, *targets.shape).reshape(-1, *targets.shape[1:])
    nll = likelihood.token_nll(draws.reshape(-1, *draws.shape[2:]), repeated)
    nll = nll.reshape(count, -1)
    return -(torch.logsumexp(-nll, dim=0) - math.log(count)).sum()


def _monte_carlo_nll(
    likelihood: Likelihood, mean: Tensor, covariance: Tensor, noise: Tensor, targets: Tensor
) -> Tensor:
    r"""Draws :math:`\bar f + R\xi` per block (R as ``draw`` takes it), scored."""
    root = covariance_root(covariance)
    count = noise.shape[0]
    steps = (root @ noise.reshape(count, *covariance.shape[:-1]).unsqueeze(-1)).squeeze(-1)
    return _draws_nll(likelihood, mean + steps.reshape(count, *mean.shape), targets)


def _per_position(likelihood: Likelihood, center: Tensor) -> bool:
    """Observations per position (classification, regression) on ``(B, *positions, K)``."""
    return center.dim() > 2 and likelihood.name != "callable"


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
    one set for every δ; the other approximations draw nothing. A last layer
    (:mod:`~samplers_as_optim.gaussian.linearised.function_space`'s
    :func:`~samplers_as_optim.gaussian.linearised.function_space.last_layer_inputs`)
    takes its factored covariance, as ``predictive`` does, instead of the Jacobian.
    """
    with torch.no_grad():
        center, head = last_layer_inputs(model, basis.treated, mean_params, inputs)
        if center.dim() < 1 or center.shape[0] != inputs.shape[0]:
            raise ValueError(
                f"Invalid val_loader: inputs of shape {tuple(inputs.shape)} give outputs of "
                f"shape {tuple(center.shape)} (expected a batch of inputs, the batch first "
                "in both)"
            )
        check_batch(inputs, targets, center, likelihood)  # before any Jacobian
        noise = None
        if link_approx == "mc":
            noise = torch.randn(
                num_samples,
                *center.shape,
                generator=generator,
                dtype=center.dtype,
                device=center.device,
            )
        score = _Score(likelihood, temperature, link_approx)
        # the head's covariance is per position: not for a callable's joint observation
        if head is not None and (center.dim() <= 2 or _per_position(likelihood, center)):
            scores = _head_scores(basis, head, grid, score, center, targets, noise)
            if scores is not None:
                return scores
        return _jacobian_scores(
            model, mean_params, basis, grid, score, inputs, center, targets, noise
        )


_NOT_FINITE = (
    "Invalid model: its Jacobian at the validation inputs holds NaN or inf (expected a "
    "network differentiable at every validation input)"
)


class _Score:
    """The negative log-likelihood of one δ's predictive from what its link reads."""

    def __init__(self, likelihood: Likelihood, temperature: float, link_approx: str) -> None:
        self.likelihood, self.temperature, self.link = likelihood, temperature, link_approx
        self.closed = link_approx != "mc" and (
            isinstance(likelihood, Regression) or link_approx == "probit"
        )

    def of_variances(self, mean: Tensor, variances: Tensor, targets: Tensor) -> Tensor:
        """Regression's exact Gaussian, or the probit link, per δ: ``(G,)``."""
        likelihood = self.likelihood
        if isinstance(likelihood, Regression):
            return _regression_nll(mean, variances + likelihood.noise_std**2, targets)
        return torch.stack(
            [
                likelihood.nll(predictive.probit(mean, variance).log_softmax(-1), targets).sum()
                for variance in variances
            ]
        )

    def of_logits(self, logits: Tensor, targets: Tensor) -> Tensor:
        """Cross-entropy of a bridge's logits (soft targets allowed)."""
        return self.likelihood.nll(logits.log_softmax(-1), targets).sum()


def _head_scores(
    basis: CurvatureBasis,
    head: HeadInput,
    grid: Tensor,
    score: _Score,
    center: Tensor,
    targets: Tensor,
    noise: Tensor | None,
) -> Tensor | None:
    """Every δ through the last layer's factored covariance; None where it has none."""
    if not bool(head.features.isfinite().all()):
        raise ValueError(_NOT_FINITE)
    scores = []
    for value in grid:
        precision = basis.precision(value)
        rows: OutputCovariance | None = None
        if precision is not None:
            rows = last_layer_covariance(head, basis.treated, precision, score.temperature)
        if rows is None:
            return None
        if noise is not None:
            scores.append(_draws_nll(score.likelihood, center + rows.steps(noise), targets))
        elif score.closed:
            scores.append(score.of_variances(center, rows.diagonal().unsqueeze(0), targets)[0])
        else:
            normalize = score.link == "bridge_norm"
            logits = bridge_from_moments(center, rows.diagonal(), rows.row_sums(), normalize)
            scores.append(score.of_logits(logits, targets))
    return torch.stack(scores)


def _jacobian_scores(
    model: nn.Module,
    mean_params: dict[str, Tensor],
    basis: CurvatureBasis,
    grid: Tensor,
    score: _Score,
    inputs: Tensor,
    center: Tensor,
    targets: Tensor,
    noise: Tensor | None,
) -> Tensor:
    """Every δ from each chunk's rotated Jacobian R = J U (module docstring)."""
    batch, outputs = center.shape[0], center[0].numel()
    width = center.shape[-1] if _per_position(score.likelihood, center) else outputs
    total = center.new_zeros(grid.shape[0])
    chunks = input_chunks(batch, outputs, basis.treated.numel, center.dtype, center.device, None)
    for part in chunks:
        rotated = basis.rotate(output_jacobians(model, mean_params, inputs[part]))
        if not bool(rotated.isfinite().all()):
            raise ValueError(_NOT_FINITE)
        mean, target = center[part], targets[part]
        if score.closed:
            variances = score.temperature * basis.variances(rotated, grid)
            total += score.of_variances(mean, variances.reshape(-1, *mean.shape), target)
            continue
        for index, blocks in enumerate(basis.covariances(rotated, grid, width)):
            covariance = score.temperature * blocks
            if noise is not None:
                total[index] += _monte_carlo_nll(
                    score.likelihood, mean, covariance, noise[:, part], target
                )
                continue
            # (C, *positions, K, K) blocks, or the (C, O, O) covariance of flat outputs
            joint = width == outputs
            logits = predictive.laplace_bridge(
                mean.reshape(mean.shape[0], outputs) if joint else mean,
                covariance.reshape(mean.shape[0], outputs, outputs)
                if joint
                else covariance.reshape(*mean.shape, width),
                normalize=score.link == "bridge_norm",
            )
            total[index] += score.of_logits(logits.reshape(mean.shape), target)
    return total
