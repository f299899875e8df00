r"""The scalars a sampler's reference update and its fused kernel share, defined once.

Each sampler's module states the derivation; here are the resulting standard deviations
of the noise each update adds (all 0 at :math:`T = 0`, where no noise is drawn), and
torch's functional AdamW, which the AdamW twin's step is at :math:`T = 0`. The sampler
modules and the kernel modules (``triton_kernel``) both import them, so that the two
backends cannot disagree on a formula.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor

__all__ = [
    "adamw_sghmc_noise_scale",
    "baoa_noise_scale",
    "sghmc_noise_scale",
    "torch_adamw",
    "torch_adamw_step",
]


def sghmc_noise_scale(lr: float, momentum: float, temperature: float, num_data: int) -> float:
    r"""Standard deviation of the noise added to SGHMC's buffer: :math:`\sqrt{2(1-\mu)T/(N\,lr)}`.

    In parameter units (one step from a common state) it is ``lr`` times this,
    :math:`\sqrt{2(1-\mu)\,lr\,T/N}` (``sgmcmc/sghmc``; SGNHT's is the same).
    """
    if temperature == 0:
        return 0.0
    return math.sqrt(2.0 * (1.0 - momentum) * temperature / (num_data * lr))


def baoa_noise_scale(lr: float, momentum: float, temperature: float, num_data: int) -> float:
    r"""The O step's noise on the buffer, :math:`\sqrt{(1-\mu^2)T/(N\,lr)}` (``sgmcmc/baoa``)."""
    if temperature == 0:
        return 0.0
    return math.sqrt((1.0 - momentum * momentum) * temperature / (num_data * lr))


def adamw_sghmc_noise_scale(lr: float, temperature: float, num_data: int) -> float:
    r""":math:`\sigma = \sqrt{2T/(N\,lr)}`; the gradient's noise is :math:`\sigma\sqrt{a}\,\xi`.

    (``sgmcmc/adamw_sghmc``, with :math:`a` the sampling preconditioner.)
    """
    if temperature == 0:
        return 0.0
    return math.sqrt(2.0 * temperature / (num_data * lr))


@functools.cache
def torch_adamw() -> Any:
    """The functional AdamW of torch: ``adam(decoupled_weight_decay=True)`` (torch >= 2.6).

    Found once (reading the signature cost the twin's step at T = 0 a seventh of its time).
    """
    from torch.optim import adam, adamw

    if "decoupled_weight_decay" in inspect.signature(adam.adam).parameters:
        return functools.partial(adam.adam, decoupled_weight_decay=True)
    return adamw.adamw


def torch_adamw_step(
    group: Mapping[str, Any], tensors: Sequence[Sequence[Tensor]], **options: Any
) -> None:
    """:func:`torch_adamw`'s step with a param group's hyperparameters, in place.

    ``tensors``: the parameters, gradients, ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``
    (empty without ``amsgrad``) and step counts; ``options``: ``foreach``, ``fused``,
    ``grad_scale`` and ``found_inf``, as torch's functional Adam takes them.
    """
    beta1, beta2 = group["betas"]
    torch_adamw()(
        *tensors,
        capturable=False,
        differentiable=False,
        has_complex=False,
        amsgrad=bool(group["amsgrad"]),
        beta1=beta1,
        beta2=beta2,
        lr=group["lr"],
        weight_decay=group["weight_decay"],
        eps=group["eps"],
        maximize=bool(group["maximize"]),
        **options,
    )
