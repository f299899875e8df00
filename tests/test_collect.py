"""SampleCollector and RunningMoments.

What is checked: the burn-in/thinning schedule keeps exactly the documented steps; storage
is allocated once (the same memory before and after collecting: no concatenation), on the
CPU by default, in a chosen dtype; samples come out in the stacked layout and run through
call_stacked; a path-backed collector writes to memory-mapped files that load back after
the collector is gone (as after a crash) and that a resumed collector continues exactly
like an uninterrupted one; save/load and state_dict round trips; ensembles give
``[S, K, ...]`` samples; RunningMoments agrees with torch.mean/var of the stored samples,
per member for an ensemble, and resumes exactly; every error message.
"""

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

from samplers_as_optim import SGLD
from samplers_as_optim.collect import RunningMoments, SampleCollector
from samplers_as_optim.ensemble import ParallelEnsemble
from samplers_as_optim.stacked import call_stacked


class Counter:
    """A 'chain' whose state after step t is t (so stored values name the kept steps)."""

    def __init__(self, shape=(2,)):
        self.state = {"t": torch.zeros(shape)}

    def advance(self):
        self.state["t"] += 1


def run(collector, chain, steps):
    kept = []
    for _ in range(steps):
        chain.advance()
        if collector.step():
            kept.append(int(chain.state["t"].reshape(-1)[0]))
    return kept


@pytest.mark.parametrize(("burn_in", "thin"), [(0, 1), (3, 1), (5, 2), (0, 4)])
def test_schedule_keeps_steps_after_burn_in_every_thin(burn_in, thin):
    chain = Counter()
    collector = SampleCollector(chain.state, 4, burn_in=burn_in, thin=thin)
    assert collector.total_steps == burn_in + 4 * thin
    kept = run(collector, chain, collector.total_steps + 5)
    expected = [burn_in + thin * j for j in range(1, 5)]
    assert kept == expected
    assert collector.samples["t"][:, 0].tolist() == expected
    assert collector.full and collector.count == 4 and collector.steps == burn_in + 4 * thin + 5


def test_storage_is_allocated_once_on_the_cpu(device):
    model = nn.Linear(3, 2).to(device)
    collector = SampleCollector(model, 5)
    pointers = {name: t.data_ptr() for name, t in collector._storage.items()}
    for _ in range(5):
        with torch.no_grad():
            model.weight.add_(1.0)
        collector.step()
    samples = collector.samples
    assert {name: t.data_ptr() for name, t in samples.items()} == pointers
    assert all(t.device.type == "cpu" for t in samples.values())
    assert samples["weight"].shape == (5, 2, 3)
    assert_close(samples["weight"][4] - samples["weight"][0], torch.full((2, 3), 4.0))


def test_dtype_frozen_parameters_and_buffers():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    model[0].bias.requires_grad_(False)
    collector = SampleCollector(model, 2, dtype=torch.float16, buffers=True)
    collector.record()
    assert set(collector.samples) == {
        "0.weight",
        "1.weight",
        "1.bias",
        "1.running_mean",
        "1.running_var",
        "1.num_batches_tracked",
    }
    assert collector.samples["0.weight"].dtype == torch.float16
    assert collector.samples["1.num_batches_tracked"].dtype == torch.float16


def test_samples_run_through_call_stacked(device):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1)).to(device)
    optimizer = SGLD(model.parameters(), lr=1e-3, num_data=50, seed=0)
    collector = SampleCollector(model, 6, burn_in=4, thin=3, device=device)
    x, y = torch.randn(50, 3, device=device), torch.randn(50, 1, device=device)
    states = []
    for step in range(1, collector.total_steps + 1):
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        if collector.step():
            assert step > 4 and (step - 4) % 3 == 0
            states.append({n: p.detach().clone() for n, p in model.named_parameters()})
    x_test = torch.randn(5, 3, device=device)
    predictions = call_stacked(model, collector.samples, x_test)
    assert predictions.shape == (6, 5, 1)
    for i, state in enumerate(states):
        assert_close(predictions[i], torch.func.functional_call(model, state, (x_test,)))


def test_ensembles_give_one_sample_per_member_and_step():
    ensemble = ParallelEnsemble(lambda: nn.Linear(3, 2), 4, seed=0)
    collector = SampleCollector(ensemble, 3)
    for _ in range(3):
        with torch.no_grad():
            ensemble.module.weight.add_(1.0)
        collector.step()
    assert collector.samples["weight"].shape == (3, 4, 2, 3)
    flat = {name: t.flatten(0, 1) for name, t in collector.samples.items()}
    x = torch.randn(5, 3)
    out = call_stacked(ensemble.member(0), flat, x)
    assert out.shape == (12, 5, 2)
    assert_close(out[-4:], ensemble(x))  # the last sample is the current ensemble


def test_streaming_to_disk_survives_the_collector_and_resumes_exactly(tmp_path):
    chain = Counter((3, 2))
    path = tmp_path / "chain"
    collector = SampleCollector(chain.state, 6, burn_in=2, thin=2, path=path)
    run(collector, chain, 7)  # keeps steps 4 and 6; step 7 is counted
    files = sorted(p.name for p in path.iterdir())
    assert files == ["0000.bin", "index.json"]
    assert (path / "0000.bin").stat().st_size == 6 * 3 * 2 * 4  # preallocated, S samples
    # the index is written at every recorded sample: a crash now loses only the count of
    # step 7; save() (e.g. with a model checkpoint) records the step counter too
    assert SampleCollector.load(path).steps == 6
    collector.save()
    del collector  # as if the process had died

    stored = SampleCollector.load(path)
    assert stored.count == 2 and stored.steps == 7
    assert stored.samples["t"][:, 0, 0].tolist() == [4.0, 6.0]
    with pytest.raises(RuntimeError, match=r"has no source \(it was loaded without one\)"):
        stored.step()

    resumed = SampleCollector.load(path, chain.state)
    kept = run(resumed, chain, 20)
    assert kept == [8, 10, 12, 14]
    assert SampleCollector.load(path).samples["t"][:, 0, 0].tolist() == [4, 6, 8, 10, 12, 14]

    uninterrupted_chain = Counter((3, 2))
    uninterrupted = SampleCollector(uninterrupted_chain.state, 6, burn_in=2, thin=2)
    run(uninterrupted, uninterrupted_chain, 27)
    assert torch.equal(uninterrupted.samples["t"], resumed.samples["t"])
    assert resumed.steps == uninterrupted.steps == 27


def test_save_and_load_round_trip(tmp_path):
    chain = Counter()
    collector = SampleCollector(chain.state, 5, dtype=torch.float64)
    run(collector, chain, 3)
    collector.save(tmp_path / "saved")
    index = json.loads((tmp_path / "saved" / "index.json").read_text())
    assert index["count"] == 3 and index["tensors"][0]["dtype"] == "float64"
    for mmap in (True, False):
        loaded = SampleCollector.load(tmp_path / "saved", mmap=mmap)
        assert torch.equal(loaded.samples["t"], collector.samples["t"])
        assert loaded.samples["t"].dtype == torch.float64
        assert loaded.num_samples == 5 and loaded.thin == 1 and loaded.burn_in == 0
        assert loaded.path is None  # without a source, the store is not written to
        loaded.samples["t"].zero_()
    assert SampleCollector.load(tmp_path / "saved").samples["t"].sum() > 0
    # a streaming collector's save() with no argument brings its index up to date
    streaming = SampleCollector(chain.state, 2, path=tmp_path / "live")
    streaming.record()
    streaming.save()
    assert SampleCollector.load(tmp_path / "live").count == 1
    assert "count=1" in repr(streaming)


def test_state_dict_round_trip_continues_identically():
    chain = Counter()
    collector = SampleCollector(chain.state, 4, burn_in=1, thin=2)
    run(collector, chain, 4)
    state = collector.state_dict()
    restored = SampleCollector(chain.state, 4)
    restored.load_state_dict(state)
    assert run(restored, chain, 6) == [5, 7, 9]
    assert restored.samples["t"][:, 0].tolist() == [3.0, 5.0, 7.0, 9.0]


def test_running_moments_match_the_stored_samples(device):
    torch.manual_seed(0)
    model = nn.Linear(4, 3).to(device)
    optimizer = SGLD(model.parameters(), lr=1e-2, num_data=20, seed=1)
    collector = SampleCollector(model, 30, burn_in=5, thin=2, device=device)
    moments = RunningMoments(model, burn_in=5, thin=2, dtype=torch.float64)
    x = torch.randn(20, 4, device=device)
    for _ in range(collector.total_steps):
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()
        assert collector.step() == moments.step()
    assert moments.count == 30
    for name, samples in collector.samples.items():
        assert_close(moments.mean[name], samples.double().mean(0))
        assert_close(moments.variance[name], samples.double().var(0))
        assert_close(moments.std[name], samples.double().std(0))
        assert moments.mean[name].device == samples.device or device.type != "cpu"


def test_running_moments_per_member_and_resume():
    ensemble = ParallelEnsemble(lambda: nn.Linear(2, 1), 3, seed=0)
    moments = RunningMoments(ensemble)
    values = []
    for step in range(6):
        with torch.no_grad():
            ensemble.module.weight.add_(
                torch.randn(3, 1, 2, generator=torch.Generator().manual_seed(step))
            )
        values.append(ensemble.module.weight.detach().clone())
        moments.step()
        if step == 2:
            saved = moments.state_dict()
    stacked = torch.stack(values)
    assert moments.mean["weight"].shape == (3, 1, 2)
    assert_close(moments.mean["weight"], stacked.mean(0))
    assert_close(moments.variance["weight"], stacked.var(0))
    resumed = RunningMoments(ensemble)
    resumed.load_state_dict(saved)
    for value in values[3:]:
        resumed.record({"weight": value, "bias": torch.zeros(3, 1)})
    assert_close(resumed.mean["weight"], moments.mean["weight"])
    assert "count=6" in repr(moments)


def test_error_messages(tmp_path):
    state = {"x": torch.zeros(2)}
    with pytest.raises(ValueError, match=r"Invalid num_samples: 0 \(expected an integer >= 1\)"):
        SampleCollector(state, 0)
    with pytest.raises(ValueError, match=r"Invalid burn_in: -1 \(expected an integer >= 0\)"):
        SampleCollector(state, 2, burn_in=-1)
    with pytest.raises(TypeError, match=r"Invalid thin: 1.5 \(expected an integer >= 1\)"):
        SampleCollector(state, 2, thin=1.5)
    with pytest.raises(ValueError, match=r"Invalid thin: 0 \(expected an integer >= 1\)"):
        RunningMoments(state, thin=0)
    with pytest.raises(TypeError, match=r"Invalid source: 3 \(expected an nn.Module, a"):
        SampleCollector(3, 2)
    with pytest.raises(TypeError, match=r"Invalid source: a mapping with keys \['x'\] \(expected"):
        SampleCollector({"x": 1.0}, 2)
    with pytest.raises(ValueError, match=r"Invalid source: ReLU has no parameters that require"):
        SampleCollector(nn.ReLU(), 2)
    with pytest.raises(TypeError, match=r"Invalid dtype: 'half' \(expected None or a torch.dtype"):
        SampleCollector(state, 2, dtype="half")
    with pytest.raises(TypeError, match=r"Invalid buffers: 'no' \(expected True or False\)"):
        SampleCollector(state, 2, buffers="no")
    with pytest.raises(ValueError, match=r"Invalid device: 'meta' \(expected 'cpu' when path"):
        SampleCollector(state, 2, device="meta", path=tmp_path / "x")
    SampleCollector(state, 2, path=tmp_path / "taken")
    with pytest.raises(FileExistsError, match=r"already holds samples \(expected a new directory"):
        SampleCollector(state, 2, path=tmp_path / "taken")
    with pytest.raises(ValueError, match=r"Invalid path: .* \(expected a sample store written by"):
        SampleCollector.load(tmp_path / "missing")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "index.json").write_text(json.dumps({"format": "x", "version": 9}))
    with pytest.raises(ValueError, match=r"holds format 'x' version 9 \(expected"):
        SampleCollector.load(tmp_path / "other")
    with pytest.raises(ValueError, match=r"Invalid source: names \['y'\] \(expected \['x'\]\)"):
        SampleCollector.load(tmp_path / "taken", {"y": torch.zeros(2)})

    collector = SampleCollector(state, 1)
    with pytest.raises(
        ValueError, match=r"Invalid values: 'x' has shape \(3,\) \(expected \(2,\)\)"
    ):
        collector.record({"x": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"Invalid values: names \['z'\] \(expected \['x'\]\)"):
        collector.record({"z": torch.zeros(2)})
    collector.record()
    with pytest.raises(RuntimeError, match=r"SampleCollector is full: it holds num_samples=1"):
        collector.record()
    assert collector.step() is False
    with pytest.raises(ValueError, match=r"Invalid path: None \(expected a directory: this"):
        collector.save()
    with pytest.raises(ValueError, match=r"Invalid state_dict: num_samples=1 \(expected 2, as"):
        SampleCollector(state, 2).load_state_dict(collector.state_dict())
    with pytest.raises(ValueError, match=r"Invalid state_dict samples: 'x' has shape \(1, 2\)"):
        SampleCollector({"x": torch.zeros(3)}, 1).load_state_dict(collector.state_dict())

    moments = RunningMoments(state)
    with pytest.raises(RuntimeError, match=r"RunningMoments.mean needs at least 1 recorded state"):
        moments.mean  # noqa: B018
    moments.record()
    with pytest.raises(RuntimeError, match=r"RunningMoments.variance needs at least 2 recorded"):
        moments.variance  # noqa: B018
    with pytest.raises(ValueError, match=r"Invalid state_dict mean: names \['y'\]"):
        moments.load_state_dict({**moments.state_dict(), "mean": {"y": torch.zeros(2)}})
