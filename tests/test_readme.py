"""The README's code runs: every ```python block, in order, in one namespace.

The blocks use a user's objects (``model``, ``loader``, ...); small stand-ins are defined
here. A block that says ``# ... call collector.step() ...`` gets that loop filled in.
"""

import re
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

README = Path(__file__).resolve().parents[1] / "README.md"
ELIDED_LOOP = "# ... call collector.step() after each opt.step() of the ensemble loop above ..."
FILLED_LOOP = """for _ in range(collector.total_steps):
    for x, y in loader:
        opt.zero_grad()
        ensemble.loss(torch.nn.functional.cross_entropy, ensemble(x), y).backward()
        opt.step()
    collector.step()"""


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)


def stand_ins(tmp_path) -> dict:
    torch.manual_seed(0)

    def make_model():
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))

    x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
    train_set = TensorDataset(x, y)
    return {
        "torch": torch,
        "make_model": make_model,
        "model": make_model(),
        "train_set": train_set,
        "loader": DataLoader(train_set, batch_size=16),
        "x_test": torch.randn(10, 4),
        "y_test": torch.randint(0, 3, (10,)),
        "store_dir": str(tmp_path / "samples"),
        "checkpoint_path": str(tmp_path / "checkpoint.pt"),
        "batch_at": lambda step: (x[step % 2 :: 2], y[step % 2 :: 2]),
        "x_val": torch.randn(12, 4),
        "y_val": torch.randint(0, 3, (12,)),
        "x_ood": 3 * torch.randn(10, 4),
        "params": {"w": torch.zeros(3)},
        "grads": {"w": torch.ones(3)},
        "N": 32,
        "N_next": 32,
        "mean_nll": torch.tensor(0.0),
    }


@pytest.mark.slow
def test_every_readme_python_block_runs(capsys, tmp_path):
    blocks = python_blocks()
    assert len(blocks) >= 6
    assert any(ELIDED_LOOP in block for block in blocks)
    namespace = stand_ins(tmp_path)
    for index, block in enumerate(blocks):
        code = block.replace(ELIDED_LOOP, FILLED_LOOP)
        try:
            exec(compile(code, f"README.md block {index}", "exec"), namespace)
        except Exception as error:  # pragma: no cover - the message is the point
            raise AssertionError(f"README block {index} failed:\n{block}") from error
    assert namespace["samples"]["0.weight"].shape == (50, 8, 4)
    printed = capsys.readouterr().out
    assert "R-hat over 67 quantities (0 NaN)" in printed  # weight space: the MLP's 67 weights
    assert "R-hat over 10 quantities (0 NaN)" in printed  # function space: 10 test inputs
    # the chains moved (16 members of the ensemble, 20 draws each): finite, modest R-hats
    maxima = [float(m) for m in re.findall(r"max ([0-9.]+)", printed)]
    assert len(maxima) == 2 and all(1.0 < m < 10.0 for m in maxima)
