"""examples/distributed.py under torchrun (2 gloo ranks on this machine): the DDP and the
ZeRO chains, and 8 parallel chains split over the ranks, equal the 1-process chains bit
for bit; DDP replicas stay identical."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "distributed.py"


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")
def test_distributed_example_matches_the_one_process_run():
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", str(EXAMPLE), "--quick"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=240, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "DDP:  replicas differ by 0.0e+00; max |theta - 1-process| = 0.0e+00" in out
    assert "max |theta - 1-process| = 0.0e+00" in out.split("ZeRO:")[1]
    assert (
        "Parallel chains: members [0, 1, 2, 3] of 8 on rank 0; max |sample - 1-process| = 0.0e+00"
        in out
    )
    assert "function-space R-hat over 540 quantities (0 NaN)" in out  # 8 chains gathered
    assert "FSDP2: max |theta - 1-process| = 0.0e+00" in out
    assert "matches the 1-process run" in out
