"""``Laplace(structure="lowrank")`` against the dense Laplace and exact linear algebra.

Small MLPs (3-8-2, P = 50) in float64, where the dense curvature C fits:

* the eigenpairs the matrix-free solver finds are those of ``torch.linalg.eigh(C)``:
  eigenvalues within ``|R|^2 / gap`` (and 1e-8 of the largest), subspaces within the
  Davis-Kahan bound ``sin(angle) <= |R|_F / gap`` with R = C U - U diag(theta) computed
  here from the dense C;
* at k = P the low-rank Laplace IS the dense one: precision, logdet, evidence, variances,
  the GLM predictive, log-densities and the tuned prior agree to float64 round-off
  (1e-9 relative: P = 50 terms and a k x k eigendecomposition of a matrix whose condition
  number is below 1e5 lose at most about P * kappa * eps ~ 1e-9);
* for k < P every operation is exact for the low-rank precision itself (its dense form
  ``precision.dense()`` inverted and factored here);
* sampling: the draw transform applied to the identity is a square root of the
  covariance (exact), and 40,000 draws match it within Monte Carlo error (z-scores).
"""

from __future__ import annotations

import itertools
import math
import re
import warnings

import pytest
import torch
from torch import nn
from torch.func import functional_call, jacrev
from torch.utils.data import DataLoader, TensorDataset

from samplers_as_optim.gaussian.laplace import Laplace, _lowrank_fit
from samplers_as_optim.gaussian.laplace._lowrank import LowRankPrecision
from samplers_as_optim.gaussian.laplace._lowrank_fit import check_rank, top_eigenpairs
from samplers_as_optim.gaussian.laplace._prior_search import grid_scores
from samplers_as_optim.gaussian.laplace.marglik import marglik_training

DT = torch.float64
N = 48
PRIOR = 0.7
P = 3 * 8 + 8 + 8 * 2 + 2  # 50
ROUNDOFF = 1e-9
CASES = [
    ("classification", "ggn"),
    ("classification", "ef"),
    ("regression", "ggn"),
    ("regression", "ef"),
]


def mlp(seed: int = 0, dtype: torch.dtype = DT) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2)).to(dtype)


def data(likelihood: str, seed: int = 1, n: int = N, dtype: torch.dtype = DT):
    generator = torch.Generator().manual_seed(seed)  # float64 draws, then cast
    x = torch.randn(n, 3, generator=generator, dtype=DT).to(dtype)
    if likelihood == "classification":
        return x, torch.randint(0, 2, (n,), generator=generator)
    return x, torch.randn(n, 2, generator=generator, dtype=DT).to(dtype)


def loader(likelihood: str, dtype: torch.dtype = DT, n: int = N) -> DataLoader:
    return DataLoader(TensorDataset(*data(likelihood, n=n, dtype=dtype)), batch_size=16)


def laplace(structure, likelihood="classification", curvature="ggn", **kwargs) -> Laplace:
    kwargs.setdefault("prior_precision", PRIOR)
    model = kwargs.pop("model", None) or mlp(dtype=kwargs.pop("dtype", DT))
    if likelihood == "regression":
        kwargs.setdefault("noise_std", 0.8)
    la = Laplace(
        model,
        num_data=N,
        likelihood=likelihood,
        curvature=curvature,
        structure=structure,
        **kwargs,
    )
    return la.fit(loader(likelihood, next(model.parameters()).dtype), progress=False)


def close(actual, expected, rtol=ROUNDOFF):
    """|actual - expected| <= rtol * max|expected| (round-off relative to the scale)."""
    actual, expected = torch.as_tensor(actual), torch.as_tensor(expected)
    scale = expected.abs().max().clamp(min=1e-300)
    error = float((actual - expected).abs().max() / scale)
    assert error <= rtol, f"relative error {error:.3g} > {rtol:.3g}"


def flat_variances(la) -> torch.Tensor:
    covariance = la.covariance
    if isinstance(covariance, dict):
        return torch.cat([value.reshape(-1) for value in covariance.values()])
    return covariance.diagonal()


def jacobian(la, x) -> torch.Tensor:
    """(B, O, P) Jacobian of the outputs in the treated flat order, by jacrev."""
    mean = la.mean

    def output(params):
        return functional_call(la.model, params, (x,))

    parts = jacrev(output)(mean)
    return torch.cat([parts[name].reshape(x.shape[0], -1, mean[name].numel()) for name in mean], -1)


# ---------------------------------------------------------------- (a) the eigenpairs
@pytest.mark.parametrize(("likelihood", "curvature"), CASES)
def test_eigenpairs_are_those_of_the_dense_curvature(likelihood, curvature):
    k = 4
    dense = laplace("dense", likelihood, curvature)
    low = laplace("lowrank", likelihood, curvature, rank=k)
    matrix = dense.precision - PRIOR * torch.eye(P, dtype=DT)
    values, vectors = torch.linalg.eigh(matrix)
    values, vectors = values.flip(0), vectors.flip(1)
    precision = low.precision
    assert isinstance(precision, LowRankPrecision) and precision.rank == k
    theta, ritz = precision.eigenvalues, precision.eigenvectors  # (k,), (k, P)
    torch.testing.assert_close(ritz @ ritz.T, torch.eye(k, dtype=DT), rtol=0, atol=1e-12)
    residual = matrix @ ritz.T - ritz.T * theta  # R = C U - U diag(theta), from the dense C
    norm = float(torch.linalg.matrix_norm(residual))
    # the stopping rule: every residual <= sqrt(eps) * theta_1 (up to the products' round-off)
    assert norm <= math.sqrt(k) * (2.0**-26 * float(theta[0]) + 1e-12 * float(values[0]))
    gap = float(theta[-1] - values[k])
    assert gap > 1e-3 * float(values[0])  # the bounds below need a gap
    bound = norm**2 / gap + 1e-12 * float(values[0])
    assert float((theta - values[:k]).abs().max()) <= min(bound, 1e-8 * float(values[0]))
    # principal angles: sin = |(I - E E^T) U^T|_2 <= |R|_F / gap (Davis-Kahan)
    top = vectors[:, :k]
    sine = float(torch.linalg.matrix_norm(ritz.T - top @ (top.T @ ritz.T), ord=2))
    assert sine <= norm / gap + 1e-10
    # D: the exact diagonal minus that of U diag(s) U^T, clipped at 0; the trace is kept
    rest = (matrix.diagonal() - ritz.square().T @ theta).clamp(min=0.0)
    close(precision.diagonal - PRIOR, rest, rtol=1e-12)
    close(precision.diagonal.sum() - P * PRIOR + theta.sum(), matrix.trace(), rtol=1e-12)


def test_solver_restarts_and_converges_on_a_large_operator():
    """P = 400, a decaying spectrum: restarts happen (k = 3, blocks of 13) and converge."""
    generator = torch.Generator().manual_seed(0)
    size = 400
    basis, _ = torch.linalg.qr(torch.randn(size, size, generator=generator, dtype=DT))
    spectrum = 0.9 ** torch.arange(size, dtype=DT)
    matrix = (basis * spectrum) @ basis.T
    calls = []

    def product(rows):
        calls.append(rows.shape[0])
        return rows @ matrix

    start, _ = torch.linalg.qr(torch.randn(size, 13, generator=generator, dtype=DT))
    pairs = top_eigenpairs(
        product, start.T, start.T @ matrix, 3, float(spectrum.sum()), generator, 60
    )
    assert pairs.converged and max(calls) <= 13 and pairs.products == len(calls)
    close(pairs.values, spectrum[:3], rtol=1e-10)
    assert len(calls) * 13 + 13 > 4 * 13  # more products than one basis holds: restarted
    fraction = top_eigenpairs(
        lambda rows: rows @ matrix,
        start.T,
        start.T @ matrix,
        0.5,
        float(spectrum.sum()),
        generator,
        60,
    )
    wanted = int((spectrum.cumsum(0) >= 0.5 * spectrum.sum()).nonzero()[0, 0]) + 1
    assert fraction.converged and fraction.values.numel() == wanted
    close(fraction.values, spectrum[:wanted], rtol=1e-10)


def test_a_fraction_of_the_trace_picks_the_fewest_eigenpairs():
    dense = laplace("dense", "regression")
    low = laplace("lowrank", "regression", rank=0.9)
    values = torch.linalg.eigvalsh(dense.precision - PRIOR * torch.eye(P, dtype=DT)).flip(0)
    shares = values.cumsum(0) / values.sum()
    wanted = int((shares >= 0.9).nonzero()[0, 0]) + 1
    assert abs(float(shares[wanted - 1]) - 0.9) > 1e-6  # not on the boundary
    assert low.precision.rank == wanted
    close(low.precision.eigenvalues, values[:wanted], rtol=1e-8)
    # the fraction it holds, public on the precision: at least 0.9, and one pair less is not
    assert low.precision.captured == pytest.approx(float(shares[wanted - 1]), rel=1e-8)
    assert low.precision.captured >= 0.9 > float(shares[wanted - 2])


# ---------------------------------------------------------------- (b), (g): k = P is dense
@pytest.mark.parametrize(("likelihood", "curvature"), CASES)
def test_full_rank_equals_the_dense_laplace(likelihood, curvature):
    dense = laplace("dense", likelihood, curvature)
    low = laplace("lowrank", likelihood, curvature, rank=P)
    assert low._terms.curvature.passes == 1  # the first block spans every direction
    close(low.precision.dense(), dense.precision)
    close(low.precision.logdet(), torch.linalg.slogdet(dense.precision)[1])
    close(low.log_marginal_likelihood(), dense.log_marginal_likelihood())
    close(flat_variances(low), flat_variances(dense))
    x = data(likelihood, seed=5, n=7)[0]
    close(low.function_space(x).covariance, dense.function_space(x).covariance)
    if likelihood == "classification":
        close(low.predictive(x).probs, dense.predictive(x).probs)
    else:
        close(low.predictive(x).epistemic, dense.predictive(x).epistemic)
    draws = dense.sample(5, generator=torch.Generator().manual_seed(3))
    close(low.log_prob(draws), dense.log_prob(draws))
    close(low.penalty(draws), dense.penalty(draws))


@pytest.mark.parametrize("subset", ["last_layer", ["0.weight", "2.bias"]])
def test_subsets_equal_the_dense_subset(subset):
    dense = laplace("dense", subset=subset)
    size = sum(dense.mean[name].numel() for name in dense.subset)
    low = laplace("lowrank", subset=subset, rank=size)
    assert low.subset == dense.subset and low.precision.eigenvectors.shape == (size, size)
    close(low.precision.dense(), dense.precision)
    close(low.log_marginal_likelihood(), dense.log_marginal_likelihood())
    x = data("classification", seed=5, n=7)[0]
    close(low.function_space(x).covariance, dense.function_space(x).covariance)
    part = laplace("lowrank", subset=subset, rank=2)
    assert set(part.sample(2)) == set(dense.subset)


# ---------------------------------------------------------------- exact for k < P
@pytest.mark.parametrize(("likelihood", "curvature"), CASES[::3])
def test_every_operation_is_exact_for_the_low_rank_precision(likelihood, curvature):
    la = laplace("lowrank", likelihood, curvature, rank=3, temperature=0.6)
    precision = la.precision
    matrix = precision.dense()
    inverse = torch.linalg.inv(matrix)
    close(precision.logdet(), torch.linalg.slogdet(matrix)[1])
    close(flat_variances(la), 0.6 * inverse.diagonal())
    x = data(likelihood, seed=5, n=6)[0]
    jac = jacobian(la, x)
    close(la.function_space(x).covariance, 0.6 * jac @ inverse @ jac.mT)
    draws = la.sample(4, generator=torch.Generator().manual_seed(2))
    delta = torch.cat([(draws[n] - la.mean[n]).reshape(4, -1) for n in la.subset], -1)
    expected = torch.distributions.MultivariateNormal(
        torch.zeros(P, dtype=DT), covariance_matrix=0.6 * inverse
    ).log_prob(delta)
    close(la.log_prob(draws), expected)
    # the evidence: log p(D|theta*) - theta*^T L0 theta* / 2 - logdet(L) / 2 + logdet(L0) / 2
    theta = torch.cat([value.reshape(-1) for value in la.mean.values()])
    formula = (
        la.log_likelihood
        - 0.5 * PRIOR * theta.square().sum()
        - 0.5 * torch.linalg.slogdet(matrix)[1]
        + 0.5 * P * math.log(PRIOR)
    )
    close(la.log_marginal_likelihood(), formula)


def test_the_draw_transform_is_an_exact_square_root():
    """W = inverse_sqrt(I)^T: W W^T = inverse(L); (J W)(J W)^T = J inverse(L) J^T."""
    precision = laplace("lowrank", "regression", rank=5).precision
    inverse = torch.linalg.inv(precision.dense())
    identity = torch.eye(P, dtype=DT)
    root = precision.inverse_sqrt(identity).T  # column i is W e_i
    close(root @ root.T, inverse, rtol=1e-12)
    factor = precision.factor(identity)  # row i is e_i^T W
    close(factor @ factor.T, inverse, rtol=1e-12)


def test_draws_have_the_covariance_within_monte_carlo_error():
    """40,000 draws at T = 0.5: every mean and covariance entry within 5.5 standard errors.

    For a Gaussian with covariance S and known mean, the sample covariance over n draws
    has entry variances (S_ii S_jj + S_ij^2) / n and the sample mean S_ii / n; 5.5 keeps
    the chance that one of the 1,325 z-scores exceeds it below 1e-4 (Bonferroni).
    """
    la = laplace("lowrank", "classification", rank=5, temperature=0.5)
    count = 40_000
    draws = la.sample(count, generator=torch.Generator().manual_seed(11))
    theta = torch.cat([value.reshape(-1) for value in la.mean.values()])
    delta = torch.cat([draws[name].reshape(count, -1) for name in la.subset], -1) - theta
    covariance = 0.5 * torch.linalg.inv(la.precision.dense())
    variance = covariance.diagonal()
    z_mean = delta.mean(0) / (variance / count).sqrt()
    empirical = delta.T @ delta / count
    spread = ((torch.outer(variance, variance) + covariance.square()) / count).sqrt()
    assert float(z_mean.abs().max()) < 5.5
    assert float(((empirical - covariance) / spread).abs().max()) < 5.5


# ---------------------------------------------------------------- (c) k grows to P
def test_the_error_shrinks_as_k_grows_and_is_round_off_at_p():
    """The predictive variance and the evidence approach dense's as k grows to P.

    Not monotonically from k = 1: Lambda_(k+1) - Lambda_k = s (u u^T - diag(u^2)) is
    indefinite (the pair moves from the diagonal into the low-rank part), so a few pairs
    can do worse than one (here k = 5 does). From k = 15 on the errors fall at every
    step, below k = 1's, to round-off at k = P.
    """
    dense = laplace("dense", "regression")
    x = data("regression", seed=5, n=10)[0]
    reference = dense.predictive(x).epistemic
    evidence = float(dense.log_marginal_likelihood())
    errors, gaps = [], []
    for k in (1, 5, 15, 30, 45, P):
        low = laplace("lowrank", "regression", rank=k)
        errors.append(float((low.predictive(x).epistemic - reference).abs().max()))
        gaps.append(abs(float(low.log_marginal_likelihood()) - evidence))
    scale = float(reference.abs().max())
    assert errors[-1] <= ROUNDOFF * scale and gaps[-1] <= ROUNDOFF * abs(evidence)
    for values in (errors, gaps):
        assert values[2] < values[0]
        assert all(later < earlier for earlier, later in itertools.pairwise(values[2:]))


def test_the_curvature_rank_counts_the_low_rank_plus_diagonal_eigenvalues():
    """rank(D + U S U^T) = nnz(D) + rank of U S^(1/2) on D's zeros; at k = P, rank(C).

    The empirical Fisher of 48 examples (41 independent gradients here) has rank < P,
    which the evidence's noise check (``check_residuals``) reads.
    """
    matrix = laplace("dense", "classification", "ef").precision - PRIOR * torch.eye(P, dtype=DT)
    for k in (3, P):
        curvature = laplace("lowrank", "classification", "ef", rank=k)._terms.curvature
        low = curvature.eigenvectors.T * curvature.eigenvalues @ curvature.eigenvectors
        expected = torch.linalg.matrix_rank(low + torch.diag(curvature.diagonal), hermitian=True)
        assert curvature.rank() == int(expected)
    assert curvature.rank() == int(torch.linalg.matrix_rank(matrix, hermitian=True)) < P


# ---------------------------------------------------------------- (e) evidence and tuning
@pytest.mark.parametrize("prior_structure", ["scalar", "layerwise", "diag"])
def test_marglik_tuning_at_full_rank_equals_dense(prior_structure):
    results = []
    for structure in ("dense", "lowrank"):
        la = laplace(structure, "regression", rank=P if structure == "lowrank" else None)
        la.optimize_prior_precision(prior_structure=prior_structure, num_steps=20, progress=False)
        prior = la.prior_precision
        flat = (
            torch.cat([v.reshape(-1) for v in prior.values()]) if isinstance(prior, dict) else prior
        )
        results.append((torch.as_tensor(flat), la.noise_std, la.log_marginal_likelihood()))
    (prior_d, noise_d, ev_d), (prior_l, noise_l, ev_l) = results
    close(prior_l, prior_d, rtol=1e-7)  # Adam on round-off-equal gradients
    assert abs(noise_l - noise_d) <= 1e-7 * noise_d
    close(ev_l, ev_d, rtol=1e-7)


def test_prior_forms_at_full_rank_equal_dense_and_a_matrix_is_refused():
    dense = laplace("dense")
    low = laplace("lowrank", rank=P)
    per_tensor = torch.tensor([0.5, 1.0, 2.0, 3.0], dtype=DT)
    per_weight = {name: torch.rand_like(value) + 0.1 for name, value in low.mean.items()}
    for prior in (2.5, per_tensor, per_weight):
        close(low.log_marginal_likelihood(prior), dense.log_marginal_likelihood(prior))
    low.prior_precision = per_weight
    dense.prior_precision = per_weight
    close(low.precision.dense(), dense.precision)
    before = low.precision
    message = (
        f"Invalid prior_precision: tensor of shape ({P}, {P}) (expected a number, one value "
        f"per treated tensor (4,), one per weight ({P},), a dict of per-parameter precisions)"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        low.prior_precision = torch.eye(P, dtype=DT)
    with pytest.raises(ValueError, match=re.escape(message)):
        low.log_marginal_likelihood(torch.eye(P, dtype=DT))
    assert low.precision is before and isinstance(low.prior_precision, dict)


def test_a_new_prior_or_noise_needs_no_pass_and_equals_a_refit():
    la = laplace("lowrank", "regression", rank=6)
    la.prior_precision, la.noise_std = 3.0, 0.4
    refit = laplace("lowrank", "regression", rank=6, prior_precision=3.0, noise_std=0.4)
    close(la.precision.dense(), refit.precision.dense(), rtol=1e-12)
    close(la.log_marginal_likelihood(), refit.log_marginal_likelihood(), rtol=1e-12)


@pytest.mark.parametrize("link_approx", ["probit", "bridge", "mc"])
def test_gridsearch_scores_equal_setting_each_prior(link_approx):
    """k < P: the grid's per-δ precisions equal a rebuilt posterior's predictive."""
    la = laplace("lowrank", rank=4)
    val = DataLoader(TensorDataset(*data("classification", seed=9, n=12)), batch_size=6)
    grid = [0.1, 1.0, 10.0]
    scores = grid_scores(la, val, grid, link_approx, 5, False)
    expected = []
    for value in grid:
        la.prior_precision = value
        total = 0.0
        for index, (inputs, targets) in enumerate(val):
            generator = torch.Generator().manual_seed(index)
            prediction = la.predictive(
                inputs, link_approx=link_approx, num_samples=5, generator=generator
            )
            total -= float(prediction.log_probs[torch.arange(len(targets)), targets].sum())
        expected.append(total)
    close(scores, torch.tensor(expected, dtype=DT), rtol=1e-10)
    if link_approx != "probit":
        return
    dense = laplace("dense")
    full = laplace("lowrank", rank=P)
    close(
        grid_scores(full, val, grid, "probit", 1, False),
        grid_scores(dense, val, grid, "probit", 1, False),
    )
    full.optimize_prior_precision("gridsearch", val_loader=val, grid=grid, progress=False)
    assert full.prior_precision in grid


def test_marglik_training_runs_with_the_low_rank_structure():
    x, y = data("regression")
    model = mlp()
    result = marglik_training(
        model,
        DataLoader(TensorDataset(x, y), batch_size=16),
        num_data=N,
        likelihood="regression",
        structure="lowrank",
        num_epochs=2,
        hyper_steps=3,
        progress=False,
    )
    assert isinstance(result.laplace.precision, LowRankPrecision)
    assert result.laplace.precision.rank == 20 and all(map(math.isfinite, result.evidence))


# ---------------------------------------------------------------- dtypes
def test_float32_at_full_rank_is_the_float64_dense_within_float32_round_off():
    dense = laplace("dense", "regression")
    low = laplace("lowrank", "regression", rank=P, dtype=torch.float32)
    close(low.precision.dense().double(), dense.precision, rtol=1e-5)
    close(low.log_marginal_likelihood().double(), dense.log_marginal_likelihood(), rtol=1e-5)
    close(flat_variances(low).double(), flat_variances(dense), rtol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_fit_sample_predict(dtype):
    la = laplace("lowrank", "classification", rank=6, dtype=dtype)
    samples = la.sample(3, generator=torch.Generator().manual_seed(0))
    assert all(value.dtype == dtype and value.isfinite().all() for value in samples.values())
    x = data("classification", n=5, dtype=dtype)[0]
    assert la.predictive(x).probs.isfinite().all()
    for value in (la.log_prob(la.model), la.log_marginal_likelihood()):
        assert value.dtype == dtype and value.isfinite()


# ---------------------------------------------------------------- (f) refusals
def test_check_rank_defaults():
    assert check_rank(None, "lowrank", 50) == 20 and check_rank(None, "lowrank", 7) == 7
    assert check_rank(None, "diag", 50) is None
    assert check_rank(3, "lowrank", 50) == 3 and check_rank(0.25, "lowrank", 50) == 0.25


RANK_EXPECTED = (
    f"(expected an integer in [1, {P}], the eigenpairs kept of the {P} treated parameters' "
    "curvature, or a fraction in (0, 1) of its trace)"
)
RANK_ERRORS = [
    (
        {"structure": "diag", "rank": 5},
        ValueError,
        "Invalid rank: 5 (expected None unless structure='lowrank')",
    ),
    (
        {"structure": "dense", "rank": 0.5},
        ValueError,
        "Invalid rank: 0.5 (expected None unless structure='lowrank')",
    ),
    ({"rank": 0}, ValueError, f"Invalid rank: 0 {RANK_EXPECTED}"),
    ({"rank": P + 1}, ValueError, f"Invalid rank: {P + 1} {RANK_EXPECTED}"),
    ({"rank": 1.0}, ValueError, f"Invalid rank: 1.0 {RANK_EXPECTED}"),
    ({"rank": 0.0}, ValueError, f"Invalid rank: 0.0 {RANK_EXPECTED}"),
    ({"rank": float("nan")}, ValueError, f"Invalid rank: nan {RANK_EXPECTED}"),
    ({"rank": True}, TypeError, f"Invalid rank: True {RANK_EXPECTED}"),
    ({"rank": "5"}, TypeError, f"Invalid rank: '5' {RANK_EXPECTED}"),
    (
        {"structure": "lowrankk"},
        ValueError,
        "Invalid structure: 'lowrankk' (expected one of 'diag', 'dense', 'kron', 'lowrank')",
    ),
]


@pytest.mark.parametrize(("kwargs", "error", "message"), RANK_ERRORS)
def test_constructor_refusals(kwargs, error, message):
    kwargs = {"structure": "lowrank", **kwargs}
    model = mlp()
    state = {name: value.clone() for name, value in model.state_dict().items()}
    with pytest.raises(error, match=re.escape(message)):
        Laplace(model, num_data=N, likelihood="classification", **kwargs)
    assert all(torch.equal(state[name], value) for name, value in model.state_dict().items())


def test_an_iterator_or_a_changing_loader_is_refused_and_the_fit_kept():
    la = laplace("lowrank", rank=3)
    before = (la.precision, la._terms, la.mean)
    x, y = data("classification")
    batches = [(x[:16], y[:16]), (x[16:], y[16:])]
    message = (
        "Invalid loader: generator, an iterator (expected a loader that can be iterated "
        "again, e.g. a DataLoader or a list of batches: structure='lowrank' passes over the "
        "data several times)"
    )
    with pytest.raises(TypeError, match=re.escape(message)):
        la.fit(iter(batch for batch in batches), progress=False)

    class Shrinking:
        def __init__(self):
            self.calls = 0

        def __iter__(self):
            self.calls += 1
            return iter(batches if self.calls == 1 else batches[:1])

    message = (
        "Invalid loader: pass 2 yielded 16 examples, the first 48 (expected the same "
        "examples in every pass, in any order: structure='lowrank' passes over the data "
        "several times)"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        la.fit(Shrinking(), progress=False)
    assert (la.precision, la._terms) == before[:2] and la.mean.keys() == before[2].keys()
    nan_x = x.clone()
    nan_x[3, 1] = float("nan")
    with pytest.raises(ValueError, match="Invalid batch: inputs contain 1 non-finite value"):
        la.fit([(nan_x, y)], progress=False)
    assert la.precision is before[0]


def test_an_unconverged_solve_warns_and_stays_exact_for_its_pairs(monkeypatch):
    monkeypatch.setattr(_lowrank_fit, "_MAX_PASSES", 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        la = laplace("lowrank", rank=2)
    (warning,) = [w for w in caught if issubclass(w.category, RuntimeWarning)]
    pattern = (
        r"Laplace\.fit\(structure='lowrank'\): the top 2 eigenpairs of the curvature "
        r"\(rank=2\) did not converge in 1 passes over the data \(largest residual .*\); "
        r"the precision is exact for these Ritz pairs"
    )
    assert re.match(pattern, str(warning.message))
    matrix = la.precision.dense()
    close(la.precision.logdet(), torch.linalg.slogdet(matrix)[1])
    close(flat_variances(la), torch.linalg.inv(matrix).diagonal())
