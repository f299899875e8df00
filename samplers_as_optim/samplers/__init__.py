"""The SGMCMC samplers: one module per sampler, each holding its pure kernel and Optimizer."""

from .sghmc import SGHMC, sghmc_direction, sghmc_noise_scale
from .sgld import SGLD, sgld_direction, sgld_noise_scale
from .sgnht import SGNHT, sgnht_direction, sgnht_initial_state

__all__ = [
    "SGHMC",
    "SGLD",
    "SGNHT",
    "sghmc_direction",
    "sghmc_noise_scale",
    "sgld_direction",
    "sgld_noise_scale",
    "sgnht_direction",
    "sgnht_initial_state",
]
