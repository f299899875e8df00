"""The training loss of a ParallelEnsemble: the sum over members of each member's mean loss.

:func:`ensemble_loss` is the loss convention of :mod:`samplers_as_optim.samples.ensemble`
(member k's gradient is a single model's), also for a loss module with parameters of its
own stacked per member (a likelihood whose σ each member samples);
:func:`backward_in_chunks` runs forward, loss and backward a chunk of members at a time,
for ``ParallelEnsemble.backward``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, vmap
from torch.utils._pytree import tree_flatten, tree_map

from ..core.validation import check_bool


def ensemble_loss(
    loss_fn: Callable[[Any, Any], Tensor],
    outputs: Any,
    targets: Any,
    *,
    per_member_targets: bool = False,
) -> Tensor:
    r"""The sum over members of each member's mean loss: :math:`\sum_k L(o_k, y_k)`.

    ``loss_fn`` is applied to each member's outputs separately (with ``torch.func.vmap``,
    so any loss written for one model works), then the K scalars are summed. Member k's
    gradient is then the gradient a single model would get, bit for bit (see "The loss
    convention" in :mod:`samplers_as_optim.samples.ensemble`). For torch's unweighted
    cross-entropy or NLL with shared class-index targets the K B examples go through
    ``loss_fn`` at once instead (faster, the same gradients bit for bit; the value may
    differ in the last bit).

    Args:
        loss_fn: ``loss_fn(outputs_k, targets_k)`` returns member k's loss as a scalar,
            usually a mean over the batch (``F.cross_entropy``, ``nn.MSELoss()``, ...).
            A loss module with parameters or buffers of its own (a
            :class:`~samplers_as_optim.GaussianLikelihood`, whose σ each member samples)
            is given as a ``ParallelEnsemble`` of it (or as a submodule of
            ``ensemble.module``): member k's loss is then computed with member k's slice
            of its tensors, so each member has its own σ and its gradient is a single
            model's.
        outputs: the ensemble's outputs, a tensor (or pytree of tensors) with leading
            dimension K.
        targets: shared by all members (default), e.g. ``[B]`` class labels; or, with
            ``per_member_targets=True``, one set per member with leading dimension K.
        per_member_targets: whether ``targets`` carries a leading member dimension
            (default: False).

    Returns:
        A scalar tensor: the sum of the K members' losses.

    Raises:
        ValueError: ``outputs`` (or per-member ``targets``) lack a common leading
            dimension, ``loss_fn`` does not return a scalar per member, or a loss module's
            tensors are not stacked over the members.

    Example:
        >>> import torch
        >>> import torch.nn.functional as F
        >>> outputs = torch.zeros(3, 4, 2)  # K = 3 members, B = 4, two classes
        >>> ensemble_loss(F.cross_entropy, outputs, torch.tensor([0, 1, 1, 0]))
        tensor(2.0794)
    """
    return _members_loss(loss_fn, outputs, targets, per_member_targets, slice(None))


def _members_loss(
    loss_fn: Callable[[Any, Any], Tensor],
    outputs: Any,
    targets: Any,
    per_member_targets: bool,
    members: slice,
) -> Tensor:
    """:func:`ensemble_loss` of the members ``members`` (those ``outputs`` holds)."""
    check_bool("per_member_targets", per_member_targets)
    size = _leading_size("outputs", outputs)
    if per_member_targets:
        check_member_size("targets", targets, size)
    stacked_loss = _stacked_loss_tensors(loss_fn, size, members)
    if stacked_loss is not None:
        return _stacked_module_loss(
            _loss_module(loss_fn), stacked_loss, outputs, targets, per_member_targets
        )

    def member_loss(member_outputs: Any, member_targets: Any) -> Tensor:
        value = loss_fn(member_outputs, member_targets)
        _check_scalar(value)
        return value

    if not per_member_targets and _is_plain_class_nll(loss_fn, outputs, targets):
        # Fast path, same gradients bit for bit: with shared class-index targets, torch's
        # mean over all K*B examples is divided by K*B, and K * (g / (K*B)) rounds exactly
        # as g / B does, so each member's gradient is the one a single model gets.
        size = outputs.shape[0]
        flat_targets = targets.expand(size, *targets.shape).reshape(-1, *targets.shape[1:])
        return cast(Tensor, loss_fn(outputs.flatten(0, 1), flat_targets) * size)
    in_dims = (0, 0 if per_member_targets else None)
    return vmap(member_loss, in_dims=in_dims)(outputs, targets).sum()


def _loss_module(loss_fn: Any) -> nn.Module:
    """The loss module itself: a ParallelEnsemble of it gives its stacked ``module``."""
    inner = getattr(loss_fn, "module", None)
    if isinstance(getattr(loss_fn, "num_members", None), int) and isinstance(inner, nn.Module):
        return inner  # a ParallelEnsemble of the loss module
    return cast(nn.Module, loss_fn)


def _stacked_loss_tensors(loss_fn: Any, size: int, members: slice) -> dict[str, Tensor] | None:
    """A loss module's tensors, member slices ``members`` of them; None for a plain loss.

    A loss module with parameters or buffers (a likelihood with its own noise scale) is
    run for member k with the k-th slice of each: they must carry the leading member
    dimension, as those of a submodule of ``ensemble.module`` or of a
    ``ParallelEnsemble(likelihood, K)`` do.
    """
    if not isinstance(loss_fn, nn.Module):
        return None
    module = _loss_module(loss_fn)
    tensors = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    if not tensors:
        return None
    shapes = {name: tuple(tensor.shape) for name, tensor in tensors.items()}
    first = next(iter(shapes.values()))
    total = first[0] if first else 0
    chosen = range(total)[members]
    if any(not shape or shape[0] != total for shape in shapes.values()) or len(chosen) != size:
        raise ValueError(
            f"Invalid loss_fn: {type(module).__name__} with tensors {shapes} (expected a "
            f"loss module whose parameters and buffers are stacked along a leading member "
            f"dimension, {size} members here: a ParallelEnsemble of it, or a submodule of "
            "ensemble.module)"
        )
    return {name: tensor[members] for name, tensor in tensors.items()}


def _stacked_module_loss(
    module: nn.Module,
    tensors: dict[str, Tensor],
    outputs: Any,
    targets: Any,
    per_member_targets: bool,
) -> Tensor:
    """Sum over k of ``module(outputs_k, targets_k)`` run with member k's tensors."""

    def member_loss(member: dict[str, Tensor], member_outputs: Any, member_targets: Any) -> Tensor:
        value = functional_call(module, member, (member_outputs, member_targets))
        _check_scalar(value)
        return cast(Tensor, value)

    in_dims = (0, 0, 0 if per_member_targets else None)
    return vmap(member_loss, in_dims=in_dims)(tensors, outputs, targets).sum()


def _check_scalar(value: Any) -> None:
    if not isinstance(value, Tensor) or value.dim() != 0:
        shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
        raise ValueError(
            f"Invalid loss_fn: it returned {shape} per member (expected a scalar tensor, "
            "the member's mean loss: use reduction='mean')"
        )


def _is_plain_class_nll(loss_fn: Any, outputs: Any, targets: Any) -> bool:
    """Whether ``loss_fn`` is torch's unweighted mean cross-entropy or NLL on class indices."""
    if loss_fn is F.cross_entropy or loss_fn is F.nll_loss:
        pass
    elif type(loss_fn) in (nn.CrossEntropyLoss, nn.NLLLoss):
        if loss_fn.weight is not None or loss_fn.reduction != "mean":
            return False
        if getattr(loss_fn, "label_smoothing", 0.0) != 0.0:
            return False
    else:
        return False
    return (
        isinstance(outputs, Tensor)
        and isinstance(targets, Tensor)
        and outputs.dim() >= 3
        and not targets.is_floating_point()
        and targets.dim() == outputs.dim() - 2
    )


def _leading_size(name: str, value: Any) -> int:
    leaves = [leaf for leaf in tree_flatten(value)[0] if isinstance(leaf, Tensor)]
    sizes = {tuple(leaf.shape[:1]) for leaf in leaves}
    if not leaves or len(sizes) != 1 or () in sizes:
        shapes = [tuple(leaf.shape) for leaf in leaves]
        raise ValueError(
            f"Invalid {name}: shapes {shapes} (expected tensors with a common leading "
            "member dimension)"
        )
    return sizes.pop()[0]


#: one member's share of each argument that :func:`check_member_size` checks
_PER_MEMBER = {
    "outputs": "one output per member",
    "targets": "one set of targets per member, with per_member_targets=True",
}


def check_member_size(name: str, value: Any, size: int) -> None:
    """Raise unless ``value``, the outputs or targets (``name``), leads with ``size`` members."""
    found = _leading_size(name, value)
    if found != size:
        raise ValueError(
            f"Invalid {name}: leading dimension {found} (expected {size}, {_PER_MEMBER[name]})"
        )


def backward_in_chunks(
    run: Callable[[dict[str, Tensor], tuple[Any, ...]], Any],
    stacked: Mapping[str, Tensor],
    loss_fn: Callable[[Any, Any], Tensor],
    args: tuple[Any, ...],
    targets: Any,
    *,
    size: int,
    chunk_size: int,
    per_member_inputs: bool,
    per_member_targets: bool,
) -> Tensor:
    """Forward, loss and backward of ``size`` members, ``chunk_size`` at a time.

    ``run(entry, inputs)`` runs the members whose stacked tensors ``entry`` holds on
    ``inputs``. The gradients accumulate into the ``.grad`` of the ``stacked`` tensors
    (arguments already checked). Returns the summed loss, detached.
    """
    for tensor in stacked.values():
        if tensor.requires_grad and tensor.grad is None:
            tensor.grad = torch.zeros_like(tensor)
    step = chunk_size
    total = None
    for start in range(0, size, step):
        stop = min(start + step, size)
        entry = {}
        for name, tensor in stacked.items():
            # A leaf view of the chunk whose .grad is a view of the stacked .grad:
            # autograd accumulates into it in place, so no full-size gradient is ever
            # materialised for a chunk.
            view = tensor.detach()[start:stop]
            if tensor.requires_grad:
                view.requires_grad_()
                view.grad = cast(Tensor, tensor.grad)[start:stop]  # zero-filled above
            entry[name] = view

        def part(value: Any, flag: bool, start: int = start, stop: int = stop) -> Any:
            if not flag:
                return value
            return tree_map(lambda v: v[start:stop] if isinstance(v, Tensor) else v, value)

        outputs = run(entry, tuple(part(arg, per_member_inputs) for arg in args))
        loss = _members_loss(
            loss_fn,
            outputs,
            part(targets, per_member_targets),
            per_member_targets,
            slice(start, stop),
        )
        loss.backward()  # type: ignore[no-untyped-call]  # unannotated in torch
        total = loss.detach() if total is None else total + loss.detach()
    assert total is not None
    return total
