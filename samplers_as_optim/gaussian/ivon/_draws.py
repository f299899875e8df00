"""Drawing from IVON's q: the draws ``sampled_params`` puts in the parameters, and samples.

:class:`IVONDraws` is the half of :class:`~samplers_as_optim.gaussian.ivon.IVON` that
puts a draw θ = m + ε from q in the parameters for a with-block and takes it out again
(``sampled_params``): each param group is checked first, ε is drawn from the keyed noise
(``_noise``), and a training draw's gradients are averaged into the running means
the next step reads (``_kernel.accumulate_``). The step, the state and the
checkpoints are the optimizer's (``ivon``). :func:`posterior` and :func:`draw_samples`
read q out in the package's one sample layout: q(θ) = N(m, diag(σ²)), σ² = T / (ess (h +
weight_decay)) per param group (``ivon``'s module docstring), keyed by the parameters'
names, as ``model.named_parameters()`` gives them (``samples/stacked``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ...core.chain import ChainOptimizer, at_group
from ...core.distributed import agree_across_ranks
from ...core.validation import check_bool
from ...names import parameter_name
from ...sgmcmc.step.prefetch import NoisePrefetcher, NoiseRequest
from ._checks import CHANGED_PARAMETERS, COUNTERS, HYPERPARAMETERS
from ._kernel import STATISTIC, accumulate_, perturb_
from ._noise import draw_key, fill_normals, next_training_draws, submit_ahead

__all__ = ["IVONDraws", "draw_samples", "posterior"]


class _GroupDraw(NamedTuple):
    """One param group's part of a draw: its drawn parameters, their means, ε."""

    group_index: int
    group: dict[str, Any]
    params: list[Tensor]
    means: list[Tensor]  # m while the parameters hold the draw
    scratch: list[Tensor]  # ε (at T = 0 nothing: the draw is the mean)
    perturbed: bool


class _Draw(NamedTuple):
    train: bool
    groups: list[_GroupDraw]
    by_step: bool  # opened by step(closure): a sampled_params inside it is a no-op


class IVONDraws(ChainOptimizer):
    """IVON's draws from q in its parameters: ``sampled_params`` and what it rests on.

    Not used directly: :class:`~samplers_as_optim.gaussian.ivon.IVON` builds the groups,
    the state and the runtime (``_reset_runtime``: ``draw``, ``agreed``, ``seed_given``,
    ``checked``, ``buffers``, ``drawn`` and the prefetcher) and validates a group's
    hyperparameters (``check_hyperparameters``); here each group is checked before a draw
    or a step, each parameter's state and work buffers are made, and the draws are put
    in and taken out.
    """

    #: runtime, not the chain's state (rebuilt by ``_reset_runtime``)
    _prefetcher: NoisePrefetcher | None
    #: draws per ``step(closure)``: the prefetcher draws a step's next one ahead
    mc_samples: int

    def _check_group(self, index: int, group: dict[str, Any]) -> None:
        """Validate a group before a draw or a step, again only when a value changed."""
        values = tuple(group[name] for name in HYPERPARAMETERS)
        checked = self._runtime["checked"]
        if checked.get(index) == values:
            return
        self.check_hyperparameters(group, where=at_group(index))
        self._check_precision(index, group)
        if all(type(value) in (int, float, str, bool) for value in values):  # not a tensor
            checked[index] = values

    def _check_precision(self, index: int, group: dict[str, Any]) -> None:
        """Refuse a ``weight_decay`` under which some h + weight_decay is not positive.

        Only h + δ is kept positive by the update, so h may be negative down to -δ; a
        smaller δ set later (a schedule, a new task's prior) would make σ² negative and
        every draw NaN. Checked when a group's hyperparameters change (one read of the
        device), before anything is drawn or stepped.
        """
        delta = float(group["weight_decay"])
        for position, param in enumerate(group["params"]):
            hess = self.state[param].get("hess") if param in self.state else None
            if hess is None or hess.numel() == 0:
                continue
            lowest = float(hess.min())
            if not lowest + delta > 0:
                raise ValueError(
                    f"Invalid weight_decay{at_group(index)}: {delta!r} (expected a value "
                    f"with h + weight_decay > 0 for every weight: parameter {position}'s "
                    f"Hessian estimate h reaches {lowest:.6g}, which the weight decay it was "
                    "learnt with kept positive; nothing was changed)"
                )

    def _refuse_inside_draw(self, what: str) -> None:
        if self._runtime["draw"] is not None:
            raise RuntimeError(
                f"IVON: {what} inside sampled_params(), where the parameters hold a draw "
                "rather than the mean; call it after the with-block"
            )

    def _state_of(self, param: Tensor, group: dict[str, Any]) -> dict[str, Any]:
        state: dict[str, Any] = self.state[param]
        if "momentum" not in state:
            state["momentum"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["hess"] = torch.full_like(param, float(group["hess_init"]))
        return state

    def _buffers(self, params: list[Tensor]) -> tuple[list[Tensor], list[Tensor]]:
        """Each parameter's two work buffers (kept between steps; not the run's state)."""
        buffers = self._runtime["buffers"]
        for param in params:
            pair = buffers.get(id(param))
            if pair is None or pair[0].shape != param.shape or pair[0].dtype != param.dtype:
                buffers[id(param)] = [
                    torch.empty_like(param, memory_format=torch.contiguous_format) for _ in range(2)
                ]
        pairs = [buffers[id(param)] for param in params]
        return [pair[0] for pair in pairs], [pair[1] for pair in pairs]

    # ------------------------------------------------------------------ drawing weights
    @contextmanager
    def sampled_params(self, train: bool = False) -> Iterator[None]:
        """Put a draw θ = m + ε from q into the parameters for the with-block.

        The parameters are perturbed in place and restored to the mean m (exactly) on
        exit, also when the block raises. With ``train=True`` the gradients the block
        leaves in ``.grad`` (None counts as zero) are averaged into the next
        :meth:`step`; a block that raises contributes nothing. Parameters with
        ``requires_grad=False`` are left alone.

        Args:
            train: whether this draw's gradients feed the next step (default: False:
                prediction; such draws have numbers of their own, so evaluating between
                steps does not change the training run).

        Raises:
            RuntimeError: inside another ``sampled_params`` (except inside
                ``step(closure)``, where it is the step's own draw), or the parameters
                that require gradients changed between two training draws of a step.
            ValueError: a param group holds an invalid hyperparameter.
        """
        train = check_bool("train", train)
        active = self._runtime["draw"]
        if active is not None and active.by_step:
            yield  # a closure written for ivon-opt opens its own: the step's draw is it
            return
        with self._draw(train, by_step=False):
            yield

    @contextmanager
    def _draw(self, train: bool, *, by_step: bool) -> Iterator[None]:
        self._refuse_inside_draw("sampled_params()")
        draw = self._perturb(train, by_step)
        self._runtime["draw"] = draw
        try:
            yield
        finally:
            self._runtime["draw"] = None
            with torch.no_grad():
                for part in draw.groups:
                    if part.perturbed:
                        torch._foreach_copy_(part.params, part.means)
        self._finish(draw)

    @torch.no_grad()
    def _perturb(self, train: bool, by_step: bool) -> _Draw:
        """Put a draw in every group's parameters; all checks come first.

        A failure while drawing puts back what was drawn already, so a draw that raises
        leaves every parameter at its mean.
        """
        if not self._runtime["agreed"]:
            self._agree_across_ranks()
        plans = []
        for index, group in enumerate(self.param_groups):
            self._check_group(index, group)
            params = [p for p in group["params"] if p.requires_grad]
            if params:
                keys = self._noise_keys(params) if float(group["temperature"]) > 0 else []
                plans.append((index, group, params, keys))
        prefetcher = self._prefetcher
        if prefetcher is not None:
            prefetcher.wait()
        parts: list[_GroupDraw] = []
        ahead: list[NoiseRequest] = []
        try:
            for index, group, params, keys in plans:
                hess = [self._state_of(p, group)["hess"] for p in params]
                means, scratch = self._buffers(params)
                if not keys:  # T = 0 ("gradsq" only): the draw is the mean
                    parts.append(_GroupDraw(index, group, params, means, scratch, False))
                    continue
                seed, step, count = group["seed"], group["step"], group[COUNTERS[not train]]
                requests = [
                    NoiseRequest(p, seed, step, draw_key(k, train=train, index=count), self._shard)
                    for p, k in zip(params, keys, strict=True)
                ]
                fill_normals(self._stream(seed), prefetcher, requests, scratch)
                for param, normals in zip(params, scratch, strict=True):  # maybe the worker's
                    self._runtime["buffers"][id(param)][1] = normals
                perturb_(
                    params,
                    means,
                    scratch,
                    hess,
                    weight_decay=float(group["weight_decay"]),
                    ess=float(group["ess"]),
                    temperature=float(group["temperature"]),
                )
                parts.append(_GroupDraw(index, group, params, means, scratch, True))
                self._record_noise_keys(params)
                if train and prefetcher is not None:  # the next: this step's or the next's
                    ahead += next_training_draws(
                        params, keys, seed, step, count, self.mc_samples, self._shard
                    )
        except BaseException:
            for part in parts:
                if part.perturbed:
                    torch._foreach_copy_(part.params, part.means)
            raise
        if prefetcher is not None:
            submit_ahead(prefetcher, ahead)
        return _Draw(train, parts, by_step)

    @torch.no_grad()
    def _finish(self, draw: _Draw) -> None:
        """After a draw's block ended normally: accumulate its gradients, count it.

        Everything is checked for every group before any group accumulates.
        """
        if not draw.train:
            for part in draw.groups:
                part.group["eval_draws"] += 1
            return
        drawn = self._runtime["drawn"]
        checked = []
        for part in draw.groups:
            count = part.group["train_draws"] + 1
            members = tuple(id(p) for p in part.params)
            key = STATISTIC[part.group["hess_approx"]]
            states = [self.state[p] for p in part.params]
            if count > 1 and (
                drawn.get(part.group_index, members) != members
                or not all(key in state for state in states)
            ):
                raise RuntimeError(CHANGED_PARAMETERS)
            grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in part.params]
            if any(g.is_sparse for g in grads):
                raise TypeError("IVON does not support sparse gradients (use sparse=False)")
            checked.append((part, count, members, key, states, grads))
        for part, count, members, key, states, grads in checked:
            drawn[part.group_index] = members
            if count == 1:
                for state, param in zip(states, part.params, strict=True):
                    if "avg_grad" not in state:
                        state["avg_grad"] = torch.empty_like(param)
            old = [state.get(key) for state in states]
            stats = accumulate_(
                [state["avg_grad"] for state in states],
                old,  # read only after the first draw
                grads,
                part.scratch,
                count=count,
                hess_approx=part.group["hess_approx"],
            )
            if count == 1:  # the scratch now holds the statistic: swap the buffers
                buffers = self._runtime["buffers"]
                for state, param, stat, previous in zip(
                    states, part.params, stats, old, strict=True
                ):
                    state[key] = stat
                    buffers[id(param)][1] = torch.empty_like(stat) if previous is None else previous
            part.group["train_draws"] = count

    def _agree_across_ranks(self) -> None:
        """Under ``torch.distributed``, agree on the seeds once (``core/distributed``)."""
        self._noise_keys([])
        agreement = agree_across_ranks(
            [group["seed"] for group in self.param_groups],
            [group["step"] for group in self.param_groups],
            [[tuple(p.shape) for p in group["params"]] for group in self.param_groups],
            given=self._runtime["seed_given"],
            named=self._runtime["all_named"],
        )
        for group, seed in zip(self.param_groups, agreement.seeds, strict=True):
            group["seed"] = seed
        self._runtime.update(shard=agreement.shard, agreed=True)


def posterior(
    param_groups: Sequence[dict[str, Any]],
    state: Mapping[Tensor, dict[str, Any]],
    saved: Mapping[int, Tensor],
) -> list[tuple[str, Tensor, Tensor]]:
    """(name, m, σ) of every parameter that requires a gradient, new tensors.

    Args:
        param_groups: the optimizer's param groups.
        state: its per-parameter state (``"hess"``; h₀ = ``hess_init`` where none yet).
        saved: the means of the parameters that hold a draw, by ``id``.

    Raises:
        ValueError: a parameter has no name (from ``named_parameters()`` or
            ``name_parameters``).
    """
    found = []
    for index, group in enumerate(param_groups):
        names = group.get("param_names")
        for position, param in enumerate(group["params"]):
            if not param.requires_grad:
                continue
            name = names[position] if names else parameter_name(param)
            if name is None:
                raise ValueError(
                    f"IVON: parameter {position} of param group {index} has no name, and the "
                    "sample layout is keyed by names (expected an optimizer built from "
                    "model.named_parameters(), or name_parameters(model) first)"
                )
            hess = state.get(param, {}).get("hess")
            if hess is None:
                hess = torch.full_like(param, float(group["hess_init"]))
            precision = (hess.detach() + float(group["weight_decay"])) * float(group["ess"])
            std = (float(group["temperature"]) / precision).sqrt()
            found.append((name, saved.get(id(param), param).detach().clone(), std))
    return found


def draw_samples(
    parts: list[tuple[str, Tensor, Tensor]], n: int, generator: torch.Generator | None
) -> dict[str, Tensor]:
    """Draw n samples m + σ ξ of each (name, m, σ): name -> ``[n, *shape]``."""
    out = {}
    for name, mean, std in parts:
        noise = torch.randn(
            (n, *mean.shape), generator=generator, dtype=mean.dtype, device=mean.device
        )
        out[name] = torch.addcmul(mean.unsqueeze(0), noise, std.unsqueeze(0))
    return out
