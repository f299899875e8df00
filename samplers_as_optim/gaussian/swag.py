r"""SWAG: a Gaussian from the weights an optimizer or sampler visits (Maddox et al. 2019).

After each step of any optimizer (SGD with a high constant or cyclical learning rate, as
in the paper, or a sampler), :meth:`SWAG.record` reads the model's treated parameters
:math:`\theta_t` and updates, in O(P) time and O((2 + K) P) memory, without storing the
stream:

* the running mean :math:`\bar\theta = \frac1n\sum_t\theta_t` (SWA) and the diagonal
  variance :math:`\Sigma_\text{diag} = \frac1n\sum_t\theta_t^2 - \bar\theta^2`, accumulated
  by Welford's update (no cancellation between two large second moments);
* the last K deviations :math:`\hat D = [\theta_t - \bar\theta_t]` from the running mean
  at the time (Maddox et al. 2019, §3.2-3.3), a ring buffer of ``rank`` = K columns.

The SWAG Gaussian is :math:`\mathcal N(\bar\theta, \Sigma)` with
:math:`\Sigma = \tfrac12\big(\Sigma_\text{diag} + \hat D\hat D^\top/(K-1)\big)`, drawn as

.. math::

    \theta = \bar\theta + \sqrt T\Big(\tfrac{1}{\sqrt2}\Sigma_\text{diag}^{1/2} z_1
    + \tfrac{1}{\sqrt{2(K-1)}}\hat D z_2\Big), \qquad z_1\sim\mathcal N(0, I_P),\;
    z_2\sim\mathcal N(0, I_K)

(the paper's eq. 1 and the sampling rule after it), with K the number of stored
deviations. ``rank=0`` gives SWAG-diagonal, :math:`\mathcal N(\bar\theta,
\Sigma_\text{diag})`. ``temperature`` T multiplies the covariance, as everywhere in the
package. Draws come in the stacked layout, so
:func:`~samplers_as_optim.samples.stacked.call_stacked`, :meth:`SWAG.predict` (sampled or
linearised at :math:`\bar\theta`) and :mod:`~samplers_as_optim.predictive` apply.

Reference:
    Maddox, Izmailov, Garipov, Vetrov & Wilson (2019), A simple baseline for Bayesian
    uncertainty in deep learning. NeurIPS.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

import torch
from torch import Tensor, nn

from ..core.validation import (
    check_nonnegative_integer,
    check_positive_int,
    check_state_fields,
)
from ._weight_gaussian import _WeightGaussian, select_subset

__all__ = ["SWAG"]


class SWAG(_WeightGaussian):
    r"""Diagonal plus low-rank Gaussian from a stream of weights (SWAG, Maddox et al. 2019).

    .. math::

        \mathcal N\Big(\bar\theta,\; \tfrac T2\big(\Sigma_\text{diag} +
        \hat D\hat D^\top/(K-1)\big)\Big)

    Args:
        model: the network being trained; :meth:`record` reads its treated parameters.
        rank: K, the number of recent deviations kept (default 20, as in the paper; an
            integer >= 0; 0: the diagonal Gaussian :math:`\mathcal N(\bar\theta,
            T\Sigma_\text{diag})`).
        temperature: T, multiplies the covariance (default 1.0; a finite number >= 0).
        subset: the weights covered (default None: every parameter with
            ``requires_grad=True``), ``"last_layer"`` or a list of names, as for
            :class:`~samplers_as_optim.Laplace`; the others keep the model's values.

    Example:
        >>> import torch
        >>> from samplers_as_optim import SWAG
        >>> _ = torch.manual_seed(0)
        >>> model = torch.nn.Linear(3, 2)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> swag = SWAG(model, rank=5)
        >>> x, y = torch.randn(64, 3), torch.randn(64, 2)
        >>> for step in range(40):
        ...     optimizer.zero_grad()
        ...     batch = slice(step % 8 * 8, step % 8 * 8 + 8)
        ...     torch.nn.functional.mse_loss(model(x[batch]), y[batch]).backward()
        ...     optimizer.step()
        ...     if step >= 20:  # after a burn-in
        ...         swag.record()
        >>> draws = swag.sample(10, generator=torch.Generator().manual_seed(1))
        >>> draws["weight"].shape, swag.predict(x[:4], num_samples=10).shape
        (torch.Size([10, 2, 3]), torch.Size([10, 4, 2]))
    """

    def __init__(
        self,
        model: nn.Module,
        rank: int = 20,
        *,
        temperature: float = 1.0,
        subset: str | Sequence[str] | None = None,
    ) -> None:
        self.treated = select_subset(model, subset)
        self.model = model
        self.rank = check_nonnegative_integer("rank", rank)
        self.temperature = temperature
        params = dict(model.named_parameters())
        reference = params[self.treated.names[0]]
        size = self.treated.numel
        #: Number of recorded parameter vectors n.
        self.count = 0
        self._mean = torch.zeros(size, dtype=reference.dtype, device=reference.device)
        self._m2 = torch.zeros_like(self._mean)
        self._deviations = torch.zeros(
            self.rank, size, dtype=reference.dtype, device=reference.device
        )
        self._stored = 0
        self._next = 0

    def record(self, params: Mapping[str, Tensor] | None = None) -> None:
        r"""Add the model's current treated parameters (or ``params``) to the statistics.

        Welford: :math:`\bar\theta_n = \bar\theta_{n-1} + (\theta - \bar\theta_{n-1})/n`,
        :math:`M_n = M_{n-1} + (\theta-\bar\theta_{n-1})\circ(\theta-\bar\theta_n)`; the
        deviation :math:`\theta - \bar\theta_n` replaces the oldest of the K stored.

        Args:
            params: name -> tensor for every treated parameter (default None: read the
                model), e.g. a sample that a sampler or ``SampleCollector`` produced.
        """
        if params is None:
            params = dict(self.model.named_parameters())
        missing = [name for name in self.treated.names if name not in params]
        if missing:
            raise KeyError(f"Invalid params: missing {missing} (expected every treated name)")
        with torch.no_grad():
            theta = self.treated.flatten({n: params[n].detach() for n in self.treated.names})
            theta = theta.to(self._mean)
            if not bool(theta.isfinite().all()):
                raise ValueError(
                    f"Invalid params: non-finite values at record {self.count + 1} (expected "
                    "finite weights; the optimizer diverged?)"
                )
            self.count += 1
            delta = theta - self._mean
            self._mean += delta / self.count
            self._m2 += delta * (theta - self._mean)
            if self.rank:
                self._deviations[self._next] = theta - self._mean
                self._next = (self._next + 1) % self.rank
                self._stored = min(self._stored + 1, self.rank)

    def _check_recorded(self, needed: int = 1) -> None:
        if self.count < needed:
            raise RuntimeError(
                f"SWAG has {self.count} record(s): call record() after optimizer steps "
                f"(at least {needed} needed)"
            )

    @property
    def mean(self) -> dict[str, Tensor]:
        r""":math:`\bar\theta` (the SWA solution): name -> tensor of the parameter's shape."""
        self._check_recorded()
        return {n: t.clone() for n, t in self.treated.unflatten(self._mean).items()}

    @property
    def variance(self) -> dict[str, Tensor]:
        r""":math:`\Sigma_\text{diag} = \frac1n\sum_t(\theta_t - \bar\theta)^2` per weight."""
        self._check_recorded()
        return self.treated.unflatten(self._m2 / self.count)

    @property
    def deviations(self) -> Tensor:
        r""":math:`\hat D^\top`: the K stored deviations, (K, P) in the flat order."""
        return self._deviations[: self._stored].clone()

    def covariance(self) -> Tensor:
        r"""The dense (P, P) SWAG covariance :math:`T\Sigma` (for small models and tests)."""
        self._check_recorded(2 if self.rank else 1)
        diag = torch.diag(self._m2 / self.count)
        if not self.rank:
            return self.temperature * diag
        dev = self._deviations[: self._stored]
        low = dev.T @ dev / max(self._stored - 1, 1)
        return 0.5 * self.temperature * (diag + low)

    def sample(self, n: int, *, generator: torch.Generator | None = None) -> dict[str, Tensor]:
        r"""Draw n weights by the SWAG rule (z_1 first, then z_2, from ``generator``).

        :math:`\theta = \bar\theta + \sqrt T(\Sigma_\text{diag}^{1/2}z_1/\sqrt2 +
        \hat D z_2/\sqrt{2(K-1)})`; with ``rank=0``, :math:`\bar\theta +
        \sqrt T\,\Sigma_\text{diag}^{1/2}z_1`.

        Args:
            n: number of draws (an integer >= 1).
            generator: a ``torch.Generator`` on the parameters' device (default: None,
                torch's global RNG).

        Returns:
            The stacked layout: name -> tensor ``(n, *shape)`` for every treated parameter.
        """
        n = check_positive_int("n", n)
        self._check_recorded(2 if self.rank else 1)
        mean = self._mean
        std = (self._m2 / self.count).sqrt()
        z1 = torch.randn(n, mean.numel(), generator=generator, dtype=mean.dtype, device=mean.device)
        scale = math.sqrt(self.temperature)
        if not self.rank:
            return self.treated.unflatten(mean + scale * std * z1)
        z2 = torch.randn(n, self._stored, generator=generator, dtype=mean.dtype, device=mean.device)
        low = z2 @ self._deviations[: self._stored] / math.sqrt(2.0 * max(self._stored - 1, 1))
        return self.treated.unflatten(mean + scale * (std * z1 / math.sqrt(2.0) + low))

    def _linearisation_point(self) -> dict[str, Tensor]:
        return self.mean

    def state_dict(self) -> dict[str, Any]:
        """The running statistics, for checkpoints (tensors are cloned)."""
        return {
            "count": self.count,
            "mean": self._mean.clone(),
            "m2": self._m2.clone(),
            "deviations": self._deviations.clone(),
            "stored": self._stored,
            "next": self._next,
            "names": self.treated.names,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s statistics (same treated names, shapes, dtype, rank).

        Every field is validated before any is assigned, so a refused state leaves this
        SWAG unchanged: the names must be this SWAG's treated parameters; ``mean``,
        ``m2`` (the sum of squared deviations from the mean, >= 0) and ``deviations``
        finite tensors of the treated parameters' dtype and of shapes ``(P,)``, ``(P,)``
        and ``(rank, P)``; ``count`` an integer >= 0, ``stored`` = min(count, rank) and
        ``next`` = count mod rank (0 for rank 0), as :meth:`record` leaves them. Tensors
        may come from another device; they are copied to the parameters'.

        Raises:
            TypeError: ``state`` is not a mapping, or a field has the wrong type.
            ValueError: a field is missing or has a value :meth:`record` cannot produce.
        """
        check_state_fields(state, _STATE_FIELDS, source="SWAG.state_dict")
        names = state["names"]
        if (
            isinstance(names, str)
            or not isinstance(names, Sequence)
            or tuple(names) != self.treated.names
        ):
            _invalid_state("names", names, f"{self.treated.names}, this SWAG's treated names")
        rank, size = self.rank, self.treated.numel
        mean = self._check_state_tensor("mean", state["mean"], (size,))
        m2 = self._check_state_tensor("m2", state["m2"], (size,))
        deviations = self._check_state_tensor("deviations", state["deviations"], (rank, size))
        count = _state_integer("count", state["count"])
        stored = _state_integer("stored", state["stored"])
        if stored != min(count, rank):
            _invalid_state(
                "stored",
                stored,
                f"{min(count, rank)} = min(count, rank): the deviations kept of count={count} "
                f"records with rank={rank}",
            )
        following = _state_integer("next", state["next"])
        if following != (count % rank if rank else 0):
            _invalid_state(
                "next",
                following,
                f"{count % rank if rank else 0} = count mod rank (0 for rank 0): the ring "
                f"buffer's next slot after count={count} records with rank={rank}",
            )
        if bool((m2 < 0).any()):
            raise ValueError(
                f"Invalid state_dict: m2 with minimum {float(m2.min())!r} (expected values "
                ">= 0: the sums of squared deviations from the mean)"
            )
        if count <= 1 and bool((m2 != 0).any()):
            raise ValueError(
                f"Invalid state_dict: m2 with maximum {float(m2.max())!r} at count={count} "
                "(expected zeros: the squared deviations of at most one record sum to 0)"
            )
        if count == 0 and bool((mean != 0).any()):
            raise ValueError(
                "Invalid state_dict: nonzero mean at count=0 (expected zeros, as before the "
                "first record)"
            )
        device = self._mean.device
        new_mean = mean.detach().to(device, copy=True)
        new_m2 = m2.detach().to(device, copy=True)
        new_deviations = deviations.detach().to(device, copy=True)
        self.count = count
        self._mean = new_mean
        self._m2 = new_m2
        self._deviations = new_deviations
        self._stored = stored
        self._next = following

    def _check_state_tensor(self, field: str, value: Any, shape: tuple[int, ...]) -> Tensor:
        """A finite tensor of ``shape`` and the statistics' dtype (on any device)."""
        dtype = self._mean.dtype
        expected = f"a {dtype} tensor of shape {shape}"
        if not isinstance(value, Tensor):
            raise TypeError(
                f"Invalid state_dict: {field} of type {type(value).__name__} (expected {expected})"
            )
        if tuple(value.shape) != shape:
            what = f"the {self.treated.numel} treated weights"
            if field == "deviations":
                what = f"rank={self.rank} x {what}"
            raise ValueError(
                f"Invalid state_dict: {field} of shape {tuple(value.shape)} (expected shape "
                f"{shape}: {what})"
            )
        if value.dtype != dtype:
            raise ValueError(
                f"Invalid state_dict: {field} of dtype {value.dtype} (expected {dtype}, the "
                "dtype of the treated parameters)"
            )
        if not bool(value.isfinite().all()):
            raise ValueError(
                f"Invalid state_dict: {field} holds NaN or infinity (expected finite values, "
                "as record() keeps them)"
            )
        return value


_STATE_FIELDS = ("count", "mean", "m2", "deviations", "stored", "next", "names")


def _invalid_state(field: str, value: Any, expected: str) -> NoReturn:
    raise ValueError(f"Invalid state_dict: {field}={value!r} (expected {expected})")


def _state_integer(field: str, value: Any) -> int:
    """An integer >= 0 (Python, NumPy or one-element tensor; not a bool) as an int."""
    expected = "an integer >= 0"
    if isinstance(value, bool):
        raise TypeError(f"Invalid state_dict: {field}={value!r} (expected {expected})")
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"Invalid state_dict: {field}={value!r} (expected {expected})") from None
    if number < 0:
        _invalid_state(field, value, expected)
    return number
