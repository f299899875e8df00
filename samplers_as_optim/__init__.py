"""Bayesian deep learning in PyTorch as a one-line change.

Replace ``torch.optim.SGD`` with :class:`SGHMC` (adding ``num_data``) and a training loop
draws samples from the posterior; with ``temperature=0`` it is SGD again, bit for bit.

Samplers (``torch.optim`` optimizers): :class:`SGLD`, :class:`SGHMC`, :class:`SGNHT`;
the same as torchopt transformations: :mod:`.transforms`. Gaussian approximations:
:class:`Laplace`, :class:`MeanFieldVI`, :class:`FullCovarianceVI`. Parallel chains and
deep ensembles: :class:`ParallelEnsemble`. Samples: :class:`SampleCollector`,
:class:`RunningMoments`, :func:`call_stacked`. Names for wrappers that drop them
(``ZeroRedundancyOptimizer``): :func:`name_parameters`. Using them: :mod:`.predictive`,
:mod:`.diagnostics`.
"""

from . import diagnostics, predictive, transforms
from .collect import RunningMoments, SampleCollector
from .ensemble import ParallelEnsemble, ensemble_loss
from .laplace import Laplace
from .names import name_parameters
from .samplers import SGHMC, SGLD, SGNHT
from .stacked import call_stacked
from .vi import FullCovarianceVI, MeanFieldVI

__all__ = [
    "SGHMC",
    "SGLD",
    "SGNHT",
    "FullCovarianceVI",
    "Laplace",
    "MeanFieldVI",
    "ParallelEnsemble",
    "RunningMoments",
    "SampleCollector",
    "call_stacked",
    "diagnostics",
    "ensemble_loss",
    "name_parameters",
    "predictive",
    "transforms",
]
__version__ = "0.1.0"
