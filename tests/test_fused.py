"""The fused step (``fused``): SGLD's and SGHMC's Triton kernels, their noise, their refusals.

Without CUDA the kernels run on CPU tensors in Triton's interpreter
(``tests/triton_interpreter.py`` switches it on before Triton is imported, again if a
whole-suite run imported it before), and ``fused.RUN_ON_CPU_UNDER_INTERPRETER`` lets the
fused path take CPU tensors. With CUDA the same tests run on the GPU, and the step at temperature 0 is compared with
``torch.optim.SGD(fused=True)`` bit for bit.

What is checked: the kernels against the reference updates (``sgld_direction``,
``sghmc_direction`` and the step) given the very noise the kernel drew
(``fused.fused_normal``); the noise's moments and independence across steps, parameters,
shards and positions; a shard drawing exactly its slice of the whole; exact resume;
temperature 0 as SGD; when ``fused=None`` takes the fused path; every ``fused=True``
refusal; the non-finite policies without a host synchronisation. Tensors are small: the
interpreter runs each program in Python.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import subprocess
import sys

import pytest
import torch
from triton_interpreter import use_interpreter

CUDA = use_interpreter()
pytest.importorskip("triton")

from samplers_as_optim import BAOA, SGHMC, SGLD, SGNHT, AdamWSGHMC  # noqa: E402
from samplers_as_optim.core.streams import parameter_key  # noqa: E402
from samplers_as_optim.names import set_parameter_layout  # noqa: E402
from samplers_as_optim.sgmcmc import fused  # noqa: E402
from samplers_as_optim.sgmcmc.fused import backend as fused_step_module  # noqa: E402
from samplers_as_optim.sgmcmc.fused import fused_normal  # noqa: E402
from samplers_as_optim.sgmcmc.fused import launch as _fused_launch  # noqa: E402
from samplers_as_optim.sgmcmc.sghmc import sghmc_direction  # noqa: E402
from samplers_as_optim.sgmcmc.sghmc import triton_kernel as _sghmc_fused  # noqa: E402
from samplers_as_optim.sgmcmc.sgld import sgld_direction  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")
N = 100


@pytest.fixture(autouse=True)
def _fused_on_this_device(monkeypatch):
    """On the CPU, let the fused path run under Triton's interpreter (for tests only)."""
    monkeypatch.setattr(fused, "RUN_ON_CPU_UNDER_INTERPRETER", not CUDA)


def named(**shapes: tuple[int, ...]) -> list[tuple[str, torch.nn.Parameter]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (name, torch.nn.Parameter(torch.randn(shape, generator=generator).to(DEVICE)))
        for name, shape in shapes.items()
    ]


def gradients(params, steps: int, seed: int = 2) -> list[list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        [torch.randn(p.shape, generator=generator, dtype=p.dtype).to(DEVICE) for _, p in params]
        for _ in range(steps)
    ]


def run(optimizer, params, grads) -> None:
    for step in grads:
        for (_, p), g in zip(params, step, strict=True):
            p.grad = g.clone()
        optimizer.step()


# ------------------------------------------------------------------ the noise stream
def test_importing_the_package_does_not_import_triton():
    """No kernel module (each imports Triton) is imported with the package. A CUDA build
    of torch imports Triton itself on the way (2.11 did, within what the package
    imports from torch); a CPU build does not, so there Triton must stay unimported."""
    code = (
        "import pathlib, sys, torch, samplers_as_optim\n"
        "from samplers_as_optim.sgmcmc import SAMPLERS\n"
        "from samplers_as_optim.sgmcmc.fused.kernels import has_fused_kernel\n"
        "folder = pathlib.Path(samplers_as_optim.__file__).parent / 'sgmcmc'\n"
        "names = {f'sgmcmc.{c.definition.transform_name}.triton_kernel' for c in SAMPLERS\n"
        "         if has_fused_kernel(c.definition)}\n"
        "names |= {'sgmcmc.fused.normal', 'sgmcmc.fused.io', 'sgmcmc.fused.pooled'}\n"
        "paths = [folder.parent.joinpath(*n.split('.')).with_suffix('.py') for n in names]\n"
        "assert len(names) == 9 and all(path.is_file() for path in paths), names\n"
        "kernels = [m for m in sys.modules if m.removeprefix('samplers_as_optim.') in names]\n"
        "assert not kernels, kernels\n"
        "assert torch.version.cuda is not None or 'triton' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_noise_is_standard_normal_and_independent_across_steps_keys_shards_and_positions():
    """Over n = 20,000 draws a correlation is N(0, 1/n), the mean N(0, 1/n), the sample sd
    about N(1, 1/(2n)) and the fourth moment N(3, 96/n): 5 standard errors each (a false
    alarm about once in 10^6 per check); a Kolmogorov-Smirnov test at p > 1e-4."""
    stats = pytest.importorskip("scipy.stats")
    n = 20_000
    key = parameter_key("w")
    xi = fused_normal(n, seed=7, step=3, key=key, device=DEVICE).double().cpu()
    assert abs(xi.mean()) < 5 / math.sqrt(n)
    assert abs(xi.std() - 1) < 5 / math.sqrt(2 * n)
    assert abs(xi.pow(4).mean() - 3) < 5 * math.sqrt(96 / n)
    assert stats.kstest(xi.numpy(), "norm").pvalue > 1e-4
    others = {
        "next step": fused_normal(n, seed=7, step=4, key=key, device=DEVICE),
        "another parameter": fused_normal(n, seed=7, step=3, key=parameter_key("v"), device=DEVICE),
        "another seed": fused_normal(n, seed=8, step=3, key=key, device=DEVICE),
        "another shard": fused_normal(n, seed=7, step=3, key=key, shard=1, device=DEVICE),
        "the next elements": fused_normal(n, seed=7, step=3, key=key, offset=n, device=DEVICE),
        "elements 2**32 on": fused_normal(n, seed=7, step=3, key=key, offset=2**32, device=DEVICE),
    }
    bound = 5 / math.sqrt(n)
    for what, other in others.items():
        r = torch.corrcoef(torch.stack((xi, other.double().cpu())))[0, 1]
        assert abs(r) < bound, what
    for lag in (1, 2, 1024):  # positions within one tensor
        r = torch.corrcoef(torch.stack((xi[:-lag], xi[lag:])))[0, 1]
        assert abs(r) < bound, lag


def test_a_shard_draws_exactly_its_slice_of_the_whole_and_the_block_size_does_not_matter(
    monkeypatch,
):
    whole = fused_normal(5000, seed=7, step=0, key=11, device=DEVICE)
    for offset, size in ((0, 1), (1234, 2000), (4999, 1)):
        part = fused_normal(size, seed=7, step=0, key=11, offset=offset, device=DEVICE)
        assert torch.equal(part, whole[offset : offset + size])
    far = fused_normal(40, seed=7, step=0, key=11, offset=2**32 + 5, device=DEVICE)
    assert torch.equal(
        far[3:13], fused_normal(10, seed=7, step=0, key=11, offset=2**32 + 8, device=DEVICE)
    )
    monkeypatch.setattr(_fused_launch, "block_size", lambda device: 1024)
    assert torch.equal(fused_normal(5000, seed=7, step=0, key=11, device=DEVICE), whole)


def test_a_sharded_parameter_steps_as_its_slice_of_the_whole():
    """Parameters holding parts of one tensor (``set_parameter_layout``) take exactly the
    whole tensor's step on their elements: the same noise, bit for bit."""
    torch.manual_seed(0)
    start, grads = torch.randn(300, device=DEVICE), torch.randn(3, 300, device=DEVICE)
    whole = torch.nn.Parameter(start.clone())
    parts = [torch.nn.Parameter(start[a:b].clone()) for a, b in ((0, 100), (100, 300))]
    for part, offset in zip(parts, (0, 100), strict=True):
        set_parameter_layout(part, offset, 300)
    one = SGHMC([("w", whole)], lr=0.1, num_data=N, seed=5, fused=True)
    split = [SGHMC([("w", part)], lr=0.1, num_data=N, seed=5, fused=True) for part in parts]
    for g in grads:
        whole.grad = g.clone()
        one.step()
        for part, opt, (a, b) in zip(parts, split, ((0, 100), (100, 300)), strict=True):
            part.grad = g[a:b].clone()
            opt.step()
    assert torch.equal(torch.cat([part.detach() for part in parts]), whole.detach())


# ------------------------------------------------------------------ the kernels
CASES = {
    "sghmc": (SGHMC, {"momentum": 0.9, "weight_decay": 0.01}),
    "sghmc-maximize": (SGHMC, {"momentum": 0.5, "maximize": True}),
    "sgld": (SGLD, {"weight_decay": 0.01}),
    "sghmc-momentum-0": (SGHMC, {"momentum": 0.0, "maximize": True}),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("case", CASES)
def test_the_kernel_is_the_reference_update_given_its_noise(case, dtype):
    """Three steps (the first creates SGHMC's buffer) against ``sghmc_direction`` or
    ``sgld_direction`` and the step, given the noise the kernel drew; the kernel computes
    in float64 and rounds once where the reference rounds each operation."""
    cls, kwargs = CASES[case]
    lr, temperature = 0.05, 2.0
    params = [
        (name, torch.nn.Parameter(p.detach().to(dtype))) for name, p in named(w=(3, 70), b=(5,))
    ]
    grads = gradients(params, 3)
    opt = cls(params, lr=lr, num_data=N, temperature=temperature, seed=9, fused=True, **kwargs)
    reference = {name: p.detach().clone() for name, p in params}
    buffers: dict[str, torch.Tensor | None] = dict.fromkeys(reference)
    momentum = kwargs.get("momentum", 0.0)
    common = {
        "lr": lr,
        "temperature": temperature,
        "num_data": N,
        "weight_decay": kwargs.get("weight_decay", 0.0),
        "maximize": kwargs.get("maximize", False),
        "foreach": False,
    }
    for step, step_grads in enumerate(grads):
        for (name, p), g in zip(params, step_grads, strict=True):
            p.grad = g.clone()
            xi = fused_normal(p.numel(), seed=9, step=step, key=parameter_key(name), device=DEVICE)
            xi = xi.to(dtype).view_as(p)
            if cls is SGLD:
                [d] = sgld_direction([reference[name]], [g], [xi], **common)
            else:
                [d], [buffers[name]] = sghmc_direction(
                    [reference[name]],
                    [g],
                    [buffers[name]],
                    [xi],
                    momentum=momentum,
                    dampening=0.0,
                    nesterov=False,
                    **common,
                )
            reference[name].add_(d.mul(-lr))
        opt.step()
    tolerance = (
        {"rtol": 1e-12, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 2e-6, "atol": 2e-6}
    )
    for name, p in params:
        torch.testing.assert_close(p.detach(), reference[name], **tolerance)
        if momentum:
            torch.testing.assert_close(opt.state[p]["momentum_buffer"], buffers[name], **tolerance)


SGD_CASES = {
    "plain": {"momentum": 0.0},
    "weight-decay-maximize": {"momentum": 0.0, "weight_decay": 0.1, "maximize": True},
    "momentum": {"momentum": 0.9, "weight_decay": 0.01},
    "nesterov": {"momentum": 0.9, "nesterov": True},
    "dampening": {"momentum": 0.8, "dampening": 0.3, "maximize": True},
}


@pytest.mark.parametrize("case", SGD_CASES)
def test_at_temperature_zero_it_is_sgd(case):
    """Equal to ``torch.optim.SGD(foreach=False)`` up to rounding (the kernel computes as
    torch's fused SGD: in float64, rounded once), in float64 to float64's rounding."""
    kwargs = SGD_CASES[case]
    cls = SGHMC if kwargs["momentum"] else SGLD
    for dtype, tolerance in ((torch.float32, 1e-6), (torch.float64, 1e-14)):
        params = [(n, torch.nn.Parameter(p.detach().to(dtype))) for n, p in named(w=(4, 5), b=(3,))]
        twins = [(n, torch.nn.Parameter(p.detach().clone())) for n, p in params]
        grads = gradients(params, 3)
        run(cls(params, lr=0.1, num_data=N, temperature=0.0, fused=True, **kwargs), params, grads)
        run(torch.optim.SGD([p for _, p in twins], lr=0.1, foreach=False, **kwargs), twins, grads)
        for (_, p), (_, q) in zip(params, twins, strict=True):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("case", SGD_CASES)
def test_at_temperature_zero_it_is_torchs_fused_sgd_bit_for_bit(case):
    """At T = 0 the fused step is ``torch._fused_sgd_`` itself (``fused/launch.
    torch_fused_sgd``): on every device and torch version, whatever torch rounds (torch
    2.11's CUDA kernel rounds lr to float32 for a float32 parameter, where the Triton
    kernel computed in float64: 5% of the elements differed by an ulp)."""
    kwargs = SGD_CASES[case]
    cls = SGHMC if kwargs["momentum"] else SGLD
    params = named(w=(64, 33), b=(7,))
    twins = [(n, torch.nn.Parameter(p.detach().clone())) for n, p in params]
    grads = gradients(params, 4)
    run(cls(params, lr=0.1, num_data=N, temperature=0.0, fused=True, **kwargs), params, grads)
    run(torch.optim.SGD([p for _, p in twins], lr=0.1, fused=True, **kwargs), twins, grads)
    for (_, p), (_, q) in zip(params, twins, strict=True):
        assert torch.equal(p, q)


def test_resume_is_exact():
    """A state_dict round trip, a deep copy: the same chain, bit for bit."""
    params = named(w=(6, 7), b=(3,))
    grads = gradients(params, 4)
    opt = SGHMC(params, lr=0.05, num_data=N, seed=4, fused=True)
    run(opt, params, grads[:2])
    saved = copy.deepcopy(opt.state_dict())
    twins = [(n, torch.nn.Parameter(p.detach().clone())) for n, p in params]
    copied = copy.deepcopy(opt)
    resumed = SGHMC(twins, lr=0.05, num_data=N, seed=0, fused=True)
    resumed.load_state_dict(saved)
    run(opt, params, grads[2:])
    run(resumed, twins, grads[2:])
    copied_params = [
        (n, p) for (n, _), p in zip(params, copied.param_groups[0]["params"], strict=True)
    ]
    run(copied, copied_params, grads[2:])
    for (_, p), (_, q), (_, r) in zip(params, twins, copied_params, strict=True):
        assert torch.equal(p, q)
        assert torch.equal(p, r)
        assert torch.equal(opt.state[p]["momentum_buffer"], resumed.state[q]["momentum_buffer"])


# ------------------------------------------------------------------ when it is fused
def spy_on_the_kernel(monkeypatch) -> list[str]:
    calls: list[str] = []
    original = fused_step_module.fused_kernel

    def spied(definition):
        calls.append(definition.name)
        return original(definition)

    monkeypatch.setattr(fused_step_module, "fused_kernel", spied)
    return calls


def test_fused_none_takes_the_fused_path_only_where_it_can_run(monkeypatch):
    assert fused.DEFAULT_ON_CUDA  # (validated on an H100: bash .ci/gpu fused)
    calls = spy_on_the_kernel(monkeypatch)
    params = named(w=(3, 4))
    grads = gradients(params, 1)
    run(SGHMC(params, lr=0.1, num_data=N), params, grads)  # on CUDA, or the CPU test hatch
    assert calls == ["SGHMC"]
    # at T = 0 the default step is torch.optim.SGD's default one, bit for bit
    for kwargs in ({"fused": False}, {"foreach": False}, {"foreach": True}, {"temperature": 0}):
        run(SGHMC(params, lr=0.1, num_data=N, **kwargs), params, grads)
    run(SGNHT(params, lr=0.1, num_data=N), params, grads)
    assert calls == ["SGHMC", "SGNHT"]
    monkeypatch.delitem(fused.kernels.KERNELS, "SGNHT")
    run(SGNHT(params, lr=0.1, num_data=N), params, grads)  # a sampler without a kernel
    assert calls == ["SGHMC", "SGNHT"]
    monkeypatch.setattr(fused, "triton_importable", lambda: False)
    run(SGHMC(params, lr=0.1, num_data=N), params, grads)
    assert calls == ["SGHMC", "SGNHT"]


@pytest.mark.skipif(CUDA, reason="CPU parameters without the test hatch")
def test_fused_none_takes_the_unfused_path_on_the_cpu(monkeypatch):
    monkeypatch.setattr(fused, "RUN_ON_CPU_UNDER_INTERPRETER", False)
    calls = spy_on_the_kernel(monkeypatch)
    params = named(w=(3, 4))
    twins = [(n, torch.nn.Parameter(p.detach().clone())) for n, p in params]
    grads = gradients(params, 2)
    run(SGHMC(params, lr=0.1, num_data=N, seed=1), params, grads)
    run(SGHMC(twins, lr=0.1, num_data=N, seed=1, fused=False), twins, grads)
    assert calls == []
    assert torch.equal(params[0][1], twins[0][1])


def fused_error(reason: str) -> str:
    return (
        f"Invalid fused: True ({reason}; use fused=None to take the fused path only where it "
        "can run, or fused=False)"
    )


@pytest.mark.parametrize("cls", [SGNHT, BAOA, AdamWSGHMC], ids=lambda c: c.__name__)
def test_fused_true_without_a_kernel_is_refused(cls, monkeypatch):
    # every sampler has a kernel now: the refusal, for a definition without one
    monkeypatch.delitem(fused.kernels.KERNELS, cls.definition.name)
    with pytest.raises(ValueError) as error:
        cls([torch.nn.Parameter(torch.zeros(2, device=DEVICE))], lr=0.1, num_data=N, fused=True)
    assert str(error.value) == fused_error(f"{cls.__name__} has no fused kernel yet")


def test_a_kernel_is_its_own_samplers_and_not_a_namesakes():
    """A sampler of one's own built from SGLD's definition with another update keeps the
    name "SGLD" but not SGLD's kernel, which would step it with SGLD's update."""
    from samplers_as_optim.sgmcmc.optimizer import SamplerOptimizer

    def update(*args, **kwargs):
        return SGLD.definition.update(*args, **kwargs)

    class Namesake(
        SamplerOptimizer, definition=dataclasses.replace(SGLD.definition, update=update)
    ):
        pass

    assert fused.kernels.has_fused_kernel(SGLD.definition)
    assert not fused.kernels.has_fused_kernel(Namesake.definition)
    param = torch.nn.Parameter(torch.zeros(2, device=DEVICE))
    with pytest.raises(ValueError) as error:
        Namesake([param], lr=0.1, num_data=N, fused=True)
    assert str(error.value) == fused_error("SGLD has no fused kernel yet")
    param.grad = torch.ones(2, device=DEVICE)
    opt = Namesake([param], lr=0.1, num_data=N, seed=0)  # fused=None: the reference step
    twin = torch.nn.Parameter(torch.zeros(2, device=DEVICE))
    twin.grad = torch.ones(2, device=DEVICE)
    reference = SGLD([twin], lr=0.1, num_data=N, seed=0, fused=False)
    opt.step()
    reference.step()
    assert torch.equal(param, twin)  # not the fused stream (``test_fused_none_takes...``)


def test_fused_true_refusals_name_the_reason(monkeypatch):
    def build(*params, **kwargs):
        return SGHMC(list(params), lr=0.1, num_data=N, fused=True, **kwargs)

    ok = torch.nn.Parameter(torch.zeros(2, device=DEVICE))
    cases = [
        ((ok, torch.nn.Parameter(torch.zeros(2, dtype=torch.complex64, device=DEVICE))), {},
         "param group 0, parameter 1 of shape (2,) is torch.complex64: the fused kernels take "
         "float32, float64, float16 and bfloat16 parameters"),
        ((torch.nn.Parameter(torch.zeros(3, 2, device=DEVICE).t()),), {},
         "param group 0, parameter 0 of shape (2, 3) is not contiguous: the fused kernels take "
         "contiguous tensors"),
        ((ok,), {"foreach": True},
         "param group 0 sets foreach=True (fused and foreach exclude each other)"),
    ]  # fmt: skip
    if not CUDA:
        cases.append(
            ((torch.nn.Parameter(torch.zeros(3)),), {},
             "param group 0, parameter 0 of shape (3,) is on cpu: the fused kernels run on CUDA")
        )  # fmt: skip
    for params, kwargs, reason in cases:
        if reason.endswith("on CUDA"):
            monkeypatch.setattr(fused, "RUN_ON_CPU_UNDER_INTERPRETER", False)
        with pytest.raises(ValueError) as error:
            build(*params, **kwargs)
        assert str(error.value) == fused_error(reason)
    monkeypatch.setattr(fused, "RUN_ON_CPU_UNDER_INTERPRETER", not CUDA)
    monkeypatch.setattr(_sghmc_fused, "unsupported", lambda group, temperature: "no such option")
    with pytest.raises(ValueError) as error:
        build(ok)
    assert str(error.value) == fused_error("no such option (param group 0)")
    monkeypatch.undo()
    monkeypatch.setattr(fused, "RUN_ON_CPU_UNDER_INTERPRETER", not CUDA)
    monkeypatch.setattr(fused, "triton_importable", lambda: False)
    with pytest.raises(ValueError) as error:
        build(ok)
    assert str(error.value) == fused_error("Triton cannot be imported (pip install triton)")
    with pytest.raises(
        ValueError, match=r"^Invalid fused: 'yes' \(expected None, True or False\)$"
    ):
        SGHMC([ok], lr=0.1, num_data=N, fused="yes")


def test_fused_true_refuses_a_step_it_cannot_take_before_anything_changes():
    p = torch.nn.Parameter(torch.zeros(3, 2, device=DEVICE))
    opt = SGHMC([p], lr=0.1, num_data=N, fused=True)
    p.grad = torch.ones(2, 3, device=DEVICE).t()  # not contiguous
    with pytest.raises(ValueError) as error:
        opt.step()
    assert str(error.value) == fused_error(
        "the gradient of param group 0, parameter 0 of shape (3, 2) is not contiguous: the "
        "fused kernels take contiguous tensors"
    )
    assert not p.detach().any()
    assert opt.state_dict()["state"] == {}
    assert opt.param_groups[0]["step"] == 0


# ------------------------------------------------------------------ non-finite gradients
def snapshot(opt, params):
    return copy.deepcopy(opt.state_dict()), [p.detach().clone() for _, p in params]


def assert_same(before, after):
    (state_a, params_a), (state_b, params_b) = before, after
    assert all(torch.equal(a, b) for a, b in zip(params_a, params_b, strict=True))
    assert state_a["param_groups"] == state_b["param_groups"]
    assert state_a["state"].keys() == state_b["state"].keys()
    for key, entries in state_a["state"].items():
        assert entries.keys() == state_b["state"][key].keys()
        for name, value in entries.items():
            assert torch.equal(value, state_b["state"][key][name]), name


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_skip_leaves_every_bit_and_counts_the_step(bad):
    params = named(w=(4, 3), b=(3,))
    grads = gradients(params, 3)
    opt = SGHMC(params, lr=0.1, num_data=N, seed=2, fused=True, nonfinite="skip")
    run(opt, params, grads[:1])
    before = [p.detach().clone() for _, p in params] + [
        opt.state[p]["momentum_buffer"].clone() for _, p in params
    ]
    grads[1][1][2] = bad
    run(opt, params, grads[1:2])
    after = [p.detach() for _, p in params] + [opt.state[p]["momentum_buffer"] for _, p in params]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert int(opt.param_groups[0]["skipped_steps"]) == 1
    assert opt.param_groups[0]["step"] == 2
    huge = [[torch.full_like(g, 3e38) for g in grads[2]]]  # finite: not skipped
    run(opt, params, huge)
    assert int(opt.param_groups[0]["skipped_steps"]) == 1


def test_raise_refuses_the_step_at_the_next_call_and_nothing_changed():
    """The fused step checks on the device and writes nothing; the next ``step()`` raises,
    naming the step and the parameter, and leaves the optimizer as before the refused
    step: the chain then goes on as if that batch had never come."""
    params = named(w=(4, 3), b=(3,))
    grads = gradients(params, 4)
    twins = [(n, torch.nn.Parameter(p.detach().clone())) for n, p in params]
    opt = SGHMC(params, lr=0.1, num_data=N, seed=2, fused=True)
    run(opt, params, grads[:1])
    before = snapshot(opt, params)
    bad = [g.clone() for g in grads[1]]
    bad[1][0] = math.nan
    run(opt, params, [bad])  # no error yet: no host synchronisation
    assert all(torch.equal(a, p) for a, (_, p) in zip(before[1], params, strict=True))
    with pytest.raises(FloatingPointError) as error:
        run(opt, params, grads[2:3])
    assert str(error.value) == (
        "SGHMC refused step 2: non-finite gradient in param group 0, parameter 1 'b' of shape "
        "(3,); no parameter or buffer was changed (the fused step checks the gradients on the "
        "device, without a host synchronisation: this call, the next after that step, raises "
        "it and changes nothing either)"
    )
    assert_same(before, snapshot(opt, params))
    run(opt, params, grads[2:])
    reference = SGHMC(twins, lr=0.1, num_data=N, seed=2, fused=True)
    run(reference, twins, grads[:1] + grads[2:])
    assert all(torch.equal(p, q) for (_, p), (_, q) in zip(params, twins, strict=True))


def test_raise_at_the_first_step_is_reported_by_state_dict_and_nothing_changed():
    params = named(w=(4, 3))
    opt = SGHMC(params, lr=0.1, num_data=N, seed=2, fused=True)
    before = snapshot(opt, params)
    run(opt, params, [[torch.full((4, 3), math.inf, device=DEVICE)]])
    with pytest.raises(FloatingPointError, match=r"^SGHMC refused step 1: non-finite gradient in"):
        opt.state_dict()
    assert_same(before, snapshot(opt, params))  # no buffer created, no key recorded


@pytest.mark.parametrize("cls", [SGHMC, SGNHT, BAOA, AdamWSGHMC], ids=lambda c: c.__name__)
def test_a_refused_step_at_a_new_lr_leaves_the_buffers_in_the_old_units(cls):
    """A step at a changed lr re-expresses the momentum in the new lr's units before the
    kernel; when the kernel then refuses it (nonfinite="raise": found at the next call),
    the record of the rate goes back, so the buffer must too: the re-expression is gated
    on the device by the same verdict. The chain after the refusal equals the chain that
    never saw the bad gradient (it was re-expressed twice: by the refused step and again
    by the next)."""

    def chain(steps):
        param = torch.nn.Parameter(torch.ones(4, device=DEVICE))
        opt = cls([param], lr=0.1, num_data=N, seed=0, fused=True)
        refusals = 0
        for grad, lr in steps:
            opt.param_groups[0]["lr"] = lr
            param.grad = grad.to(DEVICE)
            try:
                opt.step()
            except FloatingPointError:
                refusals += 1
        return param.detach(), refusals

    good, bad = torch.ones(4), torch.tensor([1.0, math.nan, 1.0, 1.0])
    refused, refusals = chain([(good, 0.1), (bad, 0.2), (good, 0.2), (good, 0.2), (good, 0.2)])
    clean, _ = chain([(good, 0.1), (good, 0.2), (good, 0.2)])
    assert refusals == 1 and torch.equal(refused, clean)
