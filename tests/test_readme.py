"""The README's tour runs as pasted: its ```python blocks, in order, in one namespace.

Nothing is defined for the blocks: the tour's first block builds the model, the loader and
the held-out data from scikit-learn's digits, as a user pasting the blocks would. (The
two lines above the tour show the one-line change to a user's own loop.)
"""

import re
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    tour = README.read_text().split("## A tour", 1)[1]
    return re.findall(r"```python\n(.*?)```", tour, flags=re.DOTALL)


@pytest.mark.slow
def test_every_readme_python_block_runs_as_pasted(capsys):
    blocks = python_blocks()
    assert len(blocks) == 5
    assert not any(re.search(r"^\s*(# )?\.\.\. ", block, re.M) for block in blocks), "elided code"
    threads = torch.get_num_threads()
    namespace: dict = {}
    try:
        for index, block in enumerate(blocks):
            try:
                exec(compile(block, f"README.md block {index}", "exec"), namespace)
            except Exception as error:  # pragma: no cover - the message is the point
                raise AssertionError(f"README block {index} failed:\n{block}") from error
    finally:
        torch.set_num_threads(threads)  # the tour sets one thread, as it advises
    assert namespace["samples"]["0.weight"].shape == (20, 32, 64)
    printed = capsys.readouterr().out
    # the BMA of 20 samples of a 64-32-10 MLP on digits classifies well (seen: 0.94-0.95
    # over three seeds of the loader and the weights)
    accuracy = float(re.search(r"validation accuracy ([0-9.]+)", printed).group(1))
    assert accuracy > 0.9
    assert "R-hat over 2410 quantities (0 NaN)" in printed  # weight space: the MLP's weights
    assert "R-hat over 297 quantities (0 NaN)" in printed  # function space: 297 test images
    # the chains moved (16 members of the ensemble, 20 draws each): finite, modest R-hats
    maxima = [float(m) for m in re.findall(r"max ([0-9.]+)", printed)]
    assert len(maxima) == 2 and all(1.0 < m < 10.0 for m in maxima)
