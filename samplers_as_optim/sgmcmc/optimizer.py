"""The ``torch.optim`` front end of the SG-MCMC samplers, built from their definitions.

A sampler class is ``class SGHMC(SamplerOptimizer, definition=DEFINITION)``: its
constructor (with the declared signature), its documentation and its hooks come from the
:class:`~.definition.SamplerDefinition`. This base class owns the step every sampler
takes: param-group validation (at construction, on ``add_param_group`` and at every
step, since a schedule may move any hyperparameter), gathering parameters with a
gradient, the non-finite policy (``_nonfinite``; what a skipped or refused step puts back
on the host, ``_skipped_host``), the lr re-expression of the state, the
noise (``_group_noise``, drawn ahead by ``_prefetch``), the CPU update in chunks
(``_chunked_update``), the fused step (``fused``: one Triton kernel per tensor, its
non-finite check on the device, ``_fused_nonfinite``), ``torch.amp.GradScaler``'s
``grad_scale``/``found_inf`` (``_grad_scaler``), the float32 master of a float16/bfloat16
parameter (``_half_precision``) and loading checkpoints (``_checkpoint``).

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
from ..names import parameter_layout
from ._checkpoint import (
    MOMENTUM_RATE,
    migrate_momentum_rates,
    refuse_non_finite_state,
    restore_momentum_rate,
    saved_groups_with_chain_state,
    warn_if_keyed_otherwise,
)
from ._chunked_update import chunkable, update_in_chunks
from ._common import (
    HostScalars,
    apply_step_,
    default_foreach,
)
from ._fused_launch import FusedInput
from ._fused_nonfinite import DeferredRefusal, check_gradients, count_skipped
from ._grad_scaler import ScalerInput, found_inf_flags, keep_flags, scaler_input, unscaled_grads
from ._group_noise import GroupNoise, large
from ._half_precision import (
    MASTER,
    MasterSync,
    check_saved_master,
    compute_tensors,
    is_half,
    restore_master_state_,
    store_masters_,
)
from ._nonfinite import describe_parameter, finite_flags, kept, refuse_non_finite_gradients
from ._prefetch import NoisePrefetcher, NoiseRequest
from ._skipped_host import (
    exact_step_unless_skipped,
    host_record,
    put_back_if_skipped,
    rescale_gate,
    settle_skipped,
)
from .arguments import PARAMS_DOC
from .chain_temperature import ChainTemperatureReport, temperature_reports
from .definition import (
    REQUIRED,
    SamplerDefinition,
    UpdateInput,
    arguments_doc,
    example_doc,
    generated_function,
)
from .fused import (
    DEFAULT_ON_CUDA,
    check_fused,
    fused_kernel,
    fused_message,
    fused_noise_seeds,
    fused_refusal,
    parameter_offset,
)
from .momentum_units import rescale_momentum_state

__all__ = ["SamplerOptimizer"]


#: what a step does with a non-finite gradient: refuse it (an error, after a host sync) or
#: skip it (a no-op, counted in ``group["skipped_steps"]``, without a sync)
NONFINITE_POLICIES = ("raise", "skip")


def check_differentiable(differentiable: Any) -> None:
    """Reject ``torch.optim.SGD``'s ``differentiable=True``: no sampler implements it."""
    if differentiable is not False:
        raise ValueError(
            f"Invalid differentiable: {differentiable!r} (expected False: differentiating "
            "through a sampler step is not supported)"
        )


class SamplerOptimizer(ChainOptimizer):
    """Base class of the SG-MCMC optimizers, built from a sampler's definition.

    A sampler is declared once, as a :class:`~.definition.SamplerDefinition`
    (hyperparameters, state, pure update); its class is ``class SGHMC(SamplerOptimizer,
    definition=DEFINITION)``, whose ``__init__`` (with the declared signature) and
    ``Args`` documentation are generated here, and whose hooks (``_state_fields``,
    ``_init_state``, ``_kernel``, the group checks) read the definition. This class owns
    the rest: param-group validation (at construction, on ``add_param_group`` and at every
    step, since a schedule may move any hyperparameter), gathering parameters with a
    gradient, the non-finite policy, the lr re-expression of the state, the fused step
    (``fused``, where the definition names a fused kernel), ``torch.amp.GradScaler``'s
    protocol (``_step_supports_amp_scaling``: the step unscales and skips itself,
    without a host synchronisation), the float32 master of a half-precision parameter,
    and the chain.
    """

    #: the sampler this class is built from (set by ``__init_subclass__``)
    definition: SamplerDefinition
    #: ``torch.amp.GradScaler.step`` hands over ``grad_scale`` and ``found_inf`` instead
    #: of unscaling and synchronising (``_grad_scaler``)
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
        self.check_hyperparameters(defaults, where="")
        for name in self.signature_only_arguments:
            del defaults[name]
        defaults["seed"] = seed_from_global_rng() if seed is None else seed
        defaults["step"] = 0
        self._reset_runtime(seed_given=seed is not None)
        Optimizer.__init__(self, params, defaults)
        if self._fused:
            groups = [(i, g, list(g["params"]), None) for i, g in enumerate(self.param_groups)]
            reason = fused_refusal(self.definition, groups)
            if reason is not None:
                raise ValueError(fused_message(reason))

    def _reset_runtime(self, *, seed_given: bool) -> None:
        """Create what is not part of the chain's state: generator caches, rank agreement.

        What the step itself updates lives in dicts (``_keys``, ``_runtime``), never in
        attributes assigned during the step: TorchDynamo traces dict mutations of an
        optimizer, not (in every torch version) attribute assignments.
        """
        self._reset_chain_runtime()  # the noise streams and keys, the shard
        #: the values of the 0-d rate tensors in the state (see ``HostScalars``)
        self._host_scalars = HostScalars()
        #: what each half-precision parameter held after its last step (``_half_precision``)
        self._master_sync = MasterSync()
        self._prefetcher = NoisePrefetcher() if self._overlap_noise else None
        self._seed_given = seed_given
        self._runtime["agreed"] = False

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
    def _gather(self, group: dict[str, Any], index: int) -> tuple[list[Tensor], list[Tensor]]:
        params, grads = [], []
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
            params.append(param)
            grads.append(grad)
        if self.definition.check_parameters is not None:
            self.definition.check_parameters(group, params, at_group(index))
        return params, grads

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
        unscaling or synchronising (``sgmcmc/_grad_scaler``). The update then reads each
        gradient as ``g / grad_scale`` in float32 or wider; ``.grad`` is left as it is
        (scaled), unlike after ``scaler.unscale_``. ``found_inf > 0`` makes the step a
        no-op decided on the device (unfused: ``torch.where`` against the old values;
        fused: the kernels' flag), with no ``FloatingPointError`` whatever
        ``nonfinite`` says; as with ``nonfinite="skip"`` the step counter advances, 1 is
        added to ``param_group["skipped_steps"]`` and host counts are put back (``_skipped_host``).

        float16/bfloat16 parameters: from a parameter's first step at T > 0 on, the
        update runs on its float32 master ``state["master_param"]`` with float32
        buffers, and the parameter takes its rounding to nearest
        (``sgmcmc/_half_precision``, which says what wins when the parameter was
        assigned from outside); at T = 0 a parameter without master steps as
        ``torch.optim.SGD`` does, in its own dtype.

        Under ``torch.compile`` the step is one graph (the noise draw is one custom op,
        ``samplers_as_optim.core.noise_op``) when built with ``nonfinite="skip"`` (but
        PSGLD's and AdamWSGHMC's, which read host counts); with
        ``"raise"`` the check of the gradients reads a value back to Python, which
        splits the graph there, exactly as in eager mode. (The fused step is not traced:
        ``fused=None`` takes the unfused step there.)
        """
        loss = None
        scaler = scaler_input(self)  # set by torch.amp.GradScaler.step, checked first
        self._raise_deferred_refusal()
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        compiling = torch.compiler.is_compiling()
        if not self._runtime["agreed"]:
            self._agree_across_ranks()
        gathered = []
        checked: dict[int, Any] = {} if compiling else self._runtime.setdefault("checked", {})
        for index, group in enumerate(self.param_groups):
            key = None if compiling else _hyperparameter_key(group)
            if key is None or checked.get(id(group)) != key:
                self.check_hyperparameters(group, where=at_group(index))
                if key is not None:  # (the checks read these values alone)
                    checked[id(group)] = key
            if not compiling:  # checked on the way in; reading it would specialise the graph
                self._check_chain_state(group, where=at_group(index))
            params, grads = self._gather(group, index)
            check_representable(group, params, where=at_group(index))
            gathered.append((index, group, params, grads))
        if self._takes_fused_step(gathered, compiling=compiling):
            self._fused_step(gathered, scaler)
            for group in self.param_groups:
                group["step"] += 1
            return loss
        keep, record = self._unfused_verdict(gathered, scaler)
        prefetcher = None if compiling else self._prefetcher
        if prefetcher is not None:
            prefetcher.wait()
        for _, group, params, grads in gathered:
            if not params:
                continue
            temperature = float(group["temperature"])
            lr = float(group["lr"])
            if temperature > 0 and lr == 0:
                continue  # a step of length zero: no time passes, nothing changes
            self._update_group(
                group,
                params,
                grads,
                lr=lr,
                temperature=temperature,
                keep=keep,
                grad_scale=scaler.grad_scale,
            )
            if temperature > 0:  # the keys the noise was drawn with (module docstring)
                self._record_noise_keys(params)
        for group in self.param_groups:
            group["step"] += 1
        put_back_if_skipped(self._runtime, record, keep)  # (off the CPU: by the next call)
        if prefetcher is not None:
            prefetcher.submit(self._next_noise_requests())
        return loss

    def temperature_estimates(self, *, level: float = 0.999) -> list[ChainTemperatureReport]:
        r"""The chain's kinetic and configurational temperatures, now, with their bands.

        One :class:`~.chain_temperature.ChainTemperatureReport` per param group (per
        member of a ``ParallelEnsemble``'s stacked group), from this one state:
        :math:`T_{\text{kin}}` from the momentum buffers and :math:`T_{\text{conf}} =
        \tfrac1d\sum_i \theta_i\,\partial_i U` from the parameters and their ``.grad``
        as they are now, so call it after ``backward()`` and before ``step()`` (the
        gradient must be the one at these parameters). Each estimate carries its band
        under the target at ``level`` and ``hot``/``cold`` flags; formulas, units and
        bands in ``sgmcmc/chain_temperature``. It reads to the host (once per group); to
        follow a chain every step without synchronising, use
        :class:`samplers_as_optim.diagnostics.TemperatureMonitor`.

        Args:
            level: the bands' two-sided probability under the target (default 0.999).

        Raises:
            ValueError: ``level`` is not in (0, 1), the sampler declares no
                ``temperature_rule``, or a param group mixes stacked members.
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

    def _next_noise_requests(self) -> list[NoiseRequest]:
        """The next step's draws to prefetch: large CPU and CUDA parameters of groups at T > 0.

        Handing a draw to the worker costs about as much as drawing a few ten thousand
        normals (the hand-off, and the worker's Python competing for the GIL), so smaller
        parameters draw in the step, and a small model hands nothing over.
        """
        requests = []
        for group in self.param_groups:
            if not (float(group["temperature"]) > 0 and float(group["lr"]) > 0):
                continue
            params = [
                param
                for param in group["params"]
                if large(param)
                and param.requires_grad
                and param.device.type in ("cpu", "cuda")
                and parameter_layout(param) is None
                and not is_dtensor(param)
            ]
            requests += [
                NoiseRequest(
                    self._noise_like(param), group["seed"], group["step"], key, self._shard
                )
                for param, key in zip(params, self._noise_keys(params), strict=True)
            ]
        return requests

    def _noise_like(self, param: Tensor) -> Tensor:
        """The tensor ``param``'s noise is drawn like: its float32 master where it has one."""
        if is_half(param):
            state = self.state.get(param)
            if state and isinstance(state.get(MASTER), Tensor):
                master: Tensor = state[MASTER]
                return master
        return param

    def _agree_across_ranks(self) -> None:
        """Under ``torch.distributed``, agree on the seeds once (see ``_distributed``)."""
        self._noise_keys([])  # whether every parameter has a name
        agreement = agree_across_ranks(
            [group["seed"] for group in self.param_groups],
            [group["step"] for group in self.param_groups],
            [[tuple(p.shape) for p in group["params"]] for group in self.param_groups],
            given=self._seed_given,
            named=self._runtime["all_named"],
        )
        for group, seed in zip(self.param_groups, agreement.seeds, strict=True):
            group["seed"] = seed
        self._runtime.update(shard=agreement.shard, agreed=True)

    # ------------------------------------------------------------------ the fused step
    def _takes_fused_step(self, gathered: list[Any], *, compiling: bool) -> bool:
        """Whether this step is fused (``fused``); with ``fused=True``, raise if it cannot be.

        ``fused=None`` takes the fused path where :func:`~.fused.fused_refusal` finds no
        reason against it and no param group sets ``foreach`` (a choice of the unfused
        kernels); never under ``torch.compile``, which traces the unfused step, nor for a
        step without gradients (which would only import Triton), nor where every group is
        at temperature 0: there the step is ``torch.optim``'s default (foreach) step,
        bit for bit, as the optimizer it replaces takes it (``fused=True`` is
        ``SGD(fused=True)``'s step at T = 0).
        """
        if self._fused is False or (self._fused is None and compiling):
            return False
        if self._fused is None and not DEFAULT_ON_CUDA:
            return False
        if self._fused is None and (
            any(group["foreach"] is not None for _, group, *_ in gathered)
            or not any(params for _, _, params, _ in gathered)
            or all(float(group["temperature"]) == 0 for _, group, params, _ in gathered if params)
        ):
            return False
        reason = fused_refusal(self.definition, gathered, self.state, compiling=compiling)
        if reason is not None and self._fused:
            raise ValueError(fused_message(reason))
        return reason is None

    def _fused_step(
        self,
        gathered: list[tuple[int, dict[str, Any], list[Tensor], list[Tensor]]],
        scaler: ScalerInput,
    ) -> None:
        """Every group's step by the sampler's fused kernel, checked on the device.

        The kernels read the device flag of :func:`~._fused_nonfinite.check_gradients`
        and write nothing when a gradient is not finite: with ``nonfinite="skip"`` the
        step is counted as skipped, with ``"raise"`` the verdict is read by the next
        ``step()`` or ``state_dict()`` (:class:`~._fused_nonfinite.DeferredRefusal`),
        which can then put back what this step recorded on the host. Under a
        ``GradScaler`` (``scaler.found_inf`` given) its ``found_inf`` is the flag
        (:func:`~._grad_scaler.found_inf_flags`): no check of the gradients, no refusal.
        A skipped step's host record is put back as the unfused step's (``_skipped_host``).
        """
        rollback = check = None
        if scaler.found_inf is not None:
            largest = found_inf_flags(gathered, scaler.found_inf)
        else:
            check = check_gradients(gathered)
            largest = check.largest
            if self._nonfinite == "skip":
                count_skipped(gathered, largest)
            else:
                rollback = host_record(
                    self.state, self.param_groups, gathered, self.host_state, counters=True
                )
        record = self._skip_record(gathered) if rollback is None else None
        finite_where = None if rollback is None and record is None else largest
        for _, group, params, grads in gathered:
            if not params:
                continue
            temperature = float(group["temperature"])
            lr = float(group["lr"])
            if temperature > 0 and lr == 0:
                continue  # a step of length zero: no time passes, nothing changes
            self._fused_update_group(
                group,
                params,
                grads,
                lr=lr,
                temperature=temperature,
                largest=largest,
                grad_scale=scaler.grad_scale,
                finite_where=finite_where,
            )
            if temperature > 0:  # the keys the noise was drawn with (module docstring)
                self._record_noise_keys(params)
        if rollback is not None and check is not None:
            steps = {id(group): int(group["step"]) for group in self.param_groups}
            self._runtime["refusal"] = DeferredRefusal(check, steps=steps, rollback=rollback)
        if record is not None:
            kept = {device: flag.isfinite().reshape(()) for device, flag in largest.items()}
            put_back_if_skipped(self._runtime, record, kept)

    def _unfused_verdict(
        self, gathered: list[Any], scaler: ScalerInput
    ) -> tuple[dict[torch.device, Tensor] | None, Callable[[], None] | None]:
        """The unfused step's verdict, and the host record a skip puts back.

        Per device, a boolean, False where the step is skipped (a ``GradScaler``'s
        ``found_inf``, or ``nonfinite="skip"``), or None: ``nonfinite="raise"`` refused
        a non-finite gradient here already, before anything changed.
        """
        keep = None
        if scaler.found_inf is not None:  # the scaler's verdict, on the device
            keep = keep_flags(gathered, scaler.found_inf)
        elif self._nonfinite == "raise":
            refuse_non_finite_gradients(type(self).__name__, gathered)
        else:
            keep = finite_flags(gathered)
        return keep, None if keep is None else self._skip_record(gathered)

    def _skip_record(self, gathered: list[Any]) -> Callable[[], None] | None:
        """What a skipped step puts back on the host (``_skipped_host``); None if nothing."""
        if not self.host_state:
            return None
        return host_record(self.state, self.param_groups, gathered, self.host_state, counters=False)

    def _raise_deferred_refusal(self) -> None:
        """Raise the refusal of the last fused step (``nonfinite="raise"``), if refused.

        Reads the verdict the step copied to the host (waiting, at most, for that copy,
        queued at the end of the step), puts back what the step recorded on the host
        and raises; the kernels changed no parameter or buffer. First, a skipped step's
        host record waiting for its verdict is put back if skipped (``_skipped_host``).
        """
        settle_skipped(self._runtime)
        refusal = self._runtime.pop("refusal", None)
        if refusal is None:
            return
        found = refusal.culprit()
        if found is None:
            return
        culprit, step = found
        refusal.rollback()
        raise FloatingPointError(
            f"{type(self).__name__} refused step {step}: non-finite gradient in {culprit}; "
            "no parameter or buffer was changed (the fused step checks the gradients on "
            "the device, without a host synchronisation: this call, the next after that "
            "step, raises it and changes nothing either)"
        )

    def _fused_update_group(
        self,
        group: dict[str, Any],
        params: list[Tensor],
        grads: list[Tensor],
        *,
        lr: float,
        temperature: float,
        largest: dict[torch.device, Tensor],
        grad_scale: Tensor | None = None,
        finite_where: dict[torch.device, Tensor] | None = None,
    ) -> None:
        """One param group's step by the sampler's fused kernel (``sgmcmc/fused``).

        The state is created and re-expressed in lr's units as by the unfused step; the
        kernel then reads and writes each parameter and buffer once, drawing the fused
        noise stream (``fused.fused_noise_seed``) in registers. A half-precision
        parameter's float32 master (``_half_precision``) and the GradScaler's scale go
        to the kernel (``FusedInput.masters``, ``FusedInput.grad_scales``), which reads
        the gradient as ``g / scale`` and writes the master and its rounding.
        """
        masters, tensors = self._positions(params, temperature)
        # (a step refused later keeps every bit of its buffers: ``unless_nonfinite``)
        fields, states = self._ready_state(
            group,
            params,
            tensors,
            lr=lr,
            temperature=temperature,
            foreach=default_foreach(params),
            unless_nonfinite=finite_where,
        )
        keys = self._noise_keys(params) if temperature > 0 else [0] * len(params)
        seeds = (
            fused_noise_seeds(group["seed"], group["step"], keys, self._shard)
            if temperature > 0
            else [0] * len(params)
        )
        extra: dict[str, Any] = {}  # the fields of FusedInput a plain step leaves out
        if grad_scale is not None:
            on: dict[torch.device, Tensor] = {}
            for param in params:
                if param.device not in on:
                    on[param.device] = grad_scale.reshape(1).to(
                        device=param.device,
                        dtype=torch.float32,
                        non_blocking=param.device.type != "cpu",
                    )
            extra["grad_scales"] = [on[param.device] for param in params]
        if any(master is not None for master in masters):
            extra["masters"] = masters
        inputs = FusedInput(
            params,
            grads,
            {name: [state.get(name) for state in states] for name in fields},
            seeds,
            [parameter_offset(param) for param in params],
            [largest[param.device] for param in params],
            **extra,
        )
        new = fused_kernel(self.definition).launch(
            {**group, "lr": lr, "temperature": temperature}, inputs
        )
        for param, master in zip(params, masters, strict=True):
            if master is not None:  # the kernel wrote its rounding into the parameter
                self._master_sync.written(param, master)
        for name in fields:
            for state, value in zip(states, new[name], strict=True):
                if value is None:  # not created yet (a frozen preconditioner)
                    state.pop(name, None)
                else:
                    state[name] = value

    # ------------------------------------------------------------------ the update
    def _unwidened_state(self) -> tuple[str, ...]:
        """State entries a new master leaves in their dtype: the host numbers."""
        return self.host_state

    def _update_group(
        self,
        group: dict[str, Any],
        params: list[Tensor],
        grads: list[Tensor],
        *,
        lr: float,
        temperature: float,
        keep: dict[torch.device, Tensor] | None = None,
        grad_scale: Tensor | None = None,
    ) -> None:
        """Draw the noise, call the sampler's kernel, store its state and take the step.

        ``keep`` (``nonfinite="skip"``, or a ``GradScaler``'s ``found_inf``): per
        device, a 0-d boolean tensor, False when the step must change nothing; the new
        parameters and buffers are then selected with ``torch.where`` against the old
        ones, without a host synchronisation. ``grad_scale`` (a ``GradScaler``'s): the
        update reads each gradient as ``g / grad_scale``, ``.grad`` is left as it is.

        A float16/bfloat16 parameter at T > 0, or one that has a master already, is
        updated through its float32 master (``_half_precision``): the update runs on the
        master with the gradient widened, then the parameter takes its rounding.
        """
        masters, tensors = self._positions(params, temperature)
        grads = unscaled_grads(grads, grad_scale, widen=[m is not None for m in masters])
        self._update_tensors(
            group, params, tensors, grads, lr=lr, temperature=temperature, keep=keep
        )
        store_masters_(params, masters, self._master_sync)

    def _positions(
        self, params: list[Tensor], temperature: float
    ) -> tuple[list[Tensor | None], list[Tensor]]:
        """Each parameter's float32 master (None without one), and the tensors stepped.

        The tensor a parameter's step updates is its master, or the parameter itself
        (``_half_precision``).
        """
        masters = compute_tensors(
            params,
            self.state,
            temperature=temperature,
            skip=self._unwidened_state(),
            sync=self._master_sync,
        )
        tensors = [p if m is None else m for p, m in zip(params, masters, strict=True)]
        return masters, tensors

    def _ready_state(
        self,
        group: dict[str, Any],
        params: list[Tensor],
        tensors: list[Tensor],
        *,
        lr: float,
        temperature: float,
        foreach: bool,
        unless_nonfinite: dict[torch.device, Tensor] | None = None,
    ) -> tuple[tuple[str, ...], list[dict[str, Any]]]:
        """The group's state fields and per-parameter states, ready for this step.

        What a state lacks is created (new, or loaded from another kind) like its
        ``tensors``; state in lr's units follows a change of lr (``docs/design.md``;
        ``unless_nonfinite`` as for :meth:`_reexpress_state`). Both the unfused and the
        fused step start here.
        """
        fields = self._state_fields(group)
        states = [self.state[p] for p in params] if fields else []
        for tensor, state in zip(tensors if fields else [], states, strict=True):
            if not all(name in state for name in fields):
                self._init_state(group, tensor, state)
        if fields:
            self._reexpress_state(
                group,
                params,
                states,
                lr=lr,
                temperature=temperature,
                foreach=foreach,
                unless_nonfinite=unless_nonfinite,
            )
        return fields, states

    def _update_tensors(
        self,
        group: dict[str, Any],
        params: list[Tensor],
        tensors: list[Tensor],
        grads: list[Tensor],
        *,
        lr: float,
        temperature: float,
        keep: dict[torch.device, Tensor] | None,
    ) -> None:
        """:meth:`_update_group` on ``tensors`` (each parameter, or its master).

        ``params`` key the state and the noise; ``tensors`` are updated in place. On the
        CPU without foreach, large tensors are updated chunk by chunk, in cache
        (``_chunked_update``), with the same numbers.
        """
        foreach = group["foreach"]
        if foreach is None:  # under compile, whole tensors (both paths: the same numbers)
            foreach = torch.compiler.is_compiling() or default_foreach(params)
        gate = rescale_gate(keep, self.host_state)  # (where a skip puts back the rate)
        fields, states = self._ready_state(
            group,
            params,
            tensors,
            lr=lr,
            temperature=temperature,
            foreach=foreach,
            unless_nonfinite=gate,
        )
        buffers: list[list[Any]] = [[state.get(name) for state in states] for name in fields]
        exact = self.definition.zero_temperature_step
        if exact is not None and temperature == 0:
            inputs = UpdateInput(tensors, grads, dict(zip(fields, buffers, strict=True)), None)
            at_zero = {**group, "lr": lr, "temperature": 0.0}
            if exact_step_unless_skipped(exact, at_zero, inputs, foreach, keep, self.host_state):
                return
        noise_of = None
        if temperature > 0:
            noise_of = GroupNoise(
                tensors,
                stream=self._stream(group["seed"]),
                keys=self._noise_keys(params),
                step=group["step"],
                shard=self._shard,
                prefetcher=self._prefetcher,
                ahead=self._overlap_noise,
            )

        kwargs = {"lr": lr, "temperature": temperature}
        if (
            keep is None
            and not foreach
            and self.chunked_kernel
            and chunkable(tensors, grads, buffers)
        ):

            def kernel(
                ps: list[Tensor],
                gs: list[Tensor],
                bs: list[list[Tensor | None]],
                noise: list[Tensor] | None,
            ) -> list[Tensor]:
                return self._kernel(group, ps, gs, bs, noise, foreach=False, **kwargs)[0]

            update_in_chunks(
                kernel, tensors, grads, buffers, noise_of, lr=lr, temperature=temperature
            )
            return
        noise = None if noise_of is None else [noise_of.whole(i) for i in range(len(params))]
        old = None
        if keep is not None:  # the kernels update buffers in place
            old = [[None if b is None else b.clone() for b in field] for field in buffers]
        directions, new_buffers = self._kernel(
            group, tensors, grads, buffers, noise, foreach=foreach, **kwargs
        )
        for f, (name, field) in enumerate(zip(fields, new_buffers, strict=True)):
            host = name in self.host_state  # put back if skipped (``_skipped_host``)
            for i, (state, value) in enumerate(zip(states, field, strict=True)):
                if value is None:  # not created yet: torch.optim keeps tensors only
                    state.pop(name, None)
                    continue
                if old is not None and keep is not None and isinstance(value, Tensor) and not host:
                    value = kept(value, old[f][i], keep)
                state[name] = value
        apply_step_(tensors, directions, lr=lr, as_sgd=temperature == 0, foreach=foreach, keep=keep)

    # What a sampler supplies.
    #: whether the kernel is elementwise, so that it may run on chunks of a tensor
    chunked_kernel: bool = True
    #: whether the kernel runs on DTensor parameters (FSDP2's fully_shard), and why not
    supports_dtensor: bool = True
    dtensor_unsupported_reason: str = ""

    def _state_fields(self, group: dict[str, Any]) -> tuple[str, ...]:
        """The per-parameter state the kernel reads and writes, in its argument order."""
        return self.definition.state_fields(group)

    def _init_state(self, group: dict[str, Any], param: Tensor, state: dict[str, Any]) -> None:
        """Create what a parameter's state lacks before a step (keeping what is there).

        Called before its first step, and when a loaded state lacks a field (an SGD or
        SGHMC checkpoint loaded into SGNHT has no thermostat). A field whose definition
        has no ``init`` is created by the update at the first step (SGD's momentum).
        """
        for field in self.definition.state:
            if field.init is not None and field.used(group) and field.name not in state:
                state[field.name] = field.init(param, group)

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
        self._reexpress_state(group, params, states, lr=lr, temperature=1.0, foreach=False)

    def _reexpress_state(
        self,
        group: dict[str, Any],
        params: list[Tensor],
        states: list[dict[str, Any]],
        *,
        lr: float,
        temperature: float,
        foreach: bool,
        unless_nonfinite: dict[torch.device, Tensor] | None = None,
    ) -> None:
        """Re-express state kept in lr's units when lr has changed, before the kernel.

        A sampler whose state holds a momentum buffer in SGD units
        (``momentum_in_lr_units``: SGHMC, SGNHT, BAOA) rescales it at T > 0 so that the
        chain's physical momentum is kept (``docs/design.md``;
        :func:`~.momentum_units.rescale_momentum_state`), reading the rate each buffer
        was written at through ``self._host_scalars``; other samplers keep no such state.
        """
        if self.momentum_in_lr_units:
            rescale_momentum_state(
                states,
                lr=lr,
                temperature=temperature,
                foreach=foreach,
                params=params,
                known=self._host_scalars,
                buffer=self.definition.momentum_buffer,
                unless_nonfinite=unless_nonfinite,
            )

    def _kernel(
        self,
        group: dict[str, Any],
        params: list[Tensor],
        grads: list[Tensor],
        buffers: list[list[Tensor | None]],
        noise: list[Tensor] | None,
        *,
        lr: float,
        temperature: float,
        foreach: bool,
    ) -> tuple[list[Tensor], list[list[Tensor | None]]]:
        """Call the sampler's pure update: ``(directions, new buffers per field)``."""
        fields = self._state_fields(group)
        directions, new = self.definition.update(
            {**group, "lr": lr, "temperature": temperature, "initial_state": False},
            UpdateInput(params, grads, dict(zip(fields, buffers, strict=True)), noise),
            foreach=foreach,
            inplace=True,
        )
        return directions, [list(new[name]) for name in fields]

    # ------------------------------------------------------------------ state
    def _restore_own_dtype_state(self, state_dict: dict[str, Any]) -> None:
        """Undo torch's cast of some saved entries to the parameter's dtype and device.

        ``own_dtype_state`` (a thermostat) keeps its dtype on the parameter's device,
        ``host_state`` (AdamW's step count) its dtype on the CPU, a half-precision
        parameter's master and buffers float32 (``_half_precision``); the
        noise key (``ChainOptimizer._restore_noise_keys``) and the rate of a momentum
        buffer (``_checkpoint.restore_momentum_rate``) keep theirs on the CPU.
        """
        self._restore_noise_keys(state_dict)
        saved_state = state_dict.get("state", {})
        for group, saved_group in zip(self.param_groups, state_dict["param_groups"], strict=True):
            for param, param_id in zip(group["params"], saved_group["params"], strict=True):
                saved = saved_state.get(param_id) or {}
                for key in self.own_dtype_state:
                    value = saved.get(key)
                    if isinstance(value, Tensor):
                        self.state[param][key] = value.to(device=param.device, copy=True)
                for key in self.host_state:
                    value = saved.get(key)
                    if isinstance(value, Tensor):
                        self.state[param][key] = value.detach().to(device="cpu", copy=True)
                if MOMENTUM_RATE in saved:  # (indexing self.state creates an entry)
                    restore_momentum_rate(self.state[param], saved)
                if MASTER in saved:  # a half parameter's float32 master and buffers
                    restore_master_state_(
                        param, self.state[param], saved, (*self.host_state, MOMENTUM_RATE)
                    )

    def _check_saved_masters(
        self, saved_groups: list[dict[str, Any]], saved_state: dict[Any, Any]
    ) -> None:
        """Refuse a saved ``master_param`` that does not fit its parameter (before loading)."""
        for group, saved_group in zip(self.param_groups, saved_groups, strict=False):
            for param, param_id in zip(
                group["params"], saved_group.get("params", []), strict=False
            ):
                saved = saved_state.get(param_id) or {}
                if MASTER in saved and is_half(param):
                    check_saved_master(param_id, param, saved[MASTER])

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
        as taken (see :meth:`step`).
        """
        self._raise_deferred_refusal()
        return super().state_dict()

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
        self._check_saved_masters(saved_groups, saved_state)
        warn_if_keyed_otherwise(type(self).__name__, self.param_groups, saved_groups, saved_state)
        if len(saved_groups) == len(self.param_groups):
            saved_groups = [
                {**{k: v for k, v in current.items() if k != "params"}, **saved}
                for current, saved in zip(self.param_groups, saved_groups, strict=True)
            ]
            for index, group in enumerate(saved_groups):
                self.check_hyperparameters(group, where=at_group(index))
                self._check_chain_state(group, where=at_group(index))
        state_dict["param_groups"] = saved_groups
        super().load_state_dict(state_dict)
        self._restore_own_dtype_state(state_dict)
        self._reset_runtime(seed_given=True)
        self._prime_runtime()


if not COMPILED_DRAW:
    # torch < 2.13 cannot trace the step soundly (see ``_noise_op``; torch 2.11's dynamo
    # also fails on its comprehensions): under torch.compile the step then runs eagerly.
    SamplerOptimizer.step = torch.compiler.disable(  # type: ignore[method-assign,no-untyped-call]
        SamplerOptimizer.step
    )


#: param-group entries that are not hyperparameters (the chain's state, counters)
_NOT_HYPERPARAMETERS = frozenset({"params", "step", "seed", "skipped_steps"})


def _hyperparameter_key(group: dict[str, Any]) -> tuple[Any, ...] | None:
    """The group's hyperparameters as a hashable tuple of ``(name, type, value)``, or None.

    None where one is a tensor or unhashable: then they are checked at every step. The
    checks of :meth:`SamplerOptimizer.check_hyperparameters` read these values
    alone, so a group whose key is the one last checked needs no new check.
    """
    items = []
    for name, value in group.items():
        if name in _NOT_HYPERPARAMETERS:
            continue
        if isinstance(value, Tensor):
            return None
        try:
            hash(value)
        except TypeError:
            return None
        items.append((name, type(value), value))
    return tuple(items)
