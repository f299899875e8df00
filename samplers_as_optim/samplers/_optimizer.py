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

from .._random import NoiseStream, seed_from_global_rng
from .._validation import (
    check_bool,
    check_foreach,
    check_learning_rate,
    check_nonnegative,
    check_num_data,
    check_seed,
    check_temperature,
)
from ._common import default_foreach

__all__ = ["SamplerOptimizer"]

_SAMPLER_KEY = "sampler"


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
    ``_update_group``.
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

        Fast path: the sum of per-tensor L2 norms (one foreach reduction and one host
        synchronisation per device and dtype) is finite exactly when every gradient is,
        except when it overflows; only then are the tensors checked one by one.
        """
        by_kind: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
        for _, _, _, grads in gathered:
            for grad in grads:
                by_kind.setdefault((grad.device, grad.dtype), []).append(grad)
        suspect = False
        for grads in by_kind.values():
            total = torch.stack(torch._foreach_norm(grads)).sum()
            if not bool(torch.isfinite(total)):
                suspect = True
                break
        if not suspect:
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
            noise = None
            if temperature > 0:
                noise = self._noise.standard_normal(params, step=self._steps, stream=index)
            foreach = group["foreach"]
            if foreach is None:
                foreach = default_foreach(params)
            self._update_group(
                group, params, grads, noise, lr=lr, temperature=temperature, foreach=foreach
            )
        self._steps += 1
        return loss

    def _update_group(
        self,
        group: dict[str, Any],
        params: list[Tensor],
        grads: list[Tensor],
        noise: list[Tensor] | None,
        *,
        lr: float,
        temperature: float,
        foreach: bool,
    ) -> None:
        """Call the sampler's kernel on one group's parameters with a gradient and step."""
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
