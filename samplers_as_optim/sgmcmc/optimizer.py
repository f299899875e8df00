"""What SGLD, SGHMC and SGNHT share as ``torch.optim.Optimizer`` subclasses.

A subclass supplies its constructor (which builds ``defaults``), a per-group validator
and ``_update_group``, which calls the sampler's pure kernel. This base class owns
everything else: param-group validation (at construction, on ``add_param_group`` and at
every step, since a schedule may move any hyperparameter), gathering parameters with a
gradient, the refusal of non-finite gradients, and the chain's random state.

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

import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch import Tensor
from torch.optim import Optimizer

from ..core import streams
from ..core.chain import NOISE_KEY, ChainOptimizer, check_representable, check_saved_noise_key
from ..core.chain import at_group as at_group  # re-exported: the samplers' modules use it
from ..core.distributed import agree_across_ranks
from ..core.dtensor import is_dtensor, local_layout, wrap_like
from ..core.noise_op import COMPILED_DRAW
from ..core.streams import block_bounds, seed_from_global_rng
from ..core.validation import (
    check_bool,
    check_choice,
    check_foreach,
    check_learning_rate,
    check_nonnegative,
    check_num_data,
    check_seed,
    check_temperature,
)
from ..names import parameter_layout
from ._common import (
    HostScalars,
    all_finite,
    apply_step_,
    default_foreach,
    host_scalar,
    may_be_non_finite,
)
from ._prefetch import NoisePrefetcher, NoiseRequest
from .arguments import PARAMS_DOC
from .definition import (
    REQUIRED,
    SamplerDefinition,
    UpdateInput,
    arguments_doc,
    example_doc,
    generated_function,
)
from .momentum_units import rescale_momentum_state

__all__ = ["SamplerOptimizer"]

#: where checkpoints written before the chain state moved into the param groups kept it
_LEGACY_SAMPLER_KEY = "sampler"
#: param-group entries that only a sampler (not torch.optim.SGD) writes
_SAMPLER_ONLY_KEYS = ("num_data", "temperature")
#: the per-parameter entry that holds the learning rate its momentum buffer was written at
MOMENTUM_RATE = "momentum_lr"

#: what a step does with a non-finite gradient: refuse it (an error, after a host sync) or
#: skip it (a no-op, counted in ``group["skipped_steps"]``, without a sync)
NONFINITE_POLICIES = ("raise", "skip")

#: Parameters with at least this many elements have their noise drawn ahead (on the
#: worker thread, or a CUDA side stream: ``overlap_noise``); smaller ones draw in the step.
PREFETCH_MIN_NUMEL = 2**16

#: Tensors with more elements than this are updated chunk by chunk on the CPU, in the
#: noise's blocks (``streams.BLOCK`` elements), so that a chunk draws exactly its block.
CHUNK = streams.BLOCK


def check_sgd_only_flags(differentiable: Any, fused: Any) -> None:
    """Reject the two ``torch.optim.SGD`` flags that have no sampler implementation."""
    if differentiable is not False:
        raise ValueError(
            f"Invalid differentiable: {differentiable!r} (expected False: differentiating "
            "through a sampler step is not supported)"
        )
    if fused not in (None, False):
        raise ValueError(
            f"Invalid fused: {fused!r} (expected None or False: there is no fused sampler "
            "kernel; use foreach=True for the multi-tensor path)"
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
    gradient, the non-finite policy, the lr re-expression of the state, and the chain.
    """

    #: the sampler this class is built from (set by ``__init_subclass__``)
    definition: SamplerDefinition
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
        ``step`` (0) start the chain's random state.
        """
        defaults = dict(arguments)
        params = defaults.pop("params")
        seed = check_seed(defaults.pop("seed"))
        self._overlap_noise = check_bool("overlap_noise", defaults.pop("overlap_noise"))
        self._nonfinite = check_choice(
            "nonfinite", defaults.pop("nonfinite", "raise"), NONFINITE_POLICIES
        )
        check_sgd_only_flags(defaults.pop("differentiable", False), defaults.pop("fused", None))
        self.check_hyperparameters(defaults, where="")
        for name in self.signature_only_arguments:
            del defaults[name]
        defaults["seed"] = seed_from_global_rng() if seed is None else seed
        defaults["step"] = 0
        self._reset_runtime(seed_given=seed is not None)
        Optimizer.__init__(self, params, defaults)

    def _reset_runtime(self, *, seed_given: bool) -> None:
        """Create what is not part of the chain's state: generator caches, rank agreement.

        What the step itself updates lives in dicts (``_keys``, ``_runtime``), never in
        attributes assigned during the step: TorchDynamo traces dict mutations of an
        optimizer, not (in every torch version) attribute assignments.
        """
        self._reset_chain_runtime()  # the noise streams and keys, the shard
        #: the values of the 0-d rate tensors in the state (see ``HostScalars``)
        self._host_scalars = HostScalars()
        self._prefetcher = NoisePrefetcher() if self._overlap_noise else None
        self._seed_given = seed_given
        self._runtime["agreed"] = False

    def __getstate__(self) -> dict[str, Any]:
        """``torch.optim.Optimizer``'s state (the whole chain) plus the runtime options."""
        return {
            **super().__getstate__(),
            "_overlap_noise": self._overlap_noise,
            "_nonfinite": self._nonfinite,
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
                    f"({self._describe(group, index, position)}); use a dense embedding "
                    "(sparse=False) or torch.optim.SparseAdam for that parameter"
                )
            if param.is_complex() or grad.is_complex():
                raise TypeError(
                    f"{type(self).__name__} does not support complex parameters "
                    f"({self._describe(group, index, position)}); view them as real with "
                    "torch.view_as_real"
                )
            if is_dtensor(param) and not self.supports_dtensor:
                raise NotImplementedError(
                    f"{type(self).__name__} does not support DTensor (FSDP2) parameters yet "
                    f"({self._describe(group, index, position)}): "
                    f"{self.dtensor_unsupported_reason}; use SGHMC or SGLD"
                )
            params.append(param)
            grads.append(grad)
        return params, grads

    @staticmethod
    def _describe(group: dict[str, Any], index: int, position: int) -> str:
        names = group.get("param_names")
        param = group["params"][position]
        name = f" {names[position]!r}" if names else ""
        return f"param group {index}, parameter {position}{name} of shape {tuple(param.shape)}"

    def _refuse_non_finite(
        self, gathered: Sequence[tuple[int, dict[str, Any], list[Tensor], list[Tensor]]]
    ) -> None:
        """Raise, before anything changes, if any gradient holds NaN or infinity.

        Fast path :func:`may_be_non_finite`; only on suspicion are the tensors checked one
        by one, to name the culprit.
        """
        if not may_be_non_finite([grad for *_, grads in gathered for grad in grads]):
            return
        for index, group, _, _ in gathered:
            for position, param in enumerate(group["params"]):
                grad = param.grad
                if grad is not None and not bool(torch.isfinite(grad).all()):
                    raise FloatingPointError(
                        f"{type(self).__name__} refused step {group['step'] + 1}: non-finite "
                        f"gradient in {self._describe(group, index, position)}; no parameter "
                        "or buffer was changed"
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
                (with ``nonfinite="raise"``, the default).
            ValueError: a param group holds an invalid hyperparameter (a schedule may
                have moved it); nothing was changed.

        Under ``torch.compile`` the step is one graph (the noise draw is one custom op,
        ``samplers_as_optim.core.noise_op``) when built with ``nonfinite="skip"``; with
        ``"raise"`` the check of the gradients reads a value back to Python, which
        splits the graph there, exactly as in eager mode.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        compiling = torch.compiler.is_compiling()
        if not self._runtime["agreed"]:
            self._agree_across_ranks()
        gathered = []
        for index, group in enumerate(self.param_groups):
            self.check_hyperparameters(group, where=at_group(index))
            if not compiling:  # checked on the way in; reading it would specialise the graph
                self._check_chain_state(group, where=at_group(index))
            params, grads = self._gather(group, index)
            check_representable(group, params, where=at_group(index))
            gathered.append((index, group, params, grads))
        keep = None
        if self._nonfinite == "raise":
            self._refuse_non_finite(gathered)
        else:
            keep = self._finite_flags(gathered)
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
            self._update_group(group, params, grads, lr=lr, temperature=temperature, keep=keep)
            if temperature > 0:  # the keys the noise was drawn with (module docstring)
                self._record_noise_keys(params)
        for group in self.param_groups:
            group["step"] += 1
        if prefetcher is not None:
            prefetcher.submit(self._next_noise_requests())
        return loss

    def _finite_flags(
        self, gathered: Sequence[tuple[int, dict[str, Any], list[Tensor], list[Tensor]]]
    ) -> dict[torch.device, Tensor]:
        """``nonfinite="skip"``: whether every gradient is finite, one flag per device.

        Computed without reading anything back to Python (no host synchronisation, no
        graph break under ``torch.compile``); every param group counts the steps it
        skipped in ``group["skipped_steps"]``, a 0-d integer tensor on its device.
        """
        flags = all_finite([grad for *_, grads in gathered for grad in grads])
        for _, group, params, _ in gathered:
            if params:
                device = params[0].device
                skipped = group.get("skipped_steps")
                if not isinstance(skipped, Tensor):
                    skipped = group["skipped_steps"] = torch.zeros(
                        (), dtype=torch.int64, device=device
                    )
                skipped.add_(flags[skipped.device].logical_not().to(torch.int64))
        return flags

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
                if param.numel() >= PREFETCH_MIN_NUMEL
                and param.requires_grad
                and param.device.type in ("cpu", "cuda")
                and parameter_layout(param) is None
                and not is_dtensor(param)
            ]
            requests += [
                NoiseRequest(param, group["seed"], group["step"], key, self._shard)
                for param, key in zip(params, self._noise_keys(params), strict=True)
            ]
        return requests

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

    # ------------------------------------------------------------------ the update
    def _update_group(
        self,
        group: dict[str, Any],
        params: list[Tensor],
        grads: list[Tensor],
        *,
        lr: float,
        temperature: float,
        keep: dict[torch.device, Tensor] | None = None,
    ) -> None:
        """Draw the noise, call the sampler's kernel, store its state and take the step.

        ``keep`` (``nonfinite="skip"``): per device, a 0-d boolean tensor, False when the
        step must change nothing; the new parameters and buffers are then selected with
        ``torch.where`` against the old ones, without a host synchronisation.

        On the CPU without foreach, tensors larger than ``CHUNK`` elements are updated
        chunk by chunk (the kernel on views, the noise drawn into a scratch chunk): the
        same operations on the same numbers, so the same results bit for bit, but each
        chunk stays in cache across the kernel's passes. That keeps a step within ~15%
        of SGD's step plus drawing the noise, instead of ~30% for whole tensors.
        """
        foreach = group["foreach"]
        if foreach is None:  # under compile, whole tensors (both paths: the same numbers)
            foreach = torch.compiler.is_compiling() or default_foreach(params)
        fields = self._state_fields(group)
        states = [self.state[p] for p in params] if fields else []
        for param, state in zip(params if fields else [], states, strict=True):
            if not all(name in state for name in fields):  # new, or loaded from another kind
                self._init_state(group, param, state)
        if fields:  # state in lr's units follows a change of lr (docs/design.md)
            self._reexpress_state(
                group, params, states, lr=lr, temperature=temperature, foreach=foreach
            )
        buffers = [[state.get(name) for state in states] for name in fields]
        noise_of = None
        if temperature > 0:
            noise_of = _GroupNoise(self, group, params)

        kwargs = {"lr": lr, "temperature": temperature}
        if keep is None and not foreach and self._chunkable(params, grads, buffers):
            self._update_in_chunks(group, params, grads, buffers, noise_of, **kwargs)
            return
        noise = None if noise_of is None else [noise_of.whole(i) for i in range(len(params))]
        old = None
        if keep is not None:  # the kernels update buffers in place
            old = [[None if b is None else b.clone() for b in field] for field in buffers]
        directions, new_buffers = self._kernel(
            group, params, grads, buffers, noise, foreach=foreach, **kwargs
        )
        for f, (name, field) in enumerate(zip(fields, new_buffers, strict=True)):
            for i, (state, value) in enumerate(zip(states, field, strict=True)):
                if old is not None and keep is not None and isinstance(value, Tensor):
                    value = _kept(value, old[f][i], keep)
                state[name] = value
        apply_step_(params, directions, lr=lr, as_sgd=temperature == 0, foreach=foreach, keep=keep)

    def _chunkable(
        self,
        params: list[Tensor],
        grads: list[Tensor],
        buffers: list[list[Tensor | None]],
    ) -> bool:
        if not self.chunked_kernel or not any(p.numel() > CHUNK for p in params):
            return False
        if any(parameter_layout(p) is not None or is_dtensor(p) for p in params):
            return False  # a share of a larger tensor draws its part of that one's noise
        tensors = [*params, *grads, *(b for field in buffers for b in field)]
        # not e.g. SGHMC's first step, whose buffers the kernel creates
        return all(t is not None and t.device.type == "cpu" and t.is_contiguous() for t in tensors)

    def _update_in_chunks(
        self,
        group: dict[str, Any],
        params: list[Tensor],
        grads: list[Tensor],
        buffers: list[list[Tensor | None]],
        noise_of: _GroupNoise | None,
        *,
        lr: float,
        temperature: float,
    ) -> None:
        """``_update_group`` for CPU tensors, large ones chunk by chunk (buffers in place).

        A chunk is a block of the noise (:data:`~samplers_as_optim.core.streams.BLOCK`): a
        view of the prefetched noise, or drawn with ``normal_`` into a scratch tensor from
        the block's own generator: the numbers of ``NoiseStream.draw``, which draws each
        block with ``torch.randn``.
        """

        def update(
            ps: list[Tensor],
            gs: list[Tensor],
            bs: list[list[Tensor | None]],
            noise: list[Tensor] | None,
        ) -> None:
            directions, _ = self._kernel(
                group, ps, gs, bs, noise, lr=lr, temperature=temperature, foreach=False
            )
            apply_step_(ps, directions, lr=lr, as_sgd=temperature == 0, foreach=False)

        def flat(tensor: Tensor, start: int, stop: int) -> Tensor:
            return tensor.view(-1)[start:stop]

        small: list[int] = []  # consecutive small tensors, updated together in order

        def flush() -> None:
            if small:
                noise = None if noise_of is None else [noise_of.whole(i) for i in small]
                bs = [[field[i] for i in small] for field in buffers]
                update([params[i] for i in small], [grads[i] for i in small], bs, noise)
                small.clear()

        scratch: dict[tuple[torch.device, torch.dtype], Tensor] = {}
        for i, param in enumerate(params):
            if param.numel() <= CHUNK:
                small.append(i)
                continue
            flush()
            kind = (param.device, param.dtype)
            if kind not in scratch:
                scratch[kind] = param.new_empty(streams.BLOCK)
            for block, (start, stop) in enumerate(block_bounds(param.numel())):
                noise = None
                if noise_of is not None:
                    noise = [noise_of.block(i, block, start, stop, scratch[kind])]
                update(
                    [flat(param, start, stop)],
                    [flat(grads[i], start, stop)],
                    [[flat(cast(Tensor, field[i]), start, stop)] for field in buffers],
                    noise,
                )
        flush()

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
        params = [p for p in group["params"] if self.state[p].get("momentum_lr") is not None]
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

        ``own_dtype_state`` (a thermostat) keeps its dtype on the parameter's device; the
        noise key (``ChainOptimizer._restore_noise_keys``) and the rate of a momentum
        buffer keep theirs on the CPU (a float rate, as checkpoints wrote it before,
        becomes a tensor; None, an unknown rate, none).
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
                if MOMENTUM_RATE in saved:
                    value = saved[MOMENTUM_RATE]
                    if value is None:
                        self.state[param].pop(MOMENTUM_RATE, None)
                    elif isinstance(value, Tensor):
                        self.state[param][MOMENTUM_RATE] = value.detach().to(
                            device="cpu", copy=True
                        )
                    else:
                        self.state[param][MOMENTUM_RATE] = host_scalar(float(value))

    def _migrate_host_state(self) -> None:
        """A rate kept as a float (or None) by an earlier version becomes a tensor (or none)."""
        for state in self.state.values():
            if not isinstance(state, dict) or MOMENTUM_RATE not in state:
                continue
            rate = state[MOMENTUM_RATE]
            if rate is None:
                del state[MOMENTUM_RATE]
            elif not isinstance(rate, Tensor):
                state[MOMENTUM_RATE] = host_scalar(float(rate))

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
        saved_groups = [dict(group) for group in state_dict.get("param_groups", [])]
        legacy = state_dict.pop(_LEGACY_SAMPLER_KEY, None)
        if legacy is not None:  # written by 0.1.0: {"seed", "steps"} beside the groups
            for group in saved_groups:
                group.update(seed=legacy["seed"], step=legacy["steps"])
        elif not self._hold_chain_state(saved_groups):
            found = sorted(
                {key for group in saved_groups for key in _SAMPLER_ONLY_KEYS}
                & {key for group in saved_groups for key in group}
            )
            if found:
                raise ValueError(
                    f"Invalid state_dict: its param groups hold {', '.join(found)} but not "
                    "the chain's random state ('seed' and 'step'), so loading it would "
                    "silently restart the noise (expected a sampler's state_dict(), or a "
                    "torch.optim.SGD checkpoint, which has neither)"
                )
        saved_state = state_dict.get("state", {})
        _refuse_non_finite_state(saved_state)
        named_now = any("param_names" in group for group in self.param_groups)
        named_then = any("param_names" in group for group in saved_groups)
        keyless = sum(
            NOISE_KEY not in (saved_state.get(param_id) or {})
            for group in saved_groups
            for param_id in group.get("params", [])
        )
        if (
            named_now
            and not named_then
            and keyless
            and all("seed" in group for group in saved_groups)
        ):
            warnings.warn(
                f"{type(self).__name__}.load_state_dict: this optimizer was given parameter "
                "names and the saved one was not, so the noise is now keyed by name, not "
                f"by position, for the {keyless} parameter(s) whose saved state holds no "
                "noise key (a checkpoint written before the samplers stored the keys, or "
                "parameters that have not drawn noise yet: frozen, or only stepped at "
                "temperature 0): they go on with other (equally valid) noise than the saved "
                "run would have drawn. For an exact resume, build the optimizer as the "
                "saved one was built (model.parameters() rather than named_parameters()).",
                stacklevel=2,
            )
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


def _drawn_ahead(param: Tensor) -> bool:
    """Whether a parameter's next noise is drawn ahead on the worker (CPU, large)."""
    return param.device.type == "cpu" and param.numel() >= PREFETCH_MIN_NUMEL


def _kept(new: Tensor, old: Tensor | None, keep: dict[torch.device, Tensor]) -> Tensor:
    """``new`` where the step is kept, else ``old`` (zeros for a buffer the step created)."""
    before = torch.zeros_like(new) if old is None else old
    return new.copy_(torch.where(keep[new.device], new, before))  # the kernel's own buffer


def _valid_rate(value: Any) -> bool:
    """None, or a finite number > 0 (a float, or a 0-d floating tensor)."""
    if value is None:
        return True
    if isinstance(value, Tensor):
        if value.dim() != 0 or not value.is_floating_point():
            return False
        value = float(value)
    elif not isinstance(value, float):
        return False
    return math.isfinite(value) and value > 0


def _refuse_non_finite_state(saved_state: dict[Any, Any]) -> None:
    """Raise if a saved per-parameter buffer holds NaN or infinity (before loading it).

    Also checks the learning rate recorded with a momentum buffer (``"momentum_lr"``):
    None or a finite number > 0, since the next change of lr rescales the buffer by it;
    and the noise key (``"noise_key"``): a 0-d int64 tensor.
    """
    for param_id, entries in saved_state.items():
        for key, value in (entries or {}).items():
            if key == MOMENTUM_RATE and not _valid_rate(value):
                raise ValueError(
                    f"Invalid state_dict: 'momentum_lr' of parameter {param_id} is "
                    f"{value!r} (expected None or a finite number > 0: the learning rate "
                    "its momentum buffer was written at)"
                )
            if key == NOISE_KEY:
                check_saved_noise_key(param_id, value)
            if (
                isinstance(value, Tensor)
                and value.is_floating_point()
                and not bool(torch.isfinite(value).all())
            ):
                raise ValueError(
                    f"Invalid state_dict: {key!r} of parameter {param_id} holds NaN or "
                    "infinity (expected finite buffers: they would reach the parameters at "
                    "the next step)"
                )


class _GroupNoise:
    """The noise of one param group's step: prefetched where it was, drawn otherwise."""

    def __init__(self, optimizer: SamplerOptimizer, group: dict[str, Any], params: list[Tensor]):
        self.params = params
        self.stream = optimizer._stream(group["seed"])
        self.keys = optimizer._noise_keys(params)
        self.step = group["step"]
        self.shard = optimizer._shard
        self.prefetched: list[Tensor | None] = [None] * len(params)
        #: under torch.compile, whether the draw hands the next step's to the worker
        self.ahead = optimizer._overlap_noise
        if optimizer._prefetcher is not None:
            self.prefetched = [
                optimizer._prefetcher.take(
                    NoiseRequest(param, group["seed"], self.step, key, self.shard)
                )
                for param, key in zip(params, self.keys, strict=True)
            ]

    def whole(self, i: int) -> Tensor:
        """Parameter i's noise, shaped like it."""
        prefetched = self.prefetched[i]
        if prefetched is not None:
            return prefetched
        param = self.params[i]
        if is_dtensor(param):  # FSDP2: this rank's rows of the whole parameter's noise
            local, layout = local_layout(param)
            noise = self.stream.draw(
                local, step=self.step, key=self.keys[i], shard=self.shard, layout=layout
            )
            return wrap_like(noise, param)
        share = parameter_layout(param)
        return self.stream.draw(
            param,
            step=self.step,
            key=self.keys[i],
            shard=self.shard,
            layout=share,
            ahead=self.ahead and share is None and _drawn_ahead(param),
        )

    def block(self, i: int, block: int, start: int, stop: int, scratch: Tensor) -> Tensor:
        """Elements ``[start, stop)`` of parameter i's noise (its block ``block``)."""
        prefetched = self.prefetched[i]
        if prefetched is not None:
            return prefetched.view(-1)[start:stop]
        return self.stream.fill_block_(
            scratch[: stop - start], step=self.step, key=self.keys[i], block=block, shard=self.shard
        )
