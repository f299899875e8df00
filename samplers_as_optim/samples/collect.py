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

:class:`RunningMoments` keeps only the running mean and variance of the same tensors
(Welford's algorithm), for posterior means and standard deviations at the memory cost
of two copies of the model.
"""

from __future__ import annotations

import json
import mmap
import os
import uuid
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..core.validation import check_bool, check_nonnegative_integer, check_positive_int
from .ensemble import ParallelEnsemble

__all__ = ["RunningMoments", "SampleCollector"]

_FORMAT = "samplers_as_optim.samples"
_VERSION = 2
_INDEX = "index.json"


# ---------------------------------------------------------------------- shared pieces
def _sample_buffers(module: nn.Module) -> dict[str, Tensor]:
    """The buffers a sample carries: floating-point (or complex) and persistent."""
    chosen = {}
    for name, buffer in module.named_buffers():
        prefix, _, key = name.rpartition(".")
        owner = module.get_submodule(prefix)
        persistent = key not in owner._non_persistent_buffers_set
        if persistent and (buffer.is_floating_point() or buffer.is_complex()):
            chosen[name] = buffer
    return chosen


class _Reader:
    """Returns the source's current tensors when called.

    A plain object holding references to the source (the module, or the mapping), not a
    closure and not copies: ``copy.deepcopy`` of a collector together with its model, in
    one call (e.g. a dict {model, optimizer, collector}), maps the reference to the copied
    model through deepcopy's memo, so the copy records the copied chain; ``pickle`` and
    ``torch.save`` store the source with the collector. A ParallelEnsemble is read
    through its ``module`` (the stacked tensors) with its names, subset and size fixed
    here; a mapping is read at every call, so replaced entries are followed.

    Args:
        source: a module, an ensemble or a mapping.
        buffers: also the module's sample buffers (see :func:`_sample_buffers`).
        names: None (choose the names now: the parameters that require grad and, with
            ``buffers``, the sample buffers), or the names to read (a store's); a name
            the source lacks is left out, for the caller's check to report.
    """

    def __init__(self, source: Any, buffers: bool, names: Sequence[str] | None = None) -> None:
        check_bool("buffers", buffers)
        self.module: nn.Module | None = None
        self.mapping: Mapping[str, Tensor] | None = None
        self.names: list[str] = []
        self.shared: list[str] = []  # read once, repeated along K
        self.members = 0
        if isinstance(source, ParallelEnsemble):
            module = source.module
        elif isinstance(source, nn.Module):
            module = source
        elif isinstance(source, Mapping):
            keys = list(source)
            bad = [key for key in keys if not isinstance(source[key], Tensor)]
            if not keys or bad or not all(isinstance(key, str) for key in keys):
                raise TypeError(
                    f"Invalid source: a mapping with keys {keys} (expected a non-empty "
                    "mapping of str names to tensors)"
                )
            self.mapping = source
            self.names = keys
            return
        else:
            raise TypeError(
                f"Invalid source: {source!r} (expected an nn.Module, a ParallelEnsemble or a "
                "mapping of names to tensors)"
            )

        if names is None:
            chosen = [n for n, p in module.named_parameters() if p.requires_grad]
            if buffers:
                chosen.extend(_sample_buffers(module))
            if not chosen:
                raise ValueError(
                    f"Invalid source: {type(source).__name__} has no parameters that require "
                    f"grad {'or floating-point buffers ' if buffers else ''}(expected at "
                    "least one tensor to collect)"
                )
            names = chosen
        self.module = module
        self.names = list(names)
        if isinstance(source, ParallelEnsemble) and source.subset is not None:
            subset = set(source.subset)
            self.shared = [name for name in self.names if name not in subset]
            if self.shared:
                self.members = source.num_members

    def __call__(self) -> dict[str, Tensor]:
        if self.mapping is not None:
            return {key: self.mapping[key] for key in self.names}
        assert self.module is not None
        module = self.module
        tensors = {**dict(module.named_parameters()), **dict(module.named_buffers())}
        found = {name: tensors[name] for name in self.names if name in tensors}
        for name in self.shared:  # one copy for all members: [K, ...] too
            if name in found:
                found[name] = found[name].expand(self.members, *found[name].shape)
        return found


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


def _check_path(value: Any, *, optional: bool) -> Path | None:
    """``path``: a str or an os.PathLike naming a directory (or None, when ``optional``)."""
    expected = f"{'None, ' if optional else ''}a str or an os.PathLike naming a directory"
    if value is None and optional:
        return None
    if not isinstance(value, (str, os.PathLike)) or not isinstance(os.fspath(value), str):
        raise TypeError(f"Invalid path: {value!r} (expected {expected})")
    if value == "":
        raise ValueError(
            f"Invalid path: '' (expected {expected}; '' would be the working directory)"
        )
    return Path(value)


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
            os.PathLike.

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
    ) -> None:
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

        Returns:
            The collector, with the store's ``count`` samples.

        Raises:
            TypeError: ``path`` is not a str or an os.PathLike, ``mmap`` not a bool.
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


# ---------------------------------------------------------------------- the store on disk
def _file_name(position: int) -> str:
    return f"{position:04d}.bin"


def _nbytes(num_samples: int, shape: Sequence[int], dtype: torch.dtype) -> int:
    numel = num_samples
    for size in shape:
        numel *= size
    return numel * dtype.itemsize


class _Store:
    """The files of a store on disk: one memory-mapped file per tensor, ``[S, *shape]``."""

    def __init__(self, root: Path, identity: str) -> None:
        self.root = root
        self.id = identity
        self.tensors: dict[str, Tensor] = {}
        self._maps: list[mmap.mmap] = []

    @classmethod
    def create(
        cls, root: Path, num_samples: int, layout: Mapping[str, tuple[tuple[int, ...], torch.dtype]]
    ) -> _Store:
        """Create the files of a new store in ``root`` (the caller writes the index last)."""
        if (root / _INDEX).exists():
            raise FileExistsError(
                f"Invalid path: {str(root)!r} already holds samples (expected a new "
                "directory; use SampleCollector.load(path, source) to continue collecting "
                "into it)"
            )
        root.mkdir(parents=True, exist_ok=True)
        store = cls(root.resolve(), uuid.uuid4().hex)
        for position, (name, (shape, dtype)) in enumerate(layout.items()):
            file = store.root / _file_name(position)
            with open(file, "wb") as handle:
                handle.truncate(_nbytes(num_samples, shape, dtype))
            store._map(file, name, (num_samples, *shape), dtype, writable=True)
        return store

    @classmethod
    def open(
        cls,
        root: Path,
        index: Mapping[str, Any],
        layout: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
        *,
        writable: bool,
    ) -> _Store:
        """Map the files of a checked index (sizes checked here)."""
        store = cls(root.resolve(), index["id"])
        num_samples = index["num_samples"]
        for entry in index["tensors"]:
            name = entry["name"]
            shape, dtype = layout[name]
            file = store.root / entry["file"]
            expected = _nbytes(num_samples, shape, dtype)
            what = (
                f"num_samples={num_samples} samples of {name!r} with shape {list(shape)} and "
                f"dtype {entry['dtype']}"
            )
            try:
                size = file.stat().st_size
            except OSError as error:
                raise ValueError(
                    f"Invalid file of {name!r} in {store.root / _INDEX}: {file} cannot be read "
                    f"({error.strerror}; expected {expected} bytes: {what})"
                ) from error
            if size != expected:
                raise ValueError(
                    f"Invalid size of {file}: {size} bytes (expected {expected}: {what}, as "
                    f"{store.root / _INDEX} says)"
                )
            store._map(file, name, (num_samples, *shape), dtype, writable=writable)
        return store

    def _map(
        self, file: Path, name: str, shape: tuple[int, ...], dtype: torch.dtype, *, writable: bool
    ) -> None:
        nbytes = _nbytes(1, shape, dtype)
        if nbytes == 0:  # an empty file cannot be mapped
            self.tensors[name] = torch.empty(shape, dtype=dtype)
            return
        with open(file, "r+b" if writable else "rb") as handle:
            access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_COPY
            mapping = mmap.mmap(handle.fileno(), nbytes, access=access)
        self._maps.append(mapping)
        flat = torch.frombuffer(mapping, dtype=dtype, count=nbytes // dtype.itemsize)
        self.tensors[name] = flat.view(shape)

    def flush(self) -> None:
        """Write the mapped samples through to disk (``msync``)."""
        for mapping in self._maps:
            mapping.flush()


def _write_index(root: Path, index: dict[str, Any], *, durable: bool = False) -> None:
    """Write ``index.json`` atomically (a reader never sees a half-written index).

    With ``durable``, the new index is also on disk when this returns (``fsync`` of the
    file and of the directory), not only in the operating system's cache.
    """
    temporary = root / (_INDEX + ".tmp")
    with open(temporary, "w") as handle:
        handle.write(json.dumps(index, indent=1))
        if durable:
            handle.flush()
            os.fsync(handle.fileno())
    os.replace(temporary, root / _INDEX)
    if durable and hasattr(os, "O_DIRECTORY"):  # POSIX: make the rename durable too
        directory = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)


_FIELDS = ("id", "num_samples", "count", "steps", "burn_in", "thin", "tensors")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _read_index(root: Path) -> dict[str, Any]:
    """Read and check ``index.json``: every field present and consistent."""
    file = root.resolve() / _INDEX
    where = str(file)
    try:
        text = file.read_text()
    except OSError as error:
        raise ValueError(
            f"Invalid path: {str(root)!r} (expected a sample store written by "
            f"SampleCollector: {error})"
        ) from error
    try:
        index = json.loads(text)
    except ValueError as error:
        raise ValueError(f"Invalid index in {where}: malformed JSON ({error})") from error
    if not isinstance(index, dict):
        raise ValueError(
            f"Invalid index in {where}: a JSON {type(index).__name__} (expected an object)"
        )
    if index.get("format") != _FORMAT or index.get("version") != _VERSION:
        raise ValueError(
            f"Invalid path: {str(root)!r} holds format {index.get('format')!r} version "
            f"{index.get('version')!r} (expected {_FORMAT!r} version {_VERSION})"
        )
    for field in _FIELDS:
        if field not in index:
            raise ValueError(
                f"Invalid index in {where}: missing field {field!r} (expected the fields "
                f"{list(_FIELDS)})"
            )

    def fail(field: str, expected: str) -> None:
        raise ValueError(f"Invalid {field} in {where}: {index[field]!r} (expected {expected})")

    if not isinstance(index["id"], str) or not index["id"]:
        fail("id", "a non-empty string")
    if not _is_int(index["num_samples"]) or index["num_samples"] < 1:
        fail("num_samples", "an integer >= 1")
    capacity = index["num_samples"]
    if not _is_int(index["count"]) or not 0 <= index["count"] <= capacity:
        fail("count", f"an integer in [0, {capacity}], the capacity")
    for field, low in (("steps", 0), ("burn_in", 0), ("thin", 1)):
        if not _is_int(index[field]) or index[field] < low:
            fail(field, f"an integer >= {low}")
    tensors = index["tensors"]
    if not isinstance(tensors, list) or not tensors:
        fail("tensors", "a non-empty list of {name, file, shape, dtype} objects")
    names: set[str] = set()
    files: set[str] = set()
    for position, entry in enumerate(tensors):
        _check_entry(where, position, entry, names, files)
    return index


def _check_entry(where: str, position: int, entry: Any, names: set[str], files: set[str]) -> None:
    """One entry of the index's ``tensors``: a unique name, a plain file name, a shape, a dtype."""
    fields = ("name", "file", "shape", "dtype")
    if not isinstance(entry, dict) or any(field not in entry for field in fields):
        raise ValueError(
            f"Invalid tensors[{position}] in {where}: {entry!r} (expected an object with the "
            f"fields {list(fields)})"
        )
    name = entry["name"]
    if not isinstance(name, str) or name in names:
        raise ValueError(
            f"Invalid name of tensors[{position}] in {where}: {name!r} (expected a string "
            "naming no other tensor)"
        )
    names.add(name)
    file = entry["file"]
    if not isinstance(file, str) or file in files or file in ("", ".", "..", _INDEX):
        plain = False
    else:
        plain = Path(file).name == file and "\\" not in file
    if not plain:
        raise ValueError(
            f"Invalid file of {name!r} in {where}: {file!r} (expected the name of a file in "
            "the store's directory, used by no other tensor)"
        )
    files.add(file)
    shape = entry["shape"]
    if not isinstance(shape, list) or not all(_is_int(size) and size >= 0 for size in shape):
        raise ValueError(
            f"Invalid shape of {name!r} in {where}: {shape!r} (expected a list of integers >= 0)"
        )
    dtype = entry["dtype"]
    if not isinstance(dtype, str) or not isinstance(getattr(torch, dtype, None), torch.dtype):
        raise ValueError(
            f"Invalid dtype of {name!r} in {where}: {dtype!r} (expected the name of a torch "
            "dtype, e.g. 'float32')"
        )


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
