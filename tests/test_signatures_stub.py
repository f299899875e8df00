"""The samplers' signatures for type checkers, generated from their definitions.

A sampler's constructor and its transformation factory are compiled at import from its
``SamplerDefinition`` (``docs/design.md``), which a static type checker (mypy, pyright)
does not run. The stub is written from their runtime signatures. ``samplers_as_optim/_signatures.pyi`` states them for it, and the public
faces (``__init__``, ``transforms``) import from it under ``TYPE_CHECKING``. The stub is
generated from the registry, never written by hand: this test fails when it differs from
what the definitions give. Regenerate it with::

    python tests/test_signatures_stub.py --write
"""

from __future__ import annotations

import ast
import inspect
import sys
from pathlib import Path
from typing import Any

from samplers_as_optim import transforms
from samplers_as_optim.sgmcmc import SAMPLERS

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
from .sgmcmc.transform import ScalarOrSchedule
'''


def _signature(function: Any, *, skip_self: bool = False) -> str:
    """The runtime signature of a generated function, written as a stub's parameters."""
    pieces: list[str] = []
    star = False
    parameters = list(inspect.signature(function).parameters.values())
    for parameter in parameters[1:] if skip_self else parameters:
        if parameter.kind is parameter.KEYWORD_ONLY and not star:
            pieces.append("*")
            star = True
        text = f"{parameter.name}: {parameter.annotation}"
        if parameter.default is not parameter.empty:
            text += f" = {parameter.default!r}"
        pieces.append(text)
    return ", ".join(pieces)


def _optimizer(cls: Any) -> str:
    signature = _signature(cls.__init__, skip_self=True)
    return (
        f"class {cls.__name__}(SamplerOptimizer):\n"
        f"    def __init__(self, {signature}) -> None: ...\n"
    )


def _transformation(cls: Any) -> str:
    definition = cls.definition
    factory = getattr(transforms, definition.transform_name)
    state = getattr(transforms, f"{definition.name}State")
    body = "".join(f"    {name}: tuple[Any, ...]\n" for name in state._fields[:-2])
    return (
        f"class {definition.name}State(NamedTuple):\n{body}    seed: int\n"
        "    count: int  # type: ignore[assignment]  # a field, as optax's states have\n\n"
        f"def {definition.transform_name}({_signature(factory)}) -> GradientTransformation:"
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
