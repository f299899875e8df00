r"""Gaussian variational inference trained by any torch optimizer, in the units of DESIGN §1.

The variational family is :math:`q_\phi(\theta) = \mathcal N(\mu, \Sigma)` over the treated
parameters (those with ``requires_grad=True`` when the wrapper is built): mean-field
:math:`\Sigma = \mathrm{diag}(\sigma^2)`, :math:`\sigma = \exp(\text{log\_std})`
(:class:`MeanFieldVI`), or full :math:`\Sigma = LL^\top` with L lower triangular with a
positive diagonal (:class:`FullCovarianceVI`, for small models). The prior is
:math:`p(\theta) = \mathcal N(0, \sigma_p^2 I)`, the same as ``weight_decay = 1 / (N
\sigma_p^2)`` for SGD.

**Objective.** With the tempered target :math:`p_T(\theta\mid D) \propto \big(p(D\mid
\theta)\,p(\theta)\big)^{1/T}` of DESIGN §1, :math:`\frac TN \mathrm{KL}(q \,\|\, p_T)` is,
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
:meth:`kl_loss` with ``stl=True`` (default) returns the single-sample estimate
:math:`\frac1N(-\log p(\theta) + T\log q_{\bar\phi}(\theta))` with φ̄ = φ with gradients
stopped, but θ still a function of φ: stick-the-landing (Roeder, Wu & Duvenaud 2017,
eq. 8), which drops the score term whose expectation is zero, so the gradient's variance
vanishes when q equals the target. ``stl=False`` returns the closed form of the
expectation instead.

References:
    Blei, Kucukelbir & McAuliffe (2017), Variational inference: a review for statisticians.
    Roeder, Wu & Duvenaud (2017), Sticking the landing, eq. 8.
    Duffield et al. (2024), Scalable Bayesian learning with posteriors, §2 and App. A.2.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call

from ._flat import Treated
from ._memory import check_dense_fits
from ._validation import (
    check_bool,
    check_num_data,
    check_positive,
    check_positive_int,
    check_temperature,
)
from .stacked import call_stacked

__all__ = ["FullCovarianceVI", "MeanFieldVI"]

_LOG_2PI = math.log(2 * math.pi)


class _GaussianVI(nn.Module):
    """Shared machinery: prior, objective, forward with a reparameterised draw, sampling."""

    def __init__(
        self,
        model: nn.Module,
        *,
        num_data: int,
        prior_std: float | None,
        temperature: float,
        init_std: float,
        stl: bool,
    ) -> None:
        super().__init__()
        self.treated = Treated.of(model)
        self.num_data = check_num_data(num_data)
        self.prior_std = None if prior_std is None else check_positive("prior_std", prior_std)
        self.temperature = check_temperature(temperature)
        self.init_std = check_positive("init_std", init_std)
        self.stl = check_bool("stl", stl)
        self.model = model
        self._last: Tensor | None = None

    # Subclasses implement the family.
    def _flat_mean(self) -> Tensor:
        raise NotImplementedError

    def _draw(self, n: int, generator: torch.Generator | None) -> Tensor:
        """(n, P) reparameterised draws, differentiable in the variational parameters."""
        raise NotImplementedError

    def _log_q_stopped(self, flat: Tensor) -> Tensor:
        """(n,) log q(theta) with the variational parameters' gradients stopped."""
        raise NotImplementedError

    def _log_det_scale(self) -> Tensor:
        """Sum of log standard deviations: log det of the scale, 0.5 * log det Sigma."""
        raise NotImplementedError

    def _trace_covariance(self) -> Tensor:
        raise NotImplementedError

    def _noise(self, n: int, generator: torch.Generator | None) -> Tensor:
        mean = self._flat_mean()
        return torch.randn(
            n, self.treated.numel, generator=generator, dtype=mean.dtype, device=mean.device
        )

    @property
    def mean(self) -> dict[str, Tensor]:
        r""":math:`\mu` as name -> tensor shaped like the parameter (detached)."""
        return self.treated.unflatten(self._flat_mean().detach())

    def entropy(self) -> Tensor:
        r""":math:`\mathcal H(q) = \tfrac12\log\det\Sigma + \tfrac P2\log(2\pi e)`."""
        return self._log_det_scale() + 0.5 * self.treated.numel * (_LOG_2PI + 1.0)

    def forward(
        self,
        *args: Any,
        num_samples: int | None = None,
        generator: torch.Generator | None = None,
        **kwargs: Any,
    ) -> Any:
        r"""Run the model at reparameterised draws :math:`\theta \sim q`.

        The draws are kept for the next :meth:`kl_loss`.

        Args:
            *args: the model's inputs.
            num_samples: None (default): one draw, the output is the model's own;
                an integer S >= 1: S draws, the output has a leading dimension S (all in
                one vmap, :func:`~samplers_as_optim.stacked.call_stacked`).
            generator: ``torch.Generator`` for the draws (default: None, global RNG).
            **kwargs: the model's keyword inputs.

        Returns:
            The model output, differentiable in the variational parameters.
        """
        count = 1 if num_samples is None else check_positive_int("num_samples", num_samples)
        flat = self._draw(count, generator)
        self._last = flat
        params = self.treated.unflatten(flat)
        if num_samples is None:
            single = {name: value[0] for name, value in params.items()}
            return functional_call(self.model, single, args, kwargs)
        return call_stacked(self.model, params, *args, **kwargs)

    def kl_loss(self) -> Tensor:
        r"""The prior/entropy part of the loss, in mean-loss units.

        .. math::

            \frac1N\big(\mathbb E_q[-\log p(\theta)] - T\,\mathcal H(q)\big)
            \;=\; \frac1N\,\mathbb E_q\big[-\log p(\theta) + T\log q(\theta)\big],

        which is KL(q‖p)/N at T = 1. With ``prior_std=None`` the prior term is left to the
        user's loss (see the class's Args) and this is :math:`\frac TN\mathbb E_q[\log q]`.
        With ``stl=True``: the estimate at the draws of
        the last :meth:`forward` (averaged over them), :math:`\log q` with stopped
        variational parameters (stick-the-landing); with ``stl=False``: the closed form,
        :math:`\mathbb E_q[-\log p] = \frac{|\mu|^2 + \mathrm{tr}\,\Sigma}{2\sigma_p^2} +
        \frac P2\log(2\pi\sigma_p^2)`.

        Returns:
            A scalar; add it to the mean NLL of the batch.
        """
        if not self.stl:
            return (self._neg_log_prior_mean() - self.temperature * self.entropy()) / self.num_data
        if self._last is None:
            raise RuntimeError(
                "kl_loss() with stl=True needs the draws of a forward pass: call the wrapper "
                "on a batch first"
            )
        flat = self._last
        value = self.temperature * self._log_q_stopped(flat)
        if self.prior_std is not None:
            value = value + self._neg_log_prior(flat)
        return value.mean() / self.num_data

    def _neg_log_prior(self, flat: Tensor) -> Tensor:
        """(n,) -log p(theta) of the Gaussian prior at flat draws."""
        return 0.5 * flat.square().sum(-1) / self.prior_std**2 + self._prior_constant()

    def _neg_log_prior_mean(self) -> Tensor:
        """E_q[-log p(theta)] in closed form (0 when the loss carries the prior)."""
        if self.prior_std is None:
            return self._flat_mean().new_zeros(())
        second_moment = self._flat_mean().square().sum() + self._trace_covariance()
        return 0.5 * second_moment / self.prior_std**2 + self._prior_constant()

    def _prior_constant(self) -> float:
        return 0.5 * self.treated.numel * math.log(2 * math.pi * self.prior_std**2)

    @torch.no_grad()
    def sample(self, n: int, *, generator: torch.Generator | None = None) -> dict[str, Tensor]:
        """Draw n samples from q, detached, in the stacked layout (name -> ``(n, *shape)``).

        Args:
            n: number of samples (an integer >= 1).
            generator: ``torch.Generator`` for reproducible draws (default: None).
        """
        n = check_positive_int("n", n)
        return self.treated.unflatten(self._draw(n, generator).detach())

    def predict(
        self,
        x: Tensor,
        num_samples: int = 100,
        *,
        generator: torch.Generator | None = None,
        chunk_size: int | None = None,
    ) -> Tensor:
        """Model outputs under ``num_samples`` draws from q, stacked along dim 0.

        The layout of a ``ParallelEnsemble``'s output, for the
        :mod:`~samplers_as_optim.predictive` helpers: e.g.
        ``predictive.classification(vi.predict(x))`` for a classifier.

        Args:
            x: a batch of inputs.
            num_samples: S (default: 100; an integer >= 1).
            generator: ``torch.Generator`` for the draws (default: None, global RNG).
            chunk_size: evaluate at most this many draws at once (default: None, all).

        Returns:
            Outputs of shape ``(S, *model(x).shape)``, without gradients.
        """
        samples = self.sample(check_positive_int("num_samples", num_samples), generator=generator)
        with torch.no_grad():
            return call_stacked(self.model, samples, x, chunk_size=chunk_size)


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
        init_std: initial posterior standard deviation of every weight (default: 1e-3;
            a finite number > 0); the mean starts at the model's current weights. From
            this small start the standard deviations grow slowly at T = 1 on a neural
            network: budget a few hundred epochs (on scikit-learn's digits, Adam at 3e-2
            cosine-annealed to 0 over 200 epochs converged; a constant 1e-2 had not at 300).
        stl: stick-the-landing estimate in :meth:`kl_loss` (default: True); False uses
            the closed-form expectation."""


class MeanFieldVI(_GaussianVI):
    r"""Mean-field Gaussian VI: :math:`q = \mathcal N(\mu, \mathrm{diag}(\sigma^2))`.

    .. math::

        \theta = \mu + \sigma\odot\varepsilon, \quad \sigma = e^{\text{log\_std}}, \qquad
        \text{loss} = \text{mean NLL}(\theta) + \tfrac1N\big(-\log p(\theta) +
        T \log q_{\bar\phi}(\theta)\big),

    N = ``num_data``, T = ``temperature``, :math:`p = \mathcal N(0, \sigma_p^2 I)` with
    σ_p = ``prior_std``. The variational parameters are the ``nn.Parameter`` lists
    ``vi.loc`` and ``vi.log_std`` (one entry per treated parameter, in
    ``named_parameters()`` order); train them with any optimizer over
    ``vi.parameters()``.

    Args:
        {shared_args}

    Example:
        >>> import torch
        >>> import torch.nn.functional as F
        >>> from samplers_as_optim.vi import MeanFieldVI
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

    def __init__(
        self,
        model: nn.Module,
        *,
        num_data: int,
        prior_std: float | None,
        temperature: float = 1.0,
        init_std: float = 1e-3,
        stl: bool = True,
    ) -> None:
        super().__init__(
            model,
            num_data=num_data,
            prior_std=prior_std,
            temperature=temperature,
            init_std=init_std,
            stl=stl,
        )
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

    def _flat_log_std(self) -> Tensor:
        return torch.cat([log_std.reshape(-1) for log_std in self.log_std])

    @property
    def std(self) -> dict[str, Tensor]:
        r""":math:`\sigma` as name -> tensor shaped like the parameter (detached)."""
        return self.treated.unflatten(self._flat_log_std().detach().exp())

    def _draw(self, n: int, generator: torch.Generator | None) -> Tensor:
        noise = self._noise(n, generator)
        return self._flat_mean() + self._flat_log_std().exp() * noise

    def _log_q_stopped(self, flat: Tensor) -> Tensor:
        mean = self._flat_mean().detach()
        log_std = self._flat_log_std().detach()
        z = (flat - mean) * torch.exp(-log_std)
        return -0.5 * z.square().sum(-1) - log_std.sum() - 0.5 * flat.shape[-1] * _LOG_2PI

    def _log_det_scale(self) -> Tensor:
        return self._flat_log_std().sum()

    def _trace_covariance(self) -> Tensor:
        return self._flat_log_std().mul(2).exp().sum()


class FullCovarianceVI(_GaussianVI):
    r"""Full-covariance Gaussian VI: :math:`q = \mathcal N(\mu, LL^\top)`, for small models.

    .. math::

        \theta = \mu + L\varepsilon, \quad L = \mathrm{tril}_{-1}(\text{scale\_offdiag}) +
        \mathrm{diag}(e^{\text{log\_scale\_diag}}),

    with the loss of :class:`MeanFieldVI`. Parameters: ``vi.loc`` (P,),
    ``vi.scale_offdiag`` (the P(P-1)/2 strictly-lower entries, row-major) and
    ``vi.log_scale_diag`` (P,), P the number of treated scalars in
    ``named_parameters()`` order. Refused, naming the size, when a P x P matrix cannot
    fit in memory.

    Args:
        {shared_args}

    Example:
        >>> import torch
        >>> from samplers_as_optim.vi import FullCovarianceVI
        >>> vi = FullCovarianceVI(torch.nn.Linear(3, 1), num_data=100, prior_std=1.0)
        >>> vi.covariance.shape
        torch.Size([4, 4])
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        num_data: int,
        prior_std: float | None,
        temperature: float = 1.0,
        init_std: float = 1e-3,
        stl: bool = True,
    ) -> None:
        super().__init__(
            model,
            num_data=num_data,
            prior_std=prior_std,
            temperature=temperature,
            init_std=init_std,
            stl=stl,
        )
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
        self.scale_offdiag = nn.Parameter(current.new_zeros(size * (size - 1) // 2))
        self.log_scale_diag = nn.Parameter(torch.full_like(current, math.log(self.init_std)))

    def _flat_mean(self) -> Tensor:
        return self.loc

    def scale_tril(self) -> Tensor:
        r"""The lower-triangular L with :math:`LL^\top = \Sigma`, differentiable."""
        size = self.treated.numel
        rows, cols = torch.tril_indices(size, size, -1, device=self.loc.device)
        lower = self.loc.new_zeros(size, size).index_put((rows, cols), self.scale_offdiag)
        return lower + torch.diag(self.log_scale_diag.exp())

    @property
    def covariance(self) -> Tensor:
        r""":math:`\Sigma = LL^\top`, (P, P), detached."""
        scale = self.scale_tril().detach()
        return scale @ scale.T

    def _draw(self, n: int, generator: torch.Generator | None) -> Tensor:
        noise = self._noise(n, generator)
        return self.loc + noise @ self.scale_tril().T

    def _log_q_stopped(self, flat: Tensor) -> Tensor:
        scale = self.scale_tril().detach()
        centred = (flat - self.loc.detach()).T
        z = torch.linalg.solve_triangular(scale, centred, upper=False)
        log_det = self.log_scale_diag.detach().sum()
        return -0.5 * z.square().sum(0) - log_det - 0.5 * flat.shape[-1] * _LOG_2PI

    def _log_det_scale(self) -> Tensor:
        return self.log_scale_diag.sum()

    def _trace_covariance(self) -> Tensor:
        return self.scale_offdiag.square().sum() + self.log_scale_diag.mul(2).exp().sum()


for _cls in (MeanFieldVI, FullCovarianceVI):
    _cls.__doc__ = _cls.__doc__.replace("{shared_args}", _SHARED_ARGS)
