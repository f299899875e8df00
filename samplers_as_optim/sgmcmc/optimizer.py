"""The ``torch.optim`` front end of the SG-MCMC samplers, built from their definitions.

A sampler class is ``class SGHMC(SamplerOptimizer, definition=DEFINITION)``: its
constructor (with the declared signature), its documentation and its hooks come from the
:class:`~.definition.SamplerDefinition`. This base class owns the step every sampler
takes, the pipeline of ``docs/design.md`` ("The step"): the plan and its validation
(``step/plan``: a schedule may move any hyperparameter; the capturable step's counter),
the guard (``step/guard``: the non-finite policy, ``torch.amp.GradScaler``'s verdict,
what a skipped step puts back on the host), the state made ready (``step/ready``: the lr
re-expression, float32 masters), the noise (``step/group_noise``), the update by one of
two backends (``step/reference``: torch ops, chunked on the CPU; the fused one, one Triton
kernel per tensor, ``fused/backend``, which registers itself with ``step/backends``), and
loading checkpoints (``step/checkpoint``).

The chain itself (the seed and step counter in the param groups, the noise streams, each
parameter's noise key, derived once and kept in its state as ``state["noise_key"]``) is
:class:`~samplers_as_optim.core.chain.ChainOptimizer`'s, which HMC shares (see
``samplers_as_optim.core.chain``). The SG-MCMC samplers draw a parameter's noise, and so
store its key, from its first step at a positive temperature on: a parameter that has
not drawn noise yet (frozen, which has no state as in torch.optim, or only stepped at
temperature 0, whose state stays ``torch.optim.SGD``'s) holds none.

Every per-parameter entry is a tensor, as ``torch.optim`` keeps them (its generic tests
compare states through ``.detach()``); numbers kept there (the keys, the learning rate a
momentum buffer was written at) are 0-d CPU tensors in their own dtype, restored as saved
by ``load_state_dict``, whereas torch casts the rest to the parameter's dtype. Checkpoints
that hold such a number as a float are migrated on load.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from ..core.chain import ChainOptimizer, check_representable
from ..core.chain import at_group as at_group  # re-exported: the samplers' modules use it
from ..core.distributed import agree_across_ranks
from ..core.dtensor import is_dtensor
from ..core.noise_op import COMPILED_DRAW
from ..core.streams import seed_from_global_rng
from ..core.validation import (
    check_bool,
    check_choice,
    check_foreach,
    check_learning_rate,
    check_nonnegative,
    check_num_data,
    check_open_unit_interval,
    check_seed,
    check_temperature,
)
from .definition import REQUIRED, SamplerDefinition, arguments_doc, example_doc, generated_function
from .definition.arguments import NONFINITE_POLICIES, PARAMS_DOC, check_differentiable
from .step.backends import check_fused, fused_backend
from .step.checkpoint import (
    MOMENTUM_RATE,
    check_saved_masters,
    counters_copied,
    migrate_momentum_rates,
    refuse_non_finite_state,
    restore_own_dtype_state,
    saved_groups_with_chain_state,
    warn_if_keyed_otherwise,
)
from .step.grad_scaler import scaler_input
from .step.group_noise import next_noise_requests
from .step.guard import raise_deferred_refusal, verdict
from .step.half_precision import MasterSync
from .step.nonfinite import describe_parameter
from .step.plan import (
    GroupPlan,
    StepRates,
    capturable_option,
    check_capturable,
    place_step_counter,
    planned,
)
from .step.prefetch import NoisePrefetcher
from .step.ready import reexpress_state
from .step.reference import update_group
from .step.skipped_host import put_back_if_skipped, settle_skipped
from .temperature.estimates import ChainTemperatureReport, temperature_reports
from .tensor_lists import HostScalars

__all__ = ["SamplerOptimizer"]


class SamplerOptimizer(ChainOptimizer):
    """Base class of the SG-MCMC optimizers, built from a sampler's definition.

    A sampler is declared once, as a :class:`~.definition.SamplerDefinition`
    (hyperparameters, state, pure update); its class is ``class SGHMC(SamplerOptimizer,
    definition=DEFINITION)``, whose ``__init__`` (with the declared signature) and
    ``Args`` documentation are generated here. This class owns the step every sampler
    takes (the module docstring), ``torch.amp.GradScaler``'s protocol
    (``_step_supports_amp_scaling``) and the chain.
    """

    #: the sampler this class is built from (set by ``__init_subclass__``)
    definition: SamplerDefinition
    #: ``torch.amp.GradScaler.step`` hands over ``grad_scale`` and ``found_inf`` instead
    #: of unscaling and synchronising (``step/grad_scaler``)
    _step_supports_amp_scaling = True
    requires_positive_temperature: bool = False
    #: the state holds a momentum buffer in SGD units, re-expressed when lr changes
    momentum_in_lr_units: bool = False
    #: arguments of ``torch.optim.SGD``'s signature validated at construction but not
    #: kept in the param groups (SGLD's ``momentum``, which must be 0)
    signature_only_arguments: tuple[str, ...] = ()
    positive_temperature_reason: str = ""
    #: what goes wrong at temperature 0, in a schedule's message (CyclicalSGMCMC)
    zero_temperature_fault: str = ""
    #: per-parameter state kept in its own dtype on load (torch casts to the param's dtype)
    own_dtype_state: tuple[str, ...] = ()
    #: per-parameter numbers read in Python, kept as 0-d CPU tensors (``StateField.host``)
    host_state: tuple[str, ...] = ()

    def __init_subclass__(cls, definition: SamplerDefinition | None = None, **kwargs: Any):
        """Build a sampler's class from its definition: signature, docs, hooks' data."""
        super().__init_subclass__(**kwargs)
        if definition is None:
            return
        cls.definition = definition
        cls.requires_positive_temperature = definition.requires_positive_temperature
        cls.positive_temperature_reason = definition.positive_temperature_reason
        cls.zero_temperature_fault = definition.zero_temperature_fault
        cls.momentum_in_lr_units = definition.momentum_in_lr_units
        cls.chunked_kernel = definition.chunked_kernel
        cls.supports_dtensor = definition.supports_dtensor
        cls.dtensor_unsupported_reason = definition.dtensor_unsupported_reason
        cls.own_dtype_state = tuple(state.name for state in definition.state if state.own_dtype)
        cls.host_state = tuple(state.name for state in definition.state if state.host)
        cls.signature_only_arguments = tuple(
            h.name for h in definition.hyperparameters if not h.kept
        )
        parameters = [("params", REQUIRED, "Any", True)] + [
            (h.name, h.default, h.annotation, h.positional) for h in definition.hyperparameters
        ]
        entries = [PARAMS_DOC, *(h.doc for h in definition.hyperparameters)]
        cls.__doc__ = definition.optimizer_doc.format(
            arguments=arguments_doc(entries),
            example=example_doc(definition.name, definition.example),
        )
        cls.__init__ = generated_function(  # type: ignore[method-assign]
            "__init__",
            parameters,
            SamplerOptimizer._build,
            returns="None",
            module=cls.__module__,
            qualname=f"{cls.__qualname__}.__init__",
            method=True,
        )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Replaced in every sampler class by one with the sampler's signature."""
        raise TypeError(
            f"{type(self).__name__} has no sampler definition (expected a class declared "
            "as class Name(SamplerOptimizer, definition=...))"
        )

    def _build(self, arguments: dict[str, Any]) -> None:
        """Build from the public constructor's arguments.

        Everything but ``params`` and the runtime options (``differentiable``, ``fused``,
        ``overlap_noise``, ``nonfinite``) becomes a param-group default, validated before
        anything is built; ``seed`` (drawn from torch's global RNG when None) and
        ``step`` (0) start the chain's random state. With ``fused=True``, what can be
        known of the fused path before a step (the sampler's kernel, Triton, the
        parameters' devices, dtypes and layout) is checked once the groups are built.
        """
        defaults = dict(arguments)
        params = defaults.pop("params")
        seed = check_seed(defaults.pop("seed"))
        self._overlap_noise = check_bool("overlap_noise", defaults.pop("overlap_noise"))
        self._nonfinite = check_choice(
            "nonfinite", defaults.pop("nonfinite", "raise"), NONFINITE_POLICIES
        )
        check_differentiable(defaults.pop("differentiable", False))
        self._fused = check_fused(defaults.pop("fused", None))
        self._capturable = capturable_option(defaults, type(self).__name__, self.host_state)
        self.check_hyperparameters(defaults, where="")
        for name in self.signature_only_arguments:
            del defaults[name]
        defaults["seed"] = seed_from_global_rng() if seed is None else seed
        defaults["step"] = 0
        self._reset_runtime(seed_given=seed is not None)
        Optimizer.__init__(self, params, defaults)
        for index, group in enumerate(self.param_groups if self._capturable else ()):
            where = at_group(index)
            check_capturable(group, nonfinite=self._nonfinite, fused=self._fused, where=where)
        if self._fused:
            groups = [(i, g, list(g["params"]), None) for i, g in enumerate(self.param_groups)]
            fused_backend().check_construction(self.definition, groups)

    def _reset_runtime(self, *, seed_given: bool) -> None:
        """Create what is not part of the chain's state: generator caches, rank agreement.

        What the step itself updates lives in dicts (``_keys``, ``_runtime``), never in
        attributes assigned during the step: TorchDynamo traces dict mutations of an
        optimizer, not (in every torch version) attribute assignments.
        """
        self._reset_chain_runtime()  # the noise streams and keys, the shard
        #: the values of the 0-d rate tensors in the state (see ``HostScalars``)
        self._host_scalars = HostScalars()
        #: what each half-precision parameter held after its last step (``step/half_precision``)
        self._master_sync = MasterSync()
        self._prefetcher = NoisePrefetcher() if self._overlap_noise else None
        self._seed_given = seed_given
        self._runtime["agreed"] = False
        #: each param group's plan, by ``id(group)`` (``step/plan``): dropped with the rest
        self._runtime["plans"] = {}

    def __getstate__(self) -> dict[str, Any]:
        """``torch.optim.Optimizer``'s state (the whole chain) plus the runtime options.

        A skipped step's host record waiting for its verdict is put back first.
        """
        settle_skipped(self._runtime)
        return {
            **super().__getstate__(),
            "_overlap_noise": self._overlap_noise,
            "_nonfinite": self._nonfinite,
            "_fused": self._fused,
            "_capturable": self._capturable,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore a pickled or deep-copied optimizer: the same chain continues.

        ``torch.optim.Optimizer.__getstate__`` keeps ``defaults``, ``state`` and
        ``param_groups``, which hold the whole chain (the seeds and step counters are in
        the param groups); the generator caches are rebuilt here. torch's
        ``load_state_dict`` installs a loaded state through this method too, with
        ``state`` and ``param_groups`` only: the runtime options stay as they are.
        """
        state.setdefault("_overlap_noise", getattr(self, "_overlap_noise", True))
        state.setdefault("_nonfinite", getattr(self, "_nonfinite", "raise"))
        state.setdefault("_fused", getattr(self, "_fused", None))
        state.setdefault("_capturable", getattr(self, "_capturable", False))
        super().__setstate__(state)
        self._migrate_host_state()
        self._reset_runtime(seed_given=True)

    # ------------------------------------------------------------------ validation
    @classmethod
    def check_hyperparameters(cls, group: dict[str, Any], *, where: str = "") -> None:
        """Validate one param group's hyperparameters (also used by the transforms).

        Raises the same ``ValueError``/``TypeError`` messages for every front end;
        ``where`` locates the group (``" in param group 1"``).
        """
        check_learning_rate(group["lr"], where=where)
        check_nonnegative("weight_decay", group["weight_decay"], where=where)
        temperature = check_temperature(
            group["temperature"],
            where=where,
            positive=cls.requires_positive_temperature,
            reason=cls.positive_temperature_reason,
        )
        check_num_data(group["num_data"], where=where)
        check_bool("maximize", group["maximize"], where=where)
        check_foreach(group["foreach"], where=where)
        cls.definition.check_hyperparameters(group, temperature, where)

    # ------------------------------------------------------------------ step
    def _gather(
        self, group: dict[str, Any], index: int, plan: GroupPlan | None = None
    ) -> tuple[list[Tensor], list[Tensor]]:
        """The parameters with a gradient, and their gradients, refused if unfit (by the plan)."""
        params = [param for param in group["params"] if param.grad is not None]
        grads = [param.grad for param in params]
        layout = None if plan is None else plan.layout(params)
        if layout is None:
            complex_, dtensor = any(p.is_complex() for p in params), any(map(is_dtensor, params))
        else:
            complex_, dtensor = layout.complex, layout.dtensor
        unfit = complex_ or (dtensor and not self.supports_dtensor)
        if unfit or any(grad.is_sparse or grad.is_complex() for grad in grads):
            self._refuse_parameters(group, index)
        if self.definition.check_parameters is not None:
            self.definition.check_parameters(group, params, at_group(index))
        return params, grads

    def _refuse_parameters(self, group: dict[str, Any], index: int) -> None:
        """Raise for the first parameter the step cannot take, naming it."""
        for position, param in enumerate(group["params"]):
            grad = param.grad
            if grad is None:
                continue
            if grad.is_sparse:
                raise TypeError(
                    f"{type(self).__name__} does not support sparse gradients "
                    f"({describe_parameter(group, index, position)}); use a dense embedding "
                    "(sparse=False) or torch.optim.SparseAdam for that parameter"
                )
            if param.is_complex() or grad.is_complex():
                raise TypeError(
                    f"{type(self).__name__} does not support complex parameters "
                    f"({describe_parameter(group, index, position)}); view them as real with "
                    "torch.view_as_real"
                )
            if is_dtensor(param) and not self.supports_dtensor:
                raise NotImplementedError(
                    f"{type(self).__name__} does not support DTensor (FSDP2) parameters yet "
                    f"({describe_parameter(group, index, position)}): "
                    f"{self.dtensor_unsupported_reason}; use SGHMC or SGLD"
                )

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Take one sampler step (one Markov-chain transition) for every param group.

        Args:
            closure: optional callable that re-evaluates the model and returns the loss,
                as for any ``torch.optim`` optimizer.

        Returns:
            The closure's loss, or None.

        Raises:
            FloatingPointError: a gradient holds NaN or infinity; nothing was changed
                (with ``nonfinite="raise"``, the default). A fused step checks on the
                device, without a host synchronisation: its refusal is raised by the
                next ``step()`` (before the closure runs) or ``state_dict()``, which
                changes nothing either, and names the refused step. Never under a
                ``GradScaler`` (below).
            ValueError: a param group holds an invalid hyperparameter (a schedule may
                have moved it), or ``fused=True`` and the fused step cannot run (a
                parameter moved off CUDA, say); nothing was changed.
            TypeError: ``grad_scale`` or ``found_inf`` is set but is not a 1-element
                floating tensor; nothing was changed.

        ``torch.amp.GradScaler``: ``scaler.step(opt)`` sets ``opt.grad_scale`` and
        ``opt.found_inf`` (``_step_supports_amp_scaling``) and calls this without
        unscaling or synchronising (``sgmcmc/step/grad_scaler``). The update then reads each
        gradient as ``g / grad_scale`` in float32 or wider; ``.grad`` is left as it is
        (scaled), unlike after ``scaler.unscale_``. ``found_inf > 0`` makes the step a
        no-op decided on the device (unfused: ``torch.where`` against the old values;
        fused: the kernels' flag), with no ``FloatingPointError`` whatever
        ``nonfinite`` says; as with ``nonfinite="skip"`` the step counter advances, 1 is
        added to ``param_group["skipped_steps"]`` and host counts are put back
        (``step/skipped_host``).

        float16/bfloat16 parameters: from a parameter's first step at T > 0 on, the
        update runs on its float32 master ``state["master_param"]`` with float32
        buffers, and the parameter takes its rounding to nearest
        (``sgmcmc/step/half_precision``, which says what wins when the parameter was
        assigned from outside); at T = 0 a parameter without master steps as
        ``torch.optim.SGD`` does, in its own dtype.

        Under ``torch.compile`` the step is one graph (the noise draw is one custom op,
        ``samplers_as_optim.core.noise_op``) when built with ``nonfinite="skip"`` (but
        PSGLD's and AdamWSGHMC's, which read host counts); with ``"raise"`` the check
        of the gradients reads a value back to Python, which splits the graph there.
        (The fused step is not traced: ``fused=None`` takes the unfused step there.)
        With ``capturable=True`` (and ``"skip"``) a step reads nothing back and keeps
        no Python value that changes per step: ``torch.cuda.graph`` captures it
        (``docs/design.md``, "A capturable step").
        """
        loss = None
        scaler = scaler_input(self)  # set by torch.amp.GradScaler.step, checked first
        raise_deferred_refusal(self)
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        compiling = torch.compiler.is_compiling()
        if not self._runtime["agreed"]:
            self._agree_across_ranks()
        gathered, rates = self._plan(compiling)
        fused = None if self._fused is False else fused_backend()
        if fused is not None and fused.takes_step(self, gathered, compiling=compiling):
            fused.step(self, gathered, rates, scaler)
            self._advance()
        else:
            self._reference_step(gathered, rates, scaler, compiling=compiling)
        return loss

    def _advance(self) -> None:
        """The chain's step counter, in every group: the next step's noise is the next."""
        for group in self.param_groups:
            group["step"] += 1

    def _reference_step(
        self, gathered: list[Any], rates: list[StepRates], scaler: Any, *, compiling: bool
    ) -> None:
        """Every group's step by the reference backend (``step/reference``), guarded.

        Then the counters advance, a skipped step's host record is put back
        (``step/skipped_host``) and the next step's large draws go to the worker
        (``step/prefetch``).
        """
        layout = rates[0].layout if len(rates) == 1 else None
        keep, record = verdict(self, gathered, scaler, None if layout is None else layout.buckets)
        prefetcher = None if compiling else self._prefetcher
        if prefetcher is not None:
            prefetcher.wait()
        for (_, group, params, grads), planned_rates in zip(gathered, rates, strict=True):
            lr, temperature = planned_rates.lr, planned_rates.temperature
            if not params or (temperature > 0 and lr == 0):
                continue  # (a step of length zero: no time passes, nothing changes)
            update_group(
                self, group, params, grads, planned_rates, keep=keep, grad_scale=scaler.grad_scale
            )
            if temperature > 0:  # the keys the noise was drawn with (module docstring)
                self._record_noise_keys(params, None if record else planned_rates.scratch)
        self._advance()
        put_back_if_skipped(self._runtime, record, keep)  # (off the CPU: by the next call)
        if prefetcher is not None:
            prefetcher.submit(next_noise_requests(self))

    def _plan(self, compiling: bool) -> tuple[list[Any], list[StepRates]]:
        """Each group's plan (``step/plan``), its parameters with a gradient, lr and T.

        A group is validated when it is planned, and re-planned when anything its plan
        holds has changed; traced by ``torch.compile`` it is validated at every step
        (and its chain state on the way in: reading it would specialise the graph).
        """
        gathered, rates = [], []
        plans: dict[int, GroupPlan] = self._runtime["plans"]
        for index, group in enumerate(self.param_groups):
            if compiling:
                params, grads = self._gather(group, index)
                self.check_hyperparameters(group, where=at_group(index))
                check_representable(group, params, where=at_group(index))
                if self._capturable:  # (a traced int may pass for a tensor)
                    place_step_counter(group, capturable=True)
                fields = self.definition.state_fields(group)
                rates.append(StepRates(float(group["lr"]), float(group["temperature"]), fields, {}))
            else:
                check = partial(self._check_group, index=index)
                plan = planned(plans, group, check, self.definition.state_fields)
                params, grads = self._gather(group, index, plan)
                plan.check_dtypes(group, params, partial(at_group, index))
                rates.append(plan.rates())
            gathered.append((index, group, params, grads))
        return gathered, rates

    def _check_group(self, group: dict[str, Any], *, index: int) -> None:
        """Validate a group's hyperparameters and chain state; place a capturable counter."""
        where = at_group(index)
        self.check_hyperparameters(group, where=where)
        if self._capturable:
            check_capturable(group, nonfinite=self._nonfinite, fused=self._fused, where=where)
        self._check_chain_state(group, where=where, step_tensor=True)
        place_step_counter(group, capturable=self._capturable)

    def temperature_estimates(self, *, level: float = 0.999) -> list[ChainTemperatureReport]:
        r"""The chain's kinetic and configurational temperatures, now, with their bands.

        One :class:`~.chain_temperature.ChainTemperatureReport` per param group (per
        member of a ``ParallelEnsemble``'s stacked group), from this one state:
        :math:`T_{\text{kin}}` from the momentum buffers and :math:`T_{\text{conf}} =
        \tfrac1d\sum_i \theta_i\,\partial_i U` from the parameters and their ``.grad``
        as they are now, so call it after ``backward()`` and before ``step()`` (the
        gradient must be the one at these parameters). Each estimate carries its band
        under the target at ``level`` and ``hot``/``cold`` flags; formulas, units and
        bands in ``sgmcmc/temperature/estimates``. It reads to the host (once per group); to
        follow a chain every step without synchronising, use
        :class:`samplers_as_optim.diagnostics.TemperatureMonitor`.

        Args:
            level: the bands' two-sided probability under the target (default 0.999).

        Raises:
            ValueError: ``level`` is not in (0, 1), the sampler declares no
                ``temperature/rule``, or a param group mixes stacked members.
        """
        check_open_unit_interval("level", level)
        settle_skipped(self._runtime)  # (a skipped step's frozen preconditioner goes)
        rule = self.definition.temperature_rule
        if rule is None:
            raise ValueError(
                f"Invalid optimizer: {type(self).__name__} (expected a sampler whose "
                "definition declares a temperature_rule)"
            )
        return temperature_reports(rule, self.param_groups, self.state, level)

    def _agree_across_ranks(self) -> None:
        """Under ``torch.distributed``, agree on the seeds once (see ``_distributed``)."""
        self._noise_keys([])  # whether every parameter has a name
        agreement = agree_across_ranks(
            [group["seed"] for group in self.param_groups],
            [int(group["step"]) for group in self.param_groups],
            [[tuple(p.shape) for p in group["params"]] for group in self.param_groups],
            given=self._seed_given,
            named=self._runtime["all_named"],
        )
        for group, seed in zip(self.param_groups, agreement.seeds, strict=True):
            group["seed"] = seed
        self._runtime.update(shard=agreement.shard, agreed=True)

    # ------------------------------------------------------------------ the fused step

    # What a sampler supplies.
    #: whether the kernel is elementwise, so that it may run on chunks of a tensor
    chunked_kernel: bool = True
    #: whether the kernel runs on DTensor parameters (FSDP2's fully_shard), and why not
    supports_dtensor: bool = True
    dtensor_unsupported_reason: str = ""

    def reexpress_state(self, group: dict[str, Any], *, lr: float) -> None:
        """Re-express ``group``'s recorded lr-dependent state at ``lr``, keeping the chain.

        What a schedule that jumps ``lr`` while the temperature goes to 0 needs
        (``CyclicalSGMCMC``'s restarts): a sampler at temperature 0 treats its buffers as
        SGD's and would not rescale them itself. Only state recorded at temperature > 0
        (a momentum buffer with its rate) is re-expressed, as the sampler's own step at
        temperature > 0 would (``docs/design.md``); a sampler without such state does
        nothing.
        """
        params = [p for p in group["params"] if self.state[p].get(MOMENTUM_RATE) is not None]
        states = [self.state[p] for p in params]
        reexpress_state(self, params, states, lr=lr, temperature=1.0, foreach=False)

    def _migrate_host_state(self) -> None:
        """A rate kept as a float (or None) by an earlier version becomes a tensor (or none)."""
        migrate_momentum_rates(self.state.values())

    def _prime_runtime(self) -> None:
        """Read the stored keys and rates now, so that the next step reads no tensor back.

        (Under ``torch.compile`` a value read back from a tensor breaks the graph.)
        """
        self._noise_keys([])
        for group in self.param_groups:
            for param in group["params"]:
                state = self.state.get(param)
                if state and MOMENTUM_RATE in state:
                    self._host_scalars.value(param, state[MOMENTUM_RATE])

    def state_dict(self) -> dict[str, Any]:
        """``torch.optim.Optimizer.state_dict``, once a refused fused step is raised.

        With ``nonfinite="raise"``, a fused step whose gradients were not finite is
        refused here if no ``step()`` has raised it yet, so that no checkpoint counts it
        as taken. The groups' counters are copies (a capturable step's advance in place).
        """
        raise_deferred_refusal(self)
        return counters_copied(super().state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state saved by a sampler (or a wrapper of one), or by ``torch.optim.SGD``.

        A sampler's ``state_dict()`` holds the chain's random state in its param groups
        (``"seed"`` and ``"step"``) and each parameter's noise key in its state, so
        loading it continues the chain bit for bit, whether this optimizer names its
        parameters as the saved one did or not; so does the consolidated
        ``state_dict()`` of a ``ZeroRedundancyOptimizer`` over a sampler. A state
        without keys (written before they were stored) keys the noise by this
        optimizer's names or positions, and warns where that is not what the saved one
        did (names now, none then). A genuine ``torch.optim.SGD`` checkpoint (no
        ``num_data`` or ``temperature`` in its groups) loads too: its groups keep this
        optimizer's ``num_data``, ``temperature``, seed and step counter. Everything is
        checked before anything changes.

        Raises:
            ValueError: the groups hold sampler hyperparameters but no chain state (a
                wrapper dropped it: loading would silently restart the noise), a saved
                value is invalid, or a saved buffer holds NaN or infinity.
        """
        state_dict = dict(state_dict)
        saved_groups = saved_groups_with_chain_state(
            state_dict,
            self._hold_chain_state([dict(g) for g in state_dict.get("param_groups", [])]),
        )
        saved_state = state_dict.get("state", {})
        refuse_non_finite_state(saved_state)
        check_saved_masters(self, saved_groups, saved_state)
        warn_if_keyed_otherwise(type(self).__name__, self.param_groups, saved_groups, saved_state)
        if len(saved_groups) == len(self.param_groups):
            saved_groups = [
                {**{k: v for k, v in current.items() if k != "params"}, **saved}
                for current, saved in zip(self.param_groups, saved_groups, strict=True)
            ]
            for index, group in enumerate(saved_groups):
                where = at_group(index)
                self.check_hyperparameters(group, where=where)
                self._check_chain_state(group, where=where, step_tensor=True)
        state_dict["param_groups"] = saved_groups
        super().load_state_dict(state_dict)
        restore_own_dtype_state(self, state_dict)
        self._reset_runtime(seed_given=True)
        self._prime_runtime()


if not COMPILED_DRAW:
    # torch < 2.13 cannot trace the step soundly (see ``_noise_op``; torch 2.11's dynamo
    # also fails on its comprehensions): under torch.compile the step then runs eagerly.
    SamplerOptimizer.step = torch.compiler.disable(  # type: ignore[method-assign,no-untyped-call]
        SamplerOptimizer.step
    )
