"""A chain killed at any instant and resumed from its last checkpoint collects the same store.

The chain of ``collect_crash_script.py`` (SGHMC on a BatchNorm network, samples streamed to
disk, a checkpoint of model, optimizer and collector every 10 steps, written atomically)
is SIGKILLed at pseudo-random steps, at every phase of a step (while a checkpoint is
written, right after it, between ``optimizer.step()`` and ``collector.step()``, right
after the sample is recorded; once before the first checkpoint is in place), then from
outside at an arbitrary instant; each time it resumes from its last checkpoint. The
final store must equal an uninterrupted run's, bit for bit: no sample lost, none
duplicated. (Two interpreter starts: the script forks a child per self-kill.)
"""

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from collect_crash_script import BURN_IN, EVERY, NUM_SAMPLES, PHASES, THIN, train

from samplers_as_optim.samples.collect import SampleCollector

SCRIPT = Path(__file__).with_name("collect_crash_script.py")
TOTAL = BURN_IN + THIN * NUM_SAMPLES

pytestmark = pytest.mark.skipif(
    not hasattr(os, "fork") or not hasattr(signal, "SIGKILL"), reason="needs fork and SIGKILL"
)


def kill_points(rng, count, below):
    """``count`` increasing (step, phase) points; the first lands before any checkpoint."""
    points = [(0, "in_checkpoint")]
    for step in sorted(rng.sample(range(1, below), count - 1)):
        phases = PHASES if step % EVERY == 0 else PHASES[2:]
        points.append((step, rng.choice(phases)))
    return points


@pytest.fixture
def uninterrupted(tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train(tmp_path / "uninterrupted")
    finally:
        torch.set_num_threads(threads)
    return tmp_path / "uninterrupted"


def test_kills_at_any_instant_resume_to_the_uninterrupted_store(tmp_path, uninterrupted):
    rng = random.Random(10)
    points = kill_points(rng, 7, below=TOTAL - 40)
    # then from outside, during the last resumed run, a little after it prints step `when`
    when = rng.randrange(points[-1][0] + 1, TOTAL - 30)  # 150 ms before the end
    workdir = tmp_path / "killed"
    kills = ",".join(f"{step}:{phase}" for step, phase in points)
    command = [sys.executable, str(SCRIPT), str(workdir), "--pace", "0.005"]
    process = subprocess.Popen([*command, "--kills", kills], stdout=subprocess.PIPE, text=True)
    lines = []
    for line in process.stdout:
        lines.append(line.strip())
        if lines[-1] == f"step {when}":
            break
    time.sleep(rng.uniform(0.0, 0.02))
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
    process.stdout.close()
    assert [line for line in lines if line.startswith("killed")] == [
        f"killed at {step}:{phase}" for step, phase in points
    ]
    assert process.returncode == -signal.SIGKILL
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr

    # the checkpoint holds the collector's counters and the store's identity, not samples
    state = torch.load(workdir / "checkpoint.pt")["collector"]
    assert "samples" not in state and state["store"]["path"] == str(workdir / "samples")
    got = SampleCollector.load(workdir / "samples")
    want = SampleCollector.load(uninterrupted / "samples")
    assert got.count == want.count == NUM_SAMPLES and got.steps == want.steps == TOTAL
    assert list(got.samples) == list(want.samples)
    assert "1.running_mean" in got.samples  # BatchNorm statistics travel with each sample
    for name, tensor in want.samples.items():
        assert torch.equal(got.samples[name], tensor), name
