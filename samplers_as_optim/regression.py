r"""Gaussian observation noise for regression: a sampled noise scale, and a heteroscedastic head.

Both losses follow the package's mean-loss convention (``docs/design.md``): what a user
minimises is

.. math::

    L(\theta, s) = \frac1B \sum_{i \in \text{batch}} -\log \mathcal N(y_i \mid f(x_i;\theta),
    \sigma^2 I) \;+\; \frac{-\log p(s)}{N},

the mean negative log-likelihood over the batch plus the noise's own prior divided by
N = ``num_data``, so that N·L is the potential U of the joint posterior of the weights θ
and the noise. The weights' prior stays where the package keeps it, in the optimizer's
``weight_decay`` (:func:`samplers_as_optim.priors.prior_param_groups`); the noise's prior
is declared here, inside the loss, because it is not a Gaussian centred at 0.

:class:`GaussianLikelihood` holds σ as one unconstrained parameter, :math:`s = \log\sigma`,
so that any optimizer or sampler over ``likelihood.parameters()`` fits or samples it:
``SGHMC([*model.parameters(), *likelihood.parameters()], num_data=N)`` draws (θ, σ) from
their joint posterior. The prior is a Gamma(α, β) law (shape α, rate β) on the precision
:math:`\tau = \sigma^{-2}` (the conjugate prior of a Gaussian's precision; Bishop 2006,
§2.3.6; the noise prior of Hernández-Lobato & Adams 2015, PBP), carried to s with its
Jacobian :math:`|d\tau/ds| = 2\tau`:

.. math::

    -\log p(s) = 2\alpha s + \beta e^{-2s} - \alpha\log\beta + \log\Gamma(\alpha) - \log 2.

Its mode is at :math:`\sigma^2 = \beta/\alpha`; the default α = β = 1 (the mode at σ = 1,
worth two pseudo-observations) suits standardised targets. Since the Gamma law is the
conjugate prior, σ's conditional posterior given the residuals
:math:`r_i` is Gamma(α + nD/2, β + Σr²/2) on τ.

:class:`HeteroscedasticGaussian` reads a 2D-column output as D means and D raw scales,
:math:`\sigma_i = \mathrm{softplus}(\rho_i) + \sigma_{\min}` (the floor keeps the
likelihood bounded; Lakshminarayanan et al. 2017, §2.2.1, use the same softplus and
floor), and has no parameter of its own.

References:
    Bishop (2006), Pattern Recognition and Machine Learning, §2.3.6.
    Hernández-Lobato & Adams (2015), Probabilistic backpropagation for scalable learning
    of Bayesian neural networks, §3.
    Lakshminarayanan, Pritzel & Blundell (2017), Simple and scalable predictive
    uncertainty estimation using deep ensembles, §2.2.1.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .core.validation import check_bool, check_num_data, check_positive

__all__ = ["GaussianLikelihood", "HeteroscedasticGaussian", "gaussian_nll"]

_HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)


def _check_pair(output: Tensor, target: Tensor, expected: str) -> None:
    for name, value in (("output", output), ("target", target)):
        if not isinstance(value, Tensor) or not value.is_floating_point():
            kind = type(value).__name__ if not isinstance(value, Tensor) else value.dtype
            raise TypeError(f"Invalid {name}: {kind} (expected a floating-point tensor)")
    if output.dim() == 0:
        raise ValueError(f"Invalid output: shape () (expected {expected})")
    if output.shape[0] == 0:
        raise ValueError(
            f"Invalid output: shape {tuple(output.shape)} (expected at least one example: the "
            "loss is the mean over the batch)"
        )


def gaussian_nll(mean: Tensor, std: Tensor, target: Tensor) -> Tensor:
    r"""Per-example :math:`-\log\mathcal N(y \mid \mu, \sigma^2)`, summed over all but dim 0.

    .. math::
        \ell_i = \sum_d \Big[\tfrac12\log(2\pi) + \log\sigma_{id}
        + \frac{(y_{id} - \mu_{id})^2}{2\sigma_{id}^2}\Big]

    ``std`` broadcasts to ``mean`` (a 0-d tensor for a homoscedastic σ); an empty batch
    gives an empty tensor. No checks: the classes below check their inputs.
    """
    std = std.expand_as(mean)
    values = _HALF_LOG_2PI + std.log() + 0.5 * ((target - mean) / std).square()
    rows = mean.shape[0]
    return values.reshape(rows, -1 if rows else 0).sum(dim=1)


class GaussianLikelihood(nn.Module):
    r"""Homoscedastic Gaussian noise N(0, σ²) with σ a parameter to fit or sample.

    ``likelihood(output, target)`` (also ``likelihood.loss``) is the mean loss of the
    module docstring: the mean over the batch of
    :math:`\sum_d -\log\mathcal N(y_{id} \mid f_{id}, \sigma^2)` plus, when σ is learnt,
    :math:`-\log p(s)/N` with :math:`s = \log\sigma` and the Gamma(α, β) prior on
    :math:`\sigma^{-2}` written out there. Put ``likelihood.parameters()`` beside the
    model's in the optimizer (with no weight decay: its prior is in this loss;
    :func:`~samplers_as_optim.priors.prior_param_groups` does so) and a sampler draws σ
    with the weights.

    Args:
        noise_std: the initial (or, with ``learn=False``, fixed) σ (default: 1.0; a finite
            number > 0). :meth:`reset_parameters` returns to it.
        num_data: N, the training-set size, by which the prior is divided (keyword-only;
            required when ``learn=True``, unused otherwise).
        learn: whether σ is a parameter (default: True). With False σ is a buffer and
            the loss is the Gaussian NLL alone.
        prior_shape: α of the Gamma prior on the precision (default: 1.0; > 0).
        prior_rate: β of the Gamma prior on the precision (default: 1.0; > 0), in the
            units of the targets' variance.

    Raises:
        ValueError: a non-positive or non-finite ``noise_std``, ``prior_shape`` or
            ``prior_rate``; ``num_data`` missing (None) with ``learn=True`` or not an
            integer >= 1.
        TypeError: ``learn`` is not a bool.

    Example:
        >>> import torch
        >>> from samplers_as_optim import SGHMC, GaussianLikelihood
        >>> model = torch.nn.Linear(3, 1)
        >>> likelihood = GaussianLikelihood(num_data=100)
        >>> optimizer = SGHMC(
        ...     [*model.parameters(), *likelihood.parameters()], lr=1e-3, num_data=100)
        >>> x, y = torch.randn(10, 3), torch.randn(10, 1)
        >>> loss = likelihood(model(x), y)
        >>> loss.backward()
        >>> optimizer.step()
        >>> likelihood.noise_std.shape
        torch.Size([])
    """

    #: its prior is part of its loss: :func:`~samplers_as_optim.priors.prior_param_groups`
    #: gives its parameters no weight decay
    prior_in_loss = True
    #: the curvature of the mean loss in log σ known whatever the data: the Fisher
    #: information of a Gaussian's log σ, 2 per observation (with ``decoupled=True``,
    #: ``prior_param_groups`` floors the AdamW twin's preconditioner by it, as by a prior:
    #: at the MAP the gradient in log σ vanishes and the unfloored first step threw σ
    #: up by e^0.5 at lr 1e-3 on diabetes, e^1.6 at 1e-2)
    loss_curvature: ClassVar[Mapping[str, float]] = MappingProxyType({"log_noise_std": 2.0})

    log_noise_std: Tensor

    def __init__(
        self,
        noise_std: float = 1.0,
        *,
        num_data: int | None = None,
        learn: bool = True,
        prior_shape: float = 1.0,
        prior_rate: float = 1.0,
    ) -> None:
        noise_std = check_positive("noise_std", noise_std)
        check_bool("learn", learn)
        prior_shape = check_positive("prior_shape", prior_shape)
        prior_rate = check_positive("prior_rate", prior_rate)
        if learn and num_data is None:
            raise ValueError(
                "Invalid num_data: None (expected a positive integer: the number of "
                "training examples, by which the prior on the noise is divided; required "
                "with learn=True)"
            )
        super().__init__()
        self.num_data = None if num_data is None else check_num_data(num_data)
        self.learn = learn
        self.initial_noise_std = noise_std
        self.prior_shape = prior_shape
        self.prior_rate = prior_rate
        value = torch.tensor(math.log(noise_std), dtype=torch.get_default_dtype())
        if learn:
            self.log_noise_std = nn.Parameter(value)
        else:
            self.register_buffer("log_noise_std", value)

    def reset_parameters(self) -> None:
        """σ back to its initial value (``ParallelEnsemble`` calls this for each member)."""
        with torch.no_grad():
            self.log_noise_std.fill_(math.log(self.initial_noise_std))

    @property
    def noise_std(self) -> Tensor:
        """σ = exp(s), a 0-d tensor (differentiable in s)."""
        return self.log_noise_std.exp()

    def prior_nll(self) -> Tensor:
        r""":math:`-\log p(s)` of the module docstring (0 with ``learn=False``)."""
        s = self.log_noise_std
        if not self.learn:
            return torch.zeros((), dtype=s.dtype, device=s.device)
        alpha, beta = self.prior_shape, self.prior_rate
        constant = -alpha * math.log(beta) + math.lgamma(alpha) - math.log(2.0)
        return 2 * alpha * s + beta * torch.exp(-2 * s) + constant

    def forward(self, output: Tensor, target: Tensor) -> Tensor:
        """The mean loss: mean Gaussian NLL over the batch + (−log prior of s) / N.

        Args:
            output: the model's predicted means, ``(B, ...)``.
            target: the targets, the same shape as ``output`` (no broadcasting: a
                ``(B, 1)`` output against ``(B,)`` targets is refused, not broadcast to
                ``(B, B)``).

        Returns:
            A scalar tensor.

        Raises:
            TypeError: ``output`` or ``target`` is not a floating-point tensor.
            ValueError: their shapes differ, or ``output`` is 0-d or an empty batch (B = 0:
                a mean over no examples is undefined; refused rather than a NaN loss that
                a sampler's step would carry into the weights).
        """
        _check_pair(output, target, "(batch, ...) predicted means")
        if output.shape != target.shape:
            raise ValueError(
                f"Invalid target: shape {tuple(target.shape)} (expected the output's shape "
                f"{tuple(output.shape)})"
            )
        loss = gaussian_nll(output, self.noise_std.to(output.dtype), target).mean()
        if self.learn:
            assert self.num_data is not None
            loss = loss + self.prior_nll().to(output.dtype) / self.num_data
        return loss

    loss = forward

    def extra_repr(self) -> str:
        """σ's initial value, and the prior when it is learnt."""
        text = f"noise_std={self.initial_noise_std:g}, learn={self.learn}"
        if self.learn:
            text += (
                f", num_data={self.num_data}, prior_shape={self.prior_shape:g}, "
                f"prior_rate={self.prior_rate:g}"
            )
        return text


class HeteroscedasticGaussian:
    r"""A Gaussian whose σ the network predicts: output ``(B, 2D)`` = D means, D raw scales.

    :math:`\mu = o_{:, :D}`, :math:`\sigma = \mathrm{softplus}(o_{:, D:}) +
    \sigma_{\min}`; ``head(output, target)`` (also ``head.loss``) is the mean over the
    batch of :math:`\sum_d -\log\mathcal N(y_{id} \mid \mu_{id}, \sigma_{id}^2)`. It has no
    parameters (σ is the network's), so no prior term.

    Args:
        min_std: the floor :math:`\sigma_{\min}` (default: 1e-3, in the targets' units;
            a finite number > 0).

    Raises:
        ValueError: a bad ``min_std``.

    Example:
        >>> import torch
        >>> from samplers_as_optim import HeteroscedasticGaussian
        >>> head = HeteroscedasticGaussian()
        >>> output = torch.zeros(4, 2)  # means 0, raw scales 0
        >>> mean, std = head.mean_and_std(output)
        >>> std[0]  # softplus(0) + 1e-3 = log(2) + 1e-3
        tensor([0.6941])
        >>> head(output, torch.zeros(4)).shape
        torch.Size([])
    """

    def __init__(self, min_std: float = 1e-3) -> None:
        self.min_std = check_positive("min_std", min_std)

    def mean_and_std(self, output: Tensor) -> tuple[Tensor, Tensor]:
        """Split ``(..., 2D)`` outputs (any leading dims, e.g. samples) into means and σ.

        Raises:
            TypeError: ``output`` is not a floating-point tensor.
            ValueError: its last dimension is not even.
        """
        if not isinstance(output, Tensor) or not output.is_floating_point():
            kind = type(output).__name__ if not isinstance(output, Tensor) else output.dtype
            raise TypeError(f"Invalid output: {kind} (expected a floating-point tensor)")
        if output.dim() == 0 or output.shape[-1] % 2:
            raise ValueError(
                f"Invalid output: shape {tuple(output.shape)} (expected a last dimension "
                "2D: D means, then D raw scales)"
            )
        mean, raw = output.chunk(2, dim=-1)
        return mean, F.softplus(raw) + self.min_std

    def __call__(self, output: Tensor, target: Tensor) -> Tensor:
        """The mean Gaussian NLL over the batch.

        Args:
            output: ``(B, 2D)``: D means, then D raw scales.
            target: ``(B, D)``, or ``(B,)`` when D = 1.

        Raises:
            TypeError: ``output`` or ``target`` is not a floating-point tensor.
            ValueError: ``output`` is not ``(B, 2D)`` with B >= 1 (a mean over no examples
                is undefined) or ``target`` does not match it.
        """
        _check_pair(output, target, "(batch, 2D): D means, then D raw scales")
        if output.dim() != 2:
            raise ValueError(
                f"Invalid output: shape {tuple(output.shape)} (expected (batch, 2D): D "
                "means, then D raw scales)"
            )
        mean, std = self.mean_and_std(output)
        if target.dim() == 1 and mean.shape[1] == 1:
            target = target.unsqueeze(1)
        if target.shape != mean.shape:
            raise ValueError(
                f"Invalid target: shape {tuple(target.shape)} (expected {tuple(mean.shape)}, "
                "or (batch,) for one output)"
            )
        return gaussian_nll(mean, std, target).mean()

    loss = __call__

    def __repr__(self) -> str:
        return f"HeteroscedasticGaussian(min_std={self.min_std:g})"
