r"""Gaussian priors that scale with the layer: N(0, σ²/fan_in) per weight, biases apart.

A prior :math:`\mathcal N(0, v)` on a parameter is, in the package's mean-loss convention
(``docs/design.md``), the weight decay :math:`\lambda = 1/(N v)` (its gradient in the mean
loss is :math:`\theta/(N v)`), and the Laplace prior precision :math:`1/v`. The rule, per
parameter of ``model`` (each module's own parameters, ``recurse=False``):

* the ``weight`` of an ``nn.Linear`` or a convolution (``nn.Conv1d/2d/3d`` and the
  transposed ones): :math:`v = \text{std}^2/\text{fan\_in}` with ``scale="fan_in"``
  (the variance that keeps a layer's pre-activations of order one, as He et al. 2015
  initialise and as Neal 1996, §2.2, scales priors so that wide networks have a limit;
  fan_in as ``torch.nn.init`` computes it: ``weight.shape[1]`` times the kernel size,
  i.e. ``in_features``, or ``in_channels / groups`` times the kernel's elements, read
  from the layer's attributes so that a ``ParallelEnsemble``'s stacked weights get each
  member's), or
  :math:`v = \text{std}^2` with ``scale="none"``;
* the ``bias`` of those layers: :math:`v = \text{bias\_std}^2`;
* the parameters of a module that declares its prior in its own loss (a class attribute
  ``prior_in_loss = True``, as :class:`~samplers_as_optim.regression.GaussianLikelihood`):
  no weight decay (:math:`\lambda = 0`), and no entry in the Laplace dict; the module
  declares there the curvature of that loss its parameters have whatever the data
  (``loss_curvature``, per datum: ``GaussianLikelihood``'s log σ, whose Fisher
  information is 2 per observation), which floors the twin's preconditioner as the
  prior's decay floors the weights' (``decoupled=True``);
* every other parameter (normalisation layers, embeddings, a user's module):
  :math:`v = \text{other\_std}^2`, no fan-in scaling;
* but where ``precision`` is given, :math:`v = 1/\text{precision}` for the parameters it
  names (a number: for every parameter whose prior is not in a loss), e.g. the prior a
  :class:`~samplers_as_optim.Laplace`'s evidence tuned (``la.prior_precision`` with
  ``prior_structure="scalar"`` or ``"layerwise"``), so that a chain samples the
  posterior under the prior the evidence chose (empirical Bayes, MacKay 1992).

Only parameters with ``requires_grad=True`` are included. Parameters with one variance
share a param group, in the order of ``model.named_parameters()``; every group holds
``(name, parameter)`` pairs, so a sampler keys its noise by the parameters' names, and
the marker ``"l2_prior": True`` (``PRIOR_GROUP_KEY``), which says that its
``weight_decay`` is a prior only where the decay is an L2 term of the gradient:
``torch.optim`` optimizers keep such a key and ignore it, and
:class:`~samplers_as_optim.AdamWSGHMC`, whose decay is decoupled, refuses the group.

References:
    Neal (1996), Bayesian Learning for Neural Networks, §2.2.
    He, Zhang, Ren & Sun (2015), Delving deep into rectifiers, §2.2.
    Fortuin et al. (2022), Bayesian neural network priors revisited, §2.
    MacKay (1992), A practical Bayesian framework for backpropagation networks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, TypeAlias

import torch
from torch import Tensor, nn

from .core.validation import check_bool, check_choice, check_num_data, check_positive

__all__ = ["prior_loss", "prior_param_groups", "prior_precision", "prior_variances"]

#: how a weight's variance scales: by 1/fan_in, or not at all
SCALES = ("fan_in", "none")

#: the key (set to True) that marks a group of :func:`prior_param_groups`: its
#: ``weight_decay`` is the prior N(0, v) as the L2 decay 1/(N v) coupled to the gradient
PRIOR_GROUP_KEY = "l2_prior"

_LAYERS = (nn.Linear, nn.modules.conv._ConvNd)

#: a prior precision 1/v: one number for every parameter, or one per parameter name
Precision: TypeAlias = "float | Mapping[str, float | Tensor]"


def _fan_in(module: nn.Module) -> int:
    """``torch.nn.init``'s fan-in of a layer's weight, from the layer's own attributes.

    ``weight.shape[1]`` times the kernel's elements, as ``torch.nn.init`` computes it,
    but read from the module (``in_features``; ``in_channels / groups``, or for a
    transposed convolution ``out_channels / groups``, times the kernel size), so that a
    stacked weight (a ``ParallelEnsemble``'s ``[K, out, in]``) gets each member's fan-in.
    """
    if isinstance(module, nn.Linear):
        return int(module.in_features)
    assert isinstance(module, nn.modules.conv._ConvNd)
    channels = module.out_channels if module.transposed else module.in_channels
    return channels // module.groups * math.prod(module.kernel_size)


def prior_variances(
    model: nn.Module,
    *,
    std: float = 1.0,
    bias_std: float = 1.0,
    other_std: float = 1.0,
    scale: str = "fan_in",
    precision: Precision | None = None,
) -> dict[str, float | None]:
    """The prior variance of every trainable parameter, by name (None: its prior is in a loss).

    The rule of the module docstring. Shared parameters appear once, under their first
    name (as in ``model.named_parameters()``).

    Args:
        model: the model (any ``nn.Module``).
        std: the weights' σ (default: 1.0; > 0), divided by √fan_in with
            ``scale="fan_in"``.
        bias_std: the biases' σ (default: 1.0; > 0).
        other_std: σ of every other parameter (default: 1.0; > 0).
        scale: ``"fan_in"`` (default) or ``"none"``.
        precision: None (default: the rule above), or the prior precision 1/v that
            overrides it: a number (> 0) for every parameter whose prior is not in a loss,
            or a mapping from parameter names (as ``model.named_parameters()`` gives
            them) to a number or a tensor of one value (a
            :class:`~samplers_as_optim.Laplace`'s ``prior_precision`` with
            ``prior_structure="layerwise"``); the parameters it does not name keep the
            rule.

    Returns:
        name -> variance v (a float), or None for a parameter whose module declares its
        prior in its own loss.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, or ``precision`` not None, a number
            or a mapping of names to numbers or tensors.
        ValueError: a bad ``std``, ``bias_std``, ``other_std`` or ``scale``, a model
            with no trainable parameter, or a ``precision`` that names no trainable
            parameter of the model, or one whose prior is in a loss, or holds a value that
            is not finite and > 0, or a tensor of more than one value (a per-element
            precision is no weight decay).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"Invalid model: {type(model).__name__} (expected an nn.Module)")
    std = check_positive("std", std)
    bias_std = check_positive("bias_std", bias_std)
    other_std = check_positive("other_std", other_std)
    check_choice("scale", scale, SCALES)
    variances: dict[str, float | None] = {}
    seen: set[int] = set()
    for prefix, module in model.named_modules():
        for local, parameter in module.named_parameters(recurse=False):
            if id(parameter) in seen or not parameter.requires_grad:
                continue
            seen.add(id(parameter))
            name = f"{prefix}.{local}" if prefix else local
            variance: float | None
            if getattr(module, "prior_in_loss", False) is True:
                variance = None
            elif isinstance(module, _LAYERS) and local == "weight":
                fan_in = _fan_in(module) if scale == "fan_in" else 1
                variance = std**2 / fan_in
            elif isinstance(module, _LAYERS) and local == "bias":
                variance = bias_std**2
            else:
                variance = other_std**2
            variances[name] = variance
    if not variances:
        raise ValueError(
            f"Invalid model: {type(model).__name__} without trainable parameters "
            "(expected a model with parameters that require grad)"
        )
    variances.update(_overridden(variances, precision))
    # named_modules() visits in named_parameters() order for the first occurrence
    order = [name for name, _ in model.named_parameters() if name in variances]
    return {name: variances[name] for name in order}


def _overridden(variances: dict[str, float | None], precision: Any) -> dict[str, float]:
    """The variances 1/precision that ``precision`` sets (see :func:`prior_variances`)."""
    if precision is None:
        return {}
    if not isinstance(precision, Mapping):
        if isinstance(precision, Tensor) and precision.numel() == 1:
            precision = float(precision)
        if isinstance(precision, bool) or not isinstance(precision, (int, float)):
            raise TypeError(
                f"Invalid precision: {precision!r} (expected None, a finite number > 0, or "
                "a mapping of parameter names to numbers or one-valued tensors)"
            )
        with_prior = [name for name, variance in variances.items() if variance is not None]
        return dict.fromkeys(with_prior, 1.0 / check_positive("precision", precision))
    overrides = {}
    for name, value in precision.items():
        where = f"precision[{name!r}]"
        if name not in variances:
            raise ValueError(
                f"Invalid precision: key {name!r} (expected the names of the model's "
                f"trainable parameters, as model.named_parameters() gives them: "
                f"{', '.join(map(repr, variances))})"
            )
        if variances[name] is None:
            raise ValueError(
                f"Invalid precision: key {name!r} (expected a parameter with a prior: its "
                "module declares its prior in its own loss)"
            )
        if isinstance(value, Tensor):
            if value.numel() == 0 or not bool((value == value.flatten()[0]).all()):
                raise ValueError(
                    f"Invalid {where}: a tensor of shape {tuple(value.shape)} whose elements "
                    "differ (expected one precision per parameter tensor, as Laplace's "
                    "prior_structure='scalar' or 'layerwise' gives it: a weight decay is "
                    "one number per parameter)"
                )
            value = float(value.flatten()[0])
        overrides[name] = 1.0 / check_positive(where, value)
    return overrides


def prior_param_groups(
    model: nn.Module,
    *,
    num_data: int,
    std: float = 1.0,
    bias_std: float = 1.0,
    other_std: float = 1.0,
    scale: str = "fan_in",
    decoupled: bool = False,
    precision: Precision | None = None,
) -> list[dict[str, Any]]:
    r"""Param groups whose ``weight_decay`` is each parameter's prior: :math:`1/(N v)`.

    ``SGHMC(prior_param_groups(model, num_data=N), lr=lr, num_data=N)`` samples the
    posterior under the module docstring's prior; any ``torch.optim`` optimizer with an
    L2 weight decay (SGD, Adam, RMSprop) takes the same groups (its MAP). A group's own
    ``weight_decay`` overrides the optimizer's argument. Where ``weight_decay`` is
    decoupled from the gradient (``torch.optim.AdamW``, :class:`~samplers_as_optim.AdamWSGHMC`)
    it is not this prior: give those ``weight_decay=0`` and :func:`prior_loss` in the loss.
    :class:`~samplers_as_optim.AdamWSGHMC` refuses these groups (a ``weight_decay`` other
    than 0) by their marker ``"l2_prior": True`` (``PRIOR_GROUP_KEY``); AdamW cannot tell.

    ``decoupled=True`` gives those optimizers their groups: ``weight_decay`` 0 and the
    prior's decay as ``"prior_weight_decay"`` (the prior itself goes in the loss,
    :func:`prior_loss`; a module's ``loss_curvature`` for the parameters whose prior is
    in a loss, module docstring), which :class:`~samplers_as_optim.AdamWSGHMC` reads to
    floor its sampling preconditioner, so that a chain started at the MAP stays sane;
    ``torch.optim`` ignores the key, the other samplers warn that they do.

    Args:
        model: the model.
        num_data: N, the training-set size (keyword-only, required).
        std: as in :func:`prior_variances`.
        bias_std: as in :func:`prior_variances`.
        other_std: as in :func:`prior_variances`.
        scale: as in :func:`prior_variances`.
        decoupled: the groups of an optimizer with a decoupled decay (above).
        precision: as in :func:`prior_variances` (e.g. a Laplace's ``la.prior_precision``).

    Returns:
        A list of param groups ``{"params": [(name, parameter), ...], "weight_decay":
        λ, "l2_prior": True}`` (``decoupled``: ``{"params": ..., "weight_decay": 0.0,
        "prior_weight_decay": λ}``), one per distinct variance, in the order of the
        parameters; λ = 0 for the parameters whose prior is in a loss.

    Raises:
        ValueError, TypeError: as :func:`prior_variances`; a bad ``num_data``, or another
            than that of a module whose prior is in its loss (which would temper it).

    Example:
        >>> import torch
        >>> from samplers_as_optim import SGHMC, prior_param_groups
        >>> model = torch.nn.Sequential(
        ...     torch.nn.Linear(4, 50), torch.nn.ReLU(), torch.nn.Linear(50, 1))
        >>> groups = prior_param_groups(model, num_data=100)
        >>> [(len(g["params"]), g["weight_decay"]) for g in groups]  # 1/(N v)
        [(1, 0.04), (2, 0.01), (1, 0.5)]
        >>> optimizer = SGHMC(groups, lr=1e-3, num_data=100)
    """
    num_data = check_num_data(num_data)
    check_bool("decoupled", decoupled)
    variances = prior_variances(
        model, std=std, bias_std=bias_std, other_std=other_std, scale=scale, precision=precision
    )
    _check_loss_priors_agree(model, num_data)
    parameters = dict(model.named_parameters())
    known = _loss_curvatures(model) if decoupled else {}
    groups: dict[float, list[tuple[str, nn.Parameter]]] = {}
    for name, variance in variances.items():
        decay = known.get(name, 0.0) if variance is None else 1.0 / (num_data * variance)
        groups.setdefault(decay, []).append((name, parameters[name]))
    if decoupled:
        return [
            {"params": params, "weight_decay": 0.0, "prior_weight_decay": decay}
            for decay, params in groups.items()
        ]
    return [
        {"params": params, "weight_decay": decay, PRIOR_GROUP_KEY: True}
        for decay, params in groups.items()
    ]


def prior_precision(
    model: nn.Module,
    *,
    std: float = 1.0,
    bias_std: float = 1.0,
    other_std: float = 1.0,
    scale: str = "fan_in",
    precision: Precision | None = None,
) -> dict[str, Tensor]:
    r"""The same prior as Laplace's per-parameter precision: name -> a tensor of :math:`1/v`.

    ``Laplace(model, ..., prior_precision=prior_precision(model))`` uses the prior that
    :func:`prior_param_groups` gives a sampler (:math:`1/v = N\lambda`). Parameters whose
    prior is in a loss have no entry (keep them out of the Laplace approximation, e.g.
    with ``subset``).

    Args:
        model: the model.
        std: as in :func:`prior_variances`.
        bias_std: as in :func:`prior_variances`.
        other_std: as in :func:`prior_variances`.
        scale: as in :func:`prior_variances`.
        precision: as in :func:`prior_variances`.

    Returns:
        name -> a tensor of the parameter's shape, dtype and device, filled with 1/v.

    Example:
        >>> import torch
        >>> from samplers_as_optim import prior_precision
        >>> precision = prior_precision(torch.nn.Linear(4, 2))
        >>> precision["weight"][0, 0].item(), precision["bias"][0].item()
        (4.0, 1.0)
    """
    variances = prior_variances(
        model, std=std, bias_std=bias_std, other_std=other_std, scale=scale, precision=precision
    )
    parameters = dict(model.named_parameters())
    return {
        name: torch.full_like(parameters[name], 1.0 / variance).detach()
        for name, variance in variances.items()
        if variance is not None
    }


def prior_loss(
    model: nn.Module,
    *,
    num_data: int,
    std: float = 1.0,
    bias_std: float = 1.0,
    other_std: float = 1.0,
    scale: str = "fan_in",
    precision: Precision | None = None,
) -> Tensor:
    r"""The same prior as a term of the mean loss: :math:`\sum_j \theta_j^2 / (2 N v_j)`.

    :math:`-\log p(\theta)/N` up to a constant, for optimizers whose ``weight_decay`` is
    decoupled (AdamW, :class:`~samplers_as_optim.AdamWSGHMC`): ``loss = nll +
    prior_loss(model, num_data=N)`` with ``weight_decay=0``. Its gradient is what
    :func:`prior_param_groups`' weight decay adds, :math:`\theta_j/(N v_j)`.

    Args:
        model: the model.
        num_data: N, the training-set size (keyword-only, required).
        std: as in :func:`prior_variances`.
        bias_std: as in :func:`prior_variances`.
        other_std: as in :func:`prior_variances`.
        scale: as in :func:`prior_variances`.
        precision: as in :func:`prior_variances`.

    Returns:
        A scalar tensor, differentiable in the parameters.

    Raises:
        ValueError, TypeError: as :func:`prior_param_groups`.

    Example:
        >>> import torch
        >>> from samplers_as_optim import prior_loss
        >>> model = torch.nn.Linear(4, 1)
        >>> with torch.no_grad():
        ...     _ = model.weight.fill_(1.0), model.bias.fill_(2.0)
        >>> prior_loss(model, num_data=10)  # (4 * 1 / (2 * 10 / 4)) + 4 / (2 * 10)
        tensor(1., grad_fn=<AddBackward0>)
    """
    num_data = check_num_data(num_data)
    variances = prior_variances(
        model, std=std, bias_std=bias_std, other_std=other_std, scale=scale, precision=precision
    )
    _check_loss_priors_agree(model, num_data)
    parameters = dict(model.named_parameters())
    total: Tensor | None = None
    for name, variance in variances.items():
        if variance is None:
            continue
        term = parameters[name].square().sum() / (2 * num_data * variance)
        total = term if total is None else total + term
    if total is None:
        reference = next(iter(parameters.values()))
        return torch.zeros((), dtype=reference.dtype, device=reference.device)
    return total


def _check_loss_priors_agree(model: nn.Module, num_data: int) -> None:
    """Raise if a module whose prior is in its loss divides it by another N than ``num_data``.

    :class:`~samplers_as_optim.regression.GaussianLikelihood` adds its prior over N, its
    own ``num_data``; where that differs from the N the weights' prior and the sampler
    use, σ's posterior is silently tempered by their ratio.
    """
    for prefix, module in model.named_modules():
        own = getattr(module, "num_data", None)
        if getattr(module, "prior_in_loss", False) is True and own is not None and own != num_data:
            raise ValueError(
                f"Invalid num_data: {num_data} (expected {own}, the num_data of "
                f"{prefix or 'the model'} ({type(module).__name__}), whose prior is in its "
                "loss over its own num_data: both are the training-set size N, else its "
                "parameters' posterior is tempered by their ratio)"
            )


def _loss_curvatures(model: nn.Module) -> dict[str, float]:
    """Per parameter name, the ``loss_curvature`` its module declares (``prior_in_loss``)."""
    known: dict[str, float] = {}
    for prefix, module in model.named_modules():
        if getattr(module, "prior_in_loss", False) is not True:
            continue
        for local, value in dict(getattr(module, "loss_curvature", {})).items():
            known[f"{prefix}.{local}" if prefix else local] = float(value)
    return known
