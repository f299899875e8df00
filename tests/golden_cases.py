"""The golden cases: tiny deterministic chains run through the public API only.

Shared by ``tests/data/make_golden.py`` (which records them into
``tests/data/golden_trajectories.json`` and ``tests/data/golden_checkpoints.pt``) and
``tests/test_golden.py`` (which reruns them and compares bit for bit), so that the two run
exactly the same code. Why they exist and when regenerating them is legitimate: see
``tests/test_golden.py``.

Only public names are used (``from samplers_as_optim import ...``,
``samplers_as_optim.transforms``): private modules will move in the reorganisation, and
the cases must run unchanged before and after it.

The problem. A model of 10 parameters in 3 tensors (``Linear(3, 2)`` with its bias, a
tanh, then a bias-free ``Linear(2, 1)``), its weights drawn from a seeded
``torch.Generator``; 13 examples ``(x, y)`` from another; minibatch ``k`` is 5 of them,
picked by a fixed rule; the loss is the mean squared error, ``num_data=13``. Every
optimizer and transform gets an explicit seed, and every case runs under a given seed of
torch's global RNG (the generator uses one, the test another), so that a hidden use of
the global RNG shows up as a failure.

A case returns ``{name: [float, ...]}``: ``params.<k>`` the parameters after step ``k``
(flattened, in ``model.parameters()`` order), and for some cases ``state.<...>`` (the
final optimizer or transform state, every tensor and number of it flattened, by path),
``diag.<k>.<...>`` (HMC's diagnostics after step ``k``) or ``lr.<k>``/``temperature.<k>``
(the param groups' values after step ``k``). Entries under ``state.`` and ``diag.`` may
grow (new state entries); the test only requires the recorded ones to be there, equal.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torchopt
from torch import Tensor, nn
from torch.nn import functional as F

from samplers_as_optim import (
    BAOA,
    HMC,
    PSGLD,
    SGHMC,
    SGLD,
    SGNHT,
    CyclicalSGMCMC,
    ParallelEnsemble,
    transforms,
)

DATA_DIR = Path(__file__).with_name("data")
GOLDEN_JSON = DATA_DIR / "golden_trajectories.json"
GOLDEN_CHECKPOINTS = DATA_DIR / "golden_checkpoints.pt"
#: the recordings of CPUs that round differently from the one ``GOLDEN_JSON`` was made on,
#: one file per :func:`rounding_probe` (same commit, same cases, same checkpoints loaded)
MACHINE_DIR = DATA_DIR / "golden_machines"


def rounding_probe() -> str:
    """A fingerprint of how this CPU's torch build rounds the golden cases' kind of math.

    torch's vectorised CPU kernels round some elements differently on different
    processors (the SIMD width and FMA decide where a tensor's tail is computed and
    whether ``a + alpha*b`` is rounded once or twice), so one commit's golden numbers
    differ by an ulp or so between machines while every machine is deterministic. The
    probe runs torch's own optimizers (no code of this package) on tensors of the cases'
    awkward sizes, float64 and float32, single-tensor and foreach, with seeded noise, and
    hashes the bits: machines with one probe round the cases alike.
    """
    import hashlib

    digest = hashlib.sha256()
    for dtype in (torch.float64, torch.float32):
        for foreach in (False, True):
            generator = torch.Generator().manual_seed(3)
            params = [torch.randn(n, generator=generator, dtype=dtype) for n in (6, 2, 2, 10)]
            params = [nn.Parameter(p) for p in params]
            optimizers = [
                torch.optim.SGD(params, lr=LR, foreach=foreach),
                torch.optim.SGD(
                    params, lr=LR, momentum=0.9, weight_decay=WEIGHT_DECAY, foreach=foreach
                ),
                torch.optim.RMSprop(params, lr=LR, weight_decay=WEIGHT_DECAY, foreach=foreach),
                torch.optim.AdamW(params, lr=LR, foreach=foreach),
            ]
            for opt in optimizers:
                for _ in range(3):
                    for param in params:
                        noise = torch.randn(param.shape, generator=generator, dtype=dtype)
                        param.grad = param.detach() * (1 / NUM_DATA) + noise.mul(
                            math.sqrt(2 * LR / NUM_DATA)
                        )
                    opt.step()
            for param in params:
                digest.update(" ".join(v.hex() for v in numbers(param)).encode())
    return digest.hexdigest()[:16]


NUM_DATA = 13  # not a power of two, nor BATCH: a reordered product or quotient shows
BATCH = 5
STEPS = 8
LR = 0.05
WEIGHT_DECAY = 1e-2
#: before step index JUMP_AT (the fifth step) every group's lr is multiplied by LR_FACTOR,
#: as a scheduler does; the transforms get the same values as a schedule
JUMP_AT = 4
LR_FACTOR = 0.1
#: the checkpoints are taken after this many steps; the continuation runs to STEPS
CHECKPOINT_AT = 4
#: the seed of every optimizer and transform; a resumed one is built with OTHER_SEED, which
#: the loaded state must override
SEED = 0
OTHER_SEED = 12345
#: torch's global RNG is seeded with this when recording, with TEST_GLOBAL_SEED in the test
RECORD_GLOBAL_SEED = 0
TEST_GLOBAL_SEED = 271828


# ---------------------------------------------------------------------------- the problem
def make_data(dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """NUM_DATA examples, drawn in float64 from a seeded generator, then cast."""
    generator = torch.Generator().manual_seed(20261126)
    x = torch.randn(NUM_DATA, 3, generator=generator, dtype=torch.float64)
    y = torch.randn(NUM_DATA, 1, generator=generator, dtype=torch.float64)
    return x.to(dtype), y.to(dtype)


def make_model(dtype: torch.dtype) -> nn.Module:
    """Linear(3, 2) + tanh + Linear(2, 1, bias=False): 10 parameters in 3 tensors."""
    model = nn.Sequential(nn.Linear(3, 2), nn.Tanh(), nn.Linear(2, 1, bias=False))
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(0.5 * torch.randn(param.shape, generator=generator, dtype=torch.float64))
    return model.to(dtype)


def batch_index(k: int) -> list[int]:
    """The rows of minibatch ``k``."""
    return [(5 * k + j) % NUM_DATA for j in range(BATCH)]


def lr_at(k: int, lr: float = LR) -> float:
    """The lr of step index ``k`` (the transforms' schedule; the Optimizers' jump)."""
    return lr * LR_FACTOR if k >= JUMP_AT else lr


# ---------------------------------------------------------------------------- recording
def numbers(value: Any) -> list[float]:
    """A tensor or number as a flat list of Python floats (exact for float32/float64).

    A Python number is taken as it is (not through ``torch.as_tensor``, which would round
    a float to float32), so that a state entry that was a float and becomes a 0-d float64
    tensor of the same value records the same.
    """
    if isinstance(value, (bool, int, float)):
        return [float(value)]
    tensor = torch.as_tensor(value).detach().cpu()
    return [float(v) for v in tensor.flatten().tolist()]


def flatten_tree(prefix: str, value: Any, out: dict[str, list[float]]) -> None:
    """Every tensor and number under ``value`` into ``out``, by path (None, str skipped)."""
    if value is None or isinstance(value, str):
        return
    if isinstance(value, dict):
        for key in sorted(value, key=str):
            flatten_tree(f"{prefix}.{key}", value[key], out)
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            flatten_tree(f"{prefix}.{index}", item, out)
    else:
        out[prefix] = numbers(value)


def flat_params(params: list[Tensor]) -> list[float]:
    return [v for p in params for v in numbers(p)]


def to_hex(record: dict[str, list[float]]) -> dict[str, list[str]]:
    return {key: [float(v).hex() for v in values] for key, values in record.items()}


# ---------------------------------------------------------------------------- chains
class Chain:
    """One chain of a front end: ``step(k)``, the parameters, a checkpoint, the state."""

    def step(self, k: int) -> None:
        raise NotImplementedError

    def extra(self, k: int) -> dict[str, list[float]]:
        """What to record after step index ``k`` besides the parameters."""
        return {}

    def params(self) -> list[Tensor]:
        raise NotImplementedError

    def load_params(self, params: list[Tensor]) -> None:
        raise NotImplementedError

    def checkpoint(self) -> dict[str, Any]:
        raise NotImplementedError

    def restore(self, checkpoint: dict[str, Any]) -> None:
        raise NotImplementedError

    def final_state(self) -> dict[str, list[float]]:
        return {}


class OptimizerChain(Chain):
    """A ``torch.optim.Optimizer`` sampler (and optionally a scheduler) on the problem."""

    def __init__(
        self,
        make_optimizer: Callable[[nn.Module, int], Any],
        seed: int,
        *,
        dtype: torch.dtype = torch.float64,
        scheduler: Callable[[Any], Any] | None = None,
        maximize: bool = False,
    ) -> None:
        self.model = make_model(dtype)
        self.x, self.y = make_data(dtype)
        self.optimizer = make_optimizer(self.model, seed)
        self.scheduler = None if scheduler is None else scheduler(self.optimizer)
        self.maximize = maximize

    def step(self, k: int) -> None:
        if k == JUMP_AT and self.scheduler is None:
            for group in self.optimizer.param_groups:
                group["lr"] *= LR_FACTOR
        index = batch_index(k)
        self.optimizer.zero_grad()
        loss = F.mse_loss(self.model(self.x[index]), self.y[index])
        (-loss if self.maximize else loss).backward()
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()

    def extra(self, k: int) -> dict[str, list[float]]:
        if self.scheduler is None:
            return {}
        groups = self.optimizer.param_groups
        return {
            f"lr.{k + 1}": [float(group["lr"]) for group in groups],
            f"temperature.{k + 1}": [float(group["temperature"]) for group in groups],
        }

    def params(self) -> list[Tensor]:
        return [p.detach().clone() for p in self.model.parameters()]

    def load_params(self, params: list[Tensor]) -> None:
        with torch.no_grad():
            for param, value in zip(self.model.parameters(), params, strict=True):
                param.copy_(value)

    def checkpoint(self) -> dict[str, Any]:
        saved = {"optimizer": copy.deepcopy(self.optimizer.state_dict())}
        if self.scheduler is not None:
            saved["scheduler"] = copy.deepcopy(self.scheduler.state_dict())
        return saved

    def restore(self, checkpoint: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(checkpoint["optimizer"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(checkpoint["scheduler"])

    def final_state(self) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {}
        flatten_tree("state", self.optimizer.state_dict()["state"], out)
        return out


class HMCChain(OptimizerChain):
    """HMC on the full batch, by closure or ``loss_fn``; ``end_warmup()`` before a step."""

    def __init__(
        self,
        make_optimizer: Callable[[nn.Module, int], Any],
        seed: int,
        *,
        use_loss_fn: bool = False,
        end_warmup_at: int | None = None,
    ) -> None:
        super().__init__(make_optimizer, seed)
        self.use_loss_fn = use_loss_fn
        self.end_warmup_at = end_warmup_at

    def closure(self) -> Tensor:
        self.optimizer.zero_grad()
        loss = F.mse_loss(self.model(self.x), self.y)
        loss.backward()
        return loss

    def loss_fn(self, params: dict[str, Tensor]) -> Tensor:
        prediction = torch.func.functional_call(self.model, params, (self.x,))
        return F.mse_loss(prediction, self.y)

    def step(self, k: int) -> None:
        if k == self.end_warmup_at:
            self.optimizer.end_warmup()
        if self.use_loss_fn:
            self.optimizer.step(loss_fn=self.loss_fn)
        else:
            self.optimizer.step(self.closure)

    def extra(self, k: int) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {}
        flatten_tree(f"diag.{k + 1}", self.optimizer.diagnostics, out)
        return out


class TransformChain(Chain):
    """A torchopt transform in a pure ``torch.func`` loop with ``torchopt.apply_updates``."""

    def __init__(self, make_transform: Callable[[int], Any], seed: int) -> None:
        self.model = make_model(torch.float64)
        self.x, self.y = make_data(torch.float64)
        self.names = [name for name, _ in self.model.named_parameters()]
        self.tensors = {name: p.detach().clone() for name, p in self.model.named_parameters()}
        self.transform = make_transform(seed)
        self.state = self.transform.init(self.tensors)

    def loss(self, params: dict[str, Tensor], x: Tensor, y: Tensor) -> Tensor:
        return F.mse_loss(torch.func.functional_call(self.model, params, (x,)), y)

    def step(self, k: int) -> None:
        index = batch_index(k)
        grads = torch.func.grad(self.loss)(self.tensors, self.x[index], self.y[index])
        updates, self.state = self.transform.update(grads, self.state, params=self.tensors)
        self.tensors = torchopt.apply_updates(self.tensors, updates)

    def params(self) -> list[Tensor]:
        return [self.tensors[name].detach().clone() for name in self.names]

    def load_params(self, params: list[Tensor]) -> None:
        self.tensors = {name: p.clone() for name, p in zip(self.names, params, strict=True)}

    def checkpoint(self) -> dict[str, Any]:
        # the fields as plain containers, and the state's public name: no class path is
        # pickled (the state classes live in private modules, which will move)
        return {
            "state_class": type(self.state).__name__,
            "fields": copy.deepcopy(dict(self.state._asdict())),
        }

    def restore(self, checkpoint: dict[str, Any]) -> None:
        self.state = getattr(transforms, checkpoint["state_class"])(**checkpoint["fields"])

    def final_state(self) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {}
        flatten_tree("state", dict(self.state._asdict()), out)
        return out


# ---------------------------------------------------------------------------- the samplers
#: sampler -> (Optimizer class, transform, extra hyperparameters, temperatures)
SAMPLERS: dict[str, tuple[Any, Any, dict[str, Any], tuple[float, ...]]] = {
    "sgld": (SGLD, transforms.sgld, {}, (0.0, 1.0)),
    "sghmc": (SGHMC, transforms.sghmc, {"momentum": 0.9}, (0.0, 1.0)),
    "sgnht": (SGNHT, transforms.sgnht, {"momentum": 0.9}, (1.0, 0.3)),  # needs T > 0
    # Li et al.'s moving elementwise preconditioner, the default when these were recorded
    # (0.2 pools and freezes it by default; its chains are not recorded here)
    "psgld": (
        PSGLD,
        transforms.psgld,
        {"alpha": 0.9, "preconditioner": "elementwise", "preconditioner_warmup": None},
        (0.0, 1.0),
    ),
    "baoa": (BAOA, transforms.baoa, {"momentum": 0.9}, (0.0, 1.0)),
}


def _tname(temperature: float) -> str:
    return f"T{temperature:g}"


def optimizer_chain(
    sampler: str,
    temperature: float,
    *,
    dtype: torch.dtype = torch.float64,
    named: bool = False,
    **options: Any,
) -> Callable[[int], Chain]:
    """A factory ``seed -> chain`` of the sampler's Optimizer, one param group."""
    cls, _, hyper, _ = SAMPLERS[sampler]
    maximize = bool(options.get("maximize", False))

    def make(model: nn.Module, seed: int) -> Any:
        params = model.named_parameters() if named else model.parameters()
        return cls(
            params,
            lr=LR,
            num_data=NUM_DATA,
            temperature=temperature,
            weight_decay=WEIGHT_DECAY,
            seed=seed,
            **{**hyper, **options},
        )

    return lambda seed: OptimizerChain(make, seed, dtype=dtype, maximize=maximize)


def transform_chain(sampler: str, temperature: float, **options: Any) -> Callable[[int], Chain]:
    """A factory ``seed -> chain`` of the sampler's transform; lr a schedule with the jump."""
    _, factory, hyper, _ = SAMPLERS[sampler]

    def make(seed: int) -> Any:
        return factory(
            lr_at,
            num_data=NUM_DATA,
            temperature=temperature,
            weight_decay=WEIGHT_DECAY,
            seed=seed,
            **{**hyper, **options},
        )

    return lambda seed: TransformChain(make, seed)


def two_groups_chain(seed: int) -> Chain:
    """SGHMC with two param groups: the first layer with weight decay, the last at 2 lr."""

    def make(model: nn.Module, seed: int) -> Any:
        first, last = model[0], model[2]
        groups = [
            {"params": list(first.parameters()), "weight_decay": WEIGHT_DECAY},
            {"params": list(last.parameters()), "lr": 2 * LR},
        ]
        return SGHMC(groups, lr=LR, momentum=0.9, num_data=NUM_DATA, temperature=1.0, seed=seed)

    return OptimizerChain(make, seed)


def cyclical_chain(seed: int) -> Chain:
    """SGHMC driven by CyclicalSGMCMC: 2 cycles of 6 steps, half exploration (T = 0)."""

    def make(model: nn.Module, seed: int) -> Any:
        return SGHMC(
            model.parameters(),
            lr=LR,
            momentum=0.9,
            num_data=NUM_DATA,
            temperature=1.0,
            weight_decay=WEIGHT_DECAY,
            seed=seed,
        )

    def scheduler(optimizer: Any) -> Any:
        return CyclicalSGMCMC(optimizer, cycle_length=6, num_cycles=2, exploration=0.5)

    return OptimizerChain(make, seed, scheduler=scheduler)


def hmc_chain(**options: Any) -> Callable[..., Chain]:
    """A factory ``seed -> chain`` of HMC (num_steps=5, lr=0.05) on the full batch."""
    use_loss_fn = options.pop("use_loss_fn", False)
    end_warmup_at = options.pop("end_warmup_at", None)
    named = options.pop("named", False)

    def make(model: nn.Module, seed: int) -> Any:
        params = model.named_parameters() if named else model.parameters()
        return HMC(
            params, lr=LR, num_steps=5, num_data=NUM_DATA, seed=seed, **options
        )  # fmt: skip

    return lambda seed: HMCChain(make, seed, use_loss_fn=use_loss_fn, end_warmup_at=end_warmup_at)


# ---------------------------------------------------------------------------- runners
def run_chain(chain: Chain, start: int, stop: int) -> dict[str, list[float]]:
    """Steps ``start..stop-1``, recording the parameters (and extras) after each."""
    out: dict[str, list[float]] = {}
    for k in range(start, stop):
        chain.step(k)
        out[f"params.{k + 1}"] = flat_params(chain.params())
        out.update(chain.extra(k))
    return out


def chain_case(factory: Callable[[int], Chain], steps: int = STEPS) -> Callable[[], Any]:
    def case() -> dict[str, list[float]]:
        chain = factory(SEED)
        out = run_chain(chain, 0, steps)
        out.update(chain.final_state())
        return out

    return case


def hmc_warmup_case(warmup_steps: int, steps: int, **options: Any) -> Callable[[], Any]:
    """HMC through ``warmup(closure, warmup_steps)``, then ``steps`` steps by closure."""

    def case() -> dict[str, list[float]]:
        chain = hmc_chain(**options)(SEED)
        assert isinstance(chain, HMCChain)
        chain.optimizer.warmup(chain.closure, warmup_steps)
        out = {"params.warmup": flat_params(chain.params())}
        flatten_tree("diag.warmup", chain.optimizer.diagnostics, out)
        flatten_tree("state.after_warmup", chain.optimizer.state_dict()["state"], out)
        out.update(run_chain(chain, 0, steps))
        out.update(chain.final_state())
        return out

    return case


def ensemble_case() -> dict[str, list[float]]:
    """A ParallelEnsemble of 3 MLPs (seeded init) trained by SGHMC for 5 steps."""

    def factory() -> nn.Module:
        return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double()

    ensemble = ParallelEnsemble(factory, 3, seed=0)
    x, y = make_data(torch.float64)
    optimizer = SGHMC(
        ensemble.parameters(),
        lr=LR,
        momentum=0.9,
        num_data=NUM_DATA,
        temperature=1.0,
        weight_decay=WEIGHT_DECAY,
        seed=SEED,
    )

    def stacked() -> list[float]:
        tensors = ensemble.stacked(buffers=False)
        return [v for name in sorted(tensors) for v in numbers(tensors[name])]

    out = {"params.0": stacked()}
    for k in range(5):
        index = batch_index(k)
        optimizer.zero_grad()
        loss = ensemble.loss(F.mse_loss, ensemble(x[index]), y[index])
        loss.backward()
        optimizer.step()
        out[f"params.{k + 1}"] = stacked()
    flatten_tree("state", optimizer.state_dict()["state"], out)
    return out


def _trajectory_cases() -> dict[str, Callable[[], dict[str, list[float]]]]:
    cases: dict[str, Callable[[], dict[str, list[float]]]] = {}
    for sampler, (_, _, _, temperatures) in SAMPLERS.items():
        for temperature in temperatures:
            t = _tname(temperature)
            cases[f"{sampler}-optimizer-{t}"] = chain_case(optimizer_chain(sampler, temperature))
            cases[f"{sampler}-transform-{t}"] = chain_case(transform_chain(sampler, temperature))
        cases[f"{sampler}-optimizer-T1-float32"] = chain_case(
            optimizer_chain(sampler, 1.0, dtype=torch.float32)
        )
        cases[f"{sampler}-optimizer-T1-foreach"] = chain_case(
            optimizer_chain(sampler, 1.0, foreach=True)
        )
    # options that take other paths through the kernels
    cases["sghmc-optimizer-T1-two-groups"] = chain_case(two_groups_chain)
    cases["sghmc-optimizer-T1-named"] = chain_case(optimizer_chain("sghmc", 1.0, named=True))
    cases["sghmc-optimizer-T1-nonfinite-skip"] = chain_case(
        optimizer_chain("sghmc", 1.0, nonfinite="skip")
    )
    cases["sghmc-optimizer-T0-nesterov"] = chain_case(optimizer_chain("sghmc", 0.0, nesterov=True))
    cases["sghmc-optimizer-T0-dampening"] = chain_case(
        optimizer_chain("sghmc", 0.0, dampening=0.25)
    )
    cases["sgld-optimizer-T1-maximize"] = chain_case(optimizer_chain("sgld", 1.0, maximize=True))
    cases["sgnht-optimizer-T1-ding"] = chain_case(
        optimizer_chain("sgnht", 1.0, kinetic_energy="ding")
    )
    cases["psgld-optimizer-T0-centered-momentum"] = chain_case(
        optimizer_chain("psgld", 0.0, centered=True, momentum=0.5)
    )
    cases["psgld-optimizer-T1-correction"] = chain_case(
        optimizer_chain("psgld", 1.0, correction=True)
    )
    cases["psgld-transform-T1-correction"] = chain_case(
        transform_chain("psgld", 1.0, correction=True)
    )
    # the scheduler, HMC, the ensemble
    cases["sghmc-cyclical"] = chain_case(cyclical_chain, steps=12)
    cases["hmc-warmup-closure"] = hmc_warmup_case(10, 6, target_accept=0.8)
    cases["hmc-warmup-mass-adapt"] = hmc_warmup_case(20, 3, target_accept=0.8, mass="adapt")
    cases["hmc-loss-fn-jitter"] = chain_case(
        hmc_chain(use_loss_fn=True, named=True, jitter=0.1), steps=6
    )
    cases["ensemble-sghmc"] = ensemble_case
    return cases


#: case name -> a function returning the record
#: Cases whose behaviour changed deliberately after the first recordings, and why: each
#: is held to a recording that says it was made after that change (its ``"revised"``
#: entry, written by ``make_golden.py --revise`` from a clean clone of the commit that
#: made it), and skipped, with the reason, on a CPU whose recording predates it.
PSGLD_FLOOR = (
    "PSGLD's sampling preconditioner floored by its prior, V/c >= T weight_decay / N "
    "(issue #36: a chain started at a mode no longer builds it from vanishing gradients)"
)
REVISED: dict[str, str] = {
    name: PSGLD_FLOOR
    for name in (
        "psgld-optimizer-T1",
        "psgld-transform-T1",
        "psgld-optimizer-T1-float32",
        "psgld-optimizer-T1-foreach",
        "psgld-optimizer-T1-correction",
        "psgld-transform-T1-correction",
        "psgld-default-optimizer-T1",
        "psgld-default-transform-T1",
        "psgld-optimizer-T1-skip",
        "fused-psgld-T1-float32",
        "fused-psgld-T1-float64",
        "fused-psgld-T1-skip",
    )
}


def revision_pending(name: str, recording: dict[str, Any]) -> str | None:
    """Why ``recording`` cannot hold case ``name`` (made before its revision), or None."""
    reason = REVISED.get(name)
    if reason is None or recording.get("revised", {}).get(name) == reason:
        return None
    return (
        f"{name} changed deliberately ({reason}) after this CPU's recording "
        f"({recording['recorded_from']['commit']}): record it from that change's commit in "
        "a clean clone, tests/data/make_golden.py --revise"
    )


TRAJECTORY_CASES = _trajectory_cases()


def _checkpoint_cases() -> dict[str, Callable[[int], Chain]]:
    cases: dict[str, Callable[[int], Chain]] = {}
    for sampler in SAMPLERS:
        cases[f"{sampler}-optimizer-T1"] = optimizer_chain(sampler, 1.0)
    for sampler in SAMPLERS:
        cases[f"{sampler}-transform-T1"] = transform_chain(sampler, 1.0)
    # mid-warm-up: the dual averaging's state is in the checkpoint; it ends at step 6
    cases["hmc-warmup"] = hmc_chain(target_accept=0.8, end_warmup_at=6)
    cases["sghmc-cyclical"] = cyclical_chain
    return cases


#: case name -> a factory ``seed -> chain``, checkpointed after CHECKPOINT_AT steps
CHECKPOINT_CASES = _checkpoint_cases()


def with_global_seed(seed: int, function: Callable[[], Any]) -> Any:
    """Run ``function`` with torch's global RNG seeded, restoring the RNG afterwards."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return function()


def run_trajectory(name: str, global_seed: int) -> dict[str, list[float]]:
    return with_global_seed(global_seed, TRAJECTORY_CASES[name])


def record_checkpoint(name: str, global_seed: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The checkpoint after CHECKPOINT_AT steps and the uninterrupted continuation."""

    def run() -> tuple[dict[str, Any], dict[str, Any]]:
        chain = CHECKPOINT_CASES[name](SEED)
        run_chain(chain, 0, CHECKPOINT_AT)
        saved = {"params": chain.params(), **chain.checkpoint()}
        continuation = run_chain(chain, CHECKPOINT_AT, STEPS)
        continuation.update(chain.final_state())
        return saved, continuation

    return with_global_seed(global_seed, run)


def resume_checkpoint(name: str, saved: dict[str, Any], global_seed: int) -> dict[str, Any]:
    """A fresh chain (other seed), the saved params and state loaded, run to STEPS."""

    saved = copy.deepcopy(saved)  # a loaded state may be updated in place

    def run() -> dict[str, Any]:
        chain = CHECKPOINT_CASES[name](OTHER_SEED)
        chain.load_params(saved["params"])
        chain.restore(saved)
        continuation = run_chain(chain, CHECKPOINT_AT, STEPS)
        continuation.update(chain.final_state())
        return continuation

    return with_global_seed(global_seed, run)


def mismatches(expected: dict[str, list[str]], actual: dict[str, list[float]]) -> list[str]:
    """Where ``actual`` differs from the recorded ``expected`` (hex strings), described.

    Every recorded entry must be there and equal bit for bit. Extra entries are allowed
    under ``state.`` and ``diag.`` only (a state may gain entries); elsewhere (the
    parameters) they are a difference too.
    """
    found = to_hex(actual)
    problems = []
    for key, values in expected.items():
        if key not in found:
            problems.append(f"{key}: missing")
        elif found[key] != values:
            if len(found[key]) != len(values):
                problems.append(f"{key}: {len(found[key])} numbers, recorded {len(values)}")
                continue
            old = [float.fromhex(v) for v in values]
            new = actual[key]
            diff = [i for i, (a, b) in enumerate(zip(old, new, strict=True)) if a.hex() != b.hex()]
            worst = max(
                (abs(new[i] - old[i]) for i in diff if math.isfinite(new[i] - old[i])), default=0
            )
            problems.append(
                f"{key}: {len(diff)} of {len(values)} differ (first at [{diff[0]}]: "
                f"{new[diff[0]]!r}, recorded {old[diff[0]]!r}; largest difference {worst:.3g})"
            )
    for key in found:
        if key not in expected and not key.startswith(("state.", "diag.")):
            problems.append(f"{key}: not recorded")
    return problems
