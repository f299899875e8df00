"""Online evidence-based training (``gaussian.laplace.marglik.marglik_training``)."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from samplers_as_optim.gaussian.laplace.marglik import marglik_training

NOISE = 0.2
N = 200


def regression_loader():
    generator = torch.Generator().manual_seed(0)
    x = torch.rand(N, 1, generator=generator, dtype=torch.float64) * 4 - 2
    y = torch.sin(2 * x) + NOISE * torch.randn(N, 1, generator=generator, dtype=torch.float64)
    shuffle = torch.Generator().manual_seed(1)
    return DataLoader(TensorDataset(x, y), batch_size=100, shuffle=True, generator=shuffle)


def network(seed: int = 0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(1, 32), nn.Tanh(), nn.Linear(32, 1)).to(torch.float64)


@pytest.fixture(scope="module")
def trained():
    model = network()
    result = marglik_training(
        model,
        regression_loader(),
        num_data=N,
        likelihood="regression",
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-2),
        num_epochs=150,
        frequency=15,
        hyper_steps=50,
        progress=False,
    )
    return model, result


def test_evidence_recovers_the_noise(trained):
    """σ̂ within 25% of the true 0.2.

    With N = 200 residuals the sampling error of a noise estimate is about σ/√(2N), 5%
    of σ; 25% is five of those, and leaves room for the network's own misfit of sin(2x).
    A wrong noise exponent in the evidence (σ⁻¹ for σ⁻², say) moves σ̂ by far more.
    """
    _, result = trained
    assert result.laplace.noise_std == pytest.approx(NOISE, rel=0.25)


def test_evidence_increases_over_the_rounds(trained):
    _, result = trained
    assert len(result.evidence) == 10
    assert len(result.losses) == 150
    assert result.evidence[-1] > result.evidence[0] + 50.0
    assert max(result.evidence) == result.evidence[result.best_round]
    assert result.losses[-1] < result.losses[0]


def test_the_model_and_the_laplace_are_at_the_best_round(trained):
    model, result = trained
    for name, value in model.state_dict().items():
        assert torch.equal(value, result.state_dict[name])
    for name, value in result.laplace.mean.items():
        assert torch.equal(value, result.state_dict[name])
    prior = result.laplace.prior_precision
    assert isinstance(prior, dict)  # layerwise: one value per KFAC layer
    assert bool(torch.all(prior["0.weight"] == prior["0.bias"].reshape(-1)[0]))
    assert [block.prior for block in result.laplace.precision.blocks] == [
        pytest.approx(float(prior["0.weight"].reshape(-1)[0])),
        pytest.approx(float(prior["2.weight"].reshape(-1)[0])),
    ]
    # The returned evidence is the best round's: refitting at its state and
    # hyperparameters gives it back (float64: only the order of the sums differs).
    assert float(result.laplace.log_marginal_likelihood()) == pytest.approx(
        result.evidence[result.best_round], rel=1e-9
    )


def test_classification_with_any_optimizer_and_scalar_prior():
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(64, 2, generator=generator)
    y = (x[:, 0] * x[:, 1] > 0).long()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 2))
    result = marglik_training(
        model,
        DataLoader(TensorDataset(x, y), batch_size=32),
        num_data=64,
        likelihood="classification",
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        num_epochs=6,
        structure="diag",
        prior_structure="scalar",
        frequency=2,
        burnin=2,
        hyper_steps=5,
        progress=False,
    )
    assert len(result.evidence) == 3
    assert isinstance(result.laplace.prior_precision, float)
    assert result.laplace.noise_std is None


ERRORS = [
    (
        {"optimizer": "adam"},
        TypeError,
        "Invalid optimizer: str (expected None or a torch.optim.Optimizer over the model's "
        "parameters)",
    ),
    (
        {"optimizer": "adamw"},
        ValueError,
        "Invalid optimizer: weight_decay [0.01] (expected 0 in every group: the prior "
        "penalty of the tuned prior precision replaces it)",
    ),
    (
        {"num_epochs": 4, "burnin": 5},
        ValueError,
        "Invalid burnin: 5 (expected a tuning round within num_epochs=4 at every "
        "frequency=1-th epoch from burnin on)",
    ),
    ({"num_epochs": 0}, ValueError, "Invalid num_epochs: 0"),
    ({"frequency": 0}, ValueError, "Invalid frequency: 0"),
    ({"hyper_steps": 0}, ValueError, "Invalid hyper_steps: 0"),
    ({"hyper_lr": 0.0}, ValueError, "Invalid hyper_lr: 0.0 (expected a finite number > 0)"),
    (
        {"prior_structure": "diag"},
        ValueError,
        "Invalid prior_structure: 'diag' (expected 'scalar' or 'layerwise' with structure='kron'",
    ),
    (
        {"prior_structure": "full"},
        ValueError,
        "Invalid prior_structure: 'full' (expected one of 'scalar', 'layerwise', 'diag')",
    ),
    (
        {"likelihood": "classification", "tune_noise": True},
        ValueError,
        "Invalid tune_noise: True (expected None or False: the noise is tuned only for "
        "likelihood='regression')",
    ),
    ({"burnin": -1}, ValueError, "Invalid burnin: -1"),
]


@pytest.mark.parametrize(("kwargs", "error", "message"), ERRORS)
def test_errors_train_nothing(kwargs, error, message):
    model = network()
    before = {name: value.clone() for name, value in model.state_dict().items()}
    if kwargs.get("optimizer") == "adamw":
        kwargs = {**kwargs, "optimizer": torch.optim.AdamW(model.parameters())}
    arguments = {"num_data": N, "likelihood": "regression", "num_epochs": 2, "progress": False}
    with pytest.raises(error, match=re.escape(message)):
        marglik_training(model, regression_loader(), **{**arguments, **kwargs})
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name])
