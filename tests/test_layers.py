"""The package's imports against its declared layers (``docs/design.md``, "Layout").

Every import of the package's own modules is read from the source (function-local ones
too, which hide cycles from an import-time check), and the test fails on:

- a cycle between modules;
- an import from a lower layer to a higher one (a module may import its own layer and
  the layers below);
- a private module (``_name.py``) imported from outside the package folder that holds it;
- a module that no layer declares (a new module must be placed in a layer).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "samplers_as_optim"
PACKAGE = "samplers_as_optim"

#: bottom first; a module belongs to the first entry whose name it is or starts
#: (``samplers`` covers ``samplers.sghmc``); keep in step with docs/design.md
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "the chain core: validation, keyed noise, names, process groups; the model's "
        "likelihoods and priors, which rest on validation only",
        ("core", "names", "regression", "priors"),
    ),
    ("the SG-MCMC family and the cyclical schedule", ("sgmcmc",)),
    ("Hamiltonian Monte Carlo", ("hmc",)),
    (
        "samples and what uses them",
        ("samples", "predictive", "_predictive_checks", "_predictive_regression", "diagnostics"),
    ),
    ("Gaussian approximations and their curvature", ("gaussian", "curvature")),
    ("the public faces", ("transforms", "__init__")),
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(ROOT.rglob("*.py"))}


def package_of(name: str, path: Path) -> list[str]:
    """The package a module's relative imports start from (as name parts)."""
    parts = name.split(".") if name != "__init__" else []
    return parts if path.name == "__init__.py" else parts[:-1]


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules that ``name`` imports (any depth of the syntax tree)."""
    found: set[str] = set()
    base = package_of(name, path)
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base[: len(base) - (node.level - 1)]
                target = [*anchor, *(node.module.split(".") if node.module else [])]
            elif node.module and node.module.split(".")[0] == PACKAGE:
                target = node.module.split(".")[1:]
            else:
                continue
            dotted = ".".join(target)
            for alias in node.names:  # ``from . import x`` imports the module x
                candidate = f"{dotted}.{alias.name}" if dotted else alias.name
                if candidate in known:
                    found.add(candidate)
                    break
            else:
                found.add(dotted or "__init__")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == PACKAGE:
                    found.add(".".join(parts[1:]) or "__init__")
    found.discard(name)
    return {target for target in found if target in known or target == "__init__"}


def layer_of(name: str) -> int | None:
    for index, (_, members) in enumerate(LAYERS):
        for member in members:
            if name == member or name.startswith(member + "."):
                return index
    return None


GRAPH = {name: imports(name, path, set(modules())) for name, path in modules().items()}


def test_every_module_has_a_layer():
    assert [name for name in GRAPH if layer_of(name) is None] == []


def test_no_import_runs_from_a_lower_layer_to_a_higher_one():
    upward = [
        f"{name} (layer {layer_of(name)}) -> {target} (layer {layer_of(target)})"
        for name, targets in GRAPH.items()
        for target in targets
        if (layer_of(target) or 0) > (layer_of(name) or 0)
    ]
    assert upward == []


def test_no_import_cycle():
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(name: str) -> None:
        state[name] = 1
        path.append(name)
        for target in sorted(GRAPH.get(name, ())):
            if state.get(target) == 1:
                cycle = [*path[path.index(target) :], target]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target)
        path.pop()
        state[name] = 2

    for name in sorted(GRAPH):
        if name not in state:
            visit(name)


def test_private_modules_are_imported_only_inside_their_package():
    outside = []
    for name, targets in GRAPH.items():
        for target in targets:
            *folder, leaf = target.split(".")
            private = leaf.startswith("_") and leaf != "__init__"
            if private and name.split(".")[: len(folder)] != folder:
                outside.append(f"{name} -> {target}")
    assert outside == []


def test_the_walk_sees_the_imports():
    """The reader is not vacuous: known edges, function-local ones included."""
    assert "core.noise_op" in GRAPH["core.streams"]
    assert "hmc.dynamics" in GRAPH["hmc._functional"]  # ``from . import dynamics``
    assert "hmc._functional" in GRAPH["hmc.sampler"]  # a function-local import
    assert "sgmcmc.transform" in GRAPH["transforms"]
    assert "samples.stacked" in GRAPH["gaussian._weight_gaussian"]
    assert sum(len(targets) for targets in GRAPH.values()) > 60


def test_the_design_document_names_every_module():
    """docs/design.md's layout names each module by its path (``sgmcmc/sgld``)."""
    design = (ROOT.parent / "docs" / "design.md").read_text()
    missing = [
        name
        for name in GRAPH
        if name != "__init__"
        and f"`{name}/`" not in design  # a package (``core/``)
        and f"`{name.replace('.', '/')}`" not in design
    ]
    assert missing == []
