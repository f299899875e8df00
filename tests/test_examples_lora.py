"""The Bayesian LoRA and continual LoRA examples, run in quick mode (needs the llm extra).

Each test runs the example's ``main(["--quick", ...])`` once (seed 0), checks that the
figure is written and the table printed, and asserts what the example's mechanics
guarantee (shapes, which entries exist, equalities that hold by construction, the
ensemble's members differing). The quick models are too small and too briefly trained
for the experiments' statistical claims (those are in the README, from full mode), so
only the claims that held with margin over quick-mode seeds 0-2 are asserted, with the
observed range in a comment.
"""

from __future__ import annotations

import importlib
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.fixture
def examples(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    return importlib.import_module


@pytest.mark.slow
def test_bayesian_lora_quick(examples, tmp_path, capsys):
    example = examples("bayesian_lora")
    figure = tmp_path / "bayesian_lora.png"
    results = example.main(["--quick", "--seed", "0", "--output", str(figure)])

    assert figure.stat().st_size > 10_000
    printed = capsys.readouterr().out
    for word in ("SGD", f"SGHMC x{example.K}", "AUROC epistemic", "memory ratio", "speedup"):
        assert word in printed
    scores = results["scores"]
    for name, found in scores.items():
        for split in ("prose", "code", "unicode names", "codec tables"):
            assert torch.isfinite(found[split]["nll"]).all()
            # the mutual information is >= 0; exactly 0 (to rounding) for one model
            if name == f"SGHMC x{example.K}":
                assert (found[split]["epistemic"] > 0).all()
            else:
                assert found[split]["epistemic"].abs().max() < 1e-9
    # The ensemble's members disagree more on Unicode character names (text unlike the
    # docstrings it was trained on) than on held-out docstrings: mean epistemic
    # uncertainty, names / prose = 1.3 to 10.7 over quick seeds 0-2.
    ensemble = scores[f"SGHMC x{example.K}"]
    assert ensemble["unicode names"]["epistemic"].mean() > ensemble["prose"]["epistemic"].mean()
    # Fine-tuning moved the adapters: SGD's predictions are not the base model's.
    assert not torch.equal(scores["SGD"]["prose"]["nll"], scores["base (no LoRA)"]["prose"]["nll"])
    # The cost measurements ran: the ensemble holds more than one run, and is measured.
    costs = results["costs"]
    assert costs["memory ratio"] > 1 and math.isfinite(costs["speedup"])


@pytest.mark.slow
def test_continual_lora_quick(examples, tmp_path, capsys):
    example = examples("continual_lora")
    figure = tmp_path / "continual_lora.png"
    results = example.main(["--quick", "--seed", "0", "--output", str(figure)])

    assert figure.stat().st_size > 10_000
    printed = capsys.readouterr().out
    for word in ("Naive", "Laplace", "Offline", "base (no LoRA)"):
        assert word in printed
    count = len(results["names"])
    nll = results["nll"]
    for method in example.METHODS:
        # tested on every episode seen so far, and only on those
        seen = ~nll[method].isnan()
        assert torch.equal(seen, torch.ones(count, count, dtype=torch.bool).tril())
    # Episode 1 is the same training for all three (same adapters, seed and data).
    assert nll["Laplace"][0, 0] == nll["Naive"][0, 0] == nll["Offline"][0, 0]
    # After episode 2 the learners differ (the Laplace penalty and the union change it).
    assert nll["Laplace"][1, 1] != nll["Naive"][1, 1] != nll["Offline"][1, 1]
    # Fine-tuning on the Unicode names and the codec tables (episodes 3 and 4, text far
    # from the docstrings the base was pre-trained on) lowers their test NLL below the
    # base model's, for every learner: by 0.45 nats or more over quick seeds 0-2.
    for method in example.METHODS:
        for episode in (2, 3):
            assert nll[method][episode, episode] < results["base"][episode] - 0.2
