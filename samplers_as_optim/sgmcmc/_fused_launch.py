"""What every fused kernel module shares: Triton's language, float64 scalars, the launches.

Importing this module does not import Triton (``sgmcmc/fused`` imports it with the
package); a kernel module imports Triton's language with :func:`optional_module` (None
where Triton is missing, so that the module still imports, for pytest's doctest
collection) and writes its kernels as plain functions that :func:`launch_elementwise`
(or :func:`launch_tensors`) jits on first launch, when ``TRITON_INTERPRET`` is read.

Annotations. Triton's compiler (not its interpreter) visits a kernel's annotations and
refuses any global name that is not Triton's own or a constexpr
(``Cannot access global variable Any``): a kernel annotates its compile-time arguments
:class:`constexpr` (Triton reads ``"constexpr"`` in the annotation's text) and the others
:data:`KernelArg`, both of which it accepts (``tests/test_fused_sgnht_baoa.py`` compiles
the kernels for an sm_90 GPU, on the CPU, without running them).

Many tensors in one launch (:func:`launch_tensors`). A tensor of at most
:data:`MULTI_TENSOR_BLOCKS` blocks shares its launch with the other small tensors of the
call on its device with its dtypes: the kernel finds its tensor, block, sizes, noise key
and data pointers in a table of 64-bit integers copied to the device once per call
(layout: :func:`launch_tensors`). The noise stays a function of ``(seed, step, key,
global index)``: each tensor keeps its own Philox key, so the numbers are those of one
launch per tensor, bit for bit (checked through Triton's interpreter).
"""

from __future__ import annotations

import array
import importlib
import struct
from collections.abc import Callable, Mapping, Sequence
from functools import cache
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import torch
from torch import Tensor

__all__ = [
    "MULTI_TENSOR_BLOCKS",
    "FusedInput",
    "FusedKernel",
    "KernelArg",
    "as_float64_bits",
    "as_int64",
    "block_size",
    "constexpr",
    "launch_elementwise",
    "launch_programs",
    "launch_tensors",
    "optional_module",
    "upload_table",
]

#: a tensor of at most this many blocks shares its launch with the other small tensors
#: of a :func:`launch_tensors` call (0: one launch per tensor)
MULTI_TENSOR_BLOCKS = 16


class constexpr(int):  # noqa: N801 (Triton reads "constexpr" in the annotation's text)
    """The annotation of a kernel's compile-time arguments; to a type checker an int.

    Marked as one of Triton's own names, so that its compiler accepts the annotation.
    """

    __triton_builtin__ = True


if TYPE_CHECKING:
    KernelArg = Any
else:

    class KernelArg:
        """The annotation of a kernel's runtime arguments (``Any`` to a type checker).

        Marked as one of Triton's own names, so that its compiler accepts the
        annotation (it refuses ``typing.Any``, a global of another module).
        """

        __triton_builtin__ = True


def optional_module(name: str) -> Any:
    """The module ``name`` (``"triton.language"``), or None where it cannot be imported."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def as_float64_bits(value: float) -> int:
    """The bits of a float64 as a signed 64-bit integer, for a kernel to bitcast back.

    Triton passes a Python float to a kernel as float32; torch's fused optimizers take
    their scalars as float64, and so do these kernels, through their bits.
    """
    signed: int = struct.unpack("<q", struct.pack("<d", float(value)))[0]
    return signed


def as_int64(value: int) -> int:
    """An unsigned 64-bit integer (a Philox key) as the signed one of the same bits."""
    return value - (1 << 64) if value >= 1 << 63 else value


def block_size(device: torch.device) -> int:
    """Elements per Triton program: 1024 on a GPU, more under the interpreter.

    (The interpreter runs its programs one after the other in Python.) The numbers do
    not depend on it.
    """
    return 1024 if device.type == "cuda" else 16384


@cache
def _jitted(function: Callable[..., Any], do_not_specialize: tuple[str, ...]) -> Any:
    """``triton.jit(function)``, made on first launch (so ``TRITON_INTERPRET`` is read then)."""
    triton = importlib.import_module("triton")
    return triton.jit(function, do_not_specialize=list(do_not_specialize))


def launch_elementwise(
    kernel: Callable[..., Any],
    first: Tensor,
    *args: Any,
    do_not_specialize: tuple[str, ...] = (),
    **constants: Any,
) -> None:
    """Launch an elementwise kernel over ``first``'s elements, one program per block.

    Calls ``kernel(first, *args, BLOCK=..., **constants)`` (jitted on first use) on a grid
    of ``ceil(numel / BLOCK)`` programs, on ``first``'s device and torch's current
    stream; nothing for an empty tensor.
    """
    numel = first.numel()
    if numel == 0:
        return
    block = block_size(first.device)
    grid = ((numel + block - 1) // block,)
    _run(_jitted(kernel, do_not_specialize), grid, first.device, (first, *args), constants, block)


def _run(
    jitted: Any,
    grid: tuple[int],
    device: torch.device,
    args: tuple[Any, ...],
    constants: Mapping[str, Any],
    block: int,
) -> None:
    """Launch ``jitted`` on ``grid`` (every launch of the fused path goes through here)."""
    if device.type == "cuda":
        with torch.cuda.device(device):
            jitted[grid](*args, BLOCK=block, **constants)
    else:
        jitted[grid](*args, BLOCK=block, **constants)


def launch_programs(
    kernel: Callable[..., Any],
    programs: int,
    device: torch.device,
    *args: Any,
    block: int,
    do_not_specialize: tuple[str, ...] = (),
    **constants: Any,
) -> None:
    """Launch ``kernel(*args, BLOCK=block, **constants)`` on ``programs`` programs."""
    if programs:
        _run(_jitted(kernel, do_not_specialize), (programs,), device, args, constants, block)


def upload_table(values: Sequence[int], device: torch.device) -> Tensor:
    """A table of 64-bit integers on ``device``: one copy, without waiting on a GPU.

    On CUDA it goes through pinned memory (``non_blocking``: torch keeps the host
    buffer until the copy has run); on the CPU (the interpreter) it is made there.
    """
    table = torch.frombuffer(array.array("q", values), dtype=torch.int64)  # (fast)
    if device.type == "cpu":
        return table.clone()  # its own memory
    return table.pin_memory().to(device, non_blocking=True)


def launch_tensors(
    kernel: Callable[..., Any],
    columns: Sequence[Sequence[Tensor]],
    *args: Any,
    offsets: Sequence[int],
    seeds: Sequence[int],
    do_not_specialize: tuple[str, ...] = (),
    **constants: Any,
) -> int:
    """Launch an elementwise kernel over many tensors, small ones several per launch.

    ``columns`` holds the kernel's tensor arguments, one list per argument, one entry per
    tensor (``[params, grads, buffers, flags]``); the first column's numel is the
    tensor's. The kernel is called as ``kernel(table, count, programs, numel, offset,
    seed, *column_tensors, *args, BLOCK=..., MULTI=..., **constants)``:

    * ``MULTI=False``: one tensor, its own arguments (``table`` None, ``count`` 1), one
      program per block (``tl.program_id(0)``), as :func:`launch_elementwise`;
    * ``MULTI=True``: the column arguments are the launch's first tensors (for their
      dtypes); program ``p`` takes block ``table[p] & 0xFFFFFFFF`` of tensor ``t =
      table[p] >> 32``, whose numel, offset and seed (``offsets``, ``seeds``, as signed
      64-bit integers of the same bits: :func:`as_int64`) are at ``table[programs + t]``,
      ``table[programs + count + t]``, ``table[programs + 2 * count + t]`` and whose
      column ``j``'s data pointer is at ``table[programs + (3 + j) * count + t]``
      (``count`` tensors, ``programs`` programs).

    Tensors of at most :data:`MULTI_TENSOR_BLOCKS` blocks share a launch per device and
    column dtypes (one table copied per device); larger ones, and a small one alone,
    have their own. Empty tensors are skipped. Returns the number of launches.
    """
    sizes: dict[torch.device, int] = {}  # each device's block size
    blocks: list[int] = []  # each tensor's number of blocks
    batches: dict[tuple[Any, ...], list[int]] = {}
    launches = 0
    for t, first in enumerate(columns[0]):
        device, numel = first.device, first.numel()
        block = sizes.get(device) or sizes.setdefault(device, block_size(device))
        blocks.append((numel + block - 1) // block)
        if numel == 0:
            continue
        if blocks[t] <= MULTI_TENSOR_BLOCKS:
            batches.setdefault((device, *(column[t].dtype for column in columns)), []).append(t)
            continue
        _launch_one(kernel, columns, t, args, offsets, seeds, do_not_specialize, constants)
        launches += 1
    # per device: (the launch's tensors, its number of programs, its table)
    shared: dict[torch.device, list[tuple[list[int], int, list[int]]]] = {}
    for (device, *_), members in batches.items():
        if len(members) == 1:
            _launch_one(
                kernel, columns, members[0], args, offsets, seeds, do_not_specialize, constants
            )
            launches += 1
            continue
        codes = [
            (position << 32) | b for position, t in enumerate(members) for b in range(blocks[t])
        ]
        rows = [columns[0][t].numel() for t in members]
        rows += [offsets[t] for t in members] + [as_int64(seeds[t]) for t in members]
        rows += [column[t].data_ptr() for column in columns for t in members]
        shared.setdefault(device, []).append((members, len(codes), codes + rows))
    jitted = _jitted(kernel, do_not_specialize)
    multi = {**constants, "MULTI": True}
    for device, launches_here in shared.items():
        table = upload_table([v for _, _, values in launches_here for v in values], device)
        start = 0
        for members, programs, values in launches_here:
            arguments: tuple[Any, ...] = (table[start:], len(members), programs, 0, 0, 0)
            arguments += tuple(column[members[0]] for column in columns) + args
            _run(jitted, (programs,), device, arguments, multi, sizes[device])
            launches += 1
            start += len(values)
    return launches


def _launch_one(
    kernel: Callable[..., Any],
    columns: Sequence[Sequence[Tensor]],
    t: int,
    args: tuple[Any, ...],
    offsets: Sequence[int],
    seeds: Sequence[int],
    do_not_specialize: tuple[str, ...],
    constants: Mapping[str, Any],
) -> None:
    """Tensor ``t`` of :func:`launch_tensors` alone (``MULTI=False``)."""
    first = columns[0][t]
    block = block_size(first.device)
    grid = ((first.numel() + block - 1) // block,)
    arguments: tuple[Any, ...] = (None, 1, grid[0], first.numel(), offsets[t], seeds[t])
    arguments += tuple(column[t] for column in columns) + args
    jitted = _jitted(kernel, do_not_specialize)
    _run(jitted, grid, first.device, arguments, {**constants, "MULTI": False}, block)


class FusedInput(NamedTuple):
    """What a sampler's fused kernel reads: one param group's tensors at one step.

    Attributes:
        params: the parameters with a gradient, contiguous (updated in place).
        grads: their gradients, contiguous (never modified).
        buffers: each state field the group keeps, one value per parameter (None where
            the kernel creates it, as SGD's momentum buffer at its first step); updated
            in place.
        seeds: each parameter's Philox key at this step (``fused.fused_noise_seed``;
            unused at temperature 0).
        offsets: the global index of each parameter's first element (a shard's offset
            in the whole tensor, else 0).
        largest: each parameter's device flag, a 1-element float64 tensor: the largest
            absolute gradient of the step over every parameter, NaN or infinity when one
            is not finite, and then the kernel writes nothing.
    """

    params: list[Tensor]
    grads: list[Tensor]
    buffers: Mapping[str, list[Tensor | None]]
    seeds: list[int]
    offsets: list[int]
    largest: list[Tensor]


class FusedKernel(Protocol):
    """What the module named by ``SamplerDefinition.fused_kernel`` provides."""

    def unsupported(self, group: Mapping[str, Any], temperature: float) -> str | None:
        """Why the kernel cannot take a param group's step (an option), or None."""

    def launch(self, group: Mapping[str, Any], inputs: FusedInput) -> Mapping[str, list[Tensor]]:
        """Take the step in place; return every state field's buffers (created ones too).

        ``group`` holds the hyperparameters, ``lr`` and ``temperature`` as floats.
        """
