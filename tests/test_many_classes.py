"""A last layer over many classes: the GLM predictive by the Kronecker identity (#37, item 3).

When the treated weights are one ``nn.Linear``'s (``subset="last_layer"``), the
function-space covariance :math:`T J\\Lambda^{-1}J^\\top` is computed from the layer's
input :math:`\\tilde\\phi` and the structure of Λ (``gaussian/linearised/_last_layer``),
without the C x P Jacobian. The reference is today's route, the Jacobian by ``jacrev``
(forced here by hiding the head from ``function_space``), on a small body network with
a 40-class head, in float64:

* the covariance, its diagonal, the per-position blocks and every closed form (probit,
  bridge, bridge_norm; regression's variances) equal the Jacobian route's to round-off
  (1e-10 relative: sums of fewer than 10^3 terms, and no eigendecomposition that differs);
* the draws go through the factor's own square root R, not an ``eigh`` of Σ_f: R Rᵀ
  equals the Jacobian route's Σ_f to round-off, and the Monte Carlo fields are
  ``predictive.classification`` of f̄ + Rξ with the generator's ξ; against the Jacobian
  route's draws (another root, the same law) the averages agree within 5 standard
  deviations of their difference, estimated from the draws.
"""

from __future__ import annotations

import copy
import functools
import re

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from samplers_as_optim import ExtendedKalmanFilter, Laplace, predictive
from samplers_as_optim.gaussian.laplace._prior_search import grid_scores
from samplers_as_optim.gaussian.linearised import _last_layer
from samplers_as_optim.gaussian.linearised import function_space as function_space_module
from samplers_as_optim.gaussian.linearised import output_jacobians as jacobians_module
from samplers_as_optim.gaussian.linearised.glm_predictive import (
    bridge_from_moments,
    covariance_root,
)

pytestmark = pytest.mark.usefixtures("float64_default")

CLASSES, FEATURES = 40, 8
STRUCTURES = ["diag", "kron", "lowrank"]
LINKS = ["probit", "bridge", "bridge_norm"]


def assert_close(actual, expected, rtol=1e-10):
    actual, expected = torch.as_tensor(actual), torch.as_tensor(expected)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    scale = max(float(expected.abs().max()), 1e-300)
    error = float((actual - expected).abs().max())
    assert error <= rtol * scale, error / scale


def network(bias=True, outputs=CLASSES):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, FEATURES), nn.Tanh(), nn.Linear(FEATURES, outputs, bias=bias))


def sequence_network():
    """Position-wise: tokens -> features -> 40 classes at every position."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Embedding(11, 6), nn.Linear(6, FEATURES), nn.Tanh(), nn.Linear(FEATURES, CLASSES)
    )


def variant(name):
    """A model and its training data: the 40-class head, without bias, regression, ..."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(32, 5, generator=generator)
    if name == "positions":
        ids = torch.randint(0, 11, (6, 4), generator=generator)
        targets = torch.randint(0, CLASSES, (6, 4), generator=generator)
        targets[0, 2:] = -100  # padding
        return sequence_network(), "classification", (ids, targets)
    if name.startswith("regression"):
        x = x.reshape(8, 4, 5) if name == "regression_positions" else x
        y = torch.randn(*x.shape[:-1], 3, generator=generator)
        return network(outputs=3), "regression", (x, y)
    y = torch.randint(0, CLASSES, (32,), generator=generator)
    return network(bias=name != "no_bias"), "classification", (x, y)


@functools.cache
def _fit(structure, name):
    model, likelihood, data = variant(name)
    extra = {"rank": 8} if structure == "lowrank" else {}
    if likelihood == "regression":
        extra["noise_std"] = 0.3
    if name == "positions":
        extra["ignore_index"] = -100
    la = Laplace(
        model,
        num_data=len(data[0]),
        likelihood=likelihood,
        structure=structure,
        subset="last_layer",
        prior_precision=0.5,
        temperature=0.7,
        **extra,
    )
    return la.fit(DataLoader(TensorDataset(*data), batch_size=16), progress=False)


def fitted(structure, name="head"):
    """A fitted last-layer Laplace (each fitted once per module; a copy to change freely)."""
    return copy.deepcopy(_fit(structure, name))


def inputs_of(count=6, seed=2):
    return torch.randn(count, 5, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def jacobian_route(monkeypatch):
    """A context in which ``function_space``/``predictive`` take the Jacobian route."""

    class Route:
        def __enter__(self):
            monkeypatch.setattr(function_space_module, "find_head", lambda *args: None)

        def __exit__(self, *exc):
            monkeypatch.undo()

    return Route()


def rows_of(la, x):
    """The head route's factored covariance of ``x``."""
    return la._output_gaussian(x, None).covariance


def root_of(rows, lead, classes=CLASSES):
    """R with columns ``steps(e_j)``: the head route's square root, ``(*lead, C, C)``."""
    eye = torch.eye(classes).reshape(classes, *([1] * len(lead)), classes)
    return rows.steps(eye.expand(classes, *lead, classes)).movedim(0, -1)


# ------------------------------------------------------------------ which models take it
def test_the_head_is_found_only_where_the_identity_holds():
    model = network()
    found = _last_layer.find_head(
        model, Laplace(model, num_data=1, likelihood="classification", subset="last_layer").treated
    )
    assert found is not None and (found.weight, found.bias) == ("2.weight", "2.bias")
    weight_only = Laplace(model, num_data=1, likelihood="classification", subset=["2.weight"])
    assert _last_layer.find_head(model, weight_only.treated).bias is None
    for subset in (None, ["2.bias"], ["0.bias", "2.weight"]):
        la = Laplace(model, num_data=1, likelihood="classification", subset=subset)
        assert _last_layer.find_head(model, la.treated) is None, subset
    first = Laplace(model, num_data=1, likelihood="classification", subset=["0.weight"])
    assert _last_layer.find_head(model, first.treated) is not None  # a Linear, but not last
    x = inputs_of()
    assert (
        function_space_module.last_layer_inputs(
            model, first.treated, first.treated.current(model), x
        )[1]
        is None
    )

    class Scaled(nn.Linear):
        def forward(self, x):
            return 2.0 * super().forward(x)

    custom = nn.Sequential(nn.Linear(5, FEATURES), nn.Tanh(), Scaled(FEATURES, CLASSES))
    la = Laplace(custom, num_data=1, likelihood="classification", subset="last_layer")
    assert _last_layer.find_head(custom, la.treated) is None
    tied = network()
    tied.add_module("3", nn.Linear(FEATURES, CLASSES))
    tied[3].weight = tied[2].weight
    la = Laplace(tied, num_data=1, likelihood="classification", subset=["2.weight"])
    assert _last_layer.find_head(tied, la.treated) is None


class Doubled(nn.Module):
    """The head's output is not the model's (a scale after it)."""

    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Sequential(nn.Linear(5, FEATURES), nn.Tanh()), None
        self.head = nn.Linear(FEATURES, CLASSES)

    def forward(self, x):
        return 2.0 * self.head(self.body(x))


class Twice(nn.Module):
    """The head runs twice (its input depends on its weights)."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(CLASSES, CLASSES)
        self.body = nn.Linear(5, CLASSES)

    def forward(self, x):
        return self.head(torch.tanh(self.head(self.body(x))))


class InPlace(Doubled):
    """The head's output, scaled in place: the very tensor, but not the head's values."""

    def forward(self, x):
        out = self.head(self.body(x))
        out.mul_(2.0)
        return out


@pytest.mark.parametrize("make", [Doubled, Twice, InPlace], ids=["scaled", "twice", "in_place"])
def test_a_head_whose_output_is_not_the_models_takes_the_jacobian(make, jacobian_route):
    torch.manual_seed(0)
    model = make()
    x, y = inputs_of(32), torch.randint(0, CLASSES, (32,))
    la = Laplace(
        model, num_data=32, likelihood="classification", structure="kron", subset="last_layer"
    ).fit(DataLoader(TensorDataset(x, y), batch_size=16))
    x = inputs_of()
    assert _last_layer.find_head(la.model, la.treated) is not None
    assert function_space_module.last_layer_inputs(la.model, la.treated, la.mean, x)[1] is None
    got = la.function_space(x).covariance
    with jacobian_route:
        assert_close(got, la.function_space(x).covariance, rtol=0.0)


# ------------------------------------------------------------------ exactness
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("structure", STRUCTURES)
def test_function_space_equals_the_jacobian_route(structure, bias, jacobian_route):
    la = fitted(structure, "head" if bias else "no_bias")
    x = inputs_of()
    got = la.function_space(x)
    diagonal = la.function_space(x, diagonal=True).covariance
    with jacobian_route:
        want = la.function_space(x)
        want_diagonal = la.function_space(x, diagonal=True).covariance
    assert_close(got.mean, want.mean, rtol=0.0)
    assert_close(got.covariance, want.covariance)
    assert_close(diagonal, want_diagonal)
    assert_close(want_diagonal, want.covariance.diagonal(dim1=-2, dim2=-1))


@pytest.mark.parametrize("structure", STRUCTURES)
def test_closed_forms_equal_the_jacobian_route(structure, jacobian_route):
    la = fitted(structure)
    x = inputs_of()
    got = {link: la.predictive(x, link_approx=link, num_samples=4) for link in LINKS}
    with jacobian_route:
        want = {link: la.predictive(x, link_approx=link, num_samples=4) for link in LINKS}
    for link in LINKS:
        for field in ("log_probs", "probs", "total"):
            assert_close(getattr(got[link], field), getattr(want[link], field))


@pytest.mark.parametrize("structure", STRUCTURES)
def test_draws_go_through_an_exact_root(structure, jacobian_route):
    la = fitted(structure)
    x = inputs_of()
    rows = rows_of(la, x)
    root = root_of(rows, (len(x),))
    with jacobian_route:
        covariance = la.function_space(x).covariance
    assert_close(root @ root.mT, covariance)
    mean = la.function_space(x, diagonal=True).mean
    noise = torch.randn(7, len(x), CLASSES, generator=torch.Generator().manual_seed(3))
    want = predictive.classification(mean + (root @ noise.unsqueeze(-1)).squeeze(-1))
    got = la.predictive(
        x, link_approx="mc", num_samples=7, generator=torch.Generator().manual_seed(3)
    )
    for field_got, field_want in zip(got, want, strict=True):
        assert_close(field_got, field_want)
    probit = la.predictive(x, num_samples=7, generator=torch.Generator().manual_seed(3))
    assert_close(probit.aleatoric, want.aleatoric)
    assert_close(probit.epistemic, want.epistemic)


@pytest.mark.parametrize("structure", ["kron", "lowrank"])
def test_monte_carlo_agrees_with_the_jacobian_route(structure, jacobian_route):
    """The same law through another root: within 5 sd of the two averages' difference."""
    la = fitted(structure)
    x, samples = inputs_of(3), 4000
    mean = la.function_space(x, diagonal=True).mean
    noise = torch.randn(samples, len(x), CLASSES, generator=torch.Generator().manual_seed(4))
    head = (mean + rows_of(la, x).steps(noise)).softmax(-1)
    with jacobian_route:
        root = covariance_root(la.function_space(x).covariance)
    jacobian = (mean + (root @ noise.unsqueeze(-1)).squeeze(-1)).softmax(-1)
    for per_draw in (lambda p: p, lambda p: -(p * p.log()).sum(-1)):  # probs, entropies
        a, b = per_draw(head), per_draw(jacobian)
        spread = ((a.var(0) + b.var(0)) / samples).sqrt()
        assert bool(((a.mean(0) - b.mean(0)).abs() <= 5 * spread + 1e-12).all())
    got = la.predictive(
        x, link_approx="mc", num_samples=samples, generator=torch.Generator().manual_seed(4)
    )
    assert_close(got.probs, head.mean(0))


@pytest.mark.parametrize("structure", STRUCTURES)
def test_outputs_with_positions(structure, jacobian_route):
    la = fitted(structure, "positions")
    ids = variant("positions")[2][0]
    blocks = la.function_space(ids[:3], per_position=True).covariance
    got = {link: la.predictive(ids[:3], link_approx=link, num_samples=3) for link in LINKS}
    joint = la.function_space(ids[:3]).covariance  # positions mix: the Jacobian route
    with jacobian_route:
        want_blocks = la.function_space(ids[:3], per_position=True).covariance
        want = {link: la.predictive(ids[:3], link_approx=link, num_samples=3) for link in LINKS}
        assert_close(joint, la.function_space(ids[:3]).covariance, rtol=0.0)
    assert blocks.shape == (3, 4, CLASSES, CLASSES)
    assert_close(blocks, want_blocks)
    root = root_of(rows_of(la, ids[:3]), (3, 4))
    assert_close(root @ root.mT, want_blocks)
    for link in LINKS:
        for field in ("log_probs", "probs", "total"):
            assert_close(getattr(got[link], field), getattr(want[link], field))


@pytest.mark.parametrize("positions", [False, True], ids=["flat", "positions"])
@pytest.mark.parametrize("structure", STRUCTURES)
def test_regression_variances(structure, positions, jacobian_route):
    name = "regression_positions" if positions else "regression"
    la = fitted(structure, name)
    x = variant(name)[2][0]
    got = la.predictive(x[:5])
    with jacobian_route:
        want = la.predictive(x[:5])
    assert_close(got.mean, want.mean, rtol=0.0)
    assert_close(got.epistemic, want.epistemic)
    assert_close(got.total, want.total)


def test_the_bridge_from_moments_is_the_laplace_bridge():
    generator = torch.Generator().manual_seed(8)
    factor = torch.randn(5, 6, 9, generator=generator)
    covariance = factor @ factor.mT
    covariance[0] = 0.0  # no variance: the bridge's unconditioned branch
    mean = torch.randn(5, 6, generator=generator)
    for normalize in (False, True):
        assert_close(
            bridge_from_moments(
                mean, covariance.diagonal(dim1=-2, dim2=-1), covariance.sum(-1), normalize
            ),
            predictive.laplace_bridge(mean, covariance, normalize=normalize),
        )


# ------------------------------------------------------------------ no Jacobian, anywhere
@pytest.mark.parametrize("structure", STRUCTURES)
def test_no_jacobian_is_formed_and_the_grid_scores_as_the_predictive(structure, monkeypatch):
    """Predictive, function_space and the prior grid search without ``output_jacobians``."""
    la = fitted(structure)

    def refuse(*args, **kwargs):
        raise AssertionError("a Jacobian was formed")

    monkeypatch.setattr(function_space_module, "output_jacobians", refuse)
    monkeypatch.setattr(jacobians_module, "output_jacobians", refuse)
    from samplers_as_optim.gaussian.laplace import _prior_grid

    monkeypatch.setattr(_prior_grid, "output_jacobians", refuse)
    x, y = inputs_of(10, seed=9), torch.randint(0, CLASSES, (10,))
    batches = [(x[:6], y[:6]), (x[6:], y[6:])]
    grid = [0.1, 1.0, 10.0]
    for link in ("probit", "bridge", "mc"):
        scores = grid_scores(la, batches, grid, link, 5, False)
        want = []
        for delta in grid:
            la.prior_precision = delta
            total = torch.zeros(())
            for index, (xb, yb) in enumerate(batches):
                prediction = la.predictive(
                    xb,
                    link_approx=link,
                    num_samples=5,
                    generator=torch.Generator().manual_seed(index),
                )
                total -= prediction.log_probs[torch.arange(len(yb)), yb].sum()
            want.append(total)
        assert_close(scores, torch.stack(want))
    assert la.function_space(x).covariance.shape == (10, CLASSES, CLASSES)


def test_the_ekf_last_layer_takes_it_too(jacobian_route):
    model = network(outputs=3)
    ekf = ExtendedKalmanFilter(model, likelihood="regression", noise_std=0.5, subset="last_layer")
    x = inputs_of(32, seed=10)
    ekf.update((x, torch.randn(32, 3, generator=torch.Generator().manual_seed(11))))
    got = ekf.predictive(x[:4])
    with jacobian_route:
        want = ekf.predictive(x[:4])
    assert_close(got.epistemic, want.epistemic)


def test_refuses_a_diagonal_that_is_not_a_bool():
    la = fitted("diag")
    with pytest.raises(
        TypeError, match=re.escape("Invalid diagonal: 'yes' (expected True or False)")
    ):
        la.function_space(inputs_of(), diagonal="yes")


def test_a_callable_likelihood_over_positions_is_scored_jointly(jacobian_route):
    """A callable reads the whole (T, C) output as one observation: joint draws, not blocks."""
    ids, targets = variant("positions")[2]
    targets = targets.clamp(min=0)

    def log_likelihood(output, target):
        picked = output.log_softmax(-1).gather(-1, target.unsqueeze(-1))
        return picked.squeeze(-1).sum(-1)

    la = Laplace(
        sequence_network(),
        num_data=6,
        likelihood=log_likelihood,
        structure="kron",
        curvature="ef",
        subset="last_layer",
    ).fit(DataLoader(TensorDataset(ids, targets), batch_size=3), progress=False)
    batches = [(ids[:3], targets[:3])]
    got = grid_scores(la, batches, [0.5, 5.0], "mc", 6, False)
    with jacobian_route:
        want = grid_scores(la, batches, [0.5, 5.0], "mc", 6, False)
    assert_close(got, want)
