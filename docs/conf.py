"""Sphinx configuration: guide pages in Markdown (MyST), API reference from the package.

The API reference is written at build time from ``samplers_as_optim.__all__`` and the list
of public modules (every module whose dotted name has no component starting with ``_``),
so a new export or module appears without editing the docs. Each object is documented
once, where users import it from: the top-level package first, then the modules it lists
in ``__all__`` (``transforms``, ``predictive``, ``diagnostics``, ...), then the other
public modules in alphabetical order.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import shutil
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import samplers_as_optim  # noqa: E402

project = "samplers_as_optim"
author = "the samplers_as_optim authors"
copyright = "2026, the samplers_as_optim authors"
release = samplers_as_optim.__version__
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
    "myst_parser",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]
myst_enable_extensions = ["dollarmath", "deflist"]
myst_heading_anchors = 3

html_theme = "furo"
html_title = f"samplers_as_optim {release}"

napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_use_ivar = True  # "Attributes:" as fields, not a second description of each
autodoc_typehints = "signature"
autodoc_member_order = "bysource"
autodoc_class_signature = "mixed"
autodoc_default_options = {"show-inheritance": True}
# the docs build without network: no intersphinx; references to torch's types stay text
nitpicky = False

# Base classes whose own members are not repeated on every subclass page.
FOREIGN_BASES = "Optimizer, Module, tuple, object, int, Exception, ValueError, TypeError"


def public_modules(package: ModuleType) -> list[str]:
    """Every public module of the package, by dotted name (none with a ``_`` component)."""
    names = [package.__name__]
    for info in pkgutil.walk_packages(package.__path__, prefix=package.__name__ + "."):
        if not any(part.startswith("_") for part in info.name.split(".")):
            names.append(info.name)
    return names


def documented_names(module: ModuleType) -> list[str]:
    """The classes and functions a module offers: its ``__all__``, else what it defines."""
    names = getattr(module, "__all__", None)
    if names is None:
        names = [
            name
            for name, obj in vars(module).items()
            if not name.startswith("_") and getattr(obj, "__module__", None) == module.__name__
        ]
    return [
        name
        for name in names
        if inspect.isclass(getattr(module, name, None))
        or inspect.isfunction(getattr(module, name, None))
    ]


def directive(qualified: str, obj: Any) -> str:
    """The autodoc directive for one class or function."""
    if inspect.isclass(obj):
        return f".. autoclass:: {qualified}\n   :members:\n   :inherited-members: {FOREIGN_BASES}\n"
    return f".. autofunction:: {qualified}\n"


def write_api_pages(app: Any) -> None:
    """Write ``api/generated/*.rst`` from the package (run before Sphinx reads sources)."""
    out = Path(app.srcdir) / "api" / "generated"
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    package = samplers_as_optim
    modules = public_modules(package)
    listed = [
        f"{package.__name__}.{n}" for n in package.__all__ if f"{package.__name__}.{n}" in modules
    ]
    order = [package.__name__, *listed, *sorted(m for m in modules[1:] if m not in listed)]
    seen: set[int] = set()
    pages = []
    for name in order:
        module = importlib.import_module(name)
        members = []
        for member in documented_names(module):
            obj = getattr(module, member)
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            members.append(directive(f"{name}.{member}", obj))
        title = f"``{name}``"
        body = [title, "=" * len(title), "", f".. automodule:: {name}", "   :no-members:", ""]
        if members:
            body += ["", *members]
        (out / f"{name}.rst").write_text("\n".join(body) + "\n")
        pages.append(name)
    toc = ["API reference", "=============", "", ".. toctree::", "   :maxdepth: 1", ""]
    toc += [f"   {page}" for page in pages]
    (out / "index.rst").write_text("\n".join(toc) + "\n")


def setup(app: Any) -> None:
    """Generate the API pages before the sources are read."""
    app.connect("builder-inited", write_api_pages)
