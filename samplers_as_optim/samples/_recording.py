"""What a recorder of a chain reads, and when: the pieces SampleCollector and RunningMoments share.

:class:`_Reader` reads the source's current tensors (a module's parameters and sample
buffers, a ParallelEnsemble's stacked ones, or a mapping's); :class:`_Schedule` counts
optimizer steps and says which are kept (burn-in and thinning); :class:`_PreconditionerWatch`
warns when a sample is taken before a sampler's preconditioner froze; the checks refuse
recorded values, paths and dtypes that do not fit.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..core.validation import check_bool, check_nonnegative_integer, check_positive_int
from ..sgmcmc.temperature.warmup import adapting_warmup
from .ensemble import ParallelEnsemble


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


class _PreconditionerWatch:
    """Warns once when a sample is recorded while a sampling preconditioner still adapts.

    Or while a :class:`~samplers_as_optim.StepSizeWarmup` still adapts the optimizer's lr
    (``sgmcmc/temperature/warmup.adapting_warmup``), which is read first.

    PSGLD and AdamWSGHMC follow the optimizer's second moment during each param group's
    ``preconditioner_warmup`` (a parameter's step count, ``state["step"]``) and freeze it
    then (``state["preconditioner_step"]``, 0 until the freeze): only the frozen chain
    samples the stated law. Any other optimizer (no ``preconditioner_warmup`` in its
    groups), ``preconditioner_warmup=None`` (never frozen, by choice) and a step count
    past the warm-up without a freeze (temperature 0, where the preconditioner is
    released) are not watched. Once every watched preconditioner is seen frozen (or the
    warning shown) it reads nothing more: a release (a step at temperature 0) ends at
    the next step at temperature > 0, which freezes at once past the warm-up.
    The reads are of CPU step counts, once per recorded sample.

    Args:
        optimizer: None (nothing to watch) or the ``torch.optim.Optimizer`` of the chain.
    """

    def __init__(self, optimizer: Any) -> None:
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"Invalid optimizer: {type(optimizer).__name__} (expected None or the "
                "torch.optim.Optimizer, e.g. the sampler, whose chain is recorded)"
            )
        self.optimizer: torch.optim.Optimizer | None = optimizer
        self.done = optimizer is None

    def check(self, steps: int, burn_in: int, thin: int) -> None:
        """Called as the sample of collector step ``steps`` is recorded."""
        if self.done:
            return
        lr_warmup = adapting_warmup(self.optimizer)
        if lr_warmup is not None:
            self.done = True
            later = lr_warmup.steps - lr_warmup.seen
            warnings.warn(
                f"SampleCollector recorded a sample at step {steps} from "
                f"{type(self.optimizer).__name__} while its StepSizeWarmup still adapts lr "
                f"(step {lr_warmup.seen} of its {lr_warmup.steps}; lr is frozen {later} steps "
                "later): the samples before are not from the chain's stated law. Raise "
                f"burn_in (now {burn_in}) past it: to at least {steps + later - thin} if "
                "the collector steps with the optimizer (once per batch).",
                stacklevel=4,
            )
            return
        adapting, pending = self._adapting()
        self.done = adapting is not None or not pending
        if adapting is None:
            return
        index, count, warmup = adapting
        later = warmup - count
        warnings.warn(
            f"SampleCollector recorded a sample at step {steps} from "
            f"{type(self.optimizer).__name__} while its sampling preconditioner is still "
            f"adapting (param group {index}: step count {count}, preconditioner_warmup="
            f"{warmup}; it freezes at step count {warmup}, {later} steps later): the samples "
            "before the freeze are not from the chain's stated law. Raise burn_in to at "
            f"least {steps + later - thin} (from {burn_in}), or lower preconditioner_warmup.",
            stacklevel=4,
        )

    def _adapting(self) -> tuple[tuple[int, int, int] | None, bool]:
        """A preconditioner still adapting, and whether a watched parameter has no state.

        The first is ``(group index, step count, warm-up)`` or None; a parameter without
        state has had no gradient so far.
        """
        optimizer = self.optimizer
        assert optimizer is not None
        pending = False
        for index, group in enumerate(optimizer.param_groups):
            warmup = group.get("preconditioner_warmup")
            if warmup is None:
                continue
            for param in group["params"]:
                state = optimizer.state.get(param, {})
                if "preconditioner_step" not in state:
                    pending = True
                elif not float(state["preconditioner_step"]):
                    count = int(float(state["step"]))
                    if count < warmup:
                        return (index, count, int(warmup)), pending
        return None, pending
