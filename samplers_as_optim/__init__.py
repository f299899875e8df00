"""Bayesian deep learning in PyTorch as a one-line change.

Replace ``torch.optim.SGD`` with :class:`SGHMC` (adding ``num_data``) and a training loop
draws samples from the posterior; with ``temperature=0`` it is SGD again, bit for bit.

Samplers (``torch.optim`` optimizers): :class:`SGLD`, :class:`SGHMC`, :class:`SGNHT`,
:class:`PSGLD` (RMSprop-preconditioned), :class:`AdamWSGHMC` (AdamW's twin),
:class:`BAOA`, the cyclical schedule :class:`CyclicalSGMCMC`,
and full-batch Metropolis-corrected :class:`HMC`; their step sizes adapted in a warm-up
so that the chain runs at its temperature: :class:`StepSizeWarmup`;
the same as torchopt transformations: :mod:`.transforms`. Gaussian approximations:
:class:`Laplace` (diagonal, dense, KFAC; all or a subset of the weights),
:class:`ExtendedKalmanFilter`, :class:`SWAG`, :class:`MeanFieldVI`,
:class:`FullCovarianceVI`, :class:`IVON` (variational learning at AdamW's cost);
curvature-vector products and conjugate gradients: :mod:`.curvature`. Parallel chains and
deep ensembles: :class:`ParallelEnsemble`. Samples: :class:`SampleCollector`,
:class:`RunningMoments`, :func:`call_stacked`. Names for wrappers that drop them
(``ZeroRedundancyOptimizer``): :func:`name_parameters`. Using them: :mod:`.predictive`,
:mod:`.diagnostics`. Regression and priors: :class:`GaussianLikelihood` (a sampled noise
scale), :class:`HeteroscedasticGaussian`, :func:`prior_param_groups` (N(0, σ²/fan_in)
per layer as weight decay), :func:`prior_precision`, :func:`prior_loss`.
"""

from typing import TYPE_CHECKING

from . import curvature, diagnostics, predictive, transforms
from .gaussian.ekf import ExtendedKalmanFilter
from .gaussian.ivon import IVON
from .gaussian.laplace import Laplace
from .gaussian.swag import SWAG
from .gaussian.vi import FullCovarianceVI, MeanFieldVI
from .hmc.sampler import HMC
from .names import name_parameters
from .priors import prior_loss, prior_param_groups, prior_precision
from .regression import GaussianLikelihood, HeteroscedasticGaussian
from .samples.collect import RunningMoments, SampleCollector
from .samples.ensemble import ParallelEnsemble, ensemble_loss
from .samples.stacked import call_stacked
from .sgmcmc.cyclical import CyclicalSGMCMC
from .sgmcmc.temperature.warmup import StepSizeWarmup

if TYPE_CHECKING:  # their signatures, compiled at import from their definitions, stated
    from ._signatures import BAOA, PSGLD, SGHMC, SGLD, SGNHT, AdamWSGHMC
else:
    from .sgmcmc import BAOA, PSGLD, SGHMC, SGLD, SGNHT, AdamWSGHMC

__all__ = [
    "BAOA",
    "HMC",
    "IVON",
    "PSGLD",
    "SGHMC",
    "SGLD",
    "SGNHT",
    "SWAG",
    "AdamWSGHMC",
    "CyclicalSGMCMC",
    "ExtendedKalmanFilter",
    "FullCovarianceVI",
    "GaussianLikelihood",
    "HeteroscedasticGaussian",
    "Laplace",
    "MeanFieldVI",
    "ParallelEnsemble",
    "RunningMoments",
    "SampleCollector",
    "StepSizeWarmup",
    "call_stacked",
    "curvature",
    "diagnostics",
    "ensemble_loss",
    "name_parameters",
    "predictive",
    "prior_loss",
    "prior_param_groups",
    "prior_precision",
    "transforms",
]
__version__ = "0.1.0"
