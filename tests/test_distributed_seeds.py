"""Under torch.distributed the ranks agree on the chain's seed, and ZeRO keeps the chain.

With named parameters (``name_parameters``) a 2-rank ZeRO run is the 1-process run.

Each test spawns 2 gloo processes on 127.0.0.1 (``distributed_workers.py``), bounded in
time; every process destroys its process group before it exits.
"""

import socket

import distributed_workers
import pytest
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="torch.distributed is not available"
)

TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn(scenario: str, out) -> list[dict]:
    context = mp.spawn(
        distributed_workers.run,
        args=(scenario, free_port(), str(out)),
        nprocs=2,
        join=False,
    )
    paths = [out / f"rank{rank}.pt" for rank in (0, 1)]
    distributed_workers.join_ranks(context, paths, scenario, TIMEOUT_S)
    results = [torch.load(path, weights_only=False) for path in paths]
    for result in results:
        assert "traceback" not in result, result.get("traceback")
    return results


def test_ddp_ranks_seeded_differently_with_seed_none_stay_identical(tmp_path):
    results = spawn("ddp_with_seed_none", tmp_path)
    # before the fix: max |difference| 0.445 after 30 steps, no warning
    assert results[0]["max_difference"] == 0.0
    assert results[0]["seed"] == results[1]["seed"]


def test_ddp_ranks_with_different_explicit_seeds_fail_loudly_at_the_first_step(tmp_path):
    results = spawn("ddp_with_different_seeds", tmp_path)
    for result in results:
        assert result["error"] is not None, "the ranks stepped with different seeds"
        assert result["error"].startswith(
            "Invalid seed: rank 1 has 1 and rank 0 0 (expected the same seed on every rank"
        )
        assert result["changed"] == 0


def test_zero_consolidated_checkpoint_resumes_the_same_chain(tmp_path):
    results = spawn("zero_resume", tmp_path)
    for result in results:
        assert result["chain_state"] and all(step == 10 for _, step in result["chain_state"])
        assert result["equal"], "the resumed chain differs from the uninterrupted one"
        assert result["replicas_equal"]


def test_zero_with_named_parameters_equals_the_one_process_run(tmp_path):
    results = spawn("zero_named_equals_one_process", tmp_path)
    assert sum(result["share"][0] for result in results) == 4  # each rank holds a share
    assert all(0 < result["share"][0] < 4 for result in results)
    for result in results:
        assert result["equal"], "the ZeRO run's noise differs from the 1-process run's"


def test_chains_split_over_ranks_are_the_chains_of_one_process(tmp_path):
    results = spawn("ensemble_across_ranks", tmp_path)
    assert [r["3"]["members"] for r in results] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    for result in results:
        for seed in ("3", "None"):
            outcome = result[seed]
            assert outcome["params_equal"], f"seed {seed}: members differ from one process's"
            assert outcome["samples_equal"] and outcome["logits_equal"]
            assert outcome["rhat_equal"]
        assert result["uneven"] == (
            "Invalid num_members: 7 (expected a multiple of the process group's 2 ranks, "
            "which share the members equally)"
        )


def test_fsdp2_equals_the_one_process_run(tmp_path):
    results = spawn("fsdp2_equals_one_process", tmp_path)
    assert [r["rows"] for r in results] == [[4, 4, 1, 1], [4, 4, 1, 1]]  # half of each
    for result in results:
        assert result["equal"], "the FSDP2 run's noise differs from the 1-process run's"
        assert result["sgnht"].startswith(
            "SGNHT does not support DTensor (FSDP2) parameters yet (param group 0, parameter 0"
        )


def test_fsdp2_with_the_skip_policy_skips_on_every_rank_as_one_process(tmp_path):
    results = spawn("fsdp2_skip_equals_one_process", tmp_path)
    for result in results:
        assert result["reference_skipped"] == result["skipped"] == [1]
        assert result["equal"], "the FSDP2 run with nonfinite='skip' left the 1-process chain"
