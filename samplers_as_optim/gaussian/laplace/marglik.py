r"""Online evidence-based training: the prior and the noise tuned while the network trains.

Immer et al. (2021), Algorithm 1 (laplace-torch's ``marglik_training``). The network is
trained by any torch optimiser on the mean loss of docs/design.md with the current prior
as its penalty,

.. math::

    L(\theta) = \frac1B\sum_{i\in\text{batch}} -\log p(y_i\mid x_i,\theta,\sigma)
    + \frac{1}{2N}\theta^\top\mathrm{diag}(\delta)\,\theta,

so the optimiser itself needs no ``weight_decay``. Every ``frequency`` epochs after
``burnin``, a :class:`~samplers_as_optim.gaussian.laplace.Laplace` is fitted at the
current weights and ``hyper_steps`` Adam steps (rate ``hyper_lr``) on :math:`\log\delta`
(one per layer by default) and :math:`\log\sigma` (regression) maximise its
:meth:`~samplers_as_optim.gaussian.laplace.Laplace.log_marginal_likelihood`; the Adam
state of the hyperparameters carries over between rounds, as in the paper. The weights
of the round with the highest evidence are kept, loaded back into the model at the end,
and the returned Laplace is fitted there with that round's hyperparameters.

References:
    Immer, Bauer, Fortuin, Rätsch & Khan (2021), Scalable marginal likelihood estimation
    for model selection in deep learning, ICML, Algorithm 1 and §3.
    Daxberger et al. (2021), Laplace Redux — effortless Bayesian deep learning, §2.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from ...core.progress import ProgressBar, check_progress
from ...core.validation import (
    check_choice,
    check_learning_rate,
    check_nonnegative_integer,
    check_num_data,
    check_positive_int,
)
from .._data_checks import check_loader
from .._weight_gaussian import batches_on
from . import Laplace
from ._prior_forms import read_prior
from ._prior_search import HyperParameters, check_tune_noise, evidence_steps

__all__ = ["MarglikResult", "marglik_training"]


@dataclass
class MarglikResult:
    """What :func:`marglik_training` returns.

    Attributes:
        laplace: the Laplace approximation fitted at the best weights, with the prior
            precision (and ``noise_std``) of that round.
        state_dict: the model's state at the round with the highest evidence (also
            loaded into the model).
        evidence: the log marginal likelihood after each round's hyperparameter steps.
        losses: the mean training loss (the objective above) of each epoch.
        best_round: the index into ``evidence`` of the kept round.
    """

    laplace: Laplace
    state_dict: dict[str, Any]
    evidence: list[float]
    losses: list[float]
    best_round: int


def _check_optimizer(optimizer: Any, model: nn.Module) -> torch.optim.Optimizer:
    """``optimizer``: None (Adam), or an optimizer over the model's parameters.

    Every parameter it updates must be one of ``model.parameters()`` (by identity); a
    subset is allowed (e.g. the last layer only, the rest staying as they are).
    """
    if optimizer is None:
        return torch.optim.Adam(model.parameters(), lr=1e-3)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"Invalid optimizer: {type(optimizer).__name__} (expected None or a "
            "torch.optim.Optimizer over the model's parameters)"
        )
    owned = {id(param) for param in model.parameters()}
    updated = [param for group in optimizer.param_groups for param in group["params"]]
    foreign = sum(id(param) not in owned for param in updated)
    if foreign or not updated:
        raise ValueError(
            f"Invalid optimizer: {foreign} of {len(updated)} parameters it updates are not "
            "the model's (expected a torch.optim.Optimizer over model.parameters() or a "
            "subset of them: it would train another model's weights, not this one's)"
        )
    decays = [group.get("weight_decay", 0.0) for group in optimizer.param_groups]
    if any(decay != 0.0 for decay in decays):
        raise ValueError(
            f"Invalid optimizer: weight_decay {decays} (expected 0 in every group: the "
            "prior penalty of the tuned prior precision replaces it)"
        )
    return optimizer


class _Plan(NamedTuple):
    """The checked schedule of a run: its epochs, tuning rounds, their steps, the bar."""

    num_epochs: int
    rounds: list[int]
    hyper_steps: int
    hyper_lr: float
    progress: bool


def _check_plan(
    num_epochs: int,
    frequency: int,
    burnin: int,
    hyper_steps: int,
    hyper_lr: float,
    prior_structure: str,
    progress: bool | None,
) -> _Plan:
    """Check the schedule's arguments (and ``prior_structure``), in the signature's order."""
    num_epochs = check_positive_int("num_epochs", num_epochs)
    frequency = check_positive_int("frequency", frequency)
    burnin = check_nonnegative_integer("burnin", burnin)
    hyper_steps = check_positive_int("hyper_steps", hyper_steps)
    hyper_lr = check_learning_rate(hyper_lr)
    if not hyper_lr > 0.0:
        raise ValueError(f"Invalid hyper_lr: {hyper_lr!r} (expected a finite number > 0)")
    rounds = _check_rounds(num_epochs, frequency, burnin)
    check_choice("prior_structure", prior_structure, ("scalar", "layerwise", "diag"))
    return _Plan(num_epochs, rounds, hyper_steps, hyper_lr, check_progress(progress))


@dataclass(frozen=True)
class _LaplaceOf:
    """Every round's Laplace at the model's current weights, but for its prior and noise."""

    model: nn.Module
    num_data: int
    likelihood: str | Callable[[Tensor, Tensor], Tensor]
    curvature: str
    structure: str
    ignore_index: int | None

    def __call__(self, prior: Any, noise: float | None) -> Laplace:
        return Laplace(
            self.model,
            num_data=self.num_data,
            likelihood=self.likelihood,
            noise_std=noise,
            curvature=self.curvature,
            structure=self.structure,
            prior_precision=prior,
            ignore_index=self.ignore_index,
        )


def _check_rounds(num_epochs: int, frequency: int, burnin: int) -> list[int]:
    rounds = [
        epoch for epoch in range(1, num_epochs + 1) if epoch % frequency == 0 and epoch >= burnin
    ]
    if not rounds:
        raise ValueError(
            f"Invalid burnin: {burnin} (expected a tuning round within num_epochs="
            f"{num_epochs} at every frequency={frequency}-th epoch from burnin on)"
        )
    return rounds


class _Run:
    """One ``marglik_training`` run: the epochs, the tuning rounds and the best round."""

    def __init__(
        self,
        model: nn.Module,
        loader: Iterable[Any],
        first: Laplace,
        hyper: HyperParameters,
        optimizer: torch.optim.Optimizer,
        laplace: Callable[[Any, float | None], Laplace],
    ) -> None:
        self.model, self.loader, self.first, self.hyper = model, loader, first, hyper
        self.optimizer, self.laplace = optimizer, laplace
        self.hyper_optimizer: torch.optim.Optimizer | None = None
        self.ref = first._reference()
        params = dict(model.named_parameters())
        self.trained = [params[name] for name in first.treated.names]
        self.first_noise: float | None = first.noise_std
        self.evidence: list[float] = []
        self.losses: list[float] = []
        self.best: tuple[float, dict[str, Any], Any, float | None] | None = None

    def epoch(self, structure: str, num_data: int) -> None:
        """One pass of the optimiser over the loader, the current prior as the penalty."""
        first, hyper = self.first, self.hyper
        with torch.no_grad():
            delta, _ = read_prior(
                hyper.prior().detach(),
                first.treated,
                self.ref,
                structure=structure,
                groups=first._groups,
            )
            noise = hyper.noise()
            self.first_noise = first.noise_std if noise is None else float(noise)
        if noise is not None:
            first.noise_std = float(noise)
        total, count = 0.0, 0
        self.model.train()
        for inputs, targets in batches_on(self.loader, self.ref.device):
            self.optimizer.zero_grad()
            output = self.model(inputs)
            theta = torch.cat([param.reshape(-1) for param in self.trained])
            loss = (
                first.likelihood.nll(output, targets).mean()
                + 0.5 * (delta * theta.square()).sum() / num_data
            )
            loss.backward()  # type: ignore[no-untyped-call]
            self.optimizer.step()
            total += float(loss.detach()) * inputs.shape[0]
            count += inputs.shape[0]
        if count == 0:
            raise ValueError("Invalid loader: it yielded no examples (expected one pass over data)")
        self.losses.append(total / count)

    def tune(self, hyper_steps: int, hyper_lr: float) -> float:
        """A round: fit at the current weights, Adam on the evidence; its value."""
        hyper = self.hyper
        if self.hyper_optimizer is None:
            self.hyper_optimizer = torch.optim.Adam(hyper.parameters(), lr=hyper_lr)
        current = hyper.prior().detach().clone()
        la = self.laplace(current, self.first_noise).fit(self.loader, progress=False)
        evidence_steps(la, hyper, hyper_steps, hyper_lr, False, self.hyper_optimizer)
        with torch.no_grad():
            value = float(la.log_marginal_likelihood(hyper.prior(), hyper.noise()))
        self.evidence.append(value)
        if self.best is None or value > self.best[0]:
            noise_now = hyper.noise()
            self.best = (
                value,
                copy.deepcopy(self.model.state_dict()),
                hyper.prior().detach().clone(),
                None if noise_now is None else float(noise_now.detach()),
            )
        return value

    def run(self, plan: _Plan, structure: str, num_data: int) -> MarglikResult:
        """The epochs, a tuning round after each of ``plan.rounds``, then the result.

        The model's training flag is restored at the end, and on an error.
        """
        training = self.model.training
        try:
            with ProgressBar(plan.progress, plan.num_epochs, "marglik_training") as bar:
                for epoch in range(1, plan.num_epochs + 1):
                    self.epoch(structure, num_data)
                    bar.update()
                    if epoch in plan.rounds:
                        value = self.tune(plan.hyper_steps, plan.hyper_lr)
                        bar.set_postfix(log_marglik=value)
            return self.result()
        finally:
            self.model.train(training)

    def result(self) -> MarglikResult:
        """Load the best round's weights and fit there with its hyperparameters."""
        assert self.best is not None
        value, state, prior, noise_best = self.best
        self.model.load_state_dict(state)
        final = self.laplace(prior, noise_best if noise_best is not None else self.first.noise_std)
        final.fit(self.loader, progress=False)
        return MarglikResult(final, state, self.evidence, self.losses, self.evidence.index(value))


def marglik_training(
    model: nn.Module,
    loader: Iterable[Any],
    *,
    num_data: int,
    likelihood: str | Callable[[Tensor, Tensor], Tensor],
    optimizer: torch.optim.Optimizer | None = None,
    num_epochs: int = 300,
    structure: str = "kron",
    curvature: str = "ggn",
    prior_structure: str = "layerwise",
    prior_precision: float = 1.0,
    noise_std: float | None = None,
    tune_noise: bool | None = None,
    frequency: int = 1,
    burnin: int = 0,
    hyper_steps: int = 100,
    hyper_lr: float = 0.1,
    progress: bool | None = None,
    ignore_index: int | None = None,
) -> MarglikResult:
    r"""Train ``model`` and tune its prior precision (and noise) by the Laplace evidence.

    Before the first epoch every batch of ``loader`` is checked, as one pass yields
    them: one forward per batch without grad, in eval mode, refusing inputs, targets or
    outputs that hold NaN or inf and targets the likelihood refuses (a class index out
    of range), so that no bad batch reaches the weights.

    Args:
        model: the network; trained in place (train mode during the epochs; its training
            flag is restored at the end, and on an error), left at the best round's
            weights.
        loader: ``(inputs, targets)`` batches of the training set, one epoch per pass.
        num_data: N, the number of training examples (required).
        likelihood: ``"classification"``, ``"regression"`` or a callable, as for
            :class:`~samplers_as_optim.gaussian.laplace.Laplace`.
        optimizer: a ``torch.optim.Optimizer`` with ``weight_decay=0`` over the model's
            parameters or a subset of them (every parameter it updates must be one of
            ``model.parameters()``; default: None, ``Adam(model.parameters(), lr=1e-3)``).
        num_epochs: epochs of training (default: 300; an integer >= 1).
        structure: the Laplace structure of every round (default: ``"kron"``;
            ``"lowrank"`` keeps its default ``rank``, min(P, 20), refitted each round).
        curvature: ``"ggn"`` (default) or ``"ef"``.
        prior_structure: ``"layerwise"`` (default: one per layer; with ``"kron"`` a
            layer's weight and bias share it), ``"scalar"`` or ``"diag"`` (not with
            ``"kron"``).
        prior_precision: the initial prior precision (default: 1.0; a number > 0).
        noise_std: the initial σ for regression (default: None, 1.0); None otherwise.
        tune_noise: tune σ too (default: None, True for regression).
        frequency: tune every this many epochs (default: 1; an integer >= 1).
        burnin: epochs before the first tuning (default: 0; an integer >= 0).
        hyper_steps: Adam steps on the hyperparameters per round (default: 100).
        hyper_lr: their learning rate (default: 0.1; a finite number > 0).
        progress: a bar over the epochs (default: None, where standard error is a
            terminal and tqdm is installed).
        ignore_index: as ``Laplace``'s (default: None; padding adds nothing).

    Returns:
        A :class:`MarglikResult`: the fitted Laplace, the best state, the evidence of each
        round and the loss of each epoch.

    Raises:
        ValueError, TypeError: an argument outside the above (an optimizer that updates
            a parameter that is not the model's), ``burnin``, ``frequency`` and
            ``num_epochs`` that leave no round, or a batch of ``loader`` refused by the
            check above (``Invalid loader: batch b ...``); nothing is trained then. With
            ``tune_noise``, a round whose fit reproduces every target exactly (see
            :meth:`Laplace.optimize_prior_precision
            <samplers_as_optim.gaussian.laplace.Laplace.optimize_prior_precision>`).
    """
    num_data = check_num_data(num_data)
    plan = _check_plan(
        num_epochs, frequency, burnin, hyper_steps, hyper_lr, prior_structure, progress
    )
    laplace = _LaplaceOf(model, num_data, likelihood, curvature, structure, ignore_index)
    first = laplace(prior_precision, noise_std)
    hyper = HyperParameters(first, prior_structure, check_tune_noise(first, tune_noise), None)
    optimizer = _check_optimizer(optimizer, model)
    check_loader(model, loader, first.likelihood, first._reference().device)
    return _Run(model, loader, first, hyper, optimizer, laplace).run(plan, structure, num_data)
