r"""The machinery Gaussian VI's families share: prior, objective, reparameterised draws.

:class:`GaussianVI` holds everything of :mod:`samplers_as_optim.gaussian.vi` but the
family itself (the module docstring there gives the objective, the gradients and the
guard): the prior and the closed-form or stick-the-landing KL term, the forward at a
draw, sampling and the predictive. A family (:class:`~samplers_as_optim.MeanFieldVI`,
:class:`~samplers_as_optim.FullCovarianceVI`) creates its variational parameters and
says how noise becomes a draw.
"""

from __future__ import annotations

import math
from typing import Any, NoReturn, cast

import torch
from torch import Tensor, nn
from torch.func import functional_call

from ...core.validation import (
    check_bool,
    check_num_data,
    check_positive,
    check_positive_int,
    check_temperature,
)
from ...samples.stacked import call_stacked
from ..flat import Treated

__all__ = ["GaussianVI"]

_LOG_2PI = math.log(2 * math.pi)
# A draw standardised by the current (mu, L) must give back its own noise to within this
# (in standard deviations of the draw): rounding leaves ~1e-7 |mu| / sigma in float32 for a
# healthy factor (1e-5 at init_std 1e-3); a numerically singular or underflowed one gives
# inf, NaN or far more than 1.
_STANDARDISED_TOLERANCE = 0.1


class GaussianVI(nn.Module):
    """Shared machinery: prior, objective, forward with a reparameterised draw, sampling."""

    def __init__(
        self,
        model: nn.Module,
        *,
        num_data: int,
        prior_std: float | None,
        temperature: float = 1.0,
        init_std: float = 1e-3,
        stl: bool = False,
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
        self._last_noise: Tensor | None = None
        self._init_variational_parameters(model)

    # Subclasses implement the family.
    def _init_variational_parameters(self, model: nn.Module) -> None:
        """Create the family's variational parameters, the mean at the model's weights."""
        raise NotImplementedError

    def _flat_mean(self) -> Tensor:
        raise NotImplementedError

    def _mean_parts(self) -> list[Tensor]:
        """The mean's variational parameters (differentiable), for reductions over them."""
        raise NotImplementedError

    def _log_std_parts(self) -> list[Tensor]:
        """The log standard deviations' variational parameters (differentiable)."""
        raise NotImplementedError

    def _reduction_dtype(self) -> torch.dtype:
        """float32 for float16/bfloat16 variational parameters, their own dtype otherwise.

        Sums over the P parameters (the log-determinant, |mu|^2, tr Sigma, |theta|^2) are
        taken in it: in float16 the log-determinant of a 20010-weight layer at the default
        ``init_std`` (-138 000) overflows, and bfloat16 keeps 3 significant digits of
        terms that largely cancel.
        """
        return torch.promote_types(self._mean_parts()[0].dtype, torch.float32)

    def _flat_std(self) -> Tensor:
        """(P,) marginal standard deviations, differentiable."""
        raise NotImplementedError

    def _transform(self, noise: Tensor) -> Tensor:
        """(n, P) draws mu + L noise, differentiable in the variational parameters."""
        raise NotImplementedError

    def _standardise_stopped(self, flat: Tensor) -> tuple[Tensor, Tensor]:
        """(n, P) L^-1 (theta - mu) and log det L, the variational parameters stopped."""
        raise NotImplementedError

    def _scale_diagonal(self) -> Tensor:
        """(P,) the diagonal of L (detached) as the draws use it, in the parameters' dtype.

        The guard's: 0 there means every draw is the mean.
        """
        raise NotImplementedError

    def _log_det_scale(self) -> Tensor:
        """Log det of the scale L, 0.5 * log det Sigma, differentiable, reduction dtype."""
        raise NotImplementedError

    def _trace_covariance(self) -> Tensor:
        r""":math:`\mathrm{tr}\,\Sigma = \sum_i \sigma_i^2` in the reduction dtype."""
        dtype = self._reduction_dtype()
        parts = [part.to(dtype).mul(2).exp().sum() for part in self._log_std_parts()]
        return torch.stack(parts).sum()

    def _noise(self, n: int, generator: torch.Generator | None) -> Tensor:
        mean = self._flat_mean()
        return torch.randn(
            n, self.treated.numel, generator=generator, dtype=mean.dtype, device=mean.device
        )

    def _draw(self, n: int, generator: torch.Generator | None) -> Tensor:
        """(n, P) reparameterised draws, differentiable in the variational parameters."""
        return self._transform(self._noise(n, generator))

    @property
    def mean(self) -> dict[str, Tensor]:
        r""":math:`\mu` as name -> tensor shaped like the parameter (detached)."""
        return self.treated.unflatten(self._flat_mean().detach())

    @property
    def std(self) -> dict[str, Tensor]:
        r"""Marginal standard deviations :math:`\sqrt{\Sigma_{ii}}`, name -> tensor (detached)."""
        return self.treated.unflatten(self._flat_std().detach())

    def entropy(self) -> Tensor:
        r""":math:`\mathcal H(q) = \tfrac12\log\det\Sigma + \tfrac P2\log(2\pi e)`.

        In float32 for float16/bfloat16 parameters (see :meth:`kl_loss`).
        """
        return self._log_det_scale() + 0.5 * self.treated.numel * (_LOG_2PI + 1.0)

    def forward(
        self,
        *args: Any,
        num_samples: int | None = None,
        generator: torch.Generator | None = None,
        **kwargs: Any,
    ) -> Any:
        r"""Run the model at reparameterised draws :math:`\theta \sim q`.

        The draws (and their noise) are kept for the next :meth:`kl_loss`.

        Args:
            *args: the model's inputs.
            num_samples: None (default): one draw, the output is the model's own;
                an integer S >= 1: S draws, the output has a leading dimension S (all in
                one vmap, :func:`~samplers_as_optim.samples.stacked.call_stacked`).
            generator: ``torch.Generator`` for the draws (default: None, global RNG).
            **kwargs: the model's keyword inputs.

        Returns:
            The model output, differentiable in the variational parameters.
        """
        count = 1 if num_samples is None else check_positive_int("num_samples", num_samples)
        noise = self._noise(count, generator)
        flat = self._transform(noise)
        self._last, self._last_noise = flat, noise
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

        Every sum over the P parameters is taken in float32 when the variational
        parameters are float16 or bfloat16 (in float16 the log-determinant alone overflows
        from about 10 000 weights at the default ``init_std``; bfloat16 keeps 3 digits of
        terms that largely cancel), in their own dtype otherwise.

        Returns:
            A scalar; add it to the mean NLL of the batch. Its dtype is float32 for
            float16/bfloat16 parameters (the value, KL/N, can exceed float16's range on a
            large model with little data), their dtype otherwise: ``nll + vi.kl_loss()``
            then works for a ``.half()`` model or under autocast (a 0-dim half NLL plus it
            is a float32 loss), and its gradient reaches the half-precision variational
            parameters in their own dtype.

        Raises:
            RuntimeError: ``stl=True`` and no forward pass has drawn θ yet.
            FloatingPointError: the variational scale has degenerated (module docstring,
                "Guard"): L numerically singular, a standard deviation underflowed, or a
                variational parameter not finite.
        """
        if not self.stl:
            value = (self._neg_log_prior_mean() - self.temperature * self.entropy()) / self.num_data
            diagonal = self._scale_diagonal()
            healthy = torch.isfinite(value) & (diagonal > 0).all() & torch.isfinite(diagonal).all()
            if not bool(healthy):
                self._degenerate(
                    f"the closed-form objective is {float(value.detach()):.4g}",
                    "check the loss and the learning rate for non-finite values",
                )
            return value
        if self._last is None:
            raise RuntimeError(
                "kl_loss() with stl=True needs the draws of a forward pass: call the wrapper "
                "on a batch first"
            )
        flat = self._last
        z, log_det = self._standardise_stopped(flat)
        error = (z - cast(Tensor, self._last_noise)).detach().abs().amax()  # set with _last
        if not bool(error <= _STANDARDISED_TOLERANCE):  # NaN fails too
            self._degenerate(
                f"the draws of the last forward, standardised by L, differ from their noise by "
                f"up to {float(error):.3g} (expected at most {_STANDARDISED_TOLERANCE})",
                "lower the learning rate, or use stl=False (the default): the stick-the-landing "
                "gradient's noise grows like |L^-1| and can drive L to singular",
            )
        log_q = -0.5 * z.square().sum(-1) - log_det - 0.5 * flat.shape[-1] * _LOG_2PI
        value = self.temperature * log_q
        if self.prior_std is not None:
            value = value + self._neg_log_prior(flat)
        return value.mean() / self.num_data

    def _degenerate(self, what: str, advice: str) -> NoReturn:
        diagonal = self._scale_diagonal()
        raise FloatingPointError(
            f"{type(self).__name__}: the variational scale has degenerated: {what}; the "
            f"diagonal of its factor L spans [{float(diagonal.min()):.3g}, "
            f"{float(diagonal.max()):.3g}] (expected finite and > 0, and L numerically "
            f"invertible): {advice}"
        )

    def _neg_log_prior(self, flat: Tensor) -> Tensor:
        """(n,) -log p(theta) of the Gaussian prior at flat draws, reduction dtype."""
        prior_std = cast(float, self.prior_std)  # called only with a prior
        squares = flat.to(self._reduction_dtype()).square().sum(-1)
        return 0.5 * squares / prior_std**2 + self._prior_constant()

    def _neg_log_prior_mean(self) -> Tensor:
        """E_q[-log p(theta)] in closed form (0 when the loss carries the prior)."""
        dtype = self._reduction_dtype()
        if self.prior_std is None:
            return self._mean_parts()[0].new_zeros((), dtype=dtype)
        squares = torch.stack([part.to(dtype).square().sum() for part in self._mean_parts()])
        second_moment = squares.sum() + self._trace_covariance()
        return 0.5 * second_moment / self.prior_std**2 + self._prior_constant()

    def _prior_constant(self) -> float:
        prior_std = cast(float, self.prior_std)  # called only with a prior
        return 0.5 * self.treated.numel * math.log(2 * math.pi * prior_std**2)

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
            outputs: Tensor = call_stacked(self.model, samples, x, chunk_size=chunk_size)
        return outputs
