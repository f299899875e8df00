"""Laplace over a fine-tune's LoRA adapters: the Bayesian LoRA example's Laplace rows.

``Laplace(Logits(lm), num_data=W, likelihood="classification", subset=<the adapters>,
structure=..., ignore_index=IGNORE)`` around the fine-tuned adapters (the example fits it
at AdamW's, the MAP of the prior N(0, 1); see ``bayesian_lora.py``), in the units of
docs/design.md (section "Laplace: the structures of the precision, and outputs with
positions"):

* the model is the PEFT causal LM wrapped so that its forward takes token ids and
  returns ``(batch, sequence, vocabulary)`` logits (:class:`Logits`); every position's
  target is the next token, the last position's ``IGNORE`` (it has none), so a window's
  log-likelihood is the sum over its T - 1 predicted tokens;
* N = ``num_data`` counts windows (W, the fine-tuning windows), the prior precision is
  1 / PRIOR_STD^2 as a number; the curvature (the GGN, exact: every position's softmax
  Hessian) comes from the first ``windows`` of the (shuffled) fine-tuning windows,
  scaled by W / windows (the exact GGN costs T x V backward columns per window, seconds
  per window here: the whole fine-tuning set would take tens of minutes in full mode);
* ``structure="kron"`` (KFAC-expand over the eight ``nn.Linear`` adapters) and
  ``structure="lowrank"`` (the top ``RANK`` eigenpairs plus the diagonal of the rest);
* the prior precision tuned by the evidence, ``optimize_prior_precision(
  prior_structure="layerwise")``: one precision per adapter tensor (lora_A and lora_B
  have different scales; with KFAC one per layer, each adapter a layer without bias);
* the predictive: the linearised network (the GLM predictive) at ``draws`` posterior
  draws, ``la.predict(ids, draws)`` (one ``jvp`` per draw), the same draws for every
  batch and text, scored like an ensemble's members (the Monte Carlo form of the GLM
  predictive). ``la.predictive(ids)`` puts the same function-space Gaussian through the
  probit approximation in closed form, but it forms each window's Jacobian of all
  T x V logits by reverse mode: about 1.3 s a window in quick mode, against 10 ms for
  ten draws, too slow for the 800 windows of the four texts in full mode.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, cast

import lora_common as lc
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from samplers_as_optim import Laplace

#: The target of a position without a next token (``CrossEntropyLoss``'s default).
IGNORE = -100
#: The low rank k, the library's default: it holds 99% of the GGN's trace on the quick
#: model (P = 1,024) and 53% on the full one (P = 3,072; printed as "captured"), where
#: k = 60 (78%) changed the prose NLL by 1e-4 and the AUROCs by <= 0.03 (bayesian_lora.py).
RANK = 20
#: name -> (structure, rank) of the Laplace rows
STRUCTURES = {"Laplace KFAC": ("kron", None), "Laplace low-rank": ("lowrank", RANK)}


class Logits(nn.Module):
    """A Hugging Face causal LM as Laplace reads it: ids -> ``(batch, seq, vocab)`` logits."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids: Tensor) -> Tensor:
        return cast(Tensor, self.lm(input_ids=ids).logits)


def next_token_targets(ids: Tensor) -> Tensor:
    """Every position's next token; the last position has none (``IGNORE``)."""
    targets = ids.roll(-1, dims=1)
    targets[:, -1] = IGNORE
    return targets


def objective(model: nn.Module, data: Tensor, prior_std: float, batch: int) -> tuple[float, float]:
    """The fine-tuning objective at ``model``'s adapters and its gradient's norm.

    Mean next-token NLL over every window of ``data`` plus the prior N(0, prior_std^2)
    over N = ``data.numel()`` tokens (what SGD, SGHMC and AdamW minimise or sample).
    """
    params = lc.adapters(model)
    num_tokens = data.numel()
    grads = [torch.zeros_like(p) for p in params]
    value = 0.0
    for ids in data.split(batch):
        loss = lc.next_token_nll(lc.logits_of(model, ids), ids) * (len(ids) / len(data))
        for total, grad in zip(grads, torch.autograd.grad(loss, params), strict=True):
            total += grad
        value += float(loss.detach())
    with torch.no_grad():
        for total, p in zip(grads, params, strict=True):
            total += p / (num_tokens * prior_std**2)
        value += sum(float(p.square().sum()) for p in params) / (2 * num_tokens * prior_std**2)
    return value, float(torch.cat([g.flatten() for g in grads]).norm())


def stored_bytes(value: Any) -> int:
    """Bytes of the distinct tensor storages reachable from ``value`` (its attributes)."""
    storages: dict[int, int] = {}
    seen: set[int] = set()
    pending = [value]
    while pending:
        item = pending.pop()
        if id(item) in seen or isinstance(item, (nn.Module, str, bytes, int, float, type)):
            continue
        seen.add(id(item))
        if isinstance(item, Tensor):
            storages[item.untyped_storage().data_ptr()] = item.untyped_storage().nbytes()
        elif isinstance(item, dict):
            pending.extend(item.values())
        elif isinstance(item, (list, tuple)):
            pending.extend(item)
        elif dataclasses.is_dataclass(item):
            pending.extend(getattr(item, field.name) for field in dataclasses.fields(item))
        elif hasattr(item, "__dict__"):
            pending.extend(vars(item).values())
    return sum(storages.values())


def fit(
    lm: nn.Module,
    data: Tensor,
    name: str,
    *,
    windows: int,
    batch: int,
    prior_precision: float,
) -> tuple[Laplace, dict[str, Any]]:
    """The Laplace ``name`` (of ``STRUCTURES``) around ``lm``'s adapters, evidence-tuned.

    Returns the fitted approximation and its cost: the fit's and the tuning's seconds,
    the bytes its precision keeps, the evidence before and after tuning, the tuned
    precisions' range and, for the low rank, k and the fraction of tr(GGN) it holds.
    """
    structure, rank = STRUCTURES[name]
    model = Logits(lm)
    adapters = [key for key, p in model.named_parameters() if p.requires_grad]
    la = Laplace(
        model,
        num_data=len(data),  # windows: each window's log-likelihood sums its tokens
        likelihood="classification",
        subset=adapters,
        structure=structure,
        rank=rank,
        prior_precision=prior_precision,
        ignore_index=IGNORE,
    )
    ids = data[:windows]
    start = time.perf_counter()
    la.fit(DataLoader(TensorDataset(ids, next_token_targets(ids)), batch_size=batch))
    fit_s = time.perf_counter() - start
    evidence = float(la.log_marginal_likelihood())
    start = time.perf_counter()
    la.optimize_prior_precision(prior_structure="layerwise")
    tune_s = time.perf_counter() - start
    prior = la.prior_precision
    assert isinstance(prior, dict)  # "layerwise": name -> the tensor's precision per weight
    tuned = torch.cat([prior[key].flatten() for key in la.subset])
    cost = {
        "fit windows": windows,
        "fit s": fit_s,
        "tuning s": tune_s,
        "posterior MB": stored_bytes(la.precision) / 2**20,
        "evidence": evidence,
        "tuned evidence": float(la.log_marginal_likelihood()),
        "prior min": float(tuned.min()),
        "prior max": float(tuned.max()),
    }
    if structure == "lowrank":  # k, and the fraction of the GGN's trace its pairs hold
        cost["k"] = la.precision.rank
        cost["captured"] = la.precision.captured
    return la, cost


class Predictor:
    """``ids -> (draws, batch, seq, vocab)``: the linearised network at fixed posterior draws.

    The same ``draws`` for every call (the generator re-seeded with ``seed``), as an
    ensemble's members are the same for every text; ``seconds`` sums the calls' time.
    """

    def __init__(self, la: Laplace, draws: int, seed: int) -> None:
        self.la, self.draws, self.seed = la, draws, seed
        self.seconds = 0.0

    def __call__(self, ids: Tensor) -> Tensor:
        start = time.perf_counter()
        generator = torch.Generator(device=ids.device).manual_seed(self.seed)
        with torch.no_grad():
            logits: Tensor = self.la.predict(ids, self.draws, linear=True, generator=generator)
        self.seconds += time.perf_counter() - start
        return logits


def laplace_rows(
    lm: nn.Module, data: Tensor, settings: dict[str, Any], prior_std: float, draws: int, seed: int
) -> tuple[dict[str, Predictor], dict[str, dict[str, Any]]]:
    """Both Laplace rows around ``lm``'s adapters: their predictors and their costs."""
    predictors: dict[str, Predictor] = {}
    costs = {}
    for name in STRUCTURES:
        la, costs[name] = fit(
            lm,
            data,
            name,
            windows=settings["laplace_windows"],
            batch=settings["batch"],
            prior_precision=1.0 / prior_std**2,
        )
        predictors[f"{name} x{draws}"] = Predictor(la, draws, seed)
    return predictors, costs
