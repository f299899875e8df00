"""A param group's step, planned once: what every step reads, validated, kept until it changes.

``torch.optim``'s optimizers validate their hyperparameters once, at construction; a
sampler cannot, because a schedule may move any of them between steps (a scheduler
writes ``group["lr"]``, ``CyclicalSGMCMC`` writes ``group["temperature"]``) and a wrong
value would silently change the law sampled. What the step reads of a group is therefore
planned: :class:`GroupPlan` holds the values it validated (the hyperparameters, the
chain's seed, the dtypes the step's scalars were checked against) and the floats the
step computes with, and :meth:`GroupPlan.holds` says, in a few comparisons and no
validation, whether the group is still the one planned. A step re-plans a group when
anything the plan depends on has changed:

* a hyperparameter's value or type (a schedule, an assignment), an entry added to or
  removed from the group (``initial_lr``, written once by a scheduler);
* the group's ``params`` list (another list, or one of another length) or ``seed``;
* the dtypes of its parameters with a gradient, where a new one appears;
* a loaded state, an unpickled or deep-copied optimizer (which drop every plan:
  ``SamplerOptimizer._reset_runtime``).

A value that is a tensor (a learning rate held as a tensor) makes the group's plan
volatile: it is validated at every step, as before plans. The step counter is not
planned: it changes at every step and is checked (an ``int`` >= 0) every time, by a
comparison, before it keys the noise. A capturable group's counter (a 0-d tensor on the
device, advanced in place: ``capturable=True``) is validated when planned, and the plan
holds that tensor: another one (a loaded state) makes a new plan; its value is never read
by the step.

The parameters a step takes (those with a gradient) are described once, too
(:class:`TensorLayout`: their foreach buckets, dtypes, which are drawn together and
into what), and the description is kept while a step's parameters are the same
tensors with the same shapes, dtypes, devices and shares of larger tensors: one
comparison per parameter instead of each stage asking each tensor again.

What the step then runs is the pipeline of ``docs/design.md`` ("The step"): the guard
(the non-finite policy and ``torch.amp.GradScaler``'s verdict), the noise, the sampler's
update and the write-back of masters and buffers, through one of two backends, the
reference (``step/reference``: torch ops, foreach or chunked) or the fused Triton
kernels (``fused/backend``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ...core.chain import check_representable
from ...core.dtensor import is_dtensor
from ...core.validation import check_bool
from ...names import parameter_layout
from ..tensor_lists import buckets, default_foreach
from .half_precision import HALF_DTYPES

__all__ = [
    "NOT_HYPERPARAMETERS",
    "GroupPlan",
    "StepRates",
    "TensorLayout",
    "capturable_option",
    "check_capturable",
    "drawn_whole",
    "place_step_counter",
    "planned",
]

#: param-group entries that are not hyperparameters (the chain's state, counters)
#: (and ``capturable``: an option of the optimizer, which ``torch.compile`` writes into
#: every group it traces, and torch's RMSprop and AdamW checkpoints hold)
NOT_HYPERPARAMETERS = frozenset({"params", "step", "seed", "skipped_steps", "capturable"})


def drawn_whole(param: Tensor) -> bool:
    """Whether a parameter's noise is a whole draw of its own.

    Not for a DTensor (an FSDP2 shard's rows) nor a share of a larger tensor
    (``names.parameter_layout``), which draw their part of the whole tensor's noise.
    """
    return parameter_layout(param) is None and not is_dtensor(param)


class TensorLayout:
    """The tensors a group steps (its parameters with a gradient), described once.

    What the stages read of the parameters but their values: a step whose parameters
    are the same tensors, of the same shapes, dtypes, devices and shares (``signature``),
    reads it from the plan (:meth:`GroupPlan.layout`) instead of asking each tensor again.

    Attributes:
        signature: each parameter's ``(id, shape, dtype, device, share)`` (``share``: its
            ``parameter_layout``, where it is part of a larger tensor).
        buckets: their indices grouped by (device, dtype), for the foreach kernels
            (``tensor_lists.buckets``).
        dtypes: their dtypes.
        half: whether any is float16/bfloat16 (a float32 master may step for it).
        complex: whether any is complex (refused: ``SamplerOptimizer._gather``).
        dtensor: whether any is a DTensor.
        foreach: ``torch.optim``'s default for them (``tensor_lists.default_foreach``).
        drawn: the indices of those whose noise the step draws together (neither a
            DTensor nor a share of a larger tensor: ``step/group_noise``).
        noise: the tensors their noise is drawn into, kept (``step/group_noise``; None
            until the first draw).
    """

    __slots__ = (
        "buckets",
        "complex",
        "drawn",
        "dtensor",
        "dtypes",
        "foreach",
        "half",
        "noise",
        "signature",
    )

    def __init__(self, params: list[Tensor], signature: list[tuple[Any, ...]]) -> None:
        self.signature = signature
        self.buckets = buckets(params)
        self.dtypes = {param.dtype for param in params}
        self.half = any(dtype in HALF_DTYPES for dtype in self.dtypes)
        self.complex = any(dtype.is_complex for dtype in self.dtypes)
        self.dtensor = any(map(is_dtensor, params))
        self.foreach = default_foreach(params)
        self.drawn = [i for i, param in enumerate(params) if drawn_whole(param)]
        self.noise: list[Tensor | None] | None = None


class StepRates(NamedTuple):
    """What a group's step computes with: ``lr``, ``temperature``, fields, ``scratch``.

    ``layout``: its tensors' (:class:`TensorLayout`), or None (a step not planned).
    """

    lr: float
    temperature: float
    fields: tuple[str, ...]
    scratch: dict[str, Any]
    layout: TensorLayout | None = None


class GroupPlan:
    """What one param group's step reads, validated once (see the module docstring).

    Attributes:
        lr: the validated learning rate, as a float.
        temperature: the validated temperature, as a float.
        fields: the per-parameter state the sampler's update reads and writes, in its
            order (``SamplerDefinition.state_fields``).
        volatile: a hyperparameter is a tensor: validated at every step.
        counter: a capturable group's step counter, the tensor planned, else None.
        scratch: what the stages keep from step to step (a dict; a step not planned,
            traced by ``torch.compile``, gets a new one).
        tensors: the last step's :class:`TensorLayout` (:meth:`layout`), or None.
    """

    __slots__ = (
        "counter",
        "fields",
        "lr",
        "names",
        "params",
        "represented",
        "scratch",
        "seed",
        "size",
        "temperature",
        "tensors",
        "types",
        "values",
        "volatile",
    )

    def __init__(self, group: dict[str, Any], fields: tuple[str, ...]) -> None:
        self.names = tuple(name for name in group if name not in NOT_HYPERPARAMETERS)
        self.values = tuple(group[name] for name in self.names)
        self.types = tuple(map(type, self.values))
        self.volatile = any(isinstance(value, Tensor) for value in self.values)
        self.size = len(group)
        self.params = group["params"]
        self.seed = group["seed"]
        self.lr = float(group["lr"])
        self.temperature = float(group["temperature"])
        self.fields = fields
        step = group["step"]
        #: a capturable group's step counter (a tensor), else None
        self.counter = step if isinstance(step, Tensor) else None
        #: the dtypes ``check_representable`` passed for these hyperparameters
        self.represented: set[torch.dtype] = set()
        self.scratch: dict[str, Any] = {}
        self.tensors: TensorLayout | None = None

    def rates(self) -> StepRates:
        """What the step computes with (:class:`StepRates`), with the last layout."""
        return StepRates(self.lr, self.temperature, self.fields, self.scratch, self.tensors)

    def layout(self, params: list[Tensor]) -> TensorLayout:
        """The :class:`TensorLayout` of ``params``: the last one if they match it, else new."""
        signature = [(id(p), p.shape, p.dtype, p.device, parameter_layout(p)) for p in params]
        kept = self.tensors
        if kept is None or kept.signature != signature:
            kept = self.tensors = TensorLayout(params, signature)
        return kept

    def holds(self, group: dict[str, Any]) -> bool:
        """Whether ``group`` is still the group planned: same values, same entries."""
        if self.volatile or len(group) != self.size or group["params"] is not self.params:
            return False
        counter = self.counter
        if counter is not None and (
            group["step"] is not counter
            or (self.params and counter.device != self.params[0].device)
        ):
            return False  # (a loaded counter, or the parameters moved: placed again)
        seed = group["seed"]
        if seed is not self.seed and (type(seed) is not type(self.seed) or seed != self.seed):
            return False
        try:
            values = tuple(map(group.__getitem__, self.names))
        except KeyError:  # an entry renamed: as many entries, other names
            return False
        return values == self.values and tuple(map(type, values)) == self.types

    def check_dtypes(
        self, group: dict[str, Any], params: list[Tensor], where: Callable[[], str]
    ) -> None:
        """``check_representable`` for dtypes these hyperparameters were not checked against.

        ``params``: the step's, whose :meth:`layout` was the last taken; ``where()``
        locates the group in a message.
        """
        layout = self.tensors
        dtypes = {param.dtype for param in params} if layout is None else layout.dtypes
        if dtypes <= self.represented:
            return
        check_representable(group, params, where=where())
        if not self.volatile:
            self.represented |= dtypes


def planned(
    plans: dict[int, GroupPlan],
    group: dict[str, Any],
    check: Callable[[dict[str, Any]], None],
    fields: Callable[[dict[str, Any]], tuple[str, ...]],
) -> GroupPlan:
    """``group``'s plan: the one kept if it still holds, else a new one, validated first.

    ``check(group)`` validates the hyperparameters and the chain's state and raises on
    an invalid value; nothing is kept then, so the next step checks again.
    ``fields(group)``: the state fields the group's update reads. The step
    counter, which no plan holds (but a capturable group's tensor), is checked at every
    call: a step counter that is not an ``int`` >= 0 is checked, which raises, or (a
    tensor, a state loaded from a capturable group) makes a new plan.
    """
    plan = plans.get(id(group))
    if plan is not None and plan.holds(group):
        step = group["step"]
        if plan.counter is not None or (type(step) is int and step >= 0):
            return plan
    check(group)
    plan = plans[id(group)] = GroupPlan(group, fields(group))
    return plan


def capturable_option(arguments: dict[str, Any], sampler: str, host_state: tuple[str, ...]) -> bool:
    """The constructor's ``capturable``: a bool, True only for a sampler without host numbers."""
    capturable = check_bool("capturable", arguments.get("capturable", False))
    if capturable and host_state:
        raise ValueError(
            f"Invalid capturable: True (expected False: {sampler} counts its steps in "
            f"Python (state {', '.join(map(repr, host_state))}), which a replayed step "
            "would not advance; capturable=True is for SGLD, SGHMC, BAOA and SGNHT)"
        )
    return capturable


def check_capturable(
    group: dict[str, Any], *, nonfinite: str, fused: bool | None, where: str
) -> None:
    """Refuse a group a capturable step cannot take, saying why (ValueError).

    A captured step may read nothing back to the host: ``nonfinite="raise"`` reads the
    gradients' check, the fused kernels take the step counter as a host integer, and the
    group's step counter lives on one device.
    """
    params = [param for param in group["params"] if isinstance(param, Tensor)]  # (not saved ids)
    tensors = [name for name, value in group.items() if isinstance(value, Tensor)]
    tensors = [name for name in tensors if name not in NOT_HYPERPARAMETERS]
    reason = None
    if tensors:
        reason = (
            f"a tensor {tensors[0]} ({group[tensors[0]]!r}; expected a Python number: a "
            "tensor hyperparameter is checked at every step, which reads it back to the "
            "host; a capturable step reads lr and temperature when it is captured)"
        )
    elif nonfinite != "skip":
        reason = (
            f"nonfinite={nonfinite!r} (expected nonfinite='skip': refusing a step reads the "
            "gradients' check back to the host, which a captured step cannot)"
        )
    elif fused:
        reason = (
            "fused=True (expected fused=None or False: the fused kernels take the step "
            "counter from the host; a capturable step runs the unfused one)"
        )
    elif any(map(is_dtensor, params)):
        reason = "DTensor (FSDP2) parameters (expected plain tensors: not supported yet)"
    elif len({param.device for param in params}) > 1:
        devices = sorted({str(param.device) for param in params})
        reason = (
            f"parameters on {', '.join(devices)} (expected one device per param group: "
            "the group's step counter lives on it)"
        )
    if reason is not None:
        raise ValueError(f"Invalid capturable{where}: True with {reason}")


def place_step_counter(group: dict[str, Any], *, capturable: bool) -> None:
    """A capturable step's counter: a 0-d int64 tensor on the group's parameters' device.

    An ``int`` (a new group, a state saved uncapturable) becomes one; a tensor elsewhere
    (a state loaded with another ``map_location``, parameters moved) is copied there,
    with the group's ``skipped_steps``. Not capturable: a
    tensor (a state saved capturable) becomes an ``int`` (a host read, when planned).
    """
    step = group["step"]
    if not capturable:
        if isinstance(step, Tensor):
            group["step"] = int(step)
        return
    device = group["params"][0].device if group["params"] else torch.device("cpu")
    if not isinstance(step, Tensor):
        group["step"] = torch.tensor(step, dtype=torch.int64, device=device)
    elif step.device != device or step.dtype != torch.int64:
        group["step"] = step.to(device=device, dtype=torch.int64)
    skipped = group.get("skipped_steps")  # (a state loaded elsewhere: read at every step)
    if isinstance(skipped, Tensor) and skipped.device != device:
        group["skipped_steps"] = skipped.to(device)
