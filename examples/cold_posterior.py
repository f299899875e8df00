"""Cold posterior effect (posteriors paper, Section 5.1 and Appendix D), on digits.

Reproduces, at laptop scale, Figure 4 of the posteriors paper (Duffield et al. 2024): the
test loss of approximate Bayesian methods as the posterior is tempered,
``p_T(θ | D) ∝ (p(D | θ) p(θ))^(1/T)``, from T = 1e-3 (nearly optimisation) to T = 1 (the
Bayesian posterior). The paper trains a 2.7M-parameter CNN-LSTM on IMDB; here a one-hidden-
layer MLP learns scikit-learn's handwritten digits. Every method uses the same split,
initialisation, batch order and prior N(0, σ²) on every weight, written once
(``PRIOR_STD``) and passed in each method's units: ``weight_decay = 1 / (N σ²)`` for SGD,
SGHMC and IVON, ``prior_precision = 1 / σ²`` for Laplace, ``prior_std = σ`` for VI, the
penalty ``|θ|² / (2 N σ²)`` in the loss for the AdamW twin.

* **MAP (SGD)**: ``torch.optim.SGD``; a baseline that does not depend on T.
* **Deep ensemble**: ``ParallelEnsemble`` + SGD, K members from K initialisations, each
  member on its own shuffles; also independent of T.
* **Laplace EF / GGN**: diagonal ``Laplace`` around the MAP with the empirical Fisher or
  the generalised Gauss-Newton, covariance T Λ⁻¹; predictions by Laplace's default, the
  GLM (linearised) predictive ``predict(x)``; from weight samples ("(sampled)",
  ``predict(linear=False)``); and by the closed-form probit GLM predictive ("(probit)",
  ``predictive(x)``; GGN only).
* **Laplace KFAC**: ``Laplace(structure="kron")``, the GGN's Kronecker factors per layer
  (Ritter et al. 2018): the GLM predictive, sampled, or probit.
* **Last-layer Laplace**: ``Laplace(structure="dense", subset="last_layer")``, the dense
  GGN over the output layer with the hidden layer fixed at the MAP (Kristiadi et al.
  2020); linear in the sampled weights, so sampled and GLM draws are one predictive; and
  its probit ("Last-layer (probit)").
* **VI**: ``MeanFieldVI`` started at the MAP (standard deviations 1e-3), one draw per
  step, stick-the-landing; Adam, learning rate 3e-2 cosine-annealed to 0.
* **Serial SGHMC**: one ``SGHMC`` chain with SGD's learning rate and momentum; burn-in,
  then one sample every 2 epochs (``SampleCollector``).
* **Parallel SGHMC**: ``ParallelEnsemble`` + ``SGHMC`` (the paper's "Bayesian deep
  ensemble"), K chains from the deep ensemble's initialisations and batches; their final
  states. At T = 0 it is the deep ensemble exactly.
* **AdamW twin**: ``AdamWSGHMC``, SGHMC preconditioned by Adam's second moment, one
  chain as serial SGHMC's (same start, batches, burn-in and samples); AdamW's arguments
  with lr 3e-3 (AdamW's default 1e-3 leaves quick mode's 40 epochs short of the MAP; 1e-2
  did better still at every T in quick mode, not tuned further), ``weight_decay=0`` and
  the prior in the loss (AdamW's decoupled decay would be the prior N(0, 1/(N λ a)),
  ``a`` the preconditioner, not the isotropic one the others have); the preconditioner
  frozen halfway through the burn-in. At T = 0 it is AdamW.
* **IVON**: the improved variational online Newton optimizer (Shen et al. 2024), from
  the MAP's initialisation and batches, as long as the MAP; ``ess`` = N, its weight
  decay the prior, one training draw per step, its ``temperature`` the target's; lr 0.2
  and ``hess_init`` 0.5 (from ivon-opt's recommended ranges), ``beta2`` 0.999 instead
  of 0.99999 (in 10^3 steps the Hessian estimate would not leave ``hess_init``; 0.99
  was unstable at T >= 0.1, as ivon-opt 0.1.3 itself is there, and in one seed of eight
  at T = 0.01). Predictions from the draws of its posterior.

The Bayesian model average of every method goes through ``call_stacked`` (or the
ensemble's forward) and ``predictive.classification``; the metrics are ``predictive.nll``
and ``predictive.accuracy`` on the test set.

Setup: digits split 70/30, stratified (1257 training, 540 test images); MLP 64-128-10,
ReLU; batch 64; SGD and SGHMC with lr 0.1 and momentum 0.9 (SGD units; SGHMC's step is
√(lr/N)); prior σ = 1. Full mode: 7 temperatures log-spaced from 1e-3 to 1; the MAP, the
ensemble and each parallel chain run 100 epochs, K = 10; serial SGHMC runs 50 epochs of
burn-in and keeps 25 samples, one every 2 epochs (100 epochs, one parallel chain's
length; the AdamW twin as serial SGHMC); VI 200 epochs, IVON 100; Laplace, VI and IVON
predict from 100 weight draws. Quick mode: 4 temperatures (1e-3, 1e-2, 0.1, 1), 40
epochs (IVON too), K = 5, serial 20 + 10 x 2 epochs, VI 40 epochs, 32 draws.
``--seed`` picks the split, the initialisations, the batches and the noise; the chains
at different temperatures share their noise, scaled by √T.

Run:
    ``python examples/cold_posterior.py --quick`` (about 30 s on one CPU core) or without
    ``--quick`` (about 3 min: the AdamW twin and IVON add about 70 s to the 100 s of the
    others; 5 to 7 min of wall time on a busy shared 2-core machine); ``--output`` names
    the figure (default
    ``examples/output/cold_posterior.png``): test NLL (log scale) and accuracy against T,
    one line per method, MAP and the deep ensemble as horizontal lines. Tables of test NLL
    and accuracy are printed.

Results (full mode, seeds 0, 1, 2: mean ± standard deviation over seeds; 4 of the 7
temperatures). Test NLL of the Bayesian model average (the seed-to-seed spread is mostly
the split's; differences between methods within a seed are much steadier):

    ======================  =============  =============  =============  =============
    method                  T = 0.001      T = 0.01       T = 0.1        T = 1
    ======================  =============  =============  =============  =============
    MAP (SGD)               0.090 ± 0.012  (any T)
    Deep ensemble           0.088 ± 0.015  (any T)
    Laplace EF (sampled)    0.093 ± 0.012  0.126 ± 0.012  0.760 ± 0.020  2.120 ± 0.025
    Laplace EF              0.092 ± 0.012  0.111 ± 0.012  0.394 ± 0.015  1.308 ± 0.001
    Laplace GGN (sampled)   0.091 ± 0.012  0.104 ± 0.012  0.408 ± 0.018  1.979 ± 0.033
    Laplace GGN             0.091 ± 0.012  0.098 ± 0.012  0.207 ± 0.006  0.959 ± 0.013
    Laplace GGN (probit)    0.091 ± 0.012  0.095 ± 0.011  0.168 ± 0.007  0.792 ± 0.010
    Laplace KFAC (sampled)  0.091 ± 0.012  0.098 ± 0.011  0.374 ± 0.005  1.944 ± 0.044
    Laplace KFAC            0.090 ± 0.012  0.091 ± 0.012  0.107 ± 0.011  0.390 ± 0.005
    Laplace KFAC (probit)   0.090 ± 0.012  0.092 ± 0.012  0.111 ± 0.011  0.401 ± 0.008
    Last-layer Laplace      0.090 ± 0.012  0.090 ± 0.012  0.093 ± 0.012  0.144 ± 0.016
    Last-layer (probit)     0.090 ± 0.012  0.091 ± 0.012  0.097 ± 0.012  0.200 ± 0.011
    VI                      0.081 ± 0.012  0.082 ± 0.013  0.086 ± 0.012  0.120 ± 0.011
    Serial SGHMC            0.090 ± 0.013  0.088 ± 0.014  0.091 ± 0.006  0.115 ± 0.012
    Parallel SGHMC          0.088 ± 0.015  0.087 ± 0.015  0.085 ± 0.019  0.097 ± 0.024
    AdamW twin              0.090 ± 0.014  0.089 ± 0.014  0.097 ± 0.015  0.140 ± 0.016
    IVON                    0.101 ± 0.007  0.102 ± 0.021  0.110 ± 0.026  0.118 ± 0.023
    ======================  =============  =============  =============  =============

All rows were re-run together (2026-11-26, the current package). "Laplace X" is the
default predictive, the GLM's (``predict``: 100 linearised draws); "(sampled)" samples
weights (``predict(linear=False)``); "(probit)" is the closed-form probit GLM predictive
(``predictive(x)``). Against the earlier run, the twin's rows changed after its momentum
fix (0.123 -> 0.140 at T = 1) and serial SGHMC reads 0.115 at T = 1 (0.100 before the
package changed in between; not investigated here); the other rows agree within 0.02.

Test accuracy: MAP 0.976 ± 0.007, deep ensemble 0.977 ± 0.006; at T = 1 sampled Laplace
collapses (EF 0.247 ± 0.045, GGN 0.412 ± 0.049), the GLM predictive keeps 0.915 (EF)
and 0.960 (GGN), its probit 0.972 (GGN), VI 0.968, serial and parallel SGHMC 0.969 and
0.980; at T <= 0.01 every method is within 0.004 of the MAP.

What reproduces (the takeaways of Section 5.1; every comparison below checked per seed
against the full-mode run above, seeds 0-2):

* A strong cold posterior effect for the Gaussian approximations: every Laplace variant
  is best at the coldest temperature in every seed; at T = 1 the whole-network ones are
  3.9-27 times worse (KFAC's GLM predictive 3.9-5.1 times, the diagonal GGN's 7.9-12.6,
  weight sampling 19-27) and the last-layer ones 1.6-2.4 times; VI is best at
  T <= 0.01 and 1.4-1.6 times worse at T = 1.
* Only a mild one for SGHMC: its best temperature lies between 0.01 and 0.32 (serial)
  and between 0.03 and 0.32 (parallel), and T = 1 costs 0.011-0.044 nats over it
  (serial) and 0.007-0.023 (parallel).
* Linearisation rescues Laplace (the GLM predictive beats weight sampling at every
  temperature and seed, for the EF, the diagonal GGN and KFAC), and the GGN beats the
  empirical Fisher (Kunstner et al. 2019), at every temperature and seed, sampled or
  linearised.
* Structure matters as much (not in the paper): keeping each layer's correlations, KFAC
  (linearised) has a 2.4-2.5 times lower NLL than the diagonal GGN at T = 1 (0.39
  against 0.96 nats on average, every seed), and the last-layer Laplace, a dense
  Gaussian over the output layer alone, loses least of the Laplace variants in every
  seed (0.13-0.15 at T = 1 against serial SGHMC's 0.10-0.13; accuracy 0.973); both are
  still best at the coldest temperature.
* T -> 0 recovers optimisation: the linearised GGN, KFAC and last-layer Laplace tend to
  the MAP (within 0.001 nats at T = 1e-3; the empirical Fisher's and the sampled
  diagonal's within 0.003) and parallel SGHMC to the deep ensemble (within 0.0005);
  cooling parallel SGHMC below its best temperature makes it worse, towards the deep
  ensemble, which it beats at its best temperature in every seed (by 0.003-0.007
  nats).

What does not, or only weakly, at this scale:

* "Parallel SGHMC slightly outperforms serial SGHMC": on average over the temperatures
  it does in 2 of 3 seeds (by 0.007-0.015 nats), not in seed 2 (serial better by 0.005,
  at 5 of the 7 temperatures); at T = 1 serial is better in 1 of 3 seeds.
* "VI and SGHMC significantly outperform the MAP": at its best temperature parallel
  SGHMC beats the MAP by -0.001-0.012 nats and serial SGHMC by 0.004-0.006, small
  against the spread. VI at cold temperatures has the lowest
  NLL of all, but that is optimisation, not Bayes: continuing the MAP's training with
  VI's Adam schedule alone, no noise, gives the same (0.0665 against VI's 0.0668 at
  seed 0, quick mode, an earlier run).
* That linearisation hurts VI is not tested (``MeanFieldVI.predict`` samples weights).
* The cold posterior effect of SGHMC depends on the prior: in exploratory runs (one
  seed, lr 0.05, an earlier version) σ = 1 and σ = 3 showed the mild effect, but with
  σ = 0.3 the MAP underfits (NLL 0.21) and SGHMC was best at T = 1.

AdamW's twin and IVON (full mode, seeds 0-2):

* The twin behaves as serial SGHMC, whose chain it shares: the MAP's NLL at T = 1e-3
  (0.090 on average; -0.006 to +0.006 from the MAP per seed), best at T = 0.003-0.01,
  and T = 1 costs it 0.039-0.066 nats over its best (serial SGHMC 0.011-0.044, VI
  0.035-0.041); accuracy 0.958 ± 0.010 at T = 1. A mild cold posterior effect, as
  SGHMC's, not the Gaussian approximations' strong one.
* IVON is worse than the MAP at every temperature in every seed (0.101 at T = 1e-3;
  seed 1 worst at 0.109-0.148): in 100 epochs with these settings its mean does not fit
  as well as SGD. Its cold posterior effect is mild (T = 1 costs 0.011-0.035 nats over
  its best, at T <= 0.003), and at T = 1 it is level with VI on average (0.118 against
  0.120; better in 2 seeds of 3), from scratch in under a third of VI's time; accuracy
  0.965 ± 0.005 at T = 1.

In quick mode VI is not converged at T = 1 (NLL about 0.25 instead of 0.12), which
exaggerates its cold posterior effect; SGHMC's best temperature and the serial/parallel
order vary more between seeds.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from common import (
    digits,
    example_arguments,
    figure_title,
    member_minibatches,
    minibatches,
    mlp,
    print_table,
    progress,
    torch_threads,
)
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from samplers_as_optim import (
    IVON,
    SGHMC,
    AdamWSGHMC,
    Laplace,
    MeanFieldVI,
    ParallelEnsemble,
    SampleCollector,
    call_stacked,
    predictive,
)

PRIOR_STD = 1.0  # the prior N(0, PRIOR_STD^2) on every weight, for every method
HIDDEN = (128,)
BATCH = 64
LR, MOMENTUM = 0.1, 0.9  # SGD units: MAP, deep ensemble and both SGHMCs
VI_LR, VI_INIT_STD = 3e-2, 1e-3  # Adam, cosine-annealed to 0
TWIN_LR = 3e-3  # AdamW units; AdamW's other defaults (betas, eps)
IVON_SETTINGS = dict(lr=0.2, hess_init=0.5, beta2=0.999)  # ivon-opt's other defaults

#: The methods whose target depends on the temperature, in the table's order.
METHODS = (
    "Laplace EF (sampled)",
    "Laplace EF",
    "Laplace GGN (sampled)",
    "Laplace GGN",
    "Laplace GGN (probit)",
    "Laplace KFAC (sampled)",
    "Laplace KFAC",
    "Laplace KFAC (probit)",
    "Last-layer Laplace",
    "Last-layer (probit)",
    "VI",
    "Serial SGHMC",
    "Parallel SGHMC",
    "AdamW twin",
    "IVON",
)
#: The temperature-independent baselines (optimisation).
BASELINES = ("MAP (SGD)", "Deep ensemble")


@dataclass(frozen=True)
class Settings:
    """How long each method runs (epochs of the 1257 training images, batch 64)."""

    temperatures: tuple[float, ...]
    epochs: int  # MAP, the deep ensemble and each parallel SGHMC chain
    members: int  # K: deep ensemble members, parallel SGHMC chains
    burn_in: int  # serial SGHMC: epochs discarded ...
    samples: int  # ... then this many samples kept,
    thin: int  # one every `thin` epochs
    vi_epochs: int  # VI, started at the MAP
    draws: int  # Laplace and VI: weight draws per prediction


def log_spaced(count: int) -> tuple[float, ...]:
    """``count`` temperatures from 1e-3 to 1, evenly spaced in log."""
    return tuple(10.0 ** (-3 + 3 * i / (count - 1)) for i in range(count))


SETTINGS = {  # quick: True
    True: Settings(
        log_spaced(4), epochs=40, members=5, burn_in=20, samples=10, thin=2, vi_epochs=40, draws=32
    ),
    False: Settings(
        log_spaced(7),
        epochs=100,
        members=10,
        burn_in=50,
        samples=25,
        thin=2,
        vi_epochs=200,
        draws=100,
    ),
}


def train(
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    optimizer: torch.optim.Optimizer,
    data: tuple[Tensor, Tensor],
    epochs: int,
    generator: torch.Generator,
    *,
    members: int | None = None,
    after_step: Callable[[], Any] | None = None,
    description: str = "",
) -> None:
    """The usual minibatch loop; ``members``: one shuffle per ensemble member."""
    x, y = data
    for _ in progress(range(epochs), description):
        batches: Iterator[Tensor] = (
            minibatches(len(x), BATCH, generator)
            if members is None
            else member_minibatches(len(x), BATCH, members, generator)
        )
        for index in batches:
            optimizer.zero_grad()
            loss_fn(x[index], y[index]).backward()
            optimizer.step()
            if after_step is not None:
                after_step()


def model_loss_fn(model: nn.Module) -> Callable[[Tensor, Tensor], Tensor]:
    """The usual mean cross-entropy of a batch."""
    return lambda x, y: F.cross_entropy(model(x), y)


def vi_loss_fn(vi: MeanFieldVI, generator: torch.Generator) -> Callable[[Tensor, Tensor], Tensor]:
    """Mean NLL at one reparameterised draw plus the prior/entropy term, in mean-loss units."""
    return lambda x, y: F.cross_entropy(vi(x, generator=generator), y) + vi.kl_loss()


def ensemble_loss_fn(ensemble: ParallelEnsemble) -> Callable[[Tensor, Tensor], Tensor]:
    """The sum of the members' mean losses, each member on its own batch."""

    def loss(x: Tensor, y: Tensor) -> Tensor:
        outputs = ensemble(x, per_member_inputs=True)
        return ensemble.loss(F.cross_entropy, outputs, y, per_member_targets=True)

    return loss


def metrics(logits: Tensor, y: Tensor) -> dict[str, float]:
    """Test NLL and accuracy of the Bayesian model average of ``[S, B, 10]`` logits."""
    bma = predictive.classification(logits)
    return {
        "nll": predictive.nll(bma.log_probs, y).item(),
        "accuracy": predictive.accuracy(bma.probs, y).item(),
    }


def run(quick: bool = False, seed: int = 0) -> dict[str, Any]:
    """Every method at every temperature: test NLL and accuracy as plain data.

    Returns:
        ``temperatures``; ``nll`` and ``accuracy``: method -> one value per temperature;
        ``baselines``: MAP and deep ensemble -> ``{"nll", "accuracy"}``; ``seconds`` per
        method (summed over temperatures); the settings, prior and seed.
    """
    settings = SETTINGS[quick]
    with torch_threads(1):
        return _run(settings, seed)


def _run(settings: Settings, seed: int) -> dict[str, Any]:
    x, y, x_test, y_test = digits(seed=seed)
    num_data = len(x)
    # The one prior, N(0, PRIOR_STD^2) on every weight, in each method's units.
    weight_decay = 1.0 / (num_data * PRIOR_STD**2)
    prior_precision = 1.0 / PRIOR_STD**2
    steps_per_epoch = math.ceil(num_data / BATCH)

    def generator() -> torch.Generator:
        return torch.Generator().manual_seed(seed)

    seconds = dict.fromkeys(BASELINES + METHODS, 0.0)
    nll = {method: [] for method in METHODS}
    accuracy = {method: [] for method in METHODS}
    baselines: dict[str, dict[str, float]] = {}

    def record(method: str, logits: Tensor, started: float) -> None:
        scores = metrics(logits, y_test)
        seconds[method] += time.perf_counter() - started
        if method in BASELINES:
            baselines[method] = scores
        else:
            nll[method].append(scores["nll"])
            accuracy[method].append(scores["accuracy"])

    # MAP: SGD on the mean loss with the prior as weight decay.
    started = time.perf_counter()
    map_model = mlp(hidden=HIDDEN, seed=seed)
    sgd = torch.optim.SGD(
        map_model.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=weight_decay
    )
    train(model_loss_fn(map_model), sgd, (x, y), settings.epochs, generator(), description="MAP")
    with torch.no_grad():
        record("MAP (SGD)", map_model(x_test).unsqueeze(0), started)

    # Deep ensemble: K MAPs from K initialisations, trained at once.
    started = time.perf_counter()
    ensemble = ParallelEnsemble(mlp(hidden=HIDDEN), settings.members, seed=seed)
    sgd = torch.optim.SGD(
        ensemble.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=weight_decay
    )
    train(
        ensemble_loss_fn(ensemble),
        sgd,
        (x, y),
        settings.epochs,
        generator(),
        members=settings.members,
        description="deep ensemble",
    )
    with torch.no_grad():
        record("Deep ensemble", ensemble(x_test), started)

    # Laplace around the MAP: the fit does not depend on T (the covariance is T / Λ), so
    # each curvature is fitted once and its temperature set in the sweep.
    # KFAC (structure="kron") and the last-layer Laplace (dense GGN over the output layer,
    # the body fixed at the MAP) are GGN too. The last layer enters the logits linearly,
    # so its sampled and linearised predictives are the same: one row.
    loader = DataLoader(TensorDataset(x, y), batch_size=256)
    variants = {
        "Laplace EF": {"curvature": "ef"},
        "Laplace GGN": {"curvature": "ggn"},
        "Laplace KFAC": {"structure": "kron"},
        "Last-layer Laplace": {"structure": "dense", "subset": "last_layer"},
    }
    laplaces = {
        label: Laplace(
            map_model,
            num_data=num_data,
            likelihood="classification",
            prior_precision=prior_precision,
            **options,
        ).fit(loader)
        for label, options in variants.items()
    }
    for temperature in progress(settings.temperatures, "temperatures"):
        for label, laplace in laplaces.items():
            laplace.temperature = temperature
            started = time.perf_counter()
            # the default predictive, the GLM's (linearised draws); weight draws
            # ("(sampled)", linear=False); the closed-form probit GLM predictive
            with torch.no_grad():
                logits = laplace.predict(x_test, settings.draws, generator=generator())
            record(label, logits, started)
            if label != "Last-layer Laplace":
                started = time.perf_counter()
                with torch.no_grad():
                    logits = laplace.predict(
                        x_test, settings.draws, linear=False, generator=generator()
                    )
                record(f"{label} (sampled)", logits, started)
            if label != "Laplace EF":
                started = time.perf_counter()
                probit = laplace.predictive(x_test, link_approx="probit")
                name = "Last-layer" if label == "Last-layer Laplace" else label
                record(f"{name} (probit)", probit.log_probs.unsqueeze(0), started)
            started = time.perf_counter()

        # Mean-field VI, started at the MAP.
        started = time.perf_counter()
        vi = MeanFieldVI(
            copy.deepcopy(map_model),
            num_data=num_data,
            prior_std=PRIOR_STD,
            temperature=temperature,
            init_std=VI_INIT_STD,
            stl=True,  # stick-the-landing, as the figures in the docstring were made
        )
        adam = torch.optim.Adam(vi.parameters(), lr=VI_LR)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(
            adam, settings.vi_epochs * steps_per_epoch
        )
        train(
            vi_loss_fn(vi, generator()),
            adam,
            (x, y),
            settings.vi_epochs,
            generator(),
            after_step=schedule.step,
            description="VI",
        )
        record("VI", vi.predict(x_test, settings.draws, generator=generator()), started)

        # Serial SGHMC: one chain, burn-in, then every `thin`-th epoch kept.
        started = time.perf_counter()
        model = mlp(hidden=HIDDEN, seed=seed)
        sampler = SGHMC(
            model.parameters(),
            lr=LR,
            momentum=MOMENTUM,
            weight_decay=weight_decay,
            num_data=num_data,
            temperature=temperature,
            seed=seed,
        )
        collector = SampleCollector(
            model,
            settings.samples,
            burn_in=settings.burn_in * steps_per_epoch,
            thin=settings.thin * steps_per_epoch,
        )
        epochs = settings.burn_in + settings.samples * settings.thin
        train(
            model_loss_fn(model),
            sampler,
            (x, y),
            epochs,
            generator(),
            after_step=collector.step,
            description="serial SGHMC",
        )
        assert collector.full
        with torch.no_grad():
            record("Serial SGHMC", call_stacked(model, collector.samples, x_test), started)

        # Parallel SGHMC: K chains from the deep ensemble's initialisations; final states.
        started = time.perf_counter()
        ensemble = ParallelEnsemble(mlp(hidden=HIDDEN), settings.members, seed=seed)
        sampler = SGHMC(
            ensemble.parameters(),
            lr=LR,
            momentum=MOMENTUM,
            weight_decay=weight_decay,
            num_data=num_data,
            temperature=temperature,
            seed=seed,
        )
        train(
            ensemble_loss_fn(ensemble),
            sampler,
            (x, y),
            settings.epochs,
            generator(),
            members=settings.members,
            description="parallel SGHMC",
        )
        with torch.no_grad():
            record("Parallel SGHMC", ensemble(x_test), started)

        # AdamW's twin: one chain as serial SGHMC's (its start, batches, burn-in and
        # thinning), AdamW's arguments; the prior in the loss (weight_decay=0: AdamW's
        # decoupled decay would be the prior N(0, 1/(N λ a)), not this isotropic one).
        # The preconditioner freezes halfway through the burn-in.
        started = time.perf_counter()
        model = mlp(hidden=HIDDEN, seed=seed)
        params = list(model.parameters())
        sampler = AdamWSGHMC(
            params,
            lr=TWIN_LR,
            weight_decay=0.0,
            num_data=num_data,
            temperature=temperature,
            preconditioner_warmup=settings.burn_in * steps_per_epoch // 2,
            seed=seed,
        )
        collector = SampleCollector(
            model,
            settings.samples,
            burn_in=settings.burn_in * steps_per_epoch,
            thin=settings.thin * steps_per_epoch,
        )

        def twin_loss(
            x: Tensor, y: Tensor, model: nn.Module = model, params: list[Tensor] = params
        ) -> Tensor:
            prior = sum(p.square().sum() for p in params) / (2 * num_data * PRIOR_STD**2)
            return F.cross_entropy(model(x), y) + prior

        train(
            twin_loss,
            sampler,
            (x, y),
            epochs,
            generator(),
            after_step=collector.step,
            description="AdamW twin",
        )
        assert collector.full
        with torch.no_grad():
            record("AdamW twin", call_stacked(model, collector.samples, x_test), started)

        # IVON from the MAP's initialisation, as long as the MAP; its own weight decay is
        # the prior (1 / (N σ²)), its temperature the target's.
        started = time.perf_counter()
        model = mlp(hidden=HIDDEN, seed=seed)
        ivon = IVON(
            model.named_parameters(),
            ess=num_data,
            weight_decay=weight_decay,
            temperature=temperature,
            seed=seed,
            **IVON_SETTINGS,
        )
        batches = generator()  # the MAP's batches; a training draw before each step
        for _ in progress(range(settings.epochs), "IVON"):
            for index in minibatches(num_data, BATCH, batches):
                with ivon.sampled_params(train=True):
                    ivon.zero_grad()
                    F.cross_entropy(model(x[index]), y[index]).backward()
                ivon.step()
        logits = ivon.predict(model, x_test, settings.draws, generator=generator())
        record("IVON", logits, started)

    return {
        "temperatures": list(settings.temperatures),
        "nll": nll,
        "accuracy": accuracy,
        "baselines": baselines,
        "seconds": seconds,
        "settings": asdict(settings),
        "prior_std": PRIOR_STD,
        "seed": seed,
    }


def tables(results: dict[str, Any]) -> str:
    """Print (and return) the test NLL and accuracy tables."""
    temperatures = results["temperatures"]
    columns = ["method", *(f"T={t:.3g}" for t in temperatures), "time (s)"]
    texts = []
    for metric, title in (("nll", "test NLL"), ("accuracy", "test accuracy")):
        rows = []
        for method in BASELINES:
            value = results["baselines"][method][metric]
            row = {"method": f"{method} (any T)", "time (s)": f"{results['seconds'][method]:.1f}"}
            row.update({column: value for column in columns[1:-1]})
            rows.append(row)
        for method in METHODS:
            row = {"method": method, "time (s)": f"{results['seconds'][method]:.1f}"}
            row.update(dict(zip(columns[1:-1], results[metric][method], strict=True)))
            rows.append(row)
        title = (
            f"Digits MLP, prior N(0, {results['prior_std']:g}^2), seed {results['seed']}: "
            f"{title} of the Bayesian model average"
        )
        texts.append(print_table(rows, columns, title=title))
        print()
    return "\n\n".join(texts)


def plot(results: dict[str, Any], path: Path) -> None:
    """Test NLL and accuracy against temperature (log x), one line per method."""
    from matplotlib.figure import Figure

    temperatures = results["temperatures"]
    figure = Figure(figsize=(14, 4.5), layout="constrained")
    axes = figure.subplots(1, 2)
    # one colour per method family; within a Laplace family the weight-sampled predictive
    # is dotted with crosses, the GLM one (the default) solid with circles, its closed-form
    # probit dashed with pluses (visible in the legend)
    styles = {
        "Laplace EF (sampled)": ("C1", ":", "x"),
        "Laplace EF": ("C1", "-", "o"),
        "Laplace GGN (sampled)": ("C2", ":", "x"),
        "Laplace GGN": ("C2", "-", "o"),
        "Laplace GGN (probit)": ("C2", "--", "+"),
        "Laplace KFAC (sampled)": ("C5", ":", "x"),
        "Laplace KFAC": ("C5", "-", "o"),
        "Laplace KFAC (probit)": ("C5", "--", "+"),
        "Last-layer Laplace": ("C6", "-", "o"),
        "Last-layer (probit)": ("C6", "--", "+"),
        "VI": ("C4", "-", "o"),
        "Serial SGHMC": ("C9", "--", "s"),
        "Parallel SGHMC": ("C0", "-", "D"),
        "AdamW twin": ("C8", "-.", "^"),
        "IVON": ("C4", "--", "v"),
    }
    for axis, metric, label in (
        (axes[0], "nll", "test NLL (log scale)"),
        (axes[1], "error", "test error = 1 - accuracy (log scale)"),
    ):
        for method in METHODS:
            color, style, marker = styles[method]
            values = results["accuracy" if metric == "error" else metric][method]
            if metric == "error":
                values = [1.0 - value for value in values]
            axis.plot(temperatures, values, marker=marker, ls=style, color=color, label=method)
        for method, color in zip(BASELINES, ("k", "C3"), strict=True):
            value = results["baselines"][method]["accuracy" if metric == "error" else metric]
            if metric == "error":
                value = 1.0 - value
            axis.axhline(value, color=color, ls="--", label=method)
        axis.set_xscale("log")
        axis.set_yscale("log")
        axis.set_xlabel("temperature T")
        axis.set_ylabel(label)
        axis.grid(alpha=0.3, which="both")
    handles, labels = axes[0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="outside right center", fontsize="small")
    figure.suptitle(
        figure_title(
            f"Cold posterior effect on digits (MLP 64-128-10, prior N(0, "
            f"{results['prior_std']:g}^2), seed {results['seed']})"
        )
    )
    figure.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    quick, seed, path = example_arguments(
        argv, __doc__, quick="4 temperatures, short runs", figure="cold_posterior.png"
    )
    results = run(quick=quick, seed=seed)
    results["table"] = tables(results)
    plot(results, path)
    results["figure"] = str(path)
    print(f"figure: {path}")
    return results


if __name__ == "__main__":
    main()
