"""The samplers' signatures for type checkers; generated, do not edit.

Each SG-MCMC sampler's constructor and transformation are compiled at import from its
definition (``docs/design.md``); this stub states them for static type checkers.
Regenerate with ``python tests/test_signatures_stub.py --write``.
"""

from typing import Any, NamedTuple

from torch import Tensor
from torchopt.base import GradientTransformation

from .sgmcmc.optimizer import SamplerOptimizer
from .sgmcmc.transform import ScalarOrSchedule

class SGLD(SamplerOptimizer):
    def __init__(self, params: Any, lr: float | Tensor = 0.001, momentum: float = 0.0, *, num_data: int, temperature: float = 1.0, weight_decay: float = 0.0, dampening: float = 0.0, nesterov: bool = False, maximize: bool = False, foreach: bool | None = None, differentiable: bool = False, fused: bool | None = None, seed: int | None = None, overlap_noise: bool = True, nonfinite: str = 'raise', capturable: bool = False) -> None: ...

class SGHMC(SamplerOptimizer):
    def __init__(self, params: Any, lr: float | Tensor = 0.001, momentum: float = 0.9, *, num_data: int, temperature: float = 1.0, weight_decay: float = 0.0, dampening: float = 0.0, nesterov: bool = False, maximize: bool = False, foreach: bool | None = None, differentiable: bool = False, fused: bool | None = None, seed: int | None = None, overlap_noise: bool = True, nonfinite: str = 'raise', capturable: bool = False) -> None: ...

class SGNHT(SamplerOptimizer):
    def __init__(self, params: Any, lr: float | Tensor = 0.001, momentum: float = 0.9, *, num_data: int, temperature: float = 1.0, weight_decay: float = 0.0, dampening: float = 0.0, nesterov: bool = False, maximize: bool = False, foreach: bool | None = None, differentiable: bool = False, fused: bool | None = None, seed: int | None = None, overlap_noise: bool = True, nonfinite: str = 'raise', capturable: bool = False, kinetic_energy: str = 'symmetric') -> None: ...

class PSGLD(SamplerOptimizer):
    def __init__(self, params: Any, lr: float | Tensor = 0.01, alpha: float = 0.99, eps: float = 1e-08, weight_decay: float = 0.0, momentum: float = 0.0, centered: bool = False, capturable: bool = False, foreach: bool | None = None, maximize: bool = False, differentiable: bool = False, *, num_data: int, temperature: float = 1.0, preconditioner: str = 'factored', preconditioner_warmup: int | None = 1000, correction: bool = False, seed: int | None = None, overlap_noise: bool = True, nonfinite: str = 'raise', fused: bool | None = None) -> None: ...

class BAOA(SamplerOptimizer):
    def __init__(self, params: Any, lr: float | Tensor = 0.001, momentum: float = 0.9, *, num_data: int, temperature: float = 1.0, weight_decay: float = 0.0, dampening: float = 0.0, nesterov: bool = False, maximize: bool = False, foreach: bool | None = None, differentiable: bool = False, fused: bool | None = None, seed: int | None = None, overlap_noise: bool = True, nonfinite: str = 'raise', capturable: bool = False) -> None: ...

class AdamWSGHMC(SamplerOptimizer):
    def __init__(self, params: Any, lr: float | Tensor = 0.001, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-08, weight_decay: float = 0.01, amsgrad: bool = False, *, maximize: bool = False, foreach: bool | None = None, capturable: bool = False, differentiable: bool = False, fused: bool | None = None, num_data: int, temperature: float = 1.0, prior_weight_decay: float = 0.0, preconditioner: str = 'factored', preconditioner_warmup: int | None = 1000, seed: int | None = None, overlap_noise: bool = True, nonfinite: str = 'raise') -> None: ...

class SGLDState(NamedTuple):
    seed: int
    count: int  # type: ignore[assignment]  # a field, as optax's states have

def sgld(lr: ScalarOrSchedule, momentum: float = 0.0, *, num_data: int, temperature: ScalarOrSchedule = 1.0, weight_decay: float = 0.0, dampening: float = 0.0, nesterov: bool = False, maximize: bool = False, foreach: bool | None = None, fused: bool | None = None, seed: int | None = None) -> GradientTransformation: ...

class SGHMCState(NamedTuple):
    momentum_buffer: tuple[Any, ...]
    momentum_lr: tuple[Any, ...]
    seed: int
    count: int  # type: ignore[assignment]  # a field, as optax's states have

def sghmc(lr: ScalarOrSchedule, momentum: float = 0.9, *, num_data: int, temperature: ScalarOrSchedule = 1.0, weight_decay: float = 0.0, dampening: float = 0.0, nesterov: bool = False, maximize: bool = False, foreach: bool | None = None, fused: bool | None = None, seed: int | None = None) -> GradientTransformation: ...

class SGNHTState(NamedTuple):
    momentum_buffer: tuple[Any, ...]
    thermostat: tuple[Any, ...]
    momentum_lr: tuple[Any, ...]
    seed: int
    count: int  # type: ignore[assignment]  # a field, as optax's states have

def sgnht(lr: ScalarOrSchedule, momentum: float = 0.9, *, num_data: int, temperature: ScalarOrSchedule = 1.0, weight_decay: float = 0.0, dampening: float = 0.0, nesterov: bool = False, maximize: bool = False, foreach: bool | None = None, fused: bool | None = None, seed: int | None = None, kinetic_energy: str = 'symmetric') -> GradientTransformation: ...

class PSGLDState(NamedTuple):
    square_avg: tuple[Any, ...]
    momentum_buffer: tuple[Any, ...]
    grad_avg: tuple[Any, ...]
    previous_param: tuple[Any, ...]
    previous_grad: tuple[Any, ...]
    step: tuple[Any, ...]
    preconditioner: tuple[Any, ...]
    preconditioner_step: tuple[Any, ...]
    seed: int
    count: int  # type: ignore[assignment]  # a field, as optax's states have

def psgld(lr: ScalarOrSchedule, alpha: float = 0.99, eps: float = 1e-08, weight_decay: float = 0.0, momentum: float = 0.0, centered: bool = False, *, foreach: bool | None = None, maximize: bool = False, num_data: int, temperature: ScalarOrSchedule = 1.0, preconditioner: str = 'factored', preconditioner_warmup: int | None = 1000, correction: bool = False, seed: int | None = None, fused: bool | None = None) -> GradientTransformation: ...

class BAOAState(NamedTuple):
    momentum_buffer: tuple[Any, ...]
    momentum_lr: tuple[Any, ...]
    seed: int
    count: int  # type: ignore[assignment]  # a field, as optax's states have

def baoa(lr: ScalarOrSchedule, momentum: float = 0.9, *, num_data: int, temperature: ScalarOrSchedule = 1.0, weight_decay: float = 0.0, dampening: float = 0.0, nesterov: bool = False, maximize: bool = False, foreach: bool | None = None, fused: bool | None = None, seed: int | None = None) -> GradientTransformation: ...

class AdamWSGHMCState(NamedTuple):
    step: tuple[Any, ...]
    exp_avg: tuple[Any, ...]
    exp_avg_sq: tuple[Any, ...]
    max_exp_avg_sq: tuple[Any, ...]
    preconditioner: tuple[Any, ...]
    preconditioner_root: tuple[Any, ...]
    preconditioner_step: tuple[Any, ...]
    momentum_lr: tuple[Any, ...]
    seed: int
    count: int  # type: ignore[assignment]  # a field, as optax's states have

def adamw_sghmc(lr: ScalarOrSchedule, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-08, weight_decay: float = 0.01, amsgrad: bool = False, *, maximize: bool = False, foreach: bool | None = None, fused: bool | None = None, num_data: int, temperature: ScalarOrSchedule = 1.0, prior_weight_decay: float = 0.0, preconditioner: str = 'factored', preconditioner_warmup: int | None = 1000, seed: int | None = None) -> GradientTransformation: ...
