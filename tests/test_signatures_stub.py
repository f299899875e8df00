"""The samplers' signatures for type checkers, generated from their definitions.

A sampler's constructor and its transformation factory are compiled at import from its
``SamplerDefinition`` (``docs/design.md``), which a static type checker (mypy, pyright)
does not run. ``samplers_as_optim/_signatures.pyi`` states them for it, and the public
faces (``__init__``, ``transforms``) import from it under ``TYPE_CHECKING``. The stub is
generated from the registry, never written by hand: this test fails when it differs from
what the definitions give. Regenerate it with::

    python tests/test_signatures_stub.py --write
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Any

from samplers_as_optim.sgmcmc import SAMPLERS
from samplers_as_optim.sgmcmc.definition import REQUIRED, Hyperparameter

STUB = Path(__file__).resolve().parents[1] / "samplers_as_optim" / "_signatures.pyi"

HEADER = '''"""The samplers' signatures for type checkers; generated, do not edit.

Each SG-MCMC sampler's constructor and transformation are compiled at import from its
definition (``docs/design.md``); this stub states them for static type checkers.
Regenerate with ``python tests/test_signatures_stub.py --write``.
"""

from typing import Any, NamedTuple

from torch import Tensor
from torchopt.base import GradientTransformation

from .sgmcmc.optimizer import SamplerOptimizer
from .sgmcmc.transformation import ScalarOrSchedule
'''


def _parameter(name: str, annotation: str, default: Any) -> str:
    return f"{name}: {annotation}" if default is REQUIRED else f"{name}: {annotation} = {default!r}"


def _signature(parameters: list[tuple[str, str, Any, bool]]) -> str:
    pieces: list[str] = []
    star = False
    for name, annotation, default, positional in parameters:
        if not positional and not star:
            pieces.append("*")
            star = True
        pieces.append(_parameter(name, annotation, default))
    return ", ".join(pieces)


def _optimizer(cls: Any) -> str:
    hyperparameters: tuple[Hyperparameter, ...] = cls.definition.hyperparameters
    parameters = [("params", "Any", REQUIRED, True)] + [
        (h.name, h.annotation, h.default, h.positional) for h in hyperparameters
    ]
    return (
        f"class {cls.__name__}(SamplerOptimizer):\n"
        f"    def __init__(self, {_signature(parameters)}) -> None: ...\n"
    )


def _transformation(cls: Any) -> str:
    definition = cls.definition
    declared = [h for h in definition.hyperparameters if h.transform]
    parameters = [
        (
            h.name,
            h.transform_annotation or h.annotation,
            h.default_in_transform(),
            h.positional if h.transform_positional is None else h.transform_positional,
        )
        for h in declared
    ]
    parameters = [p for p in parameters if p[3]] + [p for p in parameters if not p[3]]
    fields = [state.name for state in definition.state]
    if definition.momentum_in_lr_units:
        fields.append("momentum_lr")
    body = "".join(f"    {name}: tuple[Any, ...]\n" for name in fields)
    return (
        f"class {definition.name}State(NamedTuple):\n{body}    seed: int\n"
        "    count: int  # type: ignore[assignment]  # a field, as optax's states have\n\n"
        f"def {definition.transform_name}({_signature(parameters)}) -> GradientTransformation:"
        " ...\n"
    )


def stub_source() -> str:
    parts = [HEADER]
    for cls in SAMPLERS:
        parts.append(_optimizer(cls))
    for cls in SAMPLERS:
        parts.append(_transformation(cls))
    return "\n".join(parts)


def test_the_stub_is_what_the_definitions_give():
    assert STUB.read_text() == stub_source(), (
        "samplers_as_optim/_signatures.pyi is stale: python tests/test_signatures_stub.py --write"
    )


def _stub_imports(path: Path) -> set[str]:
    """The names a module imports from ``._signatures`` (under ``TYPE_CHECKING``)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "_signatures" and node.level == 1:
            names.update(alias.name for alias in node.names)
    return names


def test_the_public_faces_type_check_against_the_stub():
    """Under TYPE_CHECKING the public names come from the stub, at runtime from sgmcmc."""
    assert _stub_imports(STUB.parent / "__init__.py") == {cls.__name__ for cls in SAMPLERS}
    expected = set()
    for cls in SAMPLERS:
        expected |= {cls.definition.transform_name, f"{cls.definition.name}State"}
    assert _stub_imports(STUB.parent / "transforms.py") == expected


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        STUB.write_text(stub_source())
        print(f"wrote {STUB}")
    else:
        print(stub_source())
