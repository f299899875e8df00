r"""Gaussian variational inference trained by any torch optimizer, in the units of docs/design.md.

The variational family is :math:`q_\phi(\theta) = \mathcal N(\mu, \Sigma)` over the treated
parameters (those with ``requires_grad=True`` when the wrapper is built): mean-field
:math:`\Sigma = \mathrm{diag}(\sigma^2)`, :math:`\sigma = \exp(\text{log\_std})`
(:class:`MeanFieldVI`), or full :math:`\Sigma = LL^\top` with L lower triangular with a
positive diagonal (:class:`FullCovarianceVI`, for small models). The prior is
:math:`p(\theta) = \mathcal N(0, \sigma_p^2 I)`, the same as ``weight_decay = 1 / (N
\sigma_p^2)`` for SGD.

**Objective.** With the tempered target :math:`p_T(\theta\mid D) \propto \big(p(D\mid
\theta)\,p(\theta)\big)^{1/T}` of docs/design.md, :math:`\frac TN \mathrm{KL}(q \,\|\, p_T)` is,
up to a constant, the mean-loss-unit objective

.. math::

    \mathcal L(\phi) = \mathbb E_q\Big[\frac1B\sum_{i\in\text{batch}} \ell_i(\theta)\Big]
    + \frac1N \Big(\mathbb E_q[-\log p(\theta)] - T\,\mathcal H(q)\Big),

:math:`\ell_i = -\log p(y_i\mid x_i,\theta)`. At T = 1 the second term is
:math:`\mathrm{KL}(q\,\|\,p)/N`: the loss is NLL + KL/N. (For T ≠ 1 it equals
:math:`\frac TN\mathrm{KL}(q\,\|\,p^{1/T})` plus a constant: the prior is tempered along
with the likelihood, as in the samplers, in :class:`~samplers_as_optim.Laplace` and in
posteriors; writing NLL + T·KL(q‖p)/N instead would temper only the likelihood, a
different target.) Its minimiser over all Gaussians, for a Gaussian target, is that
target: for Bayesian linear regression :class:`FullCovarianceVI` converges to the exact
posterior scaled by T, and :class:`MeanFieldVI` to the exact mean with variances
:math:`T / \mathrm{diag}(\Lambda)` (Λ the posterior precision).

**Gradients.** The user's forward draws :math:`\theta = \mu + \sigma\odot\varepsilon`
(or :math:`\mu + L\varepsilon`), :math:`\varepsilon\sim\mathcal N(0, I)`, so the NLL is
differentiable in φ (reparameterisation; Kingma & Welling 2014, Rezende et al. 2014).
:meth:`kl_loss` returns, by default (``stl=False``), the closed form of
:math:`\frac1N(\mathbb E_q[-\log p] - T\,\mathcal H(q))`, whose gradient is exact
(:math:`\partial\mathcal H/\partial\log\sigma_i = 1`) and bounded; only the NLL is
estimated. With ``stl=True`` it returns the single-sample estimate
:math:`\frac1N(-\log p(\theta) + T\log q_{\bar\phi}(\theta))` with φ̄ = φ with gradients
stopped, but θ still a function of φ: stick-the-landing (Roeder, Wu & Duvenaud 2017,
eq. 8), which drops the score term whose expectation is zero. Its entropy part at a draw is
:math:`\frac TN\nabla_\theta\log q_{\bar\phi}\cdot\partial\theta/\partial\phi` with
:math:`\nabla_\theta\log q_{\bar\phi} = -L^{-\top}\varepsilon`: unbiased, and it cancels the
NLL's draw-to-draw noise when q equals a Gaussian target (zero variance there: the
exactness tests use it), but its variance grows like :math:`\|L^{-1}\|^2` (sd
:math:`T/(N\sigma_i)` on :math:`\partial/\partial\mu_i` for mean-field). From a small
``init_std``, or once L is ill-conditioned, that noise swamps the data gradient: Adam,
which normalises by the gradient's RMS, then hardly moves the mean (breast-cancer
regression of ``benchmarks/bench_vi.py``, init_std 1e-3: means still 1.3 posterior sd off
after 4000 steps at lr 1e-2, against 0.07 for the closed form), and a large step amplifies
it until L is singular (lr 5e-2: the guard below stops it at step 200-300; unguarded,
cond(L) reached 1e19 and the standard deviations 2e-4 to 1e4 times the posterior's; the
closed form converges at lr 1e-1). Hence the default.

**The full-covariance factor.** :class:`FullCovarianceVI` writes

.. math::

    L = \mathrm{diag}(\sigma)\,R, \qquad R = \mathrm{diag}(1/\|u_i\|)\,U, \qquad
    U = I + \mathrm{tril}_{-1}(V), \qquad \|u_i\|^2 = 1 + \textstyle\sum_{j<i} V_{ij}^2,

:math:`u_i` the i-th row of the unit lower-triangular U. The rows of R have unit norm, so
:math:`RR^\top` is a correlation matrix and :math:`\Sigma_{ii} = \sigma_i^2`:
:math:`\sigma = e^{\text{log\_std}}` are the marginal standard deviations, exactly as in
:class:`MeanFieldVI` (V = 0 is the mean-field family), and V sets the correlations only
(V ↦ R is TensorFlow Probability's ``CorrelationCholesky`` bijector; the split into scales
and correlations is Barnard, McCulloch & Meng 2000). The map is one-to-one onto the
lower-triangular matrices with a positive diagonal: :math:`\sigma_i = \|L_{i\cdot}\|`,
:math:`V_{ij} = L_{ij}/L_{ii}`. Then :math:`L_{ii} = \sigma_i/\|u_i\|`,

.. math::

    \log\det L = \sum_i \log\sigma_i - \tfrac12\sum_i \log\Big(1 + \sum_{j<i} V_{ij}^2\Big),
    \qquad \mathrm{tr}\,\Sigma = \sum_i \sigma_i^2, \qquad
    L^{-1}(\theta - \mu) = U^{-1}\big((\theta - \mu)\odot\|u\|/\sigma\big),

the last a unit-triangular solve. Why not :math:`L = \mathrm{tril}_{-1}(M) +
\mathrm{diag}(e^{s})` (the parametrisation before issue 10)? Adam moves every coordinate
by about lr per step whatever its scale, so one step from ``init_std`` = 1e-3 at lr 1e-2
made the off-diagonal entries ten times the diagonal; forward substitution then amplifies
by about :math:`(1 + |M_{ij}|/L_{ii})^{P}` (:math:`11^{30}` for P = 31): L was numerically
singular after the first step, :math:`\log q` at the draws overflowed (objective -5e67 in
float64, -inf then NaN in float32) and the standard deviations collapsed (0.0013 times the
posterior's). Here a step of lr in log_std is a relative change of a marginal standard
deviation, a step of lr in V changes the correlations by O(lr) whatever the scales, and
:math:`\|U^{-1}\|` stays near 1 while V is small (cond(L) 1.2 after the first step at lr
1e-2).

**Guard.** No degenerate scale passes silently. With ``stl=True``, :meth:`kl_loss`
checks that the draws of the last forward, standardised by the current :math:`(\mu, L)`,
give back their own noise ε to within 0.1 (rounding leaves about
:math:`10^{-7}|\mu|/\sigma` in float32, 1e-5 at the default ``init_std``): a numerically
singular L, an underflowed standard deviation (:math:`\mu + \sigma\varepsilon = \mu`) or a
non-finite variational parameter fails it. With ``stl=False`` the diagonal of L must be
finite and positive and the objective finite (a badly conditioned L does not corrupt the
closed form, and its draws are still draws of :math:`\mathcal N(\mu, LL^\top)`). Either
failure raises ``FloatingPointError`` naming the smallest and largest :math:`L_{ii}`.

**Half precision.** For float16 or bfloat16 variational parameters (a ``.half()``
model) every sum over the P parameters (log-determinant, :math:`|\mu|^2`,
:math:`\mathrm{tr}\,\Sigma`, :math:`|\theta|^2`, :math:`|z|^2`) is taken in float32 and
:meth:`~MeanFieldVI.kl_loss` is returned in float32: in float16 the log-determinant of
the 20010 weights of ``nn.Linear(2000, 10)`` at the default ``init_std`` is -138 000,
past float16's 65504, and bfloat16 keeps 3 digits of terms that largely cancel. The
guard checks :math:`L_{ii}` as the draws use it, in the parameters' dtype: a scale that
underflows there (every draw is the mean) fails, a small but representable one does not.

**Training.** Adam at a constant learning rate leaves every variational parameter
jittering by several lr around the optimum, so the last iterate's standard deviations are
noisy and their minimum over many weights is biased low; anneal the learning rate to 0
over the run. On a 31-parameter Bayesian logistic regression (breast cancer, N = 569,
``benchmarks/bench_vi.py``, 5 seeds) :class:`FullCovarianceVI` with its defaults and Adam,
full batch, reaches standard deviations 0.89-1.03 times a long HMC run's and means within
0.07 posterior sd at lr 1e-2 cosine-annealed to 0 over 4000 steps (the best Gaussian
itself: 0.96-1.00 and 0.025), 0.92-1.02 at a constant 1e-3 over 20000 steps, but
0.77-1.06 at a constant 1e-2. Minibatch noise slows the scale's convergence (batch 32,
400 epochs, cosine from 1e-2: 0.73-1.02); :class:`MeanFieldVI` reaches its own optimum
(0.90-1.14 of its sds, means within 0.13 sd) in the same 400 epochs.

References:
    Blei, Kucukelbir & McAuliffe (2017), Variational inference: a review for statisticians.
    Roeder, Wu & Duvenaud (2017), Sticking the landing, eq. 8.
    Barnard, McCulloch & Meng (2000), Modeling covariance matrices in terms of standard
    deviations and correlations, Statistica Sinica 10, §2 (the separation strategy).
    Duffield et al. (2024), Scalable Bayesian learning with posteriors, §2 and App. A.2.
"""

from __future__ import annotations

import math
from typing import cast

import torch
from torch import Tensor, nn

from .._memory import check_dense_fits
from ._gaussian_vi import GaussianVI

__all__ = ["FullCovarianceVI", "MeanFieldVI"]

_SHARED_ARGS = r"""model: the network; its parameters with ``requires_grad=True`` are treated
            (it becomes the submodule ``model``; its treated parameters are replaced by
            draws in every call, so they get no gradients and any optimizer over
            ``vi.parameters()`` leaves them unchanged).
        num_data: the number of training examples N (required, a positive integer).
        prior_std: standard deviation of the prior N(0, prior_std**2) on every treated
            weight (required; a finite number > 0); the same as ``weight_decay = 1 /
            (num_data * prior_std**2)``. Or None: the loss you add :meth:`kl_loss` to
            already holds the prior, ``-log p(theta) / num_data`` at the draw (a Pyro
            model's log joint, say), and :meth:`kl_loss` is the entropy term alone.
        temperature: T, the target is ``(p(D | θ) p(θ)) ** (1 / T)`` (default: 1.0; a
            finite number >= 0).
        init_std: initial marginal standard deviation of every weight (default: 1e-3; a
            finite number > 0); the mean starts at the model's current weights (and the
            correlations at 0). Adam changes a log standard deviation by at most about lr
            per step, so reaching a standard deviation s takes at least
            ``|log(s / init_std)| / lr`` steps. From this small start the standard
            deviations grow slowly at T = 1 on a neural network: budget a few hundred
            epochs (on scikit-learn's digits, with ``stl=True``, Adam at 3e-2
            cosine-annealed to 0 over 200 epochs converged; a constant 1e-2 had not at
            300).
        stl: False (default): :meth:`kl_loss` is the closed-form expectation; True: the
            stick-the-landing estimate at the draws, of zero variance at a Gaussian target
            but noisy far from it (module docstring, "Gradients")."""


class MeanFieldVI(GaussianVI):
    r"""Mean-field Gaussian VI: :math:`q = \mathcal N(\mu, \mathrm{diag}(\sigma^2))`.

    .. math::

        \theta = \mu + \sigma\odot\varepsilon, \quad \sigma = e^{\text{log\_std}}, \qquad
        \text{loss} = \text{mean NLL}(\theta) + \tfrac1N\big(\mathbb E_q[-\log p] -
        T\,\mathcal H(q)\big),

    N = ``num_data``, T = ``temperature``, :math:`p = \mathcal N(0, \sigma_p^2 I)` with
    σ_p = ``prior_std`` (the second term in closed form, or, with ``stl=True``, as
    :math:`\tfrac1N(-\log p(\theta) + T\log q_{\bar\phi}(\theta))` at the draw). The
    variational parameters are the ``nn.Parameter`` lists
    ``vi.loc`` and ``vi.log_std`` (one entry per treated parameter, in
    ``named_parameters()`` order); train them with any optimizer over
    ``vi.parameters()``, and anneal its learning rate to 0 (module docstring, "Training").
    The optimum's variances are :math:`T/\mathrm{diag}(\Lambda)` for a Gaussian target of
    precision Λ, below the marginal variances :math:`T\,\mathrm{diag}(\Lambda^{-1})` when
    the weights are correlated (on the breast-cancer regression of
    ``benchmarks/bench_vi.py``: 0.43-0.71 times the posterior's standard deviations).

    Args:
        {shared_args}

    Example:
        >>> import torch
        >>> import torch.nn.functional as F
        >>> from samplers_as_optim.gaussian.vi import MeanFieldVI
        >>> _ = torch.manual_seed(0)
        >>> x = torch.randn(256, 3)
        >>> y = x @ torch.tensor([[1.0], [-2.0], [0.5]]) + 0.3 * torch.randn(256, 1)
        >>> vi = MeanFieldVI(torch.nn.Linear(3, 1), num_data=256, prior_std=1.0)
        >>> optimizer = torch.optim.Adam(vi.parameters(), lr=0.05)
        >>> for step in range(150):
        ...     optimizer.zero_grad()
        ...     nll = F.mse_loss(vi(x), y) / (2 * 0.3**2)  # Gaussian NLL, noise 0.3
        ...     loss = nll + vi.kl_loss()
        ...     loss.backward()
        ...     optimizer.step()
        >>> vi.mean["weight"].round(decimals=1)
        tensor([[ 1.0000, -2.0000,  0.5000]])
        >>> vi.predict(x[:2], num_samples=5).shape
        torch.Size([5, 2, 1])
    """

    def _init_variational_parameters(self, model: nn.Module) -> None:
        current = self.treated.current(model)
        self.loc = nn.ParameterList([nn.Parameter(current[name]) for name in self.treated.names])
        self.log_std = nn.ParameterList(
            [
                nn.Parameter(torch.full_like(current[name], math.log(self.init_std)))
                for name in self.treated.names
            ]
        )

    def _flat_mean(self) -> Tensor:
        return torch.cat([loc.reshape(-1) for loc in self.loc])

    def _mean_parts(self) -> list[Tensor]:
        return list(self.loc)

    def _log_std_parts(self) -> list[Tensor]:
        return list(self.log_std)

    def _flat_log_std(self) -> Tensor:
        return torch.cat([log_std.reshape(-1) for log_std in self.log_std])

    def _flat_std(self) -> Tensor:
        return self._flat_log_std().exp()

    def _transform(self, noise: Tensor) -> Tensor:
        return self._flat_mean() + self._flat_log_std().exp() * noise

    def _standardise_stopped(self, flat: Tensor) -> tuple[Tensor, Tensor]:
        dtype = self._reduction_dtype()
        log_std = self._flat_log_std().detach().to(dtype)
        z = (flat.to(dtype) - self._flat_mean().detach().to(dtype)) * torch.exp(-log_std)
        return z, log_std.sum()

    def _scale_diagonal(self) -> Tensor:
        return self._flat_log_std().detach().exp()

    def _log_det_scale(self) -> Tensor:
        dtype = self._reduction_dtype()
        return torch.stack([part.to(dtype).sum() for part in self.log_std]).sum()


class FullCovarianceVI(GaussianVI):
    r"""Full-covariance Gaussian VI: :math:`q = \mathcal N(\mu, LL^\top)`, for small models.

    .. math::

        \theta = \mu + L\varepsilon, \quad L = \mathrm{diag}(\sigma)\,R, \quad
        \sigma = e^{\text{log\_std}}, \quad R = \text{rows of } I +
        \mathrm{tril}_{-1}(\text{corr\_offdiag}) \text{ scaled to unit norm},

    with the loss of :class:`MeanFieldVI`: σ are the marginal standard deviations and
    :math:`RR^\top` the correlation matrix (module docstring, "The full-covariance
    factor"). Parameters: ``vi.loc`` (P,), ``vi.log_std`` (P,) and ``vi.corr_offdiag`` (the
    P(P-1)/2 strictly-lower entries of V, row-major), P the number of treated scalars in
    ``named_parameters()`` order; train them with any optimizer, and anneal its learning
    rate to 0 (module docstring, "Training"). Refused, naming the size, when a P x P
    matrix cannot fit in memory.

    Args:
        {shared_args}

    Example:
        >>> import torch
        >>> from samplers_as_optim.gaussian.vi import FullCovarianceVI
        >>> vi = FullCovarianceVI(torch.nn.Linear(3, 1), num_data=100, prior_std=1.0)
        >>> vi.covariance.shape
        torch.Size([4, 4])
    """

    def _init_variational_parameters(self, model: nn.Module) -> None:
        current = self.treated.flatten(self.treated.current(model))
        size = self.treated.numel
        check_dense_fits(
            size,
            current.dtype,
            current.device,
            subject=f"model: {type(model).__name__} for FullCovarianceVI",
            alternative="MeanFieldVI",
        )
        self.loc = nn.Parameter(current)
        self.log_std = nn.Parameter(torch.full_like(current, math.log(self.init_std)))
        self.corr_offdiag = nn.Parameter(current.new_zeros(size * (size - 1) // 2))

    def _flat_mean(self) -> Tensor:
        return self.loc

    def _mean_parts(self) -> list[Tensor]:
        return [self.loc]

    def _log_std_parts(self) -> list[Tensor]:
        return [self.log_std]

    def _flat_std(self) -> Tensor:
        return self.log_std.exp()

    def _factors(self) -> tuple[Tensor, Tensor]:
        """U = I + tril_-1(V) and log ||u_i|| = 0.5 log(1 + sum_j V_ij^2), differentiable.

        U in the parameters' dtype, the row sums log ||u_i|| in the reduction dtype.
        """
        size = self.treated.numel
        rows, cols = torch.tril_indices(size, size, -1, device=self.loc.device)
        lower = self.loc.new_zeros(size, size).index_put((rows, cols), self.corr_offdiag)
        log_norms = 0.5 * torch.log1p(lower.to(self._reduction_dtype()).square().sum(1))
        return lower + torch.eye(size, dtype=lower.dtype, device=lower.device), log_norms

    def _log_diagonal(self, log_norms: Tensor) -> Tensor:
        """The log-diagonal of L, log_std_i - log ||u_i||, in the reduction dtype."""
        return self.log_std.to(log_norms.dtype) - log_norms

    def scale_tril(self) -> Tensor:
        r"""The lower-triangular L with :math:`LL^\top = \Sigma`, differentiable."""
        unit, log_norms = self._factors()
        return torch.exp(self._log_diagonal(log_norms)).to(unit.dtype)[:, None] * unit

    @property
    def covariance(self) -> Tensor:
        r""":math:`\Sigma = LL^\top`, (P, P), detached."""
        scale = self.scale_tril().detach()
        return scale @ scale.T

    def _transform(self, noise: Tensor) -> Tensor:
        return self.loc + noise @ self.scale_tril().T

    def _standardise_stopped(self, flat: Tensor) -> tuple[Tensor, Tensor]:
        unit, log_norms = (t.detach() for t in self._factors())
        dtype = log_norms.dtype
        log_diagonal = self._log_diagonal(log_norms).detach()  # log L_ii
        centred = (flat.to(dtype) - self.loc.detach().to(dtype)) * torch.exp(-log_diagonal)
        z = torch.linalg.solve_triangular(
            unit.to(dtype), centred.T, upper=False, unitriangular=True
        )
        return z.T, log_diagonal.sum()

    def _scale_diagonal(self) -> Tensor:
        _, log_norms = self._factors()
        return torch.exp(self._log_diagonal(log_norms)).detach().to(self.loc.dtype)

    def _log_det_scale(self) -> Tensor:
        _, log_norms = self._factors()
        return self._log_diagonal(log_norms).sum()


for _cls in (MeanFieldVI, FullCovarianceVI):
    _cls.__doc__ = cast(str, _cls.__doc__).replace("{shared_args}", _SHARED_ARGS)
