r"""The samplers as torchopt gradient transformations, for torchopt and ``torch.func`` loops.

:func:`sgld`, :func:`sghmc`, :func:`sgnht`, :func:`psgld`, :func:`baoa` and
:func:`adamw_sghmc` are the chains
of :class:`~samplers_as_optim.SGLD`, :class:`~samplers_as_optim.SGHMC`,
:class:`~samplers_as_optim.SGNHT`, :class:`~samplers_as_optim.PSGLD`,
:class:`~samplers_as_optim.BAOA` and :class:`~samplers_as_optim.AdamWSGHMC`, computed by
the same kernels, as ``torchopt.base.GradientTransformation`` s: an ``(init, update)``
pair of pure functions.
:func:`langevin_noise` is the noise they inject, as a part to chain in front of a
torchopt optimizer. Each returns the update :math:`-lr\, d` for the kernel's
direction :math:`d`; ``torchopt.apply_updates`` adds it to the parameters.

The state. Everything a chain needs is in its state, a NamedTuple: the buffers (a tuple
with one tensor per leaf of the params tree, in the order of its leaves), the ``seed``
and the update counter ``count`` (Python integers). The noise of update ``count`` is a
function of ``(seed, count)`` alone, so ``update`` is a pure function of ``(updates,
state, params)``: two states from one seed give one chain, and a state saved with
``torch.save`` and loaded with ``torch.load`` continues it exactly (this module registers
the state classes with ``torch.serialization.add_safe_globals`` so that the default
``weights_only=True`` loads them). With one seed a transform and the matching Optimizer
with one param group take identical steps, given the parameters in the same order: noise
is drawn leaf after leaf, in optree's order of the tree (which sorts a dict's keys).

Where they work:

* in ``torchopt.chain``, e.g. ``torchopt.chain(torchopt.clip.clip_grad_norm(1.0),
  transforms.sghmc(1e-3, num_data=N))``;
* in ``torchopt.Optimizer`` and ``torchopt.MetaOptimizer`` (which differentiates
  through the updates: with ``dampening=0`` the graph runs through every step). Each of
  their param groups gets a state from the same ``init``, hence the same seed: give the
  sampler a single group, or use the ``torch.optim`` class, whose groups draw
  independent noise;
* in a ``torch.func`` loop with ``torch.func.grad`` and ``torchopt.apply_updates``, in
  place or not;
* under ``torch.func.vmap`` over a leading chain dimension, with
  ``randomness="different"`` so that every chain draws its own noise, and
  :func:`chain_dims` for the state's ``in_dims``/``out_dims`` (the seed and counter are
  shared, the buffers batched). Use ``inplace=False`` there. A chain under vmap does not
  draw the numbers a lone chain with that seed draws; the chains are independent and
  each has the right law.

The fused path. Every sampler above takes ``fused`` as its Optimizer does: its update is
then computed by the Optimizer's Triton kernel, with the noise a fused Optimizer of the
same seed draws; SGNHT's thermostats and BAOA's buffers stay in the state, updated by
the kernel (``sgmcmc/fused/transform``).

Precision. At temperature > 0 a chain's position must be float32 or float64: a
float16 or bfloat16 leaf of the params tree (of the updates, without ``params``) is
refused by ``update`` with a ``TypeError``, before anything changes. ``apply_updates``
would round most of each step away in half precision and the chain would freeze
without a word (SGLD, ``lr=1e-4``, ``num_data=1000``, 100 steps: a spread of 0.00009 in
bfloat16 against 0.00443 in float32), and a transformation has no place for a float32
copy of the position. Keep the parameters in float32 (``torch.autocast`` still
computes the model in half precision), or use the ``torch.optim`` class, which keeps a
float32 master copy. At temperature 0 half-precision leaves step as ``torchopt.sgd``
steps them.

Example:
    Four chains of SGHMC on the Gaussian target :math:`\mathcal N(0, I/N)` in one vmap:

    >>> import torch, torchopt
    >>> from torch.func import grad, vmap
    >>> from samplers_as_optim import transforms
    >>> N = 100
    >>> def loss(params):
    ...     return 0.5 * params["w"].pow(2).sum()
    >>> tx = transforms.sghmc(1e-2, momentum=0.9, num_data=N, seed=0)
    >>> params = {"w": torch.zeros(4, 3)}  # 4 chains of a 3-vector
    >>> dims = transforms.chain_dims(tx.init(params))
    >>> state = vmap(tx.init, out_dims=dims)(params)
    >>> def step(params, state):
    ...     updates, state = tx.update(grad(loss)(params), state, params=params, inplace=False)
    ...     return torchopt.apply_updates(params, updates, inplace=False), state
    >>> step = vmap(step, in_dims=(0, dims), out_dims=(0, dims), randomness="different")
    >>> for _ in range(10):
    ...     params, state = step(params, state)
    >>> params["w"].shape, state.count
    (torch.Size([4, 3]), 10)
    >>> bool((params["w"][0] != params["w"][1]).all())  # each chain its own noise
    True
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .sgmcmc.transform import ScalarOrSchedule, chain_dims
from .sgmcmc.transform.langevin_noise import LangevinNoiseState, langevin_noise

if TYPE_CHECKING:  # their signatures, compiled at import from their definitions, stated
    from ._signatures import (
        AdamWSGHMCState,
        BAOAState,
        PSGLDState,
        SGHMCState,
        SGLDState,
        SGNHTState,
        adamw_sghmc,
        baoa,
        psgld,
        sghmc,
        sgld,
        sgnht,
    )
else:  # each built here from its sampler's definition (the Optimizer's module needs none)
    from .sgmcmc import BAOA, PSGLD, SGHMC, SGLD, SGNHT, AdamWSGHMC
    from .sgmcmc.transform import transformation_of

    sgld, SGLDState = transformation_of(SGLD.definition, SGLD)
    sghmc, SGHMCState = transformation_of(SGHMC.definition, SGHMC)
    sgnht, SGNHTState = transformation_of(SGNHT.definition, SGNHT)
    baoa, BAOAState = transformation_of(BAOA.definition, BAOA)
    psgld, PSGLDState = transformation_of(PSGLD.definition, PSGLD)
    adamw_sghmc, AdamWSGHMCState = transformation_of(AdamWSGHMC.definition, AdamWSGHMC)

__all__ = [
    "AdamWSGHMCState",
    "BAOAState",
    "LangevinNoiseState",
    "PSGLDState",
    "SGHMCState",
    "SGLDState",
    "SGNHTState",
    "ScalarOrSchedule",
    "adamw_sghmc",
    "baoa",
    "chain_dims",
    "langevin_noise",
    "psgld",
    "sghmc",
    "sgld",
    "sgnht",
]

_STATES = (
    SGLDState,
    SGHMCState,
    SGNHTState,
    LangevinNoiseState,
    PSGLDState,
    BAOAState,
    AdamWSGHMCState,
)
#: where version 0.1 defined the state classes: a state it saved names them so
_SAVED_BY_0_1 = {
    SGLDState: "samplers_as_optim.samplers.sgld",
    SGHMCState: "samplers_as_optim.samplers.sghmc",
    SGNHTState: "samplers_as_optim.samplers.sgnht",
    LangevinNoiseState: "samplers_as_optim.samplers.sghmc",
    PSGLDState: "samplers_as_optim.samplers.psgld",
    BAOAState: "samplers_as_optim.samplers.baoa",
}
# The states hold tensors, tuples and integers only: safe for torch.load(weights_only=True),
# under this module's names and under the paths older versions saved them with.
torch.serialization.add_safe_globals(
    [
        *_STATES,
        *((state, f"{module}.{state.__name__}") for state, module in _SAVED_BY_0_1.items()),
    ]
)
