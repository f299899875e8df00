"""Tests for samplers_as_optim.predictive.

References: scikit-learn (accuracy, log loss, Brier, ROC AUC), SciPy (entropy, Gaussian
densities, logsumexp), float64 NumPy re-derivations of the formulas, and hand-computed
cases.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.special
import scipy.stats
import torch
from sklearn.metrics import accuracy_score, brier_score_loss, log_loss, roc_auc_score

from samplers_as_optim import predictive
from samplers_as_optim.samples.stacked import call_stacked, stack_modules


def random_logits(seed, shape, scale=3.0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g, dtype=torch.float64)).to(dtype)


def reference_classification(logits):
    """Straightforward float64 NumPy: average the probabilities, then take entropies."""
    p = scipy.special.softmax(logits, axis=-1)
    mean = p.mean(axis=0)
    total = scipy.stats.entropy(mean, axis=-1)
    aleatoric = scipy.stats.entropy(p, axis=-1).mean(axis=0)
    return mean, total, aleatoric, total - aleatoric


# --------------------------------------------------------------------------- classification


def test_classification_matches_reference():
    logits = random_logits(0, (7, 11, 4))
    result = predictive.classification(logits)
    mean, total, aleatoric, epistemic = reference_classification(logits.numpy())
    np.testing.assert_allclose(result.probs.numpy(), mean, rtol=1e-12)
    np.testing.assert_allclose(result.log_probs.numpy(), np.log(mean), rtol=1e-12)
    np.testing.assert_allclose(result.total.numpy(), total, rtol=1e-12)
    np.testing.assert_allclose(result.aleatoric.numpy(), aleatoric, rtol=1e-12)
    np.testing.assert_allclose(result.epistemic.numpy(), epistemic, rtol=1e-9, atol=1e-14)
    torch.testing.assert_close(result.total, result.aleatoric + result.epistemic)


def test_classification_hand_computed():
    # Two samples, certain of opposite classes: BMA is uniform, all uncertainty epistemic.
    logits = torch.tensor([[[0.0, -math.inf]], [[-math.inf, 0.0]]])
    result = predictive.classification(logits)
    torch.testing.assert_close(result.probs, torch.tensor([[0.5, 0.5]]))
    torch.testing.assert_close(result.total, torch.tensor([math.log(2)]))
    torch.testing.assert_close(result.aleatoric, torch.tensor([0.0]))
    torch.testing.assert_close(result.epistemic, torch.tensor([math.log(2)]))
    # Identical samples: no epistemic uncertainty, even with a masked class.
    same = torch.tensor([[1.0, 2.0, -math.inf]]).expand(5, 1, 3)
    result = predictive.classification(same)
    assert result.epistemic.item() == 0.0
    assert result.probs[0, 2].item() == 0.0
    torch.testing.assert_close(result.total, result.aleatoric)


def test_classification_is_stable_for_extreme_logits():
    """Probabilities that underflow in float32 still average exactly in log space."""
    logits = torch.tensor([[[0.0, -200.0]], [[0.0, -300.0]]])  # p(class 1) = e^-200, e^-300
    result = predictive.classification(logits)
    expected = scipy.special.logsumexp([-200.0, -300.0]) - math.log(2)
    assert result.log_probs[0, 1].item() == pytest.approx(expected, rel=1e-6)
    assert torch.isfinite(result.log_probs).all()
    assert torch.isfinite(torch.stack(result[2:])).all()


def test_classification_small_epistemic_is_accurate():
    """Near-identical samples: MI ~ 1e-9 is exact in float64, within ~1e-7 in float32."""
    base = random_logits(1, (1, 6, 5))
    logits = base + 1e-4 * random_logits(2, (8, 6, 5), scale=1.0)
    reference = reference_classification(logits.numpy())[3]
    assert (reference > 1e-10).all() and (reference < 1e-8).all()
    result = predictive.classification(logits)
    np.testing.assert_allclose(result.epistemic.numpy(), reference, rtol=1e-4)
    single = predictive.classification(logits.float()).epistemic
    assert (single >= 0).all()
    np.testing.assert_allclose(single.double().numpy(), reference, atol=5e-7)


def test_classification_half_precision_and_batch_shapes():
    logits = random_logits(3, (4, 2, 3, 5), dtype=torch.bfloat16)
    result = predictive.classification(logits)
    assert result.probs.dtype == torch.float32
    assert result.probs.shape == (2, 3, 5) and result.total.shape == (2, 3)
    torch.testing.assert_close(result.probs.sum(-1), torch.ones(2, 3))


def test_classification_is_differentiable_with_masked_classes():
    logits = random_logits(4, (3, 2, 4))
    logits[:, :, 0] = -math.inf  # a class no sample allows
    logits.requires_grad_()
    result = predictive.classification(logits)
    (result.total + result.aleatoric + result.epistemic).sum().backward()
    assert torch.isfinite(logits.grad).all() and logits.grad.abs().sum() > 0


def test_classification_of_call_stacked_outputs():
    torch.manual_seed(0)
    members = [torch.nn.Linear(3, 4) for _ in range(6)]
    x = torch.randn(5, 3)
    logits = call_stacked(members[0], stack_modules(members), x)
    result = predictive.classification(logits)
    expected = torch.stack([m(x).softmax(-1) for m in members]).mean(0)
    torch.testing.assert_close(result.probs, expected)


# --------------------------------------------------------------------------- regression


def test_regression_law_of_total_variance():
    g = torch.Generator().manual_seed(5)
    means = torch.randn(9, 4, 2, generator=g, dtype=torch.float64)
    variances = torch.rand(9, 4, 2, generator=g, dtype=torch.float64)
    result = predictive.regression(means, variances)
    mu, var = means.numpy(), variances.numpy()
    np.testing.assert_allclose(result.mean.numpy(), mu.mean(0))
    np.testing.assert_allclose(result.epistemic.numpy(), mu.var(0, ddof=0))
    np.testing.assert_allclose(result.aleatoric.numpy(), var.mean(0))
    # The mixture's variance, from its second moment E[y^2] = mean(var + mu^2).
    second_moment = (var + mu**2).mean(0)
    np.testing.assert_allclose(result.total.numpy(), second_moment - mu.mean(0) ** 2)


def test_regression_known_noise_broadcasts():
    means = torch.tensor([[1.0, 2.0], [3.0, 2.0]])
    for noise in (0.5, torch.tensor(0.5), torch.tensor([0.5, 0.5])):
        result = predictive.regression(means, noise)
        torch.testing.assert_close(result.aleatoric, torch.tensor([0.5, 0.5]))
        torch.testing.assert_close(result.epistemic, torch.tensor([1.0, 0.0]))
        torch.testing.assert_close(result.total, torch.tensor([1.5, 0.5]))


def test_regression_nll_is_the_exact_mixture_density():
    g = torch.Generator().manual_seed(6)
    means = torch.randn(5, 8, generator=g, dtype=torch.float64)
    variances = 0.1 + torch.rand(5, 8, generator=g, dtype=torch.float64)
    targets = torch.randn(8, generator=g, dtype=torch.float64)
    ours = predictive.regression_nll(means, variances, targets, reduction="none")
    log_pdf = scipy.stats.norm.logpdf(targets.numpy(), means.numpy(), np.sqrt(variances.numpy()))
    reference = -(scipy.special.logsumexp(log_pdf, axis=0) - math.log(5))
    np.testing.assert_allclose(ours.numpy(), reference, rtol=1e-12)
    assert predictive.regression_nll(means, variances, targets).item() == pytest.approx(
        reference.mean()
    )
    far = predictive.regression_nll(torch.zeros(2, 1), 1e-4, torch.tensor([10.0]))
    assert torch.isfinite(far) and far.item() == pytest.approx(0.5 * (100 / 1e-4), rel=1e-3)


# --------------------------------------------------------------------------- metrics


def classification_problem(seed, n=200, k=4):
    rng = np.random.default_rng(seed)
    probs = rng.dirichlet(np.ones(k) * 0.7, size=n)
    targets = rng.integers(0, k, size=n)
    return torch.from_numpy(probs), torch.from_numpy(targets)


def test_accuracy_nll_brier_match_sklearn():
    probs, targets = classification_problem(7)
    y, p = targets.numpy(), probs.numpy()
    labels = list(range(p.shape[1]))
    assert predictive.accuracy(probs, targets).item() == pytest.approx(
        accuracy_score(y, p.argmax(1))
    )
    assert predictive.nll(probs.log(), targets).item() == pytest.approx(
        log_loss(y, p, labels=labels), rel=1e-12
    )
    assert predictive.brier(probs, targets).item() == pytest.approx(
        brier_score_loss(y, p, labels=labels, scale_by_half=False), rel=1e-12
    )


def test_reductions():
    probs, targets = classification_problem(8, n=10)
    for metric, values in [
        (predictive.brier, ((probs - torch.eye(4)[targets]) ** 2).sum(-1)),
        (predictive.accuracy, (probs.argmax(-1) == targets).double()),
    ]:
        torch.testing.assert_close(metric(probs, targets, reduction="none"), values)
        torch.testing.assert_close(metric(probs, targets, reduction="sum"), values.sum())
        torch.testing.assert_close(metric(probs, targets), values.mean())


def reference_ece(probs, targets, bins):
    """Guo et al. (2017): bins ((m-1)/M, m/M], loop over bins."""
    confidence = probs.max(axis=1)
    correct = probs.argmax(axis=1) == targets
    edges = np.linspace(0, 1, bins + 1)
    total = 0.0
    for m in range(bins):
        inside = (confidence > edges[m]) & (confidence <= edges[m + 1])
        if m == 0:
            inside |= confidence == 0
        if inside.any():
            gap = abs(correct[inside].mean() - confidence[inside].mean())
            total += inside.mean() * gap
    return total


@pytest.mark.parametrize("bins", [1, 10, 15, 37])
def test_ece_matches_loop_reference(bins):
    probs, targets = classification_problem(9, n=500, k=3)
    ours = predictive.ece(probs, targets, num_bins=bins).item()
    assert ours == pytest.approx(reference_ece(probs.numpy(), targets.numpy(), bins), abs=1e-12)


def test_ece_hand_computed_and_bin_edges():
    # Confidence exactly 0.6 falls in (0.5, 0.6] with 10 bins; 0.9 in (0.8, 0.9].
    probs = torch.tensor([[0.9, 0.1], [0.9, 0.1], [0.6, 0.4], [0.4, 0.6]], dtype=torch.float64)
    targets = torch.tensor([0, 1, 0, 0])
    # bin (0.8, 0.9]: acc 0.5, conf 0.9; bin (0.5, 0.6]: acc 0.5, conf 0.6
    expected = 0.5 * 0.4 + 0.5 * 0.1
    assert predictive.ece(probs, targets, num_bins=10).item() == pytest.approx(expected)
    # Bins are closed on the right: 0.75 (exact in binary) belongs to (0.5, 0.75], not with
    # 0.8 in (0.75, 1]; left-closed bins would pool them and give 0.275.
    edge = torch.tensor([[0.75, 0.25], [0.8, 0.2]], dtype=torch.float64)
    ece = predictive.ece(edge, torch.tensor([0, 1]), num_bins=4).item()
    assert ece == pytest.approx(0.5 * 0.25 + 0.5 * 0.8)
    perfect = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    assert predictive.ece(perfect, torch.tensor([0, 1])).item() == 0.0


def test_auroc_matches_sklearn_with_ties():
    rng = np.random.default_rng(10)
    inside = np.round(rng.normal(0.0, 1.0, 300), 1)  # rounding creates many ties
    outside = np.round(rng.normal(0.8, 1.0, 200), 1)
    scores = np.concatenate([inside, outside])
    labels = np.r_[np.zeros(300), np.ones(200)]
    ours = predictive.auroc(torch.from_numpy(inside), torch.from_numpy(outside))
    assert ours.item() == pytest.approx(roc_auc_score(labels, scores), abs=1e-12)
    assert predictive.auroc(torch.zeros(3), torch.ones(2)).item() == 1.0
    assert predictive.auroc(torch.ones(3), torch.zeros(2)).item() == 0.0
    assert predictive.auroc(torch.ones(3), torch.ones(4)).item() == 0.5


def test_auroc_separates_in_and_out_of_distribution_by_uncertainty():
    """Samples that disagree off the data: epistemic uncertainty flags the OOD inputs."""
    g = torch.Generator().manual_seed(11)
    agree = torch.randn(1, 100, 3, generator=g) + 0.1 * torch.randn(10, 100, 3, generator=g)
    disagree = 3.0 * torch.randn(10, 100, 3, generator=g)
    score_in = predictive.classification(agree).epistemic
    score_out = predictive.classification(disagree).epistemic
    assert predictive.auroc(score_in, score_out) > 0.95


def test_agreement_and_total_variation():
    p = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8], [0.5, 0.5, 0.0]], dtype=torch.float64)
    q = torch.tensor([[0.6, 0.3, 0.1], [0.5, 0.3, 0.2], [0.0, 0.0, 1.0]], dtype=torch.float64)
    torch.testing.assert_close(
        predictive.agreement(p, q, reduction="none"), torch.tensor([1.0, 0.0, 0.0]).double()
    )
    expected_tv = torch.tensor([0.1, 0.6, 1.0], dtype=torch.float64)
    torch.testing.assert_close(predictive.total_variation(p, q, reduction="none"), expected_tv)
    torch.testing.assert_close(predictive.total_variation(p, q), expected_tv.mean())
    torch.testing.assert_close(predictive.total_variation(q, p), predictive.total_variation(p, q))
    assert predictive.total_variation(p, p).item() == 0.0
    assert predictive.agreement(p, p).item() == 1.0


def test_total_variation_matches_numpy_on_random_distributions():
    a, _ = classification_problem(12, n=50, k=6)
    b, _ = classification_problem(13, n=50, k=6)
    reference = 0.5 * np.abs(a.numpy() - b.numpy()).sum(1).mean()
    assert predictive.total_variation(a, b).item() == pytest.approx(reference, rel=1e-12)
    agreement = (a.numpy().argmax(1) == b.numpy().argmax(1)).mean()
    assert predictive.agreement(a, b).item() == pytest.approx(agreement)


# --------------------------------------------------------------------------- errors


P = torch.tensor([[0.5, 0.5], [0.2, 0.8]])
Y = torch.tensor([0, 1])


@pytest.mark.parametrize(
    "call, error, match",
    [
        (
            lambda: predictive.classification([[1.0]]),
            TypeError,
            r"Invalid logits: list \(expected a torch.Tensor \[samples, \.\.\., classes\]",
        ),
        (
            lambda: predictive.classification(torch.zeros(3, 2, dtype=torch.long)),
            TypeError,
            r"Invalid logits: dtype torch.int64 \(expected a floating tensor\)",
        ),
        (
            lambda: predictive.classification(torch.zeros(3)),
            ValueError,
            r"Invalid logits: shape \(3,\) \(expected a non-empty tensor \[samples",
        ),
        (
            lambda: predictive.classification(torch.zeros(8, 10)),
            ValueError,
            r"Invalid logits: shape \(8, 10\) \(expected \[samples, batch, \.\.\., classes\]: a "
            r"2-D tensor is ambiguous; for one model's logits \[B, C\] use logits.unsqueeze\(0\)",
        ),
        (
            lambda: predictive.classification(torch.tensor([[[math.nan, 0.0]]])),
            ValueError,
            r"Invalid logits: they give NaN probabilities",
        ),
        (
            lambda: predictive.classification(torch.full((2, 1, 2), -math.inf)),
            ValueError,
            r"Invalid logits: they give NaN",
        ),
        (
            lambda: predictive.regression(torch.zeros(2, 3), -1.0),
            ValueError,
            r"Invalid variances: values not >= 0 \(expected variances >= 0\)",
        ),
        (
            lambda: predictive.regression(torch.zeros(2, 3), torch.zeros(2)),
            ValueError,
            r"Invalid variances: shape \(2,\) \(expected a shape that broadcasts to the means'",
        ),
        (
            lambda: predictive.regression(torch.zeros(2, 3), torch.ones(4, 2, 3)),
            ValueError,
            r"Invalid variances: shape \(4, 2, 3\) \(expected a shape that broadcasts to the "
            r"means' \(2, 3\)\)",
        ),
        (
            lambda: predictive.regression_nll(
                torch.zeros(2, 3), torch.ones(1, 2, 3), torch.zeros(3)
            ),
            ValueError,
            r"Invalid variances: shape \(1, 2, 3\) \(expected a shape that broadcasts to the "
            r"means' \(2, 3\)\)",
        ),
        (
            lambda: predictive.regression(torch.zeros(2, 3), "1"),
            TypeError,
            r"Invalid variances: str \(expected a tensor or a number\)",
        ),
        (
            lambda: predictive.regression(torch.zeros(2, 3), math.nan),
            ValueError,
            r"Invalid variances: values not >= 0",
        ),
        (
            lambda: predictive.regression_nll(torch.zeros(2, 3), 0.0, torch.zeros(3)),
            ValueError,
            r"Invalid variances: values not > 0 \(expected variances > 0\)",
        ),
        (
            lambda: predictive.regression_nll(torch.zeros(2, 3), 1.0, torch.zeros(2)),
            ValueError,
            r"Invalid targets: shape \(2,\) \(expected \(3,\), the means' shape without",
        ),
        (
            lambda: predictive.brier(torch.tensor([[2.0, -1.0]]), torch.tensor([0])),
            ValueError,
            r"Invalid probs: values outside \[0, 1\] \(expected probabilities",
        ),
        (
            lambda: predictive.ece(P, Y.float()),
            TypeError,
            r"Invalid targets: tensor\(\[0., 1.\]\) \(expected an integer tensor",
        ),
        (
            lambda: predictive.accuracy(P, torch.tensor([0, 1, 1])),
            ValueError,
            r"Invalid targets: shape \(3,\) \(expected \(2,\), the predictions' shape",
        ),
        (
            lambda: predictive.nll(P.log(), torch.tensor([0, 2])),
            ValueError,
            r"Invalid targets: values outside \[0, 2\) \(expected class indices for 2 classes\)",
        ),
        (
            lambda: predictive.nll(P, Y.neg().abs() + 0),
            ValueError,
            r"Invalid log_probs: values above 0 or NaN \(expected log-probabilities",
        ),
        (
            lambda: predictive.ece(P, Y, num_bins=0),
            ValueError,
            r"Invalid num_bins: 0 \(expected an integer >= 1\)",
        ),
        (
            lambda: predictive.ece(P, Y, num_bins=2.5),
            TypeError,
            r"Invalid num_bins: 2.5",
        ),
        (
            lambda: predictive.brier(P, Y, reduction="avg"),
            ValueError,
            r"Invalid reduction: 'avg' \(expected one of 'mean', 'sum', 'none'\)",
        ),
        (
            lambda: predictive.agreement(P, P[:1]),
            ValueError,
            r"Invalid other: shape \(1, 2\) \(expected the shape of probs, \(2, 2\)\)",
        ),
        (
            lambda: predictive.total_variation(P, torch.tensor([[0.5, 1.5], [0.0, 1.0]])),
            ValueError,
            r"Invalid other: values outside \[0, 1\]",
        ),
        (
            lambda: predictive.auroc(torch.tensor([0.1, math.nan]), torch.tensor([0.2])),
            ValueError,
            r"Invalid scores: NaN values",
        ),
        (
            lambda: predictive.auroc(torch.tensor([]), torch.tensor([0.2])),
            ValueError,
            r"Invalid in_scores: shape \(0,\) \(expected a non-empty tensor",
        ),
        (
            lambda: predictive.auroc(torch.tensor([1, 2]), torch.tensor([0.2])),
            TypeError,
            r"Invalid in_scores: dtype torch.int64",
        ),
    ],
)
def test_errors(call, error, match):
    with pytest.raises(error, match=match):
        call()
