"""Laplace on outputs with positions: ``(batch, *positions, classes)`` and regression.

Issue #37, item 2: a model whose output is ``(batch, sequence, vocabulary)`` (a causal
language model) is fitted token by token, with ``ignore_index`` for padding, for every
structure and subset. The references:

* a position-wise model (embedding -> MLP -> vocabulary, the same module on ``(B, T)``
  token ids and on the ``(B*T,)`` flattened ones): flattening the positions into the
  batch is exact, so the precision of every structure (KFAC-expand is then the KFAC of
  the flattened batch), the log-likelihood, the evidence, the samples and the GLM
  predictive per position equal those of the flattened fit, with the ignored tokens
  dropped from it;
* a causal language model (one attention layer: the positions mix): the brute-force GGN
  :math:`\\sum_{i,t}J_{it}^\\top H_{it}J_{it}` from ``torch.func.jacrev`` over all
  positions (diag, dense, the evidence and the predictive built on it), the brute-force
  KFAC-expand factors of the value projection (Eschenhagen et al. 2023: G summed over the
  factor's columns and the layer's positions, A averaged over the kept positions), and a
  last-layer KFAC equal to the head's fitted on the flattened features;
* padding: a padded batch with ``ignore_index`` against the same sequences unpadded.

float64 throughout; the tolerance is 1e-10 relative: the sums here have fewer than 10^4
terms, whose float64 round-off is below 1e-12 relative, the rest is room for the
conditioning of the eigendecompositions (KFAC, Cholesky).
"""

import math
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, jacrev, vmap
from torch.utils.data import DataLoader, TensorDataset

from samplers_as_optim import predictive
from samplers_as_optim.curvature import fisher_vector_product, ggn_vector_product
from samplers_as_optim.gaussian import _per_example_curvature
from samplers_as_optim.gaussian._per_example_curvature import batch_factor
from samplers_as_optim.gaussian.kfac import KronPrecision
from samplers_as_optim.gaussian.laplace import Laplace
from samplers_as_optim.gaussian.laplace._lowrank import LowRankPrecision
from samplers_as_optim.gaussian.likelihoods import (
    Classification,
    curvature_product,
    make_likelihood,
)

pytestmark = pytest.mark.usefixtures("float64_default")

VOCAB, WIDTH, IGNORE = 7, 6, -100
SUBSETS = [None, "last_layer", ["1.weight", "3.bias"]]
LM_SUBSETS = [None, "last_layer", ["value.weight", "up.bias", "head.weight"]]


def assert_close(a, b, rtol=1e-10):
    a, b = torch.as_tensor(a).detach(), torch.as_tensor(b).detach()
    assert a.shape == b.shape, (a.shape, b.shape)
    scale = max(float(b.abs().max()), 1e-300)
    assert float((a - b).abs().max()) <= rtol * scale, float((a - b).abs().max()) / scale


def loader(x, y, batch_size):
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


def position_wise():
    """Acts on each position alone: the same module on (B, T) ids and on (B*T,) ids."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(VOCAB, 4), nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, VOCAB))


class CausalLM(nn.Module):
    """Embedding, one causal single-head attention (residual), an MLP, the vocabulary."""

    def __init__(self, seed=0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.query = nn.Linear(WIDTH, WIDTH, bias=False)
        self.key = nn.Linear(WIDTH, WIDTH, bias=False)
        self.value = nn.Linear(WIDTH, WIDTH)
        self.up = nn.Linear(WIDTH, 8)
        self.head = nn.Linear(8, VOCAB)
        with torch.no_grad():
            for param in self.parameters():
                param.copy_(0.6 * torch.randn(param.shape, generator=gen))

    def forward(self, ids):
        hidden = self.embed(ids)
        return self.rest(hidden, self.value(hidden))

    def features(self, ids):
        hidden = self.embed(ids)
        return self.attend(hidden, self.value(hidden))

    def attend(self, hidden, value):
        scores = self.query(hidden) @ self.key(hidden).transpose(-1, -2) / math.sqrt(WIDTH)
        length = hidden.shape[-2]
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        mixed = scores.masked_fill(~causal, -math.inf).softmax(-1) @ value
        return torch.tanh(self.up(hidden + mixed))

    def rest(self, hidden, value):
        return self.head(self.attend(hidden, value))


def tokens(batch=6, length=5, seed=1, ignored=True):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, length), generator=gen)
    targets = torch.randint(0, VOCAB, (batch, length), generator=gen)
    if ignored:
        targets[1, 3:] = IGNORE  # a padded tail
        targets[-2, 1] = IGNORE  # one masked position inside a sequence
    return ids, targets


def matrix(la):
    """The fitted precision as a (P, P) matrix (a diagonal one for "diag")."""
    precision = la.precision
    if isinstance(precision, dict):
        return torch.diag(la.treated.flatten(precision))
    if isinstance(precision, KronPrecision | LowRankPrecision):
        return precision.dense()
    return precision


def assert_same_predictive(got, want):
    for field_got, field_want in zip(got, want, strict=True):
        if field_want is None:  # a RegressionPrediction's mixture fields
            assert field_got is None
            continue
        assert_close(field_got, field_want.reshape(field_got.shape))


# ------------------------------------------------------------------ position-wise models
@pytest.mark.parametrize("subset", SUBSETS, ids=["all", "last_layer", "list"])
@pytest.mark.parametrize("structure", ["diag", "dense", "kron"])
def test_position_wise_fit_equals_the_flattened_batch(structure, subset):
    """Precision, log-likelihood, evidence, samples and predictive: the flattened fit's."""
    model = position_wise()
    ids, targets = tokens()
    keep = targets != IGNORE
    common = {"likelihood": "classification", "structure": structure, "subset": subset}
    la = Laplace(model, num_data=len(ids), ignore_index=IGNORE, **common)
    la.fit(loader(ids, targets, 4))
    # the flattened reference: one example per kept token (N/n = 1 in both)
    ref = Laplace(model, num_data=int(keep.sum()), **common)
    ref.fit(loader(ids[keep], targets[keep], 7))
    assert la.subset == ref.subset
    assert_close(matrix(la), matrix(ref))
    assert_close(la.log_likelihood, ref.log_likelihood, rtol=1e-12)
    assert_close(la.log_marginal_likelihood(), ref.log_marginal_likelihood())
    assert_close(la.log_marginal_likelihood(torch.tensor(3.0)), ref.log_marginal_likelihood(3.0))
    x = ids[:3]
    links = ["probit", "mc"] if structure == "diag" else ["probit"]
    for link in links:
        got = la.predictive(
            x, link_approx=link, num_samples=16, generator=torch.Generator().manual_seed(5)
        )
        want = ref.predictive(
            x.reshape(-1),
            link_approx=link,
            num_samples=16,
            generator=torch.Generator().manual_seed(5),
        )
        assert got.probs.shape == (3, 5, VOCAB) and got.epistemic.shape == (3, 5)
        assert_same_predictive(got, want)
    if structure == "kron":  # (a KFAC draw's rotation depends on the factors' eigenvectors)
        for name, variance in la.covariance.items():
            assert_close(variance, ref.covariance[name])
        return
    draws = la.sample(3, generator=torch.Generator().manual_seed(2))
    reference = ref.sample(3, generator=torch.Generator().manual_seed(2))
    for name in la.subset:
        assert_close(draws[name], reference[name])
    outputs = la.predict(x, 3, generator=torch.Generator().manual_seed(2))
    flat = ref.predict(x.reshape(-1), 3, generator=torch.Generator().manual_seed(2))
    assert_close(outputs, flat.reshape(outputs.shape))


def test_function_space_per_position_is_the_joint_covariances_diagonal_blocks():
    model = position_wise()
    ids, targets = tokens()
    la = Laplace(model, num_data=6, likelihood="classification", structure="dense")
    la.fit(loader(ids, targets.clamp(min=0), 3))
    joint = la.function_space(ids[:2])
    blocks = la.function_space(ids[:2], per_position=True)
    assert joint.covariance.shape == (2, 5 * VOCAB, 5 * VOCAB)
    assert blocks.covariance.shape == (2, 5, VOCAB, VOCAB)
    expected = joint.covariance.reshape(2, 5, VOCAB, 5, VOCAB).diagonal(dim1=1, dim2=3)
    assert_close(blocks.covariance, expected.permute(0, 3, 1, 2))
    assert_close(blocks.mean, joint.mean)
    with pytest.raises(
        TypeError, match=re.escape("Invalid per_position: 1 (expected True or False)")
    ):
        la.function_space(ids[:2], per_position=1)


def test_an_ignore_index_among_the_classes_drops_that_class():
    """torch allows any ignore_index; one in [0, classes) ignores that class's targets."""
    model = position_wise()
    ids, targets = tokens(ignored=False)
    keep = targets != 3
    la = Laplace(model, num_data=6, likelihood="classification", ignore_index=3)
    la.fit(loader(ids, targets, 6))
    ref = Laplace(model, num_data=int(keep.sum()), likelihood="classification")
    ref.fit(loader(ids[keep], targets[keep], 30))
    assert_close(matrix(la), matrix(ref))
    assert_close(la.log_marginal_likelihood(), ref.log_marginal_likelihood())


def test_probability_targets_per_position():
    model = position_wise()
    ids, _ = tokens()
    probs = torch.rand(6, 5, VOCAB, generator=torch.Generator().manual_seed(3)).softmax(-1)
    la = Laplace(model, num_data=6, likelihood="classification", ignore_index=IGNORE)
    la.fit(loader(ids, probs, 4))
    ref = Laplace(model, num_data=30, likelihood="classification")
    ref.fit(loader(ids.reshape(-1), probs.reshape(-1, VOCAB), 7))
    assert_close(la.log_likelihood, ref.log_likelihood, rtol=1e-12)
    assert_close(matrix(la), matrix(ref))


@pytest.mark.parametrize(
    ("structure", "curvature"), [("diag", "ggn"), ("dense", "ef"), ("kron", "ggn"), ("kron", "ef")]
)
def test_regression_per_position_equals_the_flattened_batch(structure, curvature):
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2))
    gen = torch.Generator().manual_seed(5)
    x, y = torch.randn(6, 4, 3, generator=gen), torch.randn(6, 4, 2, generator=gen)
    common = {
        "likelihood": "regression",
        "noise_std": 0.7,
        "structure": structure,
        "curvature": curvature,
    }
    la = Laplace(model, num_data=6, **common).fit(loader(x, y, 4))
    ref = Laplace(model, num_data=24, **common).fit(loader(x.reshape(-1, 3), y.reshape(-1, 2), 5))
    assert_close(matrix(la), matrix(ref))
    assert_close(la.log_marginal_likelihood(), ref.log_marginal_likelihood())
    assert_close(
        la.log_marginal_likelihood(noise_std=0.4), ref.log_marginal_likelihood(noise_std=0.4)
    )
    got, want = la.predictive(x[:2]), ref.predictive(x[:2].reshape(-1, 3))
    assert got.mean.shape == (2, 4, 2)
    assert_same_predictive(got, want)


# ------------------------------------------------------------------ a causal language model
def jacobian(model, names, ids):
    """(B, T, V, P): the output's Jacobian with respect to the named parameters."""
    params = {name: param.detach() for name, param in model.named_parameters() if name in names}

    def output(p, x):
        return functional_call(model, p, (x.unsqueeze(0),)).reshape(-1)

    jac = vmap(jacrev(output), in_dims=(None, 0))(params, ids)
    flat = torch.cat([jac[name].reshape(*ids.shape, VOCAB, -1) for name in names], -1)
    return flat


def output_hessians(logits, targets):
    """(B, T, V, V): diag(p) - p p^T per position, zero where the target is ignored."""
    probs = logits.softmax(-1)
    hessian = torch.diag_embed(probs) - probs.unsqueeze(-1) * probs.unsqueeze(-2)
    return hessian * (targets != IGNORE)[..., None, None]


def brute_ggn(model, names, ids, targets):
    """sum_{i,t} J_it^T H_it J_it over every position, from the full Jacobian."""
    jac = jacobian(model, names, ids)
    hessian = output_hessians(model(ids).detach(), targets)
    return torch.einsum("btvp,btvw,btwq->pq", jac, hessian, jac)


def brute_ef(model, names, ids, targets):
    """sum_{i,t} g_it g_it^T with g_it the gradient of position t's loss."""
    params = {name: param.detach() for name, param in model.named_parameters() if name in names}

    def losses(p, x, y):
        logits = functional_call(model, p, (x.unsqueeze(0),))[0]
        return F.cross_entropy(logits, y, reduction="none", ignore_index=IGNORE)

    jac = vmap(jacrev(losses), in_dims=(None, 0, 0))(params, ids, targets)
    rows = torch.cat([jac[name].reshape(ids.numel(), -1) for name in names], -1)
    return rows.T @ rows


def log_likelihood(model, ids, targets):
    logits = model(ids).detach()
    return -F.cross_entropy(logits.movedim(-1, 1), targets, ignore_index=IGNORE, reduction="sum")


@pytest.mark.parametrize("subset", LM_SUBSETS, ids=["all", "last_layer", "list"])
@pytest.mark.parametrize("structure", ["diag", "dense", "lowrank"])
def test_causal_lm_equals_the_brute_force_ggn(structure, subset):
    """The positions mix: the reference is sum_t J_t^T H_t J_t from jacrev, all positions.

    ``"lowrank"`` at full rank (k = P) is the dense precision, from block Lanczos on the
    per-position curvature products."""
    model = CausalLM()
    ids, targets = tokens()
    prior = 2.0
    rank = {}
    if structure == "lowrank":  # k = P, the treated weights' number
        treated = Laplace(model, num_data=6, likelihood="classification", subset=subset).treated
        rank = {"rank": treated.numel}
    la = Laplace(
        model,
        num_data=6,
        likelihood="classification",
        structure=structure,
        subset=subset,
        prior_precision=prior,
        ignore_index=IGNORE,
        **rank,
    ).fit(loader(ids, targets, 4))
    names = la.subset
    ggn = brute_ggn(model, names, ids, targets)
    eye = torch.eye(len(ggn))
    precision = prior * eye + (ggn if structure != "diag" else torch.diag(ggn.diagonal()))
    assert_close(matrix(la), precision)
    # the evidence: log p(D|theta) - theta^T L0 theta / 2 - log det(L) / 2 + log det(L0) / 2
    theta = la.treated.flatten(la.mean)
    loglik = log_likelihood(model, ids, targets)
    evidence = (
        loglik
        - 0.5 * prior * theta.square().sum()
        - 0.5 * torch.linalg.slogdet(precision)[1]
        + 0.5 * len(theta) * math.log(prior)
    )
    assert_close(la.log_likelihood, loglik, rtol=1e-12)
    assert_close(la.log_marginal_likelihood(), evidence)
    # the GLM predictive per position: J_t L^{-1} J_t^T through the probit
    x = ids[:2]
    jac = jacobian(model, names, x)
    covariance = jac @ torch.linalg.solve(precision, jac.transpose(-1, -2))
    logits = model(x).detach()
    prediction = la.predictive(x)
    probs = predictive.probit(logits, covariance.diagonal(dim1=-2, dim2=-1)).softmax(-1)
    assert_close(prediction.probs, probs)
    assert_close(la.function_space(x, per_position=True).covariance, covariance)


def test_causal_lm_kfac_expand_factors_of_a_mixing_layer():
    """The value projection's G sums over columns and positions, A over kept positions."""
    model = CausalLM()
    ids, targets = tokens()
    la = Laplace(
        model, num_data=6, likelihood="classification", structure="kron", ignore_index=IGNORE
    )
    la.fit(loader(ids, targets, 4))
    block = next(block for block in la.precision.blocks if block.weight == "value.weight")
    hidden = model.embed(ids).detach()
    value = model.value(hidden).detach()

    def output(v, h):
        return model.rest(h.unsqueeze(0), v.unsqueeze(0)).reshape(-1)

    jac = vmap(jacrev(output))(value, hidden)  # (B, T*V, T, WIDTH): positions mix
    hessian = output_hessians(model(ids).detach(), targets)
    # square roots of each position's Hessian, block-diagonal over the output positions
    values, vectors = torch.linalg.eigh(hessian)
    roots = vectors * values.clamp(min=0.0).sqrt().unsqueeze(-2)  # (B, T, V, V)
    batch, length = ids.shape
    factor = torch.zeros(batch, length, VOCAB, length, VOCAB)
    for position in range(length):
        factor[:, position, :, position] = roots[:, position]
    factor = factor.reshape(batch, length * VOCAB, length * VOCAB)
    grads = torch.einsum("boc,botw->bctw", factor, jac)  # g_{i c t}
    g_expected = torch.einsum("bctw,bctu->wu", grads, grads)
    rows = torch.cat([hidden, torch.ones(batch, length, 1)], -1)[targets != IGNORE]
    a_expected = rows.T @ rows / len(rows)
    g_got = (block.g_eigenvectors * block.g_eigenvalues) @ block.g_eigenvectors.T
    a_got = (block.a_eigenvectors * block.a_eigenvalues) @ block.a_eigenvectors.T
    assert_close(g_got, g_expected)
    assert_close(a_got, a_expected)


def test_causal_lm_last_layer_kfac_equals_the_head_on_flattened_features():
    """A head applied to each position's features: KFAC-expand is the flattened KFAC."""
    model = CausalLM()
    ids, targets = tokens()
    keep = targets != IGNORE
    la = Laplace(
        model,
        num_data=6,
        likelihood="classification",
        structure="kron",
        subset="last_layer",
        ignore_index=IGNORE,
    ).fit(loader(ids, targets, 4))
    features = model.features(ids).detach()
    ref = Laplace(
        model.head, num_data=int(keep.sum()), likelihood="classification", structure="kron"
    )
    ref.fit(loader(features[keep], targets[keep], 9))
    assert la.subset == ("head.weight", "head.bias")
    assert_close(matrix(la), matrix(ref))
    assert_close(la.log_marginal_likelihood(), ref.log_marginal_likelihood())
    draws = {"num_samples": 8, "link_approx": "bridge"}
    got = la.predictive(ids[:2], generator=torch.Generator().manual_seed(1), **draws)
    want = ref.predictive(
        features[:2].reshape(-1, 8), generator=torch.Generator().manual_seed(1), **draws
    )
    assert_same_predictive(got, want)


@pytest.mark.parametrize("structure", ["diag", "dense"])
def test_causal_lm_empirical_fisher_is_per_token(structure):
    model = CausalLM()
    ids, targets = tokens()
    la = Laplace(
        model,
        num_data=6,
        likelihood="classification",
        curvature="ef",
        structure=structure,
        prior_precision=1.0,
        ignore_index=IGNORE,
    ).fit(loader(ids, targets, 4))
    ef = brute_ef(model, la.subset, ids, targets)
    expected = torch.eye(len(ef)) + (ef if structure == "dense" else torch.diag(ef.diagonal()))
    assert_close(matrix(la), expected)


def test_curvature_products_are_per_position():
    """ggn/fisher_vector_product with Laplace's likelihood object (its ignore_index)."""
    model = CausalLM()
    ids, targets = tokens(batch=3)
    names = [name for name, _ in model.named_parameters()]
    v = torch.randn(
        sum(p.numel() for p in model.parameters()), generator=torch.Generator().manual_seed(6)
    )
    like = Laplace(model, num_data=3, likelihood="classification", ignore_index=IGNORE).likelihood
    assert_close(
        ggn_vector_product(model, ids, targets, v, like), brute_ggn(model, names, ids, targets) @ v
    )
    assert_close(
        fisher_vector_product(model, ids, targets, v, like),
        brute_ef(model, names, ids, targets) @ v,
    )


@pytest.mark.parametrize("kind", ["ggn", "ef"])
@pytest.mark.parametrize("likelihood", ["classification", "regression"])
def test_the_output_space_product_is_the_block_diagonal_factors(kind, likelihood):
    """curvature_product (matrix-free, per position) = V (V^T u) with batch_factor's V."""
    gen = torch.Generator().manual_seed(7)
    output = torch.randn(3, 4, VOCAB, generator=gen)
    if likelihood == "classification":
        like = make_likelihood(likelihood, None, IGNORE)
        targets = torch.randint(0, VOCAB, (3, 4), generator=gen)
        targets[0, 2:] = IGNORE
    else:
        like, targets = make_likelihood(likelihood, 0.6), torch.randn(3, 4, VOCAB, generator=gen)
    u = torch.randn(3, 4 * VOCAB, generator=gen)
    factor = batch_factor(like, kind, output, targets)
    assert factor.shape[:2] == (3, 4 * VOCAB)
    expected = torch.einsum("bok,bk->bo", factor, torch.einsum("bok,bo->bk", factor, u))
    assert_close(curvature_product(like, kind, output, targets, u), expected)


@pytest.mark.parametrize("structure", ["diag", "dense", "kron"])
def test_column_chunks_give_the_same_fit(structure, monkeypatch):
    """Backward passes over a few positions' columns at a time: the same sums."""
    model = CausalLM()
    ids, targets = tokens()

    def fit():
        la = Laplace(model, num_data=6, likelihood="classification", structure=structure)
        return la.fit(loader(ids, targets.clamp(min=0), 6))

    whole = matrix(fit())
    monkeypatch.setattr(_per_example_curvature, "_CHUNK_BYTES", 4000)  # ~ one position
    assert_close(matrix(fit()), whole)


def test_one_linear_layer_with_positions_takes_its_dense_path():
    """A Linear layer on (batch, in) whose output is read as (batch, positions, classes)."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(4, 3 * VOCAB), nn.Unflatten(1, (3, VOCAB)))
    gen = torch.Generator().manual_seed(4)
    x, y = torch.randn(5, 4, generator=gen), torch.randint(0, VOCAB, (5, 3), generator=gen)
    y[0, 1] = IGNORE
    dense = Laplace(
        model, num_data=5, likelihood="classification", structure="dense", ignore_index=IGNORE
    ).fit(loader(x, y, 5))
    params = dict(model.named_parameters())

    def output(p, inputs):
        return functional_call(model, p, (inputs.unsqueeze(0),)).reshape(3, VOCAB, 1)

    jac = vmap(jacrev(output), in_dims=(None, 0))(params, x)
    flat = torch.cat([jac[name].reshape(5, 3, VOCAB, -1) for name in params], -1)
    hessian = output_hessians(model(x).detach(), y)
    ggn = torch.einsum("btvp,btvw,btwq->pq", flat, hessian, flat)
    assert_close(matrix(dense), torch.eye(len(ggn)) + ggn)


# ------------------------------------------------------------------ padding
@pytest.mark.parametrize("structure", ["diag", "dense", "kron"])
def test_padding_changes_nothing(structure):
    """A right-padded batch with ignore_index against the same sequences unpadded."""
    model = CausalLM()
    lengths = [5, 3, 5, 2]
    ids, targets = tokens(batch=4, ignored=False)
    padded_ids, padded_targets = ids.clone(), targets.clone()
    for row, length in enumerate(lengths):
        padded_ids[row, length:] = 0  # a pad token: any id
        padded_targets[row, length:] = IGNORE
    common = {"num_data": 4, "likelihood": "classification", "structure": structure}
    padded = Laplace(model, ignore_index=IGNORE, **common).fit(
        loader(padded_ids, padded_targets, 4)
    )
    # the same sequences, unpadded: one batch per length
    batches = [
        (ids[[0, 2]], targets[[0, 2]]),
        (ids[[1], :3], targets[[1], :3]),
        (ids[[3], :2], targets[[3], :2]),
    ]
    plain = Laplace(model, **common).fit(batches)
    assert_close(matrix(padded), matrix(plain))
    assert_close(padded.log_likelihood, plain.log_likelihood, rtol=1e-12)
    assert_close(padded.log_marginal_likelihood(), plain.log_marginal_likelihood())
    # the closed-form fields (the sampled ones draw noise of another shape)
    got = padded.predictive(padded_ids[[1]], num_samples=1)
    want = plain.predictive(ids[[1], :3], num_samples=1)
    for field in ("log_probs", "probs", "total"):
        assert_close(getattr(got, field)[:, :3], getattr(want, field))


def test_evidence_tuning_is_the_flattened_one():
    model = position_wise()
    ids, targets = tokens()
    keep = targets != IGNORE
    la = Laplace(
        model, num_data=6, likelihood="classification", structure="kron", ignore_index=IGNORE
    )
    la.fit(loader(ids, targets, 4))
    ref = Laplace(model, num_data=int(keep.sum()), likelihood="classification", structure="kron")
    ref.fit(loader(ids[keep], targets[keep], 7))
    la.optimize_prior_precision(method="marglik", num_steps=30)
    ref.optimize_prior_precision(method="marglik", num_steps=30)
    assert_close(torch.as_tensor(la.prior_precision), torch.as_tensor(ref.prior_precision))


# ------------------------------------------------------------------ refusals
def test_targets_of_neither_shape_are_refused_and_the_fit_kept():
    model = position_wise()
    ids, targets = tokens()
    la = Laplace(model, num_data=6, likelihood="classification", ignore_index=IGNORE)
    la.fit(loader(ids, targets, 3))
    before = matrix(la).clone()
    expected = (
        "Invalid targets: shape (3, 4) (expected class indices of an integer dtype, shape "
        "(3, 5), in [0, 7) or ignore_index -100, or class probabilities of the output's "
        "shape (3, 5, 7))"
    )
    with pytest.raises(ValueError, match=re.escape(expected)):
        la.fit(loader(ids, targets[:, :4], 3))
    probs = torch.full((6, 5, 6), 1 / 6)  # probabilities of another number of classes
    with pytest.raises(
        ValueError, match=re.escape("Invalid targets: dtype torch.float64 of shape (3, 5, 6)")
    ):
        la.fit(loader(ids, probs, 3))
    assert torch.equal(matrix(la), before)


def test_class_indices_out_of_range_name_their_position():
    model = position_wise()
    ids, targets = tokens()
    targets[2, 3] = VOCAB
    la = Laplace(model, num_data=6, likelihood="classification", ignore_index=IGNORE)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "Invalid targets: class index 7 in example 2 of 3 at position (3,) (expected "
            "0 <= targets < 7, the number of model outputs, or ignore_index -100)"
        ),
    ):
        la.fit(loader(ids, targets, 3))
    targets[2, 3] = -1  # no ignore_index: a negative index is refused, -100 too
    plain = Laplace(model, num_data=6, likelihood="classification")
    with pytest.raises(
        ValueError,
        match=re.escape(
            "Invalid targets: class index -100 in example 1 of 3 at position (3,) (expected "
            "0 <= targets < 7, the number of model outputs)"
        ),
    ):
        plain.fit(loader(ids, targets, 3))
    with pytest.raises(RuntimeError, match="not fitted"):
        la.log_likelihood  # noqa: B018


def test_regression_targets_of_another_shape_are_refused():
    model = nn.Linear(3, 2)
    x, y = torch.randn(4, 5, 3), torch.randn(4, 5, 2)
    la = Laplace(model, num_data=4, likelihood="regression")
    with pytest.raises(
        ValueError,
        match=re.escape(
            "Invalid targets: shape (4, 5) (expected the model output's shape (4, 5, 2) for "
            "likelihood='regression')"
        ),
    ):
        la.fit(loader(x, y[..., 0], 4))


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (
            {"likelihood": "regression", "ignore_index": -100},
            ValueError,
            "Invalid ignore_index: -100 (expected None: it applies only to "
            "likelihood='classification')",
        ),
        (
            {
                "likelihood": lambda f, t: -F.cross_entropy(f, t, reduction="none"),
                "ignore_index": 0,
            },
            ValueError,
            "Invalid ignore_index: 0 (expected None: it applies only to "
            "likelihood='classification'; a callable likelihood masks its own targets)",
        ),
        (
            {"likelihood": "classification", "ignore_index": 1.5},
            TypeError,
            "Invalid ignore_index: 1.5 (expected None or an integer, e.g. -100 as "
            "torch.nn.CrossEntropyLoss uses)",
        ),
        (
            {"likelihood": "classification", "ignore_index": True},
            TypeError,
            "Invalid ignore_index: True (expected None or an integer",
        ),
        (
            {"likelihood": "classification", "ignore_index": "pad"},
            TypeError,
            "Invalid ignore_index: 'pad' (expected None or an integer",
        ),
    ],
)
def test_ignore_index_refusals(kwargs, error, message):
    with pytest.raises(error, match=re.escape(message)):
        Laplace(position_wise(), num_data=6, **kwargs)


def test_a_likelihood_object_carries_its_own_arguments():
    like = Classification(ignore_index=IGNORE)
    assert make_likelihood(like, None) is like
    assert Classification(ignore_index=torch.tensor(-1)).ignore_index == -1
    for argument, value in (("noise_std", 0.5), ("ignore_index", 0)):
        with pytest.raises(
            ValueError,
            match=re.escape(
                f"Invalid {argument}: {value!r} (expected None with a Likelihood object, "
                "which carries its own)"
            ),
        ):
            make_likelihood(like, *((value, None) if argument == "noise_std" else (None, value)))


def test_curvature_products_refuse_targets_of_neither_shape():
    model = CausalLM()
    ids, targets = tokens(batch=3)
    v = torch.zeros(sum(p.numel() for p in model.parameters()))
    like = Classification(ignore_index=IGNORE)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "Invalid targets: class indices of shape (3, 4) (expected class indices of shape "
            "(3, 5) in [0, 7) (or ignore_index -100) or class probabilities of shape "
            "(3, 5, 7), for the model output of shape (3, 5, 7))"
        ),
    ):
        ggn_vector_product(model, ids, targets[:, :4], v, like)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "Invalid targets: class indices outside [0, 7) (expected class indices of shape "
            "(3, 5) in [0, 7) or class probabilities of shape (3, 5, 7), for the model output "
            "of shape (3, 5, 7); there is no ignore_index: leave such examples out)"
        ),
    ):
        fisher_vector_product(model, ids, targets, v)


# ------------------------------------------------------------------ tuning with positions
GRID = [0.05, 0.5, 5.0, 50.0]


def predictive_grid(la, batches, link_approx, num_samples):
    """-Σ log p̄(y_t) over the kept positions of ``la.predictive`` at each δ (batch b: seed b)."""
    scores = []
    for delta in GRID:
        la.prior_precision = delta
        total = torch.zeros(())
        for index, (ids, targets) in enumerate(batches):
            prediction = la.predictive(
                ids,
                link_approx=link_approx,
                num_samples=num_samples,
                generator=torch.Generator().manual_seed(index),
            )
            keep = targets != IGNORE
            total -= prediction.log_probs[keep].gather(-1, targets[keep].unsqueeze(-1)).sum()
        scores.append(total)
    return torch.stack(scores)


@pytest.mark.parametrize("subset", [None, "last_layer"], ids=["all", "last_layer"])
@pytest.mark.parametrize("link_approx", ["probit", "bridge", "bridge_norm", "mc"])
def test_gridsearch_scores_positions_as_the_predictive_does(link_approx, subset):
    """Per position, as ``predictive``: the bridge on K x K blocks, MC with its draws."""
    from samplers_as_optim.gaussian.laplace._prior_search import grid_scores

    ids, targets = tokens()
    la = Laplace(
        position_wise(),
        num_data=6,
        likelihood="classification",
        structure="kron",
        subset=subset,
        ignore_index=IGNORE,
    )
    la.fit(loader(ids, targets, 3))
    batches = [(ids[:4], targets[:4]), (ids[4:], targets[4:])]
    scores = grid_scores(la, batches, GRID, link_approx, 16, False)
    assert_close(scores, predictive_grid(la, batches, link_approx, 16))
    la.optimize_prior_precision(
        "gridsearch", val_loader=batches, grid=GRID, link_approx=link_approx, num_samples=16
    )
    assert la.prior_precision == GRID[int(scores.argmin())]


def test_marglik_training_ignores_the_padding():
    """``ignore_index`` passes through: the run equals the one on the kept tokens alone.

    Full-batch SGD: the sequence loss is (N_tok / N_seq) times the token loss, so a rate
    N_seq / N_tok times the token run's takes the same steps; the evidence is the same
    (``test_evidence_tuning_is_the_flattened_one``).
    """
    from samplers_as_optim.gaussian.laplace.marglik import marglik_training

    ids, targets = tokens()
    keep = targets != IGNORE
    sequences, kept = ids.shape[0], int(keep.sum())
    runs = []
    for data, num_data, rate, extra in (
        ((ids, targets), sequences, 0.2 * sequences / kept, {"ignore_index": IGNORE}),
        ((ids[keep], targets[keep]), kept, 0.2, {}),
    ):
        model = position_wise()
        result = marglik_training(
            model,
            [data],
            num_data=num_data,
            likelihood="classification",
            optimizer=torch.optim.SGD(model.parameters(), lr=rate),
            num_epochs=3,
            structure="kron",
            hyper_steps=5,
            progress=False,
            **extra,
        )
        runs.append(result)
    padded, flat = runs
    assert padded.laplace.likelihood.ignore_index == IGNORE
    assert_close(torch.tensor(padded.evidence), torch.tensor(flat.evidence))
    for name, value in flat.state_dict.items():
        assert_close(padded.state_dict[name], value)
    for name, value in flat.laplace.prior_precision.items():
        assert_close(padded.laplace.prior_precision[name], value)
    model = position_wise()
    before = {name: value.clone() for name, value in model.state_dict().items()}
    with pytest.raises(ValueError, match=re.escape("Invalid ignore_index: -100 (expected None")):
        marglik_training(
            model,
            [(ids, targets.double())],
            num_data=6,
            likelihood="regression",
            num_epochs=1,
            ignore_index=IGNORE,
            progress=False,
        )
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, before[name], rtol=0.0, atol=0.0)
