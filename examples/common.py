"""What the examples share: shipped datasets as tensors, a small MLP, a minibatch loop,
progress bars and a printed table. Everything runs offline on the CPU in seconds to
minutes; nothing here is part of the library.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from samplers_as_optim.core.progress import progress_bar

OUTPUT = Path(__file__).resolve().parent / "output"
QUICK_MODE_NOTE = "quick mode: shorter runs, not the documented full-mode figures"
# set by example_arguments from --quick: every printed table and figure title says so
_quick_mode = False


def output_path(name: str) -> Path:
    """Where an example writes its figures (``examples/output/``, created on demand)."""
    OUTPUT.mkdir(parents=True, exist_ok=True)
    return OUTPUT / name


def example_arguments(
    argv: list[str] | None,
    doc: str | None,
    *,
    quick: str,
    figure: str,
    parents: Sequence[argparse.ArgumentParser] = (),
) -> tuple[bool, int, Path]:
    """The examples' command line: ``--quick``, ``--seed`` and ``--output`` (the figure).

    ``parents``: an example's own options (parsers built with ``add_help=False``), shown
    by ``--help`` and accepted here; the example reads them with its parser's
    ``parse_known_args(argv)``.

    Returns:
        ``(quick, seed, figure_path)``, the path defaulting to ``examples/output/<figure>``.
    """
    parser = argparse.ArgumentParser(description=(doc or "").splitlines()[0], parents=list(parents))
    parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=None, help="the figure (PNG)")
    args = parser.parse_args(argv)
    global _quick_mode
    _quick_mode = args.quick
    if args.quick:
        print(f"[{QUICK_MODE_NOTE}]")
    return args.quick, args.seed, args.output or output_path(figure)


def figure_title(text: str) -> str:
    """A figure's title, marked as quick mode when the example runs with ``--quick``."""
    return f"{text}\n[{QUICK_MODE_NOTE}]" if _quick_mode else text


def digits(
    *, test_size: float = 0.3, seed: int = 0, classes: Sequence[int] | None = None
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """scikit-learn's handwritten digits (1797 8x8 images), scaled to [0, 1].

    Args:
        test_size: fraction held out, stratified by class.
        seed: the split's seed.
        classes: keep only these labels (relabelled 0..len-1 in the given order).

    Returns:
        ``x_train [n, 64], y_train [n], x_test, y_test`` as float32 / int64 tensors.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = x / 16.0
    if classes is not None:
        keep = [label in classes for label in y]
        x, y = x[keep], y[keep]
        relabel = {label: index for index, label in enumerate(classes)}
        y = [relabel[label] for label in y]
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=test_size, random_state=seed, stratify=y
    )
    return (
        torch.as_tensor(x_train, dtype=torch.float32),
        torch.as_tensor(y_train, dtype=torch.long),
        torch.as_tensor(x_test, dtype=torch.float32),
        torch.as_tensor(y_test, dtype=torch.long),
    )


def mlp(inputs: int = 64, hidden: Sequence[int] = (128,), outputs: int = 10, *, seed: int = 0):
    """A ReLU MLP with a fixed initialisation seed."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for width in hidden:
        layers += [nn.Linear(inputs, width), nn.ReLU()]
        inputs = width
    layers.append(nn.Linear(inputs, outputs))
    return nn.Sequential(*layers)


def minibatches(num_data: int, batch_size: int, generator: torch.Generator) -> Iterator[Tensor]:
    """Index tensors of one epoch, shuffled by ``generator``."""
    yield from torch.randperm(num_data, generator=generator).split(batch_size)


def member_minibatches(
    num_data: int, batch_size: int, num_members: int, generator: torch.Generator
) -> Iterator[Tensor]:
    """Index tensors ``[K, b]`` of one epoch, one shuffle per ensemble member.

    For a :class:`~samplers_as_optim.samples.ensemble.ParallelEnsemble` that sees the data in a
    different order per member: ``ensemble(x[index], per_member_inputs=True)``.
    """
    orders = [torch.randperm(num_data, generator=generator) for _ in range(num_members)]
    yield from torch.stack(orders).split(batch_size, dim=1)


@contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """Run the block with ``count`` intra-op threads, restoring the previous count after.

    Small models (a logistic regression, a one-hidden-layer MLP) spend their time in
    per-call overhead, which extra threads only add to; on a shared machine one thread is
    also several times faster than two fighting over a busy core.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def warm_up() -> None:
    """Pay torch's one-off start-up costs before timing anything.

    The first optimizer step in a process takes about a second (torch.optim loads its
    compiler hooks lazily); without this the first method timed would carry it. Draws no
    random numbers.
    """
    weight = torch.zeros(2, requires_grad=True)
    optimizer = torch.optim.SGD([weight], lr=0.0)
    weight.sum().backward()
    optimizer.step()


def progress(iterable: Iterable[Any], description: str) -> Iterable[Any]:
    """The library's progress bar (``samplers_as_optim.core.progress``), off in CI.

    A tqdm bar where stderr is a terminal and tqdm is installed, as ``progress=None`` of
    ``Laplace.fit`` or ``HMC.run``; CI's logs get none.
    """
    return progress_bar(iterable, False if os.environ.get("CI") else None, description)


def print_table(rows: Sequence[dict[str, Any]], columns: Sequence[str], title: str = "") -> str:
    """Print (and return) rows as an aligned plain-text table; floats with 4 digits."""

    def cell(value: Any) -> str:
        return f"{value:.4f}" if isinstance(value, float) else str(value)

    widths = [max(len(c), *(len(cell(r.get(c, ""))) for r in rows)) for c in columns]
    if _quick_mode:
        title = f"{title} [{QUICK_MODE_NOTE}]" if title else f"[{QUICK_MODE_NOTE}]"
    lines = [title] if title else []
    lines.append("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
    lines.append("  ".join("-" * w for w in widths))
    for row in rows:
        cells = (cell(row.get(c, "")).ljust(w) for c, w in zip(columns, widths, strict=True))
        lines.append("  ".join(cells))
    text = "\n".join(lines)
    print(text)
    return text
