"""``progress=``: a tqdm bar for long calls, off by default where stderr is not a terminal.

The bar must never change a result: HMC's warm-up and ``HMC.run`` with a bar take the
same chain bit for bit as without one.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch
from torch import Tensor

from samplers_as_optim import HMC
from samplers_as_optim.core import progress as progress_module
from samplers_as_optim.core.progress import ProgressBar, check_progress, progress_bar

X = torch.randn(30, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
Y = (X[:, 0] > 0).to(torch.float64)


def loss_fn(params: Any) -> Tensor:
    w, b = params
    return torch.nn.functional.binary_cross_entropy_with_logits(X @ w + b, Y)


def _hmc() -> HMC:
    params = [
        torch.nn.Parameter(torch.zeros(3, dtype=torch.float64)),
        torch.nn.Parameter(torch.zeros((), dtype=torch.float64)),
    ]
    return HMC(params, lr=0.05, num_data=30, num_steps=3, seed=3, target_accept=0.8)


def test_none_is_off_without_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    class Pipe:
        def isatty(self) -> bool:
            return False

    monkeypatch.setattr(progress_module.sys, "stderr", Pipe())
    assert check_progress(None) is False


def test_none_is_on_at_a_terminal_with_tqdm(monkeypatch: pytest.MonkeyPatch) -> None:
    class Terminal:
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(progress_module.sys, "stderr", Terminal())
    assert check_progress(None) is (importlib.util.find_spec("tqdm") is not None)


@pytest.mark.parametrize("value", [1, "yes", 0.0])
def test_refuses_what_is_not_a_bool(value: object) -> None:
    with pytest.raises(TypeError, match=rf"Invalid progress: {value!r} \(expected None, True"):
        check_progress(value)
    with pytest.raises(TypeError, match="Invalid progress"):
        progress_bar(range(3), value, "x")  # refused at the call, not at the first item


def test_true_without_tqdm_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(progress_module, "_tqdm_installed", lambda: False)
    with pytest.raises(ImportError, match="Invalid progress: True needs tqdm"):
        check_progress(True)
    assert check_progress(False) is False


def test_progress_bar_yields_every_item_and_draws_a_bar(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("tqdm")
    assert list(progress_bar(iter(range(5)), True, "counting", total=5)) == [0, 1, 2, 3, 4]
    assert "counting" in capsys.readouterr().err
    assert list(progress_bar(range(4), False, "silent")) == [0, 1, 2, 3]
    assert "silent" not in capsys.readouterr().err


def test_an_off_bar_does_nothing() -> None:
    with ProgressBar(False, 3, "off") as bar:
        bar.update()
        bar.set_postfix(loss=1.0)
    bar.close()


def test_hmc_warmup_and_run_are_the_same_chain_with_a_bar(
    capsys: pytest.CaptureFixture[str],
) -> None:
    pytest.importorskip("tqdm")
    results = []
    for progress in (False, True):
        hmc = _hmc()
        hmc.warmup(num_steps=6, loss_fn=loss_fn, progress=progress)
        run = hmc.run(loss_fn, 5, thin=2, progress=progress)
        results.append((run.samples, hmc.state_dict()))
    err = capsys.readouterr().err
    assert "HMC warm-up" in err and "HMC.run" in err
    (first, state), (second, state_with_bar) = results
    for name in first:
        assert torch.equal(first[name], second[name])
    assert str(state) == str(state_with_bar)


def test_hmc_refuses_a_bad_progress() -> None:
    hmc = _hmc()
    with pytest.raises(TypeError, match="Invalid progress: 'on'"):
        hmc.warmup(num_steps=2, loss_fn=loss_fn, progress="on")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Invalid progress: 'on'"):
        hmc.run(loss_fn, 2, progress="on")  # type: ignore[arg-type]
