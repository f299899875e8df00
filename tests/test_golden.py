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

Processors: torch's CPU kernels round some elements differently on different CPUs, so
the recorded commit's own numbers differ by an ulp or so on another machine (on
2026-12-02, 52 of 58 cases on a machine whose torch kernels round otherwise, with
4f73865's code unchanged). Such a CPU gets its own recording, from the same commit in a
clean clone (``python tests/data/make_golden.py --machine``, into
``tests/data/golden_machines/<probe>.json``, continuing the same checkpoints), chosen by
``golden_cases.rounding_probe``; ``41f5c8c297a30009`` was recorded so from 17f511a (the
last commit CI passed on the first machine, which reproduces 4f73865's recording there);
``bf89776652ca8bad`` (an AMD EPYC, every case an ulp or so apart) from 17f511a likewise,
with PSGLD's revised cases re-recorded from aa22379 (below).

Regenerating the recordings (``python tests/data/make_golden.py``) is legitimate only for
a deliberate, documented change of behaviour (say which in the commit message and the
changelog), never to make these tests pass after a refactoring: a refactoring must
reproduce these numbers exactly. Such a change names the cases it changes, and why, in
``golden_cases.REVISED``, and re-records them alone (``make_golden.py --revise``, from a
clean clone of its commit) into the recording of the CPU it was made on; a CPU whose
recording predates it skips them, saying so, until it is recorded there too. PSGLD's
cases at T = 1 were so revised on 2026-12-02 (its preconditioner floored by its prior,
issue #36) on the CPU of probe ``41f5c8c297a30009``.
"""

from __future__ import annotations

import json

import pytest
import torch
from golden_cases import (
    CHECKPOINT_CASES,
    GOLDEN_CHECKPOINTS,
    GOLDEN_JSON,
    MACHINE_DIR,
    TEST_GLOBAL_SEED,
    TRAJECTORY_CASES,
    mismatches,
    resume_checkpoint,
    revision_pending,
    rounding_probe,
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
    """This CPU's recording: its own where its rounding probe has one, else the first.

    One commit's numbers differ by an ulp or so between processors whose torch kernels
    round differently (``golden_cases.rounding_probe``), each machine deterministic: a
    CPU whose probe has a recording (``tests/data/golden_machines``, made from the same
    commit with ``make_golden.py --machine``) is held to it bit for bit, any other to the
    first machine's, and a failure there says how to record this CPU.
    """
    machine = MACHINE_DIR / f"{rounding_probe()}.json"
    if machine.is_file():
        return json.loads(machine.read_text())
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
    machine_note = ""
    if "rounding_probe" not in recorded:
        machine_note = (
            f" (this CPU's rounding probe {rounding_probe()} has no recording of its own: "
            "if every case differs by an ulp or so, the CPU rounds differently; record it "
            f"from {recorded['commit']} in a clean clone, tests/data/make_golden.py --machine)"
        )
    return (
        f"differs from the recording of {recorded['commit']} ({recorded['commit_date']})"
        f"{torch_note}{machine_note}:\n  " + "\n  ".join(problems[:20])
    )


def test_the_recordings_cover_every_case(checkpoints: dict) -> None:
    machines = sorted(MACHINE_DIR.glob("*.json"))
    for path in [GOLDEN_JSON, *machines]:
        recording = json.loads(path.read_text())
        assert sorted(recording["trajectories"]) == sorted(TRAJECTORY_CASES), path
        assert sorted(recording["continuations"]) == sorted(CHECKPOINT_CASES), path
    for path in machines:  # each names its probe, and records the first one's commit
        recorded = json.loads(path.read_text())["recorded_from"]
        assert recorded["rounding_probe"] == path.stem
        assert not recorded["uncommitted_changes_in_package"]
    assert sorted(checkpoints) == sorted(CHECKPOINT_CASES)


@pytest.mark.parametrize("name", list(TRAJECTORY_CASES))
def test_trajectory(name: str, golden: dict) -> None:
    pending = revision_pending(name, golden)
    if pending:
        pytest.skip(pending)
    expected = golden["trajectories"][name]
    problems = mismatches(expected, run_trajectory(name, TEST_GLOBAL_SEED))
    assert not problems, f"{name} " + _explain(golden, problems)


@pytest.mark.parametrize("name", list(CHECKPOINT_CASES))
def test_checkpoint_resumes(name: str, golden: dict, checkpoints: dict) -> None:
    pending = revision_pending(name, golden)
    if pending:
        pytest.skip(pending)
    expected = golden["continuations"][name]
    problems = mismatches(expected, resume_checkpoint(name, checkpoints[name], TEST_GLOBAL_SEED))
    assert not problems, f"{name} resumed from its checkpoint " + _explain(golden, problems)
