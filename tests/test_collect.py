"""SampleCollector and RunningMoments.

What is checked: the burn-in/thinning schedule keeps exactly the documented steps; storage
is allocated once (the same memory before and after collecting: no concatenation), on the
CPU by default, in a chosen dtype; a sample holds the parameters that require grad and the
floating-point persistent buffers (BatchNorm statistics), not counters or caches; samples
come out in the stacked layout and run through call_stacked; a path-backed collector
writes to memory-mapped files that load back after the collector is gone (as after a
crash); its state_dict is small, flushes the store, and a resume from it rewinds the
store so the chain continues like an uninterrupted one (the SIGKILL test is
test_collect_crash.py); save/load and state_dict round trips; ensembles give
``[S, K, ...]`` samples; RunningMoments agrees with torch.mean/var of the stored samples,
per member for an ensemble, and resumes exactly; a damaged store (files against index,
every index field) is an error naming the file and the field; every error message.
"""

import copy
import io
import json
import pickle
import re
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

from samplers_as_optim import SGLD
from samplers_as_optim.samples._store import _Store
from samplers_as_optim.samples.collect import RunningMoments, SampleCollector
from samplers_as_optim.samples.ensemble import ParallelEnsemble
from samplers_as_optim.samples.stacked import call_stacked


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


@pytest.mark.filterwarnings("ignore:SampleCollector is full")  # it steps past full on purpose
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


class WithCache(nn.Module):
    """BatchNorm plus a non-persistent floating-point buffer (a cache, not state)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 4)
        self.norm = nn.BatchNorm1d(4)
        self.register_buffer("cache", torch.zeros(4), persistent=False)

    def forward(self, x):
        return self.norm(self.linear(x)) + self.cache


def test_a_sample_holds_the_parameters_and_the_floating_point_state_buffers():
    model = WithCache()
    model.linear.bias.requires_grad_(False)
    collector = SampleCollector(model, 2, dtype=torch.float16)
    collector.record()
    # frozen parameters, integer counters and non-persistent buffers stay with the module
    assert list(collector.samples) == [
        "linear.weight",
        "norm.weight",
        "norm.bias",
        "norm.running_mean",
        "norm.running_var",
    ]
    assert collector.samples["norm.running_var"].dtype == torch.float16
    names_without = ["linear.weight", "norm.weight", "norm.bias"]
    assert list(SampleCollector(model, 2, buffers=False).samples) == names_without
    for buffers, names in ((True, list(collector.samples)), (False, names_without)):
        moments = RunningMoments(model, buffers=buffers)
        moments.record()
        assert list(moments.mean) == names


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


@pytest.mark.filterwarnings("ignore:SampleCollector is full")
def test_streaming_to_disk_survives_the_collector_and_resumes_from_a_checkpoint(tmp_path):
    chain = Counter((3, 2))
    path = tmp_path / "chain"
    collector = SampleCollector(chain.state, 6, burn_in=2, thin=2, path=path)
    run(collector, chain, 7)  # keeps steps 4 and 6; step 7 is counted
    files = sorted(p.name for p in path.iterdir())
    assert files == ["0000.bin", "index.json"]
    assert (path / "0000.bin").stat().st_size == 6 * 3 * 2 * 4  # preallocated, S samples
    checkpoint = {"chain": chain.state["t"].clone(), "collector": collector.state_dict()}
    # small: counters and the store's identity, not the samples
    assert set(checkpoint["collector"]) == {
        "num_samples",
        "burn_in",
        "thin",
        "steps",
        "count",
        "store",
    }
    assert checkpoint["collector"]["store"]["path"] == str(path.resolve())
    run(collector, chain, 2)  # keeps step 8 after the checkpoint ...
    del collector  # ... and the process dies

    stored = SampleCollector.load(path)  # a reader sees every recorded sample
    assert stored.count == 3 and stored.steps == 8
    assert stored.samples["t"][:, 0, 0].tolist() == [4.0, 6.0, 8.0]
    with pytest.raises(RuntimeError, match=r"has no source \(it was loaded without one\)"):
        stored.record()

    chain.state["t"].copy_(checkpoint["chain"])  # the chain resumes from its checkpoint
    resumed = SampleCollector.load(path, chain.state)
    with pytest.raises(
        RuntimeError, match=r"call collector.load_state_dict\(checkpoint\['collector'\]\)"
    ):
        resumed.step()
    resumed.load_state_dict(checkpoint["collector"])  # rewinds the store to the checkpoint
    assert resumed.count == 2 and resumed.steps == 7
    assert SampleCollector.load(path).count == 2
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


@pytest.mark.filterwarnings("ignore:SampleCollector is full")
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


def damaged_store(tmp_path):
    """A store of 4 samples (2 recorded) of w [3, 2] (0000.bin) and b [2] (0001.bin)."""
    state = {"w": torch.ones(3, 2), "b": torch.ones(2)}
    collector = SampleCollector(state, 4, path=tmp_path / "store")
    collector.record()
    collector.record()
    return state, (tmp_path / "store").resolve()


def edit_index(root, **changes):
    index = json.loads((root / "index.json").read_text())
    for key, value in changes.items():
        if value is DELETE:
            del index[key]
        else:
            index[key] = value
    (root / "index.json").write_text(json.dumps(index))


def edit_tensor(root, position, **changes):
    index = json.loads((root / "index.json").read_text())
    index["tensors"][position].update(changes)
    (root / "index.json").write_text(json.dumps(index))


def resize(root, name, size):
    with open(root / name, "r+b") as handle:
        handle.truncate(size)


DELETE = object()

# (what is damaged, how, the message: {root} is the store's directory)
DAMAGES = [
    (
        "bin truncated to half",
        lambda root: resize(root, "0000.bin", 48),
        r"Invalid size of {root}/0000.bin: 48 bytes (expected 96: num_samples=4 samples of "
        r"'w' with shape [3, 2] and dtype float32, as {root}/index.json says)",
    ),
    (
        "bin extended",
        lambda root: resize(root, "0001.bin", 40),
        r"Invalid size of {root}/0001.bin: 40 bytes (expected 32: num_samples=4 samples of "
        r"'b' with shape [2] and dtype float32, as {root}/index.json says)",
    ),
    (
        "bin missing",
        lambda root: (root / "0001.bin").unlink(),
        r"Invalid file of 'b' in {root}/index.json: {root}/0001.bin cannot be read (No such "
        r"file or directory; expected 32 bytes: num_samples=4 samples of 'b' with shape [2] and "
        r"dtype float32)",
    ),
    (
        "count too large",
        lambda root: edit_index(root, count=1000000),
        r"Invalid count in {root}/index.json: 1000000 (expected an integer in [0, 4], the "
        r"capacity)",
    ),
    (
        "count negative",
        lambda root: edit_index(root, count=-3),
        r"Invalid count in {root}/index.json: -3 (expected an integer in [0, 4], the capacity)",
    ),
    (
        "count a float",
        lambda root: edit_index(root, count=2.0),
        r"Invalid count in {root}/index.json: 2.0 (expected an integer in [0, 4]",
    ),
    (
        "count not a number",
        lambda root: edit_index(root, count="2"),
        r"Invalid count in {root}/index.json: '2' (expected an integer in [0, 4]",
    ),
    (
        "count a bool",
        lambda root: edit_index(root, count=True),
        r"Invalid count in {root}/index.json: True (expected an integer in [0, 4]",
    ),
    (
        "capacity larger than the files",
        lambda root: edit_index(root, num_samples=8),
        r"Invalid size of {root}/0000.bin: 96 bytes (expected 192: num_samples=8 samples of "
        r"'w' with shape [3, 2] and dtype float32, as {root}/index.json says)",
    ),
    (
        "capacity zero",
        lambda root: edit_index(root, num_samples=0),
        r"Invalid num_samples in {root}/index.json: 0 (expected an integer >= 1)",
    ),
    (
        "steps negative",
        lambda root: edit_index(root, steps=-1),
        r"Invalid steps in {root}/index.json: -1 (expected an integer >= 0)",
    ),
    (
        "thin zero",
        lambda root: edit_index(root, thin=0),
        r"Invalid thin in {root}/index.json: 0 (expected an integer >= 1)",
    ),
    (
        "burn_in not an integer",
        lambda root: edit_index(root, burn_in=0.5),
        r"Invalid burn_in in {root}/index.json: 0.5 (expected an integer >= 0)",
    ),
    (
        "id empty",
        lambda root: edit_index(root, id=""),
        r"Invalid id in {root}/index.json: '' (expected a non-empty string)",
    ),
    (
        "shape of other size",
        lambda root: edit_tensor(root, 0, shape=[3, 3]),
        r"Invalid size of {root}/0000.bin: 96 bytes (expected 144: num_samples=4 samples of "
        r"'w' with shape [3, 3] and dtype float32, as {root}/index.json says)",
    ),
    (
        "shape negative",
        lambda root: edit_tensor(root, 0, shape=[-1, 2]),
        r"Invalid shape of 'w' in {root}/index.json: [-1, 2] (expected a list of integers >= 0)",
    ),
    (
        "shape not a list",
        lambda root: edit_tensor(root, 1, shape="2"),
        r"Invalid shape of 'b' in {root}/index.json: '2' (expected a list of integers >= 0)",
    ),
    (
        "dtype unknown",
        lambda root: edit_tensor(root, 0, dtype="float128"),
        r"Invalid dtype of 'w' in {root}/index.json: 'float128' (expected the name of a torch "
        r"dtype, e.g. 'float32')",
    ),
    (
        "dtype of another size",
        lambda root: edit_tensor(root, 0, dtype="float64"),
        r"Invalid size of {root}/0000.bin: 96 bytes (expected 192: num_samples=4 samples of "
        r"'w' with shape [3, 2] and dtype float64, as {root}/index.json says)",
    ),
    (
        "name repeated",
        lambda root: edit_tensor(root, 1, name="w"),
        r"Invalid name of tensors[1] in {root}/index.json: 'w' (expected a string naming no "
        r"other tensor)",
    ),
    (
        "file outside the store",
        lambda root: edit_tensor(root, 1, file="../0001.bin"),
        r"Invalid file of 'b' in {root}/index.json: '../0001.bin' (expected the name of a file "
        r"in the store's directory, used by no other tensor)",
    ),
    (
        "file shared",
        lambda root: edit_tensor(root, 1, file="0000.bin"),
        r"Invalid file of 'b' in {root}/index.json: '0000.bin' (expected the name of a file",
    ),
    (
        "tensor entry incomplete",
        lambda root: edit_index(root, tensors=[{"name": "w", "file": "0000.bin", "shape": [3, 2]}]),
        r"Invalid tensors[0] in {root}/index.json: {'name': 'w', 'file': '0000.bin', 'shape': "
        r"[3, 2]} (expected an object with the fields ['name', 'file', 'shape', 'dtype'])",
    ),
    (
        "no tensors",
        lambda root: edit_index(root, tensors=[]),
        r"Invalid tensors in {root}/index.json: [] (expected a non-empty list of {name, file, "
        r"shape, dtype} objects)",
    ),
    (
        "field missing",
        lambda root: edit_index(root, count=DELETE),
        r"Invalid index in {root}/index.json: missing field 'count' (expected the fields ['id', "
        r"'num_samples', 'count', 'steps', 'burn_in', 'thin', 'tensors'])",
    ),
    (
        "malformed JSON",
        lambda root: (root / "index.json").write_text('{"format": "samplers_as_optim.samples",'),
        r"Invalid index in {root}/index.json: malformed JSON (",
    ),
    (
        "not an object",
        lambda root: (root / "index.json").write_text("[1, 2]"),
        r"Invalid index in {root}/index.json: a JSON list (expected an object)",
    ),
]


@pytest.mark.parametrize(
    ("damage", "message"), [d[1:] for d in DAMAGES], ids=[d[0] for d in DAMAGES]
)
def test_a_damaged_store_is_an_error_naming_the_file_and_the_field(tmp_path, damage, message):
    state, root = damaged_store(tmp_path)
    damage(root)
    pattern = re.escape(message.replace("{root}", str(root)))
    for source in (None, state):  # read-only, and to continue collecting
        for mmap in (True, False):
            with pytest.raises(ValueError, match=pattern):
                SampleCollector.load(root, source, mmap=mmap)


def test_a_store_state_flushes_the_samples_and_resumes_only_its_own_store(tmp_path, monkeypatch):
    chain = Counter()
    collector = SampleCollector(chain.state, 4, path=tmp_path / "a")
    run(collector, chain, 2)
    flushed = []
    original = _Store.flush
    monkeypatch.setattr(_Store, "flush", lambda self: flushed.append(self.root) or original(self))
    state = collector.state_dict()
    assert flushed == [(tmp_path / "a").resolve()]  # durable before the checkpoint is
    assert (
        state["count"] == 2
        and state["store"]["id"] == json.loads((tmp_path / "a" / "index.json").read_text())["id"]
    )

    other = SampleCollector(chain.state, 4, path=tmp_path / "b")
    with pytest.raises(ValueError, match=r"Invalid state_dict: it refers to the sample store '"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match=r"\(expected this collector's store, '[0-9a-f]{32}' at '"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match=r"refers to the sample store at '.*a' \(expected a state"):
        SampleCollector(chain.state, 4).load_state_dict(state)
    resumed = SampleCollector.load(tmp_path / "a", chain.state)
    with pytest.raises(RuntimeError, match=r"loaded from a store with a source, but the store"):
        resumed.record()
    with pytest.raises(
        ValueError, match=r"Invalid state_dict: count=3 \(expected at most 2, the samples in the"
    ):
        resumed.load_state_dict({**state, "count": 3})
    with pytest.raises(
        ValueError, match=r"Invalid state_dict: burn_in=1 \(expected 0, as the store"
    ):
        resumed.load_state_dict({**state, "burn_in": 1})
    with pytest.raises(ValueError, match=r"Invalid state_dict: count=5 \(expected an integer in"):
        resumed.load_state_dict({**state, "count": 5})
    with pytest.raises(ValueError, match=r"Invalid state_dict: missing field 'steps' \(expected a"):
        resumed.load_state_dict({k: v for k, v in state.items() if k != "steps"})
    with pytest.raises(ValueError, match=r"missing field 'store' or 'samples' \(expected a state"):
        resumed.load_state_dict({k: v for k, v in state.items() if k != "store"})
    with pytest.raises(TypeError, match=r"Invalid state_dict: 3 \(expected a mapping\)"):
        resumed.load_state_dict(3)
    resumed.load_state_dict({**state, "count": 1, "steps": 1})  # rewinds the store
    assert SampleCollector.load(tmp_path / "a").count == 1
    resumed.record()
    assert SampleCollector.load(tmp_path / "a").count == 2


def test_stepping_a_full_collector_warns_once():
    model = torch.nn.Linear(2, 1)
    collector = SampleCollector(model, num_samples=2, burn_in=1)
    for _ in range(3):
        collector.step()
    assert collector.full
    with pytest.warns(
        UserWarning,
        match=r"SampleCollector is full: it holds num_samples=2 samples, taken by step 3 "
        r"\(burn_in=1, thin=1\); step 4 and later are not recorded",
    ):
        collector.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert collector.step() is False  # only once


# ---------------------------------------------------------------- copies, pickles, flags, paths
class Net(nn.Module):
    """BatchNorm between two layers (module level, so that pickle finds the class)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))

    def forward(self, x):
        return self.body(x)


def make_net():
    return Net()


def build_chain(kind):
    """A fresh chain: {model, optimizer, scheduler, collector, moments}, all seeded."""
    torch.manual_seed(0)
    if kind == "ensemble":
        model = ParallelEnsemble(make_net, 3, seed=0)
    elif kind == "subset":  # shared tensors are recorded repeated along K
        model = ParallelEnsemble(Net(), 3, subset=["body.2.weight", "body.2.bias"], seed=0)
    else:
        model = Net()
    source = dict(model.named_parameters()) if kind == "mapping" else model
    optimizer = SGLD(model.parameters(), lr=1e-2, num_data=100, seed=0)
    return {
        "model": model,
        "optimizer": optimizer,
        "scheduler": torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5),
        "collector": SampleCollector(source, 5, burn_in=3, thin=2),
        "moments": RunningMoments(source, burn_in=3, thin=2),
    }


def train_chain(chain, start, stop):
    """Steps start..stop-1, each on a batch that depends on the step only."""
    chain["model"].train()
    for step in range(start, stop):
        x = torch.randn(8, 3, generator=torch.Generator().manual_seed(step))
        chain["optimizer"].zero_grad()
        chain["model"](x).pow(2).mean().backward()
        chain["optimizer"].step()
        chain["scheduler"].step()
        chain["collector"].step()
        chain["moments"].step()


def assert_same_collection(got, want):
    assert got["collector"].count == want["collector"].count == 5
    assert got["collector"].steps == want["collector"].steps
    for name, samples in want["collector"].samples.items():
        assert torch.equal(got["collector"].samples[name], samples), name
    for name, mean in want["moments"].mean.items():
        assert torch.equal(got["moments"].mean[name], mean), name


SOURCES = ["module", "ensemble", "subset", "mapping"]


@pytest.mark.parametrize("kind", SOURCES)
def test_a_deep_copy_with_the_model_records_the_copied_model_and_continues_identically(kind):
    """The checkpoint-in-memory pattern: deepcopy of {model, optimizer, scheduler,
    collector} in one call. The copied collector reads the copied model (deepcopy's memo),
    so the copy, continued while the original stands still, collects exactly what an
    uninterrupted chain does; the original, continued afterwards, too."""
    uninterrupted = build_chain(kind)
    train_chain(uninterrupted, 0, 14)
    original = build_chain(kind)
    train_chain(original, 0, 6)  # 1 sample (step 5) so far
    copied = copy.deepcopy(original)
    assert copied["collector"].count == 1 and copied["collector"].steps == 6
    train_chain(copied, 6, 14)
    assert_same_collection(copied, uninterrupted)
    assert original["collector"].count == 1  # untouched by the copy
    train_chain(original, 6, 14)
    assert_same_collection(original, uninterrupted)
    # a collector deep-copied alone takes a copy of its source along, not the original
    alone = copy.deepcopy(original["collector"])
    state = {name: t.clone() for name, t in original["collector"]._read().items()}
    with torch.no_grad():
        for parameter in original["model"].parameters():
            parameter.add_(1.0)
    read = alone._read()
    assert all(torch.equal(read[name], t) for name, t in state.items())


@pytest.mark.parametrize("kind", SOURCES)
@pytest.mark.parametrize("how", ["pickle", "torch.save"])
def test_a_collector_in_memory_pickles_with_its_model_and_continues_identically(
    kind, how, tmp_path
):
    uninterrupted = build_chain(kind)
    train_chain(uninterrupted, 0, 14)
    chain = build_chain(kind)
    train_chain(chain, 0, 6)
    if how == "pickle":
        restored = pickle.loads(pickle.dumps(chain))
    else:
        torch.save(chain, tmp_path / "chain.pt")
        restored = torch.load(tmp_path / "chain.pt", weights_only=False)
    train_chain(restored, 6, 14)
    assert_same_collection(restored, uninterrupted)
    # alone, too: the collector and its (pickled along) source
    collector = pickle.loads(pickle.dumps(uninterrupted["collector"]))
    assert all(
        torch.equal(t, uninterrupted["collector"].samples[n]) for n, t in collector.samples.items()
    )


def test_a_collector_with_a_path_refuses_to_be_copied_or_pickled(tmp_path):
    """A copy would write into the same files as the original: a clear error, not the
    mmap module's, and nothing in the store changes. Loaded without a source (read-only),
    the samples copy and pickle as tensors."""
    chain = Counter()
    collector = SampleCollector(chain.state, 4, path=tmp_path / "store")
    run(collector, chain, 2)
    before = {p.name: p.read_bytes() for p in (tmp_path / "store").iterdir()}
    message = r"Cannot copy or pickle a SampleCollector with path=.*store': its samples are in"
    for attempt in (copy.deepcopy, pickle.dumps, lambda c: torch.save(c, io.BytesIO())):
        with pytest.raises(TypeError, match=message):
            attempt(collector)
    assert {p.name: p.read_bytes() for p in (tmp_path / "store").iterdir()} == before
    loaded = SampleCollector.load(tmp_path / "store")
    for restored in (copy.deepcopy(loaded), pickle.loads(pickle.dumps(loaded))):
        assert torch.equal(restored.samples["t"], collector.samples["t"])


NOT_BOOLS = ["no", "", 1, 0, None, 1.0, np.bool_(True), torch.tensor(True)]


@pytest.mark.parametrize("value", NOT_BOOLS, ids=repr)
def test_flags_must_be_bools_and_a_refused_call_changes_nothing(value, tmp_path):
    """``step(sampling="no")`` used to record the step (a truthy string); every flag of
    SampleCollector and RunningMoments is a real bool, as everywhere in the package."""
    shown = re.escape(repr(value))
    chain = Counter()
    collector = SampleCollector(chain.state, 3)
    run(collector, chain, 1)
    with pytest.raises(TypeError, match=rf"Invalid sampling: {shown} \(expected True or False\)"):
        collector.step(sampling=value)
    assert (collector.steps, collector.count) == (1, 1)  # not counted, not recorded
    assert collector.samples["t"].tolist() == [[1.0, 1.0]]
    assert collector.step(sampling=False) is False and collector.step(sampling=True) is True
    with pytest.raises(TypeError, match=rf"Invalid buffers: {shown} \(expected True or False\)"):
        SampleCollector(chain.state, 3, buffers=value, path=tmp_path / "never")
    with pytest.raises(TypeError, match=rf"Invalid buffers: {shown} \(expected True or False\)"):
        RunningMoments(chain.state, buffers=value)
    collector.save(tmp_path / "saved")
    with pytest.raises(TypeError, match=rf"Invalid mmap: {shown} \(expected True or False\)"):
        SampleCollector.load(tmp_path / "saved", mmap=value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["saved"]


class BytesPath:
    """An os.PathLike whose path is bytes (pathlib refuses it)."""

    def __fspath__(self):
        return b"samples"

    def __repr__(self):
        return "BytesPath()"


@pytest.mark.parametrize("value", [123, b"samples", 1.5, ["samples"], BytesPath(), ""], ids=repr)
def test_path_must_be_none_a_str_or_a_path_like_and_a_refused_call_writes_nothing(
    value, tmp_path, monkeypatch
):
    """``SampleCollector(path=123)`` used to raise pathlib's TypeError, which does not
    name ``path``; ``path=""`` wrote a store into the working directory."""
    monkeypatch.chdir(tmp_path)
    error = ValueError if value == "" else TypeError
    shown = re.escape(repr(value))
    state = {"x": torch.zeros(2)}
    expected = r"a str or an os.PathLike naming a directory"
    with pytest.raises(error, match=rf"Invalid path: {shown} \(expected None, {expected}"):
        SampleCollector(state, 2, path=value)
    collector = SampleCollector(state, 2)
    collector.record()
    with pytest.raises(error, match=rf"Invalid path: {shown} \(expected None, {expected}"):
        collector.save(value)
    with pytest.raises(error, match=rf"Invalid path: {shown} \(expected {expected}"):
        SampleCollector.load(value)
    assert list(tmp_path.iterdir()) == []  # nothing written anywhere
    assert collector.count == 1


def test_load_without_a_path_names_path():
    with pytest.raises(TypeError, match=r"Invalid path: None \(expected a str or an os.PathLike"):
        SampleCollector.load(None)
