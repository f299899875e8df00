"""Refusals and low-precision fits of Laplace and marglik_training (issue #34, items 5-10)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from samplers_as_optim import Laplace
from samplers_as_optim.gaussian.laplace.marglik import marglik_training

N = 32


def classifier(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3)).to(dtype)


def class_loader(targets: torch.Tensor, dtype: torch.dtype = torch.float32) -> DataLoader:
    x = torch.randn(N, 3, generator=torch.Generator().manual_seed(0)).to(dtype)
    return DataLoader(TensorDataset(x, targets), batch_size=8)


def class_targets() -> torch.Tensor:
    return torch.randint(0, 3, (N,), generator=torch.Generator().manual_seed(1))


def regression_data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(N, 3, generator=generator)
    return x, x.sum(1, keepdim=True) + 0.1 * torch.randn(N, 1, generator=generator)


def states(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def assert_unchanged(model: nn.Module, before: dict[str, torch.Tensor]) -> None:
    after = model.state_dict()
    assert all(torch.equal(after[name], value) for name, value in before.items())


# ---------------------------------------------------------------- 5: a foreign optimizer
def train(model: nn.Module, loader, **kwargs):
    options = dict(num_data=N, num_epochs=2, hyper_steps=2, progress=False)
    options.update(kwargs)
    return marglik_training(model, loader, **options)


def test_marglik_refuses_an_optimizer_over_another_models_parameters():
    model, other = classifier(), classifier()
    before = states(model)
    optimizer = torch.optim.SGD(other.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"Invalid optimizer: .*not the model's"):
        train(
            model,
            class_loader(class_targets()),
            likelihood="classification",
            optimizer=optimizer,
        )
    assert_unchanged(model, before)


def test_marglik_refuses_an_optimizer_with_one_foreign_parameter():
    model, other = classifier(), classifier()
    before = states(model)
    optimizer = torch.optim.SGD([*model.parameters(), next(other.parameters())], lr=0.1)
    with pytest.raises(ValueError, match=r"Invalid optimizer: 1 of 5 parameters .*not the model's"):
        train(
            model,
            class_loader(class_targets()),
            likelihood="classification",
            optimizer=optimizer,
        )
    assert_unchanged(model, before)


def test_marglik_accepts_an_optimizer_over_a_subset_of_the_models_parameters():
    model = classifier()
    first = copy.deepcopy(model[0].state_dict())
    optimizer = torch.optim.SGD(model[2].parameters(), lr=0.1)
    train(model, class_loader(class_targets()), likelihood="classification", optimizer=optimizer)
    assert all(torch.equal(model[0].state_dict()[k], v) for k, v in first.items())


# ---------------------------------------------------------------- 6: bad data, train flag
@pytest.mark.parametrize("where", ["targets", "inputs"])
def test_marglik_refuses_non_finite_data_before_training(where):
    x, y = regression_data()
    (y if where == "targets" else x)[13, 0] = float("nan")
    model = nn.Linear(3, 1)
    model.eval()
    before = states(model)
    loader = DataLoader(TensorDataset(x, y), batch_size=8)
    with pytest.raises(
        ValueError, match=rf"Invalid loader: batch 1 .*{where} contain 1 non-finite"
    ):
        train(model, loader, likelihood="regression")
    assert_unchanged(model, before)
    assert not model.training


def test_marglik_refuses_out_of_range_class_targets_before_training():
    targets = class_targets()
    targets[30] = 5
    model = classifier()
    before = states(model)
    with pytest.raises(
        ValueError, match=r"Invalid loader: batch 3 .*Invalid targets: class index 5"
    ):
        train(model, class_loader(targets), likelihood="classification")
    assert_unchanged(model, before)


@pytest.mark.parametrize("training", [False, True])
def test_marglik_restores_the_models_training_flag(training):
    x, y = regression_data()
    model = nn.Linear(3, 1)
    model.train(training)
    train(model, DataLoader(TensorDataset(x, y), batch_size=8), likelihood="regression")
    assert model.training is training


def test_marglik_restores_the_training_flag_on_error():
    x, y = regression_data()
    model = nn.Linear(3, 1)
    model.eval()

    def failing(*args):
        raise RuntimeError("boom")

    model.register_forward_hook(lambda module, args, output: failing() if module.training else None)
    with pytest.raises(RuntimeError, match="boom"):
        train(model, DataLoader(TensorDataset(x, y), batch_size=8), likelihood="regression")
    assert not model.training


# ---------------------------------------------------------------- 7: noise_std = None
def test_setting_noise_std_to_none_is_refused_for_regression():
    x, y = regression_data()
    la = Laplace(nn.Linear(3, 1), num_data=N, likelihood="regression", noise_std=2.0)
    la.fit(DataLoader(TensorDataset(x, y), batch_size=8), progress=False)
    precision = la.precision
    with pytest.raises(ValueError, match=r"Invalid noise_std: None \(expected a finite number > 0"):
        la.noise_std = None
    assert la.noise_std == 2.0
    assert all(torch.equal(precision[name], value) for name, value in la.precision.items())


def test_setting_noise_std_to_none_is_a_no_op_for_classification():
    la = Laplace(classifier(), num_data=N, likelihood="classification")
    la.noise_std = None
    assert la.noise_std is None
    with pytest.raises(ValueError, match=r"Invalid noise_std: 1.0 \(expected None"):
        la.noise_std = 1.0


# ---------------------------------------------------------------- 8: class targets
BAD_TARGETS = [
    (
        "out of range",
        lambda t: t.index_fill(0, torch.tensor([11]), 7),
        r"class index 7 in example 3 of 8 \(expected 0 <= targets < 3",
    ),
    (
        "negative",
        lambda t: t.index_fill(0, torch.tensor([11]), -1),
        r"class index -1 in example 3 of 8 \(expected 0 <= targets < 3",
    ),
    ("float", lambda t: t.float(), r"dtype torch.float32 of shape \(8,\) \(expected class indices"),
    ("bool", lambda t: t > 0, r"dtype torch.bool of shape \(8,\) \(expected class indices"),
    ("2-d", lambda t: t.reshape(-1, 1), r"shape \(8, 1\) \(expected class indices"),
]


@pytest.mark.parametrize("structure", ["diag", "kron", "dense"])
@pytest.mark.parametrize("curvature", ["ggn", "ef"])
@pytest.mark.parametrize(
    ("case", "corrupt", "message"), BAD_TARGETS, ids=[c[0] for c in BAD_TARGETS]
)
def test_fit_refuses_invalid_class_targets(structure, curvature, case, corrupt, message):
    la = Laplace(
        classifier(),
        num_data=N,
        likelihood="classification",
        structure=structure,
        curvature=curvature,
    )
    with pytest.raises(ValueError, match=rf"Invalid targets: {message}"):
        la.fit(class_loader(corrupt(class_targets())), progress=False)
    with pytest.raises(RuntimeError, match="not fitted"):
        la.sample(1)


@pytest.mark.parametrize("link_approx", ["probit", "bridge", "mc"])
@pytest.mark.parametrize(
    ("case", "corrupt", "message"), BAD_TARGETS, ids=[c[0] for c in BAD_TARGETS]
)
def test_gridsearch_refuses_invalid_class_targets(link_approx, case, corrupt, message):
    la = Laplace(classifier(), num_data=N, likelihood="classification", prior_precision=2.0)
    la.fit(class_loader(class_targets()), progress=False)
    with pytest.raises(ValueError, match=rf"Invalid targets: {message}"):
        la.optimize_prior_precision(
            "gridsearch",
            val_loader=class_loader(corrupt(class_targets())),
            link_approx=link_approx,
            num_samples=4,
            progress=False,
        )
    assert la.prior_precision == 2.0


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.uint8])
def test_integer_class_targets_of_any_integer_dtype_fit_as_int64(dtype):
    targets = class_targets()
    reference = Laplace(classifier(), num_data=N, likelihood="classification", curvature="ef")
    reference.fit(class_loader(targets), progress=False)
    la = Laplace(classifier(), num_data=N, likelihood="classification", curvature="ef")
    la.fit(class_loader(targets.to(dtype)), progress=False)
    assert torch.equal(la.log_likelihood, reference.log_likelihood)
    la.optimize_prior_precision(
        "gridsearch", val_loader=class_loader(targets.to(dtype)), progress=False
    )


def test_class_probabilities_are_still_accepted():
    probs = torch.softmax(torch.randn(N, 3, generator=torch.Generator().manual_seed(2)), -1)
    la = Laplace(classifier(), num_data=N, likelihood="classification")
    la.fit(class_loader(probs), progress=False)
    la.optimize_prior_precision("gridsearch", val_loader=class_loader(probs), progress=False)


# ---------------------------------------------------------------- 9: an exact fit
def exact_fit(structure: str = "diag") -> Laplace:
    # integer inputs and unit weights: every output is exact, whatever the batching
    x = torch.randint(-3, 4, (N, 3), generator=torch.Generator().manual_seed(0)).float()
    model = nn.Linear(3, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    la = Laplace(model, num_data=N, likelihood="regression", structure=structure)
    return la.fit(DataLoader(TensorDataset(x, model(x).detach()), batch_size=8), progress=False)


@pytest.mark.parametrize("structure", ["diag", "kron", "dense"])
def test_noise_tuning_refuses_an_exact_fit(structure):
    la = exact_fit(structure)
    assert float(la._fitted_terms().sse) == 0.0
    with pytest.raises(ValueError, match=r"Invalid tune_noise: True for an exact fit \(SSE = 0"):
        la.optimize_prior_precision(tune_noise=True, num_steps=200, progress=False)
    assert la.noise_std == 1.0 and la.prior_precision == 1.0
    la.optimize_prior_precision(tune_noise=False, progress=False)  # the prior alone is fine
    assert la.noise_std == 1.0


def test_the_evidence_increases_as_the_noise_vanishes_at_an_exact_fit():
    """The refusal's reason: no curvature term bounds σ's maximiser at SSE = 0."""
    la = exact_fit("dense")
    values = [float(la.log_marginal_likelihood(noise_std=s)) for s in (1.0, 1e-1, 1e-2, 1e-3)]
    assert values == sorted(values)
    assert values[-1] - values[-2] > 10.0


def test_noise_tuning_runs_on_an_exact_fit_whose_diagonal_has_more_entries_than_outputs():
    """A diagonal curvature of rank 4 > N·O = 2 bounds σ: the evidence has a maximiser."""
    x = torch.randn(2, 3, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    loader = DataLoader(TensorDataset(x, model(x).detach()), batch_size=2)
    la = Laplace(model, num_data=2, likelihood="regression").fit(loader, progress=False)
    assert float(la._fitted_terms().sse) == 0.0
    la.optimize_prior_precision(tune_noise=True, num_steps=2000, progress=False)
    sigma = torch.tensor(la.noise_std, requires_grad=True)
    la.log_marginal_likelihood(noise_std=sigma).backward()
    assert 0.0 < la.noise_std < 10.0 and abs(float(sigma.grad)) < 1e-4
    kron = Laplace(model, num_data=2, likelihood="regression", structure="kron")
    kron.fit(loader, progress=False)  # one output: G is 1 x 1 and A has rank 2
    with pytest.raises(ValueError, match=r"Invalid tune_noise: True for an exact fit"):
        kron.optimize_prior_precision(tune_noise=True, progress=False)


def test_noise_tuning_refuses_a_noise_that_leaves_the_dtypes_range():
    """SSE = 1e-40 in float32: the maximiser σ ≈ 2e-21 makes the curvature overflow."""
    x = torch.randint(-3, 4, (N, 3), generator=torch.Generator().manual_seed(0)).float()
    x[0] = 0.0
    model = nn.Linear(3, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    y = model(x).detach()
    y[0, 0] = 1e-20
    la = Laplace(model, num_data=N, likelihood="regression")
    la.fit(DataLoader(TensorDataset(x, y), batch_size=8), progress=False)
    with pytest.raises(
        ValueError,
        match=r"Invalid tune_noise: True for this fit \(noise_std reached .* after \d+ evidence "
        r"steps, where the evidence is -inf in torch.float32: the residuals, SSE = 1e-40",
    ):
        la.optimize_prior_precision(tune_noise=True, num_steps=2000, progress=False)
    assert la.noise_std == 1.0 and la.prior_precision == 1.0


def test_a_zero_noise_tensor_is_refused_with_its_value():
    la = exact_fit()
    with pytest.raises(
        ValueError, match=r"Invalid noise_std: a tensor of shape \(\) holding 0.0 \(expected"
    ):
        la.log_marginal_likelihood(noise_std=torch.tensor(0.0))


# ---------------------------------------------------------------- 10: half precision
@pytest.mark.parametrize("structure", ["kron", "dense"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_fit_sample_predict(structure, dtype):
    model = classifier(dtype)
    loader = class_loader(class_targets(), dtype)
    la = Laplace(model, num_data=N, likelihood="classification", structure=structure)
    la.fit(loader, progress=False)
    generator = torch.Generator().manual_seed(0)
    samples = la.sample(4, generator=generator)
    assert all(value.dtype == dtype and value.isfinite().all() for value in samples.values())
    x = next(iter(loader))[0]
    for linear in (True, False):
        out = la.predict(x, num_samples=4, linear=linear, generator=generator)
        assert out.dtype == dtype and out.shape == (4, 8, 3) and out.isfinite().all()
    prediction = la.predictive(x, num_samples=4, generator=generator)
    assert prediction.probs.isfinite().all()
    assert torch.allclose(prediction.probs.float().sum(-1), torch.ones(8), atol=2e-2)
    log_prob = la.log_prob(model)
    assert log_prob.dtype == dtype and log_prob.isfinite()
    covariance = la.covariance
    variances = covariance.values() if isinstance(covariance, dict) else [covariance]
    assert all(value.dtype == dtype and value.isfinite().all() for value in variances)
    evidence = la.log_marginal_likelihood()
    assert evidence.dtype == dtype and evidence.isfinite()


@pytest.mark.parametrize("structure", ["kron", "dense"])
def test_half_precision_agrees_with_float32(structure):
    """The half fit's covariance within half-precision round-off of the float32 fit's."""
    targets = class_targets()
    full = Laplace(classifier(), num_data=N, likelihood="classification", structure=structure)
    full.fit(class_loader(targets), progress=False)
    model = copy.deepcopy(full.model).to(torch.bfloat16)
    half = Laplace(model, num_data=N, likelihood="classification", structure=structure)
    half.fit(class_loader(targets, torch.bfloat16), progress=False)
    a, b = full.covariance, half.covariance
    if isinstance(a, dict):
        a, b = (
            torch.cat([v.reshape(-1) for v in a.values()]),
            torch.cat([v.reshape(-1) for v in b.values()]),
        )
    torch.testing.assert_close(b.float(), a, rtol=0.05, atol=0.02)
