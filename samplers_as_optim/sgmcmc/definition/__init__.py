r"""A sampler of the SG-MCMC family as one declarative definition.

A sampler module declares, once, everything that makes the sampler what it is:

* its **hyperparameters** (:class:`Hyperparameter`): name, default, type, validator and
  documentation, in the order of the public signature;
* its **state** (:class:`StateField`): the per-parameter buffers, when each is kept,
  their initial values, and whether they are kept in SGD units and re-expressed when
  ``lr`` changes (``momentum_in_lr_units``, see ``docs/design.md``);
* its **pure update** (:data:`Update`): parameters, gradients, buffers and the noise in
  (:class:`UpdateInput`), directions and new buffers out, nothing else touched;
* the rules that join hyperparameters (``check``), and what the sampler cannot do
  (a temperature of 0, chunked or DTensor parameters).

A sampler's **fused kernel**, the same step as a Triton kernel in one pass per tensor on
CUDA, lives beside its definition (``sgmcmc/sghmc/triton_kernel``) and is named in the
fused backend's registry (``sgmcmc/fused/kernels``), not here: the definition, and the
Optimizer's reference step built from it, import nothing of the fused backend.

From a :class:`SamplerDefinition`, ``sgmcmc/optimizer.py`` builds the
``torch.optim.Optimizer`` class and ``sgmcmc/transform`` the torchopt
transformation: both front ends validate with the same validators, start the same state
and call the same update. Each public callable gets a real signature generated from the
declaration (:func:`generated_function`), so ``help(SGHMC)``, ``inspect.signature`` and
Python's own argument errors are those of a hand-written ``def``, and its ``Args``
section is assembled from the hyperparameters' documentation (:func:`arguments_doc`).
"""

from __future__ import annotations

import dataclasses
import keyword
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ...core.chain import NOISE_KEY
from ..temperature.rule import TemperatureRule
from .momentum_units import MOMENTUM_RATE

__all__ = [
    "REQUIRED",
    "RESERVED_STATE",
    "Hyperparameter",
    "SamplerDefinition",
    "StateField",
    "Update",
    "UpdateInput",
    "UpdateOutput",
    "arguments_doc",
    "example_doc",
    "generated_function",
    "transform_example_doc",
    "zeros_like_param",
]


class _Required:
    """The default of a hyperparameter that has none (``num_data``)."""

    def __repr__(self) -> str:
        return "REQUIRED"


#: the default of a hyperparameter the caller must give
REQUIRED: Any = _Required()


@dataclass(frozen=True)
class Hyperparameter:
    """One argument of a sampler's public signature, declared once for both front ends.

    Attributes:
        name: the argument's name (and the param-group key that holds it).
        default: its default, or :data:`REQUIRED`.
        annotation: its type as written in the signature (``"float | Tensor"``).
        doc: its ``Args`` entry, ``"name: text"`` with continuation lines indented by 12
            spaces (as in a class docstring).
        check: validates a value, ``check(value, where)``; raises with the argument's
            name, value and what is allowed. None: checked elsewhere (the base class
            checks the arguments every sampler shares).
        positional: whether it comes before the ``*`` in the Optimizer's signature
            (``torch.optim``'s own order).
        transform: whether the torchopt transformation takes it too.
        transform_positional: as ``positional``, for the transformation (default: the
            same).
        transform_annotation: its type in the transformation (``"ScalarOrSchedule"`` for a
            hyperparameter that may be a schedule); default: ``annotation``.
        transform_doc: its ``Args`` entry in the transformation; default: ``doc``.
        transform_default: its default in the transformation (``lr`` has none there);
            default: ``default``.
        kept: whether it is kept in the param groups (False for an argument accepted
            for ``torch.optim``'s signature and checked, such as SGLD's ``momentum``).
    """

    name: str
    default: Any = REQUIRED
    annotation: str = "float"
    doc: str = ""
    check: Callable[[Any, str], Any] | None = None
    positional: bool = False
    transform: bool = True
    transform_positional: bool | None = None
    transform_annotation: str | None = None
    transform_doc: str | None = None
    transform_default: Any = field(default=None, compare=False)
    kept: bool = True

    def __post_init__(self) -> None:
        if not self.name.isidentifier() or keyword.iskeyword(self.name):
            raise ValueError(f"Invalid hyperparameter name: {self.name!r}")

    def replace(self, **changes: Any) -> Hyperparameter:
        """A copy with some attributes changed (another default, another doc)."""
        return dataclasses.replace(self, **changes)

    def default_in_transform(self) -> Any:
        """Its default in the transformation."""
        return self.default if self.transform_default is None else self.transform_default


def zeros_like_param(param: Tensor, group: Mapping[str, Any]) -> Tensor:
    """A :class:`StateField`'s ``init``: zeros in ``param``'s shape, dtype and layout."""
    return torch.zeros_like(param, memory_format=torch.preserve_format)


@dataclass(frozen=True)
class StateField:
    """One per-parameter buffer of a sampler's state.

    Attributes:
        name: its key in the Optimizer's per-parameter state and its field in the
            transformation's state.
        doc: what it holds, for the transformation state's docstring.
        used: whether a param group with these hyperparameters keeps it (SGHMC keeps no
            buffer without momentum, as ``torch.optim.SGD``).
        init: its initial value for a parameter, ``init(param, group)``; None when the
            update creates it at the parameter's first step (``torch.optim.SGD``'s
            momentum buffer, which starts as the first gradient). The transformation,
            whose state must hold a tensor from the start, then holds zeros; the update
            is told by ``initial_state`` (see :data:`Update`).
        own_dtype: kept in its own dtype when a state is loaded (torch casts the others
            to the parameter's dtype): a thermostat.
        host: a number per parameter that the update reads in Python (AdamW's step
            count): the Optimizer keeps it as a 0-d CPU tensor, as ``torch.optim`` keeps
            its step counters, restored on the CPU in its saved dtype when a state is
            loaded; the transformation keeps it as a Python float. The update reads it
            with ``float(...)`` (no device synchronisation) and returns the same kind.
            A step the device skips (``nonfinite="skip"``, a GradScaler's
            ``found_inf``) advances it in the update, and the Optimizer puts it back once
            the verdict is on the host (``step/skipped_host``): a skipped step is not counted.
        legacy: for a field added after transformation states could be saved without it
            (it then comes after every older field): its value in such a state, from
            the old state's fields by name (``legacy(old) -> tuple``), so that a state
            pickled by an older version loads.
    """

    name: str
    doc: str
    used: Callable[[Mapping[str, Any]], bool] = lambda group: True
    init: Callable[[Tensor, Mapping[str, Any]], Tensor] | None = None
    own_dtype: bool = False
    host: bool = False
    legacy: Callable[[Mapping[str, Any]], tuple[Any, ...]] | None = None


#: names the front ends keep beside a sampler's state: the transformation's ``seed`` and
#: ``count``, the noise key (``docs/design.md``), the rate of a momentum buffer. (The
#: chain's step counter lives in the param groups, so a per-parameter ``"step"``, as
#: AdamW keeps, is a sampler's own.)
RESERVED_STATE = frozenset({"seed", "count", NOISE_KEY, MOMENTUM_RATE})


class UpdateInput(NamedTuple):
    """What a sampler's pure update reads: one param group's tensors at one step.

    Attributes:
        params: the parameters with a gradient (read only, for weight decay).
        grads: their gradients (never modified).
        buffers: each state field the group keeps, one value per parameter (None where
            the update creates it: ``StateField.init`` is None).
        noise: one standard-normal tensor per parameter, None exactly at temperature 0.
    """

    params: list[Tensor]
    grads: list[Tensor]
    buffers: Mapping[str, list[Any]]
    noise: list[Tensor] | None


#: what an update returns: one direction ``d`` per parameter (the step is
#: ``theta <- theta - lr * d``) and the new buffers by field
UpdateOutput = tuple[list[Tensor], Mapping[str, list[Any]]]

#: ``update(group, inputs, *, foreach, inplace) -> (directions, new_buffers)``: the pure
#: update of one param group (:class:`UpdateInput`). ``group`` holds the hyperparameters,
#: ``lr`` and ``temperature`` as floats at this step, and ``initial_state`` (True at a
#: transformation's first update, whose buffers are the zeros that stand for the
#: buffers an update creates). With ``inplace`` the update may write into the given
#: buffers (the Optimizer's); without, it leaves every input unchanged.
Update = Callable[..., UpdateOutput]


@dataclass(frozen=True)
class SamplerDefinition:
    """Everything that defines one sampler; the front ends are built from it.

    Attributes:
        name: the Optimizer class's name (``"SGHMC"``).
        transform_name: the transformation's name (``"sghmc"``).
        hyperparameters: the public signature's arguments in order, shared ones included
            (``params`` and the Optimizer-only runtime options come from the front end).
        state: the per-parameter buffers, in the order of the transformation's state.
        update: the pure update (:data:`Update`).
        check: the rules that join hyperparameters, ``check(group, temperature, where)``,
            run after every hyperparameter's own check.
        optimizer_doc: the Optimizer class's docstring, with ``{arguments}`` where its
            ``Args`` section goes and ``{example}`` where its ``Example`` section goes.
        transform_doc: the transformation's, with ``{arguments}`` (``Args`` and
            ``Returns``) and ``{example}`` (unless it writes its own).
        example: the hyperparameters of both examples (``"lr=1e-3, momentum=0.9"``).
        momentum_in_lr_units: the state holds a momentum buffer in SGD units, which a
            change of ``lr`` at temperature > 0 re-expresses (``docs/design.md``).
        momentum_buffer: the name of that buffer (``"exp_avg"`` for AdamW's units).
        requires_positive_temperature: the sampler has no temperature-0 limit.
        positive_temperature_reason: why, for the error message.
        zero_temperature_fault: what goes wrong at temperature 0, for a schedule's
            message (``CyclicalSGMCMC``).
        chunked_kernel: the update is elementwise, so it may run on chunks of a tensor.
        supports_dtensor: the update runs on DTensor (FSDP2) shards; else why not in
            ``dtensor_unsupported_reason``.
        check_parameters: checks a param group's parameters at every step, before any
            group changes, ``check_parameters(group, params, where)`` (PSGLD: the
            dtypes its ``eps`` and noise scale must fit).
        zero_temperature_step: for a sampler that is its optimizer at temperature 0 only
            through that optimizer's own last operation (PSGLD: RMSprop's ``addcdiv_``),
            ``zero_temperature_step(group, inputs, *, foreach)`` takes the Optimizer's
            step itself (parameters and buffers in place) and returns True, or returns
            False where it does not apply.
        temperature_rule: what the sampler means by its temperature
            (:class:`~.temperature_rule.TemperatureRule`, built in its module): how
            ``sgmcmc/temperature/estimates`` reads the kinetic temperature from a group's
            state (which buffer, its mass and discrete factor) and the prior in the
            configurational one (coupled decay, or a decoupled decay's scale). None: no
            temperature diagnostics (refused by ``temperature_estimates``).
    """

    name: str
    transform_name: str
    hyperparameters: tuple[Hyperparameter, ...]
    state: tuple[StateField, ...]
    update: Update
    check: Callable[[Mapping[str, Any], float, str], None]
    optimizer_doc: str
    transform_doc: str
    example: str = "lr=1e-3"
    momentum_in_lr_units: bool = False
    momentum_buffer: str = "momentum_buffer"
    requires_positive_temperature: bool = False
    positive_temperature_reason: str = ""
    zero_temperature_fault: str = ""
    chunked_kernel: bool = True
    supports_dtensor: bool = True
    dtensor_unsupported_reason: str = ""
    check_parameters: Callable[[Mapping[str, Any], list[Tensor], str], None] | None = None
    zero_temperature_step: Callable[..., bool] | None = None
    temperature_rule: TemperatureRule | None = None

    def __post_init__(self) -> None:
        names = [h.name for h in self.hyperparameters]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated or "params" in names:
            raise ValueError(
                f"Invalid hyperparameters of {self.name}: {repeated or ['params']} (expected "
                "unique names other than 'params')"
            )
        fields = [state.name for state in self.state]
        taken = sorted(
            {name for name in fields if fields.count(name) > 1 or name in RESERVED_STATE}
        )
        if taken:
            raise ValueError(
                f"Invalid state of {self.name}: {taken} (expected unique names other than "
                f"{sorted(RESERVED_STATE)}, which the front ends keep)"
            )

    def state_fields(self, group: Mapping[str, Any]) -> tuple[str, ...]:
        """The buffers a param group with these hyperparameters keeps, in order."""
        return tuple(state.name for state in self.state if state.used(group))

    def check_hyperparameters(
        self, group: Mapping[str, Any], temperature: float, where: str
    ) -> None:
        """Each declared hyperparameter's own check, then the rules that join them."""
        for hyperparameter in self.hyperparameters:
            if hyperparameter.check is not None and hyperparameter.name in group:
                hyperparameter.check(group[hyperparameter.name], where)
        self.check(group, temperature, where)

    def transform_hyperparameters(self) -> tuple[Hyperparameter, ...]:
        """The hyperparameters the transformation takes, in the declared order."""
        return tuple(h for h in self.hyperparameters if h.transform)


def arguments_doc(entries: Sequence[str], returns: str | None = None) -> str:
    """A docstring's ``Args`` section (then ``Returns``), for a class's indentation."""
    section = "Args:\n        " + "\n        ".join(entries)
    return section if returns is None else f"{section}\n\n    Returns:\n        {returns}"


def example_doc(name: str, arguments: str) -> str:
    """The ``Example`` section of a sampler class: a small model and one step."""
    return f"""Example:
        >>> import torch
        >>> from samplers_as_optim import {name}
        >>> model = torch.nn.Linear(3, 1)
        >>> opt = {name}(model.parameters(), {arguments}, num_data=1000, seed=0)
        >>> loss = model(torch.randn(8, 3)).pow(2).mean()
        >>> loss.backward()
        >>> opt.step()"""


def transform_example_doc(name: str, arguments: str) -> str:
    """The ``Example`` section of a transformation: one update of a leaf from zeros."""
    return f"""Example:
        >>> import torch, torchopt
        >>> from samplers_as_optim import transforms
        >>> params = {{"w": torch.zeros(3)}}
        >>> tx = transforms.{name}({arguments}, num_data=1000, seed=0)
        >>> state = tx.init(params)
        >>> updates, state = tx.update({{"w": torch.ones(3)}}, state, params=params)
        >>> params = torchopt.apply_updates(params, updates)
        >>> state.count
        1"""


def generated_function(
    name: str,
    parameters: Sequence[tuple[str, Any, str, bool]],
    body: Callable[..., Any],
    *,
    returns: str,
    module: str,
    qualname: str | None = None,
    doc: str | None = None,
    method: bool = False,
) -> Callable[..., Any]:
    """A function with a real signature that passes its arguments to ``body`` as a dict.

    ``parameters`` are ``(name, default, annotation, positional)`` in order (``default``
    :data:`REQUIRED` for none); the function is ``def name(p1, p2=..., *, k1, k2=...)``
    calling ``body(arguments)`` (``body(self, arguments)`` for a ``method``), written as
    source and compiled as ``dataclasses`` writes ``__init__``, so that Python itself
    binds and reports the arguments (``missing 1 required keyword-only argument:
    'num_data'``) and ``inspect.signature`` shows them.
    """
    defaults: dict[str, Any] = {}
    pieces = ["self"] if method else []
    star = False
    names = []
    for parameter, default, _, positional in parameters:
        if not parameter.isidentifier() or keyword.iskeyword(parameter):
            raise ValueError(f"Invalid parameter name: {parameter!r}")
        if not positional and not star:
            pieces.append("*")
            star = True
        if positional and star:
            raise ValueError(f"positional parameter {parameter!r} after a keyword-only one")
        if default is REQUIRED:
            pieces.append(parameter)
        else:
            defaults[parameter] = default
            pieces.append(f"{parameter}=__defaults[{parameter!r}]")
        names.append(parameter)
    arguments = "{" + ", ".join(f"{n!r}: {n}" for n in names) + "}"
    call = f"__body(self, {arguments})" if method else f"__body({arguments})"
    source = (
        f"def __make(__body, __defaults):\n"
        f"    def {name}({', '.join(pieces)}):\n"
        f"        return {call}\n"
        f"    return {name}\n"
    )
    namespace: dict[str, Any] = {}
    exec(compile(source, f"<{module}.{qualname or name}>", "exec"), namespace)
    function: Callable[..., Any] = namespace["__make"](body, defaults)
    annotations = {parameter: annotation for parameter, _, annotation, _ in parameters}
    function.__annotations__ = {**annotations, "return": returns}
    function.__module__ = module
    function.__qualname__ = qualname or name
    function.__doc__ = doc
    return function
