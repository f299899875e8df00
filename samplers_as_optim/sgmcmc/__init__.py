"""The SG-MCMC family: one module per sampler (its pure kernel, Optimizer and transform)."""

from .baoa import BAOA, baoa_direction
from .psgld import PSGLD, psgld_direction
from .sghmc import SGHMC, sghmc_direction, sghmc_noise_scale
from .sgld import SGLD, sgld_direction, sgld_noise_scale
from .sgnht import SGNHT, sgnht_direction, sgnht_initial_state

__all__ = [
    "BAOA",
    "PSGLD",
    "SGHMC",
    "SGLD",
    "SGNHT",
    "baoa_direction",
    "psgld_direction",
    "sghmc_direction",
    "sghmc_noise_scale",
    "sgld_direction",
    "sgld_noise_scale",
    "sgnht_direction",
    "sgnht_initial_state",
]
