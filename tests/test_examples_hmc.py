"""examples/hmc_reference.py in quick mode: the study's mechanics, not its conclusions.

Quick mode runs a tiny MLP with 10 HMC transitions per chain, too short for the poster's
claims to be judged (they are checked in full mode, README "Examples"); here: every
method is scored, the figure is written, the HMC chains accept, and the claims are
evaluated (each True or False) and printed.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.slow
def test_hmc_reference_quick(monkeypatch, tmp_path, capsys) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLES))
    example = importlib.import_module("hmc_reference")
    figure = tmp_path / "hmc.png"
    results = example.main(["--quick", "--seed", "0", "--output", str(figure)])
    printed = capsys.readouterr().out
    assert figure.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    methods = {row["method"] for row in results["rows"]}
    expected = set(example.METHODS)
    if not results["cyclical_available"]:
        expected.discard("Cyclical SGHMC")
    assert methods == expected
    by = {row["method"]: row for row in results["rows"]}
    assert by["HMC"]["agreement"] == 1.0 and by["HMC"]["tv"] == 0.0
    for row in results["rows"]:
        assert 0.0 <= row["accuracy"] <= 1.0 and row["nll"] > 0
        assert 0.0 <= row["tv"] <= 1.0
    assert results["hmc"]["accept"] > 0.5
    assert len(results["claims"]) == 6
    for claim in results["claims"]:
        assert claim in printed
    assert "function-space R-hat" in printed
