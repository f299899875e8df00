"""The vectors of :mod:`samplers_as_optim.curvature`: finiteness, arithmetic and checks.

A vector is a tensor or a dict name -> tensor. Here: how a message names a value's
kind and non-finite values (shared by the curvature products and conjugate gradients);
the arithmetic conjugate gradients runs on either form (dot products in float32 at
least, ``y + alpha x``, exact scaling by powers of two); and the checks of its right-hand
side ``b`` and of ``x0`` and every product against ``b``'s structure. Internals of
:func:`samplers_as_optim.curvature.conjugate_gradient`: use that module.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import cast

import torch
from torch import Tensor

__all__ = [
    "AnyVector",
    "breakdown_error",
    "check_rhs",
    "conform_vector",
    "describe_nonfinite",
    "describe_nonfinite_vector",
    "kind_of",
    "scale_by_power_of_two",
    "vector_axpy",
    "vector_dot",
    "vector_exponent",
    "vector_tensors",
]

#: a vector of the curvature products: a tensor, or a dict name -> tensor
AnyVector = Tensor | dict[str, Tensor]


def kind_of(value: object) -> str:
    """How a message names a value's type: ``None`` or the type's name."""
    return "None" if value is None else type(value).__name__


def describe_nonfinite(tensor: Tensor) -> str:
    """``""`` when every value is finite, else which kinds occur: "nan", "inf", "nan and inf"."""
    if not (tensor.is_floating_point() or tensor.is_complex()):
        return ""
    if bool(torch.isfinite(tensor).all()):
        return ""
    kinds = [
        kind
        for kind, present in (
            ("nan", bool(torch.isnan(tensor).any())),
            ("inf", bool(torch.isinf(tensor).any())),
        )
        if present
    ]
    return " and ".join(kinds)


def describe_nonfinite_vector(vector: AnyVector) -> str:
    """:func:`describe_nonfinite` of a tensor or of all the tensors of a dict together."""
    tensors = [vector] if isinstance(vector, Tensor) else list(vector.values())
    if bool(torch.stack([torch.isfinite(t).all() for t in tensors]).all()):
        return ""
    return " and ".join(
        kind for kind in ("nan", "inf") if any(kind in describe_nonfinite(t) for t in tensors)
    )


def vector_tensors(vector: AnyVector) -> list[Tensor]:
    """The vector's tensors: itself, or a dict's values in order."""
    return [vector] if isinstance(vector, Tensor) else list(vector.values())


def _flat(tensor: Tensor) -> Tensor:
    """Flattened, in float32 at least (a float16 sum of squares overflows at 65504)."""
    flat = tensor.reshape(-1)
    return flat.float() if flat.dtype in (torch.float16, torch.bfloat16) else flat


def vector_dot(a: AnyVector, b: AnyVector) -> Tensor:
    """``a^T b``; both have the same structure (checked by the callers)."""
    if isinstance(a, Tensor):
        return torch.dot(_flat(a), _flat(cast(Tensor, b)))
    b_dict = cast(dict[str, Tensor], b)
    parts = [torch.dot(_flat(a[k]), _flat(b_dict[k])) for k in a]
    return torch.stack(parts).sum()


def vector_axpy(alpha: Tensor | float, x: AnyVector, y: AnyVector) -> AnyVector:
    """``y + alpha * x``."""
    if isinstance(x, Tensor):
        return cast(Tensor, y) + alpha * x
    y_dict = cast(dict[str, Tensor], y)
    return {k: y_dict[k] + alpha * x[k] for k in x}


def vector_exponent(vector: AnyVector) -> int:
    """The exponent e with ``max |vector|`` in [2^(e-1), 2^e) (0 for a zero vector)."""
    maxima = [t.detach().abs().max() for t in vector_tensors(vector) if t.numel()]
    largest = float(torch.stack(maxima).max()) if maxima else 0.0
    return math.frexp(largest)[1] if largest > 0 else 0


def scale_by_power_of_two(vector: AnyVector, exponent: int) -> AnyVector:
    """``vector * 2**exponent``, exactly (in steps whose factor the dtype represents)."""

    def one(tensor: Tensor) -> Tensor:
        limit = int(-math.log2(torch.finfo(tensor.dtype).tiny))
        left = exponent
        while left:
            step = max(-limit, min(limit, left))
            tensor = tensor * math.ldexp(1.0, step)
            left -= step
        return tensor

    if exponent == 0:
        return vector
    if isinstance(vector, Tensor):
        return one(vector)
    return {k: one(t) for k, t in vector.items()}


def check_rhs(b: object) -> AnyVector:
    """``b``: a floating-point tensor or a non-empty dict of them, finite (a dict is copied)."""
    expected = "a tensor or a dict name -> tensor, floating-point and finite"
    if isinstance(b, Tensor):
        items: list[tuple[str | None, Tensor]] = [(None, b)]
    elif isinstance(b, Mapping):
        if not b:
            raise ValueError(
                f"Invalid b: an empty dict (expected {expected}, with at least one entry)"
            )
        items = []
        for key, value in b.items():
            if not isinstance(value, Tensor):
                raise TypeError(f"Invalid b: {key!r} is {kind_of(value)} (expected {expected})")
            items.append((key, value))
    else:
        raise TypeError(f"Invalid b: {type(b).__name__} (expected {expected})")
    for key, value in items:
        subject = "" if key is None else f"{key!r} has "
        if not value.is_floating_point():
            raise TypeError(
                f"Invalid b: {subject}dtype {value.dtype} (expected {expected}: the solution "
                "has b's dtype)"
            )
        kinds = describe_nonfinite(value)
        if kinds:
            raise ValueError(
                f"Invalid b: {subject}non-finite values ({kinds}) (expected finite numbers)"
            )
    return b if isinstance(b, Tensor) else {cast(str, key): value for key, value in items}


def conform_vector(value: object, like: AnyVector, name: str, context: str, hint: str) -> AnyVector:
    """``value`` (x0 or a matvec result) checked to have the structure of ``like`` (b).

    Same type, keys and shapes, real dtypes and finite values; converted to b's dtypes and
    devices. ``context`` says which product a matvec result is (empty for x0); ``hint``
    ends the message about non-finite values.
    """
    returned = "it returned " if context else ""
    if isinstance(like, Tensor):
        if not isinstance(value, Tensor):
            raise TypeError(
                f"Invalid {name}: {returned}{kind_of(value)}{context} (expected a tensor "
                f"of shape {tuple(like.shape)}, like b)"
            )
        return _conform_tensor(value, like, name, returned, context, hint, None)
    if not isinstance(value, Mapping):
        raise TypeError(
            f"Invalid {name}: {returned}{kind_of(value)}{context} (expected a dict with "
            f"the keys of b, {list(like)})"
        )
    missing = [key for key in like if key not in value]
    extra = [key for key in value if key not in like]
    if missing or extra:
        differences = "; ".join(
            ([f"missing {missing}"] if missing else []) + ([f"unexpected {extra}"] if extra else [])
        )
        raise ValueError(
            f"Invalid {name}: {returned}a dict{context} whose keys differ from b's "
            f"({differences}) (expected the keys of b)"
        )
    conformed = {}
    for key, tensor in like.items():
        entry = value[key]
        if not isinstance(entry, Tensor):
            raise TypeError(
                f"Invalid {name}: {returned}{key!r} as {kind_of(entry)}{context} "
                f"(expected a tensor of shape {tuple(tensor.shape)}, like b[{key!r}])"
            )
        conformed[key] = _conform_tensor(entry, tensor, name, returned, context, hint, key)
    return conformed


def _conform_tensor(
    value: Tensor,
    like: Tensor,
    name: str,
    returned: str,
    context: str,
    hint: str,
    key: str | None,
) -> Tensor:
    of = "" if key is None else f"{key!r} of "
    target = "b" if key is None else f"b[{key!r}]"
    if value.shape != like.shape:
        raise ValueError(
            f"Invalid {name}: {returned}{of}shape {tuple(value.shape)}{context} (expected "
            f"{tuple(like.shape)}, the shape of {target})"
        )
    if value.is_complex() or value.dtype == torch.bool:
        raise TypeError(
            f"Invalid {name}: {returned}{of}dtype {value.dtype}{context} (expected a real "
            f"tensor, converted to the dtype of {target}, {like.dtype})"
        )
    kinds = describe_nonfinite(value)
    if kinds:
        where = "" if key is None else f" in {key!r}"
        raise ValueError(
            f"Invalid {name}: {returned}non-finite values ({kinds}){where}{context} (expected "
            f"finite numbers{hint})"
        )
    return value.to(dtype=like.dtype, device=like.device)


def breakdown_error(iteration: int, what: str, value: float, dtype: str) -> ValueError:
    """The error of conjugate gradients broken down at ``iteration`` (``what`` = ``value``)."""
    return ValueError(
        f"Invalid matvec: conjugate gradient broke down at iteration {iteration}: {what} = "
        f"{value:.3g} is not finite in {dtype} (expected a symmetric positive-definite "
        "operator that is not nearly singular at this scale: add damping or a prior, or use "
        "float64)"
    )
