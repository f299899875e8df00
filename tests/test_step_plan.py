"""The step pipeline's plan (``sgmcmc/step/plan``): validated once, re-made when it changes.

A param group is validated when its plan is made; a step whose group still holds the
plan validates nothing, and any change the plan depends on (a hyperparameter's value or
type, an entry added or renamed, the ``params`` list, the seed, a new dtype, a loaded
state) makes the next step validate again, so that a bad value is refused at the step
it reaches, before anything changes. Also the one-pass check of the gradients behind
``nonfinite="raise"`` (``tensor_lists.gradients_may_be_non_finite``).
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from samplers_as_optim import SGHMC, SGLD
from samplers_as_optim.names import set_parameter_layout
from samplers_as_optim.sgmcmc.tensor_lists import (
    all_finite,
    gradients_may_be_non_finite,
    may_be_non_finite,
)


def make(**kwargs):
    params = [
        nn.Parameter(torch.randn(4, generator=torch.Generator().manual_seed(i))) for i in range(3)
    ]
    for i, param in enumerate(params):
        param.grad = torch.full((4,), 0.1 * (i + 1))
    opt = SGHMC(params, lr=1e-3, momentum=0.9, num_data=100, seed=0, **kwargs)
    return opt, params


@pytest.fixture
def checks(monkeypatch):
    """How many times the optimizer validates a group's hyperparameters."""
    counted = {"n": 0}
    original = SGHMC.check_hyperparameters.__func__

    def counting(cls, group, *, where=""):
        counted["n"] += 1
        return original(cls, group, where=where)

    monkeypatch.setattr(SGHMC, "check_hyperparameters", classmethod(counting))
    return counted


def snapshot(opt, params):
    return [p.detach().clone() for p in params], copy.deepcopy(opt.state_dict())


def assert_unchanged(opt, params, before):
    values, state = before
    assert all(torch.equal(p, v) for p, v in zip(params, values, strict=True))
    now = opt.state_dict()
    assert [g["step"] for g in now["param_groups"]] == [g["step"] for g in state["param_groups"]]


def test_an_unchanged_group_is_validated_once(checks):
    opt, _ = make()
    checks["n"] = 0
    for _ in range(5):
        opt.step()
    assert checks["n"] == 1


def test_a_schedule_that_moves_lr_revalidates_that_step_only(checks):
    opt, _ = make()
    opt.step()
    checks["n"] = 0
    opt.param_groups[0]["lr"] = 2e-3
    opt.step()
    opt.step()
    assert checks["n"] == 1


@pytest.mark.parametrize(
    ("name", "value", "error", "match"),
    [
        ("lr", -1.0, ValueError, "Invalid lr"),
        ("lr", float("nan"), ValueError, "Invalid lr"),
        ("temperature", -0.5, ValueError, "Invalid temperature"),
        ("maximize", 1, TypeError, "Invalid maximize"),  # equal to True, another type
        ("momentum", 1.0, ValueError, "Invalid momentum"),
        ("num_data", 0, ValueError, "Invalid num_data"),
    ],
)
def test_a_bad_value_set_after_planning_is_refused_at_its_step(name, value, error, match):
    opt, params = make()
    opt.step()
    before = snapshot(opt, params)
    opt.param_groups[0][name] = value
    with pytest.raises(error, match=match):
        opt.step()
    assert_unchanged(opt, params, before)
    with pytest.raises(error, match=match):  # and at every step after, until fixed
        opt.step()


def test_a_bad_step_counter_or_seed_is_refused():
    opt, params = make()
    opt.step()
    before = snapshot(opt, params)
    opt.param_groups[0]["step"] = -1
    with pytest.raises(ValueError, match="Invalid step"):
        opt.step()
    opt.param_groups[0]["step"] = 1
    opt.param_groups[0]["seed"] = -3
    with pytest.raises(ValueError, match="Invalid seed"):
        opt.step()
    opt.param_groups[0]["seed"] = 0.0  # equal to the planned seed, another type
    with pytest.raises(TypeError, match="Invalid seed"):
        opt.step()
    opt.param_groups[0]["seed"] = 0
    assert_unchanged(opt, params, before)


def test_an_entry_added_or_renamed_revalidates(checks):
    opt, _ = make()
    opt.step()
    checks["n"] = 0
    opt.param_groups[0]["initial_lr"] = 1e-3  # what a scheduler writes once
    opt.step()
    assert checks["n"] == 1
    group = opt.param_groups[0]
    group["other"] = group.pop("initial_lr")  # as many entries, another name
    opt.step()
    assert checks["n"] == 2


def test_a_tensor_hyperparameter_is_validated_at_every_step(checks):
    opt, _ = make()
    opt.param_groups[0]["lr"] = torch.tensor(1e-3)
    checks["n"] = 0
    for _ in range(3):
        opt.step()
    assert checks["n"] == 3


def test_a_new_dtype_is_checked_against_the_scalars():
    params = [nn.Parameter(torch.zeros(3, dtype=torch.float64))]
    params[0].grad = torch.ones(3, dtype=torch.float64)
    opt = SGLD(params, lr=1e40, num_data=10, temperature=0.0, seed=0)
    opt.step()  # lr fits float64
    params[0].data = params[0].data.float()
    params[0].grad = torch.ones(3)
    with pytest.raises(
        ValueError, match=r"Invalid lr in param group 0: 1e\+40 .*fits torch.float32"
    ):
        opt.step()


def test_a_loaded_state_and_a_copy_are_planned_afresh(checks):
    opt, _ = make()
    opt.step()
    state = opt.state_dict()
    checks["n"] = 0
    opt.load_state_dict(state)
    opt.step()
    assert checks["n"] >= 2  # (the load checks the saved groups, the step plans anew)
    twin = copy.deepcopy(opt)
    checks["n"] = 0
    for p in twin.param_groups[0]["params"]:
        p.grad = torch.ones(4)
    twin.step()
    assert checks["n"] == 1


def test_a_planned_step_is_the_unplanned_step_bit_for_bit(monkeypatch):
    """Planning changes what is validated, never the numbers: lr moved every step."""
    from samplers_as_optim.sgmcmc.step import plan as step_plan

    opt, params = make()
    twin_params = [nn.Parameter(p.detach().clone()) for p in params]
    for p, q in zip(params, twin_params, strict=True):
        q.grad = p.grad.clone()
    twin = SGHMC(twin_params, lr=1e-3, momentum=0.9, num_data=100, seed=0)
    monkeypatch.setattr(step_plan.GroupPlan, "holds", lambda self, group: False)
    for k in range(6):
        lr = 1e-3 * (1 + k % 3)
        opt.param_groups[0]["lr"] = lr
        twin.param_groups[0]["lr"] = lr
        twin.step()
        monkeypatch.undo()
        opt.step()
        monkeypatch.setattr(step_plan.GroupPlan, "holds", lambda self, group: False)
    assert all(torch.equal(p, q) for p, q in zip(params, twin_params, strict=True))


# ------------------------------------------------------------------ the one-pass check
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), -float("inf")])
def test_the_one_pass_check_finds_exactly_the_non_finite(dtype, bad):
    grads = [torch.randn(5, dtype=dtype) for _ in range(4)]
    if bad is not None:
        grads[2][3] = bad
    assert gradients_may_be_non_finite(grads) is (bad is not None)


def test_the_one_pass_check_leaves_every_bit_of_the_gradients():
    grads = [
        torch.tensor([1e-310, -0.0, 5e-324, -1e308], dtype=torch.float64),
        torch.tensor([1e-40, -0.0, 3.4e38, -1.5]),
    ]
    bits = [g.view(torch.int64 if g.dtype == torch.float64 else torch.int32).clone() for g in grads]
    assert not gradients_may_be_non_finite(grads)
    for g, b in zip(grads, bits, strict=True):
        assert torch.equal(g.view(b.dtype), b)


def test_the_one_pass_check_is_exact_where_the_norms_overflow():
    large = [torch.full((4,), 3e38)]
    assert may_be_non_finite(large)  # (the norms' suspicion, checked one by one after)
    assert not gradients_may_be_non_finite(large)


def test_gradients_a_graph_may_hold_are_not_written():
    x = torch.randn(4, requires_grad=True)
    graph_grad = x * 2  # requires grad: a graph may hold it
    strided = torch.randn(4, 2)[:, 0]  # not contiguous
    half = torch.randn(4, dtype=torch.bfloat16)
    for grads in ([graph_grad], [strided], [half]):
        versions = [g._version for g in grads]
        assert not gradients_may_be_non_finite(grads)
        assert [g._version for g in grads] == versions


_ELEMENTS = st.sampled_from(
    [0.0, -0.0, 1.5, -3e38, 1e-310, float("nan"), float("inf"), -float("inf")]
)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["float32", "float64", "bfloat16"]), st.lists(_ELEMENTS, max_size=5)
        ),
        min_size=1,
        max_size=5,
    )
)
def test_the_skip_policys_one_pass_flags_are_the_exact_flags(spec):
    """``nonfinite="skip"``'s eager check (one pass) against the four operations per tensor."""
    grads = [torch.tensor(values, dtype=getattr(torch, dtype)) for dtype, values in spec]
    bits = [g.clone() for g in grads]
    finite = all(bool(torch.isfinite(g.float()).all()) for g in grads)
    exact = all_finite(grads)
    one_pass = all_finite(grads, one_pass=True)
    assert set(one_pass) == set(exact) == {torch.device("cpu")}
    for flag in (*exact.values(), *one_pass.values()):
        assert flag.shape == () and flag.dtype == torch.bool and bool(flag) is finite
    for g, b in zip(grads, bits, strict=True):  # (every bit: -0.0 and NaN payloads too)
        assert torch.equal(g.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))


@pytest.mark.parametrize("foreach", [True, False])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_kept_skip_step_is_the_raise_step_and_a_skipped_one_changes_nothing(foreach, temperature):
    """The skip policy's selects (``select_``, the buffers' copies), kept and skipped."""

    def run(nonfinite, bad_at):
        params = [
            nn.Parameter(torch.randn(3, 2, generator=torch.Generator().manual_seed(i)))
            for i in range(3)
        ]
        opt = SGHMC(
            params,
            lr=0.01,
            temperature=temperature,
            num_data=10,
            seed=1,
            foreach=foreach,
            nonfinite=nonfinite,
        )
        trace = []
        for step in range(4):
            for i, p in enumerate(params):
                p.grad = torch.full_like(p, 0.1 * (i + step + 1))
            if step == bad_at:
                params[1].grad[0, 1] = float("nan")
            opt.step()
            trace.append(
                [p.detach().clone() for p in params]
                + [opt.state[p]["momentum_buffer"].clone() for p in params]
            )
        return trace

    raised, skipped = run("raise", None), run("skip", 2)
    for step in (0, 1):
        assert all(torch.equal(a, b) for a, b in zip(raised[step], skipped[step], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(skipped[1], skipped[2], strict=True))
    assert not any(torch.equal(a, b) for a, b in zip(skipped[2][:3], skipped[3][:3], strict=True))


# ------------------------------------------------------------------ the noise in one pass
@pytest.mark.parametrize("shard", [None, 3])
def test_the_noise_drawn_in_one_pass_is_each_parameters_own(shard):
    """``KeyedNormal.draw_many``: every tensor's ``draw``, bit for bit, whatever its layout."""
    from samplers_as_optim.core.keyed_normal import BLOCK, KeyedNormal

    stream = KeyedNormal(2**63 + 12345)
    likes = [
        torch.zeros(16),
        torch.zeros(3, 5, dtype=torch.float64),
        torch.zeros(4, 3, 2, 2).to(memory_format=torch.channels_last),
        torch.zeros(5, 4).t(),  # not contiguous
        torch.zeros(7, dtype=torch.bfloat16),
        torch.zeros(BLOCK + 5),  # two blocks
        torch.zeros(0),
    ]
    keys = [1, 2**64 - 1, 77, 5, 9, 11, 12]
    drawn = stream.draw_many(likes, keys, step=17, shard=shard)
    for like, key, noise in zip(likes, keys, drawn, strict=True):
        alone = stream.draw(like, step=17, key=key, shard=shard)
        assert noise.shape == like.shape and noise.dtype == like.dtype and noise.is_contiguous()
        assert torch.equal(noise, alone)


@pytest.mark.parametrize("shard", [None, 3])
def test_the_noise_filled_in_one_pass_is_each_tensors_own(shard):
    """``KeyedNormal.fill_many_``: every tensor's ``fill_``, bit for bit, one block or more;
    IVON's draws (``fill_normals``) take it."""
    from samplers_as_optim.core.keyed_normal import BLOCK, KeyedNormal

    stream = KeyedNormal(2**63 + 12345)
    outs = [
        torch.empty(16),
        torch.empty(3, 5, dtype=torch.float64),
        torch.empty(7, dtype=torch.bfloat16),
        torch.empty(BLOCK + 5),  # two blocks
        torch.empty(0),
    ]
    keys = [1, 2**64 - 1, 77, 11, 12]
    alone = [
        stream.fill_(out.clone(), step=17, key=k, shard=shard)
        for out, k in zip(outs, keys, strict=True)
    ]
    stream.fill_many_(outs, keys, step=17, shard=shard)
    assert all(torch.equal(out, one) for out, one in zip(outs, alone, strict=True))
    assert not torch.equal(outs[0], stream.fill_(outs[0].clone(), step=18, key=1, shard=shard))


def test_the_noise_drawn_into_given_tensors_is_the_same_and_fills_them():
    """``draw_many(out=...)``: the numbers of a new draw, written into the given tensors."""
    from samplers_as_optim.core.keyed_normal import KeyedNormal

    stream = KeyedNormal(7)
    likes = [torch.zeros(16), torch.zeros(3, 5, dtype=torch.float64), torch.zeros(2)]
    outs = [torch.empty(16), torch.empty(3, 5, dtype=torch.float64), None]
    drawn = stream.draw_many(likes, [1, 2, 3], step=4, out=outs)
    assert drawn[0] is outs[0] and drawn[1] is outs[1]
    fresh = stream.draw_many(likes, [1, 2, 3], step=4)
    assert all(torch.equal(a, b) for a, b in zip(drawn, fresh, strict=True))


@pytest.mark.parametrize(
    "reshape", [lambda p: p.reshape(2, 8), lambda p: p.double(), lambda p: p[:5].clone()]
)
def test_a_parameter_reshaped_under_its_plan_is_given_noise_of_its_new_kind(reshape):
    """The step draws small tensors' noise into tensors its plan keeps; a parameter given
    another shape or dtype in place (``param.data = ...``) gets noise of its new kind: the
    numbers a new draw gives, not the kept tensor's."""
    from samplers_as_optim.core.keyed_normal import KeyedNormal

    params = [
        nn.Parameter(torch.randn(16, generator=torch.Generator().manual_seed(i))) for i in range(2)
    ]
    for p in params:
        p.grad = torch.full((16,), 0.1)
    opt = SGLD(params, lr=1e-2, num_data=10, seed=3, foreach=True)
    opt.step()
    params[0].data = reshape(params[0].data)
    params[0].grad = torch.full_like(params[0].data, 0.1)
    before = params[0].detach().clone()
    key = opt._noise_keys(params)[0]
    opt.step()
    noise = KeyedNormal(3).draw(before, step=1, key=key)
    scale = (2.0 * 1.0 / (10 * 1e-2)) ** 0.5
    direction = torch.full_like(before, 0.1).add(noise, alpha=-scale)
    assert torch.equal(params[0].detach(), before.add(direction.mul(-1e-2)))


def test_the_kept_step_operands_keep_the_sign_of_zero():
    """``scalar_operand`` keeps a 0-d tensor per value and dtype, but 0.0 and -0.0 apart."""
    from samplers_as_optim.sgmcmc.tensor_lists import scalar_operand

    like = torch.zeros(3)
    assert scalar_operand(-1e-3, like) is scalar_operand(-1e-3, like)
    assert scalar_operand(-1e-3, like).dtype == torch.float32
    assert scalar_operand(-1e-3, like.double()).dtype == torch.float64
    for zero in (0.0, -0.0):
        first, second = scalar_operand(zero, like), scalar_operand(-zero, like)
        assert torch.signbit(first) == (str(zero) == "-0.0") != torch.signbit(second)
        assert scalar_operand(zero, like) is first  # kept too, by its sign
    assert scalar_operand(2.0, like.to(torch.bfloat16)) == 2.0  # (a number off float32/64)


@pytest.mark.parametrize("nonfinite", ["raise", "skip"])
def test_each_parameters_noise_key_is_in_the_state_whatever_the_first_step(nonfinite):
    """The keys a step records once per plan are recorded again after a skipped step put
    the state back (PSGLD keeps host numbers: a skip puts its new entries back)."""
    from samplers_as_optim import PSGLD

    params = [nn.Parameter(torch.randn(4)) for _ in range(2)]
    opt = PSGLD(params, lr=1e-3, num_data=10, seed=0, nonfinite=nonfinite)
    if nonfinite == "skip":
        for p in params:
            p.grad = torch.full((4,), float("nan"))
        opt.step()
    for _ in range(2):
        for p in params:
            p.grad = torch.full((4,), 0.1)
        opt.step()
    assert all("noise_key" in opt.state[p] for p in params)


def test_the_kept_operands_are_never_inference_tensors():
    """An operand first asked for under ``torch.inference_mode`` is not kept: a later
    differentiable multiply may save it for backward, which autograd refuses of one."""
    from samplers_as_optim.sgmcmc.tensor_lists import scalar_operand

    like = torch.zeros(3)
    with torch.inference_mode():
        assert scalar_operand(-0.123456, like).is_inference()
    operand = scalar_operand(-0.123456, like)
    assert not operand.is_inference()
    x = torch.ones(3, requires_grad=True)
    (x * operand).sum().backward()
    assert torch.equal(x.grad, torch.full((3,), -0.123456))


# ------------------------------------------------------------------ the plan's layout
def layout_of(opt, group=0):
    return opt._runtime["plans"][id(opt.param_groups[group])].tensors


def test_the_layout_is_kept_while_the_parameters_stay_and_remade_when_they_change():
    """``TensorLayout``: described once, kept while the step's parameters are the same
    tensors of the same kinds; a gradient lost, a dtype or shape changed in place, makes
    a new one that describes them."""
    params = [nn.Parameter(torch.randn(16)) for _ in range(3)]
    for p in params:
        p.grad = torch.full((16,), 0.1)
    opt = SGLD(params, lr=1e-3, num_data=10, seed=0, foreach=True)
    opt.step()
    first = layout_of(opt)
    opt.step()
    assert layout_of(opt) is first and first.buckets == [[0, 1, 2]]
    assert first.dtypes == {torch.float32} and not first.half and first.drawn == [0, 1, 2]
    params[1].grad = None
    opt.step()
    assert layout_of(opt) is not first and layout_of(opt).drawn == [0, 1]
    params[1].grad = torch.full((16,), 0.1)
    params[2].data = params[2].data.double()
    params[2].grad = torch.full((16,), 0.1, dtype=torch.float64)
    opt.step()
    assert layout_of(opt).buckets == [[0, 1], [2]]
    assert layout_of(opt).dtypes == {torch.float32, torch.float64}
    params[0].data = params[0].data.reshape(4, 4)
    params[0].grad = torch.full((4, 4), 0.1)
    kept = layout_of(opt)
    opt.step()
    assert layout_of(opt) is not kept and layout_of(opt).signature[0][1] == (4, 4)
    set_parameter_layout(params[1], 16, 32)  # (now the second half of a larger tensor)
    opt.step()
    assert layout_of(opt).drawn == [0, 2]  # (its part of the larger tensor's noise)


def changes(k, params):
    """Step k's gradients, with parameters losing and gaining them and changing in place."""
    generator = torch.Generator().manual_seed(k)
    if k == 4:  # (as many parameters as the step before: only the kinds tell)
        params[0].data = params[0].data.reshape(2, 8)
    if k == 5:
        params[2].data = params[2].data.double()
    for i, p in enumerate(params):
        dropped = (k == 2 and i == 1) or (k == 7 and i == 0)
        g = torch.randn(p.shape, generator=generator, dtype=p.dtype)
        p.grad = None if dropped else g


@pytest.mark.parametrize("foreach", [True, None])
@pytest.mark.parametrize("nonfinite", ["raise", "skip"])
def test_the_kept_layout_changes_no_number(monkeypatch, foreach, nonfinite):
    """A chain whose parameters lose and regain gradients, are reshaped and change dtype in
    place, is the chain of an optimizer planned afresh at every step, bit for bit."""
    from samplers_as_optim.sgmcmc.step import plan as step_plan

    def build():
        params = [
            nn.Parameter(torch.randn(16, generator=torch.Generator().manual_seed(i)))
            for i in range(3)
        ]
        kwargs = {"foreach": foreach, "nonfinite": nonfinite}
        return params, SGLD(params, lr=1e-2, num_data=10, seed=5, **kwargs)

    params, opt = build()
    twin_params, twin = build()
    for k in range(8):
        changes(k, params)
        changes(k, twin_params)
        opt.step()
        with monkeypatch.context() as patched:
            patched.setattr(step_plan.GroupPlan, "holds", lambda self, group: False)
            twin.step()
        assert all(torch.equal(p, q) for p, q in zip(params, twin_params, strict=True)), k
        assert all(p.dtype == q.dtype for p, q in zip(params, twin_params, strict=True))


def test_a_layout_remade_as_gradients_come_and_go_draws_into_the_same_tensors():
    """Parameters without a gradient at some steps (a mixture of experts'): each step's
    layout is new, but small parameters' noise is drawn into the tensors the plan keeps."""
    params = [nn.Parameter(torch.randn(16)) for _ in range(3)]
    opt = SGLD(params, lr=1e-3, num_data=10, seed=0, foreach=True)
    kept = []
    for k in range(4):
        for i, p in enumerate(params):
            p.grad = None if (k % 2 and i == 1) else torch.full((16,), 0.1)
        opt.step()
        kept.append(layout_of(opt).noise)
    assert kept[0] is not kept[2] and kept[1] is not kept[3]
    assert all(a is b for a, b in zip(kept[0], kept[2], strict=True))
    assert kept[1][1] is kept[0][2]  # (parameter 2, second of the two stepped)


class RecordingBackend:
    """A fused backend that declines every step, recording what the Optimizer asks."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    def check_construction(self, definition, groups) -> None:
        self.asked.append(f"construction of {definition.name}, {len(groups)} group(s)")

    def takes_step(self, opt, gathered, *, compiling: bool) -> bool:
        self.asked.append(f"step {opt.param_groups[0]['step']}")
        return False

    def step(self, opt, gathered, rates, scaler) -> None:
        raise AssertionError("a declined step was taken")


def test_the_optimizer_reaches_the_fused_backend_through_its_slot_alone(monkeypatch):
    """The package registers its Triton backend; the Optimizer asks whatever is
    registered, only where ``fused`` is not False, and refuses with the fix when none is."""
    from samplers_as_optim.sgmcmc.fused.backend import TritonBackend
    from samplers_as_optim.sgmcmc.step import backends

    assert isinstance(backends.fused_backend(), TritonBackend)
    recording = RecordingBackend()
    monkeypatch.setattr(backends, "_REGISTERED", [recording])
    param = nn.Parameter(torch.ones(3))
    param.grad = torch.ones(3)
    opt = SGHMC([param], lr=0.1, num_data=10, momentum=0.9, seed=0, fused=True)
    opt.step()
    opt.step()
    assert recording.asked == ["construction of SGHMC, 1 group(s)", "step 0", "step 1"]
    twin = nn.Parameter(torch.ones(3))
    twin.grad = torch.ones(3)
    reference = SGHMC([twin], lr=0.1, num_data=10, momentum=0.9, seed=0, fused=False)
    reference.step()
    reference.step()
    assert torch.equal(param, twin)  # the declined steps are the reference steps
    assert len(recording.asked) == 3  # fused=False never asks
    monkeypatch.setattr(backends, "_REGISTERED", [])
    with pytest.raises(RuntimeError) as error:
        SGHMC([param], lr=0.1, num_data=10, fused=True)
    assert str(error.value) == (
        "no fused backend is registered: importing samplers_as_optim.sgmcmc registers it"
    )
    reference.step()  # fused=False needs no backend


@settings(max_examples=60, deadline=None)
@given(
    value=st.floats(allow_nan=True, allow_infinity=True, width=64),
    dtypes=st.lists(
        st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16]),
        min_size=1,
        max_size=4,
    ),
    seed=st.integers(0, 2**16),
)
def test_the_kept_operand_lists_give_the_numbers_operations_give(value, dtypes, seed):
    """``mul_scalar_``, ``mul_each_``, ``add_scalar_`` and ``plus_scalar`` (a kept 0-d
    operand on the CPU in place of a number foreach calls wrap per tensor) give the bits of
    the foreach call with the number, for lists of one dtype or mixed, and 0-d or not."""
    from samplers_as_optim.sgmcmc.tensor_lists import (
        add_scalar_,
        mul_each_,
        mul_scalar_,
        plus_scalar,
    )

    generator = torch.Generator().manual_seed(seed)
    shapes = [(), (5,), (2, 3), ()]
    made = [
        (torch.randn(shapes[i % 4], generator=generator, dtype=torch.float64) * 1e3).to(dtype)
        for i, dtype in enumerate(dtypes)
    ]

    def bits(tensor):
        return (tensor.dtype, tensor.reshape(-1).view(torch.uint8).tolist())

    def in_place(operation):
        def reference(tensors, number):
            clones = [t.clone() for t in tensors]
            operation(clones, number)
            return clones

        return reference

    for helper, reference in (
        (mul_scalar_, in_place(torch._foreach_mul_)),
        (add_scalar_, in_place(torch._foreach_add_)),
        (plus_scalar, torch._foreach_add),
    ):
        tensors = [t.clone() for t in made]
        expected = reference(made, value)  # the same foreach call with the number
        out = helper(tensors, value)
        got = tensors if out is None else out
        for g, e in zip(got, expected, strict=True):
            assert g.dtype == e.dtype
            assert bits(g) == bits(e)
        if out is not None:  # out of place: the inputs are as they were
            assert all(
                torch.equal(t, m) or t.isnan().any() for t, m in zip(tensors, made, strict=True)
            )
    values = [value / (i + 1) for i in range(len(made))]  # a number per tensor
    expected = in_place(torch._foreach_mul_)(made, values)
    tensors = [t.clone() for t in made]
    mul_each_(tensors, values)
    assert all(bits(t) == bits(e) for t, e in zip(tensors, expected, strict=True))
    for helper in (mul_scalar_, add_scalar_):
        helper([], value)  # nothing to do
    mul_each_([], [])
    assert plus_scalar([], value) == []
