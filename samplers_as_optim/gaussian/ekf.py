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

from ..core.validation import check_choice
from ._memory import check_dense_fits
from ._per_example_curvature import dense_curvature, diag_curvature
from ._weight_gaussian import Precision, _Gaussian, _split_batch, evaluating, select_subset
from .likelihoods import make_likelihood

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


def _factor(precision: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The symmetrised dense precision, its Cholesky factor and LAPACK's ``info`` (0: ok)."""
    precision = 0.5 * (precision + precision.T)
    cholesky, info = torch.linalg.cholesky_ex(precision)
    return precision, cholesky, info


def _not_positive_definite(dtype: torch.dtype) -> str:
    return (
        "Invalid precision: the filtered dense precision is not positive definite "
        f"in {dtype} (expected prior_precision large enough to dominate "
        "round-off; increase it or use float64)"
    )


def _may_be_non_finite(tensor: Tensor) -> bool:
    """Whether ``tensor`` can hold NaN or ±inf at all (integer and bool tensors cannot)."""
    return tensor.is_floating_point() or tensor.is_complex()


def _non_finite_kind(tensor: Tensor) -> str | None:
    """``"nan"``, ``"inf"`` or ``"-inf"``: the first kind of non-finite value present, if any.

    Reads back to the host; for error messages only.
    """
    if not _may_be_non_finite(tensor):
        return None
    tensor = tensor.detach()
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
    if bool(torch.isnan(tensor).any()):
        return "nan"
    if bool(torch.isposinf(tensor).any()):
        return "inf"
    if bool(torch.isneginf(tensor).any()):
        return "-inf"
    return None


class ExtendedKalmanFilter(_Gaussian):
    r"""Online Gaussian posterior :math:`\mathcal N(\mu_t, T\Lambda_t^{-1})` by minibatch EKF.

    .. math::

        \Lambda_t = \gamma\Lambda_{t-1} + \sum_{i\in B_t} C_i(\mu_{t-1}), \qquad
        \mu_t = \mu_{t-1} - \Lambda_t^{-1}\sum_{i\in B_t}\nabla\ell_i(\mu_{t-1}),

    starting from :math:`\mathcal N(\theta_0, \Lambda_0^{-1})` (see
    :mod:`samplers_as_optim.gaussian.ekf`).

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
        precision, cholesky, info = _factor(precision)
        if info != 0:
            raise ValueError(_not_positive_definite(precision.dtype))
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

        The update is atomic: it is computed aside and checked (one host synchronisation of
        its own) before anything changes. A refused update leaves the filter (mean,
        precision, ``steps``) and the model's parameters exactly as they were, so the next
        update proceeds as if it had never been tried.

        Args:
            batch: a pair ``(inputs, targets)`` (moved to the parameters' device).

        Returns:
            :math:`\sum_{i\in B_t}\ell_i(\mu_{t-1})`, the batch's negative log-likelihood
            under the predicted mean (the prequential loss), detached.

        Raises:
            ValueError: the inputs or targets contain NaN or ±inf; or, from finite but huge
                values, the new mean or precision or the returned negative log-likelihood
                is non-finite; or (``"dense"``) the new precision is not positive definite.
        """
        inputs, targets = _split_batch(batch)
        ref = self._reference()
        inputs, targets = inputs.to(ref.device), targets.to(ref.device)
        mean, precision = self._fitted()
        # Atomic: everything is computed into temporaries and checked (one host sync)
        # before the filter's state or the model's weights change; on any failure the
        # model's treated parameters are put back as they were.
        saved = self.treated.current(self.model)
        try:
            self._write_mean()
            nll, gradient, curv = self._observe(mean, inputs, targets)
            new_precision, cholesky, factored, new_flat_mean = self._propose(
                precision, self.treated.flatten(mean), gradient, curv
            )
            loss = nll.detach()
            healthy = (
                torch.isfinite(new_flat_mean).all()
                & torch.isfinite(new_precision).all()
                & torch.isfinite(loss)
            )
            for tensor in (inputs, targets):
                if _may_be_non_finite(tensor):
                    healthy = healthy & torch.isfinite(tensor).all()
            if factored is not None:
                healthy = healthy & factored
            ok = bool(healthy)  # the one host synchronisation of a healthy update
        except Exception as error:
            self._restore(saved)
            # An error raised while computing on a non-finite batch is reported as that.
            self._check_batch(inputs, targets, cause=error)
            raise
        except BaseException:
            self._restore(saved)
            raise
        if not ok:
            self._restore(saved)
            self._refuse(inputs, targets, new_precision, factored, new_flat_mean, loss)
        # Commit.
        if cholesky is not None:
            self._precision, self._cholesky = new_precision, cholesky
        else:
            self._precision = self.treated.unflatten(new_precision)
        self._mean = {
            name: value.clone() for name, value in self.treated.unflatten(new_flat_mean).items()
        }
        self._write_mean()
        self.steps += 1
        return loss

    def _observe(
        self, mean: dict[str, Tensor], inputs: Tensor, targets: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The batch's summed NLL at ``mean``, its flat gradient and curvature (eval mode)."""
        with evaluating(self.model):
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
        return nll, gradient, curv

    def _propose(
        self, precision: Any, flat_mean: Tensor, gradient: Tensor, curv: Tensor
    ) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor]:
        r"""The predict-update step, aside: :math:`\Lambda_t = \gamma\Lambda + C`, the mean.

        Returns the new precision (flat for ``"diag"``), its Cholesky factor and whether
        it factored (``"dense"``; None for ``"diag"``), and the new flat mean, detached.
        """
        cholesky: Tensor | None = None
        if self.structure == "dense":
            assert isinstance(precision, Tensor)
            new_precision, cholesky, info = _factor(self.decay * precision + curv)
            factored = info == 0
            step = torch.cholesky_solve(gradient.unsqueeze(-1), cholesky).squeeze(-1)
        else:
            assert isinstance(precision, dict)
            new_precision = self.decay * self.treated.flatten(precision) + curv
            factored = None
            step = gradient / new_precision
        return new_precision, cholesky, factored, (flat_mean - step).detach()

    def _restore(self, saved: dict[str, Tensor]) -> None:
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name in self.treated.names:
                params[name].copy_(saved[name])

    def _check_batch(self, inputs: Tensor, targets: Tensor, cause: Exception | None = None) -> None:
        """ValueError naming the first non-finite part of the batch, if any (host syncs)."""
        for part, tensor in (("inputs", inputs), ("targets", targets)):
            kind = _non_finite_kind(tensor)
            if kind is not None:
                raise ValueError(
                    f"Invalid batch: {part} contain a non-finite value ({kind}) at update "
                    f"{self.steps + 1} (expected finite inputs and targets; the filter and "
                    "the model were left unchanged)"
                ) from cause

    def _refuse(
        self,
        inputs: Tensor,
        targets: Tensor,
        precision: Tensor,
        factored: Tensor | None,
        flat_mean: Tensor,
        loss: Tensor,
    ) -> None:
        """Raise the ValueError explaining why the checked update is unhealthy."""
        self._check_batch(inputs, targets)
        dtype = flat_mean.dtype

        def check(what: str, tensor: Tensor) -> None:
            kind = _non_finite_kind(tensor)
            if kind is not None:
                raise ValueError(
                    f"Invalid batch: its update is non-finite in {dtype} ({what}: {kind}) at "
                    f"update {self.steps + 1} (expected inputs and targets on a scale the model "
                    f"and the filter can represent in {dtype}; the filter and the model were "
                    "left unchanged)"
                )

        check("new precision", precision)
        if factored is not None and not bool(factored):
            raise ValueError(_not_positive_definite(dtype))
        check("new mean", flat_mean)
        check("negative log-likelihood", loss)
        raise AssertionError("unreachable: an unhealthy update with no culprit")  # pragma: no cover
