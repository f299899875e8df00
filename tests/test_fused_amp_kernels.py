"""The fused kernels' AMP inputs: GradScaler scales and float32 master positions (issue #24).

Each sampler's kernel is called directly (``launch(group, FusedInput(...))``, as the
Optimizer calls it) on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``, as
in ``tests/test_fused.py``; on CUDA the same tests run on the GPU). Checked, for every
sampler kernel and the options that change its code:

* ``FusedInput.grad_scales``: the step on gradients ``g`` with scale ``s`` is the step on
  ``g / s`` (torch's float32 division), bit for bit, for ``s = 1024`` and ``s = 3``;
* ``FusedInput.masters``: a float16/bfloat16 parameter with a float32 master steps as a
  float32 parameter holding the master's values (the same gradients, widened), bit for
  bit: master = that trajectory, buffers float32 and equal, the same noise; the parameter
  holds the master rounded to nearest;
* a non-finite flag leaves the parameter, the master and every buffer untouched;
* float16/bfloat16 parameters without a master at temperature 0 match torch's optimizers
  on the same half tensors within a few units of their dtype's epsilon (closer, in those
  units, than today's float32 tests require of float32 parameters); AdamWSGHMC's is
  torch's fused AdamW bit for bit, and with a master it is AdamW on the master (SGNHT
  refuses temperature 0);
* the AMP variants of every kernel compile for an sm_90 GPU (Triton's compiler, not run).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from triton_interpreter import use_interpreter

CUDA = use_interpreter()
pytest.importorskip("triton")

from samplers_as_optim import BAOA, PSGLD, SGHMC, SGLD, SGNHT, AdamWSGHMC  # noqa: E402
from samplers_as_optim.sgmcmc import fused  # noqa: E402
from samplers_as_optim.sgmcmc.fused import launch as _fused_launch  # noqa: E402
from samplers_as_optim.sgmcmc.fused.launch import FusedInput  # noqa: E402
from samplers_as_optim.sgmcmc.step.ready import init_state  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")
N, LR, T, SEED = 100, 0.01, 1.0, 5
HOT = 0.1  # the learning rate of the temperature-0 comparisons (as tests/test_fused.py's)
SHAPES = ((5, 3), (7,))  # small: both share one launch (MULTI) unless told otherwise
HALVES = (torch.bfloat16, torch.float16)

#: name: (sampler, options, temperature); every kernel and the options that change its code
CASES = {
    "SGLD-decay-maximize": (SGLD, {"weight_decay": 0.1, "maximize": True}, T),
    "SGHMC-decay-maximize": (SGHMC, {"momentum": 0.9, "weight_decay": 0.1, "maximize": True}, T),
    "SGHMC-T0-nesterov-decay": (
        SGHMC,
        {"momentum": 0.9, "nesterov": True, "weight_decay": 0.1},
        0.0,
    ),
    "SGHMC-T0-dampening": (SGHMC, {"momentum": 0.8, "dampening": 0.3}, 0.0),
    "SGNHT-ding-decay": (SGNHT, {"kinetic_energy": "ding", "weight_decay": 0.01}, T),
    "SGNHT-symmetric-maximize": (SGNHT, {"maximize": True}, T),
    "BAOA-decay": (BAOA, {"momentum": 0.9, "weight_decay": 0.1}, T),
    "PSGLD-factored-freeze": (PSGLD, {"preconditioner_warmup": 2, "weight_decay": 0.1}, T),
    "PSGLD-elementwise-correction": (
        PSGLD,
        {"preconditioner": "elementwise", "correction": True, "preconditioner_warmup": None},
        T,
    ),
    "PSGLD-T0-centered-momentum": (PSGLD, {"centered": True, "momentum": 0.5}, 0.0),
    "AdamWSGHMC-factored-freeze": (
        AdamWSGHMC,
        {"preconditioner_warmup": 2, "weight_decay": 0.1},
        T,
    ),
    "AdamWSGHMC-elementwise-maximize": (
        AdamWSGHMC,
        {"preconditioner": "elementwise", "maximize": True, "preconditioner_warmup": None},
        T,
    ),
    "AdamWSGHMC-T0-amsgrad": (AdamWSGHMC, {"amsgrad": True, "weight_decay": 0.1}, 0.0),
}
WARM = [name for name, (_, _, temperature) in CASES.items() if temperature > 0]


@pytest.fixture(autouse=True)
def _fused_on_this_device(monkeypatch):
    """On the CPU, let the fused path run under Triton's interpreter (for tests only)."""
    monkeypatch.setattr(fused, "RUN_ON_CPU_UNDER_INTERPRETER", not CUDA)


class Chain:
    """One param group stepped by its sampler's kernel, called as the Optimizer calls it.

    ``params`` in their dtype; ``masters`` (float32) or None; the state created on the
    position (the master where there is one: its buffers float32), as the Optimizer does.
    """

    def __init__(self, case, params, masters=None, lr=LR):
        cls, options, self.temperature = CASES[case]
        self.params = params
        self.masters = masters
        holder = cls(
            [torch.nn.Parameter(torch.zeros(1, device=DEVICE))],
            lr=lr,
            num_data=N,
            temperature=self.temperature,
            seed=SEED,
            fused=False,
            **options,
        )
        self.optimizer = holder
        self.group = {**holder.param_groups[0], "lr": lr, "temperature": self.temperature}
        self.kernel = fused.fused_kernel(holder.definition)
        self.fields = holder.definition.state_fields(self.group)
        self.states = [{} for _ in params]
        for position, state in zip(self.positions(), self.states, strict=True):
            init_state(holder, self.group, position, state)
        self.step_count = 0

    def positions(self):
        if self.masters is None:
            return self.params
        return [p if m is None else m for p, m in zip(self.params, self.masters, strict=True)]

    def step(self, grads, *, scale=None, finite=True):
        largest = torch.tensor([1.0 if finite else float("inf")], dtype=torch.float64)
        count = len(self.params)
        inputs = FusedInput(
            self.params,
            grads,
            {name: [state.get(name) for state in self.states] for name in self.fields},
            [fused.fused_noise_seed(SEED, self.step_count, 1000 + i) for i in range(count)],
            [0] * count,
            [largest.to(DEVICE)] * count,
            grad_scales=None
            if scale is None
            else [torch.tensor([scale], dtype=torch.float32, device=DEVICE)] * count,
            masters=self.masters,
        )
        new = self.kernel.launch(self.group, inputs)
        for name in self.fields:
            for state, value in zip(self.states, new[name], strict=True):
                if value is None:
                    state.pop(name, None)
                else:
                    state[name] = value
        self.step_count += 1

    def buffers(self):
        """Every tensor of the state but the host counts, by parameter and name."""
        host = set(self.optimizer.host_state)
        return [
            {n: v for n, v in state.items() if isinstance(v, torch.Tensor) and n not in host}
            for state in self.states
        ]


def values(dtype=torch.float32, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator).to(dtype).to(DEVICE) for shape in SHAPES]


def gradient_steps(steps, dtype=torch.float32, seed=2):
    return [values(dtype, seed + 10 * k) for k in range(steps)]


def assert_same_state(a, b):
    for x, y in zip(a.buffers(), b.buffers(), strict=True):
        assert x.keys() == y.keys()
        for name in x:
            assert x[name].dtype == y[name].dtype, name
            assert torch.equal(x[name], y[name]), name


def correctly_rounded_quotient(g, scale):
    """``g / scale``, correctly rounded on every device: a tensor divisor (CUDA divides
    by a Python number as a multiplication by its reciprocal, off by an ulp here and
    there; by a tensor it divides)."""
    return g / torch.full_like(g, scale)


# ------------------------------------------------------------------ GradScaler scales
@pytest.mark.parametrize("scale", [1024.0, 3.0], ids=["s1024", "s3"])
@pytest.mark.parametrize("case", CASES)
def test_a_scaled_gradient_is_read_as_g_over_s(case, scale):
    """Three steps on gradients ``g`` with scale ``s``, against three steps on ``g / s``
    (torch's float32 division) without one: parameters and every buffer bit for bit. The
    kernel divides in float64 and rounds once to float32: the correctly rounded quotient,
    which is torch's float32 division, so even s = 3 agrees bit for bit (and the pooled
    preconditioner, computed by torch before the kernel, reads the same quotient)."""
    scaled = Chain(case, values())
    plain = Chain(case, values())
    for grads in gradient_steps(3):
        scaled.step(grads, scale=scale)
        plain.step([correctly_rounded_quotient(g, scale) for g in grads])
    for p, q in zip(scaled.params, plain.params, strict=True):
        assert torch.equal(p, q)
    assert_same_state(scaled, plain)
    assert not torch.equal(scaled.params[0], values()[0])  # it moved


def test_a_float64_gradient_is_divided_in_float64():
    """A float64 parameter's g / s stays in float64 (not rounded to float32: that would
    be off by about 1e-8, relative). Bit for bit in the interpreter; compiled, the kernel
    with and without ``UNSCALE`` are two programs whose float64 multiply-adds the
    compiler may contract into FMAs differently (H100, Triton 3.6: the momentum off by an
    ulp, the division itself exact), so there to a few ulps."""
    scaled = Chain("SGHMC-decay-maximize", values(torch.float64))
    plain = Chain("SGHMC-decay-maximize", values(torch.float64))
    for grads in gradient_steps(2, torch.float64):
        scaled.step(grads, scale=3.0)
        plain.step([correctly_rounded_quotient(g, 3.0) for g in grads])
    if DEVICE.type == "cpu":
        for p, q in zip(scaled.params, plain.params, strict=True):
            assert torch.equal(p, q)
        assert_same_state(scaled, plain)
        return
    pairs = list(zip(scaled.params, plain.params, strict=True)) + [
        (x[name], y[name])
        for x, y in zip(scaled.buffers(), plain.buffers(), strict=True)
        for name in x
    ]
    for a, b in pairs:
        torch.testing.assert_close(a, b, rtol=4 * 2.0**-52, atol=0.0)


def test_a_scale_per_device_splits_no_launch_and_the_gradients_are_never_written(monkeypatch):
    """One scale tensor for the device's tensors: one shared launch for the two small
    tensors (as without a scale), and ``.grad`` keeps every bit."""
    launches = []
    real = _fused_launch._run
    monkeypatch.setattr(_fused_launch, "_run", lambda *a: launches.append(1) or real(*a))
    chain = Chain("SGLD-decay-maximize", values())
    grads = gradient_steps(1)[0]
    kept = [g.clone() for g in grads]
    chain.step(grads, scale=1024.0)
    assert len(launches) == 1
    assert all(torch.equal(g, k) for g, k in zip(grads, kept, strict=True))


# ------------------------------------------------------------------ float32 masters
@pytest.mark.parametrize("dtype", HALVES, ids=str)
@pytest.mark.parametrize("case", WARM)
def test_a_master_steps_as_a_float32_parameter_and_the_parameter_is_its_rounding(
    case, dtype, monkeypatch
):
    """Three steps at T > 0 of half parameters with float32 masters (values the half
    dtype cannot hold) against three steps of float32 parameters holding the masters'
    values, on the same gradients (half numbers, widened): the masters are the float32
    trajectory bit for bit (so the noise is the float32 parameter's), every buffer is
    float32 and equal, the parameters are the masters rounded to nearest. bfloat16:
    shared launches, no scale; float16: one launch per tensor and a scale of 1024."""
    if dtype == torch.float16:
        monkeypatch.setattr(_fused_launch, "MULTI_TENSOR_BLOCKS", 0)
    scale = 1024.0 if dtype == torch.float16 else None
    start = values()
    masters = [m.clone() for m in start]
    half = Chain(case, [m.to(dtype) for m in start], masters)
    single = Chain(case, [m.clone() for m in start])
    assert any(not torch.equal(m.to(dtype).float(), m) for m in start)
    for grads in gradient_steps(3, dtype):
        half.step(grads, scale=scale)
        single.step([g.float() for g in grads], scale=scale)
    for p, m, q in zip(half.params, half.masters, single.params, strict=True):
        assert p.dtype == dtype and m.dtype == torch.float32
        assert torch.equal(m, q)
        assert torch.equal(p, m.to(dtype))
    for kept in half.buffers():
        assert all(v.dtype == torch.float32 for v in kept.values())
        assert kept or CASES[case][0] is SGLD  # (SGLD keeps no buffer)
    assert_same_state(half, single)


def test_tensors_with_and_without_a_master_take_separate_launches(monkeypatch):
    """A bfloat16 parameter with a master and a float32 one: two launches, each as alone."""
    start = values()
    steps = gradient_steps(2, torch.bfloat16)
    single = Chain("SGHMC-decay-maximize", [s.clone() for s in start])
    for grads in steps:
        single.step([g.float() for g in grads])
    launches = []
    real = _fused_launch._run
    monkeypatch.setattr(_fused_launch, "_run", lambda *a: launches.append(a[4]) or real(*a))
    mixed = Chain(
        "SGHMC-decay-maximize",
        [start[0].to(torch.bfloat16), start[1].clone()],
        [start[0].clone(), None],
    )
    for grads in steps:
        mixed.step([grads[0], grads[1].float()])
    assert [flags["MASTER"] for flags in launches] == [True, False] * 2  # two steps
    assert not any(flags.get("NARROW") for flags in launches)
    assert torch.equal(mixed.masters[0], single.params[0])
    assert torch.equal(mixed.params[1], single.params[1])
    assert_same_state(mixed, single)


@pytest.mark.parametrize("dtype", HALVES, ids=str)
def test_adamw_sghmc_with_a_master_at_temperature_zero_is_adamw_on_the_master(dtype):
    """A half parameter that keeps its master at T = 0 takes the kernel's AdamW step on
    it (torch's fused AdamW takes float32 parameters only with float32 gradients): three
    steps with a scale of 1024 against ``torch.optim.AdamW(fused=True)`` on float32
    parameters holding the masters' values, the same gradients widened; the tolerance of
    ``tests/test_fused_adaptive.py`` for float32 (the kernel rounds once, torch each
    operation). The parameter is its master's rounding; the buffers float32."""
    start = values()
    chain = Chain("AdamWSGHMC-T0-amsgrad", [v.to(dtype) for v in start], [v.clone() for v in start])
    twins = [torch.nn.Parameter(v.clone()) for v in start]
    steps = gradient_steps(3, dtype)
    for grads in steps:
        chain.step([g * 1024 for g in grads], scale=1024.0)
    adamw = torch.optim.AdamW(twins, lr=LR, amsgrad=True, weight_decay=0.1, fused=True)
    run_torch(adamw, twins, [[g.float() for g in grads] for grads in steps])
    for p, m, q, state in zip(chain.params, chain.masters, twins, chain.states, strict=True):
        torch.testing.assert_close(m, q.detach(), rtol=2e-5, atol=2e-5)
        assert torch.equal(p, m.to(dtype))
        assert not torch.equal(m, m.to(dtype).float())  # (bits the parameter cannot hold)
        for name in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            assert state[name].dtype == torch.float32
            torch.testing.assert_close(state[name], adamw.state[q][name], rtol=2e-5, atol=2e-7)


# ------------------------------------------------------------------ non-finite steps
@pytest.mark.parametrize("case", CASES)
def test_a_non_finite_flag_writes_nothing(case):
    """A step whose flag is not finite (an infinite gradient) after a normal one: the
    parameters, the masters (T > 0: bfloat16 with masters; T = 0: bfloat16 without) and
    every buffer keep every bit; with a scale, as the GradScaler passes it."""
    start = values()
    warm = CASES[case][2] > 0
    chain = Chain(
        case,
        [v.to(torch.bfloat16) for v in start],
        [v.clone() for v in start] if warm else None,
    )
    grads = gradient_steps(2, torch.bfloat16)
    chain.step(grads[0], scale=1024.0)
    before = [p.clone() for p in chain.params] + [m.clone() for m in chain.masters or []]
    state = [{k: v.clone() for k, v in kept.items()} for kept in chain.buffers()]
    grads[1][0][0, 0] = float("inf")
    chain.step(grads[1], scale=1024.0, finite=False)
    after = list(chain.params) + list(chain.masters or [])
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    for old, new in zip(state, chain.buffers(), strict=True):
        for name in old:
            assert torch.equal(old[name], new[name]), name


# ------------------------------------------------------------------ half at temperature 0
def run_torch(optimizer, params, steps):
    for grads in steps:
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        optimizer.step()


#: the tolerance in units of the dtype's epsilon. torch rounds each operation in the
#: dtype, the kernel once (in float32): per step a few (at most 4) half-units in the last
#: place of values at most max(1, |theta|) in size, so at most 6 over three steps; 16 for
#: RMSprop, whose step divides by the root of a rounded V and whose centered variance
#: subtracts two rounded numbers. (The float32 tests of today allow 8.4 units for SGD,
#: 84 for RMSprop and BAOA: ``tests/test_fused.py``, ``tests/test_fused_adaptive.py``.)
SGD_UNITS, RMSPROP_UNITS = 6, 16

SGD_LIKE = {
    # case: (sampler, options, torch optimizer, its options, tolerance in epsilons)
    "SGLD-decay": (SGLD, {"weight_decay": 0.1}, torch.optim.SGD, {"weight_decay": 0.1}, SGD_UNITS),
    "SGHMC-nesterov": (
        SGHMC,
        {"momentum": 0.9, "nesterov": True, "weight_decay": 0.1},
        torch.optim.SGD,
        {"momentum": 0.9, "nesterov": True, "weight_decay": 0.1},
        SGD_UNITS,
    ),
    "SGHMC-dampening-maximize": (
        SGHMC,
        {"momentum": 0.8, "dampening": 0.3, "maximize": True},
        torch.optim.SGD,
        {"momentum": 0.8, "dampening": 0.3, "maximize": True},
        SGD_UNITS,
    ),
    "BAOA": (
        BAOA,
        {"momentum": 0.8},
        torch.optim.SGD,
        {"momentum": 0.8, "lr": HOT * 1.8 / 2},
        SGD_UNITS,
    ),
    "PSGLD-centered-momentum": (
        PSGLD,
        {"centered": True, "momentum": 0.5, "weight_decay": 0.1},
        torch.optim.RMSprop,
        {"centered": True, "momentum": 0.5, "weight_decay": 0.1},
        RMSPROP_UNITS,
    ),
}


@pytest.mark.parametrize("dtype", HALVES, ids=str)
@pytest.mark.parametrize("case", SGD_LIKE)
def test_a_half_parameter_without_master_at_temperature_zero_is_torchs_step(case, dtype):
    """Three steps at T = 0 of half parameters without masters (state in their dtype)
    against ``torch.optim.SGD``/``RMSprop(foreach=False)`` on the same half tensors, within
    a few units of the dtype's epsilon (``SGD_UNITS``, ``RMSPROP_UNITS``: closer, in those
    units, than today's float32 tests require of float32 parameters)."""
    cls, options, optimizer, torch_options, units = SGD_LIKE[case]
    start = values(dtype)
    CASES["_"] = (cls, options, 0.0)
    try:
        chain = Chain("_", [v.clone() for v in start], lr=HOT)
    finally:
        del CASES["_"]
    twins = [torch.nn.Parameter(v.clone()) for v in start]
    steps = gradient_steps(3, dtype)
    for grads in steps:
        chain.step(grads)
    run_torch(optimizer(twins, **{"lr": HOT, "foreach": False, **torch_options}), twins, steps)
    tol = units * torch.finfo(dtype).eps
    for p, q, first in zip(chain.params, twins, start, strict=True):
        assert p.dtype == dtype
        torch.testing.assert_close(p, q.detach(), rtol=tol, atol=tol)
        assert (p - first).abs().max() > 4 * tol  # it moved, by more than the tolerance
    for kept in chain.buffers():
        assert all(v.dtype == dtype for v in kept.values())


@pytest.mark.parametrize("dtype", HALVES, ids=str)
def test_adamw_sghmc_half_without_master_at_temperature_zero_is_torchs_fused_adamw(dtype):
    """Torch's fused AdamW takes the step itself (``grad_scale`` passed): bit for bit
    ``torch.optim.AdamW(fused=True)`` stepped on the unscaled gradients."""
    start = values(dtype)
    chain = Chain("AdamWSGHMC-T0-amsgrad", [v.clone() for v in start])
    twins = [torch.nn.Parameter(v.clone()) for v in start]
    steps = gradient_steps(3, dtype)
    for grads in steps:
        chain.step([g * 1024 for g in grads], scale=1024.0)
    adamw = torch.optim.AdamW(twins, lr=LR, amsgrad=True, weight_decay=0.1, fused=True)
    run_torch(adamw, twins, steps)
    for p, q, state in zip(chain.params, twins, chain.states, strict=True):
        assert torch.equal(p, q)
        assert torch.equal(state["exp_avg"], adamw.state[q]["exp_avg"])


# ------------------------------------------------------------------ the compiler
COMPILE = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction
    from samplers_as_optim.sgmcmc.adamw_sghmc import triton_kernel as _adamw_sghmc_fused
    from samplers_as_optim.sgmcmc.baoa import triton_kernel as _baoa_fused
    from samplers_as_optim.sgmcmc.psgld import triton_kernel as _psgld_fused
    from samplers_as_optim.sgmcmc.sghmc import triton_kernel as _sghmc_fused
    from samplers_as_optim.sgmcmc.sgld import triton_kernel as _sgld_fused
    from samplers_as_optim.sgmcmc.sgnht import triton_kernel as _sgnht_fused

    INTS = {"count": "i32", "programs": "i32", "numel": "i64", "offset": "i64",
            "seed": "u64"}
    FIXED = {"largest": "*fp64", "partials": "*fp64", "master": "*fp32",
             "grad_scale": "*fp32", "table": "*i64"}
    KERNELS = [_sgld_fused._sgld, _sghmc_fused._sghmc, _sgnht_fused._sgnht,
               _baoa_fused._baoa, _psgld_fused._psgld, _adamw_sghmc_fused._adamw_sghmc]
    # a bfloat16 parameter with a master and a scale, shared launches; one without
    # (NARROW, its state in bfloat16), alone; every other flag on
    VARIANTS = [("bf16", {"MASTER": True, "UNSCALE": True, "MULTI": True, "BF16": True}),
                ("bf16", {"NARROW": True, "UNSCALE": True, "MULTI": False, "BF16": True})]
    compiled = 0
    for kernel in KERNELS:
        fn = JITFunction(kernel)
        for dtype, flags in VARIANTS:
            position = "fp32" if flags.get("MASTER") else dtype
            signature, constants = {}, {"BLOCK": 1024}
            for p in fn.params:
                if p.is_constexpr:
                    signature[p.name] = "constexpr"
                    if p.name != "BLOCK":
                        constants[p.name] = flags.get(p.name, p.name not in
                                                      ("MASTER", "NARROW", "UNSCALE", "MULTI", "BF16"))
                elif p.name == "table" and not flags["MULTI"]:
                    signature[p.name] = "constexpr"
                    constants[p.name] = None
                elif p.name in ("param", "grad", "out"):
                    signature[p.name] = "*" + dtype
                elif p.name in FIXED:
                    signature[p.name] = FIXED[p.name]
                elif p.name in INTS:
                    signature[p.name] = INTS[p.name]
                elif p.name.endswith("_bits") or p.name in (
                        "inner", "row_stride", "rows", "column_stride", "columns"):
                    signature[p.name] = "i64"
                else:  # the buffers: float32 beside a master, the parameter's dtype without
                    signature[p.name] = "*" + position
            if "AMSGRAD" in constants:
                constants["AMSGRAD"] = False  # (temperature 0 only)
            if "UPDATE" in constants:
                constants["UPDATE"] = False  # (the transforms' variant: no master there)
            try:
                source = ASTSource(fn, signature, constants)
            except TypeError as error:  # another Triton's compile API
                print("API", error)
                raise SystemExit(0)
            triton.compile(source, target=GPUTarget("cuda", 90, 32))
            compiled += 1
    print(compiled)
    """
)


def test_the_amp_variants_of_every_kernel_compile_for_a_gpu():
    """Triton's compiler (a process without ``TRITON_INTERPRET``) compiles each kernel
    with a bfloat16 parameter, a float32 master and a scale, and with a bfloat16 parameter
    without master, to a cubin for sm_90 on the CPU. Nothing is run."""
    environment = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    environment["TRITON_DEFAULT_FP_FUSION"] = "1"
    done = subprocess.run(
        [sys.executable, "-c", COMPILE],
        capture_output=True,
        text=True,
        timeout=300,
        env=environment,
    )
    if done.returncode and "ptxas" in done.stderr and "No such file" in done.stderr:
        pytest.skip("Triton's ptxas is missing")
    assert done.returncode == 0, done.stderr[-3000:]
    if done.stdout.startswith("API"):
        pytest.skip(f"this Triton's compile API differs from 3.9's: {done.stdout.strip()}")
    assert done.stdout.split()[-1] == "12", done.stdout
