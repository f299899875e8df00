"""The registry of samplers under test, crossed with properties by the test modules.

Each entry names an Optimizer class, the keyword arguments that make it a sampler with
momentum (or not), and whether it reduces to SGD at temperature 0 (BAOA reduces to SGD
with another ``lr``, up to rounding: ``tests/test_baoa.py``).
"""

from dataclasses import dataclass, field
from typing import Any

from samplers_as_optim import BAOA, PSGLD, SGHMC, SGLD, SGNHT, AdamWSGHMC


@dataclass(frozen=True)
class SamplerCase:
    name: str
    cls: type
    kwargs: dict[str, Any] = field(default_factory=dict)
    sgd_at_zero: bool = True

    def __repr__(self) -> str:
        return self.name


SAMPLERS = [
    SamplerCase("sgld", SGLD),
    SamplerCase("sghmc", SGHMC, {"momentum": 0.9}),
    SamplerCase("sgnht", SGNHT, {"momentum": 0.9}, sgd_at_zero=False),
    SamplerCase("baoa", BAOA, {"momentum": 0.9}, sgd_at_zero=False),
]
#: Samplers whose signature is not ``torch.optim.SGD``'s (PSGLD: RMSprop's, whose
#: ``momentum`` is temperature 0 only; AdamWSGHMC: AdamW's): the generic tests above assume
#: SGD's, so ``tests/test_psgld.py`` runs the ones that apply over these.
OTHER_SIGNATURES = [
    SamplerCase("psgld", PSGLD, {"alpha": 0.99}, sgd_at_zero=False),
    SamplerCase("adamw_sghmc", AdamWSGHMC, {"betas": (0.9, 0.999)}, sgd_at_zero=False),
]
SGD_LIKE = [case for case in SAMPLERS if case.sgd_at_zero]
