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
    model.eval()
    predictions = call_stacked(model, collector.samples, x_test)   # [100, B, C]

The step counted as t (from 1) is kept when ``t > burn_in`` and ``(t - burn_in)`` is a
multiple of ``thin``, until ``num_samples`` are held: the chain needs
``total_steps = burn_in + thin * num_samples`` steps.

What a sample holds. From an ``nn.Module``: its parameters that require a gradient and
its floating-point buffers that its ``state_dict`` saves, such as BatchNorm's
``running_mean`` and ``running_var``: the statistics a sample was trained with are part
of that sample, and evaluating it with the statistics of another step (the final ones)
is a different, worse model. Not recorded, so :func:`call_stacked` uses the module's
own, shared by all samples: frozen parameters (they do not move), integer buffers
(counters such as ``num_batches_tracked``, which evaluation does not read) and
non-persistent buffers (caches derived from the parameters). ``buffers=False`` records
the parameters only. A :class:`~samplers_as_optim.ParallelEnsemble` gives the same
tensors stacked, under the model's own names, so each sample is the whole ensemble,
``[S, K, ...]`` (flatten the first two dimensions to predict with all S K draws); with a
``subset``, a recorded tensor outside it (shared by the members: a trained shared
weight, a buffer) is repeated along K, so every name has that layout. A
mapping name -> tensor gives exactly those tensors.

:class:`SampleCollector` stores the samples in storage allocated once, up front (never
grown by concatenation), by default on the CPU so a GPU chain keeps its memory; with
``path`` the storage is a set of memory-mapped files, so a run can hold more samples
than fit in RAM and what it collected survives the process. ``collector.samples`` is a
dict name -> ``[S, ...]`` tensor, the stacked layout of
:class:`~samplers_as_optim.ParallelEnsemble` and of every other method here, so one
predictive path (:func:`~samplers_as_optim.samples.stacked.call_stacked`) serves all of them.

Checkpoints and crashes. A store on disk keeps up with the chain, so after a crash it
holds samples taken after the last checkpoint; resuming from that checkpoint must take
them again, once. The collector's :meth:`~SampleCollector.state_dict` is small (counters
and the store's identity: the samples stay in the store) and makes every sample it
counts durable before it returns; put it in the same checkpoint as the model and the
optimizer, and write that checkpoint atomically. After a crash,
:meth:`SampleCollector.load` and :meth:`~SampleCollector.load_state_dict` rewind the
store to the checkpoint, so the resumed chain (the samplers resume exactly; feed it the
same batches, e.g. in an order that depends on the step) records the lost steps again:
the store ends identical to an uninterrupted run's. Checkpoint at step 0 too: a store
without any checkpoint is from a run that died at once, with nothing to resume (remove
it and start again).

.. code-block:: python

    collector = SampleCollector(model, 200, burn_in=500, thin=10, path="samples")
    for step in range(collector.total_steps):
        if step % 100 == 0:                         # step 0 included
            checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                          "collector": collector.state_dict(), "step": step,
                          "rng": torch.get_rng_state()}   # dropout, shuffling
            torch.save(checkpoint, "checkpoint.pt.tmp")
            os.replace("checkpoint.pt.tmp", "checkpoint.pt")    # atomic
        ...  # one training step, then collector.step()

    # after a crash: the model, the optimizer and the collector from the same checkpoint
    checkpoint = torch.load("checkpoint.pt")
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    torch.set_rng_state(checkpoint["rng"])
    collector = SampleCollector.load("samples", model)
    collector.load_state_dict(checkpoint["collector"])   # rewinds the store
    # continue the loop from checkpoint["step"]

:class:`~samplers_as_optim.RunningMoments` (in :mod:`samplers_as_optim.samples.moments`)
keeps only the running mean and variance of the same tensors (Welford's algorithm), for
posterior means and standard deviations at the memory cost of two copies of the model.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..core.validation import check_bool, check_nonnegative_integer, check_positive_int
from ._recording import (
    _check_dtype,
    _check_path,
    _check_values,
    _PreconditionerWatch,
    _Reader,
    _Schedule,
)
from ._store import _FORMAT, _VERSION, _file_name, _read_index, _Store, _write_index
from .moments import RunningMoments

__all__ = ["RunningMoments", "SampleCollector"]


class SampleCollector:
    r"""Keep every ``thin``-th state of a chain after ``burn_in`` steps, in preallocated storage.

    Args:
        source: what to record: an ``nn.Module`` (its parameters that require grad and
            its floating-point persistent buffers), a
            :class:`~samplers_as_optim.ParallelEnsemble` (the same, stacked, so a sample
            is ``[K, ...]``), or a mapping name -> tensor (read at each record).
        num_samples: S, how many samples to hold (an integer >= 1).
        burn_in: optimizer steps discarded before the first sample is counted (default:
            0; an integer >= 0).
        thin: keep one step in ``thin`` after burn-in (default: 1, every step; an
            integer >= 1).
        buffers: also record a module's floating-point buffers that its ``state_dict``
            saves, e.g. BatchNorm's running statistics, so that each sample is evaluated
            with its own (default: True; integer and non-persistent buffers are never
            recorded, see the module docstring; False: the parameters only, and every
            sample is evaluated with the module's current buffers).
        device: where the samples are stored (default: "cpu"; must be the CPU with
            ``path``).
        dtype: the storage dtype (default: None, each tensor's own; e.g. torch.float16
            halves the memory).
        path: None (default: storage in memory) or a directory to create, where the
            samples are written as they are collected (memory-mapped files, one per
            tensor, allocated for all S samples up front, plus ``index.json``, rewritten
            atomically at every recorded sample, so the files and the index agree at
            every instant); :meth:`load` reads it back, also after a crash. To resume a
            chain after a crash, checkpoint :meth:`state_dict` with the model and the
            optimizer (see the module docstring).
        optimizer: None (default) or the chain's optimizer: recording a sample while a
            PSGLD's or AdamWSGHMC's preconditioner still adapts (``preconditioner_warmup``
            not passed) warns once, with the burn-in that waits for its freeze.

    A collector in memory can be copied and pickled (``torch.save`` too) with its source:
    ``copy.deepcopy`` of a dict holding the model, the optimizer, the scheduler and the
    collector gives a collector recording the copied model, and a chain continued from
    the copy collects what the uninterrupted chain does. Deep-copied on its own, the
    collector takes a copy of its source along (as an lr scheduler does with its
    optimizer). A collector with a ``path`` cannot be copied or pickled (the copy would
    write into the same files): checkpoint its :meth:`state_dict` instead.

    Raises:
        FileExistsError: ``path`` already holds a sample store.
        TypeError: a flag that is not a bool, ``path`` that is not None, a str or an
            os.PathLike, an ``optimizer`` that is not None or a torch optimizer.

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
        buffers: bool = True,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
        path: str | os.PathLike[str] | None = None,
        optimizer: Any = None,
    ) -> None:
        self._watch = _PreconditionerWatch(optimizer)
        self._read: _Reader | None = _Reader(source, buffers)
        root = _check_path(path, optional=True)
        self.num_samples = check_positive_int("num_samples", num_samples)
        self._schedule = _Schedule(burn_in, thin)
        self.count = 0
        self._needs_state = False
        dtype = _check_dtype(dtype)
        device = torch.device(device)
        current = {name: tensor.detach() for name, tensor in self._read().items()}
        self._layout = {
            name: (tuple(tensor.shape), tensor.dtype if dtype is None else dtype)
            for name, tensor in current.items()
        }
        self.path: Path | None = None
        self._store: _Store | None = None
        if root is None:
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
            self._store = _Store.create(root, self.num_samples, self._layout)
            self.path = self._store.root
            self._storage = self._store.tensors
            self._write_index(durable=True)

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
        """The samples so far: name -> ``[count, ...]`` (views of the storage, not copies).

        Evaluate them with the module in eval mode: in train mode BatchNorm updates the
        running statistics of the stacked entries it is given, these views included.
        """
        return {name: storage[: self.count] for name, storage in self._storage.items()}

    # -------------------------------------------------------------- collecting
    def step(self, *, sampling: bool = True) -> bool:
        """Count one optimizer step; record the source's state if the schedule keeps it.

        Call it once after every ``optimizer.step()``. Steps after the collector is full
        are counted and ignored, with a warning the first time (a schedule that ends
        early, e.g. ``thin=1`` over a long run, usually means samples from its start
        only).

        Args:
            sampling: whether the step was a sampling step (default: True). A step that
                was not (the exploration of :class:`~samplers_as_optim.CyclicalSGMCMC`,
                whose ``is_sampling`` says which: pass it before ``scheduler.step()``) is
                counted for burn-in and thinning but never recorded.

        Returns:
            Whether a sample was recorded.

        Raises:
            TypeError: ``sampling`` is not a bool (the step is not counted).
            RuntimeError: the collector was loaded with a source and has not been given
                the checkpoint's state by :meth:`load_state_dict` yet.
        """
        check_bool("sampling", sampling)
        self._require_position()
        if not self._schedule.advance() or not sampling:
            return False
        if self.full:
            if not getattr(self, "_warned_full", False):
                self._warned_full = True
                warnings.warn(
                    f"SampleCollector is full: it holds num_samples={self.num_samples} "
                    f"samples, taken by step {self.total_steps} (burn_in={self.burn_in}, "
                    f"thin={self.thin}); step {self.steps} and later are not recorded. To "
                    "spread the samples over a longer run, raise thin or burn_in.",
                    stacklevel=2,
                )
            return False
        if getattr(self, "_watch", None) is not None:  # (absent from older pickles)
            self._watch.check(self.steps, self.burn_in, self.thin)
        self.record()
        return True

    def record(self, values: Mapping[str, Tensor] | None = None) -> None:
        """Record one sample now, whatever the schedule.

        Args:
            values: name -> tensor to record (default: None, the source's current state);
                the names and shapes must be the source's.

        Raises:
            RuntimeError: the collector is full, has no source and ``values`` is None,
                or was loaded with a source and not given its checkpoint's state yet.
            ValueError: ``values`` has other names or shapes.
        """
        self._require_position()
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
        if self._store is not None:
            # The sample's bytes are in the (shared) mapping before the index counts them;
            # once full, everything is made durable.
            if self.full:
                self._store.flush()
            self._write_index(durable=self.full)

    def _require_position(self) -> None:
        if self._needs_state:
            raise RuntimeError(
                "This SampleCollector was loaded from a store with a source, but the store "
                "does not know where the chain is (it may hold samples taken after your last "
                "checkpoint): call collector.load_state_dict(checkpoint['collector']) with "
                "the state saved beside the model and optimizer you resumed from"
            )

    # -------------------------------------------------------------- persistence
    def state_dict(self) -> dict[str, Any]:
        """The collector's state, for a checkpoint beside the model's and the optimizer's.

        With a ``path``, the state is small: the schedule, the counters and the store's
        path and identity, not the samples, which stay in the store; every sample it
        counts is flushed to disk (with the index) before it returns, so a checkpoint
        holding it never refers to samples a crash can lose. Without a ``path``, the
        state also holds copies of the samples so far.

        Returns:
            A dict for :meth:`load_state_dict` (and ``torch.save``).
        """
        state: dict[str, Any] = {
            "num_samples": self.num_samples,
            "burn_in": self.burn_in,
            "thin": self.thin,
            "steps": self.steps,
            "count": self.count,
        }
        if self._store is None:
            state["samples"] = {name: tensor.clone() for name, tensor in self.samples.items()}
            return state
        self._store.flush()
        self._write_index(durable=True)
        state["store"] = {"path": str(self._store.root), "id": self._store.id}
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a state from :meth:`state_dict`: the checkpoint's position in the chain.

        For a state of a collector with a ``path``, this collector must hold that store
        (opened by ``SampleCollector.load(path, source)``); the store is rewound to the
        state's count, so samples taken after the checkpoint are taken again by the
        resumed chain, not duplicated. A state with samples (from a collector in memory)
        has its samples copied in.

        Raises:
            ValueError: the state was saved with another ``num_samples``, other names or
                shapes, refers to another store, counts more samples than the store
                holds, or lacks a field.
        """
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"Invalid state_dict: {state_dict!r} (expected a mapping)")
        for field in ("num_samples", "burn_in", "thin", "steps", "count"):
            if field not in state_dict:
                raise ValueError(
                    f"Invalid state_dict: missing field {field!r} (expected a state from "
                    "SampleCollector.state_dict)"
                )
        if "store" not in state_dict and "samples" not in state_dict:
            raise ValueError(
                "Invalid state_dict: missing field 'store' or 'samples' (expected a state "
                "from SampleCollector.state_dict)"
            )
        if state_dict["num_samples"] != self.num_samples:
            raise ValueError(
                f"Invalid state_dict: num_samples={state_dict['num_samples']} (expected "
                f"{self.num_samples}, as this collector)"
            )
        schedule = _Schedule(state_dict["burn_in"], state_dict["thin"])
        schedule.steps = check_nonnegative_integer("steps", state_dict["steps"])
        count = check_nonnegative_integer("count", state_dict["count"])
        if count > self.num_samples:
            raise ValueError(
                f"Invalid state_dict: count={count} (expected an integer in [0, "
                f"{self.num_samples}], the capacity)"
            )
        if "store" in state_dict:
            self._check_store_state(state_dict, schedule, count)
        else:
            shapes = {name: (count, *shape) for name, shape in self._shapes().items()}
            _check_values(state_dict["samples"], shapes, what="state_dict samples")
            with torch.no_grad():
                for name, storage in self._storage.items():
                    storage[:count].copy_(state_dict["samples"][name])
            if self._store is not None:
                self._store.flush()
        self._schedule = schedule
        self.count = count
        self._needs_state = False
        if self._store is not None:
            self._write_index(durable=True)

    def _check_store_state(self, state: Mapping[str, Any], schedule: _Schedule, count: int) -> None:
        """A store state must be this collector's store, with its schedule, and not ahead."""
        store = state["store"]
        where = store.get("path") if isinstance(store, Mapping) else store
        identity = store.get("id") if isinstance(store, Mapping) else None
        if self._store is None:
            raise ValueError(
                f"Invalid state_dict: it refers to the sample store at {where!r} (expected a "
                "state with samples: this collector has no store it can write to; open the "
                "store with SampleCollector.load(path, source) and load the state there)"
            )
        if identity != self._store.id:
            raise ValueError(
                f"Invalid state_dict: it refers to the sample store {identity!r} at {where!r} "
                f"(expected this collector's store, {self._store.id!r} at "
                f"{str(self._store.root)!r})"
            )
        for field in ("burn_in", "thin"):
            if getattr(schedule, field) != getattr(self, field):
                raise ValueError(
                    f"Invalid state_dict: {field}={getattr(schedule, field)} (expected "
                    f"{getattr(self, field)}, as the store at {str(self._store.root)!r})"
                )
        if count > self.count:
            raise ValueError(
                f"Invalid state_dict: count={count} (expected at most {self.count}, the "
                f"samples in the store at {str(self._store.root)!r}: the store is older than "
                "the checkpoint)"
            )

    def save(self, path: str | os.PathLike[str] | None = None) -> None:
        """Write the samples to ``path``, a new directory (memory-mappable by :meth:`load`).

        Args:
            path: the directory to create (default: None: this collector's own store,
                whose samples and index are flushed to disk).

        Raises:
            FileExistsError: ``path`` already holds a sample store.
            TypeError: ``path`` is not None, a str or an os.PathLike.
            ValueError: no ``path`` is given and the collector has none.
        """
        root = _check_path(path, optional=True)
        own = self._store
        if root is None or (own is not None and root.resolve() == own.root):
            if own is None:
                raise ValueError(
                    "Invalid path: None (expected a directory: this collector keeps its "
                    "samples in memory)"
                )
            own.flush()
            self._write_index(durable=True)
            return
        target = _Store.create(root, self.num_samples, self._layout)
        with torch.no_grad():
            for name, tensor in target.tensors.items():
                tensor[: self.count].copy_(self._storage[name][: self.count])
        target.flush()
        _write_index(target.root, self._index(target.id), durable=True)

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        source: Any = None,
        *,
        mmap: bool = True,
        optimizer: Any = None,
    ) -> SampleCollector:
        """Open a sample store written by a collector with ``path`` or by :meth:`save`.

        The index is checked against the files: a missing or malformed field, a count
        outside [0, num_samples], or a file whose size is not the index's num_samples
        times the tensor's shape and dtype is an error, never a silently padded store.

        Args:
            path: the store's directory.
            source: None (default: read-only use of the samples), or the module (or
                mapping) being sampled, to continue collecting into the store: then call
                :meth:`load_state_dict` with the collector's state from the checkpoint you
                resume the model and optimizer from, before the next :meth:`step`.
            mmap: True (default): the samples stay on disk, memory-mapped (with a
                ``source``, collection continues into the same files; without one, the
                mapping is copy-on-write and the store is never changed); False: they are
                read into memory.
            optimizer: as for the constructor (default: None).

        Returns:
            The collector, with the store's ``count`` samples.

        Raises:
            TypeError: ``path``, ``mmap`` or ``optimizer`` of the wrong type.
            ValueError: ``path`` is not a sample store, the store is damaged, or
                ``source`` does not match it.
        """
        check_bool("mmap", mmap)
        root = _check_path(path, optional=False)
        assert root is not None
        index = _read_index(root)
        layout = {
            entry["name"]: (tuple(entry["shape"]), getattr(torch, entry["dtype"]))
            for entry in index["tensors"]
        }
        collector = cls.__new__(cls)
        collector._watch = _PreconditionerWatch(optimizer)
        collector._read = None
        collector._needs_state = False
        if source is not None:
            collector._read = _Reader(source, True, names=list(layout))
            collector._needs_state = True
        collector.num_samples = index["num_samples"]
        collector._schedule = _Schedule(index["burn_in"], index["thin"])
        collector._schedule.steps = index["steps"]
        collector.count = index["count"]
        collector._layout = layout
        # Continuing a chain writes to the files; otherwise they are mapped copy-on-write,
        # so changing the loaded tensors never changes the store.
        writable = mmap and source is not None
        store = _Store.open(root, index, layout, writable=writable)
        if collector._read is not None:
            _check_values(collector._read(), collector._shapes(), what="source")
        collector._store = store if writable else None
        collector.path = store.root if writable else None
        if mmap:
            collector._storage = store.tensors
        else:
            collector._storage = {name: tensor.clone() for name, tensor in store.tensors.items()}
        return collector

    def _shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: shape for name, (shape, _) in self._layout.items()}

    def _index(self, identity: str) -> dict[str, Any]:
        return {
            "format": _FORMAT,
            "version": _VERSION,
            "id": identity,
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

    def _write_index(self, *, durable: bool = False) -> None:
        assert self._store is not None
        _write_index(self._store.root, self._index(self._store.id), durable=durable)

    def __getstate__(self) -> dict[str, Any]:
        """The state for ``pickle`` and ``copy.deepcopy``: a collector in memory only."""
        if self._store is not None:
            raise TypeError(
                f"Cannot copy or pickle a SampleCollector with path={str(self._store.root)!r}: "
                "its samples are in memory-mapped files that a copy would write to as well "
                "(expected a collector in memory; checkpoint collector.state_dict() and "
                "resume with SampleCollector.load(path, source))"
            )
        return self.__dict__.copy()

    def __repr__(self) -> str:
        where = f", path={str(self.path)!r}" if self.path is not None else ""
        return (
            f"{type(self).__name__}(count={self.count}, num_samples={self.num_samples}, "
            f"burn_in={self.burn_in}, thin={self.thin}, steps={self.steps}{where})"
        )
