"""The SG-MCMC family: one module per sampler, each one declarative definition.

A sampler module holds its derivation, its pure kernel and its
:class:`~.definition.SamplerDefinition`, from which its ``torch.optim`` class is built
there and its torchopt transformation in :mod:`samplers_as_optim.transforms`
(``docs/design.md``, "A sampler is one definition").
:data:`SAMPLERS` registers it: the generic tests (``tests/test_definitions.py``) check
every registered sampler's front ends against its definition. Importing the package
registers the step's fused backend (``fused/backend``, with ``step/backends``), whose
registry names each sampler's Triton kernel (``fused/kernels``).
"""

from .adamw_sghmc import AdamWSGHMC, adamw_sghmc_direction
from .baoa import BAOA, baoa_direction
from .fused import backend as _fused_backend  # noqa: F401  (registers the fused backend)
from .optimizer import SamplerOptimizer
from .psgld import PSGLD, psgld_direction
from .sghmc import SGHMC, sghmc_direction, sghmc_noise_scale
from .sgld import SGLD, sgld_direction, sgld_noise_scale
from .sgnht import SGNHT, sgnht_direction, sgnht_initial_state

#: every SG-MCMC sampler (a new sampler adds its class here)
SAMPLERS: tuple[type[SamplerOptimizer], ...] = (SGLD, SGHMC, SGNHT, PSGLD, BAOA, AdamWSGHMC)

__all__ = [
    "BAOA",
    "PSGLD",
    "SAMPLERS",
    "SGHMC",
    "SGLD",
    "SGNHT",
    "AdamWSGHMC",
    "adamw_sghmc_direction",
    "baoa_direction",
    "psgld_direction",
    "sghmc_direction",
    "sghmc_noise_scale",
    "sgld_direction",
    "sgld_noise_scale",
    "sgnht_direction",
    "sgnht_initial_state",
]
