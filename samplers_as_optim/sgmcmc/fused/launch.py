r"""What every fused kernel module shares on the host: float64 scalars, the launches.

Importing this module does not import Triton (``sgmcmc/fused`` imports it with the
package); a kernel module imports Triton's language from ``fused/io`` (``tl``, by
:func:`optional_module`: None where Triton is missing, so that the module still imports,
for pytest's doctest collection) and writes its kernels as plain functions that
:func:`launch_elementwise` (or :func:`launch_tensors`, through
:meth:`Part.launch_members`) jits on first launch, when ``TRITON_INTERPRET`` is read,
never specialised on the scalars that change between steps.

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

Mixed precision (:class:`FusedInput`'s ``grad_scales`` and ``masters``; issue #24). The
kernels take these compile-time flags, set per :class:`Part` (one kernel call each, so
tensors with and without a master never share a launch), and read and write through
``fused/io``'s Triton functions:

* ``UNSCALE``: gradient element :math:`g` is read as :math:`g/s`, with :math:`s` the
  ``torch.amp.GradScaler`` scale read on the device (one pointer per call, not a table
  column), divided in float64 and rounded once to the position's dtype (float32 for a
  half parameter, the parameter's own otherwise): the correctly rounded quotient, so
  torch's float32 ``g / s`` bit for bit. Before ``maximize`` and weight decay; the
  gradients are never written. :func:`torch_gradient` computes the same numbers with
  torch, for the work before a kernel (the pooled preconditioner).
* ``MASTER``: the position is read from and written to the float32 master (one more
  table column, the parameter itself where there is none), the gradient widened to
  float32, every buffer float32: the numbers of a float32 parameter holding the
  master's values, the noise included; the parameter then receives the new position
  rounded to nearest even.
* ``NARROW``: a float16/bfloat16 parameter without master (temperature 0): computed in
  float32, as torch's fused SGD and AdamW compute it, the parameter and its buffers
  stored in its dtype. Only BAOA's and PSGLD's kernels have it: at temperature 0 SGLD
  and SGHMC take torch's fused SGD step and AdamWSGHMC torch's fused AdamW step (the
  transforms' fused path takes float32 and float64 only), and SGNHT refuses temperature
  0, so no other kernel is given such a parameter.
* ``BF16``: the parameter is bfloat16. Triton's interpreter truncates a conversion to
  bfloat16 (and mangles one from float64), so a value stored in bfloat16 is first rounded
  to nearest even on its float32 bits (``fused/io.narrowed``), exact in float32, which
  the GPU and the interpreter then convert alike.

A non-finite step flag writes nothing: the parameter, the master and every buffer keep
every bit.
"""

from __future__ import annotations

import array
import importlib
import inspect
import struct
from collections.abc import Callable, Mapping, Sequence
from functools import cache
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import torch
from torch import Tensor

__all__ = [
    "HALF",
    "MULTI_TENSOR_BLOCKS",
    "FusedInput",
    "FusedKernel",
    "KernelArg",
    "Part",
    "as_float64_bits",
    "as_int64",
    "block_size",
    "constexpr",
    "group_flags",
    "launch_elementwise",
    "launch_programs",
    "launch_tensors",
    "optional_module",
    "parts",
    "positions",
    "torch_fused_sgd",
    "torch_gradient",
    "upload_table",
]

#: the parameter dtypes a kernel takes in float32 (a master) or as torch's SGD takes them
HALF = (torch.float16, torch.bfloat16)

#: a tensor of at most this many blocks shares its launch with the other small tensors
#: of a :func:`launch_tensors` call (0: one launch per tensor)
MULTI_TENSOR_BLOCKS = 16


if TYPE_CHECKING:
    constexpr = int  # (a flag or a size)
    KernelArg = Any
else:

    class constexpr(int):  # noqa: N801 (Triton reads "constexpr" in the annotation's text)
        """The annotation of a kernel's compile-time arguments; to a type checker an int.

        Marked as one of Triton's own names, so that its compiler accepts the annotation.
        """

        __triton_builtin__ = True

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
    """``triton.jit(function)``, made on first launch (so ``TRITON_INTERPRET`` is read then).

    Not specialised on ``do_not_specialize`` nor on its float64 scalars (the arguments
    named ``*_bits``: :func:`as_float64_bits`), whose values change between steps: one
    compiled kernel.
    """
    triton = importlib.import_module("triton")
    scalars = [name for name in inspect.signature(function).parameters if name.endswith("_bits")]
    return triton.jit(function, do_not_specialize=[*do_not_specialize, *scalars])


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
    have their own. Empty tensors are skipped. Returns the number of launches. The
    kernel is not specialised on ``count``, ``programs``, ``offset`` and ``seed`` either.
    """
    do_not_specialize = ("count", "programs", "offset", "seed", *do_not_specialize)
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
            is not finite, and then the kernel writes nothing (parameter, master,
            buffers).
        grad_scales: each parameter's ``torch.amp.GradScaler`` scale :math:`s`, a
            1-element float32 tensor on its device (one tensor per device), or None: no
            scaling. The kernels read each gradient element as :math:`g/s`, divided in
            float64 and rounded once to float32 (float64 for a float64 gradient), before
            ``maximize`` and weight decay; the gradients are never written.
        masters: each parameter's float32 master copy (contiguous, its shape, on its
            device) for a float16/bfloat16 parameter whose chain keeps one, else None
            (None for the whole list: none). The step then runs on the master exactly
            as on a float32 parameter holding its values (the gradient widened, every
            buffer float32, the same noise), writes the master and, rounded to nearest,
            the parameter.
    """

    params: list[Tensor]
    grads: list[Tensor]
    buffers: Mapping[str, list[Tensor | None]]
    seeds: list[int]
    offsets: list[int]
    largest: list[Tensor]
    grad_scales: list[Tensor] | None = None
    masters: list[Tensor | None] | None = None


class Part(NamedTuple):
    """Tensors of a :class:`FusedInput` that one kernel call takes: the same compile-time flags.

    Attributes:
        members: their indices in the input, in its order.
        scale: the GradScaler scale they all read (one tensor), or None.
        master: whether they keep float32 masters (the kernels' ``MASTER``).
        narrow: whether they are float16/bfloat16 parameters without a master (BAOA's
            and PSGLD's kernels' ``NARROW``: computed in float32, as torch's fused SGD
            and AdamW compute a half parameter, the parameter and its state stored in its
            dtype; no other kernel is given such a part).
        bf16: whether the parameters are bfloat16 (the kernels' ``BF16``: with a
            master or narrow, the stored bfloat16 values are rounded to nearest even on
            the float32 bits, as the GPU rounds; Triton's interpreter truncates).
    """

    members: list[int]
    scale: Tensor | None
    master: bool
    narrow: bool
    bf16: bool

    def take(self, values: Sequence[Any]) -> list[Any]:
        """The entries of ``values`` (one per parameter of the input) of the members."""
        return [values[i] for i in self.members]

    def positions(self, inputs: FusedInput) -> list[Tensor]:
        """The tensors holding the members' positions: their masters, or the parameters."""
        return self.take(positions(inputs))

    def scale_argument(self, inputs: FusedInput) -> Tensor:
        """The kernels' ``grad_scale`` pointer: the scale (a flag, never read, without)."""
        return inputs.largest[self.members[0]] if self.scale is None else self.scale

    def alone(self, i: int) -> Part:
        """Member ``i`` alone, with the same flags."""
        return self._replace(members=[i])

    def flags(self) -> dict[str, bool]:
        """The compile-time arguments ``UNSCALE``, ``MASTER`` and ``BF16``.

        A kernel with a ``NARROW`` variant (BAOA's, PSGLD's) takes ``NARROW=self.narrow``
        too; the others are never given a narrow part (``fused/launch``'s docstring).
        """
        return {"UNSCALE": self.scale is not None, "MASTER": self.master, "BF16": self.bf16}

    def launch_members(
        self,
        kernel: Callable[..., Any],
        group: Mapping[str, Any],
        inputs: FusedInput,
        columns: Sequence[Sequence[Tensor]],
        *scalars: float,
        **constants: Any,
    ) -> None:
        """:func:`launch_tensors` of ``kernel`` over the members (SGLD's, SGHMC's, ...).

        The kernel's tensor columns are the parameters, the gradients, ``columns`` (one
        entry per parameter of the input) and the positions (:meth:`positions`); its
        further arguments the scale's pointer (:meth:`scale_argument`) and ``scalars``
        as float64 (:func:`as_float64_bits`); its compile-time arguments ``MAXIMIZE`` and
        ``DECAY`` (the group's ``maximize``, a nonzero ``weight_decay``), ``constants``
        and :meth:`flags`.
        """
        flags: dict[str, Any] = {**group_flags(group), **constants, **self.flags()}
        launch_tensors(
            kernel,
            [self.take(column) for column in (inputs.params, inputs.grads, *columns)]
            + [self.positions(inputs)],
            self.scale_argument(inputs),
            *(as_float64_bits(value) for value in scalars),
            offsets=self.take(inputs.offsets),
            seeds=self.take(inputs.seeds),
            **flags,
        )


def group_flags(group: Mapping[str, Any]) -> dict[str, bool]:
    """The compile-time ``MAXIMIZE`` and ``DECAY`` of a param group (every kernel takes them)."""
    return {"MAXIMIZE": bool(group["maximize"]), "DECAY": float(group["weight_decay"]) != 0}


def positions(inputs: FusedInput) -> list[Tensor]:
    """Each parameter's position: its float32 master, or the parameter itself."""
    masters = inputs.masters or [None] * len(inputs.params)
    return [param if m is None else m for param, m in zip(inputs.params, masters, strict=True)]


def parts(inputs: FusedInput) -> list[Part]:
    """The input's tensors by compile-time flags and GradScaler scale, in their order.

    Tensors with and without a master never share a launch.
    """
    found: dict[tuple[bool, bool, bool, int | None], Part] = {}
    for i, param in enumerate(inputs.params):
        scale = None if inputs.grad_scales is None else inputs.grad_scales[i]
        master = inputs.masters is not None and inputs.masters[i] is not None
        narrow = not master and param.dtype in HALF
        bf16 = param.dtype == torch.bfloat16
        key = (master, narrow, bf16, None if scale is None else id(scale))
        found.setdefault(key, Part([], scale, master, narrow, bf16)).members.append(i)
    return list(found.values())


def torch_gradient(inputs: FusedInput, i: int) -> Tensor:
    """Gradient ``i`` as the kernels read it, computed by torch (for work before a kernel).

    :math:`g/s` divided in float64 and rounded once to float32 (float64 for a float64
    gradient), the kernels' numbers bit for bit; without a scale the gradient itself,
    widened to float32 where the parameter keeps a master. A new tensor where it differs.
    """
    grad = inputs.grads[i]
    scale = None if inputs.grad_scales is None else inputs.grad_scales[i]
    has_master = inputs.masters is not None and inputs.masters[i] is not None
    if scale is None:
        return grad.float() if has_master else grad
    wide = torch.float64 if grad.dtype == torch.float64 else torch.float32
    return grad.double().div(scale.double()).to(wide)


class FusedKernel(Protocol):
    """What a fused kernel module provides (the one ``SamplerDefinition.fused_kernel`` returns)."""

    def unsupported(self, group: Mapping[str, Any], temperature: float) -> str | None:
        """Why the kernel cannot take a param group's step (an option), or None."""

    def launch(self, group: Mapping[str, Any], inputs: FusedInput) -> Mapping[str, list[Tensor]]:
        """Take the step in place; return every state field's buffers (created ones too).

        ``group`` holds the hyperparameters, ``lr`` and ``temperature`` as floats.
        """


def torch_fused_sgd(
    group: Mapping[str, Any],
    inputs: FusedInput,
    buffers: Sequence[Tensor] | None = None,
    first: Sequence[bool] | None = None,
) -> None:
    """The step at temperature 0: torch's own fused SGD step (``torch._fused_sgd_``).

    At :math:`T = 0` SGLD and SGHMC are ``torch.optim.SGD``, and their fused step is
    ``SGD(fused=True)``'s, bit for bit, whatever torch computes it with (torch 2.11's
    CUDA kernel rounds lr to float32 for a float32 parameter, for one): the same op on
    the same tensors. ``buffers``: the momentum buffers (None without momentum),
    ``first[i]``: buffer ``i`` is created by this step (zeros given: torch then writes
    ``g``, as on its first step; a skipped step leaves the zeros). The device flag
    ``inputs.largest`` becomes torch's ``found_inf`` (a non-finite gradient: nothing is
    written); a GradScaler's scale goes to torch as ``grad_scale``, on copies of the
    gradients (torch writes the unscaled gradient back, and ``.grad`` stays as it was);
    a parameter with a float32 master steps its master on the widened gradient, then
    takes its rounding.
    """
    masters = inputs.masters or [None] * len(inputs.params)
    moved = positions(inputs)
    grads = []
    for grad, master in zip(inputs.grads, masters, strict=True):
        if master is not None:
            grad = grad.float()  # a new tensor
        elif inputs.grad_scales is not None:
            grad = grad.clone()  # torch writes g / s into it
        grads.append(grad)
    found: dict[torch.device, Tensor] = {}
    batches: dict[tuple[Any, ...], list[int]] = {}
    for i, position in enumerate(moved):
        if position.numel() == 0:
            continue
        scale = None if inputs.grad_scales is None else inputs.grad_scales[i]
        key = (position.device, position.dtype, bool(first and first[i]), id(scale))
        batches.setdefault(key, []).append(i)
        if position.device not in found:
            flag = inputs.largest[i].reshape(1)
            found[position.device] = flag.isfinite().logical_not().to(torch.float32)
    for (device, _, is_first, _), members in batches.items():
        scale = None if inputs.grad_scales is None else inputs.grad_scales[members[0]]
        torch._fused_sgd_(
            [moved[i] for i in members],
            [grads[i] for i in members],
            [] if buffers is None else [buffers[i] for i in members],
            weight_decay=float(group["weight_decay"]),
            momentum=float(group["momentum"]) if buffers is not None else 0.0,
            lr=float(group["lr"]),
            dampening=float(group["dampening"]) if buffers is not None else 0.0,
            nesterov=bool(group.get("nesterov", False)),
            maximize=bool(group["maximize"]),
            is_first_step=is_first,
            grad_scale=None if scale is None else scale.reshape(1).float(),
            found_inf=found[device],
        )
    for param, master in zip(inputs.params, masters, strict=True):
        if master is not None:
            param.copy_(master)  # its rounding to nearest (the master did not move if skipped)
