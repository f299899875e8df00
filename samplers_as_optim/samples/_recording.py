"""What a recorder of a chain reads, and when: the pieces SampleCollector and RunningMoments share.

:class:`_Reader` reads the source's current tensors (a module's parameters and sample
buffers, a ParallelEnsemble's stacked ones, or a mapping's); :class:`_Schedule` counts
optimizer steps and says which are kept (burn-in and thinning); the checks refuse recorded
values, paths and dtypes that do not fit.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..core.validation import check_bool, check_nonnegative_integer, check_positive_int
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
