"""AdamWSGHMC: AdamW at temperature 0 bit for bit, the exact law with a frozen preconditioner,
the family's generic properties (resume, seeds, groups, transforms, errors).
"""

from __future__ import annotations

import copy
import math
import re

import pytest
import test_chain_state as chain_tests
import test_optimizer_api as api_tests
import test_overlap_noise as overlap_tests
import test_transforms as transform_tests
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from samplers_under_test import OTHER_SIGNATURES

from samplers_as_optim import SGHMC, AdamWSGHMC, transforms
from samplers_as_optim.sgmcmc.sampling_preconditioner import pooled_second_moment

CASE = OTHER_SIGNATURES[1]
assert CASE.name == "adamw_sghmc"
SHAPES = st.lists(
    st.lists(st.integers(1, 4), min_size=0, max_size=3).map(tuple), min_size=1, max_size=3
)


# ---------------------------------------------------------------- temperature 0: AdamW
@st.composite
def adamw_setups(draw):
    return {
        "shapes": draw(SHAPES),
        "dtype": draw(st.sampled_from([torch.float32, torch.float64])),
        "lr": draw(st.floats(1e-4, 0.5)),
        "betas": (draw(st.floats(0.0, 0.99)), draw(st.floats(0.0, 0.9999))),
        "eps": draw(st.sampled_from([1e-8, 1e-6, 1e-3])),
        "weight_decay": draw(st.one_of(st.just(0.0), st.floats(0.0, 0.5))),
        "amsgrad": draw(st.booleans()),
        "maximize": draw(st.booleans()),
        "foreach": draw(st.booleans()),
        "two_groups": draw(st.booleans()),
        "steps": draw(st.integers(1, 8)),
        "seed": draw(st.integers(0, 2**16)),
    }


def _groups(params, setup):
    hyper = {k: setup[k] for k in ("lr", "betas", "eps", "weight_decay", "amsgrad")}
    if setup["two_groups"] and len(params) > 1:
        return [{"params": params[:1]}, {"params": params[1:], "lr": hyper["lr"] / 3}], hyper
    return [{"params": params}], hyper


@settings(max_examples=30, deadline=None)
@given(adamw_setups())
def test_temperature_zero_is_torch_optim_adamw_bit_for_bit(setup):
    """Every AdamW argument, groups, dtypes, both paths: ``torch.equal`` at every step."""
    generator = torch.Generator().manual_seed(setup["seed"])
    init = [torch.randn(s, generator=generator, dtype=setup["dtype"]) for s in setup["shapes"]]
    ours = [torch.nn.Parameter(t.clone()) for t in init]
    theirs = [torch.nn.Parameter(t.clone()) for t in init]
    groups, hyper = _groups(ours, setup)
    flags = {"maximize": setup["maximize"], "foreach": setup["foreach"]}
    sampler = AdamWSGHMC(groups, **hyper, **flags, num_data=10, temperature=0.0, seed=0)
    groups, _ = _groups(theirs, setup)
    reference = torch.optim.AdamW(groups, **hyper, **flags)
    for _ in range(setup["steps"]):
        for params in (ours, theirs):
            for i, p in enumerate(params):
                p.grad = torch.sin(p.detach() * (i + 2)) + 0.1
        sampler.step()
        reference.step()
        for a, b in zip(ours, theirs, strict=True):
            assert torch.equal(a, b)
    for a, b in zip(ours, theirs, strict=True):
        for key, value in reference.state[b].items():
            assert torch.equal(sampler.state[a][key], value), key


def _model_and_batches(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    batches = [(torch.randn(16, 4), torch.randn(16, 1)) for _ in range(12)]
    return model, batches


def _train(model, opt, batches):
    for x, y in batches:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def test_an_adamw_checkpoint_loads_and_continues_as_adamw_at_temperature_zero():
    model, batches = _model_and_batches()
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    _train(model, adamw, batches[:6])
    twin_model = copy.deepcopy(model)
    twin = AdamWSGHMC(twin_model.parameters(), lr=1e-2, num_data=100, temperature=0.0, seed=0)
    twin.load_state_dict(copy.deepcopy(adamw.state_dict()))  # (torch shares the tensors)
    assert twin.param_groups[0]["weight_decay"] == 0.05
    _train(model, adamw, batches[6:])
    _train(twin_model, twin, batches[6:])
    for a, b in zip(model.parameters(), twin_model.parameters(), strict=True):
        assert torch.equal(a, b)
    # and the twin's checkpoint loads into AdamW, which continues
    again = torch.optim.AdamW(model.parameters(), lr=1e-2)
    again.load_state_dict(copy.deepcopy(twin.state_dict()))
    assert torch.equal(again.state[next(model.parameters())]["step"], torch.tensor(12.0))


def test_the_transform_at_temperature_zero_is_adamw_up_to_rounding():
    model, batches = _model_and_batches()
    reference = copy.deepcopy(model)
    adamw = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.05)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    tx = transforms.adamw_sghmc(1e-2, weight_decay=0.05, num_data=10, temperature=0.0, seed=0)
    state = tx.init(params)

    def loss(p, x, y):
        return torch.nn.functional.mse_loss(torch.func.functional_call(model, p, x), y)

    for x, y in batches:
        grads = torch.func.grad(loss)(params, x, y)
        updates, state = tx.update(grads, state, params=params, inplace=False)
        params = {k: params[k] + updates[k] for k in params}
        _train(reference, adamw, [(x, y)])
    for name, value in reference.named_parameters():
        torch.testing.assert_close(params[name], value.detach(), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- the law
SIGMA = torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64)


def _overdispersed():
    generator = torch.Generator().manual_seed(1)
    return 3 * torch.randn(4000, 3, generator=generator, dtype=torch.float64) * SIGMA


def _gaussian_chain(steps, *, temperature=1.0, lr=0.01, num_data=100, start=None, **kwargs):
    """4,000 independent chains per coordinate of N(0, T diag(SIGMA^2)), as one tensor."""
    generator = torch.Generator().manual_seed(0)
    if start is None:
        start = torch.randn(4000, 3, generator=generator, dtype=torch.float64) * SIGMA
    theta = start.clone().requires_grad_()
    opt = AdamWSGHMC([theta], lr=lr, num_data=num_data, temperature=temperature, seed=3, **kwargs)
    for _ in range(steps):
        theta.grad = theta.detach() / (num_data * SIGMA**2)
        opt.step()
    return theta.detach(), opt


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_the_frozen_chain_samples_the_gaussian_and_its_covariance_scales_with_t(temperature):
    """Started over-dispersed (sd 3 times the target's), frozen after 200 steps, 3,000 steps.

    The relaxation time of a coordinate is about sigma / lr = 200 steps at most (Adam's
    preconditioner makes it lr / sigma per step), so the chains have forgotten the start
    15 times over. With 4,000 chains the variance ratio has Monte Carlo sd sqrt(2/4000) =
    0.022; the tolerance is 5 sd, 0.11, and covers the step-size bias (lr G H < 0.01).
    """
    theta, opt = _gaussian_chain(
        3000, temperature=temperature, start=_overdispersed(),
        weight_decay=0.0, preconditioner_warmup=200,
    )  # fmt: skip
    ratio = theta.var(0) / (temperature * SIGMA**2)
    assert torch.allclose(ratio, torch.ones(3, dtype=torch.float64), atol=0.11), ratio
    assert theta.mean(0).abs().max() < 5 * (temperature * SIGMA**2 / 4000).sqrt().max()
    assert float(opt.state[opt.param_groups[0]["params"][0]]["preconditioner_step"]) == 200


def test_the_weight_decay_is_the_prior_of_precision_n_lambda_a():
    """With a frozen a, the target's variance is T / (1 / sigma^2 + N lambda a)."""
    lam = 0.2  # (its bias, 1 / (1 + lr lam / (1 - beta1)) = 0.98, is inside the tolerance)
    theta, opt = _gaussian_chain(
        3000, start=_overdispersed(), weight_decay=lam,
        preconditioner_warmup=200,
    )  # fmt: skip
    a = opt.state[opt.param_groups[0]["params"][0]]["preconditioner"].expand(4000, 3)
    # each element's law is N(0, 1 / (1/sigma^2 + N lambda a)); a column mixes its rows'
    expected = (1 / (1 / SIGMA**2 + 100 * lam * a)).mean(0)
    ratio = theta.var(0) / expected
    assert (expected / SIGMA**2).min() < 0.8  # the prior matters here
    assert torch.allclose(ratio, torch.ones(3, dtype=torch.float64), atol=0.11), ratio


def test_the_defaults_sample_the_issues_gaussian_within_15_percent():
    """N(0, diag(0.1^2, 1, 10^2)), lr 1e-3, N = 1000, started at the target, 6,000 steps.

    Full variances (not interquartile ranges). The slowest coordinate relaxes in about
    sigma / lr = 10^4 steps: what this checks is that the chain does not move the law away.
    """
    sigma = torch.tensor([0.1, 1.0, 10.0])
    torch.manual_seed(0)
    theta = (torch.randn(4000, 3) * sigma).requires_grad_()
    opt = AdamWSGHMC([theta], num_data=1000, seed=1)
    for _ in range(6000):
        theta.grad = theta.detach() / (1000 * sigma**2)
        opt.step()
    ratio = theta.detach().var(0) / sigma**2
    assert ((ratio - 1).abs() < 0.15).all(), ratio


def test_an_elementwise_moving_preconditioner_is_measurably_biased():
    """What pooling and freezing buy: AdamW's own elementwise, moving scale is off by > 25%."""
    sigma = torch.tensor([0.1, 1.0, 10.0])
    torch.manual_seed(0)
    theta = (torch.randn(4000, 3) * sigma).requires_grad_()
    opt = AdamWSGHMC(
        [theta], num_data=1000, seed=1, preconditioner="elementwise", preconditioner_warmup=None
    )
    for _ in range(6000):
        theta.grad = theta.detach() / (1000 * sigma**2)
        opt.step()
    ratio = theta.detach().var(0) / sigma**2
    assert ratio[1:].min() > 1.25, ratio


def test_an_ill_conditioned_gaussian_mixes_far_faster_than_under_sghmc():
    """sd 0.01 and 1 side by side: SGHMC's lr is bounded by the stiff coordinate, so its
    slow coordinate moves 100 times slower; the twin's preconditioner equalises them.

    Both start over-dispersed (3 sd) with the same number of steps and a stable lr each (SGHMC: lr N H =
    0.1 on the stiff coordinate); after 2,000 steps the twin's slow coordinate has its
    variance (within 0.11, 5 Monte Carlo sd), SGHMC's is still near its start's, 9.
    """
    sigma = torch.tensor([0.01, 1.0], dtype=torch.float64)
    num_data, steps = 100, 2000

    def run(cls, **kwargs):
        generator = torch.Generator().manual_seed(1)
        start = torch.randn(4000, 2, generator=generator, dtype=torch.float64) * 3 * sigma
        theta = start.requires_grad_()
        opt = cls([theta], num_data=num_data, seed=0, **kwargs)
        for _ in range(steps):
            theta.grad = theta.detach() / (num_data * sigma**2)
            opt.step()
        return (theta.detach().var(0) / sigma**2).tolist()

    twin = run(AdamWSGHMC, lr=0.01, weight_decay=0.0, preconditioner_warmup=100)
    sghmc = run(SGHMC, lr=0.1 * sigma[0].item() ** 2, momentum=0.9)
    assert abs(twin[1] - 1) < 0.11 and abs(twin[0] - 1) < 0.11, twin
    assert sghmc[1] > 5, sghmc  # (it started at 9)


# ---------------------------------------------------------------- the preconditioner's life
def test_the_preconditioner_freezes_after_the_warmup_and_a_step_at_zero_releases_it():
    param = torch.nn.Parameter(torch.randn(6, 5))
    opt = AdamWSGHMC([param], num_data=10, seed=0, preconditioner_warmup=3)
    state = opt.state[param]
    for step in range(1, 6):
        param.grad = torch.randn(6, 5)
        opt.step()
        assert float(state["preconditioner_step"]) == (0 if step < 3 else 3)
        assert ("preconditioner" in state) == (step >= 3)
    frozen = state["preconditioner"].clone()
    expected = (pooled_second_moment(state["exp_avg_sq"], "factored") / 1).shape
    assert frozen.shape == expected
    opt.param_groups[0]["temperature"] = 0.0
    param.grad = torch.randn(6, 5)
    opt.step()
    assert float(state["preconditioner_step"]) == 0  # released by AdamW's step
    opt.param_groups[0]["temperature"] = 1.0
    param.grad = torch.randn(6, 5)
    opt.step()
    assert float(state["preconditioner_step"]) == 7  # frozen again, from the latest V
    assert not torch.equal(state["preconditioner"], frozen)


def test_the_factored_second_moment_is_adafactors_rank_one_estimate():
    square = torch.rand(5, 7, dtype=torch.float64)
    pooled = pooled_second_moment(square, "factored")
    rows, columns = square.mean(1, keepdim=True), square.mean(0, keepdim=True)
    torch.testing.assert_close(pooled, rows * columns / square.mean())
    assert torch.equal(pooled_second_moment(square, "elementwise"), square)
    vector = torch.rand(9)
    assert pooled_second_moment(vector, "factored").shape == (1,)
    conv = torch.rand(8, 3, 2, 6)  # the two largest dimensions: 0 and 3
    assert pooled_second_moment(conv, "factored").shape == (8, 1, 1, 6)
    assert torch.equal(pooled_second_moment(torch.zeros(3, 4), "factored"), torch.zeros(3, 4))


def test_a_change_of_lr_rescales_the_momentum_at_positive_temperature():
    """m <- m sqrt(lr_old / lr_new) first (the physical momentum is kept), then the step."""
    param = torch.nn.Parameter(torch.randn(4, 3))
    opt = AdamWSGHMC([param], lr=1e-2, num_data=10, seed=0)
    param.grad = torch.randn(4, 3)
    opt.step()
    moved = copy.deepcopy((param, opt))
    by_hand = copy.deepcopy((param, opt))
    moved[1].param_groups[0]["lr"] = 4e-2
    state = by_hand[1].state[by_hand[0]]
    state["exp_avg"].mul_(0.5)
    state["momentum_lr"] = torch.tensor(4e-2, dtype=torch.float64)
    by_hand[1].param_groups[0]["lr"] = 4e-2
    by_hand[1]._reset_runtime(seed_given=True)
    for p, o in (moved, by_hand):
        p.grad = torch.ones(4, 3)
        o.step()
    assert torch.equal(moved[0], by_hand[0])
    assert torch.equal(moved[1].state[moved[0]]["exp_avg"], state["exp_avg"])


# ---------------------------------------------------------------- generic properties
@pytest.mark.parametrize("seed", [7, None])
@pytest.mark.parametrize("foreach", [False, True])
def test_100_steps_equal_50_plus_save_load_plus_50(seed, foreach, device):
    api_tests.test_100_steps_equal_50_plus_save_load_into_fresh_objects_plus_50(
        CASE, seed, foreach, device
    )


@pytest.mark.parametrize("copier", [copy.deepcopy, chain_tests.through_pickle])
def test_a_copied_model_and_optimizer_continue_the_same_chain(copier):
    chain_tests.test_a_copied_model_and_optimizer_continue_the_same_chain(CASE, copier)


GENERIC = [
    api_tests.test_same_seed_same_chain_different_seed_different_chain,
    api_tests.test_parameters_without_gradient_are_skipped,
    api_tests.test_zero_learning_rate_at_positive_temperature_changes_nothing,
    api_tests.test_closure_is_evaluated_with_grad_enabled_and_its_loss_returned,
    api_tests.test_every_argument_is_documented_and_the_example_names_the_class,
    chain_tests.test_an_invalid_param_group_is_not_added,
    chain_tests.test_a_group_added_later_starts_at_the_current_step_with_the_same_seed,
    overlap_tests.test_overlap_noise_must_be_a_bool,
    transform_tests.test_in_meta_optimizer_at_positive_temperature_the_chain_is_the_optimizers,
    transform_tests.test_update_is_a_pure_function_of_updates_state_and_params,
    transform_tests.test_two_inits_with_one_seed_give_one_chain_and_no_state_is_hidden,
    transform_tests.test_a_saved_and_loaded_state_continues_the_chain_exactly,
    transform_tests.test_lr_zero_at_positive_temperature_changes_nothing_but_the_counter,
]


@pytest.mark.parametrize("generic", GENERIC, ids=lambda f: f.__name__)
def test_generic_property(generic):
    generic(CASE)


@pytest.mark.parametrize("generic_with_device", [
    transform_tests.test_in_torchopt_optimizer_over_a_module_equals_the_sampler_optimizer,
    transform_tests.test_functional_loop_with_torch_func_grad_in_place_and_not,
], ids=lambda f: f.__name__)  # fmt: skip
def test_generic_property_on_the_device(generic_with_device, device):
    generic_with_device(device, CASE)


@pytest.mark.parametrize("foreach", [False, True])
def test_overlapped_noise_gives_the_same_chain(foreach):
    overlap_tests.test_overlapped_noise_gives_the_same_chain(CASE, foreach, False)


# ---------------------------------------------------------------- errors
SHARED = [
    pytest.param(kwargs, error, message, id=str(kwargs))
    for name, kwargs, error, message in transform_tests.SHARED_ERRORS
    if name == "all" and "dampening" not in kwargs
]
OWN = [
    ({"betas": (0.9, 1.0)}, ValueError, "Invalid betas: (0.9, 1.0) (expected a pair of numbers "
     "in [0, 1))"),
    ({"betas": 0.9}, TypeError, "Invalid betas: 0.9 (expected a pair of numbers in [0, 1))"),
    ({"betas": (0.9, "x")}, TypeError, "Invalid betas: (0.9, 'x') (expected a pair of numbers "
     "in [0, 1))"),
    ({"betas": (math.nan, 0.9)}, ValueError, "Invalid betas: (nan, 0.9) (expected a pair of "
     "numbers in [0, 1))"),
    ({"eps": 0.0}, ValueError, "Invalid eps: 0.0 (expected a finite number > 0)"),
    ({"eps": "1e-8"}, TypeError, "Invalid eps: '1e-8' (expected a finite number > 0)"),
    ({"amsgrad": True}, ValueError, "amsgrad=True requires temperature=0 (it has no sampling "
     "meaning)"),
    ({"amsgrad": 1}, TypeError, "Invalid amsgrad: 1 (expected True or False)"),
    ({"preconditioner": "diagonal"}, ValueError, "Invalid preconditioner: 'diagonal' (expected "
     "one of 'factored', 'elementwise')"),
    ({"preconditioner_warmup": -1}, ValueError, "Invalid preconditioner_warmup: -1 (expected an "
     "integer >= 0, or None to never freeze the preconditioner)"),
    ({"preconditioner_warmup": 1.5}, TypeError, "Invalid preconditioner_warmup: 1.5 (expected "
     "an integer >= 0, or None to never freeze the preconditioner)"),
    ({"weight_decay": -0.1}, ValueError, "Invalid weight_decay: -0.1 (expected a finite number "
     ">= 0)"),
]  # fmt: skip


@pytest.mark.parametrize(("kwargs", "error", "message"), [*SHARED, *OWN])
def test_same_validation_and_message_as_the_optimizer(kwargs, error, message):
    pattern = "^" + re.escape(message) + "$"
    with pytest.raises(error, match=pattern):
        transforms.adamw_sghmc(**{"lr": 0.1, "num_data": 10, **kwargs})
    with pytest.raises(error, match=pattern):
        AdamWSGHMC([torch.nn.Parameter(torch.zeros(2))], **{"lr": 0.1, "num_data": 10, **kwargs})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"capturable": True}, "Invalid capturable: True (expected False: AdamWSGHMC counts its "
         "steps in Python (state 'step', 'preconditioner_step'), which a replayed step would "
         "not advance; capturable=True is for SGLD, SGHMC, BAOA and SGNHT)"),
        ({"differentiable": True}, "Invalid differentiable: True (expected False: "
         "differentiating through a sampler step is not supported)"),
        ({"fused": True}, "Invalid fused: True (param group 0, parameter 0 of shape (2,) is on "
         "cpu: the fused kernels run on CUDA; use fused=None to take the fused path only where "
         "it can run, or fused=False)"),
    ],
)  # fmt: skip
def test_optimizer_only_flags(kwargs, message):
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        AdamWSGHMC([torch.nn.Parameter(torch.zeros(2))], lr=0.1, num_data=10, **kwargs)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_at_positive_temperature_is_the_float32_chain_rounded(dtype):
    """float16 (which rounds eps = 1e-8 to 0 and overflows 1/a) samples through a float32
    master copy: the chain is the float32 one given the same gradients, each step rounded
    to the parameter's dtype; bit for bit, through the preconditioner's freeze."""
    generator = torch.Generator().manual_seed(0)
    init = torch.randn(3, 5, generator=generator)
    grads = [torch.randn(3, 5, generator=generator).to(dtype) for _ in range(6)]
    chains = []
    for start, cast in ((init.to(dtype), dtype), (init.to(dtype).float(), torch.float32)):
        param = torch.nn.Parameter(start.clone())
        opt = AdamWSGHMC([param], lr=1e-2, num_data=10, seed=0, preconditioner_warmup=3)
        chain = []
        for grad in grads:
            param.grad = grad.to(cast)
            opt.step()
            chain.append(param.detach().clone())
        chains.append(chain)
        if cast is dtype:
            assert opt.state[param]["master_param"].dtype == torch.float32
    for half, full in zip(*chains, strict=True):
        assert torch.isfinite(half).all() and torch.equal(half, full.to(dtype))
    assert not torch.equal(chains[0][-1], init.to(dtype))


@pytest.mark.parametrize("foreach", [False, True])
def test_a_non_finite_gradient_is_refused_and_nothing_changes(foreach):
    param = torch.nn.Parameter(torch.ones(3))
    opt = AdamWSGHMC([param], lr=0.1, num_data=10, foreach=foreach, seed=0)
    param.grad = torch.ones(3)
    opt.step()
    before = {k: v.clone() for k, v in opt.state[param].items()}
    kept = param.detach().clone()
    param.grad = torch.tensor([1.0, math.nan, 0.0])
    message = "AdamWSGHMC refused step 2: non-finite gradient in param group 0, parameter 0"
    with pytest.raises(FloatingPointError, match="^" + re.escape(message)):
        opt.step()
    assert torch.equal(param.detach(), kept)
    for key, value in before.items():
        assert torch.equal(opt.state[param][key], value), key


def test_bfloat16_parameters_sample_at_positive_temperature():
    param = torch.nn.Parameter(torch.zeros(64, 8, dtype=torch.bfloat16))
    opt = AdamWSGHMC([param], num_data=10, seed=0, preconditioner_warmup=2)
    for _ in range(5):
        param.grad = param.detach() + 0.01
        opt.step()
    assert torch.isfinite(param).all() and param.dtype == torch.bfloat16
    assert param.detach().float().std() > 0


def test_docstring_examples_run():
    transform_tests.test_docstring_examples_run(transforms.adamw_sghmc)


def test_the_transforms_arguments_are_documented():
    transform_tests.test_every_argument_is_documented(transforms.adamw_sghmc)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_nonfinite_skip_changes_nothing(temperature):
    """Parameters and every entry keep their bits, the step count too: it is read on the
    host (``StateField.host``), advanced by the update and put back when the device skips
    the step (``step/skipped_host``; here, on the CPU, at the end of the step)."""
    param = torch.nn.Parameter(torch.randn(4, 3))
    opt = AdamWSGHMC(
        [param], num_data=10, seed=0, nonfinite="skip", temperature=temperature,
        preconditioner_warmup=1,
    )  # fmt: skip
    param.grad = torch.randn(4, 3)
    opt.step()
    before = param.detach().clone()
    state = {key: value.clone() for key, value in opt.state[param].items()}
    grad = torch.randn(4, 3)
    grad[0, 0] = math.nan
    param.grad = grad
    opt.step()
    assert torch.equal(param.detach(), before)
    for key, value in state.items():
        assert torch.equal(opt.state[param][key], value), key
    assert int(opt.param_groups[0]["skipped_steps"]) == 1


def test_a_chain_started_where_the_gradient_is_tiny_is_not_thrown_out():
    """From the mode of N(0, 1) with a gradient offset of 1e-6 (a zero-initialised LoRA
    factor's case): with AdamW's bias correction of the momentum the first step was a
    full Langevin step with a = 1e-6 (variance 3.9 after it, 1.42 after 1000 steps);
    the momentum starting at 0 undivided gives 0.98 (Monte Carlo sd 0.01)."""
    num_data = 1536
    theta = torch.zeros(20_000, requires_grad=True)
    opt = AdamWSGHMC([theta], lr=3e-3, num_data=num_data, seed=0, weight_decay=0.0)
    for step in range(1000):
        theta.grad = 1e-6 + theta.detach() / num_data
        opt.step()
        if step == 0:
            assert float(theta.detach().var()) < 0.1
    assert abs(float(theta.detach().var()) - 1) < 0.1
