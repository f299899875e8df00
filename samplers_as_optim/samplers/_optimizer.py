"""What SGLD, SGHMC and SGNHT share as ``torch.optim.Optimizer`` subclasses.

A subclass supplies its constructor (which builds ``defaults``), a per-group validator
and ``_update_group``, which calls the sampler's pure kernel. This base class owns
everything else: param-group validation (at construction, on ``add_param_group`` and at
every step, since a schedule may move any hyperparameter), gathering parameters with a
gradient, the refusal of non-finite gradients, the noise stream and its place in
``state_dict``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from .._random import (
    NoiseStream,
    chunk_bounds,
    chunked_draws_match,
    draw_standard_normal,
    seed_from_global_rng,
)
from .._validation import (
    check_bool,
    check_foreach,
    check_learning_rate,
    check_nonnegative,
    check_num_data,
    check_seed,
    check_temperature,
)
from ._common import apply_step_, default_foreach, may_be_non_finite

__all__ = ["SamplerOptimizer"]

_SAMPLER_KEY = "sampler"

#: Tensors with more elements than this are updated in chunks of this size on the CPU.
CHUNK = 2**17


def _at_group(index: int) -> str:
    return f" in param group {index}"


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


class SamplerOptimizer(Optimizer):
    """Base class of the SGMCMC optimizers; not used directly.

    A subclass spells out its public signature (``torch.optim.SGD``'s plus ``num_data``,
    ``temperature`` and ``seed``) and passes its ``locals()`` here; it sets
    ``requires_positive_temperature`` and implements ``_check_group_combinations`` and
    ``_kernel`` (with ``_state_fields``/``_init_state`` when it keeps state).
    """

    requires_positive_temperature: bool = False
    positive_temperature_reason: str = ""
    #: per-parameter state kept in its own dtype on load (torch casts to the param's dtype)
    own_dtype_state: tuple[str, ...] = ()

    def __init__(self, arguments: dict[str, Any]) -> None:
        """Build from the public constructor's arguments (its ``locals()``).

        Everything but ``params``, ``seed``, ``differentiable`` and ``fused`` becomes a
        param-group default, validated before anything is built.
        """
        defaults = {k: v for k, v in arguments.items() if k not in ("self", "__class__")}
        params = defaults.pop("params")
        seed = check_seed(defaults.pop("seed"))
        check_sgd_only_flags(defaults.pop("differentiable"), defaults.pop("fused"))
        self.check_hyperparameters(defaults, where="")
        self._noise = NoiseStream(seed_from_global_rng() if seed is None else seed)
        self._steps = 0
        super().__init__(params, defaults)

    # ------------------------------------------------------------------ validation
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group as ``torch.optim.Optimizer`` does, then validate it."""
        super().add_param_group(param_group)
        self.check_hyperparameters(
            self.param_groups[-1], where=_at_group(len(self.param_groups) - 1)
        )

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
        cls._check_group_combinations(group, temperature, where)

    @classmethod
    def _check_group_combinations(
        cls, group: dict[str, Any], temperature: float, where: str
    ) -> None:
        raise NotImplementedError

    @staticmethod
    def _reject_at_positive_temperature(
        name: str, value: Any, default: Any, temperature: float, where: str
    ) -> None:
        if value != default and temperature > 0:
            raise ValueError(
                f"{name}={value!r}{where} requires temperature=0 (it has no sampling meaning)"
            )

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
                        f"{type(self).__name__} refused step {self._steps + 1}: non-finite "
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
            FloatingPointError: a gradient holds NaN or infinity; nothing was changed.
            ValueError: a param group holds an invalid hyperparameter (a schedule may
                have moved it); nothing was changed.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        gathered = []
        for index, group in enumerate(self.param_groups):
            self.check_hyperparameters(group, where=_at_group(index))
            params, grads = self._gather(group, index)
            gathered.append((index, group, params, grads))
        self._refuse_non_finite(gathered)
        for index, group, params, grads in gathered:
            if not params:
                continue
            temperature = float(group["temperature"])
            lr = float(group["lr"])
            if temperature > 0 and lr == 0:
                continue  # a step of length zero: no time passes, nothing changes
            self._update_group(index, group, params, grads, lr=lr, temperature=temperature)
        self._steps += 1
        return loss

    # ------------------------------------------------------------------ the update
    def _update_group(
        self,
        index: int,
        group: dict[str, Any],
        params: list[Tensor],
        grads: list[Tensor],
        *,
        lr: float,
        temperature: float,
    ) -> None:
        """Draw the noise, call the sampler's kernel, store its state and take the step.

        On the CPU without foreach, tensors larger than ``CHUNK`` elements are updated
        chunk by chunk (the kernel on views, the noise drawn into a scratch chunk): the
        same operations on the same numbers, so the same results bit for bit, but each
        chunk stays in cache across the kernel's passes. That keeps a step within ~15%
        of SGD's step plus drawing the noise, instead of ~30% for whole tensors.
        """
        foreach = group["foreach"]
        if foreach is None:
            foreach = default_foreach(params)
        fields = self._state_fields(group)
        states = [self.state[p] for p in params] if fields else []
        for param, state in zip(params if fields else [], states, strict=True):
            if not state:
                self._init_state(group, param, state)
        buffers = [[state.get(name) for state in states] for name in fields]
        generators = None
        if temperature > 0:
            generators = self._noise.generators(params, step=self._steps, stream=index)
        kwargs = {"lr": lr, "temperature": temperature}
        if not foreach and self._chunkable(params, grads, buffers, temperature):
            self._update_in_chunks(group, params, grads, buffers, generators, **kwargs)
            return
        noise = None if generators is None else draw_standard_normal(params, generators)
        directions, new_buffers = self._kernel(
            group, params, grads, buffers, noise, foreach=foreach, **kwargs
        )
        for name, field in zip(fields, new_buffers, strict=True):
            for state, value in zip(states, field, strict=True):
                state[name] = value
        apply_step_(params, directions, lr=lr, as_sgd=temperature == 0, foreach=foreach)

    def _chunkable(
        self,
        params: list[Tensor],
        grads: list[Tensor],
        buffers: list[list[Tensor | None]],
        temperature: float,
    ) -> bool:
        if not self.chunked_kernel or not any(p.numel() > CHUNK for p in params):
            return False
        tensors = [*params, *grads, *(b for field in buffers for b in field)]
        if any(t is None or t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
            return False  # e.g. SGHMC's first step, whose buffers the kernel creates
        return temperature == 0 or all(
            chunked_draws_match(p.device, p.dtype) for p in params if p.numel() > CHUNK
        )

    def _update_in_chunks(
        self,
        group: dict[str, Any],
        params: list[Tensor],
        grads: list[Tensor],
        buffers: list[list[Tensor]],
        generators: list[torch.Generator] | None,
        *,
        lr: float,
        temperature: float,
    ) -> None:
        """``_update_group`` for CPU tensors, large ones chunk by chunk (buffers in place)."""

        def update(ps, gs, bs, noise):
            directions, _ = self._kernel(
                group, ps, gs, bs, noise, lr=lr, temperature=temperature, foreach=False
            )
            apply_step_(ps, directions, lr=lr, as_sgd=temperature == 0, foreach=False)

        def flat(tensor, start, stop):
            return tensor.view(-1)[start:stop]

        small: list[int] = []  # consecutive small tensors, updated together in order

        def flush():
            if small:
                noise = None
                if generators is not None:
                    noise = draw_standard_normal(
                        [params[i] for i in small], [generators[i] for i in small]
                    )
                bs = [[field[i] for i in small] for field in buffers]
                update([params[i] for i in small], [grads[i] for i in small], bs, noise)
                small.clear()

        scratch: dict[tuple[torch.device, torch.dtype], Tensor] = {}
        for i, param in enumerate(params):
            if param.numel() <= CHUNK:
                small.append(i)
                continue
            flush()
            key = (param.device, param.dtype)
            if key not in scratch:
                scratch[key] = param.new_empty(CHUNK + 15)
            for start, stop in chunk_bounds(param.numel(), CHUNK):
                noise = None
                if generators is not None:
                    noise = [scratch[key][: stop - start].normal_(generator=generators[i])]
                update(
                    [flat(param, start, stop)],
                    [flat(grads[i], start, stop)],
                    [[flat(field[i], start, stop)] for field in buffers],
                    noise,
                )
        flush()

    # What a sampler supplies.
    #: whether the kernel is elementwise, so that it may run on chunks of a tensor
    chunked_kernel: bool = True

    def _state_fields(self, group: dict[str, Any]) -> tuple[str, ...]:
        """The per-parameter state the kernel reads and writes, in its argument order."""
        return ()

    def _init_state(self, group: dict[str, Any], param: Tensor, state: dict[str, Any]) -> None:
        """Create a parameter's state before its first step (default: the kernel does)."""

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
        """Call the sampler's pure kernel: ``(directions, new buffers per field)``."""
        raise NotImplementedError

    # ------------------------------------------------------------------ state
    @property
    def seed(self) -> int:
        """The seed of this chain's noise (drawn from torch's global RNG if not given)."""
        return self._noise.seed

    @property
    def steps_taken(self) -> int:
        """How many steps this optimizer has taken (restored by ``load_state_dict``)."""
        return self._steps

    def state_dict(self) -> dict[str, Any]:
        """``torch.optim.Optimizer.state_dict`` plus ``"sampler": {"seed", "steps"}``.

        The seed and the step counter are the chain's whole random state (see
        ``samplers_as_optim._random``), so loading this dict continues the chain bit for bit.
        """
        state = super().state_dict()
        state[_SAMPLER_KEY] = {"seed": self._noise.seed, "steps": self._steps}
        return state

    def _restore_own_dtype_state(self, state_dict: dict[str, Any]) -> None:
        saved_state = state_dict.get("state", {})
        for group, saved_group in zip(self.param_groups, state_dict["param_groups"], strict=True):
            for param, param_id in zip(group["params"], saved_group["params"], strict=True):
                for key in self.own_dtype_state:
                    value = saved_state.get(param_id, {}).get(key)
                    if isinstance(value, Tensor):
                        self.state[param][key] = value.to(device=param.device, copy=True)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state saved by this class, or by ``torch.optim.SGD``.

        Hyperparameters absent from the saved groups (``num_data`` and ``temperature``
        when migrating from an SGD checkpoint) keep this optimizer's values, and the noise
        stream then keeps this optimizer's seed and step counter.
        """
        state_dict = dict(state_dict)
        sampler = state_dict.pop(_SAMPLER_KEY, None)
        saved_groups = state_dict.get("param_groups", [])
        if len(saved_groups) == len(self.param_groups):
            state_dict["param_groups"] = [
                {**{k: v for k, v in current.items() if k != "params"}, **saved}
                for current, saved in zip(self.param_groups, saved_groups, strict=True)
            ]
        if sampler is not None:
            seed = check_seed(sampler["seed"])
            steps = sampler["steps"]
            if not (isinstance(steps, int) and steps >= 0):
                raise ValueError(
                    f"Invalid saved step counter: {steps!r} (expected an integer >= 0)"
                )
        super().load_state_dict(state_dict)
        self._restore_own_dtype_state(state_dict)
        for index, group in enumerate(self.param_groups):
            self.check_hyperparameters(group, where=_at_group(index))
        if sampler is not None:
            self._noise = NoiseStream(seed)
            self._steps = steps
