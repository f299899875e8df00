"""Record the golden trajectories and checkpoints that ``tests/test_golden.py`` checks.

Run from the repository root::

    python tests/data/make_golden.py

It runs every case of ``tests/golden_cases.py`` (the code the test runs too) and writes

* ``tests/data/golden_trajectories.json``: each trajectory case's record, and each
  checkpoint case's continuation, every number as ``float.hex()`` (exact);
* ``tests/data/golden_checkpoints.pt``: one ``torch.save``'d dict, per checkpoint case the
  parameters and the ``state_dict()`` (optimizer, scheduler) or the transform state's
  fields after ``CHECKPOINT_AT`` steps. It holds tensors and builtins only (checked
  below), so ``torch.load(weights_only=True)`` reads it whatever the package's modules.

Record a commit, not work in progress: run it in a clean clone, with that clone's package
first on the path (the JSON notes the commit, and whether the package had uncommitted
changes)::

    git clone . /tmp/golden && cd /tmp/golden
    PYTHONPATH=$PWD python tests/data/make_golden.py   # then copy tests/data/golden_* back

Regenerating replaces the recorded behaviour: do it only for a deliberate, documented
change of behaviour (see ``tests/test_golden.py``). Running it twice on the same code gives
the same JSON, byte for byte.
"""

from __future__ import annotations

import io
import json
import pickletools
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import torch

import samplers_as_optim

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import golden_cases  # tests/ is put on the path just above

#: the checkout of the package being recorded (its commit goes into the JSON)
REPO = Path(samplers_as_optim.__file__).resolve().parents[1]


def _git(*args: str) -> str:
    try:
        result = subprocess.run(
            ["git", "-C", str(REPO), *args], capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return result.stdout.strip()


def _recorded_from(**extra: Any) -> dict[str, Any]:
    """The commit recorded, whether the package had uncommitted changes, torch's version."""
    dirty = _git("status", "--porcelain", "--", "samplers_as_optim") not in ("", "unknown")
    return {
        "commit": _git("log", "-1", "--format=%h"),
        "commit_date": _git("log", "-1", "--format=%cs"),
        "uncommitted_changes_in_package": dirty,
        "torch": torch.__version__.split("+")[0],
        **extra,
    }


def _dumps(golden: dict[str, Any]) -> str:
    """JSON with one line per recorded list (diffable, about one line per entry)."""

    def write(value: Any, indent: int) -> str:
        if isinstance(value, dict):
            pad = " " * (indent + 1)
            items = [f"{pad}{json.dumps(k)}: {write(v, indent + 1)}" for k, v in value.items()]
            return "{\n" + ",\n".join(items) + "\n" + " " * indent + "}"
        return json.dumps(value, separators=(", ", ": "))

    return write(golden, 0) + "\n"


def _check_builtins_only(path: Path) -> None:
    """Refuse a checkpoint that pickles a class of the package (private paths move)."""
    with zipfile.ZipFile(path) as archive:
        pickle = next(name for name in archive.namelist() if name.endswith("data.pkl"))
        data = archive.read(pickle)
    out = io.StringIO()
    pickletools.dis(data, out=out)
    if "samplers_as_optim" in out.getvalue():
        raise RuntimeError(f"{path} pickles a samplers_as_optim class; keep it to builtins")
    torch.load(path, weights_only=True)


def record_machine() -> None:
    """Record this CPU's numbers beside the first machine's: ``--machine``.

    For a CPU whose :func:`golden_cases.rounding_probe` differs from the recording's (its
    torch kernels round some elements differently, so the recorded commit's own numbers
    differ by an ulp here): run it in a clean clone of the commit the JSON records, the
    same cases; the continuations resume the recorded checkpoints (``GOLDEN_CHECKPOINTS``,
    as the test does), which stay the one file. Writes ``MACHINE_DIR/<probe>.json``.
    """
    probe = golden_cases.rounding_probe()
    golden: dict[str, Any] = {
        "about": (
            "Golden trajectories of samplers_as_optim on CPUs with this rounding probe "
            "(tests/golden_cases.py rounding_probe), recorded by tests/data/make_golden.py "
            "--machine; the continuations resume tests/data/golden_checkpoints.pt."
        ),
        "recorded_from": _recorded_from(rounding_probe=probe),
        "trajectories": {},
        "continuations": {},
    }
    seed = golden_cases.RECORD_GLOBAL_SEED
    for name in golden_cases.TRAJECTORY_CASES:
        golden["trajectories"][name] = golden_cases.to_hex(golden_cases.run_trajectory(name, seed))
    checkpoints = torch.load(golden_cases.GOLDEN_CHECKPOINTS, weights_only=True)
    for name in golden_cases.CHECKPOINT_CASES:
        continuation = golden_cases.resume_checkpoint(
            name, checkpoints[name], golden_cases.TEST_GLOBAL_SEED
        )
        golden["continuations"][name] = golden_cases.to_hex(continuation)
    golden_cases.MACHINE_DIR.mkdir(exist_ok=True)
    path = golden_cases.MACHINE_DIR / f"{probe}.json"
    path.write_text(_dumps(golden))
    print(f"recorded {REPO} at {golden['recorded_from']['commit']} for probe {probe}: {path}")


def record_pipeline() -> None:
    """Record ``tests/golden_pipeline_cases.py``: ``--pipeline``.

    Into ``golden_pipeline_cases.PIPELINE_DIR/<rounding probe>.json``, the fused cases
    through Triton's interpreter where there is no CUDA (they need Triton installed).
    """
    import golden_pipeline_cases

    probe = golden_cases.rounding_probe()
    golden: dict[str, Any] = {
        "about": (
            "Golden trajectories of the paths the step pipeline (issue #35) moves, recorded "
            "by tests/data/make_golden.py --pipeline from tests/golden_pipeline_cases.py "
            "and checked bit for bit by tests/test_golden_pipeline.py."
        ),
        "recorded_from": _recorded_from(rounding_probe=probe, cuda=torch.cuda.is_available()),
        "trajectories": {},
    }
    seed = golden_cases.RECORD_GLOBAL_SEED
    for name in golden_pipeline_cases.PIPELINE_CASES:
        record = golden_pipeline_cases.run_pipeline_case(name, seed)
        golden["trajectories"][name] = golden_cases.to_hex(record)
    golden_pipeline_cases.PIPELINE_DIR.mkdir(exist_ok=True)
    path = golden_pipeline_cases.PIPELINE_DIR / f"{probe}.json"
    path.write_text(_dumps(golden))
    print(f"recorded {REPO} at {golden['recorded_from']['commit']} for probe {probe}: {path}")


def record_revisions() -> None:
    """Re-record the deliberately changed cases (``golden_cases.REVISED``): ``--revise``.

    Into this CPU's recordings (``MACHINE_DIR/<probe>.json`` and the pipeline's), which
    must exist: each case of ``REVISED`` they hold is run again with this checkout's code
    and marked ``"revised": {case: reason}``, with the commit it was recorded from under
    ``"revised_from"``; every other case keeps its recording. Run it in a clean clone of
    the commit that made the change.
    """
    import golden_pipeline_cases

    probe = golden_cases.rounding_probe()
    seed = golden_cases.RECORD_GLOBAL_SEED
    checkpoints = torch.load(golden_cases.GOLDEN_CHECKPOINTS, weights_only=True)
    paths = (
        golden_cases.MACHINE_DIR / f"{probe}.json",
        golden_pipeline_cases.PIPELINE_DIR / f"{probe}.json",
    )
    for path in paths:
        golden = json.loads(path.read_text())
        pipeline = "continuations" not in golden
        for name, reason in golden_cases.REVISED.items():
            if name not in golden["trajectories"]:
                continue
            if pipeline:
                record = golden_pipeline_cases.run_pipeline_case(name, seed)
            else:
                record = golden_cases.run_trajectory(name, seed)
            golden["trajectories"][name] = golden_cases.to_hex(record)
            if not pipeline and name in golden["continuations"]:
                continuation = golden_cases.resume_checkpoint(
                    name, checkpoints[name], golden_cases.TEST_GLOBAL_SEED
                )
                golden["continuations"][name] = golden_cases.to_hex(continuation)
            golden.setdefault("revised", {})[name] = reason
        golden.setdefault("revised_from", {})[_git("rev-parse", "--short", "HEAD")] = sorted(
            name for name in golden_cases.REVISED if name in golden["trajectories"]
        )
        path.write_text(_dumps(golden))
        print(f"revised {path}")


def main() -> None:
    if sys.argv[1:] == ["--machine"]:
        record_machine()
        return
    if sys.argv[1:] == ["--revise"]:
        record_revisions()
        return
    if sys.argv[1:] == ["--pipeline"]:
        record_pipeline()
        return
    golden: dict[str, Any] = {
        "about": (
            "Golden trajectories of samplers_as_optim, recorded by tests/data/make_golden.py "
            "from tests/golden_cases.py and checked bit for bit by tests/test_golden.py. "
            "Numbers are float.hex() strings. Regenerate only for a deliberate, documented "
            "change of behaviour."
        ),
        "recorded_from": _recorded_from(),
        "trajectories": {},
        "continuations": {},
    }
    seed = golden_cases.RECORD_GLOBAL_SEED
    for name in golden_cases.TRAJECTORY_CASES:
        record = golden_cases.run_trajectory(name, seed)
        golden["trajectories"][name] = golden_cases.to_hex(record)
    checkpoints = {}
    for name in golden_cases.CHECKPOINT_CASES:
        saved, continuation = golden_cases.record_checkpoint(name, seed)
        checkpoints[name] = saved
        golden["continuations"][name] = golden_cases.to_hex(continuation)

    golden_cases.GOLDEN_JSON.write_text(_dumps(golden))
    torch.save(checkpoints, golden_cases.GOLDEN_CHECKPOINTS)
    _check_builtins_only(golden_cases.GOLDEN_CHECKPOINTS)
    count = sum(
        len(values)
        for section in ("trajectories", "continuations")
        for record in golden[section].values()
        for values in record.values()
    )
    print(
        f"recorded {REPO} at {golden['recorded_from']['commit']}"
        f"{' with uncommitted changes' if golden['recorded_from']['uncommitted_changes_in_package'] else ''}: "
        f"{len(golden['trajectories'])} trajectory cases, {len(checkpoints)} checkpoint cases, "
        f"{count} numbers; {golden_cases.GOLDEN_JSON.stat().st_size} bytes of JSON, "
        f"{golden_cases.GOLDEN_CHECKPOINTS.stat().st_size} bytes of checkpoints"
    )


if __name__ == "__main__":
    main()
