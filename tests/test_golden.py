"""Golden trajectories: the samplers' behaviour frozen, bit for bit, before the reorganisation.

These tests freeze what the code did before the package was reorganised (code moved into
subpackages, the samplers rebuilt from one declarative definition): the recordings in
``tests/data/golden_trajectories.json`` and ``tests/data/golden_checkpoints.pt`` were made
on 2026-11-26 from a clean checkout of commit 4f73865 (69da1e4 and 46702ea give the same
numbers and checkpoints, byte for byte; the work then in progress in the working tree was
left out, and reproduced them) by ``tests/data/make_golden.py``, which runs the cases of
``tests/golden_cases.py``, the same code these tests run. The cases use the public API
only (``from samplers_as_optim import ...``, ``samplers_as_optim.transforms``), so they
run unchanged across the move.

(a) ``test_trajectory``: every case rerun gives the recorded numbers exactly (compared as
``float.hex()`` strings: the same bits, as ``torch.equal``): SGLD, SGHMC, SGNHT, PSGLD and
BAOA, each as a ``torch.optim`` Optimizer and as a torchopt transform in a pure
``torch.func`` loop, at two temperatures, with weight decay and an lr jump after four
steps (float32, foreach, two param groups, named parameters and other options besides);
SGHMC under ``CyclicalSGMCMC``; HMC through its warm-up; a ``ParallelEnsemble`` trained
by SGHMC.

(b) ``test_checkpoint_resumes``: a checkpoint written by that code (``state_dict()``,
or a transform state's fields) is loaded into a fresh optimizer built with another seed,
which the loaded state must override, on a fresh model holding the saved parameters, and
the next four steps must equal the uninterrupted chain's. This loads the OLD checkpoint
into the NEW code: a state_dict may gain entries, but one saved without them must load
and continue the chain exactly (only the recorded state entries are compared).

Regenerating the recordings (``python tests/data/make_golden.py``) is legitimate only for
a deliberate, documented change of behaviour (say which in the commit message and the
changelog), never to make these tests pass after a refactoring: a refactoring must
reproduce these numbers exactly.
"""

from __future__ import annotations

import json

import pytest
import torch
from golden_cases import (
    CHECKPOINT_CASES,
    GOLDEN_CHECKPOINTS,
    GOLDEN_JSON,
    TEST_GLOBAL_SEED,
    TRAJECTORY_CASES,
    mismatches,
    resume_checkpoint,
    run_trajectory,
)

#: the recordings are torch 2.13.0's on the CPU: another torch rounds some kernels (and
#: draws some noise) differently, which is not a change of this package's behaviour
pytestmark = pytest.mark.skipif(
    torch.__version__.split("+")[0] != "2.13.0",
    reason="golden trajectories were recorded with torch 2.13.0 (CPU)",
)


@pytest.fixture(scope="module")
def golden() -> dict:
    return json.loads(GOLDEN_JSON.read_text())


@pytest.fixture(scope="module")
def checkpoints() -> dict:
    # as a user loads a checkpoint: the default weights_only=True (tensors and builtins)
    return torch.load(GOLDEN_CHECKPOINTS, weights_only=True)


def _explain(golden: dict, problems: list[str]) -> str:
    recorded = golden["recorded_from"]
    torch_note = ""
    if torch.__version__.split("+")[0] != recorded["torch"]:
        torch_note = (
            f" (recorded with torch {recorded['torch']}, running {torch.__version__}: "
            "the noise and the kernels' rounding may differ between torch versions)"
        )
    return (
        f"differs from the recording of {recorded['commit']} ({recorded['commit_date']})"
        f"{torch_note}:\n  " + "\n  ".join(problems[:20])
    )


def test_the_recordings_cover_every_case(golden: dict, checkpoints: dict) -> None:
    assert sorted(golden["trajectories"]) == sorted(TRAJECTORY_CASES)
    assert sorted(golden["continuations"]) == sorted(CHECKPOINT_CASES)
    assert sorted(checkpoints) == sorted(CHECKPOINT_CASES)


@pytest.mark.parametrize("name", list(TRAJECTORY_CASES))
def test_trajectory(name: str, golden: dict) -> None:
    expected = golden["trajectories"][name]
    problems = mismatches(expected, run_trajectory(name, TEST_GLOBAL_SEED))
    assert not problems, f"{name} " + _explain(golden, problems)


@pytest.mark.parametrize("name", list(CHECKPOINT_CASES))
def test_checkpoint_resumes(name: str, golden: dict, checkpoints: dict) -> None:
    expected = golden["continuations"][name]
    problems = mismatches(expected, resume_checkpoint(name, checkpoints[name], TEST_GLOBAL_SEED))
    assert not problems, f"{name} resumed from its checkpoint " + _explain(golden, problems)
