"""Bayesian LoRA: a K = 10 parallel SGHMC ensemble over a language model's adapters.

Reproduces, at laptop scale, the experiment of the posteriors paper (Duffield et al. 2024,
Section 5.3 and Appendix F: ten SGHMC chains over LoRA adapters of Llama 3's last
attention layer, whose epistemic uncertainty tells in-distribution from
out-of-distribution text). Here:

* the model is a tiny Llama-style causal LM (``transformers.LlamaConfig``, a few layers,
  random initialisation) that the example first pre-trains itself, on the docstrings of
  Python's standard library, byte-level (one token per ASCII character);
* LoRA adapters (``peft``) on the last layer's attention projections are then fine-tuned
  on more docstrings, by **SGD** (one model) and by **SGHMC** (``ParallelEnsemble(...,
  subset="trainable")``: K = 10 stacked copies of the adapters, the frozen base shared and
  run once, every chain on the same minibatches with its own noise, temperature 1, N =
  the number of fine-tuning tokens, prior N(0, 1) on the adapters); and, with the same
  batches, epochs and prior, by **AdamW** (the paper's baseline, one model: lr 3e-3,
  ``weight_decay=0`` and the prior in the loss, so that it is the MAP SGD also targets),
  by **AdamW's twin** (``AdamWSGHMC`` with AdamW's arguments at temperature 1: K = 10
  chains in a ``ParallelEnsemble`` as SGHMC's, their final states the samples; its
  preconditioner frozen halfway through the 32 steps) and by **IVON** (one model,
  ``ess`` = N, ``weight_decay`` = 1 / N (the same prior), temperature 1; lr 0.1,
  ``hess_init`` 0.1, ``beta2`` 0.9 so that its Hessian estimate moves in 32 steps; its
  predictive from K = 10 draws of its posterior, the same draws for every text);
* then a **Laplace over the adapters** (``lora_laplace.py``) around AdamW's: ``Laplace(
  model, num_data=W, likelihood="classification", subset=<the 8 adapter tensors>,
  ignore_index=-100)`` with ``structure="kron"`` (KFAC-expand) and ``structure="lowrank"``
  (``rank=20``), the model the PEFT LM wrapped to map token ids to ``(batch, seq, vocab)``
  logits, each position's target its next token (the last position's -100: it has
  none). The curvature is the exact GGN of the first 8 fine-tuning windows (quick: 4),
  scaled to the W = 256; the prior precision starts at 1 / PRIOR_STD^2 = 1 and is then
  tuned by the evidence, ``optimize_prior_precision(prior_structure="layerwise")``: one
  precision per adapter tensor, since ``lora_A`` (Kaiming-uniform) and ``lora_B`` differ
  in scale. The predictive is the GLM predictive (the network linearised at AdamW's
  adapters) at K = 10 posterior draws, ``la.predict(ids, 10)``, the same draws for every
  text. **Why AdamW's adapters**: SGD and AdamW minimise the same objective (mean token
  NLL + prior / N); AdamW reaches the lower value (full mode 2.3353 against SGD's 2.3393,
  quick 3.31 against 3.39; printed at every run), so it is the better MAP estimate of the
  prior both share (neither is at a stationary point after 32 steps). **Units**: SGHMC
  (and the twin, IVON, AdamW's penalty) take N = W T tokens with the per-token mean
  loss; the Laplace takes N = W windows, each window's log-likelihood the sum over its
  tokens, with the same number as the prior precision: N_tokens x (mean over tokens)
  and N_windows x (mean over windows of a window's sum) are the same sum, so the two
  describe one posterior, up to one detail: N = W T counts every token of a window
  while T - 1 are predicted (the last has no next token), so SGHMC's likelihood is
  T / (T - 1) times the Laplace's (1.016 in full mode, 1.03 in quick);
* every method is evaluated on held-out docstrings (in distribution) and on three kinds of
  out-of-distribution text shipped with Python: the standard library's code (docstrings
  removed), Unicode character names ("LATIN SMALL LETTER A", one per line) and the
  single-byte codecs' mapping tables. Scores: next-token NLL of the (model-averaged)
  prediction; the total uncertainty (entropy of the predictive) and, for the methods
  with K members (chains or posterior draws), its epistemic part (the mutual
  information: predictive entropy minus the members' mean entropy), averaged over each
  window's tokens; the AUROC with which each score separates the out-of-distribution
  windows from the prose windows.
* the cost: for the Laplace, the seconds of its fit, its tuning and its predictive on
  every text, and the bytes its precision keeps; for the ensemble, the peak memory of
  one SGHMC step of the K = 10 adapter ensemble divided by that of one fine-tuning step
  of a single PEFT model (parameters, gradients, optimizer state, and the step's
  activations), and the ensemble's training throughput against a loop over 10 PEFT
  models (one step each; each a model of its own, as 10 separate runs would be).

Every fine-tuning starts from adapters whose ``lora_B`` is drawn from N(0, 0.2^2) (PEFT's
default is 0; the single models from SGD's draw, each chain under its own seed): with
``B = 0`` every member starts with the same (zero) update and, at temperature 1 with
N = 16 384 tokens, the chains do not move far enough in a few dozen steps to disagree at
all (we checked: epistemic uncertainty ~1e-4 nats, AUROC ~0.5 or below).

Run:
    ``python examples/bayesian_lora.py --quick`` (a model of 4 layers and width 32,
    about 40 s of CPU) or without ``--quick`` (6 layers of width 96, pre-trained 400
    steps: about 350 s of CPU, 8 min of wall time on a busy shared 2-core machine, about
    4 of them the Laplace's);
    ``--seed`` picks the split, the initialisation and the batches; ``--output`` the
    figure (default ``examples/output/bayesian_lora.png``). Needs the ``llm`` extra
    (``pip install samplers_as_optim[llm]``: transformers, peft).

What we found (full mode, seed 0, CPU; the examples page has the table). The paper's
claim did *not* reproduce at this scale, for any method: no epistemic uncertainty
separates the out-of-distribution texts from prose (AUROC 0.38 / 0.35 / 0.34 for code /
Unicode names / codec tables with SGHMC, 0.38 / 0.26 / 0.32 with AdamW's twin, 0.26 /
0.10 / 0.16 with IVON, 0.42 / 0.49 / 0.36 with the KFAC Laplace and 0.46 / 0.55 / 0.36
with the low-rank one: the Laplace's are the nearest to chance, the others' members agree
*more* on the far texts), while the plain total entropy of a single model separates
Unicode names perfectly (1.00) and the codec tables mostly (0.86), the same for every
method; code gets *lower* entropy than prose from every model (AUROC 0.40-0.42): the
model is confidently wrong on it. Fine-tuning 32 steps barely moves the prose NLL from
the base model's 2.3028 (AdamW 2.3026, SGD 2.3030, SGHMC 2.3034, the twin 2.3039, IVON
2.3170, its draws' spread costing a little; the Laplace 2.3056 (KFAC) and 2.3064 (low
rank), +0.003 and +0.004 over the MAP they linearise around, for epistemic uncertainty
3-5x SGHMC's on prose). Adapters of one attention layer of a small, briefly trained
byte-level model carry little epistemic signal, whichever posterior is drawn.

The Laplace's evidence prefers a tighter prior than N(0, 1): the layerwise tuning raised
it from -41,748 to -41,012 (KFAC; the low rank from -43,171 to -41,102) with precisions
of 3.5-43 (standard deviations 0.15-0.54, ``lora_A``'s the tighter; the low rank's
4.2-67), and ranks KFAC above the low rank. The low rank's k = 20 (the library's
default) holds 99% of the GGN's trace on the quick model but 53% on the full one (P =
3,072; the rest is its diagonal); a probe at k = 60 (78%) moved the prose NLL by
+0.0001, the Unicode names' epistemic AUROC from 0.55 to 0.52 and the tuned evidence by
+107 nats, for 18% more fit time, so k = 20 stays. The cost is the fit: the exact GGN of
(64 positions x 128 classes) outputs takes 8,192 backward columns a window: 91 s (KFAC)
and 124 s (low rank: the diagonal's columns, then the Lanczos passes) for 8 windows on
one thread, more than everything else in the example together; the tuning takes under a
second (no new pass), the predictive 25 s for the 800 windows of the four texts, and the
posteriors keep 0.28 MB (KFAC) and 0.50 MB (low rank) against the ensemble's 0.12 MB of
ten adapter copies.

The cost side of the ensemble holds for speed: one SGHMC step of the 10-member ensemble
is 2.7x faster than stepping 10 PEFT models in a loop (the first 5 layers run once,
unbatched; 3.3x in the run before the Laplace rows, 4.1x documented before: the machine
is shared, the times noisy). Its peak memory is 4.6x one fine-tuning step, not <= 1.5:
at this size a step's activations (the last layer and the logits, times 10) outweigh the
0.7 M frozen weights; ``benchmarks/bench_lora.py`` measures where the ratio falls as
the base grows. (The rows other than the Laplace's are, to every printed digit, what the
example computed before they were added, on torch 2.13; the figures documented before
them, from an earlier environment, had the base's prose NLL at 2.337 and SGHMC's epistemic AUROC at
0.45 / 0.28 / 0.35.)
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lora_common as lc
import lora_laplace as ll
import torch
from common import example_arguments, print_table, progress, torch_threads, warm_up
from torch import Tensor

from samplers_as_optim import IVON, SGHMC, AdamWSGHMC, ParallelEnsemble, call_stacked

K = 10
PRIOR_STD = 1.0
#: AdamW and its twin share their arguments (torch.optim.AdamW's defaults otherwise):
#: lr 3e-3 (the continual example's); weight_decay 0, the prior N(0, PRIOR_STD^2) in the
#: loss (for the twin an isotropic prior, as its docstring says; for AdamW the MAP under
#: the prior SGD has); the twin's preconditioner freezes halfway through its short run.
ADAMW_LR = 3e-3
#: IVON: lr 0.1 (ivon-opt's suggestion), hess_init 0.1, beta2 0.9 instead of ivon-opt's
#: 0.99999: the fine-tuning takes 32 steps, and with beta2 >= 0.999 the Hessian estimate h
#: would stay at hess_init (the posterior's spread set by hand); 0.9 averages it over
#: the last ~10 steps. ess = N tokens, weight_decay = 1 / (N PRIOR_STD^2): the same prior.
IVON_SETTINGS = dict(lr=0.1, hess_init=0.1, beta2=0.9)
#: Laplace over the adapters around AdamW's (KFAC and low rank; lora_laplace.py), its
#: GLM predictive from K linearised posterior draws
LAPLACE = tuple(f"{name} x{K}" for name in ll.STRUCTURES)
#: the methods with K members (chains or posterior draws): they have an epistemic part
BAYESIAN = (f"SGHMC x{K}", f"AdamW twin x{K}", f"IVON x{K}", *LAPLACE)

QUICK = dict(
    hidden=32, layers=4, heads=2, length=32, pre_steps=60, pre_batch=16, sizes=(960, 256, 48, 48),
    epochs=2, batch=16, lr=0.2, rank=4, b_std=0.2, cost_batch=4, repeats=3, laplace_windows=4,
)  # fmt: skip
FULL = dict(
    hidden=96, layers=6, heads=4, length=64, pre_steps=400, pre_batch=16,
    sizes=(6400, 256, 200, 200), epochs=4, batch=32, lr=0.2, rank=4, b_std=0.2, cost_batch=4,
    repeats=5, laplace_windows=8,
)  # fmt: skip


def train_sgd(model: torch.nn.Module, data: Tensor, settings: dict, seed: int) -> None:
    num_tokens = data.numel()
    params = lc.adapters(model)
    optimizer = torch.optim.SGD(
        params, lr=settings["lr"], momentum=0.9, weight_decay=1 / (num_tokens * PRIOR_STD**2)
    )
    generator = torch.Generator().manual_seed(seed)
    for _ in progress(range(settings["epochs"]), "SGD"):
        for rows in torch.randperm(len(data), generator=generator).split(settings["batch"]):
            ids = data[rows]
            optimizer.zero_grad()
            lc.next_token_nll(lc.logits_of(model, ids), ids).backward()
            optimizer.step()


def train_sghmc(ensemble: ParallelEnsemble, data: Tensor, settings: dict, seed: int) -> None:
    num_tokens = data.numel()
    sampler = SGHMC(
        lc.adapters(ensemble),
        lr=settings["lr"],
        momentum=0.9,
        num_data=num_tokens,
        weight_decay=1 / (num_tokens * PRIOR_STD**2),
        seed=seed,
    )
    generator = torch.Generator().manual_seed(seed)
    for _ in progress(range(settings["epochs"]), "SGHMC"):
        for rows in torch.randperm(len(data), generator=generator).split(settings["batch"]):
            ids = data[rows]
            sampler.zero_grad()
            ensemble.loss(lc.next_token_nll, lc.logits_of(ensemble, ids), ids).backward()
            sampler.step()


def prior_penalty(params: list[Tensor], num_tokens: int) -> Tensor:
    """-log N(θ; 0, PRIOR_STD^2) / N, the prior in the units of the mean token loss."""
    return sum(p.square().sum() for p in params) / (2 * num_tokens * PRIOR_STD**2)


def train_adamw(model: torch.nn.Module, data: Tensor, settings: dict, seed: int) -> None:
    """The paper's baseline: AdamW on the adapters, the mean loss plus the prior."""
    num_tokens = data.numel()
    params = lc.adapters(model)
    optimizer = torch.optim.AdamW(params, lr=ADAMW_LR, weight_decay=0.0)
    generator = torch.Generator().manual_seed(seed)
    for _ in progress(range(settings["epochs"]), "AdamW"):
        for rows in torch.randperm(len(data), generator=generator).split(settings["batch"]):
            ids = data[rows]
            optimizer.zero_grad()
            loss = lc.next_token_nll(lc.logits_of(model, ids), ids)
            (loss + prior_penalty(params, num_tokens)).backward()
            optimizer.step()


def train_twin(ensemble: ParallelEnsemble, data: Tensor, settings: dict, seed: int) -> None:
    """AdamW's twin at temperature 1: K chains, AdamW's arguments, the same batches."""
    num_tokens = data.numel()
    params = lc.adapters(ensemble)
    steps = settings["epochs"] * math.ceil(len(data) / settings["batch"])
    sampler = AdamWSGHMC(
        params,
        lr=ADAMW_LR,
        weight_decay=0.0,
        num_data=num_tokens,
        temperature=1.0,
        preconditioner_warmup=steps // 2,
        seed=seed,
    )
    generator = torch.Generator().manual_seed(seed)
    for _ in progress(range(settings["epochs"]), "AdamW twin"):
        for rows in torch.randperm(len(data), generator=generator).split(settings["batch"]):
            ids = data[rows]
            sampler.zero_grad()
            loss = ensemble.loss(lc.next_token_nll, lc.logits_of(ensemble, ids), ids)
            (loss + prior_penalty(params, num_tokens)).backward()
            sampler.step()


def train_ivon(model: torch.nn.Module, data: Tensor, settings: dict, seed: int) -> IVON:
    """IVON on the adapters (one training draw per step), temperature 1."""
    num_tokens = data.numel()
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    optimizer = IVON(
        named,
        ess=num_tokens,
        weight_decay=1 / (num_tokens * PRIOR_STD**2),
        seed=seed,
        **IVON_SETTINGS,
    )
    generator = torch.Generator().manual_seed(seed)
    for _ in progress(range(settings["epochs"]), "IVON"):
        for rows in torch.randperm(len(data), generator=generator).split(settings["batch"]):
            ids = data[rows]
            with optimizer.sampled_params(train=True):
                optimizer.zero_grad()
                lc.next_token_nll(lc.logits_of(model, ids), ids).backward()
            optimizer.step()
    return optimizer


@torch.no_grad()
def scores(logits: Tensor, ids: Tensor) -> dict[str, Tensor]:
    """Per window: NLL of the averaged prediction, total and epistemic uncertainty.

    ``logits`` is ``[S, B, T, V]`` (S = 1 for a single model).
    """
    logp = logits[..., :-1, :].double().log_softmax(-1)  # [S, B, T-1, V]
    mean_logp = logp.logsumexp(0) - math.log(logp.shape[0])  # log of the BMA
    target = ids[:, 1:].unsqueeze(-1)
    nll = -mean_logp.gather(-1, target).squeeze(-1)
    total = -(mean_logp.exp() * mean_logp).sum(-1)
    aleatoric = -(logp.exp() * logp).sum(-1).mean(0)
    return {
        "nll": nll.mean(-1),
        "total": total.mean(-1),
        "epistemic": (total - aleatoric).clamp_min(0).mean(-1),
    }


def evaluate(predict: Any, data: Tensor, batch: int) -> dict[str, Tensor]:
    parts = [scores(predict(ids), ids) for ids in data.split(batch)]
    return {key: torch.cat([p[key] for p in parts]) for key in parts[0]}


def costs(base: torch.nn.Module, layer: int, settings: dict, ids: Tensor) -> dict[str, float]:
    """Memory of one step (ensemble / single run) and throughput (ensemble / loop of 10)."""
    device = ids.device
    rank, lr = settings["rank"], settings["lr"]

    single = lc.with_lora(base, layer, rank).to(device)
    single_opt = torch.optim.SGD(lc.adapters(single), lr=lr, momentum=0.9)

    def single_step(model: Any = single, optimizer: Any = single_opt) -> None:
        optimizer.zero_grad()
        lc.next_token_nll(lc.logits_of(model, ids), ids).backward()
        optimizer.step()

    ensemble = ParallelEnsemble(
        lc.with_lora(base, layer, rank).to(device), K, subset="trainable", seed=0
    )
    sampler = SGHMC(lc.adapters(ensemble), lr=lr, num_data=10_000, seed=0)

    def ensemble_step() -> None:
        sampler.zero_grad()
        ensemble.loss(lc.next_token_nll, lc.logits_of(ensemble, ids), ids).backward()
        sampler.step()

    single_step()
    ensemble_step()  # gradients and optimizer state exist from here on
    single_peak = lc.resident_bytes(lc.state_tensors([single], single_opt))
    single_peak += lc.transient_peak_bytes(single_step, device)
    ensemble_peak = lc.resident_bytes(lc.state_tensors([ensemble], sampler))
    ensemble_peak += lc.transient_peak_bytes(ensemble_step, device)

    loop_models = [lc.with_lora(base, layer, rank).to(device) for _ in range(K)]
    loop_opts = [torch.optim.SGD(lc.adapters(m), lr=lr, momentum=0.9) for m in loop_models]

    def loop_step() -> None:
        for model, optimizer in zip(loop_models, loop_opts, strict=True):
            single_step(model, optimizer)

    repeats = settings["repeats"]
    loop_time = lc.median_seconds(loop_step, repeats, device)
    ensemble_time = lc.median_seconds(ensemble_step, repeats, device)
    return {
        "single step peak MB": single_peak / 2**20,
        "ensemble step peak MB": ensemble_peak / 2**20,
        "memory ratio": ensemble_peak / single_peak,
        "loop of 10 step s": loop_time,
        "ensemble step s": ensemble_time,
        "speedup": loop_time / ensemble_time,
    }


def score_rows(
    results: dict[str, Any],
    predictors: dict[str, Any],
    test: Tensor,
    out_of_distribution: dict[str, Tensor],
    batch: int,
) -> list[dict[str, Any]]:
    """Every method on prose and each OOD text (into ``results["scores"]``), as table rows."""
    rows = []
    for name, predict in predictors.items():
        found = {"prose": evaluate(predict, test, batch)}
        found.update({ood: evaluate(predict, d, batch) for ood, d in out_of_distribution.items()})
        results["scores"][name] = found
        prose = found["prose"]
        for ood in out_of_distribution:
            other = found[ood]
            row = {
                "method": name,
                "OOD text": ood,
                "NLL prose": float(prose["nll"].mean()),
                "NLL OOD": float(other["nll"].mean()),
                "AUROC total": lc.auroc(prose["total"], other["total"]),
            }
            if name in BAYESIAN:
                row["epistemic prose"] = float(prose["epistemic"].mean())
                row["epistemic OOD"] = float(other["epistemic"].mean())
                row["AUROC epistemic"] = lc.auroc(prose["epistemic"], other["epistemic"])
            rows.append(row)
    columns = ["method", "OOD text", "NLL prose", "NLL OOD", "AUROC total"]
    columns += ["epistemic prose", "epistemic OOD", "AUROC epistemic"]
    print_table(
        rows, columns, "Next-token NLL (nats/token); per-window uncertainty: prose vs OOD, AUROC"
    )
    return rows


def laplace_table(results: dict[str, Any], laplaces: dict[str, ll.Predictor]) -> None:
    """The Laplace rows' cost (fit, tuning, the predictive over every text) and prior."""
    for name, predictor in laplaces.items():
        results["laplace"][name.rsplit(" x", 1)[0]]["predict s"] = predictor.seconds
    objective = results["objective"]
    print(
        "The fine-tuning objective (mean token NLL + prior / N) and its gradient norm: "
        + ", ".join(f"{name} {value:.4f} ({grad:.3g})" for name, (value, grad) in objective.items())
    )
    columns = ["method", "fit windows", "fit s", "tuning s", "predict s", "posterior MB"]
    columns += ["evidence", "tuned evidence", "prior min", "prior max", "k", "captured"]
    print_table(
        [{"method": name, **cost} for name, cost in results["laplace"].items()],
        columns,
        f"Laplace over the adapters at AdamW's (GGN, N = windows; predictive: {K} draws)",
    )


def run(quick: bool = True, seed: int = 0) -> dict[str, Any]:
    with torch_threads(1):  # a small model: one thread is fastest, and fair to the loop
        return _run(quick, seed)


def _run(quick: bool, seed: int) -> dict[str, Any]:
    settings = QUICK if quick else FULL
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    warm_up()
    data = lc.corpus(settings["length"], seed=seed, sizes=settings["sizes"])
    data = lc.Corpus(*(t.to(device) for t in (data.pretrain, data.finetune, data.test, data.code)))
    base = lc.tiny_llama(
        hidden=settings["hidden"],
        layers=settings["layers"],
        heads=settings["heads"],
        length=settings["length"],
        seed=seed,
    ).to(device)
    pre_losses = lc.pretrain(
        base,
        data.pretrain,
        steps=settings["pre_steps"],
        batch=settings["pre_batch"],
        lr=3e-3,
        seed=seed,
    )
    base.requires_grad_(False)
    layer = settings["layers"] - 1

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        sgd = lc.with_lora(base, layer, settings["rank"], settings["b_std"])
    train_sgd(sgd, data.finetune, settings, seed)
    ensemble = ParallelEnsemble(
        lambda: lc.with_lora(base, layer, settings["rank"], settings["b_std"]),
        K,
        subset="trainable",
        seed=seed,
    )
    train_sghmc(ensemble, data.finetune, settings, seed)
    # AdamW from SGD's start; its twin's K chains from the SGHMC chains' starts; IVON's
    # mean from SGD's start (the adapters' lora_B drawn as for the others, see above).
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        adamw = lc.with_lora(base, layer, settings["rank"], settings["b_std"])
    train_adamw(adamw, data.finetune, settings, seed)
    twin = ParallelEnsemble(
        lambda: lc.with_lora(base, layer, settings["rank"], settings["b_std"]),
        K,
        subset="trainable",
        seed=seed,
    )
    train_twin(twin, data.finetune, settings, seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        variational = lc.with_lora(base, layer, settings["rank"], settings["b_std"])
    ivon = train_ivon(variational, data.finetune, settings, seed)
    # K draws from IVON's posterior, fixed for every text (as an ensemble's members are)
    draws = ivon.sample(K, generator=torch.Generator().manual_seed(seed))
    # Laplace over the adapters at AdamW's: the lower objective of the two MAP estimates
    batch = settings["batch"]
    results: dict[str, Any] = {"pretrain_losses": pre_losses, "scores": {}}
    results["objective"] = {
        name: ll.objective(model, data.finetune, PRIOR_STD, batch)
        for name, model in (("SGD", sgd), ("AdamW", adamw))
    }
    laplaces, results["laplace"] = ll.laplace_rows(
        adamw, data.finetune, settings, PRIOR_STD, K, seed
    )
    n_out = settings["sizes"][3]
    out_of_distribution = {
        "code": data.code,
        "unicode names": lc.episode_windows(
            "unicode names", settings["length"], train=0, test=n_out, seed=seed
        )[1].to(device),
        "codec tables": lc.episode_windows(
            "codec tables", settings["length"], train=0, test=n_out, seed=seed
        )[1].to(device),
    }
    predictors = {
        "SGD": lambda ids: lc.logits_of(sgd, ids).unsqueeze(0),
        "AdamW": lambda ids: lc.logits_of(adamw, ids).unsqueeze(0),
        f"SGHMC x{K}": lambda ids: lc.logits_of(ensemble, ids),
        f"AdamW twin x{K}": lambda ids: lc.logits_of(twin, ids),
        f"IVON x{K}": lambda ids: call_stacked(variational, draws, input_ids=ids).logits,
        **laplaces,
        "base (no LoRA)": lambda ids: lc.logits_of(base, ids).unsqueeze(0),
    }
    results["rows"] = score_rows(results, predictors, data.test, out_of_distribution, batch)
    laplace_table(results, laplaces)

    results["costs"] = costs(base, layer, settings, data.finetune[: settings["cost_batch"]])
    print_table(
        [{key: round(value, 3) for key, value in results["costs"].items()}],
        list(results["costs"]),
        f"Cost of one training step, K = {K} adapter ensemble (device: {device.type})",
    )
    results["settings"] = settings
    return results


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    found_by = results["scores"]
    panels = [
        ("SGD", "total", "total uncertainty (entropy)"),
        ("AdamW", "total", "total uncertainty (entropy)"),
        (f"SGHMC x{K}", "total", "total uncertainty"),
        *((name, "epistemic", "epistemic (mutual information)") for name in BAYESIAN),
    ]
    texts = [name for name in found_by["SGD"] if name != "prose"]
    fig, axes = plt.subplots(2, 4, figsize=(17, 7.6))
    for ax, (method, key, what) in zip(axes.flat, panels, strict=True):
        found, title = found_by[method], f"{method}: {what}"
        values = {name: found[name][key].cpu() for name in ["prose", *texts]}
        every = torch.cat(list(values.values()))
        bins = torch.linspace(float(every.min()), float(every.max()) + 1e-12, 40).numpy()
        aurocs = []
        for name, value in values.items():
            label = "docstrings (in distribution)" if name == "prose" else name
            ax.hist(value.numpy(), bins=bins, alpha=0.5, label=label)
            if name != "prose":
                aurocs.append(f"{name} {lc.auroc(values['prose'], value):.2f}")
        ax.set_title(f"{title}\nAUROC: " + ", ".join(aurocs), fontsize=8)
        ax.set_xlabel("mean per token of a window (nats)")
    for ax in axes[:, 0]:
        ax.set_ylabel("windows")
    axes[0, 0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    quick, seed, figure = example_arguments(
        argv, __doc__, quick="tiny model, seconds (CI)", figure="bayesian_lora.png"
    )
    results = run(quick=quick, seed=seed)
    plot(results, figure)
    print(f"figure: {figure}")
    return results


if __name__ == "__main__":
    main()
