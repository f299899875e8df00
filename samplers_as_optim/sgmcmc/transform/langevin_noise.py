r"""The noise SGLD and SGHMC inject, as a part to chain before a torchopt optimizer.

Not a sampler of its own: :func:`langevin_noise` adds to the incoming updates the noise of
SGHMC's buffer (SGLD's at momentum 0), computed by :func:`~.sghmc.sghmc_direction`, so that
``torchopt.chain(langevin_noise(lr, ...), torchopt.sgd(lr))`` samples as :func:`sgld` does.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor
from torchopt.base import GradientTransformation

from ..definition.arguments import FOREACH, NUM_DATA, SEED, TEMPERATURE
from ..sghmc import SGHMC, sghmc_direction
from . import (
    PUBLIC_MODULE,
    KernelInput,
    KernelOutput,
    ScalarOrSchedule,
    pick,
    sampler_transformation,
)

__all__ = ["LangevinNoiseState", "langevin_noise"]


class LangevinNoiseState(NamedTuple):
    """The state of :func:`langevin_noise`: the chain's random state.

    Attributes:
        seed: the seed of the noise.
        count: the number of updates taken, the step of the next noise draw and of the
            schedules.
    """

    seed: int
    count: int  # type: ignore[assignment]  # a field, as optax's ScaleByScheduleState.count


LangevinNoiseState.__module__ = PUBLIC_MODULE  # pickled by its public name


def langevin_noise(
    lr: ScalarOrSchedule,
    momentum: float = 0.0,
    *,
    num_data: int,
    temperature: ScalarOrSchedule = 1.0,
    foreach: bool | None = None,
    seed: int | None = None,
) -> GradientTransformation:
    """SGLD's and SGHMC's injected noise, to chain (see ``langevin_noise.__doc__``)."""
    return sampler_transformation(
        locals(),
        name="transforms.langevin_noise",
        state_type=LangevinNoiseState,
        optimizer_class=SGHMC,
        init_buffers=lambda leaves: (),
        kernel=_langevin_kernel,
        scale_by_lr=False,
    )


def _langevin_kernel(group: dict[str, Any], inputs: KernelInput) -> KernelOutput:
    if inputs.noise is None:  # temperature 0: no noise
        return list(inputs.grads), ()
    # SGHMC's step from a zero buffer (SGLD's at momentum 0) is g + noise: the injection
    # of the samplers, with their scale and sign, keeping the graph of g.
    buffers: list[Tensor | None] = [None] * len(inputs.grads)
    if group["momentum"]:
        buffers = [torch.zeros_like(grad) for grad in inputs.grads]
    directions, _ = sghmc_direction(
        inputs.grads,
        inputs.grads,
        buffers,
        inputs.noise,
        **pick(group, "lr", "momentum", "temperature", "num_data", "weight_decay", "dampening"),
        **pick(group, "nesterov", "maximize", "foreach"),
        inplace=True,
    )
    return directions, ()


langevin_noise.__doc__ = rf"""The noise SGLD and SGHMC inject, as a transformation to chain.

    Adds to the incoming updates :math:`g` (gradients, before any scaling by the
    learning rate) the noise of :func:`sghmc`'s buffer, computed by the same kernel:

    .. math::

        g \leftarrow g \pm \sqrt{{2 (1-\mu)\, T / (N\, lr)}}\;\xi,
        \qquad \xi \sim \mathcal N(0, I),

    with :math:`\mu` = ``momentum``, :math:`T` = ``temperature``, :math:`N` =
    ``num_data`` (the sign is the kernels': negative at :math:`\mu = 0` as in
    :func:`sgld`, positive otherwise as in :func:`sghmc`). Chained before
    ``torchopt.sgd(lr, momentum)`` with the same ``lr`` and ``momentum`` it turns SGD into
    SGLD (:math:`\mu = 0`) or SGHMC: with one seed, ``chain(langevin_noise(lr, seed=s,
    ...), torchopt.sgd(lr))`` is :func:`sgld` (no weight decay) bit for bit, and with
    momentum it is :func:`sghmc` up to rounding (the noise enters the buffer after the
    gradient there, with it here), as long as ``lr`` is constant: ``torchopt.sgd``'s
    buffer is not rescaled when a schedule changes ``lr`` (see :func:`sghmc`), so under
    such a schedule use :func:`sghmc` itself. Before any other optimizer it adds noise of
    that scale, which is not a sampler in general. At temperature 0 it returns the updates
    unchanged; at temperature > 0 with ``lr`` 0 too (no time passes).

    Args:
        lr: the learning rate of the SGD that follows, which sets the noise scale, or
            a schedule of the step count (a finite number >= 0).
        momentum: :math:`\mu`, the momentum of the SGD that follows (default: 0.0; in
            [0, 1)).
        {NUM_DATA.doc}
        {TEMPERATURE.transform_doc}
        {FOREACH.transform_doc}
        {SEED.transform_doc}

    Returns:
        A ``torchopt.base.GradientTransformation`` whose ``update(updates, state, *,
        params=None, inplace=True)`` returns the noisy updates and the next state.

    Example:
        >>> import torch, torchopt
        >>> from samplers_as_optim import transforms
        >>> lr, params = 0.1, {{"w": torch.zeros(3)}}
        >>> noisy_sgd = torchopt.chain(
        ...     transforms.langevin_noise(lr, num_data=100, seed=0), torchopt.sgd(lr)
        ... )
        >>> sgld = transforms.sgld(lr, num_data=100, seed=0)
        >>> grads = {{"w": torch.ones(3)}}
        >>> a, _ = noisy_sgd.update(grads, noisy_sgd.init(params), inplace=False)
        >>> b, _ = sgld.update(grads, sgld.init(params), inplace=False)
        >>> torch.equal(a["w"], b["w"])
        True

    References:
        Welling, M. & Teh, Y. W. (2011), Eq. (4); Chen, T., Fox, E. & Guestrin, C.
        (2014), Eq. (15).
    """
