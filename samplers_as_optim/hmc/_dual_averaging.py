r"""Dual-averaging step-size adaptation (Hoffman & Gelman 2014, Algorithm 5) and Welford.

Dual averaging tunes :math:`\log\epsilon` so that the average acceptance probability
:math:`\alpha` of the Metropolis test approaches a target :math:`\delta`. After the
:math:`m`-th adapted transition (Hoffman & Gelman 2014, Eq. (6) and Algorithm 5):

.. math::

    \bar H_m = \Big(1 - \frac{1}{m + t_0}\Big) \bar H_{m-1} + \frac{\delta - \alpha_m}{m + t_0},
    \qquad
    \log\epsilon_{m} = \mu - \frac{\sqrt m}{\gamma} \bar H_m,
    \qquad
    \log\bar\epsilon_m = m^{-\kappa} \log\epsilon_m + (1 - m^{-\kappa}) \log\bar\epsilon_{m-1},

with :math:`\mu = \log(10\,\epsilon_0)`, :math:`\gamma = 0.05`, :math:`t_0 = 10`,
:math:`\kappa = 0.75` (the paper's values). During warm-up the sampler uses
:math:`\epsilon_m`; afterwards it freezes :math:`\bar\epsilon`.

Every quantity is a tensor, one entry per chain (a 0-dim tensor for one chain), so the K
chains of a ``ParallelEnsemble`` adapt their step sizes independently. All functions are
pure: they return a new state.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = ["DualAveragingState", "dual_averaging_init", "dual_averaging_update"]

GAMMA = 0.05
T0 = 10.0
KAPPA = 0.75


class DualAveragingState(NamedTuple):
    """The dual-averaging iterates (each a float64 tensor, one entry per chain)."""

    log_step: Tensor  #: :math:`\log\epsilon_m`, used for the next transition
    log_step_avg: Tensor  #: :math:`\log\bar\epsilon_m`, frozen after warm-up
    h_bar: Tensor  #: :math:`\bar H_m`
    mu: Tensor  #: :math:`\mu = \log(10\,\epsilon_0)`
    count: int  # type: ignore[assignment]  #: :math:`m`, transitions adapted so far


def dual_averaging_init(log_step: Tensor) -> DualAveragingState:
    """Start adapting from the step size ``exp(log_step)`` (one entry per chain)."""
    log_step = log_step.to(torch.float64)
    zeros = torch.zeros_like(log_step)
    return DualAveragingState(log_step, zeros, zeros, log_step + math.log(10.0), 0)


def dual_averaging_update(
    state: DualAveragingState, accept_prob: Tensor, target: float
) -> DualAveragingState:
    """One step of Algorithm 5 given the last transition's acceptance probability."""
    m = state.count + 1
    eta = 1.0 / (m + T0)
    h_bar = (1.0 - eta) * state.h_bar + eta * (target - accept_prob.to(torch.float64))
    log_step = state.mu - math.sqrt(m) / GAMMA * h_bar
    weight = m**-KAPPA
    log_step_avg = weight * log_step + (1.0 - weight) * state.log_step_avg
    return DualAveragingState(log_step, log_step_avg, h_bar, state.mu, m)
