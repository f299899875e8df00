r"""The fused path of the SG-MCMC samplers: the step in Triton kernels, one pass per tensor.

A sampler with a fused kernel (the module beside its definition holding its Triton
kernel, named in ``fused/kernels`` and imported on first use, so that importing the
package never imports Triton) takes its step through the fused backend
(``fused/backend``, which registers itself with the step: ``step/backends``), with
``fused=True`` or by default (``fused=None``) where every parameter is on CUDA, in one
kernel per tensor that reads the parameter, its gradient and its buffers once, draws the
noise in registers and writes the parameter and its buffers once (a
tensor of more than ``fused/launch.MULTI_TENSOR_BLOCKS`` blocks gets a launch of its
own; smaller ones share one launch per device and dtypes, through a table of their
pointers, sizes, offsets and noise keys). This module holds what the Optimizer asks of
the fused path: whether it can run (:func:`fused_refusal`, whose reasons ``fused=True``
raises), the keys of its noise (:func:`fused_noise_seed`), a sampler's kernel module
(:func:`fused_kernel`, from ``fused/kernels``), and the numbers of its noise stream drawn alone
(:func:`fused_normal`); ``fused/launch`` holds what the kernel modules share on the
host (the launch, float64 scalars), ``fused/io`` what they share in Triton (reading and
writing their elements), ``fused/nonfinite`` the device flag every kernel reads (no
host synchronisation in a fused step).

The fused noise stream. Element :math:`i` (its index in the whole flattened tensor) of a
parameter's noise at step :math:`s` is ``tl.randn(seed', i)``: Triton's Philox 4x32-10
keyed by ``seed' = fused_noise_seed(seed, s, key)``, derived on the host from the chain's
seed, the step and the parameter's noise key as the block seeds of
``core/keyed_normal`` are (with a domain of its own), then Box--Muller in float32. So it
is a pure function of ``(seed, step, key, index)``: a shard or chunk that starts at
element :math:`o` draws exactly elements :math:`[o, o + n)` of the whole tensor's noise,
a ``state_dict`` round trip resumes the chain bit for bit, and ranks with one seed draw
the same numbers. It is a *different* stream from the unfused one (the keyed blocks of
``torch.randn``): for one seed the fused and the unfused step draw different numbers.
The fused stream's integers are the same on every device Triton runs on; its normals
are computed with float32 ``log``, ``cos`` and ``sqrt``, so Triton's interpreter (on the
CPU) and a GPU agree up to their rounding.

Scalars reach the kernels as float64 (their bits, passed as integers: Triton passes a
Python float as float32), and the kernels compute as ``torch.optim.SGD(fused=True)``
does: in float64 where torch's fused kernel does, rounded where it rounds. So at
temperature 0 a fused step is torch's fused SGD step.

Testing without a GPU: :data:`RUN_ON_CPU_UNDER_INTERPRETER` (for tests only) lets the
fused path run on CPU tensors when ``TRITON_INTERPRET=1`` was set before Triton was
imported (``tests/test_fused.py``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from functools import cache
from typing import Any

import torch
from torch import Tensor

from ...core.dtensor import is_dtensor
from ...core.keyed_normal import extend_seed
from ...core.streams import derive_seed
from ...names import parameter_layout
from ..definition import SamplerDefinition
from ..step.backends import check_fused
from ..step.half_precision import MASTER, is_half
from ..step.nonfinite import describe_parameter
from .kernels import fused_kernel, has_fused_kernel
from .launch import optional_module

__all__ = [
    "DEFAULT_ON_CUDA",
    "FULL_PRECISION",
    "FUSED_DOMAIN",
    "FUSED_DTYPES",
    "RUN_ON_CPU_UNDER_INTERPRETER",
    "check_fused",
    "fused_kernel",
    "fused_message",
    "fused_noise_seed",
    "fused_noise_seeds",
    "fused_normal",
    "fused_refusal",
    "interpreting",
    "parameter_offset",
    "triton_importable",
]

#: For tests only: let the fused path run on CPU tensors under Triton's interpreter
#: (``TRITON_INTERPRET=1`` in the environment before Triton is first imported). Off, the
#: fused path runs on CUDA tensors only.
RUN_ON_CPU_UNDER_INTERPRETER = False

#: keeps the fused stream's seeds apart from the unfused stream's block seeds
FUSED_DOMAIN = 0x7472_746E  # "trtn"

#: the parameter dtypes the fused kernels take from an Optimizer: a float16/bfloat16
#: parameter's chain keeps a float32 master at T > 0 (``step/half_precision``), whose buffers
#: are float32
FUSED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)

#: the dtypes the fused transforms take (no master copy there: half precision not yet)
FULL_PRECISION = (torch.float32, torch.float64)

#: whether ``fused=None`` takes the fused path on CUDA (at T > 0). True since the fused
#: kernels' tests passed compiled on an H100 (torch 2.11, Triton 3.6; ``bash .ci/gpu
#: fused``, issue 24); set it False to keep every default step unfused.
DEFAULT_ON_CUDA = True


@cache
def triton_importable() -> bool:
    """Whether Triton imports (tried once, on first use: never when the package is imported)."""
    return optional_module("triton") is not None


def interpreting() -> bool:
    """Whether Triton runs its kernels in its interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes")


def fused_noise_seed(seed: int, step: int, key: int, shard: int | None = None) -> int:
    """The Philox key of a parameter's fused noise at ``step``, in [2**63, 2**64).

    Derived as the unfused stream's block seeds are (``derive_seed``), in a domain of its
    own, with ``shard`` appended for one rank's share of a sharded optimizer whose
    parameters have no names. The top bit is set so that Triton always passes it as an
    unsigned 64-bit integer (one compiled variant of each kernel); 63 bits are random.
    """
    shards = () if shard is None else (shard,)
    return derive_seed(seed, FUSED_DOMAIN, step, key, *shards) | (1 << 63)


def fused_noise_seeds(
    seed: int, step: int, keys: Sequence[int], shard: int | None = None
) -> list[int]:
    """:func:`fused_noise_seed` of each key at one step (the shared part mixed once)."""
    shards = () if shard is None else (shard,)
    at_step = derive_seed(seed, FUSED_DOMAIN, step)
    return [extend_seed(at_step, key, *shards) | (1 << 63) for key in keys]


def parameter_offset(param: Tensor) -> int:
    """The global index of ``param``'s first element.

    Its offset in a tensor split over processes (``names.set_parameter_layout``), else 0.
    """
    layout = parameter_layout(param)
    return 0 if layout is None else layout[0]


def _on_supported_device(tensor: Tensor) -> bool:
    if tensor.device.type == "cuda":
        return True
    return tensor.device.type == "cpu" and RUN_ON_CPU_UNDER_INTERPRETER and interpreting()


def _tensor_refusal(
    tensor: Tensor,
    dtype: torch.dtype | None = None,
    *,
    dtypes: tuple[torch.dtype, ...] = FULL_PRECISION,
    like: str = "its parameter",
) -> str | None:
    """Why the fused path cannot take ``tensor`` (what follows its name), or None.

    ``dtypes``: the dtypes taken at all; ``dtype``: the one ``tensor`` must have, as
    ``like`` has it.
    """
    if is_dtensor(tensor):
        return "is a DTensor (FSDP2): the fused path does not take DTensors yet"
    if not _on_supported_device(tensor):
        return f"is on {tensor.device}: the fused kernels run on CUDA"
    if tensor.dtype not in dtypes:
        if dtypes == FULL_PRECISION:
            return (
                f"is {tensor.dtype}: the fused kernels take float32 and float64 parameters "
                "(half precision: not yet)"
            )
        return (
            f"is {tensor.dtype}: the fused kernels take float32, float64, float16 and "
            "bfloat16 parameters"
        )
    if dtype is not None and tensor.dtype != dtype:
        return f"is {tensor.dtype}, unlike {like} ({dtype})"
    if not tensor.is_contiguous():
        return "is not contiguous: the fused kernels take contiguous tensors"
    return None


def _parameter_refusal(
    fields: Sequence[str],
    param: Tensor,
    grad: Tensor | None,
    state: Mapping[str, Any] | None,
) -> tuple[str, str] | None:
    """Why the fused path cannot take a parameter: ``(whose, why)``, or None.

    ``fields``: the state fields its kernel reads (not those kept on the host).
    """
    why = _tensor_refusal(param, dtypes=FUSED_DTYPES)
    if why is not None:
        return "", why
    if grad is not None:
        why = _tensor_refusal(grad, param.dtype, dtypes=FUSED_DTYPES)
        if why is None and grad.device != param.device:
            why = f"is on {grad.device}, unlike its parameter"
        if why is not None:
            return "the gradient of ", why
    # a half-precision parameter with a float32 master: float32 master and buffers
    master = state.get(MASTER) if state else None
    buffer_dtype, like = param.dtype, "its parameter"
    if isinstance(master, Tensor) and is_half(param):
        why = _tensor_refusal(master, torch.float32, dtypes=FUSED_DTYPES, like="a master copy")
        if why is None and (master.device != param.device or master.shape != param.shape):
            why = f"is not shaped like its parameter on {param.device}"
        if why is not None:
            return f"the state {MASTER!r} of ", why
        buffer_dtype, like = torch.float32, f"its parameter's {MASTER!r}"
    for name in fields if state else ():
        buffer = state.get(name) if state else None
        if isinstance(buffer, Tensor):
            why = _tensor_refusal(buffer, buffer_dtype, dtypes=FUSED_DTYPES, like=like)
            if why is None and buffer.device != param.device:
                why = f"is on {buffer.device}, unlike its parameter"
            if why is not None:
                return f"the state {name!r} of ", why
    return None


def fused_refusal(
    definition: SamplerDefinition,
    groups: Sequence[tuple[int, dict[str, Any], list[Tensor], list[Tensor] | None]],
    state: Mapping[Tensor, Mapping[str, Any]] | None = None,
    *,
    compiling: bool = False,
) -> str | None:
    """Why a step of these param groups cannot be fused, or None when it can.

    ``groups`` holds ``(index, group, params, grads)``: the parameters with a gradient and
    their gradients at a step (``grads`` None at construction: the parameters alone).
    Checked in the order of cost, so that a CPU model is told no at its first parameter
    and Triton is imported only where the rest allows the fused path. The buffers an
    Optimizer's ``state`` holds must match their parameter as its gradient must.
    """
    if not has_fused_kernel(definition):
        return f"{definition.name} has no fused kernel yet"
    if compiling:
        return "torch.compile traces the unfused step"
    host = {field.name for field in definition.state if field.host}
    for index, group, params, grads in groups:
        if group.get("foreach"):
            return f"param group {index} sets foreach=True (fused and foreach exclude each other)"
        fields = [name for name in definition.state_fields(group) if name not in host]
        for i, param in enumerate(params):
            refusal = _parameter_refusal(
                fields,
                param,
                None if grads is None else grads[i],
                None if state is None or param not in state else state[param],
            )
            if refusal is not None:
                position = next(j for j, p in enumerate(group["params"]) if p is param)
                whose, why = refusal
                return f"{whose}{describe_parameter(group, index, position)} {why}"
    return _kernel_refusal(definition, groups)


def _kernel_refusal(
    definition: SamplerDefinition,
    groups: Sequence[tuple[int, dict[str, Any], list[Tensor], list[Tensor] | None]],
) -> str | None:
    """Why the kernel refuses (Triton missing, an option it lacks), or None."""
    if not triton_importable():
        return "Triton cannot be imported (pip install triton)"
    kernel = fused_kernel(definition)
    for index, group, _, _ in groups:
        option = kernel.unsupported(group, float(group["temperature"]))
        if option is not None:
            return f"{option} (param group {index})"
    return None


def fused_message(reason: str) -> str:
    """The error of ``fused=True`` where the fused path cannot run, with its reason."""
    return (
        f"Invalid fused: True ({reason}; use fused=None to take the fused path only where "
        "it can run, or fused=False)"
    )


def fused_normal(
    numel: int,
    *,
    seed: int,
    step: int,
    key: int,
    shard: int | None = None,
    offset: int = 0,
    device: torch.device | str = "cuda",
) -> Tensor:
    """Elements ``[offset, offset + numel)`` of a parameter's fused noise, float32.

    The numbers the fused kernels draw for the parameter keyed ``key`` at ``step`` of
    the chain ``seed`` (see the module docstring), drawn alone: for tests and inspection.
    On the CPU it needs :data:`RUN_ON_CPU_UNDER_INTERPRETER` as the fused path does.
    """
    from . import normal as _fused_normal  # imports Triton

    out = torch.empty(numel, dtype=torch.float32, device=device)
    if not _on_supported_device(out):
        raise ValueError(
            f"Invalid device: {out.device} (expected a CUDA device, or the CPU under "
            "Triton's interpreter with RUN_ON_CPU_UNDER_INTERPRETER)"
        )
    return _fused_normal.draw_(out, seed=fused_noise_seed(seed, step, key, shard), offset=offset)
