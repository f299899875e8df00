r"""Per-input Jacobians of a model's outputs with respect to its treated weights, chunked.

For a batch of B inputs with O output numbers each (the output of one input, flattened)
and P treated scalars, the Jacobians :math:`J(x_b) = \partial f(x_b;\theta)/\partial\theta`
at :math:`\theta = \mu` are ``vmap`` over the inputs of ``jacrev`` (O reverse passes per
input, vectorised), with the model called on one input at a time
(``x_b.unsqueeze(0)``), so the examples must not interact (eval mode). Only the treated
parameters are differentiated: a last-layer subset costs the last layer's Jacobian.

Memory: a chunk of C inputs holds :math:`C\cdot O\cdot P` numbers and about two more of
the same size while they are used; :func:`input_chunks` picks C so that this stays
under 256 MiB unless told otherwise, and refuses a single input whose Jacobian cannot
fit in the device's free memory.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import cast

import torch
from torch import Tensor, nn
from torch.func import functional_call, jacrev, vmap

from .._memory import available_bytes, refuse_unless_fits

__all__ = ["input_chunks", "output_jacobians"]

# A chunk's Jacobian, its scaled copy and one transient of the same size.
_COPIES = 3
_CHUNK_BYTES = 2**28


def input_chunks(
    batch: int,
    outputs: int,
    num_params: int,
    dtype: torch.dtype,
    device: torch.device,
    chunk_size: int | None,
) -> Iterator[slice]:
    """Slices of the batch, each small enough for its Jacobians (see the module docstring).

    Raises:
        ValueError: one input's Jacobians (``outputs`` x ``num_params``, with two copies)
            need more memory than ``device`` has free.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    per_input = _COPIES * outputs * num_params * itemsize
    refuse_unless_fits(
        per_input,
        available_bytes(device),
        lambda needs, has: (
            f"Invalid x: one input's Jacobian ({outputs} outputs x {num_params} treated "
            f"parameters, {dtype}) needs about {needs} with its copies, but "
            f"{device} has {has} free (expected a Jacobian that fits: treat fewer "
            "weights, e.g. subset='last_layer', or use predict(x, linear=True), which "
            "samples with one jvp per draw)"
        ),
    )
    if chunk_size is None:
        chunk_size = max(1, _CHUNK_BYTES // per_input)
    for start in range(0, batch, chunk_size):
        yield slice(start, min(start + chunk_size, batch))


def output_jacobians(model: nn.Module, mean: dict[str, Tensor], x: Tensor) -> dict[str, Tensor]:
    r"""Per-input Jacobians at ``mean``: name -> ``(C, O, *shape)``.

    ``x`` is a chunk of C inputs; the parameters outside ``mean`` (and the buffers) are
    the model's current ones.
    """

    def single(params: dict[str, Tensor], item: Tensor) -> Tensor:
        return cast(Tensor, functional_call(model, params, (item.unsqueeze(0),))).reshape(-1)

    return cast(dict[str, Tensor], vmap(jacrev(single), in_dims=(None, 0))(mean, x))
