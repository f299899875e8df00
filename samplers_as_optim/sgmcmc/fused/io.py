r"""What every elementwise fused kernel does around its update: find, read and write its elements.

The Triton functions the sampler kernels (each sampler folder's ``triton_kernel``:
SGLD's, SGHMC's, SGNHT's, BAOA's, PSGLD's and AdamWSGHMC's) share, so that each kernel
holds its own update and little else: which block and tensor a program takes and which
of its elements it reads and writes (:func:`this_block`, :func:`column`: the table of
``fused/launch.launch_tensors``; :func:`elements`: none unless every gradient is finite,
:func:`step_is_finite`), the float64 scalars (:func:`float64`), the position and the
gradient as the update reads them (:func:`read_inputs`, :func:`position_and_gradient`: a
float32 master, a GradScaler's unscaling; :func:`effective_gradient`: ``maximize``,
weight decay), the noise (:func:`normal`), and the stores (:func:`store_state`,
:func:`store_position`, :func:`store_moved`, :func:`store_step`, through
:func:`narrowed`: a half parameter's rounding to nearest). The compile-time flags
``UNSCALE``, ``MASTER``, ``NARROW`` and ``BF16`` are ``fused/launch``'s (its module
docstring). A kernel module imports this one as ``fio`` (``fio.this_block(...)``), and
Triton's language from here (``tl``).

What every kernel does alike, said here once (a kernel module's docstring gives its
update). Per element, with the gradient :math:`g' = \pm g + \lambda\theta` rounded to the
position's dtype, as ``torch.optim.SGD(fused=True)`` rounds it, and the noise :math:`\xi
= \texttt{tl.randn}(seed, \text{global index})`, the update is computed in float64 from
float64 scalars and each value rounded once where it is stored. A kernel reads each of
its tensors once and writes each once; nothing is written when the step's flag (the
largest absolute gradient) is not finite. Small tensors share launches
(``fused/launch.launch_tensors``), each with its own noise key: the numbers of one
launch per tensor. Mixed precision (``fused/launch``'s module docstring): with a
GradScaler scale :math:`s` the gradient is read as :math:`g/s` (float64 division,
rounded once to the position's dtype); a float16/bfloat16 parameter with a float32
master steps on the master, as a float32 parameter would, and receives its rounding to
nearest; one without master (temperature 0, ``NARROW``: BAOA's and PSGLD's kernels
only) is computed in float32 and stored, with its state, in its dtype.

Each is ``triton.jit``'d when this module is imported, which a kernel module is only on
first use (importing the package never imports Triton); without Triton they stay plain
functions, so that the module still imports (pytest's doctest collection). Under
``TRITON_INTERPRET=1`` they are interpreted as the kernels that call them are. Their
annotations are ``fused/launch``'s :class:`~._fused_launch.constexpr` and
:data:`~._fused_launch.KernelArg`, the only ones Triton's compiler accepts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from .launch import KernelArg, constexpr, optional_module

__all__ = [
    "column",
    "effective_gradient",
    "elements",
    "float64",
    "jit",
    "narrowed",
    "normal",
    "position_and_gradient",
    "read_inputs",
    "step_is_finite",
    "store_moved",
    "store_position",
    "store_state",
    "store_step",
    "this_block",
    "tl",
]

#: Triton's language (None without Triton): the kernel modules import it from here
tl: Any = optional_module("triton.language")
_triton: Any = optional_module("triton")

_Function = TypeVar("_Function", bound=Callable[..., Any])


def jit(function: _Function) -> _Function:
    """``triton.jit(function)`` (a function a kernel calls), or ``function`` without Triton."""
    return function if _triton is None else _triton.jit(function)


@jit
def this_block(
    table: KernelArg, count: KernelArg, programs: KernelArg,
    numel: KernelArg, offset: KernelArg, seed: KernelArg, largest: KernelArg,
    LARGEST: constexpr, BLOCK: constexpr, MULTI: constexpr,  # noqa: N803
) -> KernelArg:  # fmt: skip
    """This program's block of its tensor: ``(block, rows, index, mask, offset, seed)``.

    In a shared launch (``MULTI``) program ``p`` takes block ``table[p] & 0xFFFFFFFF`` of
    tensor ``t = table[p] >> 32``, whose numel, offset and seed are read from the table,
    and ``rows`` points at its first entry (:func:`column` reads its data pointers; the
    step's flag is column ``LARGEST``); alone, block ``p`` of the tensor the arguments
    describe. ``index`` and ``mask``: :func:`elements`.
    """
    if MULTI:
        code = tl.load(table + tl.program_id(0))
        block = code & 0xFFFFFFFF
        rows = table + programs + (code >> 32)
        numel = tl.load(rows)
        offset = tl.load(rows + count)
        seed = tl.load(rows + 2 * count)
    else:
        block = tl.program_id(0).to(tl.int64)
        rows = block  # (no table: never read; a tensor, as Triton returns no None)
    largest = column(rows, count, LARGEST, largest, MULTI)
    index, mask = elements(block, numel, largest, BLOCK)
    return block, rows, index, mask, offset, seed


@jit
def column(
    rows: KernelArg,
    count: KernelArg,
    j: constexpr,
    pointer: KernelArg,
    MULTI: constexpr,  # noqa: N803
) -> KernelArg:
    """Column ``j``'s data pointer of this program's tensor (``pointer`` itself alone).

    Typed as ``pointer``, the launch's first tensor of that column.
    """
    if MULTI:
        pointer = tl.load(rows + j * count).to(pointer.dtype, bitcast=True)
    return pointer


@jit
def read_inputs(
    rows: KernelArg, count: KernelArg, param: KernelArg, grad: KernelArg, master: KernelArg,
    MASTER_COLUMN: constexpr,  # noqa: N803
    grad_scale: KernelArg, index: KernelArg, mask: KernelArg,
    MULTI: constexpr, UNSCALE: constexpr, MASTER: constexpr, NARROW: constexpr,  # noqa: N803
) -> KernelArg:  # fmt: skip
    """:func:`position_and_gradient` of this program's tensor: ``(param, position, p, g)``.

    Its parameter, gradient and master are columns 3, 4 and ``MASTER_COLUMN`` of a
    shared launch's table (:func:`column`).
    """
    param = column(rows, count, 3, param, MULTI)
    grad = column(rows, count, 4, grad, MULTI)
    master = column(rows, count, MASTER_COLUMN, master, MULTI)
    position, p, g = position_and_gradient(
        param, master, grad, grad_scale, index, mask, UNSCALE, MASTER, NARROW
    )
    return param, position, p, g


@jit
def elements(
    block: KernelArg, numel: KernelArg, largest: KernelArg,
    BLOCK: constexpr,  # noqa: N803
) -> KernelArg:  # fmt: skip
    """The indices of ``block``'s elements and the mask of those read and written.

    Nothing is read or written unless every gradient is finite (:func:`step_is_finite`).
    """
    index = block * BLOCK + tl.arange(0, BLOCK)
    mask = index < tl.where(step_is_finite(largest), numel, 0)
    return index, mask


@jit
def step_is_finite(largest: KernelArg) -> KernelArg:
    """Whether the step's flag, the largest absolute gradient, is finite (not NaN).

    It is then at most the largest float64, which NaN and infinity are not.
    """
    return tl.load(largest) <= 1.7976931348623157e308


@jit
def float64(bits: KernelArg) -> KernelArg:
    """A float64 scalar from its bits (``fused/launch.as_float64_bits``)."""
    return bits.to(tl.int64).to(tl.float64, bitcast=True)


@jit
def normal(seed: KernelArg, offset: KernelArg, index: KernelArg) -> KernelArg:
    """The fused noise stream's elements ``offset + index`` of the key ``seed``, float32."""
    return tl.randn(seed, offset + index)


@jit
def position_and_gradient(
    param: KernelArg, master: KernelArg, grad: KernelArg, grad_scale: KernelArg, index: KernelArg,
    mask: KernelArg,
    UNSCALE: constexpr, MASTER: constexpr, NARROW: constexpr,  # noqa: N803
) -> KernelArg:  # fmt: skip
    r"""``(position, p, g)``: where the position is kept, its elements and the gradient's.

    The position is the float32 master (``MASTER``), else the parameter, read in float32
    where it is a half one without master (``NARROW``). The gradient is read as
    :math:`g/s` (``UNSCALE``: divided in float64, rounded once to the position's dtype),
    else widened to float32 beside a master or narrow.
    """
    position = master if MASTER else param
    p = tl.load(position + index, mask=mask)
    if NARROW:
        p = p.to(tl.float32)
    g = tl.load(grad + index, mask=mask)
    if UNSCALE:
        g = (g.to(tl.float64) / tl.load(grad_scale).to(tl.float64)).to(p.dtype)
    elif MASTER or NARROW:
        g = g.to(tl.float32)
    return position, p, g


@jit
def effective_gradient(
    g: KernelArg, p: KernelArg, decay_bits: KernelArg,
    MAXIMIZE: constexpr, DECAY: constexpr,  # noqa: N803
) -> KernelArg:  # fmt: skip
    r""":math:`g' = \pm g + \lambda p`: negated for ``MAXIMIZE``, decayed with ``DECAY``.

    The decay in float64, rounded to the position's dtype, as ``torch.optim.SGD(fused=True)``
    rounds it (``tensor_lists.effective_grad`` on the host).
    """
    if MAXIMIZE:
        g = -g
    if DECAY:
        g = (g.to(tl.float64) + float64(decay_bits) * p.to(tl.float64)).to(p.dtype)
    return g


@jit
def narrowed(value: KernelArg, BF16: constexpr) -> KernelArg:  # noqa: N803
    r"""``value`` in float32, rounded to nearest even bfloat16 on its bits where ``BF16``.

    Triton's interpreter truncates a conversion to bfloat16 (and mangles one from
    float64), so the rounding is done on the float32 bits :math:`b`, as :math:`(b +
    \texttt{0x7FFF} + (b \gg 16 \mathbin{\&} 1)) \gg 16 \ll 16`, exact in float32, which
    the GPU and the interpreter then convert alike.
    """
    value = value.to(tl.float32)
    if BF16:
        bits = value.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        value = (bits >> 16 << 16).to(tl.float32, bitcast=True)
    return value


@jit
def store_state(
    buffer: KernelArg, value: KernelArg, index: KernelArg, mask: KernelArg,
    NARROW: constexpr, BF16: constexpr,  # noqa: N803
) -> None:  # fmt: skip
    """Store a buffer's new elements in its dtype (a half one's through float32: ``NARROW``)."""
    if NARROW:
        value = narrowed(value, BF16)
    tl.store(buffer + index, value.to(buffer.dtype.element_ty), mask=mask)


@jit
def store_position(
    param: KernelArg, position: KernelArg, new: KernelArg, index: KernelArg, mask: KernelArg,
    MASTER: constexpr, NARROW: constexpr, BF16: constexpr,  # noqa: N803
) -> None:  # fmt: skip
    """Store the new position; a half parameter receives it rounded to nearest (even).

    With ``MASTER`` the master is written too; ``NARROW`` (no master) only the parameter.
    """
    if MASTER or NARROW:
        tl.store(param + index, narrowed(new, BF16).to(param.dtype.element_ty), mask=mask)
    if not NARROW:
        tl.store(position + index, new, mask=mask)


@jit
def store_moved(
    param: KernelArg, position: KernelArg, p: KernelArg, lr: KernelArg, d: KernelArg,
    index: KernelArg, mask: KernelArg,
    MASTER: constexpr, NARROW: constexpr, BF16: constexpr,  # noqa: N803
) -> None:  # fmt: skip
    r"""Store the position moved by the direction ``d``: :math:`p - lr\,d` (float64), rounded once.

    ``lr`` is a float64 scalar; ``d`` is widened to float64 (:func:`store_position`).
    """
    new = (p.to(tl.float64) - lr * d.to(tl.float64)).to(p.dtype)
    store_position(param, position, new, index, mask, MASTER, NARROW, BF16)


@jit
def store_step(
    out: KernelArg, param: KernelArg, position: KernelArg, p: KernelArg, lr: KernelArg,
    d: KernelArg, index: KernelArg, mask: KernelArg,
    UPDATE: constexpr, MASTER: constexpr, NARROW: constexpr, BF16: constexpr,  # noqa: N803
) -> None:  # fmt: skip
    r"""Store the step by the direction ``d`` (float64): the new position, or ``UPDATE``.

    With ``UPDATE`` (the transforms' variant) the update :math:`-lr\,d` itself is written
    to ``out``, rounded once to the position's dtype, and the parameter is left as it is;
    else the moved position (:func:`store_moved`).
    """
    if UPDATE:
        tl.store(out + index, (-lr * d).to(p.dtype), mask=mask)
    else:
        store_moved(param, position, p, lr, d, index, mask, MASTER, NARROW, BF16)
