"""What identifies a parameter's noise and travels with the tensor: its name, its place.

A sampler keys each parameter's noise by its name when it has one (see
``samplers_as_optim.core.streams``), so the noise does not depend on how the parameters are
grouped, ordered or shared out among ranks. An optimizer given
``model.named_parameters()`` knows the names; but ``ZeroRedundancyOptimizer`` accepts
only tensors and builds each rank's optimizer over its share of them, so there the
names must come with the tensors themselves. :func:`name_parameters` writes each
parameter's name on the tensor (an attribute); the samplers read it when their param
group has no ``param_names``.

The key is derived once: from its first step at a positive temperature on, a
parameter's state holds the key its noise is drawn with (``state["noise_key"]``), and a
state loaded into another optimizer keeps drawing with it, whatever names (given, written
on the tensors, or none) that optimizer has.
"""

from __future__ import annotations

from torch import Tensor, nn

__all__ = [
    "member_dims",
    "name_parameters",
    "parameter_layout",
    "parameter_name",
    "set_member_dims",
    "set_parameter_layout",
]

_ATTRIBUTE = "_samplers_as_optim_name"
_LAYOUT = "_samplers_as_optim_layout"
_MEMBER_DIMS = "_samplers_as_optim_member_dims"


def name_parameters(module: nn.Module) -> nn.Module:
    """Write each parameter's name (as ``module.named_parameters()`` gives it) on the tensor.

    Call it before handing ``module.parameters()`` to a wrapper that drops names, such
    as ``ZeroRedundancyOptimizer(module.parameters(), optimizer_class=SGHMC, ...)``: the
    noise of each parameter then follows its name, so a 2-rank ZeRO run draws the
    numbers of a 1-process run (given names too), whatever parameters each rank holds.

    Args:
        module: the model; its parameters are marked in place.

    Returns:
        ``module``, for chaining.

    Example:
        >>> import torch
        >>> from samplers_as_optim.names import name_parameters, parameter_name
        >>> model = name_parameters(torch.nn.Linear(2, 1))
        >>> [parameter_name(p) for p in model.parameters()]
        ['weight', 'bias']
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"Invalid module: {module!r} (expected an nn.Module)")
    for name, param in module.named_parameters():
        setattr(param, _ATTRIBUTE, name)
    return module


def parameter_name(param: Tensor) -> str | None:
    """The name :func:`name_parameters` wrote on ``param``, or None."""
    return getattr(param, _ATTRIBUTE, None)


def set_parameter_layout(param: Tensor, offset: int, total: int) -> None:
    """Mark ``param`` as elements ``[offset, offset + numel)`` of a tensor of ``total``.

    A ``ParallelEnsemble`` split over ranks marks each rank's share of a stacked tensor so,
    and the samplers draw that share's part of the whole tensor's noise: the members'
    chains do not depend on how many ranks hold them.
    """
    setattr(param, _LAYOUT, (offset, total))


def parameter_layout(param: Tensor) -> tuple[int, int] | None:
    """The ``(offset, total)`` that :func:`set_parameter_layout` wrote on ``param``, or None."""
    return getattr(param, _LAYOUT, None)


def set_member_dims(param: Tensor, dims: int) -> None:
    """Mark ``param``'s first ``dims`` dimensions as independent members (chains).

    A ``ParallelEnsemble`` stacks its members along a leading dimension; a sampler that
    pools statistics over a tensor (the sampling preconditioner of PSGLD and AdamWSGHMC)
    pools within each member, so that the members stay the independent chains that
    separate optimizers would run.
    """
    setattr(param, _MEMBER_DIMS, int(dims))


def member_dims(param: Tensor) -> int:
    """The number of leading member dimensions :func:`set_member_dims` wrote, else 0."""
    return int(getattr(param, _MEMBER_DIMS, 0))
