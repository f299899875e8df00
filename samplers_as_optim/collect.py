r"""Collecting posterior samples from a chain: burn-in, thinning, storage, moments.

A sampler is an optimizer, so a chain is a training loop; these classes watch it. Call
``collector.step()`` right after ``optimizer.step()``, as with a learning-rate scheduler:

.. code-block:: python

    collector = SampleCollector(model, num_samples=100, burn_in=1000, thin=10)
    for x, y in batches:                       # at least collector.total_steps of them
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        collector.step()                       # keeps steps 1010, 1020, ..., 2000
    predictions = call_stacked(model, collector.samples, x_test)   # [100, B, C]

The step counted as t (from 1) is kept when ``t > burn_in`` and ``(t - burn_in)`` is a
multiple of ``thin``, until ``num_samples`` are held: the chain needs
``total_steps = burn_in + thin * num_samples`` steps.

:class:`SampleCollector` stores the samples in storage allocated once, up front (never
grown by concatenation), by default on the CPU so a GPU chain keeps its memory; with
``path`` the storage is a set of memory-mapped files, so a run can hold more samples
than fit in RAM and what it collected survives the process. ``collector.samples`` is a
dict name -> ``[S, ...]`` tensor, the stacked layout of
:class:`~samplers_as_optim.ParallelEnsemble` and of every other method here, so one
predictive path (:func:`~samplers_as_optim.stacked.call_stacked`) serves all of them.

:class:`RunningMoments` keeps only the running mean and variance of the parameters
(Welford's algorithm), for posterior means and standard deviations at the memory cost
of two copies of the model.

What is collected from a source: an ``nn.Module`` gives its parameters that require a
gradient (frozen ones do not move; :func:`call_stacked` uses the module's own value for
any name absent from the samples) and, with ``buffers=True``, its buffers. A
:class:`~samplers_as_optim.ParallelEnsemble` gives its stacked tensors under the model's
own names, so each sample is the whole ensemble, ``[S, K, ...]`` (flatten the first two
dimensions to predict with all S K draws). A mapping name -> tensor gives exactly those
tensors.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ._validation import check_bool, check_nonnegative_integer, check_positive_int
from .ensemble import ParallelEnsemble

__all__ = ["RunningMoments", "SampleCollector"]

_FORMAT = "samplers_as_optim.samples"
_VERSION = 1
_INDEX = "index.json"


# ---------------------------------------------------------------------- shared pieces
def _reader(source: Any, buffers: bool) -> Callable[[], dict[str, Tensor]]:
    """A function returning the source's current tensors, by the names chosen now."""
    check_bool("buffers", buffers)
    if isinstance(source, ParallelEnsemble):
        module = source.module
    elif isinstance(source, nn.Module):
        module = source
    elif isinstance(source, Mapping):
        keys = list(source)
        bad = [key for key in keys if not isinstance(source[key], Tensor)]
        if not keys or bad or not all(isinstance(key, str) for key in keys):
            raise TypeError(
                f"Invalid source: a mapping with keys {keys} (expected a non-empty mapping "
                "of str names to tensors)"
            )
        return lambda: {key: source[key] for key in keys}
    else:
        raise TypeError(
            f"Invalid source: {source!r} (expected an nn.Module, a ParallelEnsemble or a "
            "mapping of names to tensors)"
        )

    def current() -> dict[str, Tensor]:
        tensors = dict(module.named_parameters())
        if buffers:
            tensors.update(module.named_buffers())
        return tensors

    names = [n for n, t in current().items() if not isinstance(t, nn.Parameter) or t.requires_grad]
    if not names:
        raise ValueError(
            f"Invalid source: {type(source).__name__} has no parameters that require grad "
            f"{'or buffers ' if buffers else ''}(expected at least one tensor to collect)"
        )

    def read() -> dict[str, Tensor]:
        tensors = current()
        return {name: tensors[name] for name in names}

    return read


def _check_values(
    values: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], *, what: str = "values"
) -> None:
    """``values`` must have the names of ``shapes`` and, per name, that shape."""
    if not isinstance(values, Mapping) or set(values) != set(shapes):
        names = sorted(values) if isinstance(values, Mapping) else values
        raise ValueError(f"Invalid {what}: names {names} (expected {sorted(shapes)})")
    for name, value in values.items():
        if not isinstance(value, Tensor) or tuple(value.shape) != shapes[name]:
            shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
            raise ValueError(
                f"Invalid {what}: {name!r} has shape {shape} (expected {shapes[name]})"
            )


def _check_dtype(dtype: Any) -> torch.dtype | None:
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"Invalid dtype: {dtype!r} (expected None or a torch.dtype)")
    return dtype


class _Schedule:
    """Burn-in and thinning: which optimizer steps are kept."""

    def __init__(self, burn_in: Any, thin: Any) -> None:
        self.burn_in = check_nonnegative_integer("burn_in", burn_in)
        self.thin = check_positive_int("thin", thin)
        self.steps = 0

    def advance(self) -> bool:
        """Count one optimizer step; True when that step is to be kept."""
        self.steps += 1
        after = self.steps - self.burn_in
        return after > 0 and after % self.thin == 0


# ---------------------------------------------------------------------- samples
class SampleCollector:
    r"""Keep every ``thin``-th state of a chain after ``burn_in`` steps, in preallocated storage.

    Args:
        source: what to record: an ``nn.Module`` (its parameters that require grad),
            a :class:`~samplers_as_optim.ParallelEnsemble` (its stacked tensors, so a
            sample is ``[K, ...]``), or a mapping name -> tensor (read at each record).
        num_samples: S, how many samples to hold (an integer >= 1).
        burn_in: optimizer steps discarded before the first sample is counted (default:
            0; an integer >= 0).
        thin: keep one step in ``thin`` after burn-in (default: 1, every step; an
            integer >= 1).
        buffers: also record a module's buffers, e.g. BatchNorm statistics (default:
            False).
        device: where the samples are stored (default: "cpu"; must be the CPU with
            ``path``).
        dtype: the storage dtype (default: None, each tensor's own; e.g. torch.float16
            halves the memory).
        path: None (default: storage in memory) or a directory to create, where the
            samples are written as they are collected (memory-mapped files, one per
            tensor, allocated for all S samples up front, plus ``index.json``, rewritten
            atomically at every recorded sample); :meth:`load` reads it back, also after
            a crash. Call :meth:`save` when you checkpoint the model and optimizer, so the
            index also holds the step counter of that moment and a resumed chain
            continues exactly.

    Raises:
        FileExistsError: ``path`` already holds a sample store.

    Example:
        >>> import torch
        >>> from samplers_as_optim import SGLD
        >>> _ = torch.manual_seed(0)
        >>> model = torch.nn.Linear(3, 1)
        >>> optimizer = SGLD(model.parameters(), lr=1e-2, num_data=100, seed=0)
        >>> collector = SampleCollector(model, num_samples=5, burn_in=10, thin=2)
        >>> collector.total_steps
        20
        >>> for _ in range(collector.total_steps):
        ...     optimizer.zero_grad()
        ...     model(torch.randn(8, 3)).pow(2).mean().backward()
        ...     optimizer.step()
        ...     _ = collector.step()
        >>> collector.full, {name: tuple(t.shape) for name, t in collector.samples.items()}
        (True, {'weight': (5, 1, 3), 'bias': (5, 1)})
    """

    def __init__(
        self,
        source: Any,
        num_samples: int,
        *,
        burn_in: int = 0,
        thin: int = 1,
        buffers: bool = False,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
        path: str | os.PathLike[str] | None = None,
    ) -> None:
        self._read = _reader(source, buffers)
        self.num_samples = check_positive_int("num_samples", num_samples)
        self._schedule = _Schedule(burn_in, thin)
        self.count = 0
        dtype = _check_dtype(dtype)
        device = torch.device(device)
        current = {name: tensor.detach() for name, tensor in self._read().items()}
        self._layout = {
            name: (tuple(tensor.shape), tensor.dtype if dtype is None else dtype)
            for name, tensor in current.items()
        }
        self.path: Path | None = None
        if path is None:
            self._storage = {
                name: torch.empty((self.num_samples, *shape), dtype=dt, device=device)
                for name, (shape, dt) in self._layout.items()
            }
        else:
            if device.type != "cpu":
                raise ValueError(
                    f"Invalid device: {str(device)!r} (expected 'cpu' when path is given: "
                    "samples stream to memory-mapped files)"
                )
            self.path = _create_store(Path(path))
            self._storage = _map_store(self.path, self.num_samples, self._layout, writable=True)
            self._write_index()

    # -------------------------------------------------------------- properties
    @property
    def burn_in(self) -> int:
        """Steps discarded before the first sample is counted."""
        return self._schedule.burn_in

    @property
    def thin(self) -> int:
        """One step in ``thin`` is kept after burn-in."""
        return self._schedule.thin

    @property
    def steps(self) -> int:
        """How many optimizer steps :meth:`step` has counted."""
        return self._schedule.steps

    @property
    def total_steps(self) -> int:
        """The steps a chain needs to fill the collector: ``burn_in + thin * num_samples``."""
        return self.burn_in + self.thin * self.num_samples

    @property
    def full(self) -> bool:
        """Whether all ``num_samples`` samples are held."""
        return self.count >= self.num_samples

    @property
    def samples(self) -> dict[str, Tensor]:
        """The samples so far: name -> ``[count, ...]`` (views of the storage, not copies)."""
        return {name: storage[: self.count] for name, storage in self._storage.items()}

    # -------------------------------------------------------------- collecting
    def step(self) -> bool:
        """Count one optimizer step; record the source's state if the schedule keeps it.

        Call it once after every ``optimizer.step()``. Steps after the collector is full
        are counted and ignored.

        Returns:
            Whether a sample was recorded.
        """
        if not self._schedule.advance() or self.full:
            return False
        self.record()
        return True

    def record(self, values: Mapping[str, Tensor] | None = None) -> None:
        """Record one sample now, whatever the schedule.

        Args:
            values: name -> tensor to record (default: None, the source's current state);
                the names and shapes must be the source's.

        Raises:
            RuntimeError: the collector is full, or has no source and ``values`` is None.
            ValueError: ``values`` has other names or shapes.
        """
        if self.full:
            raise RuntimeError(
                f"SampleCollector is full: it holds num_samples={self.num_samples} samples"
            )
        if values is None:
            if self._read is None:
                raise RuntimeError(
                    "This SampleCollector has no source (it was loaded without one): pass "
                    "source= to SampleCollector.load to continue collecting"
                )
            values = self._read()
        else:
            _check_values(values, self._shapes())
        with torch.no_grad():
            for name, storage in self._storage.items():
                storage[self.count].copy_(values[name].detach())
        self.count += 1
        if self.path is not None:
            self._write_index()

    # -------------------------------------------------------------- persistence
    def state_dict(self) -> dict[str, Any]:
        """The collector's state: schedule, counters and the samples so far (copies)."""
        return {
            "num_samples": self.num_samples,
            "burn_in": self.burn_in,
            "thin": self.thin,
            "steps": self.steps,
            "count": self.count,
            "samples": {name: tensor.clone() for name, tensor in self.samples.items()},
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a state from :meth:`state_dict` (same source layout and ``num_samples``).

        Raises:
            ValueError: the state was saved with another ``num_samples`` or other names
                or shapes.
        """
        if state_dict["num_samples"] != self.num_samples:
            raise ValueError(
                f"Invalid state_dict: num_samples={state_dict['num_samples']} (expected "
                f"{self.num_samples}, as this collector)"
            )
        count = check_nonnegative_integer("count", state_dict["count"])
        shapes = {name: (count, *shape) for name, shape in self._shapes().items()}
        _check_values(state_dict["samples"], shapes, what="state_dict samples")
        samples = state_dict["samples"]
        self._schedule = _Schedule(state_dict["burn_in"], state_dict["thin"])
        self._schedule.steps = check_nonnegative_integer("steps", state_dict["steps"])
        with torch.no_grad():
            for name, storage in self._storage.items():
                storage[:count].copy_(samples[name])
        self.count = count
        if self.path is not None:
            self._write_index()

    def save(self, path: str | os.PathLike[str] | None = None) -> None:
        """Write the samples to ``path``, a new directory (memory-mappable by :meth:`load`).

        Args:
            path: the directory to create (default: None: this collector's own ``path``,
                whose index is brought up to date).

        Raises:
            FileExistsError: ``path`` already holds a sample store.
            ValueError: no ``path`` is given and the collector has none.
        """
        if path is None or (self.path is not None and Path(path).resolve() == self.path):
            if self.path is None:
                raise ValueError(
                    "Invalid path: None (expected a directory: this collector keeps its "
                    "samples in memory)"
                )
            self._write_index()
            return
        target = _create_store(Path(path))
        stores = _map_store(target, self.num_samples, self._layout, writable=True)
        for name, store in stores.items():
            store[: self.count].copy_(self._storage[name][: self.count])
        _write_index(target, self._index())

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        source: Any = None,
        *,
        mmap: bool = True,
        buffers: bool = False,
    ) -> SampleCollector:
        """Open a sample store written by a collector with ``path`` or by :meth:`save`.

        Args:
            path: the store's directory.
            source: None (default: read-only use of the samples), or the module (or
                mapping) being sampled, to continue collecting where the store stopped:
                the schedule and the step counter resume from the store.
            mmap: True (default): the samples stay on disk, memory-mapped (with a
                ``source``, collection continues into the same files; without one, the
                mapping is copy-on-write and the store is never changed); False: they are
                read into memory.
            buffers: as in the constructor, for ``source``.

        Returns:
            The collector, with ``count`` samples.

        Raises:
            ValueError: ``path`` is not a sample store, or ``source`` does not match it.
        """
        check_bool("mmap", mmap)
        root = Path(path)
        index = _read_index(root)
        collector = cls.__new__(cls)
        collector._read = None
        if source is not None:
            collector._read = _reader(source, buffers)
        collector.num_samples = index["num_samples"]
        collector._schedule = _Schedule(index["burn_in"], index["thin"])
        collector._schedule.steps = index["steps"]
        collector.count = index["count"]
        collector._layout = {
            entry["name"]: (tuple(entry["shape"]), getattr(torch, entry["dtype"]))
            for entry in index["tensors"]
        }
        if source is not None:
            _check_values(collector._read(), collector._shapes(), what="source")
        # Continuing a chain writes to the files; otherwise they are mapped copy-on-write,
        # so changing the loaded tensors never changes the store.
        writable = mmap and source is not None
        storage = _map_store(root, collector.num_samples, collector._layout, writable=writable)
        collector.path = root.resolve() if writable else None
        if mmap:
            collector._storage = storage
        else:
            collector._storage = {name: tensor.clone() for name, tensor in storage.items()}
        return collector

    def _shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: shape for name, (shape, _) in self._layout.items()}

    def _index(self) -> dict[str, Any]:
        return {
            "format": _FORMAT,
            "version": _VERSION,
            "num_samples": self.num_samples,
            "count": self.count,
            "steps": self.steps,
            "burn_in": self.burn_in,
            "thin": self.thin,
            "tensors": [
                {
                    "name": name,
                    "file": _file_name(position),
                    "shape": list(shape),
                    "dtype": str(dtype).removeprefix("torch."),
                }
                for position, (name, (shape, dtype)) in enumerate(self._layout.items())
            ],
        }

    def _write_index(self) -> None:
        assert self.path is not None
        _write_index(self.path, self._index())

    def __repr__(self) -> str:
        where = f", path={str(self.path)!r}" if self.path is not None else ""
        return (
            f"{type(self).__name__}(count={self.count}, num_samples={self.num_samples}, "
            f"burn_in={self.burn_in}, thin={self.thin}, steps={self.steps}{where})"
        )


def _file_name(position: int) -> str:
    return f"{position:04d}.bin"


def _create_store(root: Path) -> Path:
    if (root / _INDEX).exists():
        raise FileExistsError(
            f"Invalid path: {str(root)!r} already holds samples (expected a new directory; "
            "use SampleCollector.load(path, source) to continue collecting into it)"
        )
    root.mkdir(parents=True, exist_ok=True)
    return root.resolve()


def _map_store(
    root: Path,
    num_samples: int,
    layout: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
    *,
    writable: bool,
) -> dict[str, Tensor]:
    """Memory-map one file per tensor as ``[num_samples, *shape]`` (created if writable)."""
    stores = {}
    for position, (name, (shape, dtype)) in enumerate(layout.items()):
        numel = num_samples
        for size in shape:
            numel *= size
        flat = torch.from_file(
            str(root / _file_name(position)), shared=writable, size=numel, dtype=dtype
        )
        stores[name] = flat.view(num_samples, *shape)
    return stores


def _write_index(root: Path, index: dict[str, Any]) -> None:
    """Write ``index.json`` atomically (a reader never sees a half-written index)."""
    temporary = root / (_INDEX + ".tmp")
    temporary.write_text(json.dumps(index, indent=1))
    os.replace(temporary, root / _INDEX)


def _read_index(root: Path) -> dict[str, Any]:
    try:
        index = json.loads((root / _INDEX).read_text())
    except (OSError, ValueError) as error:
        raise ValueError(
            f"Invalid path: {str(root)!r} (expected a sample store written by "
            f"SampleCollector: {error})"
        ) from error
    if index.get("format") != _FORMAT or index.get("version") != _VERSION:
        raise ValueError(
            f"Invalid path: {str(root)!r} holds format {index.get('format')!r} version "
            f"{index.get('version')!r} (expected {_FORMAT!r} version {_VERSION})"
        )
    return index


# ---------------------------------------------------------------------- moments
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
        buffers: also track a module's floating-point buffers (default: False).
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
        buffers: bool = False,
        dtype: torch.dtype | None = None,
    ) -> None:
        self._read = _reader(source, buffers)
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
