"""Golden cases recorded before the step pipeline (issue #35): the paths the first set lacks.

``tests/golden_cases.py`` froze the samplers before the reorganisation into definitions;
it predates the AdamW twin, PSGLD's pooled and frozen preconditioner (today's default),
GradScaler, float32 masters and the fused kernels. The step pipeline moves all of these,
so they are frozen here first, on the same problem (``golden_cases``' model, data,
minibatches, lr jump and seeds), through the public API plus one test switch:

* unfused: ``AdamWSGHMC`` at T = 0 and 1 (Optimizer and transform), ``PSGLD`` with its
  default preconditioner frozen after 3 steps (Optimizer and transform), SGHMC and the
  twin under ``torch.amp.GradScaler`` (one overflowing step included), SGHMC on a
  bfloat16 model (its float32 master), and ``nonfinite="skip"`` with a NaN gradient for
  PSGLD and the twin;
* fused (``fused=True``): every sampler's kernel, float32 and float64, the same
  GradScaler, bfloat16 and skip cases, and the SGHMC transform's kernel. Without CUDA the
  kernels run on CPU tensors in Triton's interpreter, which
  ``fused.RUN_ON_CPU_UNDER_INTERPRETER`` lets the fused path take (the switch the fused
  tests use; it is the one private name here, and moves with the code if it moves).

Recorded by ``python tests/data/make_golden.py --pipeline`` into
``tests/data/golden_pipeline/<rounding probe>.json``; checked by
``tests/test_golden_pipeline.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from triton_interpreter import use_interpreter

CUDA = use_interpreter()

from golden_cases import (  # noqa: E402
    DATA_DIR,
    LR,
    NUM_DATA,
    WEIGHT_DECAY,
    OptimizerChain,
    batch_index,
    chain_case,
    lr_at,
    with_global_seed,
)
from golden_cases import TransformChain as _TransformChain  # noqa: E402

from samplers_as_optim import (  # noqa: E402
    BAOA,
    PSGLD,
    SGHMC,
    SGLD,
    SGNHT,
    AdamWSGHMC,
    transforms,
)

__all__ = ["FUSED", "PIPELINE_CASES", "PIPELINE_DIR", "run_pipeline_case"]

#: one recording per rounding probe (``golden_cases.rounding_probe``)
PIPELINE_DIR = DATA_DIR / "golden_pipeline"

#: the step whose gradient is NaN (skip cases) or overflows the scaler (GradScaler cases)
BAD_STEP = 2
WARMUP = 3  # the preconditioners' warm-up, so that they freeze within the STEPS

#: sampler -> (class, hyperparameters)
SAMPLERS: dict[str, tuple[Any, dict[str, Any]]] = {
    "sgld": (SGLD, {}),
    "sghmc": (SGHMC, {"momentum": 0.9}),
    "sgnht": (SGNHT, {"momentum": 0.9}),
    "psgld": (PSGLD, {"preconditioner_warmup": WARMUP}),
    "baoa": (BAOA, {"momentum": 0.9}),
    "adamw_sghmc": (AdamWSGHMC, {"preconditioner_warmup": WARMUP}),
}


class BadStepChain(OptimizerChain):
    """A chain whose step ``BAD_STEP`` has a NaN gradient, or runs under a GradScaler."""

    def __init__(self, *args: Any, scaler: bool = False, nan: bool = False, **kw: Any):
        super().__init__(*args, **kw)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if scaler else None
        self.nan = nan

    def step(self, k: int) -> None:
        if self.scaler is None and not self.nan:
            return super().step(k)
        index = batch_index(k)
        self.optimizer.zero_grad()
        loss = F.mse_loss(self.model(self.x[index]), self.y[index])
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward()
        if k == BAD_STEP:  # a NaN for the skip policy, an inf for the scaler's verdict
            first = next(iter(self.model.parameters()))
            assert first.grad is not None
            first.grad.view(-1)[0] = float("nan") if self.nan else float("inf")
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()


def optimizer_case(
    sampler: str,
    temperature: float,
    *,
    dtype: torch.dtype = torch.float64,
    scaler: bool = False,
    nan: bool = False,
    **options: Any,
) -> Callable[[], dict[str, list[float]]]:
    cls, hyper = SAMPLERS[sampler]

    def make(model: nn.Module, seed: int) -> Any:
        return cls(
            model.parameters(),
            lr=LR,
            num_data=NUM_DATA,
            temperature=temperature,
            weight_decay=WEIGHT_DECAY,
            seed=seed,
            **{**hyper, **options},
        )

    return chain_case(lambda seed: BadStepChain(make, seed, dtype=dtype, scaler=scaler, nan=nan))


def transform_case(
    factory: Callable[..., Any], temperature: float, **options: Any
) -> Callable[[], dict[str, list[float]]]:
    def make(seed: int) -> Any:
        return factory(
            lr_at,
            num_data=NUM_DATA,
            temperature=temperature,
            weight_decay=WEIGHT_DECAY,
            seed=seed,
            **options,
        )

    return chain_case(lambda seed: _TransformChain(make, seed))


def _cases() -> dict[str, Callable[[], dict[str, list[float]]]]:
    cases: dict[str, Callable[[], dict[str, list[float]]]] = {
        "adamw_sghmc-optimizer-T0": optimizer_case("adamw_sghmc", 0.0),
        "adamw_sghmc-optimizer-T1": optimizer_case("adamw_sghmc", 1.0),
        "adamw_sghmc-optimizer-T1-float32": optimizer_case("adamw_sghmc", 1.0, dtype=torch.float32),
        "adamw_sghmc-transform-T1": transform_case(
            transforms.adamw_sghmc, 1.0, preconditioner_warmup=WARMUP
        ),
        "psgld-default-optimizer-T1": optimizer_case("psgld", 1.0),
        "psgld-default-transform-T1": transform_case(
            transforms.psgld, 1.0, preconditioner_warmup=WARMUP
        ),
        "sghmc-optimizer-T1-gradscaler": optimizer_case(
            "sghmc", 1.0, dtype=torch.float32, scaler=True
        ),
        "adamw_sghmc-optimizer-T1-gradscaler": optimizer_case(
            "adamw_sghmc", 1.0, dtype=torch.float32, scaler=True
        ),
        "sghmc-optimizer-T1-bfloat16": optimizer_case("sghmc", 1.0, dtype=torch.bfloat16),
        "psgld-optimizer-T1-skip": optimizer_case("psgld", 1.0, nan=True, nonfinite="skip"),
        "adamw_sghmc-optimizer-T1-skip": optimizer_case(
            "adamw_sghmc", 1.0, nan=True, nonfinite="skip"
        ),
    }
    for sampler in SAMPLERS:
        cases[f"fused-{sampler}-T1-float32"] = optimizer_case(
            sampler, 1.0, dtype=torch.float32, fused=True
        )
        cases[f"fused-{sampler}-T1-float64"] = optimizer_case(sampler, 1.0, fused=True)
    cases["fused-sghmc-T1-gradscaler"] = optimizer_case(
        "sghmc", 1.0, dtype=torch.float32, scaler=True, fused=True
    )
    cases["fused-adamw_sghmc-T1-gradscaler"] = optimizer_case(
        "adamw_sghmc", 1.0, dtype=torch.float32, scaler=True, fused=True
    )
    cases["fused-sghmc-T1-bfloat16"] = optimizer_case(
        "sghmc", 1.0, dtype=torch.bfloat16, fused=True
    )
    cases["fused-psgld-T1-skip"] = optimizer_case(
        "psgld", 1.0, dtype=torch.float32, nan=True, nonfinite="skip", fused=True
    )
    cases["fused-sghmc-transform-T1"] = transform_case(
        transforms.sghmc, 1.0, momentum=0.9, fused=True
    )
    return cases


#: case name -> a function returning the record
PIPELINE_CASES = _cases()
#: the cases that need Triton (its interpreter on the CPU)
FUSED = tuple(name for name in PIPELINE_CASES if name.startswith("fused-"))


@contextmanager
def fused_on_this_device() -> Iterator[None]:
    """On the CPU, let the fused path take CPU tensors under Triton's interpreter."""
    from samplers_as_optim.sgmcmc import fused

    previous = fused.RUN_ON_CPU_UNDER_INTERPRETER
    fused.RUN_ON_CPU_UNDER_INTERPRETER = not CUDA
    try:
        yield
    finally:
        fused.RUN_ON_CPU_UNDER_INTERPRETER = previous


def run_pipeline_case(name: str, global_seed: int) -> dict[str, list[float]]:
    """A case's record; only a fused case may take the fused path (``fused=None`` would
    take it too on CPU tensors while the interpreter's switch is on)."""
    if name not in FUSED:
        return with_global_seed(global_seed, PIPELINE_CASES[name])
    with fused_on_this_device():
        return with_global_seed(global_seed, PIPELINE_CASES[name])
