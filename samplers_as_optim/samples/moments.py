r"""Running mean and variance of a chain's states, without storing samples (Welford).

:class:`RunningMoments` records the tensors a
:class:`~samplers_as_optim.SampleCollector` would (same sources, burn-in and thinning) and
keeps only their running mean and variance, for posterior means and standard deviations at
the memory cost of two copies of the model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from ..core.validation import check_nonnegative_integer
from ._recording import _check_dtype, _check_values, _Reader, _Schedule

__all__ = ["RunningMoments"]


class RunningMoments:
    r"""Running mean and variance of a chain's states, without storing samples.

    Welford's update, per element, for each recorded state :math:`x_n`:

    .. math::

        \delta = x_n - \bar x_{n-1}, \qquad \bar x_n = \bar x_{n-1} + \delta / n, \qquad
        M_n = M_{n-1} + \delta\,(x_n - \bar x_n),

    with variance :math:`M_n / (n - 1)` (Welford 1962; numerically stable, unlike
    :math:`\overline{x^2} - \bar x^2`). Burn-in and thinning as for
    :class:`SampleCollector`; the accumulators live on the source's device.

    Args:
        source: as for :class:`SampleCollector` (for a ParallelEnsemble the moments are
            per member, ``[K, ...]``).
        burn_in: steps discarded first (default: 0).
        thin: one step in ``thin`` is recorded (default: 1).
        buffers: also track a module's floating-point buffers that its ``state_dict``
            saves, e.g. BatchNorm's running statistics (default: True, as for
            :class:`SampleCollector`; False: the parameters only). The mean of the
            samples' statistics is not the statistics of the mean weights: to evaluate a
            model at the posterior mean, recompute them
            (``torch.optim.swa_utils.update_bn``).
        dtype: the accumulators' dtype (default: None: each tensor's dtype, at least
            float32; torch.float64 for very long chains).

    Example:
        >>> import torch
        >>> moments = RunningMoments({"x": torch.zeros(2)})
        >>> for value in ([1.0, 2.0], [3.0, 2.0], [5.0, 2.0]):
        ...     moments.record({"x": torch.tensor(value)})
        >>> moments.mean["x"], moments.variance["x"]
        (tensor([3., 2.]), tensor([4., 0.]))
    """

    def __init__(
        self,
        source: Any,
        *,
        burn_in: int = 0,
        thin: int = 1,
        buffers: bool = True,
        dtype: torch.dtype | None = None,
    ) -> None:
        self._read = _Reader(source, buffers)
        self._schedule = _Schedule(burn_in, thin)
        dtype = _check_dtype(dtype)
        self.count = 0
        current = {
            name: tensor.detach()
            for name, tensor in self._read().items()
            if tensor.is_floating_point()
        }
        self._mean: dict[str, Tensor] = {}
        self._m2: dict[str, Tensor] = {}
        for name, tensor in current.items():
            acc = torch.promote_types(tensor.dtype, torch.float32) if dtype is None else dtype
            self._mean[name] = torch.zeros(tensor.shape, dtype=acc, device=tensor.device)
            self._m2[name] = torch.zeros(tensor.shape, dtype=acc, device=tensor.device)

    @property
    def steps(self) -> int:
        """How many optimizer steps :meth:`step` has counted."""
        return self._schedule.steps

    def _shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(mean.shape) for name, mean in self._mean.items()}

    def step(self) -> bool:
        """Count one optimizer step; record the source's state if the schedule keeps it.

        Returns:
            Whether the state was recorded.
        """
        if not self._schedule.advance():
            return False
        self.record()
        return True

    def record(self, values: Mapping[str, Tensor] | None = None) -> None:
        """Update the moments with one state now, whatever the schedule.

        Args:
            values: name -> tensor (default: None, the source's current state).

        Raises:
            ValueError: ``values`` has other names or shapes.
        """
        if values is None:
            values = {name: tensor for name, tensor in self._read().items() if name in self._mean}
        else:
            _check_values(values, self._shapes())
        self.count += 1
        with torch.no_grad():
            for name, mean in self._mean.items():
                value = values[name].detach().to(device=mean.device, dtype=mean.dtype)
                delta = value - mean
                mean.add_(delta, alpha=1.0 / self.count)
                self._m2[name].addcmul_(delta, value - mean)

    @property
    def mean(self) -> dict[str, Tensor]:
        """The running mean of each tensor (copies)."""
        self._require(1, "mean")
        return {name: mean.clone() for name, mean in self._mean.items()}

    @property
    def variance(self) -> dict[str, Tensor]:
        """The running variance of each tensor, unbiased (divided by ``count - 1``)."""
        self._require(2, "variance")
        return {name: m2 / (self.count - 1) for name, m2 in self._m2.items()}

    @property
    def std(self) -> dict[str, Tensor]:
        """The running standard deviation (square root of :attr:`variance`)."""
        return {name: variance.sqrt() for name, variance in self.variance.items()}

    def _require(self, count: int, what: str) -> None:
        if self.count < count:
            raise RuntimeError(
                f"RunningMoments.{what} needs at least {count} recorded state"
                f"{'s' if count > 1 else ''} (has {self.count})"
            )

    def state_dict(self) -> dict[str, Any]:
        """The state: schedule, counters and accumulators (copies)."""
        return {
            "burn_in": self._schedule.burn_in,
            "thin": self._schedule.thin,
            "steps": self.steps,
            "count": self.count,
            "mean": {name: tensor.clone() for name, tensor in self._mean.items()},
            "m2": {name: tensor.clone() for name, tensor in self._m2.items()},
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a state from :meth:`state_dict` (same names and shapes).

        Raises:
            ValueError: other names or shapes.
        """
        _check_values(state_dict["mean"], self._shapes(), what="state_dict mean")
        _check_values(state_dict["m2"], self._shapes(), what="state_dict m2")
        self._schedule = _Schedule(state_dict["burn_in"], state_dict["thin"])
        self._schedule.steps = check_nonnegative_integer("steps", state_dict["steps"])
        self.count = check_nonnegative_integer("count", state_dict["count"])
        with torch.no_grad():
            for name in self._mean:
                self._mean[name].copy_(state_dict["mean"][name])
                self._m2[name].copy_(state_dict["m2"][name])

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(count={self.count}, burn_in={self._schedule.burn_in}, "
            f"thin={self._schedule.thin}, steps={self.steps})"
        )
