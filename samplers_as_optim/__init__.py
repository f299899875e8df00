"""Bayesian deep learning in PyTorch as a one-line change.

Replace ``torch.optim.SGD`` with :class:`SGHMC` (adding ``num_data``) and a training loop
draws samples from the posterior; with ``temperature=0`` it is SGD again, bit for bit.
"""

from . import transforms
from .samplers import SGHMC, SGLD, SGNHT

__all__ = ["SGHMC", "SGLD", "SGNHT", "transforms"]
__version__ = "0.1.0"
