"""The chain core every sampler's ``torch.optim`` front end shares: seed, step, noise keys.

:class:`ChainOptimizer` is the base of both front ends, ``SamplerOptimizer`` (SGLD,
SGHMC, SGNHT, PSGLD, BAOA) and ``HMC``: what a chain is, as opposed to how a sampler
moves it (``docs/design.md``, "Noise: a pure function of (seed, step, key, position)").

The chain's random state is two integers per param group, ``group["seed"]`` and
``group["step"]`` (the noise of a step is a pure function of them, see
``samplers_as_optim.core.streams``). They live in the param groups rather than beside them
because every wrapper that saves an optimizer keeps its param groups:
``ZeroRedundancyOptimizer`` rebuilds its consolidated ``state_dict`` from them and syncs
them to each rank's optimizer on load, Lightning and the HF ``Trainer`` save
``state_dict()`` as is, and ``copy.deepcopy``/``pickle`` go through ``__getstate__``,
which holds only ``defaults``, ``state`` and ``param_groups``.

What identifies a parameter's noise travels with the parameter's own state instead:
``state["noise_key"]``, a 0-d int64 tensor on the CPU holding the key it is drawn with
(``samplers_as_optim.core.streams``), written once the parameter's noise has been drawn
(an SG-MCMC sampler's first step at a positive temperature, HMC's first transition). The
key is derived once, from the parameter's name or its position among the optimizer's
parameters; once stored it is used as is, so a state saved by an optimizer built from
``parameters()`` and loaded into one built from ``named_parameters()`` (or the reverse, or
onto tensors that carry other names) goes on drawing the numbers it drew. Per-parameter
state, unlike a list in a param group, is what every wrapper moves with its parameter
(``ZeroRedundancyOptimizer`` hands each rank its parameters' states, FSDP's and DCP's
state dicts key it by the parameter's name). A parameter whose state holds no key (a
checkpoint written before they were stored; a parameter that has not drawn noise yet) is
keyed by this optimizer's names or positions, as before. Nor is a key stored where the
ranks of a sharded optimizer key unnamed parameters by their place in the rank's share
and the rank (``samplers_as_optim.core.distributed``): such a key identifies a parameter
on that rank only.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from ..names import parameter_name
from .streams import NoiseStream, key_from_int64, key_to_int64, parameter_key
from .validation import (
    check_nonnegative_integer,
    check_seed,
    check_step_counter,
    user_stacklevel,
)

__all__ = [
    "CHAIN_KEYS",
    "NOISE_KEY",
    "ChainOptimizer",
    "at_group",
    "check_representable",
    "check_saved_noise_key",
    "stored_noise_key",
    "valid_noise_key",
]

#: the param-group entries that hold the chain's random state
CHAIN_KEYS = ("seed", "step")
#: the per-parameter entry that holds the key of the parameter's noise
NOISE_KEY = "noise_key"


def at_group(index: int) -> str:
    """Where a message locates param group ``index``: ``" in param group 1"``."""
    return f" in param group {index}"


class ChainOptimizer(Optimizer):
    """The chain machinery of every sampler's ``torch.optim`` front end; not used directly.

    It keeps the chain's random state in the param groups (``seed`` and ``step``, given a
    group added later from the optimizer's), validates it wherever a group enters, caches
    one :class:`~samplers_as_optim.core.streams.NoiseStream` per seed, and keys each
    parameter's noise: from the key its state holds, else its name, else its index, and
    records the key in its state once drawn with (see the module docstring).

    A subclass implements :meth:`check_hyperparameters`, calls
    :meth:`_reset_chain_runtime` wherever it (re)builds what is not the chain's state (at
    construction, after ``load_state_dict`` and unpickling), calls
    :meth:`_record_noise_keys` with the parameters whose noise a step drew, and in its
    ``load_state_dict`` checks the saved chain before anything changes
    (:meth:`_hold_chain_state`, :meth:`_check_chain_state`, :func:`check_saved_noise_key`;
    or :meth:`_check_saved_chain` for all of them) and after torch's ``load_state_dict``
    calls :meth:`_restore_noise_keys`.
    """

    #: runtime, not the chain's state (see ``_reset_chain_runtime``)
    _streams: dict[int, NoiseStream]
    _keys: dict[int, int]
    _runtime: dict[str, Any]

    def _reset_chain_runtime(self) -> None:
        """Forget the noise streams and keys; an unsharded chain, every parameter named.

        What the step itself updates lives in dicts (``_keys``, ``_runtime``), never in
        attributes assigned during the step: TorchDynamo traces dict mutations of an
        optimizer, not (in every torch version) attribute assignments. ``_runtime`` holds
        ``"shard"`` (this rank's index where sharded ranks key unnamed parameters by
        their place in the rank's share, else None) and ``"all_named"`` (whether every
        key is unique across ranks); a subclass may add entries of its own.
        """
        self._streams = {}
        self._keys = {}  # empty: not derived yet
        self._runtime = {"shard": None, "all_named": True}

    # ------------------------------------------------------------------ validation
    @classmethod
    def check_hyperparameters(cls, group: dict[str, Any], *, where: str = "") -> None:
        """Validate one param group's hyperparameters (a subclass says which).

        ``where`` locates the group in the messages (``" in param group 1"``).
        """
        raise NotImplementedError

    @staticmethod
    def _check_chain_state(group: dict[str, Any], *, where: str, step_tensor: bool = False) -> None:
        """Raise unless a group's ``seed`` and ``step`` are valid (the chain's state).

        ``step_tensor``: a step counter may be a 0-d integer tensor (a capturable step's).
        """
        check_seed(group["seed"], where=where)
        step = group["step"]
        if isinstance(step, Tensor) and step_tensor:
            check_step_counter(step, where=where)  # (read: not in a step that is captured)
        else:
            check_nonnegative_integer("step", step, where=where)

    @staticmethod
    def _hold_chain_state(groups: Iterable[dict[str, Any]]) -> bool:
        """Whether every one of (saved) ``groups`` holds the chain's ``seed`` and ``step``."""
        return all(key in group for group in groups for key in CHAIN_KEYS)

    def _check_saved_chain(self, state_dict: dict[str, Any]) -> None:
        """Raise unless a saved state's chain is valid: each group's seed and step, each key.

        Before anything is loaded; the groups must hold the chain's state (see
        :meth:`_hold_chain_state`). Entries of the saved state that are not a parameter's
        (an optimizer-level entry) hold no ``"noise_key"`` and pass.
        """
        for index, group in enumerate(state_dict.get("param_groups", [])):
            self._check_chain_state(group, where=at_group(index))
        for param_id, entries in state_dict.get("state", {}).items():
            if isinstance(entries, dict) and NOISE_KEY in entries:
                check_saved_noise_key(param_id, entries[NOISE_KEY])

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Validate a param group, then add it as ``torch.optim.Optimizer`` does.

        Nothing is added, and the dict given is left as it was, when a value is invalid.
        A group added after some steps starts at the current step counter and, unless it
        names its own ``seed``, the optimizer's seed.
        """
        chain: dict[str, Any] = {}
        if isinstance(param_group, dict):
            where = at_group(len(getattr(self, "param_groups", [])))
            if getattr(self, "param_groups", None):
                chain = {"step": self.steps_taken, "seed": self.seed}
                chain = {k: v for k, v in chain.items() if k not in param_group}
            candidate = {**self.defaults, **chain, **param_group}
            self.check_hyperparameters(candidate, where=where)
            self._check_chain_state(candidate, where=where)
        super().add_param_group(param_group)
        self.param_groups[-1].update(chain)  # (into the group once it is accepted)
        self._warn_if_prior_ignored(self.param_groups[-1], len(self.param_groups) - 1)

    def _warn_if_prior_ignored(self, group: dict[str, Any], index: int) -> None:
        """Warn where a group's prior is in ``"prior_weight_decay"``, which only the twin reads."""
        decay = group.get("prior_weight_decay", 0)
        if "prior_weight_decay" in self.defaults or not decay:
            return
        if float(group.get("temperature", 1.0)) > 0 and not group.get("weight_decay"):
            warnings.warn(
                f"{type(self).__name__} ignores prior_weight_decay {decay!r}"
                f"{at_group(index)}: it is the prior of an optimizer whose weight_decay is "
                "decoupled (prior_param_groups(..., decoupled=True), for AdamWSGHMC), and "
                "with weight_decay 0 this sampler's prior is only what the loss holds. Give "
                "it prior_param_groups(model, num_data=N) (the prior as its weight_decay), "
                "or add prior_loss(model, num_data=N) to the loss.",
                UserWarning,
                stacklevel=user_stacklevel(),
            )

    # ------------------------------------------------------------------ the chain's state
    @property
    def seed(self) -> int:
        """The seed of this chain's noise (drawn from torch's global RNG if not given).

        Every param group holds it as ``group["seed"]``; this is the first group's.
        """
        return int(self.param_groups[0]["seed"])

    @property
    def steps_taken(self) -> int:
        """How many steps this optimizer has taken (restored by ``load_state_dict``)."""
        return max(int(group["step"]) for group in self.param_groups)

    @property
    def _shard(self) -> int | None:
        """This rank's index when sharded ranks update different, unnamed parameters."""
        shard: int | None = self._runtime["shard"]
        return shard

    def _stream(self, seed: int) -> NoiseStream:
        """The noise stream of ``seed`` (one per seed, kept)."""
        stream = self._streams.get(seed)
        if stream is None:
            stream = self._streams[seed] = NoiseStream(seed)
        return stream

    # ------------------------------------------------------------------ noise keys
    def _noise_keys(self, params: list[Tensor]) -> list[int]:
        """Each parameter's noise key (see ``samplers_as_optim.core.streams``).

        The key its state holds (``state["noise_key"]``, see the module docstring); for a
        parameter whose state holds none, from its name where the optimizer was given
        names (``named_parameters()``) or the tensor carries one
        (:func:`~samplers_as_optim.name_parameters`), else from its index among all the
        optimizer's parameters, in group order. Derived once per parameter (the step
        reads no tensor back once they are known).
        """
        keys = self._keys
        if keys:
            try:
                return [keys[id(param)] for param in params]
            except KeyError:  # (a parameter not keyed yet)
                pass
        self._derive_noise_keys()  # (every parameter's: ``_noise_keys([])`` derives them)
        return [keys[id(param)] for param in params]

    def _derive_noise_keys(self) -> None:
        """Key every parameter not keyed yet; note whether every key is unique.

        A key is unique across the ranks of a sharded optimizer when it comes from a name,
        or from a state: a key is stored only where it is unique (see
        ``_record_noise_keys``).
        """
        unique = True
        index = 0
        owners: dict[int, str] = {}
        for group_index, group in enumerate(self.param_groups):
            names = group.get("param_names")
            for position, param in enumerate(group["params"]):
                where = f"{at_group(group_index)}, parameter {position}"
                state = self.state.get(param)
                stored = None if state is None else state.get(NOISE_KEY)
                if stored is not None:
                    key = stored_noise_key(stored, where=where)
                    label = "its stored noise key"
                else:
                    identity = names[position] if names else parameter_name(param)
                    if identity is None:
                        identity = index
                        unique = False
                    key = parameter_key(identity)
                    label = repr(identity)
                key = self._keys.setdefault(id(param), key)
                owner = f"parameter {position} ({label}){at_group(group_index)}"
                _refuse_shared_key(owners, key, owner)
                index += 1
        self._runtime["all_named"] = unique

    def _record_noise_keys(
        self, params: list[Tensor], scratch: dict[str, Any] | None = None
    ) -> None:
        """Keep each parameter's noise key in its state, once its noise has been drawn.

        Not where the ranks of a sharded optimizer key unnamed parameters by their place
        in the rank's share (with the rank): such a key does not identify the parameter
        outside that rank. ``scratch`` (a step's plan's, unless a skip may put back new
        state entries) keeps the ids of the parameters known to hold theirs.
        """
        recorded = None if scratch is None else scratch.setdefault("noise_keys", set())
        if self._shard is not None or (recorded and recorded.issuperset(map(id, params))):
            return
        missing = [param for param in params if NOISE_KEY not in self.state[param]]
        for param, key in zip(missing, self._noise_keys(missing), strict=True):
            self.state[param][NOISE_KEY] = torch.tensor(key_to_int64(key), dtype=torch.int64)
        if recorded is not None:
            recorded.update(map(id, params))

    def _restore_noise_keys(self, state_dict: dict[str, Any]) -> None:
        """Undo torch's cast of the saved noise keys to the parameter's dtype and device.

        ``torch.optim.Optimizer.load_state_dict`` casts every floating or integer state
        tensor to its parameter's dtype and device (a float32 key loses bits); each key
        becomes a copy of the saved int64 tensor on the CPU again (a saved None: none).
        """
        saved_state = state_dict.get("state", {})
        for group, saved_group in zip(self.param_groups, state_dict["param_groups"], strict=True):
            for param, param_id in zip(group["params"], saved_group["params"], strict=True):
                saved = saved_state.get(param_id) or {}
                if NOISE_KEY not in saved:
                    continue
                value = saved[NOISE_KEY]
                if value is None:
                    self.state[param].pop(NOISE_KEY, None)
                elif isinstance(value, Tensor):
                    self.state[param][NOISE_KEY] = value.detach().to(device="cpu", copy=True)


def _refuse_shared_key(owners: dict[int, str], key: int, owner: str) -> None:
    """Raise if another parameter holds ``key`` (one name twice): they would share noise."""
    other = owners.setdefault(key, owner)
    if other != owner:
        raise ValueError(
            f"Invalid params: {other} and {owner} have the same noise key (expected "
            "distinct names: a sampler keys each parameter's noise by its name, and two "
            "parameters of one name would draw the same noise; name them apart, e.g. "
            "model.named_parameters(prefix='...') or one nn.ModuleDict of the modules)"
        )


def valid_noise_key(value: Any) -> bool:
    """Whether ``value`` is a noise key as a state holds it: a 0-dim int64 tensor."""
    return isinstance(value, Tensor) and value.dtype == torch.int64 and value.dim() == 0


def stored_noise_key(value: Any, *, where: str = "") -> int:
    """The key a state's ``"noise_key"`` holds (a 0-d int64 tensor); ValueError otherwise."""
    if not valid_noise_key(value):
        raise ValueError(
            f"Invalid state{where}: 'noise_key' is {value!r} (expected a 0-dim int64 tensor, "
            "the key of the parameter's noise; a loader that casts per-parameter state to "
            "the parameter's dtype loses it: load with this optimizer's load_state_dict, or "
            "delete the entry to key the noise by this optimizer's names or positions)"
        )
    return key_from_int64(int(value))


def check_saved_noise_key(param_id: Any, value: Any) -> None:
    """Raise unless a saved state's ``"noise_key"`` of parameter ``param_id`` is valid."""
    if not valid_noise_key(value):
        raise ValueError(
            f"Invalid state_dict: 'noise_key' of parameter {param_id} is {value!r} "
            "(expected a 0-dim int64 tensor: the key of the parameter's noise, as "
            "the samplers store it; delete the entry to key the noise by this "
            "optimizer's names or positions)"
        )


def check_representable(group: dict[str, Any], params: list[Tensor], *, where: str) -> None:
    r"""Raise unless the step's scalars fit the parameters' dtypes (before anything changes).

    A kernel passes ``lr``, ``weight_decay`` and its noise scale to torch as scalars of
    the parameters' dtype; one that overflows it fails in the middle of a step. Every
    SG-MCMC sampler's noise scale is at most :math:`\sqrt{2T/(N\,lr)}` (SGLD's; SGHMC's and
    SGNHT's carry a factor :math:`1-\mu \le 1`), which is what is checked (HMC, which has
    no such scale, passes ``temperature=0``).
    """
    lr, temperature = float(group["lr"]), float(group["temperature"])
    for dtype in {param.dtype for param in params}:
        largest = torch.finfo(dtype).max
        for name in ("lr", "weight_decay"):
            if abs(float(group[name])) > largest:
                raise ValueError(
                    f"Invalid {name}{where}: {group[name]!r} (expected a value that fits "
                    f"{dtype}, at most {largest:.3g})"
                )
        if temperature > 0 and lr > 0:
            scale = math.sqrt(2.0 * temperature / (group["num_data"] * lr))
            if not scale <= largest:
                raise ValueError(
                    f"Invalid temperature{where}: {group['temperature']!r} (expected a value "
                    f"whose noise scale sqrt(2 T / (N lr)) = {scale:.3g} fits {dtype}, at "
                    f"most {largest:.3g})"
                )
