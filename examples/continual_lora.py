"""Continual learning with LoRA: each episode's Laplace posterior is the next one's prior.

Reproduces, at laptop scale, the experiment of the posteriors paper (Duffield et al. 2024,
Section 5.2 and Appendix E: Llama 2 with LoRA adapters learns 20 books one after another,
a diagonal empirical-Fisher Laplace posterior carried as the next episode's prior). Here a
tiny Llama-style model (``transformers.LlamaConfig``, random initialisation, pre-trained
by the example on the standard library's docstrings, byte-level tokens) gets LoRA adapters
(``peft``, rank 8 on every layer's query and value projections; the base frozen) and
learns four kinds of text shipped with Python, one episode each, tested after every
episode on every episode's held-out windows:

1. the language reference (``pydoc_data.topics``, the text of ``help()``),
2. the standard library's code (docstrings removed),
3. Unicode character names ("LATIN SMALL LETTER A WITH GRAVE", one per line),
4. the single-byte codecs' mapping tables (``encodings.cp437`` and others).

Five learners on the adapters only, the same batches and epochs, temperature 1; how each
carries what it learned into the next episode:

* **Naive (AdamW)**, the paper's baseline: AdamW fine-tuning on each episode alone, with
  the N(0, σ²) prior on the adapters in the loss (``weight_decay=0``: AdamW is then Adam,
  bit for bit) and nothing else; only its starting point remembers: it forgets.
* **Laplace**: episode 1 as Naive; after each episode ``Laplace(model, curvature="ef",
  structure="diag", prior_precision=previous precision).fit(episode)`` over the adapters
  (one example = one window, its log-likelihood the sum over its tokens), and the next
  episode minimises its mean loss plus ``penalty / N`` (``Laplace.penalty``): the
  Bayesian online update with the previous posterior as the prior.
* **Offline**: the unrealistic reference, trained at every episode on the union of all
  episodes so far (continuing from its previous adapters).
* **AdamW twin** (``AdamWSGHMC``, AdamW's arguments, K = 10 chains in a
  ``ParallelEnsemble``): as Laplace, the previous posterior is the next prior, here the
  Gaussian with the previous episode's sample mean and variance per weight (over the
  second half of its steps and the K chains: a diagonal Gaussian, the Laplace learner's
  structure, fitted to samples instead of around a mode), in the loss. The chains
  continue from where they were; a new sampler per episode (as the others' AdamW
  state), its preconditioner frozen halfway through the episode. It predicts with the
  model average of its K chains.
* **IVON** (ivon-opt's arguments; lr 0.1, ``hess_init`` 0.1, ``beta2`` 0.9; ``ess`` =
  N): variational continual learning (Nguyen et al. 2018), the previous episode's
  posterior q = N(m, s²) is the next prior: IVON's own weight decay δ stays the N(0, σ²)
  prior, and the loss adds q / N(0, σ²), so that the two make q. One optimizer runs
  through every episode, as ivon-opt's online use does, so the mean m starts where it
  was and the Hessian estimate h where it was: the new loss's Hessian is the episode's
  plus h (q's precision per example is h + δ, δ applied by IVON), so h starts at the
  right value for its prior part. Merely continuing the optimizer (its weight decay
  pulling to 0, h an average that forgets) would be Naive with a warm start, not a
  Bayesian update; switching its weight decay off and putting q in the loss fails (h
  may lie in (-δ, 0]: only h + δ is kept positive). It predicts with K = 10 posterior
  draws.

Every score is the test NLL of the method's predictive: one model for the point
estimates, the model average of the K chains or draws for the twin and IVON.

Run:
    ``python examples/continual_lora.py --quick`` (a model of width 32, about 20 s) or
    without ``--quick`` (width 96, 4 layers; about 6 min of CPU, half of it the twin's
    10 chains); ``--seed``;
    ``--output`` the figure (default ``examples/output/continual_lora.png``): one panel per
    episode's text, its test NLL after each episode, as the paper's Figure 4. Needs the
    ``llm`` extra (transformers, peft).

What we found (full mode, seed 0: 375 s of CPU, 6.4 min of wall time on a busy shared
2-core machine). Test NLL after the last episode, averaged over episodes 1-3: Naive
(AdamW) 3.272, Laplace 3.132, AdamW twin 3.082, IVON 2.941, Offline 2.433 (the base model
without adapters: 2.959). Every sequential learner forgets: after learning the Unicode
names (episode 3) it loses most of what it had learned of episodes 1 and 2 and ends
above the base model on both (Offline keeps them); averaged over episodes 1-3, only IVON
ends below the base. The Laplace prior reduces forgetting a little (-0.14 nats against
Naive); the twin's sampled Gaussian more (-0.19, and it learns each episode as well as
AdamW does); IVON's posterior the most (-0.33), but it also learns each episode less
(its test NLL on the episode just learned is 0.06-0.54 nats above the other learners'),
its posterior's spread costing fit. The diagonal empirical Fisher of
rank-8 adapters, at temperature 1, is a weak memory at this scale; a Kronecker-factored
posterior (``structure="kron"``) was not tried. (The Naive, Laplace, Offline and base
figures are what the example computed before the twin and IVON were added, bit for bit;
those documented before, from an earlier run whose pre-trained base differed, had the
base at 2.931, Naive 3.254, Laplace 3.161 and Offline 2.483.)
"""

from __future__ import annotations

import copy
import functools
import math
import time
from pathlib import Path
from typing import Any

import lora_common as lc
import torch
from common import example_arguments, print_table, progress, torch_threads, warm_up
from torch import Tensor, nn

from samplers_as_optim import (
    IVON,
    AdamWSGHMC,
    Laplace,
    ParallelEnsemble,
    RunningMoments,
    call_stacked,
)

METHODS = ("Naive (AdamW)", "Laplace", "Offline", "AdamW twin", "IVON")
PRIOR_STD = 1.0
K = 10  # the twin's chains, and IVON's posterior draws for the predictive
#: IVON as in the Bayesian LoRA example: lr 0.1 (ivon-opt's suggestion), hess_init 0.1,
#: beta2 0.9 (an episode is 9 to 64 steps: with beta2 >= 0.999 the Hessian estimate
#: would stay at hess_init)
IVON_SETTINGS = dict(lr=0.1, hess_init=0.1, beta2=0.9)
QUICK = dict(
    hidden=32, layers=2, heads=2, length=32, pre_steps=60, pre_batch=16, train=48, test=16,
    epochs=3, batch=16, lr=3e-3, rank=8,
)  # fmt: skip
FULL = dict(
    hidden=96, layers=4, heads=4, length=64, pre_steps=400, pre_batch=16, train=256, test=64,
    epochs=4, batch=16, lr=3e-3, rank=8,
)  # fmt: skip


class Logits(nn.Module):
    """The causal LM as a function of token ids returning next-token logits (for Laplace)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: Tensor) -> Tensor:
        return self.model(input_ids=ids).logits[:, :-1]


def window_log_likelihood(logits: Tensor, ids: Tensor) -> Tensor:
    """log p(window) = sum over its tokens of log p(next token), one value per window."""
    return -lc.next_token_nll(torch.cat([logits, logits[:, -1:]], 1), ids, "none").sum(-1)


def lora_everywhere(base: nn.Module, rank: int) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj"])
    return get_peft_model(copy.deepcopy(base), config)


def train(
    model: nn.Module,
    data: Tensor,
    settings: dict,
    generator: torch.Generator,
    *,
    weight_decay: float,
    penalty: Any = None,
) -> None:
    """AdamW on the adapters: mean next-token NLL (+ ``penalty()`` in the same units).

    ``weight_decay=0`` and the prior in the loss: AdamW is then ``torch.optim.Adam``,
    step for step, bit for bit (the figures of earlier versions, which used Adam, stand).
    """
    params = lc.adapters(model)
    optimizer = torch.optim.AdamW(params, lr=settings["lr"], weight_decay=0.0)
    for _ in range(settings["epochs"]):
        for rows in torch.randperm(len(data), generator=generator).split(settings["batch"]):
            ids = data[rows]
            loss = lc.next_token_nll(lc.logits_of(model, ids), ids)
            loss = loss + 0.5 * weight_decay * sum(p.square().sum() for p in params)
            if penalty is not None:
                loss = loss + penalty()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()


def isotropic_penalty(params: list[Tensor], decay: float) -> Tensor:
    """The prior N(0, σ²) in mean-token-loss units, ``decay = 1 / (N σ²)``."""
    return 0.5 * decay * sum(p.square().sum() for p in params)


def gaussian_penalty(
    params: list[Tensor], means: list[Tensor], variances: list[Tensor], num_tokens: int
) -> Tensor:
    """-log N(θ; means, diag(variances)) / N, up to a constant: a prior in mean-token units."""
    return sum(
        ((p - m).square() / v).sum() for p, m, v in zip(params, means, variances, strict=True)
    ) / (2 * num_tokens)


def posterior_ratio_penalty(
    params: list[Tensor],
    means: list[Tensor],
    variances: list[Tensor],
    num_tokens: int,
    decay: float,
) -> Tensor:
    """-log(q(θ) / N(θ; 0, σ²)) / N, q = N(means, diag(variances)): the prior q in the loss
    of an optimizer that applies N(0, σ²) itself (as weight decay ``1 / (N σ²)``)."""
    return gaussian_penalty(params, means, variances, num_tokens) - isotropic_penalty(params, decay)


def train_twin(
    ensemble: ParallelEnsemble,
    data: Tensor,
    settings: dict,
    generator: torch.Generator,
    *,
    seed: int,
    penalty: Any,
) -> tuple[list[Tensor], list[Tensor]]:
    """AdamW's twin at temperature 1 on K chains; the moments of the episode's samples.

    The chains continue from their states at the end of the previous episode; a new
    sampler per episode (as Adam's state is new per episode for the others), its
    preconditioner frozen halfway through the episode. The second half of the episode,
    every step of every chain, gives the posterior's mean and variance per weight (pooled
    over the K chains: the mean of the chains' variances plus the variance of their means).
    """
    params = lc.adapters(ensemble)
    names = [name for name, p in ensemble.named_parameters() if p.requires_grad]
    steps = settings["epochs"] * math.ceil(len(data) / settings["batch"])
    sampler = AdamWSGHMC(
        params,
        lr=settings["lr"],
        weight_decay=0.0,
        num_data=data.numel(),
        temperature=1.0,
        preconditioner_warmup=steps // 2,
        seed=seed,
    )
    moments = RunningMoments(dict(zip(names, params, strict=True)), burn_in=steps // 2)
    for _ in range(settings["epochs"]):
        for rows in torch.randperm(len(data), generator=generator).split(settings["batch"]):
            ids = data[rows]
            loss = ensemble.loss(lc.next_token_nll, lc.logits_of(ensemble, ids), ids)
            sampler.zero_grad()
            (loss + penalty(params)).backward()
            sampler.step()
            moments.step()
    count = moments.count
    means, variances = [], []
    for name in names:
        chain_means, chain_variances = moments.mean[name], moments.variance[name]  # [K, ...]
        means.append(chain_means.mean(0))
        within = chain_variances.mean(0) * (count - 1) / count
        variances.append(within + chain_means.var(0, correction=0))
    return means, variances


def train_ivon(
    optimizer: IVON,
    model: nn.Module,
    data: Tensor,
    settings: dict,
    generator: torch.Generator,
    penalty: Any = None,
) -> None:
    """IVON's steps on the adapters, one training draw each (+ ``penalty()``)."""
    params = lc.adapters(model)
    for _ in range(settings["epochs"]):
        for rows in torch.randperm(len(data), generator=generator).split(settings["batch"]):
            ids = data[rows]
            with optimizer.sampled_params(train=True):
                optimizer.zero_grad()
                loss = lc.next_token_nll(lc.logits_of(model, ids), ids)
                if penalty is not None:
                    loss = loss + penalty(params)
                loss.backward()
            optimizer.step()


@torch.no_grad()
def test_nll(model: nn.Module, data: Tensor) -> float:
    return float(torch.cat([lc.next_token_nll(lc.logits_of(model, ids), ids, "none")
                            for ids in data.split(64)]).mean())  # fmt: skip


def ivon_logits(model: nn.Module, draws: dict[str, Tensor], ids: Tensor) -> Tensor:
    """The logits ``[S, B, T, V]`` of the model under S stacked draws of its adapters."""
    return call_stacked(model, draws, input_ids=ids).logits


@torch.no_grad()
def predictive_nll(predict: Any, data: Tensor) -> float:
    """Test NLL per token of the model average of ``predict(ids)``'s ``[S, B, T, V]`` logits."""
    found = []
    for ids in data.split(64):
        logp = predict(ids)[..., :-1, :].double().log_softmax(-1)
        logp = logp.logsumexp(0) - math.log(logp.shape[0])  # the model average
        found.append(-logp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1))
    return float(torch.cat(found).mean())


def run(quick: bool = True, seed: int = 0) -> dict[str, Any]:
    warm_up()
    with torch_threads(1):
        return _run(quick, seed)


def _run(quick: bool, seed: int) -> dict[str, Any]:
    settings = QUICK if quick else FULL
    length = settings["length"]
    names = list(lc.EPISODES)
    episodes = [
        lc.episode_windows(
            name, length, train=settings["train"], test=settings["test"], seed=seed + i
        )
        for i, name in enumerate(names)
    ]
    pre = lc.windows(lc.docstrings(lc.MODULES[:40] if quick else lc.MODULES), length)
    base = lc.tiny_llama(
        hidden=settings["hidden"],
        layers=settings["layers"],
        heads=settings["heads"],
        length=length,
        seed=seed,
    )
    lc.pretrain(
        base, pre, steps=settings["pre_steps"], batch=settings["pre_batch"], lr=3e-3, seed=seed
    )
    base.requires_grad_(False)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        first = lora_everywhere(base, settings["rank"])
    point_methods = ("Naive (AdamW)", "Laplace", "Offline")
    models = {method: copy.deepcopy(first) for method in point_methods}
    # AdamW's twin: K chains, all starting from the same adapters (the noise separates
    # them). IVON: one optimizer over all the episodes, so its mean and Hessian estimate
    # carry over as ivon-opt's own online use does; it predicts with K draws.
    twin = ParallelEnsemble(copy.deepcopy(first), K, subset="trainable")
    variational = copy.deepcopy(first)
    tokens = settings["train"] * length  # N: every episode has the same number of tokens
    ivon = IVON(
        [(name, p) for name, p in variational.named_parameters() if p.requires_grad],
        ess=tokens,
        weight_decay=1 / (tokens * PRIOR_STD**2),  # episode 1: the prior N(0, σ²)
        seed=seed,
        **IVON_SETTINGS,
    )
    generators = {method: torch.Generator().manual_seed(seed) for method in METHODS}
    count = len(names)
    nll = {method: torch.full((count, count), math.nan) for method in METHODS}
    base_nll = [test_nll(base, test) for _, test in episodes]
    seconds = dict.fromkeys(METHODS, 0.0)
    posterior: Laplace | None = None
    twin_prior: tuple[list[Tensor], list[Tensor]] | None = None
    for episode in progress(range(count), "episodes"):
        data = episodes[episode][0]
        num_data = len(data)
        decay = 1 / (num_data * length * PRIOR_STD**2)  # N(0, σ²) in mean-token-loss units
        for method in point_methods:
            model = models[method]
            start = time.perf_counter()
            if method == "Offline":
                union = torch.cat([episodes[i][0] for i in range(episode + 1)])
                decay_all = 1 / (len(union) * length * PRIOR_STD**2)
                train(model, union, settings, generators[method], weight_decay=decay_all)
            elif method == "Naive (AdamW)" or posterior is None:
                train(model, data, settings, generators[method], weight_decay=decay)
            else:
                previous = posterior
                wrapped = Logits(model)
                scale = 1 / (num_data * length)  # -log q(θ) / N in mean-token-loss units
                train(
                    model,
                    data,
                    settings,
                    generators[method],
                    weight_decay=0.0,
                    penalty=lambda p=previous, w=wrapped, s=scale: p.penalty(w) * s,
                )
            if method == "Laplace":
                prior: Any = 1.0 / PRIOR_STD**2 if posterior is None else posterior.precision
                posterior = Laplace(
                    Logits(model),
                    num_data=num_data,
                    likelihood=window_log_likelihood,
                    curvature="ef",
                    structure="diag",
                    prior_precision=prior,
                ).fit([(ids, ids) for ids in data.split(settings["batch"])])
            seconds[method] += time.perf_counter() - start
            for task in range(episode + 1):
                nll[method][episode, task] = test_nll(model, episodes[task][1])

        # AdamW's twin: the Gaussian with the previous episode's sample mean and variance
        # per weight is this episode's prior (episode 1: N(0, σ²)), in the loss.
        start = time.perf_counter()
        if twin_prior is None:
            twin_penalty: Any = functools.partial(isotropic_penalty, decay=decay)
        else:
            means, variances = twin_prior
            twin_penalty = functools.partial(
                gaussian_penalty, means=means, variances=variances, num_tokens=tokens
            )
        twin_prior = train_twin(
            twin, data, settings, generators["AdamW twin"], seed=seed + episode,
            penalty=twin_penalty,
        )  # fmt: skip
        seconds["AdamW twin"] += time.perf_counter() - start
        for task in range(episode + 1):
            nll["AdamW twin"][episode, task] = predictive_nll(
                lambda ids: lc.logits_of(twin, ids), episodes[task][1]
            )

        # IVON: the previous episode's posterior q = N(m, s²) is this episode's prior. IVON
        # keeps its weight decay δ, the prior N(0, σ²), and the loss adds q / N(0, σ²):
        # the two together are q. (Not weight_decay=0 and q in the loss: h may lie in
        # (-δ, 0], where only h + δ > 0 is kept, and s² = 1 / (N h) would not exist.)
        start = time.perf_counter()
        ivon_penalty: Any = None
        if episode > 0:
            ivon_means, ivon_stds = ivon.mean, ivon.std
            keys = [name for name, p in variational.named_parameters() if p.requires_grad]
            ivon_penalty = functools.partial(
                posterior_ratio_penalty,
                means=[ivon_means[k] for k in keys],
                variances=[ivon_stds[k].square() for k in keys],
                num_tokens=tokens,
                decay=decay,
            )
        train_ivon(ivon, variational, data, settings, generators["IVON"], ivon_penalty)
        seconds["IVON"] += time.perf_counter() - start
        draws = ivon.sample(K, generator=torch.Generator().manual_seed(seed + episode))
        for task in range(episode + 1):
            nll["IVON"][episode, task] = predictive_nll(
                functools.partial(ivon_logits, variational, draws), episodes[task][1]
            )
    rows = [
        {
            "method": method,
            "avg NLL, all episodes": float(nll[method][-1].mean()),
            "avg NLL, episodes 1..T-1": float(nll[method][-1, :-1].mean()),
            "episode 1 NLL": float(nll[method][-1, 0]),
            "time (s)": seconds[method],
        }
        for method in METHODS
    ]
    rows.append(
        {
            "method": "base (no LoRA)",
            "avg NLL, all episodes": sum(base_nll) / count,
            "avg NLL, episodes 1..T-1": sum(base_nll[:-1]) / (count - 1),
            "episode 1 NLL": base_nll[0],
        }
    )
    return {"nll": nll, "names": names, "base": base_nll, "rows": rows, "seed": seed}


def plot(results: dict[str, Any], path: Path) -> None:
    from matplotlib.figure import Figure

    names = results["names"]
    count = len(names)
    figure = Figure(figsize=(3.2 * (count + 1), 3.2), layout="constrained")
    axes = figure.subplots(1, count + 1, sharex=True)
    episodes = torch.arange(1, count + 1)
    colors = {
        "Naive (AdamW)": "C3", "Laplace": "C0", "Offline": "C2", "AdamW twin": "C1", "IVON": "C4",
    }  # fmt: skip
    for method, color in colors.items():
        nll = results["nll"][method]
        for task in range(count):
            axes[task].plot(episodes[task:], nll[task:, task], "o-", color=color, label=method)
        axes[count].plot(episodes, torch.nanmean(nll, 1), "o-", color=color, label=method)
    for task, name in enumerate(names):
        axes[task].axhline(results["base"][task], color="grey", ls=":", label="base model")
        axes[task].set_title(f"episode {task + 1}: {name}", fontsize=9)
    axes[count].set_title("average over episodes seen", fontsize=9)
    for axis in axes:
        axis.set_xticks(episodes.tolist())
        axis.set_xlabel("after episode")
        axis.grid(alpha=0.3)
    axes[0].set_ylabel("test NLL (nats / token)")
    axes[0].legend(fontsize=8)
    figure.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    quick, seed, figure = example_arguments(
        argv, __doc__, quick="tiny model, seconds (CI)", figure="continual_lora.png"
    )
    results = run(quick=quick, seed=seed)
    plot(results, figure)
    print_table(
        results["rows"],
        ["method", "avg NLL, all episodes", "avg NLL, episodes 1..T-1", "episode 1 NLL",
         "time (s)"],
        title="Test NLL after the last episode (nats / token)",
    )  # fmt: skip
    print(f"figure: {figure}")
    return results


if __name__ == "__main__":
    main()
