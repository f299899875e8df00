r"""The extended Kalman filter over a network's weights: an online Gaussian posterior.

The weights are the state of a Kalman filter (Ollivier 2018; Singhal & Wu 1989), each
minibatch :math:`B_t` an observation. With the Gaussian :math:`\mathcal N(\mu_{t-1},
\Lambda_{t-1}^{-1})` after t-1 batches, :meth:`ExtendedKalmanFilter.update` does

1. **predict** (the transition, ``decay`` γ in (0, 1]; None means 1, static weights):
   :math:`\mu^- = \mu_{t-1}`, :math:`\Lambda^- = \gamma\,\Lambda_{t-1}` — the weights
   drift by :math:`w_t \sim \mathcal N(0, (1/\gamma - 1)\Lambda_{t-1}^{-1})`, the "fading
   memory" filter that forgets old batches geometrically (Ollivier 2018, §2.3);
2. **update** (the observation, linearised at :math:`\mu^-`, in information form):

   .. math::

       \Lambda_t = \Lambda^- + \sum_{i\in B_t} C_i(\mu^-), \qquad
       \mu_t = \mu^- - \Lambda_t^{-1} \sum_{i\in B_t}\nabla\ell_i(\mu^-),

   with :math:`\ell_i = -\log p(y_i\mid x_i,\theta)` and :math:`C_i` the GGN
   :math:`J_i^\top H_i J_i` — the Fisher information of the exponential-family
   likelihoods here, which makes this the EKF of Ollivier (2018, Thm. 2), one natural
   gradient step with learning rate 1/(t + prior) per observation — or the empirical
   Fisher (``curvature="ef"``). For a model linear in its weights with a Gaussian
   likelihood the linearisation is exact, :math:`C_i` is the exact Hessian, and the
   update is the Kalman filter: after one pass over the data in minibatches (γ = 1) the
   state is the conjugate posterior, whatever the batching. ``"diag"`` keeps the
   diagonal of :math:`\Lambda` (Chang et al. 2022's diagonal EKF; exact only when the
   batches' curvatures are diagonal), ``"dense"`` all of it (P x P).

The initial state is the prior :math:`\mathcal N(\theta_0, \Lambda_0^{-1})`, centred at
the model's weights at construction (zero them first for a zero-mean prior) with
``prior_precision`` :math:`\Lambda_0`. ``temperature`` T multiplies the covariance as
everywhere in the package (the tempered posterior :math:`p^{1/T}` of a linear-Gaussian
model has the same mean and T times the covariance). After each update the mean is
written into the model's treated parameters, so the model predicts with the current
mean; the filter's own state (``mean``), not the model, is what the next update starts
from. Sampling, ``log_prob``/``penalty`` and the sampled and linearised predictive are
those of :class:`~samplers_as_optim.Laplace`.

References:
    Ollivier (2018), Online natural gradient as a Kalman filter. Electronic Journal of
    Statistics 12(2).
    Singhal & Wu (1989), Training multilayer perceptrons with the extended Kalman
    algorithm. NeurIPS.
    Chang, Murphy & Jones (2022), On diagonal approximations to the extended Kalman
    filter for online training of Bayesian neural networks.
    Duffield et al. (2024), Scalable Bayesian learning with posteriors, §2 (``ekf``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call

from ._curvature import dense_curvature, diag_curvature
from ._likelihoods import make_likelihood
from ._memory import check_dense_fits
from ._validation import check_choice
from .laplace import Precision, _Gaussian, _split_batch, select_subset

__all__ = ["ExtendedKalmanFilter"]


def _check_decay(decay: Any) -> float:
    if decay is None:
        return 1.0
    expected = "expected None or a number in (0, 1]"
    if isinstance(decay, bool) or not isinstance(decay, (int, float)):
        raise TypeError(f"Invalid decay: {decay!r} ({expected})")
    if not (math.isfinite(decay) and 0.0 < decay <= 1.0):
        raise ValueError(f"Invalid decay: {decay!r} ({expected})")
    return float(decay)


class ExtendedKalmanFilter(_Gaussian):
    r"""Online Gaussian posterior :math:`\mathcal N(\mu_t, T\Lambda_t^{-1})` by minibatch EKF.

    .. math::

        \Lambda_t = \gamma\Lambda_{t-1} + \sum_{i\in B_t} C_i(\mu_{t-1}), \qquad
        \mu_t = \mu_{t-1} - \Lambda_t^{-1}\sum_{i\in B_t}\nabla\ell_i(\mu_{t-1}),

    starting from :math:`\mathcal N(\theta_0, \Lambda_0^{-1})` (see
    :mod:`samplers_as_optim.ekf`).

    Args:
        model: the network; its treated parameters (``requires_grad=True``, or
            ``subset``) start the prior mean and receive the filter's mean after each
            update.
        likelihood: ``"classification"``, ``"regression"`` (Gaussian, ``noise_std``) or a
            callable ``log_likelihood(output, target)`` with one value per example, as
            for :class:`~samplers_as_optim.Laplace`.
        structure: ``"diag"`` (default) or ``"dense"`` (P x P; refused with the size when
            it cannot fit in memory).
        prior_precision: :math:`\Lambda_0` (default 1.0): a finite number > 0, a dict of
            per-weight precisions, or with ``"dense"`` a P x P positive-definite matrix
            (e.g. a fitted Laplace's ``precision``).
        noise_std: σ for ``likelihood="regression"`` (default None: 1.0).
        curvature: ``"ggn"`` (default; the Fisher) or ``"ef"`` (the empirical Fisher).
        decay: γ, the transition: the precision is multiplied by γ before each update
            (default None: 1, no forgetting; a number in (0, 1]).
        temperature: T, multiplies the covariance (default 1.0; >= 0).
        subset: as for :class:`~samplers_as_optim.Laplace`: ``"last_layer"`` or a list of
            parameter names (default None: every parameter with ``requires_grad``).

    Example:
        >>> import torch
        >>> from samplers_as_optim import ExtendedKalmanFilter
        >>> _ = torch.manual_seed(0)
        >>> model = torch.nn.Linear(3, 1)
        >>> ekf = ExtendedKalmanFilter(model, likelihood="regression", structure="dense")
        >>> x = torch.randn(32, 3)
        >>> y = x @ torch.tensor([[1.0], [-1.0], [0.5]])
        >>> for start in range(0, 32, 8):
        ...     _ = ekf.update((x[start : start + 8], y[start : start + 8]))
        >>> ekf.mean["weight"].shape, ekf.covariance.shape
        (torch.Size([1, 3]), torch.Size([4, 4]))
        >>> torch.equal(model.weight, ekf.mean["weight"])
        True
    """

    _not_fitted = "ExtendedKalmanFilter has no state"  # never raised: the prior is a state

    def __init__(
        self,
        model: nn.Module,
        *,
        likelihood: str | Callable[[Tensor, Tensor], Tensor],
        structure: str = "diag",
        prior_precision: Precision = 1.0,
        noise_std: float | None = None,
        curvature: str = "ggn",
        decay: float | None = None,
        temperature: float = 1.0,
        subset: str | Sequence[str] | None = None,
    ) -> None:
        self.treated = select_subset(model, subset)
        self.model = model
        self.likelihood = make_likelihood(likelihood, noise_std)
        #: The Gaussian noise scale of ``likelihood="regression"`` (None otherwise).
        self.noise_std: float | None = getattr(self.likelihood, "noise_std", None)
        self.curvature = check_choice("curvature", curvature, ("ggn", "ef"))
        self.structure = check_choice("structure", structure, ("diag", "dense"))
        self.decay = _check_decay(decay)
        self.temperature = temperature
        reference = self._reference()
        if self.structure == "dense":
            check_dense_fits(self.treated.numel, reference.dtype, reference.device)
        self.prior_precision = self._check_prior(prior_precision)
        #: Number of updates so far.
        self.steps = 0
        self._mean = self.treated.current(model)
        prior = self._prior_flat()
        if self.structure == "dense":
            self._set_dense(prior.clone())
        else:
            self._precision = self.treated.unflatten(prior.clone())
            self._cholesky = None

    def _set_dense(self, precision: Tensor) -> None:
        precision = 0.5 * (precision + precision.T)
        cholesky, info = torch.linalg.cholesky_ex(precision)
        if info != 0:
            raise ValueError(
                "Invalid precision: the filtered dense precision is not positive definite "
                f"in {precision.dtype} (expected prior_precision large enough to dominate "
                "round-off; increase it or use float64)"
            )
        self._precision, self._cholesky = precision, cholesky

    def _write_mean(self) -> None:
        assert self._mean is not None
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name in self.treated.names:
                params[name].copy_(self._mean[name])

    def update(self, batch: Any) -> Tensor:
        r"""One predict-update step on a minibatch ``(inputs, targets)``.

        The curvature and gradient are taken at the filter's mean (written into the model
        first) with the model in eval mode (its mode is restored). Afterwards the model's
        treated parameters hold the new mean.

        Args:
            batch: a pair ``(inputs, targets)`` (moved to the parameters' device).

        Returns:
            :math:`\sum_{i\in B_t}\ell_i(\mu_{t-1})`, the batch's negative log-likelihood
            under the predicted mean (the prequential loss), detached.
        """
        inputs, targets = _split_batch(batch)
        ref = self._reference()
        inputs, targets = inputs.to(ref.device), targets.to(ref.device)
        mean, precision = self._fitted()
        self._write_mean()
        training = self.model.training
        self.model.eval()
        try:
            params = {name: mean[name].detach().requires_grad_(True) for name in mean}
            with torch.enable_grad():
                output = functional_call(self.model, params, (inputs,))
                nll = self.likelihood.nll(output, targets).sum()
                grads = torch.autograd.grad(nll, [params[n] for n in self.treated.names])
            gradient = torch.cat([g.reshape(-1) for g in grads])
            if self.structure == "dense":
                curv = dense_curvature(
                    self.model, self.treated, inputs, targets, self.likelihood, self.curvature
                )
            else:
                part = diag_curvature(
                    self.model, self.treated, inputs, targets, self.likelihood, self.curvature
                )
                curv = self.treated.flatten(part)
        finally:
            self.model.train(training)
        flat_mean = self.treated.flatten(mean)
        if self.structure == "dense":
            assert isinstance(precision, Tensor)
            self._set_dense(self.decay * precision + curv)
            assert self._cholesky is not None
            step = torch.cholesky_solve(gradient.unsqueeze(-1), self._cholesky).squeeze(-1)
        else:
            assert isinstance(precision, dict)
            diag = self.decay * self.treated.flatten(precision) + curv
            self._precision = self.treated.unflatten(diag)
            step = gradient / diag
        new_mean = self.treated.unflatten(flat_mean - step)
        self._mean = {name: value.detach().clone() for name, value in new_mean.items()}
        self._write_mean()
        self.steps += 1
        return nll.detach()
