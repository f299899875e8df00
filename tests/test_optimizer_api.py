"""Everything torch.optim.SGD supports works: groups, closures, schedulers, state_dict.

Crossed with the registry of samplers under test (STYLE: optax's _OPTIMIZERS_UNDER_TEST).
"""

import copy
import inspect
import io

import pytest
import torch
from samplers_under_test import SAMPLERS

from samplers_as_optim import SGHMC, SGLD, SGNHT
from samplers_as_optim.core.streams import NoiseStream, derive_seed, parameter_key
from samplers_as_optim.sgmcmc import sghmc_direction


def make_model(seed=0, device="cpu"):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)).to(
        device
    )


def batches(count, seed=123, device="cpu"):
    generator = torch.Generator().manual_seed(seed)
    for _ in range(count):
        x = torch.randn(32, 6, generator=generator)
        y = torch.randint(0, 3, (32,), generator=generator)
        yield x.to(device), y.to(device)


def train(model, opt, data, scheduler=None):
    for x, y in data:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()


def make_opt(case, model, **kwargs):
    return case.cls(model.parameters(), lr=0.01, num_data=1000, **{**case.kwargs, **kwargs})


# ---------------------------------------------------------------- exact resume
@pytest.mark.parametrize("case", SAMPLERS, ids=repr)
@pytest.mark.parametrize("seed", [7, None])
@pytest.mark.parametrize("foreach", [False, True])
def test_100_steps_equal_50_plus_save_load_into_fresh_objects_plus_50(case, seed, foreach, device):
    data = list(batches(100, device=device))
    torch.manual_seed(99)
    straight = make_model(device=device)
    opt = make_opt(case, straight, seed=seed, foreach=foreach)
    train(straight, opt, data)

    torch.manual_seed(99)  # the same global RNG: seed=None draws the same seed
    first = make_model(device=device)
    opt_first = make_opt(case, first, seed=seed, foreach=foreach)
    train(first, opt_first, data[:50])
    checkpoint = io.BytesIO()
    torch.save({"model": first.state_dict(), "opt": opt_first.state_dict()}, checkpoint)
    del first, opt_first

    torch.manual_seed(12345)  # a different global RNG state and a different initialisation
    resumed = make_model(seed=5, device=device)
    opt_resumed = make_opt(case, resumed, seed=None, foreach=foreach)
    checkpoint.seek(0)
    saved = torch.load(checkpoint, weights_only=True)
    resumed.load_state_dict(saved["model"])
    opt_resumed.load_state_dict(saved["opt"])
    assert opt_resumed.steps_taken == 50
    train(resumed, opt_resumed, data[50:])

    for a, b in zip(straight.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


def test_state_dict_holds_the_chains_random_state():
    model = make_model()
    opt = SGHMC(model.parameters(), lr=0.01, num_data=100, seed=42)
    train(model, opt, batches(3))
    groups = opt.state_dict()["param_groups"]
    assert [(group["seed"], group["step"]) for group in groups] == [(42, 3)]
    assert opt.seed == 42 and opt.steps_taken == 3


def test_an_sgd_checkpoint_loads_into_sghmc_keeping_num_data_and_temperature():
    model = make_model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    train(model, sgd, batches(5))
    sampler = SGHMC(
        model.parameters(), lr=0.01, momentum=0.9, num_data=500, temperature=0.0, seed=1
    )
    sampler.load_state_dict(copy.deepcopy(sgd.state_dict()))
    group = sampler.param_groups[0]
    assert group["lr"] == 0.05 and group["num_data"] == 500 and group["temperature"] == 0.0
    # at temperature 0 the migrated chain continues exactly as SGD would
    twin = copy.deepcopy(model)
    sgd_twin = torch.optim.SGD(twin.parameters(), lr=0.05, momentum=0.9)
    sgd_twin.load_state_dict(copy.deepcopy(sgd.state_dict()))
    train(model, sampler, batches(4, seed=9))
    train(twin, sgd_twin, batches(4, seed=9))
    assert all(
        torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters(), strict=True)
    )


def test_sgnht_thermostat_keeps_float32_for_bfloat16_parameters_across_load():
    model = make_model().to(torch.bfloat16)
    opt = SGNHT(model.parameters(), lr=0.01, num_data=100, seed=0)
    for x, y in batches(2):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x.to(torch.bfloat16)), y).backward()
        opt.step()
    fresh = SGNHT(model.parameters(), lr=0.01, num_data=100)
    fresh.load_state_dict(copy.deepcopy(opt.state_dict()))
    for p in model.parameters():
        assert fresh.state[p]["thermostat"].dtype == torch.float32
        assert torch.equal(fresh.state[p]["thermostat"], opt.state[p]["thermostat"])
        # at T > 0 a bfloat16 parameter's chain runs on a float32 master (_half_precision)
        assert fresh.state[p]["momentum_buffer"].dtype == torch.float32
        assert torch.equal(fresh.state[p]["master_param"], opt.state[p]["master_param"])


# ---------------------------------------------------------------- randomness
@pytest.mark.parametrize("case", SAMPLERS, ids=repr)
def test_same_seed_same_chain_different_seed_different_chain(case):
    runs = []
    for seed in (3, 3, 4):
        model = make_model()
        train(model, make_opt(case, model, seed=seed), batches(5))
        runs.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])


def test_seed_none_follows_torch_manual_seed_and_steps_leave_the_global_rng_alone():
    torch.manual_seed(0)
    first = SGHMC(make_model().parameters(), lr=0.01, num_data=10).seed
    torch.manual_seed(0)
    second = SGHMC(make_model().parameters(), lr=0.01, num_data=10).seed
    assert first == second
    model = make_model()
    opt = SGHMC(model.parameters(), lr=0.01, num_data=10, seed=5)
    data = list(batches(3))
    state = torch.get_rng_state()
    train(model, opt, data)
    assert torch.equal(state, torch.get_rng_state())


def test_noise_stream_is_a_pure_function_of_seed_step_and_key():
    like = [torch.empty(1000), torch.empty(3, 3, dtype=torch.float64)]
    keys = [parameter_key(0), parameter_key("layer.weight")]
    a = NoiseStream(11).standard_normal(like, keys, step=4)
    b = NoiseStream(11).standard_normal(like, keys, step=4)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert [t.dtype for t in a] == [torch.float32, torch.float64]
    others = [
        NoiseStream(11).draw(like[0], step=5, key=keys[0]),
        NoiseStream(11).draw(like[0], step=4, key=parameter_key(1)),
        NoiseStream(11).draw(like[0], step=4, key=parameter_key("0")),
        NoiseStream(12).draw(like[0], step=4, key=keys[0]),
        NoiseStream(11).draw(like[0], step=4, key=keys[0], shard=1),
    ]
    for other in others:  # independent draws: correlation within 4.5 standard errors of 0
        assert abs(torch.corrcoef(torch.stack([a[0], other]))[0, 1]) < 4.5 / 1000**0.5
    assert (
        len({derive_seed(1, s, g, d) for s in range(20) for g in range(3) for d in range(2)}) == 120
    )


def test_a_parameters_noise_does_not_depend_on_the_others_grads_or_groups():
    """Keyed by parameter: freezing one parameter or regrouping leaves the others' noise."""

    def noise_after_one_step(groups_of, frozen=()):
        model = make_model()
        layers = list(model.parameters())
        groups = [{"params": [layers[i] for i in group]} for group in groups_of]
        opt = SGLD(groups, lr=0.01, num_data=100, seed=3)
        for i, p in enumerate(layers):
            p.grad = None if i in frozen else torch.zeros_like(p)
        before = [p.detach().clone() for p in layers]
        opt.step()
        return [p.detach() - b for p, b in zip(layers, before, strict=True)]

    reference = noise_after_one_step([[0, 1, 2, 3]])
    frozen = noise_after_one_step([[0, 1, 2, 3]], frozen=(0,))
    regrouped = noise_after_one_step([[0, 1], [2, 3]])
    assert torch.equal(frozen[0], torch.zeros_like(frozen[0]))
    for i in (1, 2, 3):
        assert torch.equal(frozen[i], reference[i]) and torch.equal(regrouped[i], reference[i])


def test_named_parameters_key_the_noise_by_name():
    """Given names, a parameter's noise follows its name, not its position."""
    model = make_model()
    named = list(model.named_parameters())
    forward = SGLD(named, lr=0.01, num_data=100, seed=3)
    backward = SGLD(named[::-1], lr=0.01, num_data=100, seed=3)
    start = [p.detach().clone() for _, p in named]
    after = []
    for opt in (forward, backward):
        with torch.no_grad():
            for (_, p), value in zip(named, start, strict=True):
                p.copy_(value)
                p.grad = torch.zeros_like(p)
        opt.step()
        after.append([p.detach().clone() for _, p in named])
    assert all(torch.equal(a, b) for a, b in zip(*after, strict=True))


# ---------------------------------------------------------------- param groups
def test_each_param_group_uses_its_own_hyperparameters():
    model = make_model()
    groups = [
        {"params": model[0].parameters(), "lr": 0.02, "temperature": 0.5, "momentum": 0.5},
        {"params": model[2].parameters(), "lr": 0.005, "temperature": 2.0},
    ]
    opt = SGHMC(groups, lr=0.01, momentum=0.9, num_data=300, seed=8, foreach=False)
    x, y = next(batches(1))
    torch.nn.functional.cross_entropy(model(x), y).backward()
    expected = []
    for index, group in enumerate(opt.param_groups):
        params = list(group["params"])
        first = sum(len(g["params"]) for g in opt.param_groups[:index])
        keys = [parameter_key(first + i) for i in range(len(params))]
        noise = NoiseStream(8).standard_normal(params, keys, step=0)
        directions, _ = sghmc_direction(
            params,
            [p.grad for p in params],
            [None] * len(params),
            noise,
            lr=group["lr"],
            momentum=group["momentum"],
            temperature=group["temperature"],
            num_data=300,
            weight_decay=0.0,
            dampening=0.0,
            nesterov=False,
            maximize=False,
            foreach=False,
            inplace=False,
        )
        expected += [
            p.detach() + d.mul(-group["lr"]) for p, d in zip(params, directions, strict=True)
        ]
    opt.step()
    assert all(torch.equal(e, p) for e, p in zip(expected, model.parameters(), strict=True))


@pytest.mark.parametrize("case", SAMPLERS, ids=repr)
def test_parameters_without_gradient_are_skipped(case):
    model = make_model()
    model[2].bias.requires_grad_(False)
    frozen = model[2].bias.detach().clone()
    opt = make_opt(case, model, seed=0)
    train(model, opt, batches(3))
    assert torch.equal(model[2].bias, frozen)
    assert model[2].bias not in opt.state


@pytest.mark.parametrize("case", SAMPLERS, ids=repr)
def test_zero_learning_rate_at_positive_temperature_changes_nothing(case):
    model = make_model()
    opt = make_opt(case, model, seed=0)
    train(model, opt, batches(2))
    before = [p.detach().clone() for p in model.parameters()]
    state = copy.deepcopy(opt.state_dict()["state"])
    opt.param_groups[0]["lr"] = 0.0
    train(model, opt, batches(2, seed=4))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    after = opt.state_dict()["state"]
    for i in state:
        for k, value in state[i].items():  # buffers, and the lr recorded with a buffer
            assert (
                torch.equal(value, after[i][k]) if torch.is_tensor(value) else value == after[i][k]
            )
    assert opt.steps_taken == 4


# ---------------------------------------------------------------- closures, schedulers
@pytest.mark.parametrize("case", SAMPLERS, ids=repr)
def test_closure_is_evaluated_with_grad_enabled_and_its_loss_returned(case):
    model = make_model()
    opt = make_opt(case, model, seed=0)
    x, y = next(batches(1))

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss

    with torch.no_grad():
        loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor) and loss.requires_grad
    assert opt.steps_taken == 1


@pytest.mark.parametrize("case", SAMPLERS, ids=repr)
def test_lr_schedulers_move_the_step_size_and_the_noise_with_it(case):
    """A StepLR-driven run equals a run whose lr is set by hand to the same values."""
    data = list(batches(8))
    scheduled = make_model()
    opt = make_opt(case, scheduled, seed=2)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    train(scheduled, opt, data, scheduler)
    by_hand = make_model()
    opt_hand = make_opt(case, by_hand, seed=2)
    for step, (x, y) in enumerate(data):
        opt_hand.param_groups[0]["lr"] = 0.01 * 0.5 ** (step // 3)
        train(by_hand, opt_hand, [(x, y)])
    assert all(
        torch.equal(a, b) for a, b in zip(scheduled.parameters(), by_hand.parameters(), strict=True)
    )
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01 * 0.5 ** (8 // 3))


def test_cosine_schedule_down_to_zero_and_a_temperature_ramp():
    """Common recipes: cosine annealing to lr=0, and SGD warm-up before sampling."""
    model = make_model()
    opt = SGHMC(model.parameters(), lr=0.05, num_data=1000, temperature=0.0, seed=0)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=6, eta_min=0.0)
    twin = copy.deepcopy(model)
    sgd = torch.optim.SGD(twin.parameters(), lr=0.05, momentum=0.9)
    sgd_scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(sgd, T_max=6, eta_min=0.0)
    data = list(batches(6))
    train(model, opt, data, scheduler)
    train(twin, sgd, data, sgd_scheduler)
    assert all(
        torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters(), strict=True)
    )
    assert opt.param_groups[0]["lr"] == 0.0
    for group in opt.param_groups:  # now sample: the warm-up was plain SGD
        group["temperature"], group["lr"] = 1.0, 0.01
    train(model, opt, batches(2))
    train(twin, sgd, batches(2))
    assert not all(
        torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters(), strict=True)
    )


# ---------------------------------------------------------------- paths and devices
def run_dtype(case, dtype, device, foreach, temperature=None):
    model = make_model(device=device).to(dtype)
    kwargs = {} if temperature is None else {"temperature": temperature}
    opt = make_opt(case, model, seed=6, foreach=foreach, weight_decay=1e-3, **kwargs)
    for x, y in batches(5, device=device):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x.to(dtype)), y).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("case", SAMPLERS, ids=repr)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_foreach_equals_the_single_tensor_reference(case, dtype, device):
    single, multi = (run_dtype(case, dtype, device, foreach) for foreach in (False, True))
    assert all(torch.equal(a, b) for a, b in zip(single, multi, strict=True))


@pytest.mark.parametrize("foreach", [False, True])
def test_half_precision_follows_sgds_own_path(foreach, device):
    """In bfloat16 torch's foreach scalar multiply rounds unlike ``mul_`` (torch.optim.SGD's
    foreach and single paths differ too), so each of our paths equals SGD's same path."""
    case = SAMPLERS[1]
    ours = run_dtype(case, torch.bfloat16, device, foreach, temperature=0.0)
    model = make_model(device=device).to(torch.bfloat16)
    sgd = torch.optim.SGD(
        model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-3, foreach=foreach
    )
    for x, y in batches(5, device=device):
        sgd.zero_grad()
        torch.nn.functional.cross_entropy(model(x.to(torch.bfloat16)), y).backward()
        sgd.step()
    assert all(torch.equal(a, b) for a, b in zip(ours, model.parameters(), strict=True))


def test_maximize_samples_the_negated_objective():
    """maximize=True on -loss is the same chain as minimising loss."""
    runs = []
    for maximize in (False, True):
        model = make_model()
        opt = SGHMC(model.parameters(), lr=0.01, num_data=100, seed=1, maximize=maximize)
        for x, y in batches(4):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            (-loss if maximize else loss).backward()
            opt.step()
        runs.append([p.detach() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


def test_zero_grad_and_repr_work_as_for_sgd():
    model = make_model()
    opt = SGLD(model.parameters(), lr=0.01, num_data=10)
    train(model, opt, batches(1))
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    assert "temperature: 1.0" in repr(opt) and "num_data: 10" in repr(opt)


# ---------------------------------------------------------------- documentation
@pytest.mark.parametrize("case", SAMPLERS, ids=repr)
def test_every_argument_is_documented_and_the_example_names_the_class(case):
    """Docstrings that drift from signatures are caught (STYLE: Docstrings)."""
    doc = case.cls.__doc__
    for name in inspect.signature(case.cls.__init__).parameters:
        if name != "self":
            assert f"\n        {name}: " in doc, f"{case.cls.__name__}: {name} is not documented"
    assert f"from samplers_as_optim import {case.cls.__name__}" in doc
    assert ".. math::" in doc and "References:" in doc
