"""A chain that collects samples on disk and checkpoints, for tests/test_collect_crash.py.

``train(workdir)`` runs (or resumes, from ``workdir/checkpoint.pt``) a small SGHMC chain on
a BatchNorm network with a :class:`SampleCollector` streaming to ``workdir/samples``, and
checkpoints the model, the optimizer and the collector every ``EVERY`` steps, atomically,
as the collect module's docstring recommends.

As a script::

    python collect_crash_script.py WORKDIR [--kills STEP:PHASE,...] [--pace SECONDS]

runs, for each kill point in turn, the chain in a forked child that resumes from the
last checkpoint and SIGKILLs itself at that point (so one interpreter start serves many
crashes), then resumes the chain once more in this process and completes it, printing
``step N`` after each step (and sleeping ``--pace`` seconds), so that a test can also
kill the process from outside at any instant.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from samplers_as_optim import SGHMC
from samplers_as_optim.samples.collect import SampleCollector

NUM_SAMPLES, BURN_IN, THIN, EVERY = 40, 20, 3, 10
PHASES = ("in_checkpoint", "after_checkpoint", "after_step", "after_collect")


def train(
    workdir: Path, kill: tuple[int, str] | None = None, *, pace: float = 0.0, echo: bool = False
) -> None:
    """Run or resume the chain to the end (or to ``kill``: (step, phase), a SIGKILL)."""

    def maybe_kill(step: int, phase: str) -> None:
        if kill == (step, phase):
            os.kill(os.getpid(), signal.SIGKILL)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1))
    optimizer = SGHMC(model.parameters(), lr=1e-2, num_data=64, seed=0)
    data = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 4, generator=data), torch.randn(64, 1, generator=data)
    checkpoint_file, store = workdir / "checkpoint.pt", workdir / "samples"
    if checkpoint_file.exists():
        checkpoint = torch.load(checkpoint_file)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        collector = SampleCollector.load(store, model)
        collector.load_state_dict(checkpoint["collector"])
        start = checkpoint["step"]
    else:  # nothing to resume: a store without a checkpoint is from a run that died at once
        shutil.rmtree(store, ignore_errors=True)
        collector = SampleCollector(model, NUM_SAMPLES, burn_in=BURN_IN, thin=THIN, path=store)
        start = 0
    for step in range(start, collector.total_steps):
        if step % EVERY == 0:
            checkpoint = {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "collector": collector.state_dict(),
                "step": step,
            }
            torch.save(checkpoint, workdir / "checkpoint.pt.tmp")
            maybe_kill(step, "in_checkpoint")
            os.replace(workdir / "checkpoint.pt.tmp", checkpoint_file)
            maybe_kill(step, "after_checkpoint")
        batch = torch.arange(16 * step, 16 * step + 16) % 64
        optimizer.zero_grad()
        F.mse_loss(model(x[batch]), y[batch]).backward()
        optimizer.step()
        maybe_kill(step, "after_step")
        collector.step()
        maybe_kill(step, "after_collect")
        if echo:
            print(f"step {step}", flush=True)
        if pace:
            time.sleep(pace)
    collector.save()


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--kills", default="")
    parser.add_argument("--pace", type=float, default=0.0)
    args = parser.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)  # tiny tensors: threads only contend on a busy machine
    # What a first optimizer imports (torch._dynamo, seconds), once for all the children.
    SGHMC([torch.zeros(1, requires_grad=True)], lr=0.1, num_data=1)
    for spec in filter(None, args.kills.split(",")):
        step, phase = spec.split(":")
        child = os.fork()
        if child == 0:
            try:
                train(args.workdir, (int(step), phase))
            finally:
                os._exit(3)  # the kill point was never reached
        _, status = os.waitpid(child, 0)
        if not os.WIFSIGNALED(status) or os.WTERMSIG(status) != signal.SIGKILL:
            sys.exit(f"the child for {spec} was not killed (status {status})")
        print(f"killed at {spec}", flush=True)
    train(args.workdir, pace=args.pace, echo=True)
    print("done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
