"""Refuse a dense P x P matrix that cannot fit, before spending an epoch on it.

A dense Gaussian over P parameters keeps a P x P precision (or scale) matrix and, while
factorising or inverting it, about two more of the same size. :func:`check_dense_fits`
compares ``copies * P**2 * itemsize`` with the memory the device has free (``MemAvailable``
on Linux CPUs, ``torch.cuda.mem_get_info`` on CUDA; no check elsewhere) and raises a
``ValueError`` that names both sizes.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

__all__ = ["available_bytes", "check_dense_fits", "dense_bytes", "refuse_unless_fits"]

# The precision itself, its Cholesky factor and one transient of the same size; a
# Laplace fit also keeps the curvature apart from the prior (for the evidence): one more.
_DENSE_COPIES = 3


def available_bytes(device: torch.device) -> int | None:
    """Free memory on ``device`` in bytes, or None where it cannot be told."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as meminfo:
                for line in meminfo:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    return None


def dense_bytes(num_params: int, dtype: torch.dtype, copies: int = _DENSE_COPIES) -> int:
    """Bytes needed for ``copies`` dense matrices over ``num_params`` parameters."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return copies * num_params * num_params * itemsize


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.3g} GiB"


def refuse_unless_fits(needed: int, free: int | None, message: Callable[[str, str], str]) -> None:
    """ValueError with ``message(needed, free)`` (both in GiB, 3 digits) if ``needed > free``.

    ``free`` is the device's free memory in bytes (:func:`available_bytes`); None (it
    cannot be told) passes.
    """
    if free is not None and needed > free:
        raise ValueError(message(_gib(needed), _gib(free)))


def check_dense_fits(
    num_params: int,
    dtype: torch.dtype,
    device: torch.device,
    *,
    subject: str = "structure: 'dense'",
    alternative: str = "structure='diag'",
    copies: int = _DENSE_COPIES,
) -> None:
    """ValueError naming the sizes if a dense ``num_params``-square structure cannot fit.

    The message reads ``Invalid <subject> (a P x P ... matrix ... needs about X GiB ...,
    but <device> has Y GiB free; use <alternative>, or set requires_grad=False ...)``.
    """
    refuse_unless_fits(
        dense_bytes(num_params, dtype, copies),
        available_bytes(device),
        lambda needs, has: (
            f"Invalid {subject} (a {num_params} x {num_params} {dtype} matrix over the "
            f"{num_params} treated parameters needs about {needs} with its "
            f"factorisation, but {device} has {has} free; use {alternative}, or set "
            "requires_grad=False on the parameters the posterior should not treat)"
        ),
    )
