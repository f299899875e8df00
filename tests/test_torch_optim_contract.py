"""torch's generic optimizer contract, re-created for the samplers (at T = 0 and T = 1).

PyTorch validates every ``torch.optim`` optimizer with the same generic tests
(``test/test_optim.py``, ``TestOptimRenewed``). Two of them, run over the samplers with
``torch.optim.SGD``'s settings, found:

* ``test_foreach_matches_forloop``: a foreach and a for-loop optimizer take the same
  steps from the same start, and their per-parameter states are compared entry by entry
  through ``.detach()``, so every entry must be a tensor (torch keeps even its step
  counters as tensors); the samplers kept a Python float, ``"momentum_lr"``;
* ``test_state_dict_deterministic``: a state saved by an optimizer built from
  ``parameters()`` and loaded into one built from ``named_parameters()`` (or the
  reverse) must continue as the uninterrupted optimizer does; the samplers keyed the
  noise of the loaded one by name and of the saved one by position.

The state now carries the key each parameter's noise is drawn with (``"noise_key"``), and
the rate of a momentum buffer is a 0-d tensor. A checkpoint written before that (no keys,
a float rate) still loads and continues its chain: ``OLD_LAYOUT`` was written by the
package as it was then (``git archive`` of commit 421a211, and of 0d7f78a, which give the
same numbers, imported in a subprocess on torch 2.13's CPU build: each sampler, given
``[w, b]``, took 4 steps at ``lr`` 0.01 on the loss ``(w @ OLD_X + b[0]) ** 2`` and was
saved, where its parameters were ``"params"``; the uninterrupted run then took 4 more at
``lr`` 0.005, ending at ``"expected"``).
"""

import copy
import warnings

import pytest
import torch
from samplers_under_test import OTHER_SIGNATURES, SAMPLERS
from torch.nn import Parameter

from samplers_as_optim import name_parameters

CASES = SAMPLERS + OTHER_SIGNATURES
BY_NAME = {case.name: case for case in CASES}

#: ``torch.optim.SGD``'s settings from torch's OptimizerInfo that have a sampling meaning
#: (no nesterov or dampening, which need temperature 0); ``momentum`` comes with the case
CONFIGS = {
    "lr": {"lr": 0.2},
    "tensor_lr": {"lr": torch.tensor(0.001)},
    "decay_maximize": {"lr": 0.01, "weight_decay": 0.1, "maximize": True},
}


def sampler(case, params, temperature, **kwargs):
    options = {"num_data": 100, "temperature": temperature, **case.kwargs, **kwargs}
    if isinstance(options.get("lr"), torch.Tensor):
        options["lr"] = options["lr"].clone()  # a schedule may move a tensor lr in place
    return case.cls(params, **options)


def skip_unsupported(case, temperature):
    if temperature == 0 and case.cls.requires_positive_temperature:
        pytest.skip(f"{case.name} requires temperature > 0")


def without_param_names(state_dict):
    state_dict = copy.deepcopy(state_dict)
    for group in state_dict["param_groups"]:
        group.pop("param_names", None)
    return state_dict


def assert_identical(a, b, where="state_dict"):
    """Equal structure, equal values: tensors bit for bit (dtype included)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for key in a:
            assert_identical(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_identical(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


# ---------------------------------------------------------------- test_foreach_matches_forloop
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("case", CASES, ids=repr)
def test_every_state_entry_is_a_tensor_and_foreach_matches_the_for_loop(
    case, config, temperature, dtype
):
    """torch's ``_test_derived_optimizers`` and ``_compare_between``, flag ``foreach``."""
    skip_unsupported(case, temperature)
    models, optimizers = [], []
    for foreach in (False, True):
        input = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6], dtype=dtype).reshape(3, 2)
        torch.manual_seed(1)
        model = torch.nn.Sequential(
            torch.nn.Linear(2, 3), torch.nn.Sigmoid(), torch.nn.Linear(3, 1), torch.nn.Sigmoid()
        ).to(dtype)
        # a 0-dim last param (torch's is torch.empty, uninitialised: not compared there)
        scalar = torch.rand((), dtype=dtype, requires_grad=True)
        scalar.grad = torch.rand_like(scalar)
        params = [*model.parameters(), scalar]
        # seed=None: drawn from the global RNG, seeded alike for both
        optimizers.append(sampler(case, params, temperature, foreach=foreach, **CONFIGS[config]))
        models.append(model)
    for i in range(7):
        for model, optimizer in zip(models, optimizers, strict=True):
            optimizer.zero_grad()
            if i == 3:  # a frozen layer: its step in foreach must be the for-loop's
                model[2].requires_grad_(False)
            if i == 5:
                model[2].requires_grad_(True)
            if i != 2:  # a step with every gradient None is a no-op
                model(input).sum().backward()
            optimizer.step()
        reference, other = optimizers
        pairs = zip(
            reference.param_groups[0]["params"], other.param_groups[0]["params"], strict=True
        )
        for p_reference, p_other in pairs:
            torch.testing.assert_close(p_other, p_reference)
            ours, theirs = reference.state[p_reference], other.state[p_other]
            assert ours.keys() == theirs.keys()
            for key in ours:
                for value in (ours[key], theirs[key]):
                    assert isinstance(value, torch.Tensor), (
                        f"state[{key!r}] is a {type(value).__name__}, not a tensor"
                    )
                torch.testing.assert_close(theirs[key].detach(), ours[key].detach())
                with torch.no_grad():  # as torch's TensorTracker: continue from one state
                    theirs[key].copy_(ours[key])
            with torch.no_grad():
                p_other.copy_(p_reference)


# ---------------------------------------------------------------- test_state_dict_deterministic
def named(params, naming):
    """Hand ``params`` as ``parameters()`` (None) or ``named_parameters()`` would."""
    if naming is None:
        return list(params)
    return [(f"{naming}{i}", p) for i, p in enumerate(params)]


NAMINGS = {
    "unnamed_to_unnamed": (None, None),
    "unnamed_to_named": (None, "name"),
    "named_to_unnamed": ("name", None),
    "named_to_renamed": ("name", "other"),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("naming", NAMINGS, ids=str)
@pytest.mark.parametrize("case", CASES, ids=repr)
def test_a_loaded_state_continues_the_same_chain_whatever_the_naming(
    case, naming, temperature, dtype
):
    """torch's ``test_state_dict_deterministic`` with a named and an unnamed optimizer.

    Bit for bit: the loaded optimizer draws the noise of the uninterrupted one, whether
    the new one is given names or not (a renamed optimizer takes the saved names, as
    ``torch.optim.Optimizer.load_state_dict`` does, and the saved keys).
    """
    skip_unsupported(case, temperature)
    saved_naming, loaded_naming = NAMINGS[naming]
    torch.manual_seed(0)
    weight = Parameter(torch.randn(2, 3, dtype=dtype))
    bias = Parameter(torch.randn(2, dtype=dtype))
    input = torch.randn(3, dtype=dtype)

    def closure(optimizer, w, b):
        optimizer.zero_grad()
        loss = (w.mv(input) + b).pow(2).sum()
        loss.backward()
        return loss

    optimizer = sampler(case, named([weight, bias], saved_naming), temperature, lr=1e-3)
    for _ in range(10):
        optimizer.step(lambda: closure(optimizer, weight, bias))
    with torch.no_grad():
        weight_c, bias_c = Parameter(weight.clone()), Parameter(bias.clone())
    optimizer_c = sampler(case, named([weight_c, bias_c], loaded_naming), temperature, lr=1e-3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimizer_c.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    # silent once the chain has drawn noise, whose keys the state then holds; at T = 0
    # nothing is stored (the state stays SGD's) and a change of naming is announced
    expected = (
        ["noise is now keyed by name"] if naming == "unnamed_to_named" and not temperature else []
    )
    assert [w for w in expected if any(w in str(c.message) for c in caught)] == expected
    assert len(caught) == len(expected), [str(c.message) for c in caught]
    for _ in range(10):
        optimizer.step(lambda: closure(optimizer, weight, bias))
        optimizer_c.step(lambda: closure(optimizer_c, weight_c, bias_c))
        assert torch.equal(weight, weight_c)
        assert torch.equal(bias, bias_c)
    assert_identical(
        without_param_names(optimizer.state_dict()), without_param_names(optimizer_c.state_dict())
    )
    optimizer_c.param_groups.extend(optimizer_c.param_groups)
    assert_identical(
        without_param_names(optimizer.state_dict())["param_groups"][-1],
        without_param_names(optimizer_c.state_dict())["param_groups"][-1],
    )


def layered_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))


def batches(count, seed=5):
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(8, 3, generator=generator), torch.randint(0, 2, (8,), generator=generator))
        for _ in range(count)
    ]


def train(model, optimizer, data):
    for x, y in data:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()


def same_parameters(a, b):
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


@pytest.mark.parametrize("case", CASES, ids=repr)
def test_a_loaded_state_continues_the_same_chain_when_the_tensors_carry_names(case):
    """Loaded where ``name_parameters`` marked the tensors (ZeRO's way to give names)."""
    data = batches(8)
    model = layered_model()
    optimizer = sampler(case, model.parameters(), 1.0, lr=0.01, seed=3)
    train(model, optimizer, data[:4])
    twin = name_parameters(copy.deepcopy(model))
    resumed = sampler(case, twin.parameters(), 1.0, lr=0.01, seed=4)
    resumed.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    train(model, optimizer, data[4:])
    train(twin, resumed, data[4:])
    assert same_parameters(model, twin)


def two_groups(model, naming):
    """The model's layers as two param groups (the second with its own lr)."""
    first, second = model[0], model[2]
    if naming is None:
        return [
            {"params": list(first.parameters())},
            {"params": list(second.parameters()), "lr": 0.02},
        ]
    return [
        {"params": list(first.named_parameters(prefix="0"))},
        {"params": list(second.named_parameters(prefix="2")), "lr": 0.02},
    ]


@pytest.mark.parametrize("direction", ["unnamed_to_named", "named_to_unnamed"])
@pytest.mark.parametrize("case", CASES, ids=repr)
def test_param_groups_keep_their_noise_across_a_change_of_naming(case, direction):
    saved_naming, loaded_naming = NAMINGS[direction]
    data = batches(10)
    model = layered_model()
    optimizer = sampler(case, two_groups(model, saved_naming), 1.0, lr=0.01, seed=3)
    train(model, optimizer, data[:5])
    twin = copy.deepcopy(model)
    resumed = sampler(case, two_groups(twin, loaded_naming), 1.0, lr=0.01, seed=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resumed.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    train(model, optimizer, data[5:])
    train(twin, resumed, data[5:])
    assert same_parameters(model, twin)


@pytest.mark.parametrize("direction", ["unnamed_to_named", "named_to_unnamed"])
@pytest.mark.parametrize("case", CASES, ids=repr)
def test_a_frozen_parameter_has_no_state_and_a_change_of_its_key_is_announced(case, direction):
    """As in torch.optim, a parameter without a gradient has no state: no key either.

    Loaded by name where it was saved by position, such a parameter (and only it) is
    keyed anew, which the load announces; the others continue their chain exactly.
    By position where it was saved by name, the names come with the state (torch's
    ``load_state_dict``): exact, frozen parameter included.
    """
    saved_naming, loaded_naming = NAMINGS[direction]
    data = batches(10)
    model = layered_model()
    model[2].bias.requires_grad_(False)
    optimizer = sampler(case, two_groups(model, saved_naming), 1.0, lr=0.01, seed=3)
    train(model, optimizer, data[:4])
    assert model[2].bias not in optimizer.state
    twin = copy.deepcopy(model)
    resumed = sampler(case, two_groups(twin, loaded_naming), 1.0, lr=0.01, seed=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    messages = [str(warning.message) for warning in caught]
    if direction == "unnamed_to_named":
        assert len(messages) == 1
        assert "keyed by name, not by position, for the 1 parameter(s)" in messages[0]
    else:
        assert messages == []
    train(model, optimizer, data[4:7])
    train(twin, resumed, data[4:7])
    assert same_parameters(model, twin)
    for net in (model, twin):
        net[2].bias.requires_grad_(True)
    train(model, optimizer, data[7:])
    train(twin, resumed, data[7:])
    assert same_parameters(model, twin) == (direction == "named_to_unnamed")


# ---------------------------------------------------------------- checkpoints of the old layout
OLD_LAYOUT = {
    "sgld": {
        "group": {
            "lr": 0.01,
            "num_data": 50,
            "temperature": 1.0,
            "weight_decay": 0.0,
            "dampening": 0.0,
            "nesterov": False,
            "maximize": False,
            "foreach": None,
            "seed": 7,
            "step": 4,
            "params": [0, 1],
        },
        "state": {},
        "params": [[0.19455720958405343, -0.5139227506212797], [-0.009906771103601424]],
        "expected": [[0.16841783740805308, -0.4325010106676178], [-0.06931301790170499]],
    },
    "sghmc": {
        "group": {
            "lr": 0.01,
            "momentum": 0.9,
            "num_data": 50,
            "temperature": 1.0,
            "weight_decay": 0.0,
            "dampening": 0.0,
            "nesterov": False,
            "maximize": False,
            "foreach": None,
            "seed": 7,
            "step": 4,
            "params": [0, 1],
        },
        "state": {
            0: {"momentum_lr": 0.01, "momentum_buffer": [2.276084617136987, -10.001952000815292]},
            1: {"momentum_lr": 0.01, "momentum_buffer": [6.934607392986467]},
        },
        "params": [[0.2497795413205005, -0.42308124450930606], [-0.10534451722904492]],
        "expected": [[0.19098790625243842, -0.1585798725408423], [-0.28799195648056364]],
    },
    "sgnht": {
        "group": {
            "lr": 0.01,
            "momentum": 0.9,
            "num_data": 50,
            "temperature": 1.0,
            "weight_decay": 0.0,
            "dampening": 0.0,
            "nesterov": False,
            "maximize": False,
            "foreach": None,
            "kinetic_energy": "symmetric",
            "seed": 7,
            "step": 4,
            "params": [0, 1],
        },
        "state": {
            0: {
                "momentum_buffer": [2.269852844127917, -9.970721348729658],
                "thermostat": 0.10731353158336296,
                "momentum_lr": 0.01,
            },
            1: {
                "momentum_buffer": [6.906599281786995],
                "thermostat": 0.10793218210796365,
                "momentum_lr": 0.01,
            },
        },
        "params": [[0.249854618882471, -0.42345131815561454], [-0.10501344746987142]],
        "expected": [[0.19234632259385365, -0.16530222233308162], [-0.2828607770404435]],
    },
    "baoa": {
        "group": {
            "lr": 0.01,
            "momentum": 0.9,
            "num_data": 50,
            "temperature": 1.0,
            "weight_decay": 0.0,
            "dampening": 0.0,
            "nesterov": False,
            "maximize": False,
            "foreach": None,
            "seed": 7,
            "step": 4,
            "params": [0, 1],
        },
        "state": {
            0: {"momentum_buffer": [1.9405353992901424, -8.914944515344907], "momentum_lr": 0.01},
            1: {"momentum_buffer": [6.203184275799884], "momentum_lr": 0.01},
        },
        "params": [[0.24627485290603993, -0.4312307791019866], [-0.09808710819816857]],
        "expected": [[0.19113424490477043, -0.17462763120173924], [-0.2765286509535607]],
    },
    "psgld": {
        "group": {
            "lr": 0.01,
            "alpha": 0.99,
            "eps": 1e-08,
            "weight_decay": 0.0,
            "momentum": 0.0,
            "centered": False,
            "capturable": False,
            "foreach": None,
            "maximize": False,
            "num_data": 50,
            "temperature": 1.0,
            "correction": False,
            "seed": 7,
            "step": 4,
            "params": [0, 1],
        },
        "state": {
            0: {"square_avg": [0.04400613746995786, 0.39605523722962077]},
            1: {"square_avg": [0.17602454987983143]},
        },
        "params": [[0.2051515042258644, -0.5191733206614835], [-0.12360772668201632]],
        "expected": [[0.16653527377779864, -0.49832811431083884], [-0.1448094253557131]],
    },
    "sghmc_named": {
        "group": {
            "param_names": ["weight", "bias"],
            "lr": 0.01,
            "momentum": 0.9,
            "num_data": 50,
            "temperature": 1.0,
            "weight_decay": 0.0,
            "dampening": 0.0,
            "nesterov": False,
            "maximize": False,
            "foreach": None,
            "seed": 7,
            "step": 4,
            "params": [0, 1],
        },
        "state": {
            0: {"momentum_lr": 0.01, "momentum_buffer": [3.456946443414152, -13.002955345217893]},
            1: {"momentum_lr": 0.01, "momentum_buffer": [7.258297554927832]},
        },
        "params": [[0.20063460404838365, -0.34547728126948984], [-0.09817820591590262]],
        "expected": [[0.12885143414468117, -0.04239591928493665], [-0.2950183532383914]],
    },
}
OLD_X = torch.tensor([0.5, -1.5], dtype=torch.float64)


def old_checkpoint(name):
    """The state_dict as the old package wrote it (a float rate, no noise keys)."""
    entry = OLD_LAYOUT[name]
    state = {
        index: {
            key: value if key == "momentum_lr" else torch.tensor(value, dtype=torch.float64)
            for key, value in entries.items()
        }
        for index, entries in entry["state"].items()
    }
    return {"state": state, "param_groups": [copy.deepcopy(entry["group"])]}


def old_setup(name, naming):
    """Parameters where the old run saved, and a sampler over them (another seed)."""
    entry = OLD_LAYOUT[name]
    w, b = (Parameter(torch.tensor(v, dtype=torch.float64)) for v in entry["params"])
    case = BY_NAME[name.removesuffix("_named")]
    params = [w, b] if naming is None else [(f"{naming}.weight", w), (f"{naming}.bias", b)]
    # PSGLD's old chain is Li et al.'s (a moving elementwise preconditioner, 0.1's default)
    old = {"preconditioner": "elementwise", "preconditioner_warmup": None}
    extra = old if case.name == "psgld" else {}
    optimizer = case.cls(params, lr=0.01, num_data=50, seed=123, **case.kwargs, **extra)
    return w, b, optimizer


def old_step(w, b, optimizer):
    optimizer.zero_grad()
    ((w @ OLD_X + b[0]) ** 2).backward()
    optimizer.step()


@pytest.mark.parametrize("name", list(OLD_LAYOUT))
def test_an_old_layout_checkpoint_migrates_and_continues_the_old_chain(name):
    w, b, optimizer = old_setup(name, None)
    optimizer.load_state_dict(old_checkpoint(name))
    for state in optimizer.state.values():  # migrated on load: a tensor rate, on the host
        assert all(isinstance(value, torch.Tensor) for value in state.values())
        if "momentum_lr" in state:
            assert state["momentum_lr"].dtype == torch.float64
            assert state["momentum_lr"].device.type == "cpu"
            assert float(state["momentum_lr"]) == 0.01
    for group in optimizer.param_groups:
        group["lr"] = 0.005  # the old run's schedule: the rate recorded matters
    old_step(w, b, optimizer)
    old_step(w, b, optimizer)
    # from its first step on, the chain records its keys: a named optimizer continues it
    assert all("noise_key" in optimizer.state[p] for p in (w, b))
    w_named, b_named, named_optimizer = old_setup(name, "other")
    with torch.no_grad():
        w_named.copy_(w)
        b_named.copy_(b)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        named_optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    for params in ((w, b, optimizer), (w_named, b_named, named_optimizer)):
        old_step(*params)
        old_step(*params)
    expected = [torch.tensor(v, dtype=torch.float64) for v in OLD_LAYOUT[name]["expected"]]
    for params in ((w, b), (w_named, b_named)):
        assert all(torch.equal(p, e) for p, e in zip(params, expected, strict=True))


def test_an_old_layout_checkpoint_loaded_by_name_warns_that_the_noise_changes():
    """Without saved keys, today's behaviour: keyed by the new names, and a warning."""
    w, b, optimizer = old_setup("sghmc", "layer")
    with pytest.warns(UserWarning, match=r"the noise is now keyed by name, not by position"):
        optimizer.load_state_dict(old_checkpoint("sghmc"))
    optimizer.param_groups[0]["lr"] = 0.005
    for _ in range(4):
        old_step(w, b, optimizer)
    expected = [torch.tensor(v, dtype=torch.float64) for v in OLD_LAYOUT["sghmc"]["expected"]]
    assert not any(torch.equal(p, e) for p, e in zip((w, b), expected, strict=True))


# ---------------------------------------------------------------- the stored keys themselves
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64], ids=str)
def test_the_stored_keys_and_rates_keep_their_dtype_and_stay_on_the_host(dtype):
    """torch's load casts per-parameter state to the parameter's dtype; not these."""
    model = layered_model().to(dtype)
    optimizer = sampler(BY_NAME["sghmc"], model.parameters(), 1.0, lr=0.01, seed=2)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    saved = copy.deepcopy(optimizer.state_dict())
    resumed = sampler(BY_NAME["sghmc"], model.parameters(), 1.0, lr=0.01, seed=5)
    resumed.load_state_dict(saved)
    for index, p in enumerate(model.parameters()):
        state = resumed.state[p]
        assert state["noise_key"].dtype == torch.int64
        assert torch.equal(state["noise_key"], saved["state"][index]["noise_key"])
        assert state["momentum_lr"].dtype == torch.float64
        # a half-precision parameter's chain runs on a float32 master at T > 0
        half = dtype in (torch.float16, torch.bfloat16)
        assert state["momentum_buffer"].dtype == (torch.float32 if half else dtype)


@pytest.mark.parametrize(
    "bad", [torch.tensor(3.0), torch.tensor([1, 2]), 7, torch.tensor(1, dtype=torch.int32)]
)
def test_an_invalid_stored_key_is_refused_before_anything_changes(bad):
    model = layered_model()
    optimizer = sampler(BY_NAME["sghmc"], model.parameters(), 1.0, lr=0.01, seed=2)
    train(model, optimizer, batches(2))
    state = copy.deepcopy(optimizer.state_dict())
    state["state"][0]["noise_key"] = bad
    before = copy.deepcopy(optimizer.state_dict())
    with pytest.raises(ValueError, match=r"Invalid state_dict: 'noise_key' of parameter 0 is "):
        optimizer.load_state_dict(state)
    assert_identical(optimizer.state_dict(), before)


@pytest.mark.parametrize("case", CASES, ids=repr)
def test_loading_a_state_keeps_the_optimizers_own_options(case):
    """torch's load_state_dict installs the state through ``__setstate__``: not a reset."""
    model = layered_model()
    optimizer = sampler(case, model.parameters(), 1.0, lr=0.01, seed=2)
    train(model, optimizer, batches(2))
    resumed = sampler(
        case, model.parameters(), 1.0, lr=0.01, seed=2, nonfinite="skip", overlap_noise=False
    )
    resumed.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    assert (resumed._nonfinite, resumed._overlap_noise) == ("skip", False)
    for p in model.parameters():
        p.grad = torch.full_like(p, float("nan"))
    before = [p.detach().clone() for p in model.parameters()]
    resumed.step()  # skipped, not refused
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
