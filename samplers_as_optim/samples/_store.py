"""The sample store on disk: one memory-mapped file per tensor and an atomic ``index.json``.

The layout :class:`~samplers_as_optim.SampleCollector` writes with ``path`` and reads back
with ``SampleCollector.load``: a file ``0000.bin``, ``0001.bin``, ... per recorded tensor,
allocated for all S samples up front (``[S, *shape]``, row-major), and ``index.json``,
which says what the files hold and how many samples count. The index is written
atomically (and, when asked, durably), and every field is checked when it is read, so a
damaged store is refused, never silently padded.
"""

from __future__ import annotations

import json
import mmap
import os
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

_FORMAT = "samplers_as_optim.samples"
_VERSION = 2
_INDEX = "index.json"


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
