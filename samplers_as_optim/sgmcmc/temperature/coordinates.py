r"""The coordinates a chain-temperature monitor reads: a fixed subset spread over every tensor.

Reading every coordinate at every step costs a pass over :math:`\theta`, the gradient and
the momentum, as much memory traffic as a good part of the step itself. The monitor
(:class:`samplers_as_optim.diagnostics.TemperatureMonitor`) reads instead at most about
``budget`` coordinates per param group (per member of a stacked group), the same ones for
its whole life, so that its cost per step no longer grows with the model:

* **Allocation.** A group of tensors of :math:`n_j` elements each (per member),
  :math:`n = \sum_j n_j`, is read whole when :math:`n \le` ``budget``; else tensor
  :math:`j` gets :math:`k_j = \min(n_j, \max(1, \lfloor \text{budget}\, n_j/n\rfloor))`
  coordinates: proportional to its size, and every tensor is represented (so the total
  is at most ``budget`` plus the number of tensors).
* **Position.** Every :math:`s_j`-th element of the tensor's row-major flattening, from an
  offset that centres the subset: :math:`s_j` the smallest integer
  :math:`\ge \lceil n_j/k_j\rceil` that is coprime with the number of elements per
  leading index (``in_features`` for a ``Linear`` weight, ``in·kh·kw`` for a convolution's),
  so that the subset meets the columns in all residues rather than one column (a
  stride that is a multiple of the row length) or the first rows of one matrix (a
  contiguous slice). On a contiguous tensor this is a strided view: no copy, no gather,
  and the reads of the three tensors cost about :math:`3 k_j` cache lines. A tensor that
  is not contiguous (``channels_last``) is read with ``torch.take`` at the same logical
  positions, which gathers only those elements.

**Why the estimates stay unbiased.** The identities behind both estimates hold coordinate
by coordinate at stationarity, :math:`E[r_i^2/M_i] = T` and :math:`E[\theta_i\,\partial_i
U] = T` (``temperature/estimates``), so the mean over any set of coordinates chosen
independently of the chain's state has expectation :math:`T`. The bands are exact for
what is read, with :math:`d'` the subset's size in place of :math:`d`: the kinetic reading
is :math:`T\chi^2_{d'}/d'` at one step, and the configurational band is
:math:`T \pm z\,s'/\sqrt{d'}` with :math:`s'^2` the empirical variance of the subset's own
terms.

**Fixed, not rotating.** A subset that moved from step to step would cover every
coordinate over a window, but the configurational band's variance (measured at a
window's first step) would then be that of other terms than the ones averaged later; with
a fixed subset each step of the window reads the same statistic, whose single-step band
bounds the window average's spread exactly as for the full reading. Both cost the same
(a view either way).

**What is lost: detection power.** The band's half-width grows as :math:`1/\sqrt{d'}`. At
``level`` :math:`\ell` the kinetic band's upper end is about :math:`T(1 + z\sqrt{2/d'})`,
:math:`z = \Phi^{-1}((1+\ell)/2)` (3.29 at 0.999): a chain is flagged once it is hotter
than about 7.5% above :math:`T` at :math:`d' = 4096` (the monitor's default budget), 15%
at 1000, against 0.34% for all 1.9M coordinates of an MLP. The configurational band
widens by the same factor :math:`\sqrt{d/d'}`. Minibatch heating large enough to matter
(the sampled noise scale of issue #26, 30% too large: twice the variance) is far beyond
either.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import Tensor

__all__ = ["CoordinateSubset", "coordinate_subsets"]


@dataclass(frozen=True)
class CoordinateSubset:
    """The coordinates read of one tensor: ``count`` of them, every ``step``-th from ``offset``.

    Positions are in the row-major flattening of each member (the tensor's elements after
    its stacked-member dimensions); a subset with ``step == 1`` and ``count == size`` is the
    whole tensor.

    Attributes:
        size: the tensor's elements per member.
        offset: the first position read.
        step: the distance between positions.
        count: the number of positions.
    """

    size: int
    offset: int
    step: int
    count: int

    @property
    def whole(self) -> bool:
        """Whether every element is read."""
        return self.count == self.size

    def positions(self) -> range:
        """The positions read, in order."""
        return range(self.offset, self.offset + self.step * self.count, self.step)

    def read(self, tensor: Tensor, members: int) -> Tensor:
        """``tensor``'s subset: ``[count]`` (``[members, count]`` for a stack of members).

        ``tensor`` holds ``members * size`` elements (a ``ParallelEnsemble``'s stack first).
        A contiguous tensor is read through a strided view (``as_strided``: one operation,
        nothing copied); a non-contiguous one is gathered at the same logical positions
        (``torch.take``), the whole one reshaped. Nothing is written.
        """
        shape = (self.count,) if members == 1 else (members, self.count)
        if self.whole:
            return tensor.reshape(shape)
        if tensor.is_contiguous():
            strides = (self.step,) if members == 1 else (self.size, self.step)
            return tensor.as_strided(shape, strides, tensor.storage_offset() + self.offset)
        stop = self.offset + self.step * (self.count - 1) + 1
        index = torch.arange(self.offset, stop, self.step, device=tensor.device)
        if members > 1:
            starts = torch.arange(0, members * self.size, self.size, device=tensor.device)
            index = index + starts[:, None]
        return torch.take(tensor, index)


def _stride(size: int, count: int, row: int) -> int:
    """The smallest step >= ceil(size / count) that is coprime with ``row``."""
    step = -(-size // count)
    while row > 1 and math.gcd(step, row) != 1:
        step += 1
    return step


def _subset(size: int, count: int, row: int) -> CoordinateSubset:
    if count >= size:
        return CoordinateSubset(size, 0, 1, size)
    step = _stride(size, count, row)
    count = -(-size // step)  # as many as the step leaves room for (<= the allocation)
    slack = size - 1 - step * (count - 1)
    return CoordinateSubset(size, slack // 2, step, count)


@lru_cache(maxsize=256)
def _plan(shapes: tuple[tuple[int, int], ...], budget: int | None) -> tuple[CoordinateSubset, ...]:
    total = sum(size for size, _ in shapes)
    if budget is None or total <= budget:
        return tuple(CoordinateSubset(size, 0, 1, size) for size, _ in shapes)
    return tuple(
        _subset(size, min(size, max(1, budget * size // total)), row) for size, row in shapes
    )


def coordinate_subsets(
    shapes: Sequence[Sequence[int]], budget: int | None
) -> tuple[CoordinateSubset, ...]:
    r"""The subsets read of a param group's tensors, for at most about ``budget`` coordinates.

    Args:
        shapes: each tensor's shape per member (after any stacked-member dimensions).
        budget: the coordinates to read per member over the group (module docstring:
            :math:`k_j = \min(n_j, \max(1, \lfloor\text{budget}\,n_j/n\rfloor))`, the stride
            coprime with the row length); None, or a group of at most ``budget`` elements:
            every coordinate.

    Returns:
        One :class:`CoordinateSubset` per tensor, in order (cached: the same shapes give
        the same subsets for a monitor's life).
    """
    keyed = tuple(
        (math.prod(shape), math.prod(shape[1:]) if len(shape) > 1 else 1) for shape in shapes
    )
    return _plan(keyed, budget)
